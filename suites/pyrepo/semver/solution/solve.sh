#!/usr/bin/env bash
set -euo pipefail
SOL="$(cd "$(dirname "$0")" && pwd)"
cp "$SOL/semver.py" semver.py
