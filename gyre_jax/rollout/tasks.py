"""The built-in task suite: tiny file-transformation tasks, their demonstrations and their evaluator.

This module owns the ``Task`` record (what a harness is given: prompt, tools, initial workspace;
what the evaluator checks), ``BuiltinSuite`` (deterministic tasks per training step, and the
demonstrations a tiny model is warm-started on) and ``evaluate`` (partial-credit reward of a
workspace). Tasks are short on purpose: every byte of the prompt is a token of a byte-level model.

Serialized form of a task (``Task.to_json``; the harness reads this file, see harness.py)::

    {"task_id": "s000003-t1", "kind": "upper", "system": str, "instruction": str,
     "files": {"input.txt": "qkzmt"}, "expected": {"answer.txt": "QKZMT"},
     "tools": [OpenAI function tool schemas], "max_turns": 4,
     "tool_latency_median_s": 0.05, "tool_latency_sigma": 1.0}

``expected`` maps workspace paths to their exact expected text; the reward is the mean over those
paths of the per-path positional partial credit (see ``evaluate``).

A task loaded from a Harbor task directory (``suites.py``) also has ``source`` (that directory: its
``environment/`` seeds the workspace and ``tests/test.sh`` is the verifier, ``verifier.py``), an empty
``expected``, the task's own agent / verifier timeouts (0 = the run's), ``environment`` (``cpus``,
``memory_mb``, ``allow_internet``, ``workdir``: what the sandbox applies), ``verifier_env`` and
``metadata`` (``task.toml``'s tables, kept as given). These keys may be absent in a task JSON.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

KINDS: tuple[str, ...] = ("copy", "upper", "reverse")
LONG_KIND = "longlog"  # the long-horizon kind: a log corpus read in pieces (``LongTaskParams``, the ``long`` harness)
ALL_KINDS: tuple[str, ...] = (*KINDS, LONG_KIND)
ALPHABETS: dict[str, str] = {"lowercase": "abcdefghijklmnopqrstuvwxyz", "digits": "0123456789"}
INPUT_FILE = "input.txt"
ANSWER_FILE = "answer.txt"

SYSTEM_PROMPT = "Solve the task with the tools."
INSTRUCTIONS: dict[str, str] = {
    "copy": "Copy input.txt to answer.txt.",
    "upper": "Write input.txt in uppercase to answer.txt.",
    "reverse": "Write input.txt reversed to answer.txt.",
}

# OpenAI function tool schemas, kept minimal: they are rendered into every prompt.
TOOLS: tuple[dict[str, Any], ...] = (
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
)

# What a task's ``environment`` may say (from task.toml's [environment]; the sandbox applies what it can).
# task.environment: what a Harbor task.toml's [environment] (and the phases' network) says, as gyre-jax keeps it
# (suites.load_harbor_task; docs/tasks.md "The task format").
ENVIRONMENT_KEYS = ("cpus", "memory_mb", "allow_internet", "workdir", "docker_image", "storage_mb", "gpus",
                    "build_timeout_s", "env", "skills_dir", "os", "network_mode", "agent_internet",
                    "verifier_internet", "reward_key", "solution_env", "mode", "unknown_keys")  # fmt: skip

WRITE_OK = "ok"  # the write_file tool result, as the reference harness returns it
FINAL_MESSAGE = "Done."

# Stream ids under the suite seed, so step tasks and demonstrations never share random numbers.
_STEP_STREAM = 0
_DEMO_STREAM = 1
_POOL_STREAM = 2
_EPOCH_STREAM = 3
_HELDOUT_STREAM = 4


def transform(kind: str, text: str) -> str:
    """The correct answer of a task of ``kind`` for input ``text``."""
    if kind == "copy":
        return text
    if kind == "upper":
        return text.upper()
    if kind == "reverse":
        return text[::-1]
    raise ValueError(f"unknown task kind {kind!r}: expected one of {KINDS}")


# -- the long-horizon kind ------------------------------------------------------------------------------------------
LONG_SYSTEM = "You are a log analysis agent. Read the files with the tools, keep notes, and answer the task."
LONG_SUBAGENT_SYSTEM = "You are a sub-agent of a log analysis agent. Read the file you are given and report."
LONG_LOG_DIR = "logs"
LONG_LEVELS = ("INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR")  # drawn uniformly: 1 line in 6 is an ERROR
LONG_TOOLS: tuple[dict[str, Any], ...] = (
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a piece of a file: limit characters from offset.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "offset": {"type": "integer"}, "limit": {"type": "integer"}},
                "required": ["path"],
            },
        },
    },
    TOOLS[1],
)
_MANUAL_WORDS = ("read_file returns limit characters of a file from offset; an offset past the end returns nothing. "
                 "write_file replaces a file. Logs are one event per line: sequence number, level, service, "
                 "message. Count carefully; keep a running tally in your notes; summaries must keep the tally. ")  # fmt: skip


LONG_PARAM_NAMES = ("files", "file_chars", "read_chars", "system_chars", "compact_tokens", "subagent_every")


@dataclass(frozen=True)
class LongTaskParams:
    """Sizes of a ``longlog`` task (config keys ``rollout.long_*``; characters are tokens for the byte tokenizer).

    The workspace holds ``files`` log files of ``file_chars`` characters under ``logs/``; the task is to count
    their ERROR lines into answer.txt. The ``long`` harness reads each file in pieces of ``read_chars`` (one
    model call per piece), hands every ``subagent_every``-th file to a sub-agent (0: none), and compacts a
    conversation (a summary, then a new conversation from it) before its context would pass
    ``compact_tokens``. Both agents' system prompts are ``system_chars`` long (a tool manual, as real agents
    carry), which is also what keeps each continuing call's reused prefix large.
    """

    files: int = 4
    file_chars: int = 2000
    read_chars: int = 500
    system_chars: int = 2000
    compact_tokens: int = 8000
    subagent_every: int = 3

    def __post_init__(self) -> None:
        for name in ("files", "file_chars", "read_chars", "compact_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config.rollout.long_{name}={value!r} must be an integer >= 1")
        if self.read_chars > self.file_chars:
            raise ValueError(
                f"config.rollout.long_read_chars={self.read_chars} must be <= long_file_chars={self.file_chars} "
                "(a read is a piece of one file)"
            )
        if self.system_chars < len(LONG_SYSTEM) + 1:
            raise ValueError(f"config.rollout.long_system_chars={self.system_chars} must be > {len(LONG_SYSTEM)}")
        if not 0 <= self.subagent_every <= self.files:
            raise ValueError(
                f"config.rollout.long_subagent_every={self.subagent_every} must be in [0, long_files={self.files}] "
                "(0: no sub-agents)"
            )
        floor = self.system_chars + 4 * self.read_chars
        if self.compact_tokens < floor:
            raise ValueError(
                f"config.rollout.long_compact_tokens={self.compact_tokens} must be >= long_system_chars + 4 x "
                f"long_read_chars = {floor}: a conversation must hold its system prompt and a few reads before it "
                "compacts"
            )

    @classmethod
    def from_rollout(cls, rollout: Any) -> LongTaskParams:
        """The sizes of a run config's rollout section (its ``long_*`` keys; typed section or ConfigDict)."""
        return cls(**{name: getattr(rollout, f"long_{name}") for name in LONG_PARAM_NAMES})

    @property
    def reads_per_file(self) -> int:
        return -(-self.file_chars // self.read_chars)

    def planned_calls(self) -> int:
        """Model calls of an execution without compaction: the main agent's first call, a call per read, a report
        per sub-agent (and one in the main agent to take it in), and the answer. Compaction adds 1-5 calls (the
        summary requests) per summary."""
        delegated = self.files // self.subagent_every if self.subagent_every else 0
        return self.files * self.reads_per_file + 2 * delegated + 2

    def max_calls(self) -> int:
        """The call budget of a task (``Task.max_turns``): the planned calls plus room for summaries."""
        per_conversation = max(
            1, (self.compact_tokens - self.system_chars - 2 * self.read_chars) // (2 * self.read_chars)
        )
        return self.planned_calls() + 5 * (self.planned_calls() // per_conversation + 1)


def long_manual(header: str, chars: int) -> str:
    """A system prompt of exactly ``chars`` characters: ``header``, then the tool manual repeated."""
    body = header + "\n\n" + _MANUAL_WORDS * (chars // len(_MANUAL_WORDS) + 1)
    return body[:chars]


def long_log_file(rng: np.random.Generator, chars: int, first_seq: int) -> tuple[str, int]:
    """A log text of exactly ``chars`` characters (whole lines, the last padded) and its number of ERROR lines."""
    lines, size, errors, seq = [], 0, 0, first_seq
    while size < chars:
        level = LONG_LEVELS[int(rng.integers(len(LONG_LEVELS)))]
        line = f"{seq:07d} {level:<5} svc{int(rng.integers(10))} op{int(rng.integers(1000)):03d} t={int(rng.integers(1, 999))}ms\n"
        if size + len(line) > chars:
            line = " " * (chars - size - 1) + "\n" if chars - size > 1 else "\n"
            level = ""
        errors += level == "ERROR"
        lines.append(line)
        size += len(line)
        seq += 1
    return "".join(lines), errors


def make_long_task(
    rng: np.random.Generator, task_id: str, params: LongTaskParams, latency: tuple[float, float]
) -> Task:
    """A ``longlog`` task: ``params.files`` generated log files; count their ERROR lines into answer.txt."""
    files, total = {}, 0
    for i in range(params.files):
        text, errors = long_log_file(rng, params.file_chars, 100000 * i)
        files[f"{LONG_LOG_DIR}/part-{i:03d}.log"] = text
        total += errors
    return Task(
        task_id=task_id,
        kind=LONG_KIND,
        system=long_manual(LONG_SYSTEM, params.system_chars),
        instruction=f"Count the ERROR lines of all {params.files} files in {LONG_LOG_DIR}/ and write the number to {ANSWER_FILE}.",
        files=files,
        expected={ANSWER_FILE: str(total)},
        tools=[json.loads(json.dumps(t)) for t in LONG_TOOLS],
        max_turns=params.max_calls(),
        tool_latency_median_s=latency[0],
        tool_latency_sigma=latency[1],
        metadata={
            "long_horizon": {
                **asdict(params),
                "subagent_system": long_manual(LONG_SUBAGENT_SYSTEM, params.system_chars),
            }
        },
    )


def _check_relative_path(path: str, what: str) -> None:
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or "\\" in path or p == PurePosixPath("."):
        raise ValueError(f"{what} path {path!r} must be a non-empty relative path without '..' (e.g. 'input.txt')")


@dataclass(frozen=True)
class Task:
    """One task: what the harness gets (prompt, tools, workspace files) and what the evaluator checks.

    Frozen, but ``files``/``expected``/``tools`` are plain dicts/lists so the record maps 1:1 to JSON;
    treat them as read-only.
    """

    task_id: str
    kind: str
    system: str  # system prompt ("" for none)
    instruction: str  # the user message
    files: dict[str, str]  # initial workspace: relative path -> text
    expected: dict[str, str]  # relative path -> exact expected text (trailing newline ignored)
    tools: list[dict[str, Any]]  # OpenAI function tool schemas
    max_turns: int  # model calls the harness may make
    tool_latency_median_s: float  # simulated tool time: lognormal(log(median), sigma); 0 for none
    tool_latency_sigma: float
    source: str = ""  # a Harbor task directory (environment/ seeds the workspace, tests/ verifies); "" for none
    agent_timeout_s: float = 0.0  # the task's own harness time limit (0: the run's rollout.timeout_s)
    verifier_timeout_s: float = 0.0  # the task's own verifier time limit (0: the run's rollout.evaluator_timeout_s)
    environment: dict[str, Any] = field(default_factory=dict)  # cpus, memory_mb, allow_internet, workdir
    verifier_env: dict[str, str] = field(default_factory=dict)  # extra variables of the verifier's environment
    metadata: dict[str, Any] = field(default_factory=dict)  # task.toml's [metadata], as given

    def __post_init__(self) -> None:
        if not isinstance(self.task_id, str) or not self.task_id:
            raise ValueError(f"task_id must be a non-empty string, got {self.task_id!r}")
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"task {self.task_id}: kind must be a non-empty string, got {self.kind!r}")
        for name in ("system", "instruction"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(
                    f"task {self.task_id}: {name} must be a string, got {type(getattr(self, name)).__name__}"
                )
        for name in ("files", "expected"):
            mapping = getattr(self, name)
            if not isinstance(mapping, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
            ):
                raise ValueError(
                    f"task {self.task_id}: {name} must map relative paths (str) to text (str), got {mapping!r}"
                )
            for path in mapping:
                _check_relative_path(path, f"task {self.task_id}: {name}")
        if not self.expected and not self.source:
            raise ValueError(
                f"task {self.task_id}: expected must name at least one file to evaluate (or source a Harbor task "
                "directory whose tests/test.sh verifies it)"
            )
        self._check_harbor_fields()
        if not isinstance(self.tools, list) or not all(isinstance(t, dict) for t in self.tools):
            raise ValueError(f"task {self.task_id}: tools must be a list of OpenAI tool schema objects")
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"task {self.task_id}: max_turns={self.max_turns!r} must be an integer >= 1")
        for name in ("tool_latency_median_s", "tool_latency_sigma"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"task {self.task_id}: {name}={value!r} must be a finite number >= 0")

    def _check_harbor_fields(self) -> None:
        where = f"task {self.task_id}"
        if not isinstance(self.source, str):
            raise ValueError(f"{where}: source must be a directory path (str), got {self.source!r}")
        for name in ("agent_timeout_s", "verifier_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{where}: {name}={value!r} must be a finite number >= 0 (0: the run's limit)")
        for name in ("environment", "metadata", "verifier_env"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{where}: {name} must be a JSON object, got {getattr(self, name)!r}")
        unknown = sorted(set(self.environment) - set(ENVIRONMENT_KEYS))
        if unknown:
            raise ValueError(f"{where}: environment has unknown keys {unknown}; known: {ENVIRONMENT_KEYS}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.verifier_env.items()):
            raise ValueError(f"{where}: verifier_env must map names to strings, got {self.verifier_env!r}")

    @property
    def agent_timeout(self) -> float | None:
        """The task's own harness time limit in seconds, None for the run's."""
        return float(self.agent_timeout_s) or None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Task:
        if not isinstance(data, dict):
            raise ValueError(f"a task must be a JSON object, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [n for n in required if n not in data]
        unknown = sorted(set(data) - set(names))
        if missing or unknown:
            raise ValueError(
                f"task JSON has missing keys {missing} and unknown keys {unknown}; expected {required} "
                f"and optionally {[n for n in names if n not in required]}"
            )
        return cls(**{n: data[n] for n in names if n in data})

    def to_json(self) -> str:
        # Key order is kept (not sorted): tool schemas are rendered into the prompt in this order.
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Task:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"task JSON is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def demonstration(self) -> list[dict[str, Any]]:
        """The ideal OpenAI-format conversation: read the input, write the answer, say done.

        Tool results are what the reference harness returns (the file text, then ``"ok"``), so a
        demonstration renders to the same tokens a perfect rollout would produce.
        """
        if INPUT_FILE not in self.files or len(self.expected) != 1 or ANSWER_FILE not in self.expected:
            raise ValueError(
                f"task {self.task_id}: a demonstration needs files[{INPUT_FILE!r}] and expected == {{{ANSWER_FILE!r}: ...}}, "
                f"got files {sorted(self.files)} and expected {sorted(self.expected)}"
            )
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": self.system})
        messages.append({"role": "user", "content": self.instruction})
        messages += [
            _tool_call_message("call_0", "read_file", {"path": INPUT_FILE}),
            {"role": "tool", "tool_call_id": "call_0", "content": self.files[INPUT_FILE]},
            _tool_call_message("call_1", "write_file", {"path": ANSWER_FILE, "content": self.expected[ANSWER_FILE]}),
            {"role": "tool", "tool_call_id": "call_1", "content": WRITE_OK},
            {"role": "assistant", "content": FINAL_MESSAGE},
        ]
        return messages


def _tool_call_message(call_id: str, name: str, arguments: dict[str, str]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
        ],
    }


class BuiltinSuite:
    """Deterministic copy/upper/reverse tasks on ``min_len..max_len`` random characters of ``alphabet``
    (lowercase letters or digits; digits appear nowhere else in a prompt, which makes them easy for a
    tiny model to attend to), or, with ``kinds=("longlog",)``, long-horizon tasks sized by ``long``
    (``make_long_task``; no demonstrations).

    ``tasks_for_step(step, n)`` depends only on ``(seed, step, n)`` (and the constructor arguments),
    so a resumed run regenerates exactly the tasks it would have had.
    """

    def __init__(
        self,
        kinds: Sequence[str] = KINDS,
        seed: int = 0,
        max_turns: int = 4,
        tool_latency_median_s: float = 0.0,
        tool_latency_sigma: float = 0.0,
        min_len: int = 4,
        max_len: int = 8,
        alphabet: str = "lowercase",
        num_tasks: int = 0,
        long: LongTaskParams | None = None,
    ) -> None:
        kinds = tuple(kinds)
        bad = [k for k in kinds if k not in ALL_KINDS]
        if not kinds or bad:
            raise ValueError(f"kinds={kinds!r}: expected a non-empty subset of {ALL_KINDS}")
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"kinds={kinds!r} lists a kind twice")
        if LONG_KIND in kinds and len(kinds) > 1:
            raise ValueError(
                f"kinds={kinds!r}: {LONG_KIND!r} cannot be mixed with the short kinds (it needs its own harness, "
                f"'long'); use kinds=({LONG_KIND!r},)"
            )
        self.long = long if long is not None else LongTaskParams()
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be an integer >= 0")
        if not 1 <= min_len <= max_len:
            raise ValueError(f"input lengths min_len={min_len}, max_len={max_len} must satisfy 1 <= min_len <= max_len")
        self.kinds = kinds
        self.seed = seed
        self.max_turns = max_turns
        self.tool_latency_median_s = float(tool_latency_median_s)
        self.tool_latency_sigma = float(tool_latency_sigma)
        self.min_len = min_len
        self.max_len = max_len
        if alphabet not in ALPHABETS:
            raise ValueError(f"alphabet={alphabet!r}: expected one of {sorted(ALPHABETS)}")
        self.alphabet = ALPHABETS[alphabet]
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 0:
            raise ValueError(f"num_tasks={num_tasks!r} must be an integer >= 0 (0 = a fresh task every time)")
        self.num_tasks = num_tasks
        self._pool: list[Task] | None = None
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r} must be an integer >= 1")
        for name, value in (
            ("tool_latency_median_s", self.tool_latency_median_s),
            ("tool_latency_sigma", self.tool_latency_sigma),
        ):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value!r} must be a finite number >= 0")

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tool schemas every task of this suite carries (for rendering demonstrations)."""
        return [json.loads(json.dumps(t)) for t in TOOLS]

    def _make_task(self, rng: np.random.Generator, task_id: str) -> Task:
        if self.kinds == (LONG_KIND,):
            return make_long_task(rng, task_id, self.long, (self.tool_latency_median_s, self.tool_latency_sigma))
        kind = self.kinds[int(rng.integers(len(self.kinds)))]
        length = int(rng.integers(self.min_len, self.max_len + 1))
        text = "".join(self.alphabet[int(c)] for c in rng.integers(0, len(self.alphabet), size=length))
        return Task(
            task_id=task_id,
            kind=kind,
            system=SYSTEM_PROMPT,
            instruction=INSTRUCTIONS[kind],
            files={INPUT_FILE: text},
            expected={ANSWER_FILE: transform(kind, text)},
            tools=self.tools,
            max_turns=self.max_turns,
            tool_latency_median_s=self.tool_latency_median_s,
            tool_latency_sigma=self.tool_latency_sigma,
        )

    def pool(self) -> list[Task]:
        """The suite's fixed training set (``num_tasks`` tasks, ids ``task-{k:05d}``); empty if unbounded."""
        if self._pool is None:
            rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_POOL_STREAM,)))
            self._pool = [self._make_task(rng, f"task-{k:05d}") for k in range(self.num_tasks)]
        return list(self._pool)

    def tasks_for_step(self, step: int, n: int) -> list[Task]:
        """``n`` tasks for training step ``step``, ids ``s{step:06d}-t{i}``; deterministic in (seed, step).

        With ``num_tasks > 0`` the tasks come from the fixed pool, visited in epochs: the ``k``-th task of
        the run is ``pool[perm_e[k % num_tasks]]`` with a fresh seeded permutation per epoch ``e``, so every
        task is seen once per epoch, and a resumed run sees exactly the tasks it would have seen.
        Without a pool, every step draws fresh random tasks.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be an integer >= 0")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n={n!r} must be an integer >= 0")
        if self.num_tasks == 0:
            rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_STEP_STREAM, step)))
            return [self._make_task(rng, f"s{step:06d}-t{i}") for i in range(n)]
        return epoch_tasks(self.pool(), self.seed, step, n)

    def heldout_tasks(self, n: int) -> list[Task]:
        """``n`` tasks from a stream disjoint from training, pool and demonstrations (ids ``heldout-{k:05d}``)."""
        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_HELDOUT_STREAM,)))
        return [self._make_task(rng, f"heldout-{k:05d}") for k in range(n)]

    def demonstration_tasks(self, n: int, seed: int) -> list[Task]:
        """``n`` random tasks for warm-start demonstrations (a stream disjoint from the step tasks)."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be an integer >= 0")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n={n!r} must be an integer >= 0")
        if LONG_KIND in self.kinds:
            raise ValueError(
                f"not supported yet: warm-start demonstrations of the {LONG_KIND!r} kind; set config.warm_start.steps=0"
            )
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_DEMO_STREAM,)))
        return [self._make_task(rng, f"demo-{i:06d}") for i in range(n)]

    def demonstrations(self, n: int, seed: int) -> list[list[dict[str, Any]]]:
        """``n`` ideal conversations (OpenAI messages) over random tasks; render them with ``self.tools``."""
        return [task.demonstration() for task in self.demonstration_tasks(n, seed)]


