"""The code's own rules, checked where the tests run (CI runs the README's pytest command):

- ``ruff format --check`` and ``ruff check`` (configured in pyproject.toml);
- the import-layer contracts (``lint-imports``; ``[tool.importlinter]`` in pyproject.toml): model < serving <
  proxy < trajectory < rl, rollout < runtime < elastic < config < sim < build < run, follower < train, and
  the scheduler (``gyre_jax.elastic``) never imports the modules that know where a cell runs;
- class and function sizes in ``gyre_jax/`` (``scripts/check_sizes.py``: classes <= 300 lines, functions
  <= 60).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "cmd",
    [
        ("ruff", "format", "--check", "."),
        ("ruff", "check", "."),
        ("lint-imports",),
        (sys.executable, "scripts/check_sizes.py"),
    ],
    ids=["ruff-format", "ruff-check", "import-layers", "sizes"],
)
def test_the_code_keeps_its_rules(cmd):
    exe = cmd[0] if cmd[0] == sys.executable else str(BIN / cmd[0])
    proc = _run(exe, *cmd[1:])
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
