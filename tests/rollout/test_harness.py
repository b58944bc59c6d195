"""Tests for gyre_jax/rollout/harness.py: the reference harness as a real subprocess against a scripted
OpenAI-compatible server (and once under the Executor, as in a run)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from timelimits import scaled

from gyre_jax.rollout.executor import ExecutionSpec, Executor
from gyre_jax.rollout.harness import resolve_in_workspace, tool_latency
from gyre_jax.rollout.tasks import ANSWER_FILE, INPUT_FILE, BuiltinSuite, Task, evaluate

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = "key-123"


def completion(message: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion response body carrying ``message``."""
    message = {"role": "assistant", **message}
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": "tiny",
        "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


class ScriptedOpenAI:
    """An OpenAI-compatible chat endpoint answering from a script, recording every request."""

    def __init__(self) -> None:
        self.script: list[tuple[int, dict[str, Any]]] = []  # (HTTP status, body), consumed in order
        self.repeat_last = False
        self.requests: list[dict[str, Any]] = []  # {"t", "authorization", "body"}
        self.expected_key: str | None = None
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            auth = request.headers.get("authorization")
            self.requests.append({"t": time.monotonic(), "authorization": auth, "body": body})
            if self.expected_key is not None and auth != f"Bearer {self.expected_key}":
                return JSONResponse({"error": {"message": f"bad key {auth!r}"}}, status_code=401)
            if not self.script:
                return JSONResponse({"error": {"message": "script exhausted"}}, status_code=500)
            status, payload = self.script[0] if self.repeat_last and len(self.script) == 1 else self.script.pop(0)
            return JSONResponse(payload, status_code=status)

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + scaled(10)
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("scripted server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=scaled(5))

    def say(self, *messages: dict[str, Any]) -> None:
        self.script += [(200, completion(m)) for m in messages]


@pytest.fixture
def server():
    s = ScriptedOpenAI()
    s.start()
    yield s
    s.stop()


def make_task(
    tmp_path: Path, *, kind: str = "upper", max_turns: int = 4, median: float = 0.0, text: str = "qkzmt"
) -> tuple[Task, Path, Path]:
    task = BuiltinSuite(kinds=(kind,), max_turns=max_turns, tool_latency_median_s=median).tasks_for_step(0, 1)[0]
    task = Task.from_dict(
        {
            **task.to_dict(),
            "files": {INPUT_FILE: text},
            "expected": {ANSWER_FILE: {"upper": text.upper(), "copy": text, "reverse": text[::-1]}[kind]},
        }
    )
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / INPUT_FILE).write_text(text)
    task_path = tmp_path / "task.json"
    task_path.write_text(task.to_json())
    return task, workspace, task_path


def run_harness(task_path: Path, workspace: Path, base_url: str, *extra: str) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": str(REPO_ROOT),
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": API_KEY,
    }
    cmd = [sys.executable, "-m", "gyre_jax.rollout.harness", "--task", str(task_path), "--model", "tiny",
           "--temperature", "0.7", "--max-tokens", "50", "--seed", "1", *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=workspace, env=env, capture_output=True, text=True, timeout=scaled(60))


def test_harness_solves_a_task_and_sends_the_demonstration_conversation(server, tmp_path):
    task, workspace, task_path = make_task(tmp_path)
    demo = task.demonstration()
    server.say(*[m for m in demo if m["role"] == "assistant"])  # the model "answers" exactly as demonstrated
    proc = run_harness(task_path, workspace, server.base_url)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"turns": 3, "stop": "no_tool_call"}
    assert (workspace / ANSWER_FILE).read_text() == "QKZMT"
    assert evaluate(task, workspace) == 1.0

    assert len(server.requests) == 3
    for req in server.requests:
        body = req["body"]
        assert req["authorization"] == f"Bearer {API_KEY}"
        assert body["model"] == "tiny" and body["temperature"] == 0.7 and body["max_tokens"] == 50
        assert body["tools"] == task.tools
        assert json.dumps(body["tools"]) == json.dumps(task.tools)  # same key order: same rendered prompt
    bodies = [r["body"]["messages"] for r in server.requests]
    assert bodies[0] == demo[:2]
    assert bodies[1] == demo[:4]  # assistant tool call as returned, then the file's content as the tool result
    assert bodies[1][3] == {"role": "tool", "tool_call_id": "call_0", "content": "qkzmt"}
    assert bodies[2] == demo[:6]  # ... then the write_file call and "ok": the harness reproduces the demonstration
    assert bodies[2][5] == {"role": "tool", "tool_call_id": "call_1", "content": "ok"}


