"""The code's own rules, checked where the tests run (CI runs the README's pytest command):

- ``ruff format --check`` and ``ruff check`` (configured in pyproject.toml);
- the import-layer contracts (``lint-imports``; ``[tool.importlinter]`` in pyproject.toml): model < serving <
  proxy < trajectory < rl, rollout < runtime < elastic < config < sim < build < run, follower < train, and
  the scheduler (``gyre_jax.elastic``) never imports the modules that know where a cell runs.

Class and function sizes are a report, not a rule (``scripts/check_sizes.py``: the longest of each, printed;
cohesion decides where code lives): the last test runs it so that it keeps working, and never fails on a size.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from timelimits import scaled

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=scaled(300))


@pytest.mark.parametrize(
    "cmd",
    [
        ("ruff", "format", "--check", "."),
        ("ruff", "check", "."),
        ("lint-imports",),
    ],
    ids=["ruff-format", "ruff-check", "import-layers"],
)
def test_the_code_keeps_its_rules(cmd):
    proc = _run(str(BIN / cmd[0]), *cmd[1:])
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"


def test_the_size_report_lists_the_longest_classes_and_functions():
    proc = _run(sys.executable, "scripts/check_sizes.py", "--top", "3")
    print(proc.stdout)  # the report, in the test log (pytest -rP)
    assert proc.returncode == 0, proc.stderr[-2000:]
    heads = re.findall(
        r"^(\d+) (classes|functions) in gyre_jax/ \(median \d+ lines\); the 3 longest:$", proc.stdout, re.M
    )
    assert [kind for _, kind in heads] == ["classes", "functions"] and all(int(n) > 100 for n, _ in heads), proc.stdout
    rows = re.findall(r"^ +(\d+)  gyre_jax/\S+\.py:\d+ \w+$", proc.stdout, re.M)
    assert len(rows) == 6, proc.stdout
    classes, functions = [int(n) for n in rows[:3]], [int(n) for n in rows[3:]]
    assert classes == sorted(classes, reverse=True) and functions == sorted(functions, reverse=True)
