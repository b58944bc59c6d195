#!/usr/bin/env bash
set -euo pipefail
mv draft.txt final.txt
