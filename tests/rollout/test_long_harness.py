"""The long-horizon harness (gyre_jax/rollout/long_harness.py) as a real subprocess against the real proxy (a
scripted backend answers): call count, compaction into a summary continuation, sub-agents, reuse, the answer."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from timelimits import scaled

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.rollout import long_harness
from gyre_jax.rollout.tasks import ANSWER_FILE, BuiltinSuite, LongTaskParams, evaluate
from gyre_jax.serving.types import GenerationResult, TokenChunk
from gyre_jax.trajectory.branches import build_branches

REPO = Path(__file__).resolve().parents[2]
BYTES = ByteTokenizer()
PARAMS = LongTaskParams(files=6, file_chars=400, read_chars=100, system_chars=1400, compact_tokens=2600,
                        subagent_every=3)  # fmt: skip


class ProseBackend:
    """Answers every call with prose (no tool call): "ok" to the first summary request (too short to be quoted,
    so the harness asks again), a sentence otherwise, and the count to the final question."""

    max_context = 8192

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)

    def submit(self, request):
        return self._pool.submit(self._generate, request)

    def cancel(self, request_id: str) -> None:
        pass

    def _generate(self, request) -> GenerationResult:
        prompt = BYTES.decode(request.prompt_ids)
        last = prompt[prompt.rfind("<|im_start|>user") :]
        if long_harness.SUMMARY_REQUEST in last:
            text = "ok"
        elif long_harness.FINAL_REQUEST in last:
            text = self.answer
        else:
            text = f"Noted the lines of this piece; call {len(request.prompt_ids)} of the work."
        ids = BYTES.encode(text)[: request.sampling.max_tokens - 1] + [BYTES.token_id("<|im_end|>")]
        n = len(ids)
        if request.on_tokens is not None:  # as a serving loop tells a request's listener
            request.on_tokens(TokenChunk(request.request_id, 0, tuple(ids), (-0.5,) * n, (3,) * n))
        return GenerationResult(request.request_id, ids, [-0.5] * n, [3] * n, "stop", len(request.prompt_ids))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def test_long_params_refuse_bad_sizes():
    with pytest.raises(ValueError, match="long_read_chars=500 must be <= long_file_chars=100"):
        LongTaskParams(file_chars=100, read_chars=500)
    with pytest.raises(ValueError, match="long_compact_tokens=100 must be >= "):
        LongTaskParams(compact_tokens=100)
    with pytest.raises(ValueError, match="long_subagent_every=9"):
        LongTaskParams(files=4, subagent_every=9)
    with pytest.raises(ValueError, match="cannot be mixed"):
        BuiltinSuite(kinds=("copy", "longlog"))
    with pytest.raises(ValueError, match="warm_start.steps=0"):
        BuiltinSuite(kinds=("longlog",)).demonstrations(1, 0)


def test_long_harness_compacts_spawns_subagents_and_reuses_prefixes(tmp_path):
    task = BuiltinSuite(kinds=("longlog",), long=PARAMS, seed=3).tasks_for_step(0, 1)[0]
    workspace = tmp_path / "workspace"
    for rel, text in task.files.items():
        (workspace / rel).parent.mkdir(parents=True, exist_ok=True)
        (workspace / rel).write_text(text)
    (tmp_path / "task.json").write_text(task.to_json())
    backend = ProseBackend(task.expected[ANSWER_FILE])
    store = RecordStore(tmp_path / "records")
    try:
        with ProxyServer(backend, BYTES, store, tools_format="compact") as server:
            key = server.open_execution("x0")
            env = {**os.environ, "OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": key}
            cmd = [sys.executable, "-m", "gyre_jax.rollout.long_harness", "--task", str(tmp_path / "task.json"),
                   "--model", "gyre-tiny", "--max-tokens", "48"]  # fmt: skip
            done = subprocess.run(cmd, cwd=workspace, env=env, capture_output=True, text=True, timeout=scaled(300))
            server.close_execution("x0")
    finally:
        backend.shutdown()
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    records = store.read("x0")
    assert summary["stop"] == "done" and summary["subagents"] == 2 and summary["summaries"] >= 1
    # the planned calls (first call, reads, 2 reports and their taking in, the answer), 2 per summary ("ok", again)
    assert len(records) == summary["calls"] == PARAMS.planned_calls() + 2 * summary["summaries"]
    assert evaluate(task, workspace) == 1.0  # the final answer, written to answer.txt by the harness
    labels = {b.label for b in build_branches(records)}
    assert {"main", "main-summary", "subagent"} <= labels and "auxiliary" not in labels
    threads = {r.thread_id for r in records}
    assert len(threads) == 3 and "main" in threads  # the main agent (all its conversations) and 2 sub-agents
    continuing = [r for r in records if r.reused_prefix_len > 0]
    assert len(continuing) >= len(records) - 2 * (summary["summaries"] + 3)  # all but each conversation's first
    assert min(r.reused_prefix_len / len(r.prompt_ids) for r in continuing) >= 0.9
    assert max(len(r.prompt_ids) + len(r.completion_ids) for r in records) <= PARAMS.compact_tokens + 200
