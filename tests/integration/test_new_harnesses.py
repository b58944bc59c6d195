"""Harnesses first tried in issue 50, unmodified and pinned, against the proxy offline: Qwen Code (npm, the Qwen
family's own CLI, OpenAI chat, streamed) on the tiny model through the Executor, as the other CLIs of test_clis.py;
its default first request outgrows the stack's 16K context and is refused in OpenAI's words, which Qwen Code shows
and exits on (nothing yet to compress). The OpenHands agent needs Python >= 3.12 in its own venv: it runs where one
is on PATH (``python3.12``), and is skipped, saying so, where none is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_agents import EVALUATOR, on_npm_path, run_preset  # noqa: E402
from test_clis import common_checks  # noqa: E402

from gyre_jax.rollout import harnesses  # noqa: E402
from gyre_jax.rollout.harnesses import harness_spec  # noqa: E402

pytestmark = pytest.mark.slow


def test_qwen_code(stack, tmp_path, npm_bins, monkeypatch) -> None:
    spec = on_npm_path(monkeypatch, npm_bins, harness_spec("qwen-code", cmd=harnesses.QWEN_CODE_SMALL_CMD))
    result, exec_dir, logs = run_preset(stack, tmp_path, "qwen-0", spec, timeout_s=300, evaluator=EVALUATOR)
    records = common_checks(stack, result, "qwen-0", logs)
    assert all(r.api == "chat" for r in records)
    events = [json.loads(x) for x in (exec_dir / "harness.stdout").read_text().splitlines() if x.startswith("{")]
    said = [
        b["text"] for e in events if e["type"] == "assistant" for b in e["message"]["content"] if b["type"] == "text"
    ]
    parsed = [stack.parsed(r) for r in records]
    assert "".join(said) == "".join(p.content for p in parsed), logs  # what it was served is what was recorded
    assert events[-1]["type"] == "result" and not events[-1]["is_error"], logs
    assert (exec_dir / "harness" / "home" / ".qwen" / "settings.json").is_file()  # the preset's settings were read


def test_qwen_code_default_request_over_the_context_is_refused_in_openais_words(stack, tmp_path, npm_bins,
                                                                                   monkeypatch) -> None:  # fmt: skip
    spec = on_npm_path(monkeypatch, npm_bins, harness_spec("qwen-code"))  # its full default first request
    before = stack.proxy.admission_stats()["admitted"]
    result, exec_dir, logs = run_preset(stack, tmp_path, "qwen-big-0", spec, timeout_s=300, evaluator=EVALUATOR)
    assert result.status == "crashed" and result.model_calls == 0, logs
    assert result.refused_calls["context"] >= 1, result
    assert stack.proxy.admission_stats()["admitted"] > before
    events = [json.loads(x) for x in (exec_dir / "harness.stdout").read_text().splitlines() if x.startswith("{")]
    error = events[-1]["error"]["message"]
    assert "This model's maximum context length is 16384 tokens. However, your messages resulted in" in error, error


def python_312() -> str | None:
    """A Python 3.12 that runs (the preset's ``python3.12``): on PATH, else one of pyenv's versions."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    found = [shutil.which("python3.12"), *(str(p) for p in sorted(root.glob("versions/3.12*/bin/python3.12")))]
    for python in filter(None, found):
        done = subprocess.run([python, "-c", "import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        if done.returncode == 0:
            return done.stdout.strip()
    return None


def test_openhands_agent(stack, tmp_path) -> None:
    """The OpenHands SDK's default agent, headless, in its own venv (built here from the pinned release)."""
    python = python_312()
    if python is None:
        pytest.skip("openhands-sdk needs Python >= 3.12 (python3.12 on PATH, or a pyenv 3.12): none here")
    venv = tmp_path / "openhands-venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
    pins = [f"openhands-sdk=={harnesses.OPENHANDS_SDK_VERSION}", f"openhands-tools=={harnesses.OPENHANDS_SDK_VERSION}"]
    done = subprocess.run([sys.executable, "-m", "uv", "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
                           *pins], capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    cmd = " ".join([str(venv / "bin" / "python3.12"), *harnesses.PRESETS["openhands"].cmd[1:]])
    spec = harness_spec("openhands", cmd=cmd)
    assert harnesses.check_harness(spec) is None  # the pinned release
    result, exec_dir, logs = run_preset(stack, tmp_path, "openhands-0", spec, timeout_s=600, evaluator=EVALUATOR)
    common_checks(stack, result, "openhands-0", logs)
