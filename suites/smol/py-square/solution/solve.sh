#!/usr/bin/env bash
set -euo pipefail
printf 'def square(x):\n    return x * x\n' > square.py
