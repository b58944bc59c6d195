#!/usr/bin/env bash
set -euo pipefail
SOL="$(cd "$(dirname "$0")" && pwd)"
mkdir -p todo
cp "$SOL"/todo/*.py todo/
