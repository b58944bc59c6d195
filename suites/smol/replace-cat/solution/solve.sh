#!/usr/bin/env bash
set -euo pipefail
sed -i 's/cat/dog/' message.txt
