"""Agent harness presets: the one place that knows each harness's command line, environment, config files and
pinned install line.

A run config names a harness (``rollout.harness``, one of ``HARNESSES``); ``harness_spec`` turns that name, an
optional command line (``rollout.harness_cmd``, a shell-quoted string) and ``KEY=VALUE`` environment entries
(``rollout.harness_env``) into a ``HarnessSpec``. Everything in a spec is a template the executor fills per
execution (``PLACEHOLDERS``; ``{task.FIELD}`` too) — argv, environment values and file contents alike — so a
preset names no host path of its own: under a sandbox the executor's values are the inside paths (/app, /gyre).
``check_harness`` says before a run whether the harness's command is installed, and at the pinned version;
``check_in_sandbox`` that it runs inside the run's sandbox too (every path it needs visible there: a harness in a
venv under /tmp or $HOME needs ``rollout.sandbox_visible_paths``).

The presets (docs/harnesses.md has the table):

- ``reference``: gyre-jax's own harness (``python -m gyre_jax.rollout.harness``), run by this very interpreter.
- ``long``: gyre-jax's long-horizon harness for ``longlog`` tasks (``python -m gyre_jax.rollout.long_harness``):
  100+ calls, compaction into summary continuations, sub-agents.
- ``claude-code``: the Claude Code CLI in print mode (``claude -p``), stream-json output, permissions skipped
  (``IS_SANDBOX=1`` lets root do that), its state under ``{exec_dir}/home``.
- ``mini-swe-agent``: ``python -m minisweagent`` with our compact config (``harness_configs/mini_swe_agent.yaml``,
  written to ``{exec_dir}/mini_swe_agent.yaml``): mini's bash-tool action format, short templates, step limit
  ``{max_turns}``.
- ``codex``: ``codex exec`` with ``{exec_dir}/codex_home/config.toml`` naming the proxy as a Responses API
  provider.
- ``opencode``: ``opencode run`` with ``{exec_dir}/opencode.json`` naming the proxy as an OpenAI-compatible
  provider.
- ``qwen-code``: Qwen Code (``qwen``, the Qwen family's own CLI) headless, OpenAI chat API, tools auto-approved,
  stream-json output, its state and settings (no telemetry, no update checks) under ``{exec_dir}/home``.
- ``openhands``: an OpenHands SDK agent (``openhands-sdk`` with its terminal and file-editor tools) run headless by
  ``harness_configs/openhands_agent.py`` through litellm (OpenAI chat API); it needs Python >= 3.12 in its own
  venv: give that venv's interpreter as the command's first word (``rollout.harness_cmd``).
- ``llm``: Simon Willison's ``llm`` CLI, one prompt through OpenAI chat (``{exec_dir}/llm/extra-openai-models.yaml``
  names the proxy as a model): no tools, so no workspace changes; a plain client for the table.
- ``command``: any harness: ``rollout.harness_cmd`` is the whole command line (no files, no install line).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from gyre_jax.rollout import templates

HARNESSES = ("reference", "long", "claude-code", "mini-swe-agent", "codex", "opencode", "qwen-code", "openhands", "llm",
             "command")  # fmt: skip
# What the executor fills in a harness's argv, environment values and files (besides ``{task.FIELD}``).
PLACEHOLDERS = ("task", "instruction_file", "workspace", "exec_dir", "base_url", "anthropic_base_url", "api_key",
                "model", "temperature", "max_tokens", "seed", "execution_id", "timeout_s", "max_turns")  # fmt: skip
# Environment variables the executor always sets itself (the proxy's URLs and the execution's key).
EXECUTOR_ENV = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY")
# The harness command of the reference harness (``Executor``'s default ``harness_cmd``).
DEFAULT_HARNESS_CMD: tuple[str, ...] = (
    sys.executable, "-m", "gyre_jax.rollout.harness",
    "--task", "{task}", "--model", "{model}", "--temperature", "{temperature}",
    "--max-tokens", "{max_tokens}", "--seed", "{seed}",
)  # fmt: skip
# The long-horizon harness (``longlog`` tasks): the same arguments as the reference harness.
LONG_HARNESS_CMD: tuple[str, ...] = (sys.executable, "-m", "gyre_jax.rollout.long_harness", *DEFAULT_HARNESS_CMD[3:])

_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NESTED_RE = re.compile(r"\{\{(?:task\.)?[A-Za-z_][A-Za-z0-9_]*\}\}")  # ``{{task}}``: Jinja meeting a placeholder
_VERSION_RE = re.compile(r"\d+\.\d+(?:\.\d+)?[0-9A-Za-z.+-]*")  # 2.1.332, 0.36, 1.0.0rc1
_CONFIGS = Path(__file__).resolve().parent / "harness_configs"


class HarnessMissing(RuntimeError):
    """The harness's command is not installed (the message names it and its install line)."""


