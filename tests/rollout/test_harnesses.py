"""Harness presets (gyre_jax/rollout/harnesses.py): filled with the executor's values they leave no placeholder
and no host path; overrides; every error; check_harness on a fake PATH; the pins match the test installs."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from gyre_jax.rollout import harnesses, templates
from gyre_jax.rollout.executor import DEFAULT_HARNESS_CMD, ExecutionSpec
from gyre_jax.rollout.harnesses import (
    HARNESSES,
    PLACEHOLDERS,
    HarnessMissing,
    HarnessSpec,
    check_harness,
    check_placeholders,
    fill_spec,
    harness_spec,
    write_files,
)
from gyre_jax.rollout.tasks import Task

REPO = Path(__file__).resolve().parents[2]
NAMED = [n for n in HARNESSES if n != "command"]
BASE_URL = "http://127.0.0.1:8123/v1"
# An absolute path not inside a URL or a relative path: a "/" after no word character, ":", "/", "." or "<".
ABS_PATH_RE = re.compile(r"(?<![\w:/.<])/[\w.-]+(?:/[\w.-]+)*")


def sandbox_values() -> dict[str, str]:
    """What the executor fills under a sandbox (inside paths /gyre and /app), plus the placeholders it adds."""
    task = Task(task_id="t1", kind="reverse", system="", instruction="Reverse {input.txt} into answer.txt.",
                files={}, expected={"answer.txt": "x"}, tools=[], max_turns=3, tool_latency_median_s=0.0, tool_latency_sigma=0.0)  # fmt: skip
    spec = ExecutionSpec("exec-1", task, "t1", seed=7)
    values = templates.template_values(spec, "/gyre", "/app", model_name="gyre-tiny", temperature=1.0, max_tokens=24,
                                       base_url=BASE_URL, api_key="key-1", timeout_s=300)  # fmt: skip
    assert values["{task}"] == "/gyre/task.json" and values["{instruction_file}"] == "/gyre/instruction.md"
    assert values["{max_turns}"] == "3" and values["{timeout_s}"] == "300" and values["{api_key}"] == "key-1"
    assert set(values) >= {"{" + p + "}" for p in PLACEHOLDERS}
    return values


@pytest.mark.parametrize("name", NAMED)
def test_preset_fills_completely_without_host_paths(name: str) -> None:
    spec = harness_spec(name)
    argv, env, files = fill_spec(spec, sandbox_values())
    assert argv[0] in (spec.cmd[0], sys.executable) and "/" not in argv[0] or argv[0] == sys.executable
    texts = [*argv[1:], *env.values(), *files.values()]
    for text in texts:
        assert not templates.PLACEHOLDER_RE.search(text), (name, text)
        for path in ABS_PATH_RE.findall(text):
            assert path.startswith(("/gyre", "/app")), (name, path, text)
    assert env.get("HOME", "/gyre/home") == "/gyre/home"
    assert not set(env) & set(harnesses.EXECUTOR_ENV)


def test_preset_commands() -> None:
    assert harness_spec("reference").cmd == DEFAULT_HARNESS_CMD
    claude, _, _ = fill_spec(harness_spec("claude-code"), sandbox_values())
    assert claude[:3] == ["claude", "-p", "Reverse {input.txt} into answer.txt."]  # a value is never re-expanded
    assert claude[claude.index("--max-turns") + 1] == "3" and "--dangerously-skip-permissions" in claude
    assert claude[claude.index("--output-format") + 1] == "stream-json"
    assert harness_spec("claude-code").env["IS_SANDBOX"] == "1"
    mini, _, _ = fill_spec(harness_spec("mini-swe-agent"), sandbox_values())
    assert mini[:3] == [sys.executable, "-m", "minisweagent"] and "/gyre/mini_swe_agent.yaml" in mini


def test_config_files_parse_with_the_values() -> None:
    _, _, mini = fill_spec(harness_spec("mini-swe-agent"), sandbox_values())
    config = yaml.safe_load(mini["mini_swe_agent.yaml"])
    assert config["agent"]["step_limit"] == 3 and config["agent"]["cost_limit"] == 0
    assert config["model"]["model_kwargs"] == {"drop_params": True, "api_base": BASE_URL, "max_tokens": 24}
    assert "{{ task }}" in config["agent"]["instance_template"]  # mini's own Jinja variable, left for mini
    assert len(config["agent"]["system_template"]) + len(config["agent"]["instance_template"]) < 600
    _, codex_env, codex = fill_spec(harness_spec("codex"), sandbox_values())
    toml = tomllib.loads(codex["codex_home/config.toml"])
    assert toml["model"] == "gyre-tiny" and toml["model_providers"]["gyre"]["base_url"] == BASE_URL
    assert toml["model_providers"]["gyre"]["wire_api"] == "responses" and codex_env["CODEX_HOME"] == "/gyre/codex_home"
    _, opencode_env, opencode = fill_spec(harness_spec("opencode"), sandbox_values())
    config = json.loads(opencode["opencode.json"])
    provider = config["provider"]["gyre"]
    assert config["model"] == "gyre/gyre-tiny" and provider["options"]["baseURL"] == BASE_URL
    assert provider["options"]["apiKey"] == "{env:OPENAI_API_KEY}"  # opencode's syntax, not ours
    assert provider["models"]["gyre-tiny"]["limit"]["output"] == 24
    assert opencode_env["OPENCODE_CONFIG"] == "/gyre/opencode.json"


def test_write_files(tmp_path: Path) -> None:
    _, _, files = fill_spec(harness_spec("codex"), sandbox_values())
    write_files(files, tmp_path)
    assert (tmp_path / "codex_home" / "config.toml").read_text() == files["codex_home/config.toml"]


def test_overrides() -> None:
    spec = harness_spec("claude-code", cmd="/opt/bin/claude -p '{task.instruction}' --tools Bash",
                        env=["HOME=/tmp/h", "EXTRA=a=b {exec_dir}"])  # fmt: skip
    assert spec.cmd == ("/opt/bin/claude", "-p", "{task.instruction}", "--tools", "Bash")
    assert spec.env["HOME"] == "/tmp/h" and spec.env["EXTRA"] == "a=b {exec_dir}" and spec.env["IS_SANDBOX"] == "1"
    assert spec.version_cmd == ("/opt/bin/claude", "--version") and spec.version == harnesses.CLAUDE_CODE_VERSION
    other = harness_spec("codex", cmd="my-codex-wrapper exec {task.instruction}")
    assert other.version == "" and other.version_cmd == () and other.files == harness_spec("codex").files
    command = harness_spec("command", cmd="python agent.py --task {task} --url {base_url}", env=["A=1"])
    assert command.cmd == ("python", "agent.py", "--task", "{task}", "--url", "{base_url}")
    assert (command.env, command.files, command.install, command.version) == ({"A": "1"}, {}, "", "")


@pytest.mark.parametrize(
    ("name", "cmd", "env", "message"),
    [
        ("claude", "", (), "unknown harness 'claude': rollout.harness must be one of"),
        ("command", "", (), "harness 'command' needs rollout.harness_cmd"),
        ("command", "  ", (), "harness 'command' needs rollout.harness_cmd"),
        ("command", "run 'unclosed", (), "is not a shell-quoted command line"),
        ("command", "run {nope}", (), "placeholder {nope} in argv is not filled by the executor"),
        ("command", "run {task.nope}", (), "placeholder {task.nope} in argv is not filled by the executor"),
        ("codex", "", ("NOEQUALS",), "entry 'NOEQUALS' must be 'KEY=VALUE'"),
        ("codex", "", ("1BAD=x",), "entry '1BAD=x' must be 'KEY=VALUE'"),
        ("codex", "", ("OPENAI_API_KEY=x",), "OPENAI_API_KEY is set by the executor"),
        ("codex", "", ("X={workdir}",), "placeholder {workdir} in env X is not filled"),
        ("codex", "", "A=1", "must be a list of 'KEY=VALUE' strings"),
    ],
)
def test_errors(name: str, cmd: str, env, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        harness_spec(name, cmd, env)


def test_spec_errors() -> None:
    with pytest.raises(ValueError, match=re.escape("{{task}} in file a.yaml would have its inner placeholder filled")):
        check_placeholders(HarnessSpec("x", ("run",), files={"a.yaml": "t: {{task}}"}))
    with pytest.raises(ValueError, match="placeholder {nope} in file a.yaml"):
        check_placeholders(HarnessSpec("x", ("run",), files={"a.yaml": "t: {nope}"}))
    for bad in ("../x", "/etc/x", ""):
        with pytest.raises(ValueError, match="must be a relative path inside the execution directory"):
            HarnessSpec("x", ("run",), files={bad: ""})
    with pytest.raises(ValueError, match="must be a non-empty tuple of strings"):
        HarnessSpec("x", ())


def fake_program(directory: Path, name: str, script: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_check_harness_fake_path(tmp_path: Path) -> None:
    spec = harness_spec("claude-code")
    with pytest.raises(HarnessMissing) as missing:
        check_harness(spec, path=str(tmp_path))
    assert "harness 'claude-code': command 'claude' is not found" in str(missing.value)
    assert "install it with: npm install -g @anthropic-ai/claude-code@2.1.332" in str(missing.value)
    fake_program(tmp_path, "claude", f"echo '{harnesses.CLAUDE_CODE_VERSION} (Claude Code)'")
    assert check_harness(spec, path=str(tmp_path)) is None
    fake_program(tmp_path, "claude", "echo '2.0.9 (Claude Code)'")
    warning = check_harness(spec, path=str(tmp_path))
    assert "installed version '2.0.9' differs from the pinned 2.1.332" in warning and spec.install in warning
    fake_program(tmp_path, "claude", "echo broken >&2; exit 3")
    assert "could not read the installed version with 'claude --version' (exit 3: broken)" in check_harness(
        spec, path=str(tmp_path)
    )
    with pytest.raises(HarnessMissing, match="install it, or give its full path in rollout.harness_cmd"):
        check_harness(harness_spec("command", cmd="my-agent {task}"), path=str(tmp_path))


def test_check_harness_python_modules(tmp_path: Path) -> None:
    assert check_harness(harness_spec("reference")) is None
    assert check_harness(harness_spec("mini-swe-agent")) is None  # a test dependency, at the pin
    spec = HarnessSpec("x", (sys.executable, "-m", "no_such_module_gyre"), install="pip install nothing")
    with pytest.raises(HarnessMissing, match="cannot import module 'no_such_module_gyre'; install it with: pip"):
        check_harness(spec)


def test_pins_match_the_test_installs() -> None:
    npm = json.loads((REPO / "tests" / "integration" / "npm" / "package.json").read_text())["dependencies"]
    assert npm == {
        "@anthropic-ai/claude-code": harnesses.CLAUDE_CODE_VERSION,
        "@openai/codex": harnesses.CODEX_VERSION,
        "@qwen-code/qwen-code": harnesses.QWEN_CODE_VERSION,
        "opencode-ai": harnesses.OPENCODE_VERSION,
    }
    for name, package in (("claude-code", "@anthropic-ai/claude-code"), ("codex", "@openai/codex"),
                          ("opencode", "opencode-ai"), ("qwen-code", "@qwen-code/qwen-code")):  # fmt: skip
        spec = harness_spec(name)
        assert spec.install == f"npm install -g {package}@{npm[package]}" and spec.version == npm[package]
    llm = (REPO / "tests" / "integration" / "requirements-llm.txt").read_text().splitlines()
    assert (
        f"llm=={harnesses.LLM_VERSION}" in llm
        and harness_spec("llm").install == f"pip install llm=={harnesses.LLM_VERSION}"
    )
    openhands = harness_spec("openhands")
    assert f"openhands-sdk=={harnesses.OPENHANDS_SDK_VERSION}" in openhands.install
    assert openhands.version == harnesses.OPENHANDS_SDK_VERSION
    test_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert f"mini-swe-agent=={harnesses.MINI_SWE_AGENT_VERSION}" in test_extra
    assert harness_spec("mini-swe-agent").install == f"pip install mini-swe-agent=={harnesses.MINI_SWE_AGENT_VERSION}"


def test_claude_code_small_command() -> None:
    spec = harness_spec("claude-code", cmd=harnesses.CLAUDE_CODE_SMALL_CMD)
    argv, _, _ = fill_spec(spec, sandbox_values())
    assert argv[:3] == ["claude", "-p", "Reverse {input.txt} into answer.txt."] and "--bare" in argv
    assert argv[argv.index("--tools") + 1] == "Bash,Read,Edit" and argv[-2] == "--system-prompt"
    assert spec.version == harnesses.CLAUDE_CODE_VERSION and spec.env == harness_spec("claude-code").env


def _venv_tool(root: Path) -> Path:
    """A program installed in a venv under ``root``: a ``#!<venv>/bin/python`` script, as pip installs one."""
    import subprocess

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    tool = root / "venv" / "bin" / "mytool"
    tool.write_text(f"#!{root}/venv/bin/python\nprint('mytool 1.0')\n")
    tool.chmod(0o755)
    return tool


