#!/usr/bin/env bash
set -euo pipefail
echo 'Paris' >> cities.txt