def test_harness_confines_tools_to_the_workspace_and_never_crashes_on_bad_calls(server, tmp_path):
    task, workspace, task_path = make_task(tmp_path)
    (tmp_path / "secret.txt").write_text("TOP-SECRET-CONTENT")
    (workspace / "link").symlink_to(tmp_path, target_is_directory=True)
    calls = [
        tool_call("c0", "read_file", {"path": "/etc/hostname"}),
        tool_call("c1", "read_file", {"path": "../secret.txt"}),
        tool_call("c2", "write_file", {"path": "../escape.txt", "content": "x"}),
        tool_call("c3", "write_file", {"path": "sub/../../escape2.txt", "content": "x"}),
        tool_call("c4", "write_file", {"path": "link/escape3.txt", "content": "x"}),
        tool_call("c5", "rm", {"path": "input.txt"}),
        tool_call("c6", "read_file", "not json"),
        tool_call("c7", "write_file", {"path": "answer.txt"}),
        tool_call("c8", "read_file", {"path": "missing.txt"}),
        tool_call("c9", "read_file", ["input.txt"]),
        tool_call("c10", "write_file", {"path": "sub/dir/ok.txt", "content": "fine"}),
        tool_call("c11", "read_file", {"path": "link/secret.txt"}),
    ]
    server.say({"content": "", "tool_calls": calls}, {"content": "Done."})
    proc = run_harness(task_path, workspace, server.base_url)
    assert proc.returncode == 0, proc.stderr
    results = {m["tool_call_id"]: m["content"] for m in server.requests[1]["body"]["messages"] if m["role"] == "tool"}
    assert list(results) == [c["id"] for c in calls]
    for call_id in ("c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7", "c8", "c9", "c11"):
        assert results[call_id].startswith("error:"), (call_id, results[call_id])
    assert "absolute" in results["c0"] and "'..'" in results["c1"] and "leaves the workspace" in results["c4"]
    assert "unknown tool 'rm'" in results["c5"] and "not valid JSON" in results["c6"] and "content" in results["c7"]
    assert results["c10"] == "ok" and (workspace / "sub/dir/ok.txt").read_text() == "fine"
    assert "TOP-SECRET-CONTENT" not in "".join(results.values())
    assert not any((tmp_path / name).exists() for name in ("escape.txt", "escape2.txt", "escape3.txt"))
    assert (workspace / INPUT_FILE).read_text() == "qkzmt"


def test_harness_stops_after_max_turns(server, tmp_path):
    _, workspace, task_path = make_task(tmp_path, max_turns=3)
    server.say({"content": "", "tool_calls": [tool_call("c", "read_file", {"path": "input.txt"})]})
    server.repeat_last = True
    proc = run_harness(task_path, workspace, server.base_url)
    assert proc.returncode == 0, proc.stderr
    assert len(server.requests) == 3
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"turns": 3, "stop": "max_turns"}


def test_harness_exits_nonzero_on_api_error_without_retrying(server, tmp_path):
    _, workspace, task_path = make_task(tmp_path)
    server.script = [(500, {"error": {"message": "engine on fire"}})]
    proc = run_harness(task_path, workspace, server.base_url)
    assert proc.returncode == 1
    assert "model call 1 failed" in proc.stderr and "InternalServerError" in proc.stderr
    assert len(server.requests) == 1  # max_retries=0: the proxy, not the SDK, decides about retries


def test_harness_exits_nonzero_when_the_server_is_unreachable(tmp_path):
    _, workspace, task_path = make_task(tmp_path)
    proc = run_harness(task_path, workspace, "http://127.0.0.1:9/v1")
    assert proc.returncode == 1 and "APIConnectionError" in proc.stderr


