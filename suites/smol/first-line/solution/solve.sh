#!/usr/bin/env bash
set -euo pipefail
head -n 1 poem.txt > first.txt
