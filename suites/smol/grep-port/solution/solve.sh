#!/usr/bin/env bash
set -euo pipefail
grep port= settings.conf | cut -d= -f2 > port.txt
