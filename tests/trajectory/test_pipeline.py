"""Tests for gyre_jax/trajectory/pipeline.py (and queue.py): the Grain pipeline from the record store to
micro-batches: exclusions with reasons, masks checked against the records themselves, weights that count
each execution once, exact resume from a saved iterator state (also through an orbax checkpoint on disk).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import grain
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre_jax.checkpoint import Checkpointer
from gyre_jax.proxy.records import RecordStore
from gyre_jax.trajectory.pipeline import PackedBatch, TrajectoryConfig, TrajectoryPipeline
from gyre_jax.trajectory.queue import ExecutionQueue
from gyre_jax.trajectory.synthetic import MESSAGE_END, TraceShape, write_executions

SMALL = TrajectoryConfig(max_branches=None, packing="tree", row_length=48, rows=2, max_sequences=4, vocab_size=8)


def write_records(store: RecordStore, records) -> None:
    with open(store.path(records[0].execution_id), "w", encoding="utf-8") as f:
        f.write("".join(r.to_json() + "\n" for r in records))


def node_prefixes(mb, row):
    """Full prefix (ancestor inputs + target) of every real token of a row, read back through the mask rule."""
    out = {}
    seg, end = mb.segment_ids[row], mb.subtree_end[row]
    for i in np.flatnonzero(seg):
        anc = [j for j in range(i + 1) if seg[j] == seg[i] and i < end[j]]
        out[i] = tuple(int(x) for x in mb.tokens[row, anc]) + (int(mb.targets[row, i]),)
    return out


def policy_prefixes(records) -> set[tuple[int, ...]]:
    """Straight from the records: the prefix ending in each token the policy generated."""
    return {tuple(r.prompt_ids + r.completion_ids[: k + 1]) for r in records for k in range(len(r.completion_ids))}


def all_outputs(pipe: TrajectoryPipeline) -> list[tuple[dict, PackedBatch]]:
    """(state before, output) for every output the queue can give now."""
    out = []
    it = iter(pipe)
    while True:
        state = json.loads(json.dumps(pipe.get_state()))  # what a checkpoint stores
        try:
            out.append((state, next(it)))
        except StopIteration:
            return out


def same_output(a: PackedBatch, b: PackedBatch) -> bool:
    if (a.step, a.end_of_step, a.excluded, a.stats) != (b.step, b.end_of_step, b.excluded, b.stats):
        return False
    if (a.packed is None) != (b.packed is None):
        return False
    if a.packed is None:
        return True
    x, y = a.packed.micro_batch, b.packed.micro_batch
    return a.packed.sequences == b.packed.sequences and all(
        np.array_equal(getattr(x, f), getattr(y, f)) for f in x.__dataclass_fields__
    )


# -- masks, weights, exclusions ---------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    n_exec=st.integers(1, 4),
    cap=st.sampled_from([None, 1, 2]),
    packing=st.sampled_from(["tree", "plain"]),
)
def test_masks_cover_exactly_the_policy_generated_tokens_and_each_execution_counts_once(
    executions, data, n_exec, cap, packing
):
    config = TrajectoryConfig(max_branches=cap, packing=packing, row_length=48, rows=2, max_sequences=4, vocab_size=8)
    with tempfile.TemporaryDirectory() as d:
        store = RecordStore(Path(d) / "records")
        records = {}
        for i in range(n_exec):
            records[f"e{i}"] = data.draw(executions(f"e{i}"))
            write_records(store, records[f"e{i}"])
        pipe = TrajectoryPipeline(store.root, Path(d) / "trajectory", config)
        pipe.enqueue(0, [(eid, 1.0 + k) for k, eid in enumerate(records)])
        step = pipe.next_step()
    trained = {eid: [] for eid in records}
    weight = {eid: 0.0 for eid in records}
    for mb, seqs in zip(step.micro_batches, step.sequences):
        assert mb.tokens.shape == (2, 48) and mb.seq_weights.shape == (4,)
        for s, info in enumerate(seqs):
            weight[info.execution_id] += float(mb.seq_weights[s])
            assert mb.advantages[s] == np.float32(1.0 + int(info.execution_id[1:]))
        for row in range(mb.tokens.shape[0]):
            for i, prefix in node_prefixes(mb, row).items():
                if mb.loss_mask[row, i]:
                    trained[seqs[mb.seq_index[row, i]].execution_id].append(prefix)
    assert step.stats["tokens_trained"] == sum(len(v) for v in trained.values())
    for eid, recs in records.items():
        policy = policy_prefixes(recs)
        assert len(trained[eid]) == len(set(trained[eid])), "a target trained twice"
        assert set(trained[eid]) <= policy, "only policy-generated tokens are trained"
        if cap is None:
            assert set(trained[eid]) == policy, "uncapped: every policy-generated token is trained"
        n_seqs = sum(1 for group in step.sequences for s in group if s.execution_id == eid)
        if cap is not None:
            assert n_seqs <= cap
        if policy:
            assert weight[eid] == pytest.approx(1.0 / n_exec, rel=1e-5)  # averaged within, then across executions
            assert eid in step.executions
        else:
            assert weight[eid] == 0.0 and any(e == eid and "nothing to train" in r for e, r in step.excluded)


def test_corrupt_and_unusable_executions_are_excluded_with_a_reason_and_the_pipeline_continues(tmp_path):
    store = RecordStore(tmp_path / "records")
    shape = TraceShape(
        num_calls=6,
        system_len=8,
        task_len=4,
        completion_len=(2, 5),
        tool_output_len=(2, 6),
        context_limit=60,
        summary_len=4,
        subagent_every=3,
        subagent_calls=2,
        subagent_system_len=6,
        vocab_size=64,
    )
    good = ["good0", "good1", "bad-json", "torn", "empty", "vocab", "long", "idle"]
    write_executions(store, good, shape)
    lines = store.path("bad-json").read_text().splitlines(True)
    store.path("bad-json").write_text(lines[0] + "{oops\n" + "".join(lines[2:]))
    store.path("torn").write_text(store.path("torn").read_text()[:-40])
    store.path("empty").write_text("")
    lines = store.path("vocab").read_text().splitlines(True)
    rec = json.loads(lines[1])
    rec["prompt_ids"][-1] = 500
    store.path("vocab").write_text(lines[0] + json.dumps(rec) + "\n" + "".join(lines[2:]))
    lines = store.path("idle").read_text().splitlines(True)
    idle = json.loads(lines[0])
    idle.update(completion_ids=[], completion_logprobs=[], policy_versions=[])
    store.path("idle").write_text(json.dumps(idle) + "\n")
    config = TrajectoryConfig(
        max_branches=3, row_length=256, rows=2, max_sequences=8, vocab_size=64, message_end_id=MESSAGE_END
    )
    pipe = TrajectoryPipeline(store.root, tmp_path / "trajectory", config)
    long_config = TrajectoryConfig(**{**config.__dict__, "row_length": 40})
    (store.root / "unreadable.jsonl").mkdir()  # opening it fails with an OSError
    pipe.enqueue(0, [(e, 0.5) for e in good + ["missing", "unreadable"]])
    pipe.enqueue(1, [("good1", -0.5)])
    step = pipe.next_step()
    reasons = dict(step.excluded)
    assert sorted(step.executions) == ["good0", "good1", "long"]
    assert "bad-json.jsonl:2: not valid JSON" in reasons["bad-json"]
    assert "truncated file" in reasons["torn"]
    assert "empty record file" in reasons["empty"]
    assert "token id 500 is outside [0, 64)" in reasons["vocab"]
    assert "nothing to train" in reasons["idle"]
    assert "no record file" in reasons["missing"]
    assert "unreadable records:" in reasons["unreadable"] and "directory" in reasons["unreadable"]
    assert reasons["missing"].startswith("no records:") and reasons["empty"].startswith("no records:")  # not damage
    assert all(r.startswith(("corrupt records:", "nothing to train", "unreadable records:", "no records:"))
               for r in reasons.values())  # fmt: skip
    assert step.stats["excluded"] == 7 and step.stats["executions"] == 10
    assert pipe.next_step().executions == ["good1"]  # the next step is unaffected
    # Rows too short for a branch: that execution is excluded, saying what to change.
    short = TrajectoryPipeline(store.root, tmp_path / "short", long_config)
    short.enqueue(0, [("long", 1.0), ("good0", 1.0)])
    reasons = dict(short.next_step().excluded)
    assert "needs rows of >=" in reasons["long"] and "raise trajectory.row_length" in reasons["long"]


def test_structure_labels_subagents_that_share_the_main_thread(tmp_path):
    """Claude Code style: sub-agents send the main session id; their own system prompt marks them."""
    store = RecordStore(tmp_path / "records")
    shape = TraceShape(
        num_calls=12,
        system_len=20,
        task_len=5,
        completion_len=(3, 6),
        tool_output_len=(3, 8),
        context_limit=120,
        summary_len=6,
        subagent_every=5,
        subagent_calls=3,
        subagent_system_len=15,
        retry_prob=0.0,
        vocab_size=64,
    )
    stats = {}
    for metadata in (True, False):
        write_executions(store, ["x"], shape.with_(thread_metadata=metadata))
        from gyre_jax.trajectory.branches import build_branches

        branches = build_branches(store.read("x"), message_end_id=MESSAGE_END)
        stats[metadata] = [b.label for b in branches]
        assert len({b.thread_id for b in branches}) == (3 if metadata else 1)
    assert stats[True] == stats[False]  # metadata or structure: the same labels
    assert stats[True].count("subagent") == 2 and stats[True][0] == "main" and "main-summary" in stats[True]
    # Without message ends the structure is unknown: every new branch of the thread is a main-summary.
    no_structure = build_branches(store.read("x"))
    assert [b.label for b in no_structure] == ["main"] + ["main-summary"] * (len(no_structure) - 1)


# -- resume -------------------------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    steps=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    cap=st.sampled_from([None, 2]),
    packing=st.sampled_from(["tree", "plain"]),
)
def test_resuming_from_any_saved_iterator_state_is_exact(executions, data, steps, cap, packing):
    config = TrajectoryConfig(max_branches=cap, packing=packing, row_length=48, rows=1, max_sequences=2, vocab_size=8)
    with tempfile.TemporaryDirectory() as d:
        store = RecordStore(Path(d) / "records")
        pipe = TrajectoryPipeline(store.root, Path(d) / "trajectory", config)
        n = 0
        for step, size in enumerate(steps):
            batch = []
            for _ in range(size):
                eid = f"e{n}"
                write_records(store, data.draw(executions(eid)))
                if data.draw(st.booleans()) and n % 3 == 2:
                    store.path(eid).write_text(store.path(eid).read_text()[:-3])  # a truncated file now and then
                batch.append((eid, float(n)))
                n += 1
            pipe.enqueue(step, batch)
        outputs = all_outputs(pipe)
        assert sum(o.end_of_step for _, o in outputs) == len(steps)
        cut = data.draw(st.integers(0, len(outputs)))
        state = outputs[cut][0] if cut < len(outputs) else json.loads(json.dumps(pipe.get_state()))
        resumed = TrajectoryPipeline(store.root, Path(d) / "trajectory", config, state=state)
        rest = all_outputs(resumed)
    assert len(rest) == len(outputs) - cut
    assert all(same_output(a, b) for (_, a), (_, b) in zip(outputs[cut:], rest))
    # Nothing dropped, nothing repeated: every execution appears exactly once over the whole run.
    seen = [s.execution_id for _, o in outputs if o.packed for s in o.packed.sequences]
    excluded = [e for _, o in outputs for e, _ in o.excluded]
    assert not set(seen) & set(excluded) and len(excluded) == len(set(excluded))
    assert set(seen) | set(excluded) == {f"e{i}" for i in range(n)}


def test_state_survives_an_orbax_checkpoint_and_later_entries_are_dropped_or_kept(tmp_path):
    store = RecordStore(tmp_path / "records")
    shape = TraceShape(
        num_calls=8,
        system_len=10,
        task_len=4,
        completion_len=(2, 6),
        tool_output_len=(2, 6),
        context_limit=70,
        summary_len=4,
        subagent_every=4,
        subagent_calls=2,
        subagent_system_len=6,
        vocab_size=64,
    )
    ids = [f"e{i}" for i in range(8)]
    write_executions(store, ids, shape)
    config = TrajectoryConfig(
        max_branches=5, row_length=128, rows=2, max_sequences=8, vocab_size=64, message_end_id=MESSAGE_END
    )
    pipe = TrajectoryPipeline(store.root, tmp_path / "trajectory", config)
    for step in range(3):
        pipe.enqueue(step, [(e, 0.1 * step) for e in ids[step * 2 : step * 2 + 2]])
    first = pipe.next_step()
    ckpt = Checkpointer(tmp_path / "checkpoints")
    ckpt.save(1, {"w": jnp.zeros((2,))}, {"next_step": 1, "trajectory": pipe.get_state()})
    rest = [pipe.next_step(), pipe.next_step()]
    pipe.enqueue(3, [("e6", 1.0)])  # after the checkpoint: a resumed trainer runs step 3 again
    _, meta = ckpt.restore(1, {"w": jnp.zeros((2,))})
    ckpt.close()
    resumed = TrajectoryPipeline(store.root, tmp_path / "trajectory", config, state=meta["trajectory"])
    again = [resumed.next_step(), resumed.next_step()]  # steps 1 and 2: queued before the checkpoint, kept
    for a, b in zip(rest, again):
        assert (a.step, a.executions, a.stats) == (b.step, b.executions, b.stats)
        for x, y in zip(a.micro_batches, b.micro_batches):
            assert all(np.array_equal(getattr(x, f), getattr(y, f)) for f in x.__dataclass_fields__)
    assert first.step == 0 and [s.step for s in again] == [1, 2]
    with pytest.raises(RuntimeError, match="no complete step"):
        resumed.next_step()  # step 3 was enqueued after the checkpoint: dropped
    resumed.enqueue(3, [("e7", 1.0)])
    assert resumed.next_step().executions == ["e7"]
    # A state from another queue is refused.
    with pytest.raises(ValueError, match="does not belong to this queue"):
        TrajectoryPipeline(store.root, tmp_path / "other", config, state=meta["trajectory"])


def test_the_pipeline_streams_grain_iterators_and_takes_only_whole_steps(tmp_path):
    store = RecordStore(tmp_path / "records")
    write_executions(
        store,
        ["a", "b"],
        TraceShape(
            num_calls=3,
            system_len=6,
            task_len=3,
            completion_len=(2, 4),
            tool_output_len=(2, 4),
            context_limit=1000,
            subagent_every=0,
            vocab_size=64,
        ),
    )
    pipe = TrajectoryPipeline(
        store.root, tmp_path / "trajectory", SMALL.__class__(**{**SMALL.__dict__, "vocab_size": 64})
    )
    assert isinstance(pipe.dataset, grain.IterDataset)
    assert isinstance(iter(pipe), grain.DatasetIterator)
    with pytest.raises(RuntimeError, match="no complete step"):
        pipe.next_step()
    # A step whose last entry is not queued yet (an async producer mid-write) is not taken half-way.
    queue = ExecutionQueue(tmp_path / "trajectory")
    with open(queue.path, "a") as f:
        f.write(
            json.dumps(
                {"index": 0, "execution_id": "a", "step": 0, "advantage": 1.0, "weight": 0.5, "last_in_step": False}
            )
            + "\n"
        )
    state = pipe.get_state()
    with pytest.raises(RuntimeError, match="no complete step"):
        pipe.next_step()
    assert pipe.get_state() == state  # nothing consumed
    with open(queue.path, "a") as f:
        f.write(
            json.dumps(
                {"index": 1, "execution_id": "b", "step": 0, "advantage": -1.0, "weight": 0.5, "last_in_step": True}
            )
            + "\n"
        )
    step = pipe.next_step()
    assert step.executions == ["a", "b"] and step.step == 0


def test_queue_refuses_bad_steps(tmp_path):
    queue = ExecutionQueue(tmp_path)
    with pytest.raises(ValueError, match="nothing to enqueue"):
        queue.append_step(0, [])
    with pytest.raises(ValueError, match="listed twice"):
        queue.append_step(0, [("a", 1.0), ("a", 2.0)])
    with pytest.raises(ValueError, match="non-finite advantage"):
        queue.append_step(0, [("a", float("nan"))])
    with pytest.raises(ValueError, match="invalid execution id"):
        queue.append_step(0, [("../a", 1.0)])
    with pytest.raises(ValueError, match="normalizer=1 must be >= the 2"):
        queue.append_step(0, [("a", 1.0), ("b", 1.0)], normalizer=1)
    entries = queue.append_step(4, [("a", 1.0), ("b", 1.0)], normalizer=4)
    assert [(e.index, e.weight, e.last_in_step) for e in entries] == [(0, 0.25, False), (1, 0.25, True)]
    # A torn entry (crash mid-append) is not part of the queue and is overwritten by the next append.
    with open(queue.path, "a") as f:
        f.write('{"index": 2, "exec')
    assert ExecutionQueue(tmp_path).end()[1] == 2
    fresh = ExecutionQueue(tmp_path)
    fresh.append_step(5, [("c", 0.0)])
    lines = fresh.path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["index"] == 2


def test_config_is_validated_with_clear_messages():
    with pytest.raises(ValueError, match="packing='dense' must be one of"):
        TrajectoryConfig(packing="dense")
    with pytest.raises(ValueError, match="max_branches=0"):
        TrajectoryConfig(max_branches=0)
    with pytest.raises(ValueError, match="rows=0 must be >= 1"):
        TrajectoryConfig(rows=0)


def test_config_from_the_run_config():
    from gyre_jax.config import load_config

    c = load_config(
        [
            "--config.rl.max_branches=3",
            "--config.trajectory.packing=plain",
            "--config.trajectory.tokens_per_micro_batch=8192",
        ]
    ).trajectory_config()
    assert (c.max_branches, c.packing, c.row_length, c.rows, c.max_sequences) == (3, "plain", 1024, 8, 64)
    # Labels follow the proxy's threads (one per agent) unless a message end is passed for structure.
    assert c.message_end_id is None and c.vocab_size == 272 and c.seed == 0 and c.auxiliary == "lowest"
    assert load_config([]).trajectory_config(message_end_id=7).message_end_id == 7
    assert load_config(["--config.trajectory.auxiliary=exclude"]).trajectory_config().auxiliary == "exclude"
    with pytest.raises(ValueError, match="trajectory.auxiliary='drop' must be one of"):
        load_config(["--config.trajectory.auxiliary=drop"])
