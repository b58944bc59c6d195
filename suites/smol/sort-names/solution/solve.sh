#!/usr/bin/env bash
set -euo pipefail
sort names.txt > sorted.txt
