#!/usr/bin/env bash
set -euo pipefail
echo 'keep it simple' > motto.txt
