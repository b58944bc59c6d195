#!/usr/bin/env bash
set -euo pipefail
SOL="$(cd "$(dirname "$0")" && pwd)"
cp "$SOL/test_slugify.py" test_slugify.py
