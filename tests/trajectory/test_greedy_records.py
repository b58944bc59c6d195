"""Greedy calls (temperature 0, served under ``proxy.sampling = "client"``) in the trainer: the reader accepts
them, their completions stay in the branch as context but are never trained (no 0 temperature reaches the
loss), the execution's sampled calls still train, and the pipeline counts them (``greedy_calls``)."""

from __future__ import annotations

import numpy as np

from gyre_jax.proxy.records import RecordStore, TitoRecord
from gyre_jax.trajectory.branches import build_branches
from gyre_jax.trajectory.pipeline import TrajectoryConfig, TrajectoryPipeline

CONFIG = TrajectoryConfig(max_branches=None, packing="tree", row_length=64, rows=2, max_sequences=4, vocab_size=16)


def record(eid: str, i: int, prompt: list[int], completion: list[int], temperature: float) -> TitoRecord:
    n = len(completion)
    return TitoRecord(eid, i, "main", f"r{i}", prompt, completion, [-0.5] * n, [0] * n, "stop", temperature, 0,
                      0.0, 1.0, client_sampling={"temperature": temperature})  # fmt: skip


def conversation(eid: str, temperatures: list[float]) -> list[TitoRecord]:
    """One thread: each call's prompt is the previous prompt + completion + one new token."""
    out, prompt = [], [1, 2]
    for i, t in enumerate(temperatures):
        completion = [3 + i, 4 + i]
        out.append(record(eid, i, prompt, completion, t))
        prompt = prompt + completion + [9]
    return out


def test_a_greedy_call_is_context_not_a_target() -> None:
    (branch,) = build_branches(conversation("e", [1.0, 0.0, 0.5]))
    arrays = branch.arrays()
    assert arrays.trainable.tolist() == [False] * 2 + [True] * 2 + [False] + [False] * 2 + [False] + [True] * 2
    assert np.all(arrays.temperature > 0) and arrays.temperature[arrays.trainable].tolist() == [1.0, 1.0, 0.5, 0.5]


def test_the_pipeline_counts_greedy_calls_and_excludes_only_what_has_nothing_to_train(tmp_path) -> None:
    store = RecordStore(tmp_path / "records")
    for eid, temps in (("mixed", [1.0, 0.0, 1.0]), ("greedy", [0.0, 0.0]), ("sampled", [1.0])):
        for rec in conversation(eid, temps):
            store.append(rec)
    pipe = TrajectoryPipeline(store.root, tmp_path / "trajectory", CONFIG)
    pipe.enqueue(0, [("mixed", 1.0), ("greedy", 1.0), ("sampled", 1.0)])
    step = pipe.next_step()
    assert sorted(step.executions) == ["mixed", "sampled"]
    reasons = dict(step.excluded)
    assert list(reasons) == ["greedy"] and "every call was greedy (temperature 0, 2 calls" in reasons["greedy"]
    assert step.stats["greedy_calls"] == 3 and step.stats["excluded"] == 1
    assert step.stats["tokens_trained"] == 2 * 2 + 2  # mixed: its two sampled calls; sampled: its one
