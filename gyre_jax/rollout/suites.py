"""Task suites from disk: Harbor / Terminal-Bench 2 task directories, and a one-file JSONL form of them.

A Harbor task is a directory::

    instruction.md       the instruction the agent gets (non-empty)
    task.toml            [agent] timeout_sec; [verifier] timeout_sec, env; [environment] cpus, memory_mb (or
                         memory = "2G"), allow_internet, docker_image, ...; [metadata] anything (kept as given)
    environment/         the starting files. A Dockerfile there is built by the docker sandbox; otherwise the
                         directory minus its Docker files is the workspace, mounted at the Dockerfile's last
                         WORKDIR (default /app) inside a sandbox
    tests/test.sh        the verifier, run after the agent ends in a fresh sandbox with tests/ at /tests; it
                         writes the reward (a float in [0, 1]) to /logs/verifier/reward.txt or reward.json
    solution/solve.sh    optional: the oracle (``check_suite`` runs it)

A suite is a directory of such task directories (or one task directory). ``config.rollout.suite`` names it as
``harbor:<dir>``; ``jsonl:<file>`` names the one-file form, one task per line (materialized once into Harbor
directories under the system's temporary directory, keyed by the file's content)::

    {"name": "add-two", "instruction": "...", "files": {"environment/app.py": "...", "tests/test.sh": "...",
     "solution/solve.sh": "..."}, "task_toml": {"agent": {"timeout_sec": 600}, "metadata": {...}}}

``task_toml`` is optional (the tables of task.toml as JSON); ``files`` holds every other file of the task
directory by relative path. Every malformed task is refused when the suite loads, with one line naming the
task and the field (``SuiteError``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import tempfile
import tomllib
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from gyre_jax.disk import publish_dir
from gyre_jax.rollout.tasks import TOOLS, BuiltinSuite, Task, epoch_tasks

logger = logging.getLogger(__name__)
DOCKER_FILES = ("Dockerfile", ".dockerignore", "docker-compose.yaml", "docker-compose.yml")
DEFAULT_WORKDIR = "/app"
SUITE_KINDS = ("builtin", "harbor", "jsonl")
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
_SPLIT_STREAM = 5  # the seed stream of the train / held-out split (tasks.py uses 0-4)


class SuiteError(ValueError):
    """A suite or one of its tasks is malformed; the message names the task and the field."""


def parse_suite_spec(spec: str) -> tuple[str, str]:
    """``"builtin"`` -> ("builtin", ""); ``"harbor:<dir>"`` / ``"jsonl:<file>"`` -> (kind, path)."""
    kind, _, path = spec.partition(":")
    if spec == "builtin":
        return "builtin", ""
    if kind not in ("harbor", "jsonl") or not path:
        raise SuiteError(f"suite {spec!r}: expected 'builtin', 'harbor:<directory of Harbor tasks>' or 'jsonl:<file>'")
    return kind, path


def memory_mb(value: Any, where: str) -> int:
    """task.toml's memory: an int of MB (``memory_mb``) or a string such as "2G" / "512M" (``memory``)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _MEMORY_RE.match(value) if isinstance(value, str) else None
    if not match:
        raise SuiteError(f"{where} must be a positive number of MB or a size such as '2G' / '512M', got {value!r}")
    scale = {"": 1 / 2**20, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2}[match.group(2).upper()]
    mb = math.ceil(float(match.group(1)) * scale)
    if mb <= 0:
        raise SuiteError(f"{where}={value!r} is less than one MB")
    return mb


def _number(table: dict, key: str, where: str, positive: bool = True) -> float | None:
    if key not in table:
        return None
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SuiteError(f"{where} {key}={value!r} must be a number > 0")
    return float(value)


def _table(config: dict, name: str, where: str) -> dict:
    table = config.get(name, {})
    if not isinstance(table, dict):
        raise SuiteError(f"{where}: task.toml [{name}] must be a table, got {table!r}")
    return table