@dataclass(frozen=True)
class HarnessSpec:
    """One harness: what the executor runs and writes for an execution, all templates (``PLACEHOLDERS``).

    ``files`` maps a path relative to the execution directory to its content, written before the start;
    ``env`` is merged under the executor's own keys (``EXECUTOR_ENV``); ``version_cmd`` prints the installed
    version, compared with ``version`` (the pin; "" when there is none) by ``check_harness``.
    """

    name: str
    cmd: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    install: str = ""
    version_cmd: tuple[str, ...] = ()
    version: str = ""

    def __post_init__(self) -> None:
        if not self.cmd or not all(isinstance(a, str) for a in self.cmd) or not self.cmd[0]:
            raise ValueError(f"harness {self.name!r}: cmd {self.cmd!r} must be a non-empty tuple of strings")
        for rel in self.files:
            pure = PurePosixPath(rel)
            if not rel or pure.is_absolute() or ".." in pure.parts or "\\" in rel:
                raise ValueError(
                    f"harness {self.name!r}: file {rel!r} must be a relative path inside the execution directory"
                )


def _npm_preset(name: str, package: str, version: str, cmd: tuple[str, ...], env: dict[str, str],
                files: dict[str, str]) -> HarnessSpec:  # fmt: skip
    """A preset for an npm CLI installed globally (``npm install -g PACKAGE@VERSION``)."""
    return HarnessSpec(name, cmd, env, files, install=f"npm install -g {package}@{version}",
                       version_cmd=(cmd[0], "--version"), version=version)  # fmt: skip


CLAUDE_CODE_VERSION = "2.1.332"  # tests/integration/npm/package.json pins the same (test_harnesses checks)
CODEX_VERSION = "0.171.0"
OPENCODE_VERSION = "1.18.33"
MINI_SWE_AGENT_VERSION = "2.4.6"  # pyproject's test extra pins the same
QWEN_CODE_VERSION = "0.24.4"  # tests/integration/npm/package.json pins the same
OPENHANDS_SDK_VERSION = "1.58.2"  # openhands-sdk and openhands-tools, the same release
LLM_VERSION = "0.36"  # tests/integration/requirements-llm.txt pins the same

# ``rollout.harness_cmd`` for the claude-code preset that keeps Claude Code an agent (Bash, Read, Edit) with a
# first request of ~4.2K prompt tokens with a byte tokenizer (qwen3 tool format; ~0.8K with the compact one)
# instead of ~49K (36K): a short system prompt, three tools, ``--bare``; ``--tools Bash`` alone gives ~2.3K.
# docs/harnesses.md has the measurements; scripts/measure_claude_request.py makes them.
CLAUDE_CODE_SMALL_CMD = (
    "claude -p {task.instruction} --model {model} --max-turns {max_turns} --dangerously-skip-permissions "
    "--output-format stream-json --verbose --bare --tools Bash,Read,Edit --system-prompt "
    "'You are a coding agent. Use the tools to do the task in the current directory, then say Done.'"
)

# ``rollout.harness_cmd`` for the qwen-code preset with a first request of ~11.6K prompt tokens with a byte tokenizer
# (compact tool format) instead of ~64.7K: ``--bare`` (no auto-discovered context, skills or extensions), the shell
# tool alone and a short system prompt. docs/harnesses.md has the measurements.
QWEN_CODE_SMALL_CMD = (
    "qwen -p {task.instruction} -m {model} --auth-type openai --openai-base-url {base_url} --yolo --output-format "
    "stream-json --max-session-turns {max_turns} --bare --core-tools run_shell_command --system-prompt "
    "'You are a coding agent. Use the tools to do the task in the current directory, then say Done.'"
)

