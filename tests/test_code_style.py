"""The code's own rules, checked where the tests run (CI runs the README's pytest command):

- ``ruff format --check`` and ``ruff check`` (configured in pyproject.toml);
- the import-layer contracts (``lint-imports``; ``[tool.importlinter]`` in pyproject.toml): model < serving <
  proxy < trajectory < rl, rollout < runtime < elastic < config < sim < build < run, follower < train, and
  the scheduler (``gyre_jax.elastic``) never imports the modules that know where a cell runs.

Class and function sizes are a report, not a rule (``scripts/check_sizes.py``: the longest of each, printed;
cohesion decides where code lives): the last test runs it so that it keeps working, and never fails on a size.
"""

from __future__ import annotations

import ast
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


def _private_jax_uses(source: str, name: str = "<source>") -> list[str]:
    """``name:line: what`` for every use of a private JAX or jaxlib module (``jax._src``, ``jaxlib._jax``) or
    attribute (``jax._src.distributed``, ``f._cache_size()``) in ``source``: they change without notice between
    releases, so gyre_jax reaches JAX only through its public API."""
    found = []
    for node in ast.walk(ast.parse(source)):
        modules = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for module in modules:
            parts = module.split(".")
            if parts[0] in ("jax", "jaxlib") and any(p.startswith("_") for p in parts[1:]):
                found.append(f"{name}:{node.lineno}: import {module}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if node.attr == "_cache_size" or (isinstance(root, ast.Name) and root.id in ("jax", "jaxlib")):
                found.append(f"{name}:{node.lineno}: .{node.attr}")
    return found


def test_gyre_jax_uses_only_public_jax():
    found = [
        use
        for path in sorted((REPO / "gyre_jax").rglob("*.py"))
        for use in _private_jax_uses(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    ]
    assert not found, "private JAX in gyre_jax (use the public API):\n" + "\n".join(found)


def test_the_private_jax_check_finds_each_form():
    source = (
        "import jax\nfrom jax._src import distributed\nimport jaxlib._jax as j\nfrom jax import _src\n"
        "x = jax._src.xla_bridge.backends_are_initialized()\nn = f._cache_size()\n"
        "ok = jax.config.update('jax_platforms', 'cpu')\nself._own = 1\n"
    )
    found = _private_jax_uses(source)
    assert sorted(found) == [
        "<source>:2: import jax._src",
        "<source>:2: import jax._src.distributed",
        "<source>:3: import jaxlib._jax",
        "<source>:4: import jax._src",
        "<source>:5: ._src",
        "<source>:6: ._cache_size",
    ], found  # the public config call and the object's own private attribute are not flagged
