"""Runs the agent's test_slugify.py against the reference slugify.py and against mutants.

The reference must pass; every mutant must be caught (the agent's tests fail on it) while the same tests pass
on the reference. All runs happen in one subprocess (run_impls.py) to keep the check fast.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MUTANTS = sorted(p.stem for p in (HERE / "impls").glob("mut_*.py"))
AGENT_TESTS = Path(os.getcwd()) / "test_slugify.py"


@pytest.fixture(scope="session")
def results(tmp_path_factory):
    if not AGENT_TESTS.is_file():
        pytest.fail("test_slugify.py was not written in the workspace")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "run_impls.py"),
            str(AGENT_TESTS),
            str(HERE / "impls"),
            str(tmp_path_factory.mktemp("runs")),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"running the tests failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_agent_tests_pass_on_reference(results):
    ref = results["reference"]
    assert ref["rc"] == 0, f"the tests must pass on the correct slugify.py:\n{ref['out']}"


@pytest.mark.parametrize("mutant", MUTANTS)
def test_mutant_is_caught(mutant, results):
    assert results["reference"]["rc"] == 0, "the tests fail on the correct slugify.py, so they catch nothing"
    run = results[mutant]
    assert run["rc"] == 1, f"{mutant} was not caught (pytest exit {run['rc']}):\n{run['out']}"
