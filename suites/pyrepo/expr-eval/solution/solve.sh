#!/usr/bin/env bash
set -euo pipefail
SOL="$(cd "$(dirname "$0")" && pwd)"
mkdir -p calc
cp "$SOL"/calc/*.py calc/
