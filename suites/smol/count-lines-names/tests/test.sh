#!/usr/bin/env bash
# Harbor verifier: runs the hidden tests against the final workspace; reward = fraction of tests passed.
# Paths are Harbor's (/app, /tests, /logs) inside a sandbox; GYRE_* give them when run without one.
set -u
TESTS="${GYRE_TESTS:-/tests}"
LOGS="${GYRE_LOGS:-/logs}"
cd "${GYRE_WORKSPACE:-/app}"
mkdir -p "$LOGS/verifier"
export PYTHONDONTWRITEBYTECODE=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1  # no third-party plugins: 4x faster start
python3 -m pytest -q -p no:cacheprovider --rootdir="$TESTS" --junitxml="$LOGS/verifier/junit.xml" "$TESTS" \
  > "$LOGS/verifier/pytest.log" 2>&1
python3 - "$LOGS/verifier/junit.xml" > "$LOGS/verifier/reward.txt" <<'EOF'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print(0.0)
    raise SystemExit
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
total = sum(int(s.get("tests", 0)) for s in suites)
bad = sum(int(s.get(k, 0)) for s in suites for k in ("failures", "errors", "skipped"))
print(round((total - bad) / total, 4) if total else 0.0)
EOF