# task.toml keys of Harbor's schema (and Terminal-Bench 2's use of it), by table; anything else is a warning.
KNOWN_KEYS = {
    "": ("version", "schema_version", "source", "metadata", "verifier", "agent", "environment", "solution", "steps"),
    "agent": ("timeout_sec", "user", "network_mode", "allowed_hosts", "env"),
    "verifier": ("timeout_sec", "env", "user", "network_mode", "allowed_hosts", "requires", "reward_key"),
    "environment": ("build_timeout_sec", "docker_image", "cpus", "memory_mb", "memory", "storage_mb", "storage",
                    "gpus", "gpu_types", "allow_internet", "network_mode", "env", "skills_dir", "mcp_servers",
                    "healthcheck", "os", "workdir", "allowed_hosts"),
    "solution": ("env",),
}  # fmt: skip
NETWORK_MODES = ("public", "no-network", "allowlist")


def unknown_keys(config: dict) -> list[str]:
    """The keys of a parsed task.toml that Harbor's schema does not have (``table.key``), sorted."""
    out = [k for k in config if k not in KNOWN_KEYS[""]]
    for table in ("agent", "verifier", "environment", "solution"):
        body = config.get(table)
        if isinstance(body, dict):
            out += [f"{table}.{k}" for k in body if k not in KNOWN_KEYS[table]]
    return sorted(out)


def _string_map(table: dict, key: str, where: str) -> dict[str, str]:
    value = table.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise SuiteError(f"{where} {key} must map names to strings, got {value!r}")
    return dict(value)


def _network(table: dict, where: str, default: bool) -> bool:
    """Whether a phase has the internet: ``network_mode`` ("public" | "no-network"), else the deprecated
    ``allow_internet``, else ``default`` (Harbor's: public)."""
    if "network_mode" in table:
        mode = table["network_mode"]
        if mode not in NETWORK_MODES:
            raise SuiteError(f"{where} network_mode={mode!r} must be one of {NETWORK_MODES}")
        return mode == "public"  # "allowlist" is refused at load (refusals): it is never granted here
    if "allow_internet" in table:
        if not isinstance(table["allow_internet"], bool):
            raise SuiteError(f"{where} allow_internet={table['allow_internet']!r} must be true/false")
        return table["allow_internet"]
    return default


def _environment(table: dict, workdir: str, where: str) -> dict[str, Any]:
    where_env = f"{where}: task.toml [environment]"
    env: dict[str, Any] = {"workdir": workdir, "allow_internet": _network(table, where_env, True)}
    cpus = _number(table, "cpus", where_env)
    if cpus is not None:
        env["cpus"] = cpus
    if "memory_mb" in table:
        env["memory_mb"] = memory_mb(table["memory_mb"], f"{where_env} memory_mb")
    elif "memory" in table:
        env["memory_mb"] = memory_mb(table["memory"], f"{where_env} memory")
    if "storage_mb" in table or "storage" in table:
        key = "storage_mb" if "storage_mb" in table else "storage"
        env["storage_mb"] = memory_mb(table[key], f"{where_env} {key}")
    build = _number(table, "build_timeout_sec", where_env)
    if build is not None:
        env["build_timeout_s"] = build
    for key in ("docker_image", "skills_dir", "os"):
        if key in table:
            if not isinstance(table[key], str) or not table[key]:
                raise SuiteError(f"{where_env} {key} must be a non-empty string, got {table[key]!r}")
            env[key] = table[key]
    if "skills_dir" in env and not env["skills_dir"].startswith("/"):
        raise SuiteError(f"{where_env} skills_dir={env['skills_dir']!r} must be an absolute path in the environment")
    if "gpus" in table:
        if isinstance(table["gpus"], bool) or not isinstance(table["gpus"], int) or table["gpus"] < 0:
            raise SuiteError(f"{where_env} gpus={table['gpus']!r} must be an integer >= 0")
        env["gpus"] = table["gpus"]
    if table.get("env"):
        env["env"] = _string_map(table, "env", where_env)
    if "network_mode" in table:
        env["network_mode"] = table["network_mode"]
    return env


def dockerfile_workdir(dockerfile: Path) -> str:
    """The last ``WORKDIR`` of a Dockerfile (absolute), or ``/app`` without one."""
    workdir = DEFAULT_WORKDIR
    if dockerfile.is_file():
        for line in dockerfile.read_text(encoding="utf-8", errors="replace").splitlines():
            parts = line.strip().split(None, 1)
            if len(parts) == 2 and parts[0].upper() == "WORKDIR":
                path = parts[1].strip().strip("\"'")
                workdir = path if path.startswith("/") else str(PurePosixPath(workdir) / path)
    return workdir


