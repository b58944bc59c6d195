#!/usr/bin/env bash
# Class: module shadowing through the working directory (the runner). A pytest.py in the workspace that writes a
# junit report with every test passed, reward files, and exits 0 (the issue's second case).
cat > pytest.py <<'PY'
import os, sys
logs = os.environ.get("GYRE_LOGS", "/logs") + "/verifier"
os.makedirs(logs, exist_ok=True)
open(logs + "/junit.xml", "w").write('<testsuite tests="11" failures="0" errors="0" skipped="0"></testsuite>')
open(logs + "/reward.txt", "w").write("1.0\n")
sys.exit(0)
PY
mkdir -p _pytest pluggy && cp pytest.py _pytest/__init__.py && cp pytest.py pluggy/__init__.py
