#!/usr/bin/env bash
set -euo pipefail
echo 'print("Hello, World!")' > hello.py
