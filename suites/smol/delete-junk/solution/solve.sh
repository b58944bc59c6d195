#!/usr/bin/env bash
set -euo pipefail
rm junk.tmp
