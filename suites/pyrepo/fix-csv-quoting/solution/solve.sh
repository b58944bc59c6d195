#!/usr/bin/env bash
set -euo pipefail
SOL="$(cd "$(dirname "$0")" && pwd)"
cp "$SOL/writer.py" "$SOL/reader.py" csvlite/
