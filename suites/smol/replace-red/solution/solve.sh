#!/usr/bin/env bash
set -euo pipefail
sed -i 's/red/green/' note.txt
