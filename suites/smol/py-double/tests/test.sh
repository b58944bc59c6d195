#!/usr/bin/env bash
# Harbor verifier: runs the hidden tests against the final workspace; reward = fraction of the tests listed in
# expected_tests.txt that passed. gyre-jax's trusted driver (its verifier kit, GYRE_VERIFIER) runs pytest in a
# child process and writes the reward itself once everything that child started is dead; pytest missing is
# "could not run" (unavailable.txt: the execution is excluded), never a 0. Paths are Harbor's (/app, /tests,
# /logs) inside a sandbox; GYRE_* give them when run without one.
set -u
TESTS="${GYRE_TESTS:-/tests}"
LOGS="${GYRE_LOGS:-/logs}"
if [ -z "${GYRE_VERIFIER:-}" ]; then
  mkdir -p "$LOGS/verifier"
  echo "this verifier needs gyre-jax's verifier kit (GYRE_VERIFIER is not set)" | tee "$LOGS/verifier/unavailable.txt" >&2
  exit 3
fi
cd "${GYRE_WORKSPACE:-/app}" || exit 3
exec python3 -I "$GYRE_VERIFIER/run_pytest.py" --tests "$TESTS" --workspace "$PWD" --logs "$LOGS/verifier" \
  --expected "$TESTS/expected_tests.txt"