def load_harbor_task(path: Path, max_turns: int = 4) -> Task:
    """One Harbor task directory as a ``Task`` (id and kind: the directory's name); SuiteError if malformed."""
    path = Path(path).resolve()
    name = path.name
    where = f"task {name} ({path})"
    instruction_file = path / "instruction.md"
    if not instruction_file.is_file():
        raise SuiteError(f"{where}: instruction.md is missing")
    instruction = instruction_file.read_text(encoding="utf-8", errors="replace").strip()
    if not instruction:
        raise SuiteError(f"{where}: instruction.md is empty")
    try:
        config = (
            tomllib.loads((path / "task.toml").read_text(encoding="utf-8")) if (path / "task.toml").is_file() else {}
        )
    except tomllib.TOMLDecodeError as exc:
        raise SuiteError(f"{where}: task.toml is not valid TOML ({exc})") from None
    if not (path / "environment").is_dir():
        raise SuiteError(f"{where}: environment/ is missing (the starting files; may hold only a Dockerfile)")
    if not (path / "tests" / "test.sh").is_file():
        raise SuiteError(f"{where}: tests/test.sh is missing (the verifier that writes /logs/verifier/reward.txt)")
    agent, verifier = _table(config, "agent", where), _table(config, "verifier", where)
    solution = _table(config, "solution", where)
    verifier_env = _string_map(verifier, "env", f"{where}: task.toml [verifier]")
    metadata = _table(config, "metadata", where)
    workdir = dockerfile_workdir(path / "environment" / "Dockerfile")
    environment = _environment(_table(config, "environment", where), workdir, where)
    # Which phase has the internet: [agent] / [verifier] network_mode override the environment's (Harbor's rule).
    environment["agent_internet"] = _network(agent, f"{where}: task.toml [agent]", environment["allow_internet"])
    environment["verifier_internet"] = _network(
        verifier, f"{where}: task.toml [verifier]", environment["allow_internet"]
    )
    reward_key = verifier.get("reward_key")
    if reward_key is not None:
        if not isinstance(reward_key, str) or not reward_key:
            raise SuiteError(f"{where}: task.toml [verifier] reward_key must be a non-empty string, got {reward_key!r}")
        environment["reward_key"] = reward_key
    if solution.get("env"):
        environment["solution_env"] = _string_map(solution, "env", f"{where}: task.toml [solution]")
    # Built from its Dockerfile (bwrap: an environment session) unless it declares that its verifier runs on the
    # trainer's own interpreter ([verifier.requires]: gyre-jax's host mode, the bundled suites).
    has_image = (path / "environment" / "Dockerfile").is_file() or "docker_image" in environment
    environment["mode"] = "build" if has_image and "requires" not in verifier else "host"
    unknown = unknown_keys(config)
    if unknown:
        environment["unknown_keys"] = unknown
    try:
        return _task(path, name, instruction, agent, verifier, environment, verifier_env, metadata, max_turns)
    except ValueError as exc:  # the record's own check: one line naming the task, never a traceback
        raise SuiteError(f"{where}: {exc}") from None


def _task(path, name, instruction, agent, verifier, environment, verifier_env, metadata, max_turns) -> Task:
    where = f"task {name} ({path})"
    return Task(
        task_id=name,
        kind=name,
        system="",
        instruction=instruction,
        files={},
        expected={},
        tools=[json.loads(json.dumps(t)) for t in TOOLS],
        max_turns=max_turns,
        tool_latency_median_s=0.0,
        tool_latency_sigma=0.0,
        source=str(path),
        agent_timeout_s=_number(agent, "timeout_sec", f"{where}: task.toml [agent]") or 0.0,
        verifier_timeout_s=_number(verifier, "timeout_sec", f"{where}: task.toml [verifier]") or 0.0,
        environment=environment,
        verifier_env=dict(verifier_env),
        metadata=json.loads(json.dumps(metadata, default=str)),
    )


def task_dirs(root: Path) -> list[Path]:
    """The task directories of a suite directory (sorted), or [root] when root is itself a task."""
    root = Path(root)
    if not root.is_dir():
        raise SuiteError(f"suite directory {root} does not exist")
    if (root / "instruction.md").exists() or (root / "task.toml").exists():
        return [root]
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    dirs = [p for p in dirs if (p / "instruction.md").exists() or (p / "task.toml").exists()]
    if not dirs:
        raise SuiteError(f"suite directory {root} holds no task (a directory with instruction.md and task.toml)")
    return dirs


