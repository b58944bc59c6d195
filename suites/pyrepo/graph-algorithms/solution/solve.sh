#!/usr/bin/env bash
set -euo pipefail
SOL="$(cd "$(dirname "$0")" && pwd)"
mkdir -p graphs
cp "$SOL"/graphs/*.py graphs/