def test_harness_rejects_a_bad_task_file(server, tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    bad = tmp_path / "task.json"
    bad.write_text(json.dumps({"system": "", "instruction": "x", "tools": [], "max_turns": 0}))
    proc = run_harness(bad, workspace, server.base_url)
    assert proc.returncode == 2 and "'max_turns'" in proc.stderr
    assert server.requests == []


def test_harness_sleeps_the_tool_latency_between_calls(server, tmp_path):
    _, workspace, task_path = make_task(tmp_path, median=0.25)  # sigma 0: exactly 0.25 s per tool call
    two_reads = [tool_call("a", "read_file", {"path": "input.txt"}), tool_call("b", "read_file", {"path": "input.txt"})]
    server.say({"content": "", "tool_calls": two_reads}, {"content": "Done."})
    proc = run_harness(task_path, workspace, server.base_url)
    assert proc.returncode == 0, proc.stderr
    gap = server.requests[1]["t"] - server.requests[0]["t"]
    assert 0.5 <= gap < 0.5 + scaled(4.5)


def test_tool_latency_is_lognormal_and_seeded():
    draws = [tool_latency(random.Random(3), 0.1, 1.0) for _ in range(2)]
    assert draws[0] == draws[1]
    rng = random.Random(0)
    sample = sorted(tool_latency(rng, 0.1, 1.0) for _ in range(2001))
    assert 0.08 < sample[1000] < 0.125  # median ~ 0.1
    assert sample[-1] > 1.0  # long tail
    assert tool_latency(random.Random(0), 0.0, 1.0) == 0.0


def test_resolve_in_workspace(tmp_path):
    assert resolve_in_workspace(tmp_path, "a/b.txt") == tmp_path.resolve() / "a" / "b.txt"
    for bad in ("", "/abs", "../x", "a/../../x", None, 3):
        with pytest.raises(ValueError):
            resolve_in_workspace(tmp_path, bad)


class KeyRegistry:
    def __init__(self) -> None:
        self.opened: list[str] = []
        self.closed: list[str] = []

    def open_execution(self, execution_id: str) -> str:
        self.opened.append(execution_id)
        return API_KEY

    def close_execution(self, execution_id: str) -> None:
        self.closed.append(execution_id)


def test_reference_harness_under_the_executor(server, tmp_path):
    """The default harness command: python -m gyre_jax.rollout.harness with cwd = workspace, key from the registry."""
    task = BuiltinSuite(kinds=("reverse",), seed=2).tasks_for_step(0, 1)[0]
    server.expected_key = API_KEY
    server.say(*[m for m in task.demonstration() if m["role"] == "assistant"])
    registry = KeyRegistry()
    executor = Executor(
        registry,
        server.base_url,
        tmp_path / "runs",
        "tiny",
        timeout_s=scaled(60),
        max_parallel=1,
        temperature=1.0,
        max_tokens=96,
    )
    [result] = executor.run([ExecutionSpec("e0", task, task.task_id, seed=0)])
    stderr = (tmp_path / "runs" / "e0" / "harness.stderr").read_text()
    assert (result.status, result.reward, result.returncode, result.excluded) == ("finished", 1.0, 0, False), stderr
    assert registry.opened == registry.closed == ["e0"]
    assert len(server.requests) == 3 and server.requests[0]["body"]["max_tokens"] == 96


def test_harness_names_each_failure_as_the_openai_sdk_does(server, tmp_path):
    """A 429 is a RateLimitError, a body that is not JSON a validation error, a missing key a config error (exit 2)."""
    _, workspace, task_path = make_task(tmp_path)
    server.script = [(429, {"error": {"message": "slow down"}})]
    proc = run_harness(task_path, workspace, server.base_url)
    assert proc.returncode == 1 and "RateLimitError" in proc.stderr and "slow down" in proc.stderr
    server.script = [(200, ["not", "a", "completion"])]
    proc = run_harness(task_path, workspace, server.base_url)
    assert proc.returncode == 1 and "APIResponseValidationError" in proc.stderr
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO_ROOT), "OPENAI_BASE_URL": server.base_url}
    cmd = [sys.executable, "-m", "gyre_jax.rollout.harness", "--task", str(task_path), "--model", "tiny"]
    proc = subprocess.run(cmd, cwd=workspace, env=env, capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 2 and "OPENAI_API_KEY" in proc.stderr
    assert len(server.requests) == 2


def test_harness_answers_a_call_of_an_unknown_type_with_an_error_and_goes_on(server, tmp_path):
    _, workspace, task_path = make_task(tmp_path)
    server.say({"content": "", "tool_calls": [{"id": "x1", "type": "retrieval"}]}, {"content": "Done."})
    proc = run_harness(task_path, workspace, server.base_url)
    assert proc.returncode == 0, proc.stderr
    tool_turn = server.requests[1]["body"]["messages"][-1]
    assert tool_turn["role"] == "tool" and tool_turn["tool_call_id"] == "x1"
    assert "unsupported tool call type 'retrieval'" in tool_turn["content"]
    assert server.requests[0]["authorization"] == f"Bearer {API_KEY}" and "tools" in server.requests[0]["body"]