CODEX_CONFIG = """\
model = "{model}"
model_provider = "gyre"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[model_providers.gyre]
name = "gyre"
base_url = "{base_url}"
env_key = "OPENAI_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
"""

# opencode's config: the proxy as an OpenAI-compatible provider "gyre" (its API key read from the environment
# by opencode itself: ``{env:...}`` is opencode's syntax, not a placeholder), for the agent and the title calls.
OPENCODE_CONFIG = """\
{
  "$schema": "https://opencode.ai/config.json",
  "autoupdate": false,
  "share": "disabled",
  "model": "gyre/{model}",
  "small_model": "gyre/{model}",
  "provider": {
    "gyre": {
      "npm": "@ai-sdk/openai-compatible",
      "name": "gyre",
      "options": {"baseURL": "{base_url}", "apiKey": "{env:OPENAI_API_KEY}"},
      "models": {"{model}": {"name": "{model}", "limit": {"context": 0, "output": {max_tokens}}}}
    }
  }
}
"""


# Qwen Code's settings (its home's .qwen/settings.json): no usage statistics, telemetry or update checks offline.
QWEN_CODE_SETTINGS = """\
{
  "privacy": {"usageStatisticsEnabled": false},
  "telemetry": {"enabled": false},
  "general": {"disableAutoUpdate": true, "disableUpdateNag": true}
}
"""

# llm's own list of OpenAI-compatible models (its user directory, LLM_USER_PATH): the proxy as model "gyre". Its key is
# llm's "openai" key, read from OPENAI_API_KEY (without api_key_name, llm sends a dummy key to an api_base: a 401).
LLM_MODELS = """\
- model_id: gyre
  model_name: "{model}"
  api_base: "{base_url}"
  api_key_name: openai
  can_stream: true
"""


