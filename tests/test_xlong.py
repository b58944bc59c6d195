"""End to end: ``python -m gyre_jax.train --config configs/xlong_cpu.py`` at small lengths (the benchmark-length
run is in docs/long_context.md): long-horizon executions through the real proxy, trained with context parallelism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from timelimits import scaled

from gyre_jax.proxy.records import RecordStore
from gyre_jax.trajectory.branches import build_branches, select_branches

REPO = Path(__file__).resolve().parent.parent
ROW, CONTEXT, MAX_BRANCHES = 5120, 4, 2  # trajectory.row_length, model.context_parallel, rl.max_branches
SMALL = [
    "--config.total_steps=1",
    "--config.rollout.long_files=4",
    "--config.rollout.long_file_chars=600",
    "--config.rollout.long_read_chars=200",
    "--config.rollout.long_system_chars=3000",
    "--config.rollout.long_compact_tokens=4200",
    "--config.rollout.long_subagent_every=2",
    "--config.rollout.max_tokens_per_call=32",
    f"--config.serving.max_seq_len={ROW}",
    f"--config.trajectory.row_length={ROW}",
    f"--config.trajectory.tokens_per_micro_batch={ROW}",
    "--config.serving.kv_pages=2048",
]
MIN_CALLS = 18  # 1 plan + 6 reads + 2 reports taken in + 1 answer (main); 2 x (3 reads + a report) (sub-agents)


@pytest.mark.slow
def test_xlong_config_trains_long_horizon_executions_with_context_parallelism(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "gyre_jax.train", "--config", "configs/xlong_cpu.py",
           f"--config.workdir={tmp_path}", *SMALL]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(1200))
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [m for m in metrics if m.get("phase") == "train"]
    assert len(train) == 1 and train[0]["excluded"] == 0 and train[0]["executions_excluded_by_pipeline"] == 0
    results = [json.loads(line) for line in (tmp_path / "results" / "step_000000.jsonl").read_text().splitlines()]
    assert len(results) == 2 and not any(r["excluded"] for r in results)
    store = RecordStore(tmp_path / "records")
    selected_lengths = []
    for result in results:
        records = store.read(result["execution_id"])
        assert len(records) >= MIN_CALLS
        branches = build_branches(records)
        labels = {b.label for b in branches}
        assert {"main", "main-summary", "subagent"} <= labels  # a summary continuation and a sub-agent
        continuing = [r for r in records if r.reused_prefix_len > 0]
        assert continuing and min(r.reused_prefix_len / len(r.prompt_ids) for r in continuing) >= 0.9
        # ... and serving took those prompts' KV from its session prefix cache: >= 90% of their tokens not prefilled
        assert sum(r.cached_prompt_tokens for r in continuing) >= 0.9 * sum(len(r.prompt_ids) for r in continuing)
        selected_lengths += [len(b.tokens) for b in select_branches(branches, MAX_BRANCHES)]
    # what was trained: the selected branches, some longer than one context shard's share of a row
    assert train[0]["branches_selected"] == len(selected_lengths) and train[0]["micro_steps"] >= 1
    assert max(selected_lengths) > ROW // CONTEXT and train[0]["tokens_computed"] >= max(selected_lengths)
