"""Runs the agent's test_bounded_stack.py against the reference implementation and each mutant."""

import functools
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

HERE = pathlib.Path(__file__).resolve().parent
MUTANTS = sorted(p.stem for p in (HERE / "mutants").glob("*.py"))
TEST_FILE = "test_bounded_stack.py"


@functools.cache
def run_against(impl):
    """Exit status and output of the agent's tests run next to `impl` (a path to a bounded_stack.py)."""
    src = pathlib.Path(os.getcwd()) / TEST_FILE
    if not src.is_file():
        return None, f"{TEST_FILE} not found in the workspace"
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(src, pathlib.Path(d) / TEST_FILE)
        shutil.copy(impl, pathlib.Path(d) / "bounded_stack.py")
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
        try:
            r = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", TEST_FILE],
                cwd=d,
                capture_output=True,
                text=True,
                timeout=120,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return None, "timed out"
        return r.returncode, r.stdout[-3000:] + r.stderr[-2000:]


def test_passes_on_correct_implementation():
    rc, out = run_against(str(HERE / "reference" / "bounded_stack.py"))
    assert rc == 0, out


@pytest.mark.parametrize("mutant", MUTANTS)
def test_kills_mutant(mutant):
    rc_ref, out_ref = run_against(str(HERE / "reference" / "bounded_stack.py"))
    assert rc_ref == 0, "the tests must first pass on the correct implementation:\n" + out_ref
    rc, out = run_against(str(HERE / "mutants" / f"{mutant}.py"))
    assert rc == 1, f"mutant {mutant} survived (exit {rc}):\n{out}"
