#!/usr/bin/env bash
set -euo pipefail
mv notes.txt archive/notes.txt