def _presets() -> dict[str, HarnessSpec]:
    """The named presets (``command`` has none: its command line is the user's)."""
    home = {"HOME": "{exec_dir}/home", "TERM": "dumb"}
    mini_cmd = (sys.executable, "-m", "minisweagent", "-m", "openai/{model}", "-t", "{task.instruction}", "--yolo",
                "--exit-immediately", "-c", "{exec_dir}/mini_swe_agent.yaml", "-o", "{exec_dir}/trajectory.json")  # fmt: skip
    mini_env = {**home, "MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1"}  # fmt: skip
    mini_version = (sys.executable, "-c", "import importlib.metadata as m; print(m.version('mini-swe-agent'))")
    claude_cmd = ("claude", "-p", "{task.instruction}", "--model", "{model}", "--max-turns", "{max_turns}",
                  "--dangerously-skip-permissions", "--output-format", "stream-json", "--verbose")  # fmt: skip
    claude_env = {
        **home,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "IS_SANDBOX": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    codex_cmd = ("codex", "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral", "--json",
                 "-o", "{exec_dir}/last_message.txt", "{task.instruction}")  # fmt: skip
    opencode_cmd = ("opencode", "run", "--format", "json", "--pure", "--auto", "{task.instruction}")
    opencode_env = {**home, "OPENCODE_CONFIG": "{exec_dir}/opencode.json", "OPENCODE_DISABLE_AUTOUPDATE": "1",
                    "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_SHARE": "1",
                    "npm_config_offline": "true"}  # its background plugin install then fails at once (a warning)  # fmt: skip
    mini_yaml = (_CONFIGS / "mini_swe_agent.yaml").read_text(encoding="utf-8")
    qwen_cmd = ("qwen", "-p", "{task.instruction}", "-m", "{model}", "--auth-type", "openai", "--openai-base-url",
                "{base_url}", "--yolo", "--output-format", "stream-json", "--max-session-turns", "{max_turns}")  # fmt: skip
    qwen_env = {**home, "OPENAI_MODEL": "{model}", "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1"}
    openhands_cmd = ("python3.12", "{exec_dir}/openhands_agent.py", "--model", "openai/{model}", "--base-url",
                     "{base_url}", "--max-iterations", "{max_turns}", "--max-tokens", "{max_tokens}",
                     "--instruction-file", "{instruction_file}")  # fmt: skip
    openhands_version = ("python3.12", "-c", "import importlib.metadata as m; print(m.version('openhands-sdk'))")
    openhands_agent = (Path(__file__).with_name("openhands_agent.py")).read_text(encoding="utf-8")
    llm_cmd = ("llm", "prompt", "-m", "gyre", "--no-log", "{task.instruction}")
    return {
        "reference": HarnessSpec("reference", DEFAULT_HARNESS_CMD, install="pip install gyre-jax (this package)"),
        "long": HarnessSpec("long", LONG_HARNESS_CMD, install="pip install gyre-jax (this package)"),
        "mini-swe-agent": HarnessSpec(
            "mini-swe-agent",
            mini_cmd,
            mini_env,
            {"mini_swe_agent.yaml": mini_yaml},
            install=f"pip install mini-swe-agent=={MINI_SWE_AGENT_VERSION}",
            version_cmd=mini_version,
            version=MINI_SWE_AGENT_VERSION,
        ),
        "claude-code": _npm_preset(
            "claude-code", "@anthropic-ai/claude-code", CLAUDE_CODE_VERSION, claude_cmd, claude_env, {}
        ),
        "codex": _npm_preset(
            "codex",
            "@openai/codex",
            CODEX_VERSION,
            codex_cmd,
            {**home, "CODEX_HOME": "{exec_dir}/codex_home"},
            {"codex_home/config.toml": CODEX_CONFIG},
        ),
        "opencode": _npm_preset(
            "opencode", "opencode-ai", OPENCODE_VERSION, opencode_cmd, opencode_env, {"opencode.json": OPENCODE_CONFIG}
        ),
        "qwen-code": _npm_preset(
            "qwen-code",
            "@qwen-code/qwen-code",
            QWEN_CODE_VERSION,
            qwen_cmd,
            qwen_env,
            {"home/.qwen/settings.json": QWEN_CODE_SETTINGS},
        ),  # fmt: skip
        "openhands": HarnessSpec(
            "openhands",
            openhands_cmd,
            {**home, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "OPENHANDS_SUPPRESS_BANNER": "1"},
            {"openhands_agent.py": openhands_agent},
            install=f"python3.12 -m venv VENV && VENV/bin/pip install openhands-sdk=={OPENHANDS_SDK_VERSION} "
            f"openhands-tools=={OPENHANDS_SDK_VERSION} (then rollout.harness_cmd starts with VENV/bin/python)",
            version_cmd=openhands_version,
            version=OPENHANDS_SDK_VERSION,
        ),
        "llm": HarnessSpec(
            "llm",
            llm_cmd,
            {**home, "LLM_USER_PATH": "{exec_dir}/llm"},
            {"llm/extra-openai-models.yaml": LLM_MODELS},
            install=f"pip install llm=={LLM_VERSION}",
            version_cmd=("llm", "--version"),
            version=LLM_VERSION,
        ),
    }


PRESETS: dict[str, HarnessSpec] = _presets()


def harness_spec(name: str, cmd: str = "", env: Sequence[str] = ()) -> HarnessSpec:
    """The harness ``name`` (one of ``HARNESSES``): its preset, with ``cmd`` (a shell-quoted command line, parsed
    with shlex) replacing the preset's argv when given and ``env`` ("KEY=VALUE" templates) overriding or adding
    variables. ``command`` has no preset: ``cmd`` is required and the spec has no files, install line or pin.

    A ``cmd`` whose program differs from the preset's (another name than ``claude``, say) drops the version check.
    Raises ValueError (one line: what is wrong, what to do) for an unknown name, ``command`` without ``cmd``, a
    command line shlex cannot split, a bad env entry, or a placeholder the executor does not fill.
    """
    if name not in HARNESSES:
        raise ValueError(f"unknown harness {name!r}: rollout.harness must be one of {HARNESSES}")
    if name == "command" and not cmd.strip():
        raise ValueError(
            "harness 'command' needs rollout.harness_cmd, the command line to run, e.g. "
            "'python my_agent.py --task {task} --model {model}' (placeholders: see docs/harnesses.md)"
        )
    base = PRESETS.get(name) or HarnessSpec(name, ("true",))
    argv = _split_cmd(cmd) if cmd.strip() else base.cmd
    version_cmd, version = base.version_cmd, base.version
    if argv[0] != base.cmd[0] and os.path.basename(argv[0]) != os.path.basename(base.cmd[0]):
        version_cmd, version = (), ""  # another program: its version is unknown
    elif version_cmd and version_cmd[0] == base.cmd[0]:
        version_cmd = (argv[0], *version_cmd[1:])  # the same program at another path: ask that one
    spec = HarnessSpec(name, argv, {**base.env, **_parse_env(env)}, dict(base.files), base.install, version_cmd,
                       version)  # fmt: skip
    check_placeholders(spec)
    return spec


def _split_cmd(cmd: str) -> tuple[str, ...]:
    try:
        argv = tuple(shlex.split(cmd))
    except ValueError as exc:
        raise ValueError(
            f"rollout.harness_cmd {cmd!r} is not a shell-quoted command line ({exc}); fix its quotes"
        ) from exc
    return argv


def _parse_env(entries: Sequence[str]) -> dict[str, str]:
    """``["KEY=VALUE", ...]`` -> {KEY: VALUE}; ValueError naming the bad entry."""
    if isinstance(entries, str):
        raise ValueError(f"rollout.harness_env must be a list of 'KEY=VALUE' strings, got the string {entries!r}")
    env: dict[str, str] = {}
    for entry in entries:
        key, sep, value = entry.partition("=") if isinstance(entry, str) else ("", "", "")
        if not sep or not _ENV_KEY_RE.fullmatch(key):
            raise ValueError(
                f"rollout.harness_env entry {entry!r} must be 'KEY=VALUE' with KEY a variable name ([A-Za-z_][A-Za-z0-9_]*)"
                "; on the command line bare text splits at commas: for a comma inside a value give a Python tuple, "
                "--config.rollout.harness_env=\"('KEY=a,b', 'OTHER=c')\" (docs/harnesses.md)"
            )
        if key in EXECUTOR_ENV:
            raise ValueError(
                f"rollout.harness_env entry {entry!r}: {key} is set by the executor (the proxy's URL or the "
                "execution's key) and cannot be overridden; remove it"
            )
        env[key] = value
    return env


def check_placeholders(spec: HarnessSpec) -> None:
    """Raises ValueError for a ``{name}`` in the spec's argv, env values or files that the executor does not fill
    (``PLACEHOLDERS``, ``{task.FIELD}``), or a placeholder inside Jinja's double braces in a file."""
    known = {"{" + p + "}" for p in PLACEHOLDERS} | {"{task." + f + "}" for f in templates.TASK_FIELDS}
    parts = [("argv", a) for a in spec.cmd] + [(f"env {k}", v) for k, v in spec.env.items()]
    parts += [(f"file {rel}", text) for rel, text in spec.files.items()]
    for where, text in parts:
        for match in templates.PLACEHOLDER_RE.finditer(text):
            if match.group(0) not in known:
                raise ValueError(
                    f"harness {spec.name!r}: placeholder {match.group(0)} in {where} is not filled by the executor; "
                    f"use one of {{{'}, {'.join(PLACEHOLDERS)}}} or {{task.FIELD}} (FIELD in {templates.TASK_FIELDS})"
                )
        nested = _NESTED_RE.search(text) if where.startswith("file") else None
        if nested:
            raise ValueError(
                f"harness {spec.name!r}: {nested.group(0)} in {where} would have its inner placeholder filled; "
                "write a Jinja variable with spaces ({{ name }})"
            )


def fill_spec(spec: HarnessSpec, values: Mapping[str, str]) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(argv, env, files) of ``spec`` with ``values`` (placeholder -> value, as ``templates.template_values``
    gives) substituted in one pass each; unknown braces are left alone."""
    argv = [templates.fill(a, values) for a in spec.cmd]
    env = {k: templates.fill(v, values) for k, v in spec.env.items()}
    files = {rel: templates.fill(text, values) for rel, text in spec.files.items()}
    return argv, env, files


def write_files(files: Mapping[str, str], exec_dir: Path) -> None:
    """Writes each ``relative path -> content`` of (filled) ``files`` under ``exec_dir``, creating folders."""
    for rel, text in files.items():
        path = Path(exec_dir) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def check_harness(spec: HarnessSpec, path: str | None = None) -> str | None:
    """Checks that ``spec``'s program is installed: its argv[0] on ``path`` (default: this process's PATH), and
    for ``python -m MODULE`` that the interpreter finds the module.

    Raises HarnessMissing naming the harness, the missing command and the install line. Returns a warning (one
    line) when the installed version differs from the pin or cannot be read, None otherwise.
    """
    search = os.environ.get("PATH", "") if path is None else path
    program = shutil.which(spec.cmd[0], path=search)
    install = (
        f"install it with: {spec.install}"
        if spec.install
        else "install it, or give its full path in rollout.harness_cmd"
    )
    if program is None:
        raise HarnessMissing(
            f"harness {spec.name!r}: command {spec.cmd[0]!r} is not found (PATH={search!r}); {install}"
        )
    if len(spec.cmd) > 2 and spec.cmd[1] == "-m":
        module = spec.cmd[2]
        probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
        found = _run([program, "-c", probe], search)
        if found is None or found.returncode != 0:
            raise HarnessMissing(f"harness {spec.name!r}: {program} cannot import module {module!r}; {install}")
    if not (spec.version and spec.version_cmd):
        return None
    return _version_warning(spec, search)


VISIBLE_KEY = "rollout.sandbox_visible_paths"  # the config key of host paths a sandbox keeps visible, read-only


def needed_paths(spec: HarnessSpec, path: str) -> list[str]:
    """Host paths the harness's command needs to see: its program as found on ``path`` (and where a link points),
    the interpreter of a script program's ``#!`` line, and every argument that is an existing absolute host path
    (a script file). Placeholders are not paths (they are filled with inside paths per execution)."""
    found = shutil.which(spec.cmd[0], path=path)
    paths = [found, os.path.realpath(found)] if found else []
    if found:
        try:
            with open(found, "rb") as f:
                head = f.readline(256)
        except OSError:
            head = b""
        if head.startswith(b"#!"):
            interpreter = head[2:].decode("utf-8", "replace").split()
            if interpreter and interpreter[0].startswith("/") and not interpreter[0].endswith("/env"):
                paths += [interpreter[0], os.path.realpath(interpreter[0])]
    paths += [a for a in spec.cmd[1:] if a.startswith("/") and "{" not in a and os.path.exists(a)]
    return list(dict.fromkeys(paths))


def install_root(path: str) -> str:
    """What to keep visible for ``path``: the virtual environment holding it (a folder with ``pyvenv.cfg``), the
    folder holding its ``node_modules``, else its own folder."""
    parts = Path(path).parts
    for i in range(len(parts) - 1, 1, -1):
        here = Path(*parts[:i])
        if (here / "pyvenv.cfg").is_file():
            return str(here)
        if parts[i - 1] == "node_modules":
            return str(Path(*parts[: i - 1]))
    return str(Path(path).parent)


def probe_env(spec: HarnessSpec) -> dict[str, str]:
    """The environment a harness gets (``templates.harness_env``: PATH with this Python's bin first, the preset's
    variables), its execution paths filled with /tmp, for running its checks before any execution exists."""
    values = {"{exec_dir}": "/tmp", "{workspace}": "/tmp"}
    return templates.harness_env("", "", spec.env, values)


def check_in_sandbox(spec: HarnessSpec, sandbox, env: Mapping[str, str]) -> None:
    """Before any work: the harness runs inside ``sandbox`` (a ``rollout.sandbox.Sandbox`` that maps paths: bwrap),
    as it will for every execution. Probes there that each of ``needed_paths`` is visible, then runs the spec's
    version command there (``version_cmd``) with the harness's environment ``env``. Raises HarnessMissing naming
    the path the sandbox does not show and the config key that keeps it visible, or the version command's failure.
    A sandbox that does not map host paths ("none") or runs an image of its own ("docker") is not probed."""
    if getattr(sandbox, "name", "none") != "bwrap":
        return
    from gyre_jax.rollout.sandbox import Launch

    search = env.get("PATH", "")
    paths = needed_paths(spec, search)
    probe = ["/bin/sh", "-c", 'for p do [ -e "$p" ] || printf "%s\\n" "$p"; done', "sh", *paths]
    done = _run_in(sandbox, Launch(argv=probe, cwd="/", env=dict(env), mounts=(), network="none"))
    missing = [line for line in (done.stdout if done else "").splitlines() if line]
    if done is None or done.returncode != 0:
        detail = "it did not start" if done is None else f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
        raise HarnessMissing(f"harness {spec.name!r}: the {sandbox.name} sandbox cannot run a probe ({detail})")
    if missing:
        roots = list(dict.fromkeys(install_root(m) for m in missing))
        value = "(" + ", ".join(f'"{r}"' for r in roots) + ",)"
        raise HarnessMissing(
            f"harness {spec.name!r}: {missing[0]} is not visible inside the {sandbox.name} sandbox (it gives each "
            f"execution its own empty /tmp and /run and hides $HOME and the run directory), so {spec.cmd[0]!r} "
            f"cannot run there; keep its install visible, read-only, with --config.{VISIBLE_KEY}='{value}' "
            '(docs/harnesses.md, "Harnesses in a sandbox")'
        )
    if not spec.version_cmd:
        return
    done = _run_in(sandbox, Launch(argv=list(spec.version_cmd), cwd="/", env=dict(env), mounts=(), network="none"))
    if done is None or done.returncode != 0:
        detail = (
            "it did not start"
            if done is None
            else f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}"
        )
        raise HarnessMissing(
            f"harness {spec.name!r}: its version command {' '.join(spec.version_cmd)!r} runs on the host but fails "
            f"inside the {sandbox.name} sandbox ({detail}); if it needs files outside the system paths, keep them "
            f'visible with --config.{VISIBLE_KEY} (docs/harnesses.md, "Harnesses in a sandbox")'
        )


def _run_in(sandbox, launch) -> subprocess.CompletedProcess[str] | None:
    """``launch`` run to its end in ``sandbox`` (60 s at most); None when it cannot run at all."""
    prepared = sandbox.prepare(launch)
    try:
        return subprocess.run(prepared.argv, capture_output=True, text=True, timeout=60, env=prepared.env,
                              cwd=prepared.cwd, stdin=subprocess.DEVNULL)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    finally:
        prepared.cleanup()


def _run(argv: Sequence[str], search: str) -> subprocess.CompletedProcess[str] | None:
    """``argv`` run with PATH=``search`` (60 s at most: opencode's binary takes seconds to start); None when it
    cannot run at all."""
    env = {**os.environ, "PATH": search}
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _version_warning(spec: HarnessSpec, search: str) -> str | None:
    """None when ``spec.version_cmd`` prints the pinned version; else a one-line warning."""
    program = shutil.which(spec.version_cmd[0], path=search) or spec.version_cmd[0]
    done = _run([program, *spec.version_cmd[1:]], search)
    shown = " ".join(spec.version_cmd)
    if done is None or done.returncode != 0:
        detail = "" if done is None else f" (exit {done.returncode}: {(done.stderr or done.stdout).strip()[-200:]})"
        return f"harness {spec.name!r}: could not read the installed version with {shown!r}{detail}; pinned is {spec.version}"
    found = _VERSION_RE.findall(done.stdout)
    if spec.version in found:
        return None
    return (
        f"harness {spec.name!r}: installed version {found[0] if found else done.stdout.strip()[:80]!r} differs from "
        f"the pinned {spec.version} (tested with it); to match: {spec.install}"
    )
