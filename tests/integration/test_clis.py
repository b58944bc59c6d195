"""More real agent harnesses, unmodified and pinned, run by the Executor against the tiny model through the
proxy, offline: the Codex CLI (npm, OpenAI Responses API), smolagents' CodeAgent and ToolCallingAgent (PyPI,
OpenAI chat with ``stop`` and ``tool_choice``), opencode (npm, OpenAI chat, streamed, with a title call) and
aider (PyPI in its own venv, OpenAI chat, streamed, ``temperature: 0``).

Each run must end normally (exit 0: these harnesses end after one short task), leave at least one record,
every record must decode and parse to exactly what the harness reports it received (its own log of each
reply), and the execution must load in the trainer's reader (``LoadExecution``) without exclusion. One short
task each, step limits 1-2, the session's shared stack. ``test_agents.py`` holds mini-swe-agent and Claude Code.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_agents import EVALUATOR, on_npm_path, run_one, run_preset  # noqa: E402

from gyre_jax.rollout.harnesses import harness_spec  # noqa: E402

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent

# What a harness needs from the proxy that another branch of issue 15 builds; strict, so the marker must go
# (and the test then pass) once that branch is merged.


def common_checks(stack, result, execution_id: str, logs: str) -> list:
    """A normal end (exit 0), scored, >= 1 record, and the trainer loads the records without exclusion."""
    assert result.status == "finished" and result.returncode == 0, logs
    assert not result.excluded and result.reward in (0.0, 0.5, 1.0), (result, logs)
    records = stack.records.read(execution_id)
    assert records, f"{execution_id}: no model call was recorded:\n{logs}"
    loaded = stack.trainer_load(execution_id)
    assert loaded.excluded is None and loaded.branches, loaded.excluded
    return records


def tool_calls_of(calls) -> list[tuple[str, object]]:
    """[(name, arguments as JSON value)] of OpenAI-style tool calls (``arguments`` a JSON string or a value)."""
    out = []
    for call in calls:
        fn = call.get("function", call)
        args = fn["arguments"]
        out.append((fn["name"], json.loads(args) if isinstance(args, str) else args))
    return out


# -- Codex CLI (Responses API) -----------------------------------------------------------------------------------------


def test_codex_cli(stack, tmp_path, npm_bins, monkeypatch) -> None:
    spec = on_npm_path(monkeypatch, npm_bins, harness_spec("codex"))  # its config.toml names the proxy (Responses API)
    result, exec_dir, logs = run_preset(stack, tmp_path, "codex-0", spec, timeout_s=300, evaluator=EVALUATOR)
    records = common_checks(stack, result, "codex-0", logs)
    # What Codex reports (--json events): its agent messages are, in order, the records' parsed text.
    events = [json.loads(x) for x in (exec_dir / "harness.stdout").read_text().splitlines() if x.startswith("{")]
    said = [e["item"]["text"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
    parsed = [stack.parsed(r) for r in records]
    assert "".join(said) == "".join(p.content for p in parsed), logs
    assert events[-1]["type"] == "turn.completed", logs
    assert (exec_dir / "harness" / "last_message.txt").read_text() == parsed[-1].content
    if len(records) == 1:
        assert events[-1]["usage"]["output_tokens"] == len(records[0].completion_ids)


# -- smolagents (OpenAI chat; stop, tool_choice) ------------------------------------------------------------------------


def run_smolagents(stack, tmp_path, agent: str) -> None:
    execution_id = f"smol-{agent}-0"
    cmd = [sys.executable, str(HERE / "smolagents_driver.py"), agent, "{model}", "{task.instruction}",
           "{exec_dir}/replies.jsonl", "--max-steps", "1", "--max-tokens", "{max_tokens}"]  # fmt: skip
    result, exec_dir, logs = run_one(stack, tmp_path, execution_id, cmd, {"HOME": "{exec_dir}/home"}, timeout_s=300,
                                     evaluator=EVALUATOR)  # fmt: skip
    records = common_checks(stack, result, execution_id, logs)
    # Every reply the agent was handed (logged by the driver before the agent acted on it) is its record's parse.
    replies = [json.loads(x) for x in (exec_dir / "harness" / "replies.jsonl").read_text().splitlines()]
    assert len(replies) == len(records), logs
    for reply, record in zip(replies, records):
        parsed = stack.parsed_turn(record)  # ToolCallingAgent's tool_choice="required" opens the reply in the prompt
        assert (reply["content"] or "") == parsed.content
        assert tool_calls_of(reply["tool_calls"]) == tool_calls_of(parsed.tool_calls)
        assert reply["completion_tokens"] == len(record.completion_ids)
    assert replies[0]["stop_sequences"], "smolagents sends stop sequences on its steps"


def test_smolagents_code_agent(stack, tmp_path) -> None:
    run_smolagents(stack, tmp_path, "code")


def test_smolagents_tool_calling_agent(stack, tmp_path) -> None:
    run_smolagents(stack, tmp_path, "tool")


# -- opencode (OpenAI chat, streamed) -----------------------------------------------------------------------------------


def test_opencode(stack, tmp_path, npm_bins, monkeypatch) -> None:
    spec = on_npm_path(monkeypatch, npm_bins, harness_spec("opencode"))  # its opencode.json names the proxy
    result, exec_dir, logs = run_preset(stack, tmp_path, "opencode-0", spec, timeout_s=300, evaluator=EVALUATOR)
    records = common_checks(stack, result, "opencode-0", logs)
    assert all(r.api == "chat" for r in records)
    events = [json.loads(x) for x in (exec_dir / "harness.stdout").read_text().splitlines() if x.startswith("{")]
    texts = [e["part"]["text"] for e in events if e.get("type") == "text"]
    # One call names the session (a title, not shown; it runs alongside the first agent call); the agent's
    # replies are the other records, in order.
    title = [r for r in records if "You are a title generator" in stack.tokenizer.decode(r.prompt_ids[:200])]
    assert len(title) == 1, [r.call_index for r in title]
    agent = [stack.parsed(r) for r in records if r is not title[0]]
    assert "".join(texts) == "".join(p.content for p in agent), logs


# -- aider (OpenAI chat through litellm, streamed, temperature 0; its own venv) -----------------------------------------


def aider_home(root: Path) -> Path:
    """A HOME whose aider model-info cache is fresh, so aider does not fetch litellm's price list from GitHub."""
    info = {"max_input_tokens": 16384, "max_output_tokens": 24, "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0, "litellm_provider": "openai", "mode": "chat"}  # fmt: skip
    cache = root / ".aider" / "caches"
    cache.mkdir(parents=True)
    (cache / "model_prices_and_context_window.json").write_text(
        json.dumps({"openai/gyre-tiny": info, "gyre-tiny": info})
    )
    return root


def test_aider(stack, tmp_path, aider_python) -> None:
    cmd = [str(aider_python), "-m", "aider", "--model", "openai/{model}", "--openai-api-base", "{base_url}",
           "--message", "{task.instruction}", "--yes-always", "--no-git", "--analytics-disable", "--no-check-update",
           "--no-show-model-warnings", "--no-show-release-notes", "--no-pretty", "--no-fancy-input", "--map-tokens", "0",
           "--no-detect-urls", "--llm-history-file", "{exec_dir}/llm_history.txt"]  # fmt: skip
    env = {"HOME": str(aider_home(tmp_path / "aider_home")), "LITELLM_LOCAL_MODEL_COST_MAP": "True", "TERM": "dumb"}
    result, exec_dir, logs = run_one(stack, tmp_path, "aider-0", cmd, env, timeout_s=300, evaluator=EVALUATOR)
    records = common_checks(stack, result, "aider-0", logs)
    assert all(r.api == "chat" for r in records)
    # aider's LLM history file logs each reply it received (``ASSISTANT `` before each line) after the call.
    history = (exec_dir / "harness" / "llm_history.txt").read_text()
    parts = re.split(r"^(TO LLM|LLM RESPONSE) \S+\n", history, flags=re.M)  # [head, kind, body, kind, body, ...]
    replies = [body.removesuffix("\n") for kind, body in zip(parts[1::2], parts[2::2]) if kind == "LLM RESPONSE"]
    expected = ["\n".join(f"ASSISTANT {line}" for line in stack.parsed(r).content.splitlines()) for r in records]
    assert replies == expected, logs