def epoch_tasks(pool: Sequence[Task], seed: int, step: int, n: int) -> list[Task]:
    """``n`` tasks of ``pool`` for step ``step``, visited in seeded epochs: the ``k``-th task of the run is
    ``pool[perm_e[k % len(pool)]]`` with a fresh permutation per epoch ``e``; ids ``s{step:06d}-t{i}``."""
    out = []
    for i in range(n):
        epoch, pos = divmod(step * n + i, len(pool))
        perm = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_EPOCH_STREAM, epoch))).permutation(
            len(pool)
        )
        out.append(replace(pool[int(perm[pos])], task_id=f"s{step:06d}-t{i}"))
    return out


def _strip_newline(text: str) -> str:
    if text.endswith("\r\n"):
        return text[:-2]
    if text.endswith("\n"):
        return text[:-1]
    return text


def partial_credit(expected: str, got: str) -> float:
    """Characters equal by position / max(len(expected), len(got)); 1.0 when both are empty."""
    expected, got = _strip_newline(expected), _strip_newline(got)
    longest = max(len(expected), len(got))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(expected, got)) / longest


def numeric_credit(expected: str, got: str) -> float:
    """A ``longlog`` answer's credit: 1.0 for the right number, else 1 - |error| / expected (at least 0), where
    the answer's number is the first integer in it (none: 0.0)."""
    match = re.search(r"\d+", got)
    if match is None:
        return 0.0
    want, number = int(expected), int(match.group(0)[:18])
    return max(0.0, 1.0 - abs(number - want) / max(want, 1))


