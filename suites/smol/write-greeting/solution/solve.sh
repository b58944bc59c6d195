#!/usr/bin/env bash
set -euo pipefail
echo 'good morning' > greeting.txt
