"""Real agent harnesses, unmodified, run by the Executor against the tiny model through the proxy, offline:
``mini-swe-agent`` (PyPI, OpenAI API through litellm) and the Claude Code CLI (npm, Anthropic API).

Each run must end (finished, or killed at its timeout), leave records whose token ids decode and
parse to exactly what the client received, and be scored by an evaluator.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from gyre_jax.rollout.executor import ExecutionSpec, Executor
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
                        timeout_s=timeout_s, max_parallel=1, temperature=1.0, max_tokens=24, evaluator_timeout_s=30,
                        harness_cmd=harness_cmd, evaluator=evaluator, extra_env=extra_env)  # fmt: skip
    [result] = executor.run([ExecutionSpec(execution_id, make_task(execution_id), execution_id, seed=0)])
    exec_dir = tmp_path / "executions" / execution_id
    logs = (exec_dir / "harness.stdout").read_text(errors="replace")[-3000:] + (exec_dir / "harness.stderr").read_text(
        errors="replace"
    )[-3000:]
    return result, exec_dir, logs


def test_mini_swe_agent(stack, tmp_path) -> None:
    mini = shutil.which("mini", path=str(Path(sys.executable).parent))
    assert mini is not None, "mini-swe-agent is a test dependency: pip install -e '.[test]'"
    cmd = [mini, "-m", "openai/{model}", "-t", "{task.instruction}", "--yolo", "--exit-immediately",
           "-o", "{exec_dir}/trajectory.json", "-c", "mini.yaml", "-c", "model.model_kwargs.api_base={base_url}",
           "-c", "model.model_kwargs.max_tokens={max_tokens}", "-c", "agent.step_limit=3", "-c", "agent.cost_limit=0"]  # fmt: skip
    env = {"MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "HOME": "{exec_dir}/home",
           "MSWEA_CONFIGURED": "true", "TERM": "dumb"}  # fmt: skip
    result, exec_dir, logs = run_one(stack, tmp_path, "mini-0", cmd, env, timeout_s=150)
    assert result.status in ("finished", "timeout", "crashed"), logs
    assert not result.excluded and result.reward is not None and 0.0 <= result.reward <= 1.0, logs
    records = stack.records.read("mini-0")
    assert records, f"mini-swe-agent made no model call:\n{logs}"
    assert all(r.api == "chat" and r.thread_id == "main" for r in records)
    loaded = stack.trainer_load("mini-0")  # the trainer's reader takes the execution
    assert loaded.excluded is None and loaded.branches, loaded.excluded
    # Every model response litellm handed the agent (kept in the trajectory, with the assistant message or
    # with the format error it caused) is exactly what its record's ids decode and parse to.
    trajectory = json.loads((exec_dir / "trajectory.json").read_text())
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


def test_claude_code(stack, tmp_path, claude_bin) -> None:
    cmd = [str(claude_bin), "-p", "{task.instruction}", "--model", "{model}", "--dangerously-skip-permissions",
           "--output-format", "stream-json", "--verbose"]  # fmt: skip
    env = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "IS_SANDBOX": "1", "HOME": "{exec_dir}/home",
           "DISABLE_AUTOUPDATER": "1", "TERM": "dumb"}  # fmt: skip
    result, exec_dir, logs = run_one(stack, tmp_path, "claude-0", cmd, env, timeout_s=170, evaluator=EVALUATOR)
    assert result.status in ("finished", "timeout"), logs
    assert not result.excluded and result.reward in (0.0, 0.5, 1.0), (result, logs)
    records = stack.records.read("claude-0")
    assert records, f"Claude Code made no model call:\n{logs}"
    assert all(r.api == "messages" for r in records)
    assert len(records[0].prompt_ids) > 5000  # its ~50 KB request: system prompt, tools, environment
    loaded = stack.trainer_load("claude-0")  # the trainer's reader takes the execution
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