def test_a_harness_in_a_tmp_venv_runs_in_bwrap_only_when_its_path_is_declared(tmp_path: Path) -> None:
    """``check_in_sandbox``: bwrap gives each execution an empty /tmp, so a venv under /tmp is invisible there until
    ``rollout.sandbox_visible_paths`` names it; the refusal names the path and the key, with the value to set."""
    import shutil

    from gyre_jax.rollout.harnesses import check_in_sandbox, install_root, needed_paths, probe_env
    from gyre_jax.rollout.sandbox import make_sandbox

    if shutil.which("bwrap") is None:
        if os.geteuid() == 0:
            pytest.fail("bwrap is not installed; CI installs it: apt-get install -y bubblewrap")
        pytest.skip("bwrap is not installed and this is not root (install: sudo apt-get install -y bubblewrap)")
    assert str(tmp_path).startswith("/tmp/")
    tool = _venv_tool(tmp_path)
    spec = harness_spec("command", f"{tool} --task {{task}}")
    env = probe_env(spec)
    python = f"{tmp_path}/venv/bin/python"
    assert needed_paths(spec, env["PATH"]) == [str(tool), python, os.path.realpath(python)]  # the #! interpreter too
    assert install_root(str(tool)) == str(tmp_path / "venv")
    hidden = make_sandbox("bwrap", proxy_address=None, state_dir=tmp_path)
    with pytest.raises(HarnessMissing) as info:
        check_in_sandbox(spec, hidden, env)
    assert str(info.value).startswith(f"harness 'command': {tool} is not visible inside the bwrap sandbox")
    assert f"--config.rollout.sandbox_visible_paths='(\"{tmp_path}/venv\",)'" in str(info.value)
    shown = make_sandbox("bwrap", proxy_address=None, state_dir=tmp_path, visible=[tmp_path / "venv"])
    check_in_sandbox(spec, shown, env)  # every path visible; no version command for "command"
    # a preset's own version command runs inside the sandbox too: the same program through the llm preset's check
    versioned = dataclasses.replace(spec, version_cmd=(str(tool),), version="1.0")
    check_in_sandbox(versioned, shown, env)
    broken = dataclasses.replace(spec, version_cmd=(str(tool), "-c"), version="1.0")
    (tmp_path / "venv" / "bin" / "mytool").write_text(f"#!{tmp_path}/venv/bin/python\nraise SystemExit(3)\n")
    with pytest.raises(HarnessMissing, match=r"its version command .* fails inside the bwrap sandbox \(exit 3"):
        check_in_sandbox(broken, shown, env)


def test_the_openhands_agent_is_a_brace_free_template_and_says_what_python_it_needs(tmp_path: Path) -> None:
    import subprocess

    spec = harness_spec("openhands")
    assert "{" not in spec.files["openhands_agent.py"]  # a preset file is a template: nothing of it is filled
    script = tmp_path / "openhands_agent.py"
    script.write_text(spec.files["openhands_agent.py"])
    (tmp_path / "instruction.md").write_text("do it")
    done = subprocess.run([sys.executable, str(script), "--model", "openai/m", "--base-url", BASE_URL,
                           "--instruction-file", str(tmp_path / "instruction.md")], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    if sys.version_info < (3, 12):  # this machine's Python: the agent refuses in one line instead of a SyntaxError
        assert done.returncode == 1 and done.stderr.startswith("openhands-sdk needs Python >= 3.12; this is 3.")
