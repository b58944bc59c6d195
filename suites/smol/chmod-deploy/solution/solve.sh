#!/usr/bin/env bash
set -euo pipefail
chmod +x deploy.sh