def _check_relative(rel: str, where: str) -> None:
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel:
        raise SuiteError(f"{where}: file path {rel!r} must be relative without '..'")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise SuiteError(f"task_toml value {value!r} cannot be written as TOML")


def _write_jsonl_task(line: dict, root: Path, where: str) -> None:
    name = line.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise SuiteError(f"{where}: 'name' must be a directory-safe name (letters, digits, . _ -), got {name!r}")
    where = f"{where} (task {name})"
    instruction, files, toml = line.get("instruction"), line.get("files", {}), line.get("task_toml", {})
    if not isinstance(instruction, str):
        raise SuiteError(f"{where}: 'instruction' must be a string")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise SuiteError(f"{where}: 'files' must map relative paths to text")
    if not isinstance(toml, dict) or not all(isinstance(v, dict) for v in toml.values()):
        raise SuiteError(f"{where}: 'task_toml' must map table names to tables")
    unknown = sorted(set(line) - {"name", "instruction", "files", "task_toml"})
    if unknown:
        raise SuiteError(f"{where}: unknown keys {unknown}; a line has name, instruction, files, task_toml")
    task = root / name
    if task.exists():
        raise SuiteError(f"{where}: the name is used by an earlier line")
    (task / "environment").mkdir(parents=True)
    (task / "instruction.md").write_text(instruction, encoding="utf-8")
    lines = [
        f"[{table}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in body.items()) for table, body in toml.items()
    ]
    (task / "task.toml").write_text("\n".join(lines), encoding="utf-8")
    for rel, text in files.items():
        _check_relative(rel, where)
        target = task / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")


def materialize_jsonl(file: Path) -> Path:
    """The Harbor directories of a JSONL suite (written once per content, then reused); SuiteError if malformed."""
    file = Path(file)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise SuiteError(f"suite file {file}: cannot read it ({exc.strerror or exc})") from None
    root = Path(tempfile.gettempdir()) / "gyre-jsonl-suites" / hashlib.sha256(data).hexdigest()[:20]
    if root.is_dir():
        return root
    with publish_dir(root) as tmp:  # renamed to root whole, or not at all
        for number, text in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
            if not text.strip():
                continue
            where = f"suite file {file} line {number}"
            try:
                line = json.loads(text)
            except json.JSONDecodeError as exc:
                raise SuiteError(f"{where}: not valid JSON ({exc})") from None
            if not isinstance(line, dict):
                raise SuiteError(f"{where}: a line must be a JSON object")
            _write_jsonl_task(line, tmp, where)
    return root


def load_tasks(spec: str, max_turns: int = 4) -> tuple[list[Task], Path]:
    """Every task of a ``harbor:`` or ``jsonl:`` suite, checked (SuiteError names the first bad task and
    field), and the directory holding them (what a sandbox hides from the agent)."""
    kind, path = parse_suite_spec(spec)
    if kind == "builtin":
        raise SuiteError("the builtin suite is generated, not loaded: use BuiltinSuite")
    root = materialize_jsonl(Path(path)) if kind == "jsonl" else Path(path).resolve()
    tasks = [load_harbor_task(d, max_turns) for d in task_dirs(root)]
    return tasks, root


def suite_warnings(tasks: Sequence[Task]) -> list[str]:
    """One line per task whose task.toml has keys Harbor's schema does not (kept, not used)."""
    return [f"task {t.task_id}: task.toml has keys gyre-jax does not know (ignored): {t.environment['unknown_keys']}"
            for t in tasks if t.environment.get("unknown_keys")]  # fmt: skip


def declared_heldout(tasks: Sequence[Task]) -> set[str] | None:
    """The held-out task names a suite declares (task.toml ``[metadata] split = "train" | "heldout"`` on every
    task), or None when no task declares one; SuiteError when only some do, a value is unknown, or a split is
    empty."""
    splits = {t.task_id: t.metadata.get("split") for t in tasks}
    declared = {n: v for n, v in splits.items() if v is not None}
    if not declared:
        return None
    bad = sorted(n for n, v in splits.items() if v not in ("train", "heldout"))
    if bad:
        raise SuiteError(
            f"task {bad[0]}: task.toml [metadata] split={splits[bad[0]]!r}; when one task of a suite declares a "
            "split, every task must, as 'train' or 'heldout'"
        )
    held = {n for n, v in splits.items() if v == "heldout"}
    if not held or len(held) == len(splits):
        raise SuiteError(f"the suite's declared split holds {len(held)} held-out task(s) of {len(splits)}: both "
                         "splits need at least one task")  # fmt: skip
    return held


