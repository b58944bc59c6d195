#!/usr/bin/env bash
set -euo pipefail
echo 'hello world' > hello.txt