def evaluate(task: Task, workspace: Path) -> float:
    """Reward in [0, 1] of ``workspace`` for ``task``: mean partial credit over ``task.expected`` (for the
    ``longlog`` kind, ``numeric_credit``).

    A missing answer scores 0, and so does one that is not a regular file of the workspace (a symlink, which is
    not followed, a FIFO, a device, a hard link to a file elsewhere: what the agent cannot write honestly); only
    its first ``MAX_ANSWER_BYTES`` are read. Raises ``FileNotFoundError``/``NotADirectoryError`` when
    the workspace itself does not exist: that is an infrastructure failure, and the executor then
    excludes the execution instead of scoring it.
    """
    workspace = Path(workspace)
    if not workspace.exists():
        raise FileNotFoundError(f"workspace {workspace} of task {task.task_id} does not exist; cannot evaluate")
    if not workspace.is_dir():
        raise NotADirectoryError(f"workspace {workspace} of task {task.task_id} is not a directory; cannot evaluate")
    scores = []
    for rel, want in task.expected.items():
        got = _read_answer(workspace / rel)
        if got is None:
            scores.append(0.0)
            continue
        scores.append(numeric_credit(want, got) if task.kind == LONG_KIND else partial_credit(want, got))
    return sum(scores) / len(scores)


MAX_ANSWER_BYTES = 1 << 20


def _read_answer(path: Path) -> str | None:
    """The text of an answer file (its first ``MAX_ANSWER_BYTES``), or None unless it is a regular file with one
    link, opened without following a symlink or blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return None
        return os.read(fd, MAX_ANSWER_BYTES).decode("utf-8", errors="replace")
    finally:
        os.close(fd)
