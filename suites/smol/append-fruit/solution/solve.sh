#!/usr/bin/env bash
set -euo pipefail
echo 'banana' >> fruits.txt
