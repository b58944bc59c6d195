"""Real agent harnesses, unmodified, run by the Executor against the tiny model through the proxy, offline:
``mini-swe-agent`` (PyPI, OpenAI API through litellm) and the Claude Code CLI (npm, Anthropic API).

Each run must end (finished, or killed at its timeout), leave records whose token ids decode and
parse to exactly what the client received, and be scored by an evaluator.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from timelimits import scaled

from gyre_jax.rollout.executor import ExecutionSpec, Executor
from gyre_jax.rollout.harnesses import CLAUDE_CODE_SMALL_CMD, HarnessSpec, check_harness, harness_spec
from gyre_jax.rollout.tasks import ANSWER_FILE, INPUT_FILE, Task, evaluate

pytestmark = pytest.mark.slow

# Scores 1 when answer.txt holds input.txt reversed, 0.5 when it exists, else 0 (prints the score last).
EVALUATOR = [sys.executable, "-c",
             "import pathlib as p; a = p.Path('answer.txt'); i = p.Path('input.txt').read_text().strip()\n"
             "print('checked'); print(1.0 if a.exists() and a.read_text().strip() == i[::-1] else 0.5 if a.exists() else 0.0)"]  # fmt: skip


def make_task(task_id: str) -> Task:
    return Task(task_id=task_id, kind="reverse", system="", instruction="Write input.txt reversed to answer.txt.",
                files={INPUT_FILE: "12345"}, expected={ANSWER_FILE: "54321"}, tools=[], max_turns=4,
                tool_latency_median_s=0.0, tool_latency_sigma=0.0)  # fmt: skip


def run_one(stack, tmp_path: Path, execution_id: str, harness_cmd: list[str], extra_env: dict[str, str], timeout_s: float,
            evaluator=evaluate):  # fmt: skip
    executor = Executor(stack.proxy, stack.proxy.base_url, tmp_path / "executions", model_name="gyre-tiny",
                        timeout_s=scaled(timeout_s), max_parallel=1, temperature=1.0, max_tokens=24,
                        evaluator_timeout_s=scaled(30),
                        harness_cmd=harness_cmd, evaluator=evaluator, extra_env=extra_env)  # fmt: skip
    return execute(executor, tmp_path, execution_id)


def execute(executor: Executor, tmp_path: Path, execution_id: str):
    """Runs the one task ``execution_id``; (result, its execution directory, the tail of the harness's output)."""
    [result] = executor.run([ExecutionSpec(execution_id, make_task(execution_id), execution_id, seed=0)])
    exec_dir = tmp_path / "executions" / execution_id
    logs = (exec_dir / "harness.stdout").read_text(errors="replace")[-3000:] + (exec_dir / "harness.stderr").read_text(
        errors="replace"
    )[-3000:]
    return result, exec_dir, logs


def run_preset(stack, tmp_path: Path, execution_id: str, spec: HarnessSpec, timeout_s: float, evaluator=evaluate):
    """``run_one`` for a harness preset: its command, environment and files, as a run config's harness."""
    executor = Executor(stack.proxy, stack.proxy.base_url, tmp_path / "executions", model_name="gyre-tiny",
                        timeout_s=scaled(timeout_s), max_parallel=1, temperature=1.0, max_tokens=24,
                        evaluator_timeout_s=scaled(30),
                        evaluator=evaluator, harness_cmd=list(spec.cmd), extra_env=dict(spec.env),
                        harness_files=dict(spec.files))  # fmt: skip
    return execute(executor, tmp_path, execution_id)


def on_npm_path(monkeypatch, npm_bins: dict[str, Path], spec: HarnessSpec) -> HarnessSpec:
    """``spec`` unchanged, with the npm CLIs' folder first on PATH (harnesses inherit PATH) as a global install
    would have them; the installed CLI must be the one the preset pins (``check_harness``: no warning)."""
    monkeypatch.setenv("PATH", f"{next(iter(npm_bins.values())).parent}{os.pathsep}{os.environ['PATH']}")
    assert check_harness(spec) is None
    return spec


def test_mini_swe_agent(stack, tmp_path) -> None:
    spec = harness_spec("mini-swe-agent")  # python -m minisweagent with our compact config, step limit = max_turns
    assert check_harness(spec) is None, "mini-swe-agent is a test dependency: pip install -e '.[test]'"
    result, exec_dir, logs = run_preset(stack, tmp_path, "mini-0", spec, timeout_s=150)
    assert result.status in ("finished", "timeout", "crashed"), logs
    assert not result.excluded and result.reward is not None and 0.0 <= result.reward <= 1.0, logs
    records = stack.records.read("mini-0")
    assert records, f"mini-swe-agent made no model call:\n{logs}"
    first = stack.tokenizer.decode(records[0].prompt_ids)  # our compact templates, not mini.yaml's
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in first and "Recommended Workflow" not in first, first
    assert all(r.api == "chat" and r.thread_id == "main" for r in records)
    loaded = stack.trainer_load("mini-0")  # the trainer's reader takes the execution
    assert loaded.excluded is None and loaded.branches, loaded.excluded
    # Every model response litellm handed the agent (kept in the trajectory, with the assistant message or
    # with the format error it caused) is exactly what its record's ids decode and parse to.
    trajectory = json.loads((exec_dir / "harness" / "trajectory.json").read_text())  # {exec_dir}: the harness's dir
    responses = [
        m["extra"]["response"]
        for m in trajectory["messages"]
        if isinstance(m.get("extra"), dict) and "response" in m["extra"]
    ]
    assert len(responses) == len(records), logs
    for response, record in zip(responses, records):
        message = response["choices"][0]["message"]
        assert (message.get("content") or "") == stack.parsed(record).content
        assert response["usage"]["completion_tokens"] == len(record.completion_ids)
    # Token-in/token-out: a call that continues its thread starts with the previous prompt + completion, verbatim.
    for before, after in zip(records, records[1:]):
        if after.reused_prefix_len:
            assert (
                after.prompt_ids[: len(before.prompt_ids) + len(before.completion_ids)]
                == before.prompt_ids + before.completion_ids
            )


@pytest.mark.parametrize("small", [False, True], ids=["preset", "small_cmd"])
def test_claude_code(stack, tmp_path, npm_bins, monkeypatch, small: bool) -> None:
    """The preset, and the preset with ``CLAUDE_CODE_SMALL_CMD`` (``--bare``, 3 tools, a short system prompt)."""
    spec = harness_spec("claude-code", cmd=CLAUDE_CODE_SMALL_CMD if small else "")
    spec = on_npm_path(monkeypatch, npm_bins, spec)
    execution_id = "claude-small-0" if small else "claude-0"
    result, exec_dir, logs = run_preset(stack, tmp_path, execution_id, spec, timeout_s=170, evaluator=EVALUATOR)
    assert result.status in ("finished", "timeout"), logs
    assert not result.excluded and result.reward in (0.0, 0.5, 1.0), (result, logs)
    records = stack.records.read(execution_id)
    assert records, f"Claude Code made no model call:\n{logs}"
    assert all(r.api == "messages" for r in records)
    if small:  # ~4.3 KB request, < 1K tokens rendered (compact tools): a short system prompt, Bash/Read/Edit
        assert len(records[0].prompt_ids) < 1500, len(records[0].prompt_ids)
    else:  # its ~50 KB request: system prompt, tools, environment
        assert len(records[0].prompt_ids) > 5000
    loaded = stack.trainer_load(execution_id)  # the trainer's reader takes the execution
    assert loaded.excluded is None and loaded.branches, loaded.excluded
    # The assistant messages Claude Code reports are, in order, what the records' ids decode and parse to.
    events = [
        json.loads(line) for line in (exec_dir / "harness.stdout").read_text().splitlines() if line.startswith("{")
    ]
    said = [e["message"]["content"] for e in events if e.get("type") == "assistant"]
    assert said and events[-1]["type"] == "result", logs
    text = "".join(b["text"] for content in said for b in content if b["type"] == "text")
    calls = [(b["name"], b["input"]) for content in said for b in content if b["type"] == "tool_use"]
    parsed = [stack.parsed(r) for r in records]
    assert text == "".join(p.content for p in parsed)
    assert calls == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for p in parsed for c in p.tool_calls
    ]
    if result.status == "finished":
        assert events[-1]["result"] == parsed[-1].content
