#!/usr/bin/env bash
set -euo pipefail
wc -w < words.txt > answer.txt
