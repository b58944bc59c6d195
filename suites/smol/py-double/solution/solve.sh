#!/usr/bin/env bash
set -euo pipefail
printf 'def double(x):\n    return 2 * x\n' > double.py
