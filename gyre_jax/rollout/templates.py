"""What a harness process gets for one execution: its command line and environment, filled from templates.

Placeholders (the list is in ``executor.py``'s docstring) are substituted in one pass, so a substituted value
is never expanded again; ``{task.FIELD}`` gives a task field (strings verbatim, others as JSON), and one
naming no field is an error (``check_task_fields``); any other brace is left alone. The environment holds
only a few basics (``ENV_KEEP``; credentials are dropped), PYTHONPATH to this checkout, the extra variables
(templated like the command) and the proxy's URLs with the execution's API key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from gyre_jax.rollout.tasks import Task

if TYPE_CHECKING:
    from gyre_jax.rollout.executor import ExecutionSpec

TASK_FIELDS = tuple(f.name for f in dataclasses.fields(Task))
_TASK_FIELD_RE = re.compile(r"\{task\.([A-Za-z_][A-Za-z0-9_]*)\}")
PLACEHOLDER_RE = re.compile(r"\{(?:task\.)?[A-Za-z_][A-Za-z0-9_]*\}")
# Environment variables a harness inherits (everything else, e.g. credentials, is dropped).
ENV_KEEP = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
)
REPO_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the gyre_jax package
TASK_FILE = "task.json"  # in the execution's directory: the task (tasks.Task JSON)
INSTRUCTION_FILE = "instruction.md"  # beside it: the task's instruction text


def check_task_fields(templates: Iterable[str]) -> None:
    """Raises ValueError for a ``{task.NAME}`` placeholder that names no task field."""
    for arg in templates:
        for name in _TASK_FIELD_RE.findall(arg):
            if name not in TASK_FIELDS:
                raise ValueError(
                    f"placeholder {{task.{name}}} in {arg!r} names no task field; task fields: {TASK_FIELDS}"
                )


def anthropic_base_url(base_url: str) -> str:
    """``base_url`` without its ``/v1``: the Anthropic SDK appends ``/v1/messages`` itself."""
    return base_url.rstrip("/").removesuffix("/v1")


def template_values(
    spec: ExecutionSpec,
    exec_dir: str,
    workspace: str,
    *,
    model_name: str,
    temperature: float,
    max_tokens: int,
    base_url: str,
    api_key: str,
    timeout_s: float,
) -> dict[str, str]:
    """Placeholder -> its value for one execution. ``exec_dir`` and ``workspace`` are the paths the harness
    sees (inside a sandbox: ``/gyre`` and ``/app``); ``{task}`` and ``{instruction_file}`` are in ``exec_dir``."""
    values = {
        "{task}": f"{exec_dir}/{TASK_FILE}",
        "{instruction_file}": f"{exec_dir}/{INSTRUCTION_FILE}",
        "{model}": model_name,
        "{temperature}": repr(float(temperature)),
        "{max_tokens}": str(int(max_tokens)),
        "{max_turns}": str(int(spec.task.max_turns)),
        "{seed}": str(int(spec.seed)),
        "{timeout_s}": str(int(timeout_s)) if float(timeout_s).is_integer() else repr(float(timeout_s)),
        "{workspace}": workspace,
        "{exec_dir}": exec_dir,
        "{execution_id}": spec.execution_id,
        "{base_url}": base_url,
        "{anthropic_base_url}": anthropic_base_url(base_url),
        "{api_key}": api_key,
    }
    values.update(task_values(spec.task))
    return values


def task_values(task: Task) -> dict[str, str]:
    """``{task.FIELD}`` -> the task's field: strings verbatim, other values as JSON."""
    values = {}
    for name in TASK_FIELDS:
        value = getattr(task, name)
        values["{task." + name + "}"] = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return values


def fill(template: str, values: Mapping[str, str]) -> str:
    """``template`` with its placeholders replaced (one pass: a substituted value is never expanded again)."""
    return PLACEHOLDER_RE.sub(lambda m: values.get(m.group(0), m.group(0)), template)


def harness_env(
    api_key: str, base_url: str, extra_env: Mapping[str, str], values: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The harness's whole environment; ``extra_env`` values are templates filled with ``values``."""
    env = {k: os.environ[k] for k in ENV_KEEP if k in os.environ}
    # This Python's bin first: a harness installed beside gyre-jax (mini-swe-agent, ...) is found by name.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")])
    pythonpath = os.environ.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + pythonpath if pythonpath else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: fill(v, values) if values else v for k, v in extra_env.items()})
    env["OPENAI_BASE_URL"] = base_url
    env["OPENAI_API_KEY"] = api_key
    env["ANTHROPIC_BASE_URL"] = anthropic_base_url(base_url)
    env["ANTHROPIC_API_KEY"] = api_key
    return env
