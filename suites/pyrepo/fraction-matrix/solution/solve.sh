#!/usr/bin/env bash
set -euo pipefail
SOL="$(cd "$(dirname "$0")" && pwd)"
cp "$SOL/matrix.py" matrix.py
