#!/usr/bin/env bash
set -euo pipefail
SOL="$(cd "$(dirname "$0")" && pwd)"
mkdir -p intervals
cp "$SOL/intervals/__init__.py" "$SOL/intervals/__main__.py" intervals/
