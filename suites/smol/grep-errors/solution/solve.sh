#!/usr/bin/env bash
set -euo pipefail
grep ERROR app.log > errors.txt
