#!/usr/bin/env bash
set -euo pipefail
cp config.ini config.bak
