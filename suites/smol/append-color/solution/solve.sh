#!/usr/bin/env bash
set -euo pipefail
echo 'blue' >> colors.txt
