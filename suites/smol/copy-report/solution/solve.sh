#!/usr/bin/env bash
set -euo pipefail
cp report.txt backup/report.txt
