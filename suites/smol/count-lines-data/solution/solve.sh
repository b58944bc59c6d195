#!/usr/bin/env bash
set -euo pipefail
wc -l < data.txt > count.txt
