#!/usr/bin/env bash
set -euo pipefail
SOL="$(cd "$(dirname "$0")" && pwd)"
cp "$SOL/inventory/models.py" "$SOL/inventory/store.py" "$SOL/inventory/report.py" inventory/
