#!/usr/bin/env bash
set -euo pipefail
grep WARN server.log > warnings.txt
