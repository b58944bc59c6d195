#!/usr/bin/env bash
set -euo pipefail
tail -n 1 story.txt > last.txt
