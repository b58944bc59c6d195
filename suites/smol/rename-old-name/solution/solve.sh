#!/usr/bin/env bash
set -euo pipefail
mv old_name.txt new_name.txt
