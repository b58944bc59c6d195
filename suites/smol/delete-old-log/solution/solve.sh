#!/usr/bin/env bash
set -euo pipefail
rm old.log
