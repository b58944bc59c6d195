#!/usr/bin/env bash
set -euo pipefail
sed -i 's/Helo/Hello/' title.txt
