#!/usr/bin/env bash
set -euo pipefail
cp data.csv data_copy.csv
