#!/usr/bin/env bash
set -euo pipefail
SOL="$(cd "$(dirname "$0")" && pwd)"
mkdir -p scheduler
cp "$SOL"/scheduler/*.py scheduler/
