#!/usr/bin/env bash
set -euo pipefail
wc -l < names.txt > lines.txt