class HarborSuite:
    """Tasks loaded from disk, with a seeded train / held-out split and the builtin suite's epoch order.

    ``heldout_fraction`` of the tasks (rounded, at least one when > 0, never all) are held out for
    evaluation; the split depends only on ``seed`` and the task names. A suite whose tasks declare their split
    (task.toml ``[metadata] split``, ``declared_heldout``) keeps it whatever the seed: ``heldout_fraction > 0``
    then only turns the held-out split on. ``tasks_for_step`` visits the
    training tasks in seeded epochs exactly like ``BuiltinSuite`` with a pool (ids ``s{step:06d}-t{i}``, the
    task's name in ``kind``). There are no demonstrations: warm start needs the builtin suite.
    """

    def __init__(self, tasks: Sequence[Task], root: Path, seed: int = 0, heldout_fraction: float = 0.0) -> None:
        if not tasks:
            raise SuiteError(f"suite {root} holds no task")
        if not 0.0 <= heldout_fraction < 1.0:
            raise SuiteError(f"heldout_fraction={heldout_fraction} must be in [0, 1)")
        names = sorted(t.task_id for t in tasks)
        n_held = 0 if heldout_fraction == 0 else max(1, round(heldout_fraction * len(names)))
        if n_held >= len(names):
            raise SuiteError(
                f"heldout_fraction={heldout_fraction} of {len(names)} tasks leaves none to train on; lower it"
            )
        held = declared_heldout(tasks) if heldout_fraction > 0 else None
        if held is None:
            rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_SPLIT_STREAM,)))
            held = {names[int(i)] for i in rng.permutation(len(names))[:n_held]}
        by_name = {t.task_id: t for t in tasks}
        self.root = Path(root)
        self.seed = seed
        self.train = [by_name[n] for n in names if n not in held]
        self.heldout = [by_name[n] for n in names if n in held]
        self.tools = [json.loads(json.dumps(t)) for t in TOOLS]

    def pool(self) -> list[Task]:
        return list(self.train)

    def tasks_for_step(self, step: int, n: int) -> list[Task]:
        return epoch_tasks(self.train, self.seed, step, n)

    def heldout_tasks(self, n: int) -> list[Task]:
        """The held-out split (its first ``n``; all of it when ``n`` is 0 or larger)."""
        return list(self.heldout if n <= 0 else self.heldout[:n])

    def demonstrations(self, n: int, seed: int):
        raise SuiteError(
            "not supported yet: warm-start demonstrations exist only for the builtin suite; set "
            "config.warm_start.steps=0 for a harbor/jsonl suite"
        )


TaskSuite = BuiltinSuite | HarborSuite  # what a run draws its tasks from


def make_suite(spec: str, *, seed: int, max_turns: int, heldout_fraction: float = 0.0, sandbox: str = "",
               **builtin: Any):  # fmt: skip
    """The suite ``config.rollout.suite`` names: ``BuiltinSuite(**builtin)`` or a ``HarborSuite``. With
    ``sandbox``, the tasks this machine cannot honour under it (``environments.problems``: an environment or a
    verifier that needs what is not here) are left out, each logged with its reason; none left is a SuiteError."""
    if parse_suite_spec(spec)[0] == "builtin":
        return BuiltinSuite(seed=seed, max_turns=max_turns, **builtin)
    tasks, root = load_tasks(spec, max_turns)
    for line in suite_warnings(tasks):
        logger.warning("%s", line)
    if sandbox:
        from gyre_jax.rollout import environments  # (it imports this module)

        kept, refused = environments.honoured(tasks, sandbox)
        for line in refused:
            logger.warning("left out: %s", line)
        if not kept:
            raise SuiteError(f"no task of {root} can run here with sandbox {sandbox!r}; first: {refused[0]}")
        tasks = kept
    return HarborSuite(tasks, root, seed=seed, heldout_fraction=heldout_fraction)
