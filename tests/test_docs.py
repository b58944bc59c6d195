"""The docs name only what exists.

- ``RETIRED``: names an issue renamed or removed (classes, functions, methods, phrases of rules that no longer
  hold) appear nowhere in docs/, README.md, configs/ or notebooks/. Add an issue's names to it when it retires
  them: the test then finds every stale mention.
- Every module path ``gyre_jax.x.y`` (a module, or a name a module defines) and every ``--config.a.b`` key that
  README.md and docs/ name exists: a key of the run's config (``gyre_jax.config``) or of the simulator's presets
  (``gyre_jax.sim.config``).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# retired name (an identifier, matched as a whole word, or a phrase) -> what replaced it, for the failure message
RETIRED: dict[str, str] = {
    # issue 46, run / runtime / config / disk
    "fsync_write": "gyre_jax.disk.write_whole (disk.py is the one place for whole-or-nothing writes)",
    "request_stop": "run.RunStop.signal",
    "follower_asks_stop": "run.RunStop.follower_asks",
    "move_sessions": "CellHandle.move_sessions_to, dispatched to one function per pair in runtime.sessions",
    "no class over 300 lines": "scripts/check_sizes.py is a report (the longest classes and functions), not a limit",
    "classes <= 300 lines": "scripts/check_sizes.py is a report, not a limit",
    # issue 46, serving: one ServingEngine protocol (serving/engine_api.py) for both KV layouts
    "PageAllocator": "a PrefixCache allocates the paged engine's pages (serving/prefix_cache.py)",
    "paged_batch": "serving.batch.DecodeBatch serves both KV layouts",
    "_cache_size": "ServingEngine.warmup / engine.programs.count() (serving/programs.py: public JAX only)",
    # issue 46, losses: one signature fn(LossInputs, params) and one registry (rl/losses.py, rl/loss_config.py)
    "seq_log_ratio": "LossInputs.whole (a SequenceTotals)",
    "seq_sums": "LossInputs.whole (a SequenceTotals)",
    # issue 46, events: typed events and one ClusterState builder (elastic/events.py, elastic/state.py)
    "driver.state_from_dict": "gyre_jax.elastic.state.state_from_dict",
    # issue 46, public JAX only: the control plane is the run's own store (runtime/kvstore.py)
    "lost the coordination service": "the watchdog's 'lost the control-plane store' (process 0 serves it)",
    "memory_kv": "tests/helpers/local_store.py (a real kvstore on loopback)",
}
PLACEHOLDER_KEYS = {"a.b", "x"}  # ``--config.a.b=value``: the form of an override, not a key
PLACEHOLDER_PATHS = {"gyre_jax.x.y"}  # the form of a module path, as this check's own description names it


def _doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _searched_files() -> list[Path]:
    """What the retired names must not appear in: the docs, the configs and the notebooks."""
    found = _doc_files() + sorted((REPO / "configs").rglob("*.py")) + sorted((REPO / "notebooks").rglob("*.ipynb"))
    found += sorted((REPO / "notebooks").rglob("*.md"))
    return found


def _pattern(name: str) -> re.Pattern:
    """An identifier as a whole word (``move_sessions`` does not match ``move_sessions_to``); a phrase (with spaces)
    in any case."""
    return re.compile(rf"(?<!\w){re.escape(name)}(?!\w)", re.IGNORECASE if " " in name else 0)


def _mentions(pattern: re.Pattern, files: list[Path]) -> list[str]:
    """``file:line: text`` of every line of ``files`` that ``pattern`` finds."""
    out = []
    for path in files:
        where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if pattern.search(line):
                out.append(f"{where}:{number}: {line.strip()[:160]}")
    return out


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_no_retired_name_is_mentioned(name):
    stale = _mentions(_pattern(name), _searched_files())
    assert not stale, f"{name!r} was retired (now: {RETIRED[name]}); still named in:\n" + "\n".join(stale)


def test_the_retired_name_check_finds_a_stale_name(tmp_path):
    """The check itself: a line naming a retired name is found (as an identifier or a phrase), a longer name that
    only starts with it is not."""
    doc = tmp_path / "page.md"
    doc.write_text(
        "Sessions move by `move_sessions_to`.\nUse `run.fsync_write(path, text)`.\nNo class over 300 lines.\n"
    )
    assert _mentions(_pattern("fsync_write"), [doc]) == [f"{doc}:2: Use `run.fsync_write(path, text)`."]
    assert _mentions(_pattern("move_sessions"), [doc]) == []
    assert _mentions(_pattern("class over 300 lines"), [doc]) == [f"{doc}:3: No class over 300 lines."]


# -- gyre_jax.x.y paths ------------------------------------------------------------------------------------------
@cache
def _defined(path: Path) -> dict[str, ast.AST | None]:
    """The names a module defines at top level (classes map to their node, to look inside them)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: dict[str, ast.AST | None] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node if isinstance(node, ast.ClassDef) else None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update({t.id: None for t in targets if isinstance(t, ast.Name)})
    return names


def _class_members(node: ast.ClassDef) -> set[str]:
    members = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
        elif isinstance(item, ast.Assign):
            members.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return members


def resolves(dotted: str) -> bool:
    """Whether ``gyre_jax.a.b`` names a module or package of the repository, a name one defines at top level (or
    imports, as a package's ``__init__`` does), or a member of a class one defines (``gyre_jax.run.RunStop.fail``)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):  # the longest prefix that is a module or a package
        base = REPO.joinpath(*parts[:i])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            break
    else:
        return False
    rest = parts[i:]
    if not rest:
        return True
    names = _defined(source)
    if rest[0] not in names:
        return False
    node = names[rest[0]]
    if len(rest) == 1:
        return True
    return isinstance(node, ast.ClassDef) and len(rest) == 2 and rest[1] in _class_members(node)


MODULE_PATH = re.compile(r"\bgyre_jax(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _named_paths() -> dict[str, list[str]]:
    paths: dict[str, list[str]] = {}
    for path in _doc_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for m in MODULE_PATH.finditer(line):
                paths.setdefault(m.group(0), []).append(f"{path.relative_to(REPO)}:{number}")
    return paths


def test_every_module_path_the_docs_name_exists():
    paths = _named_paths()
    assert len(paths) > 10  # the docs name modules: the scan found them
    missing = {p: where for p, where in paths.items() if not resolves(p) and p not in PLACEHOLDER_PATHS}
    assert not missing, "module paths named in the docs that do not exist:\n" + "\n".join(
        f"{p} ({', '.join(where[:3])})" for p, where in sorted(missing.items())
    )


def test_the_path_check_tells_what_exists():
    assert resolves("gyre_jax.run") and resolves("gyre_jax.runtime") and resolves("gyre_jax.runtime.local")
    assert resolves("gyre_jax.disk.write_whole") and resolves("gyre_jax.run.RunStop.follower_asks")
    assert resolves("gyre_jax.config.DistributedSection")  # a name the package's __init__ imports
    assert not resolves("gyre_jax.run.fsync_write") and not resolves("gyre_jax.nope")
    assert not resolves("gyre_jax.run.RunStop.nope") and not resolves("gyre_jax.runtime.nope.x")


# -- --config.a.b keys -------------------------------------------------------------------------------------------
def _keys(config, prefix: str = "") -> set[str]:
    out = set()
    for key, value in config.items():
        out |= _keys(value, f"{prefix}{key}.") if hasattr(value, "items") else {f"{prefix}{key}"}
    return out


@cache
def known_keys() -> frozenset[str]:
    """Every key of the run's config and of the simulator's presets (the two commands that take ``--config.``)."""
    from gyre_jax.config import default_config
    from gyre_jax.sim.config import preset
    from gyre_jax.sim.presets import PRESETS

    keys = _keys(default_config())
    for name in PRESETS:
        keys |= _keys(preset(name))
    return frozenset(keys)


CONFIG_KEY = re.compile(r"--config\.([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")


def test_every_config_key_the_docs_name_exists():
    named: dict[str, list[str]] = {}
    for path in _doc_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for m in CONFIG_KEY.finditer(line):
                named.setdefault(m.group(1), []).append(f"{path.relative_to(REPO)}:{number}")
    assert len(named) > 10
    unknown = {k: w for k, w in named.items() if k not in known_keys() and k not in PLACEHOLDER_KEYS}
    assert not unknown, "--config keys named in the docs that no config has:\n" + "\n".join(
        f"--config.{k} ({', '.join(w[:3])})" for k, w in sorted(unknown.items())
    )
    assert "rl.group_size" in known_keys() and "schedule.stream_unit" in known_keys()
    assert "rl.max_staleness" not in known_keys()  # a renamed key is no key
