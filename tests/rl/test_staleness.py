"""Tests for gyre_jax/rl/staleness.py and gyre_jax/rl/step_data.py: staleness from per-token policy versions,
dropping over the bound eta, group renormalization after drops and exclusions, per-execution weights."""

from __future__ import annotations

import numpy as np
import pytest

from gyre_jax.rl.advantages import group_advantages
from gyre_jax.rl.staleness import measure_staleness, oldest_version
from gyre_jax.rl.step_data import assemble_rl_step
from gyre_jax.trajectory.branches import Branch


def branch(eid: str, versions: list[int], label: str = "main") -> Branch:
    """A branch with a 3-token prompt (no version) and one completion token per entry of ``versions``."""
    b = Branch(execution_id=eid, thread_id="main", label=label)
    b._append([1, 2, 3], trainable=False)
    b._append(
        list(range(10, 10 + len(versions))), trainable=True, logprobs=[-0.5] * len(versions), versions=list(versions)
    )
    return b


def test_staleness_is_current_version_minus_the_oldest_trainable_token():
    # A request in flight across weight updates: its tokens carry versions 3, 3, 4, 5.
    assert oldest_version([branch("e", [3, 3, 4, 5])]) == 3
    assert oldest_version([branch("e", [6, 7]), branch("e", [5, 9], label="subagent")]) == 5
    assert oldest_version([Branch(execution_id="e", thread_id="main", label="main")]) is None
    report = measure_staleness(
        {"a": [branch("a", [3, 4, 5])], "b": [branch("b", [6])], "c": [branch("c", [2, 6])]},
        current_version=6,
        max_staleness=2,
    )
    assert report.staleness == {"a": 3, "b": 0, "c": 4}
    assert report.dropped == ["a", "c"]
    assert report.metrics() == {"staleness_mean": pytest.approx(7 / 3), "staleness_max": 4, "stale_dropped": 2}
    unbounded = measure_staleness({"a": [branch("a", [3])]}, current_version=6, max_staleness=None)
    assert unbounded.dropped == [] and unbounded.max == 3


def test_tokens_without_a_version_cannot_be_bounded():
    bad = branch("x", [4, 5])
    bad.versions[-1] = -1  # a trainable token that lost its version
    with pytest.raises(ValueError, match="no policy version"):
        oldest_version([bad])
    report = measure_staleness({"x": [bad], "y": [branch("y", [5])]}, current_version=5, max_staleness=1)
    assert report.dropped == ["x"] and report.unknown == ["x"] and report.staleness == {"y": 0}
    assert measure_staleness({"x": [bad]}, current_version=5, max_staleness=None).dropped == []
    with pytest.raises(ValueError, match="max_staleness"):
        measure_staleness({}, 0, max_staleness=-1)


def test_stale_executions_leave_their_group_which_is_renormalized():
    groups = {f"t{g}-{i}": f"t{g}" for g in range(2) for i in range(4)}
    rewards = {"t0-0": 1.0, "t0-1": 0.0, "t0-2": 0.5, "t0-3": 0.25, "t1-0": 1.0, "t1-1": 0.0, "t1-2": None, "t1-3": 0.0}
    versions = {
        "t0-0": [9],
        "t0-1": [7, 9],
        "t0-2": [9],
        "t0-3": [5],
        "t1-0": [8],
        "t1-1": [9],
        "t1-2": [9],
        "t1-3": [4],
    }
    branches = {eid: [branch(eid, v)] for eid, v in versions.items()}
    data = assemble_rl_step(rewards, groups, branches, current_version=9, max_staleness=2)
    # t0-3 (staleness 4) and t1-3 (5) are dropped; t1-2 is excluded (evaluator failure).
    assert data.metrics["stale_dropped"] == 2 and data.metrics["group_excluded"] == 1
    assert data.metrics["staleness_max"] == 5
    assert data.metrics["staleness_mean"] == pytest.approx(np.mean([0, 2, 0, 4, 1, 0, 5]))  # excluded t1-2 not measured
    # Group t0 is renormalized over the three executions left; t1 keeps two valid ones.
    r = np.array([1.0, 0.0, 0.5])
    want = dict(zip(["t0-0", "t0-1", "t0-2"], (r - r.mean()) / (r.std() + 1e-6)))
    want.update({"t1-0": 1.0, "t1-1": -1.0})
    got = dict(zip(data.execution_ids, data.advantages))
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-5), k
    assert data.metrics["executions_trained"] == 5 and data.metrics["skipped_groups"] == 0
    # Without a bound nothing is dropped and group t0 has four members.
    loose = assemble_rl_step(rewards, groups, branches, current_version=9, max_staleness=None)
    assert loose.metrics["stale_dropped"] == 0 and loose.metrics["executions_trained"] == 7


def test_a_group_left_with_one_execution_after_drops_is_skipped_and_counted():
    groups = {"a0": "A", "a1": "A", "b0": "B", "b1": "B"}
    rewards = {"a0": 1.0, "a1": 0.0, "b0": 1.0, "b1": 0.0}
    branches = {
        "a0": [branch("a0", [3])],
        "a1": [branch("a1", [0])],
        "b0": [branch("b0", [3])],
        "b1": [branch("b1", [3])],
    }
    data = assemble_rl_step(rewards, groups, branches, current_version=3, max_staleness=1)
    assert data.metrics["stale_dropped"] == 1 and data.metrics["skipped_groups"] == 1
    assert sorted(set(data.execution_ids)) == ["b0", "b1"]


def test_each_execution_counts_once_however_much_it_branched():
    groups = {"e0": "T", "e1": "T", "e2": "T"}
    rewards = {"e0": 1.0, "e1": 0.0, "e2": 0.5}
    branches = {
        "e0": [branch("e0", [1]), branch("e0", [1], "main-summary"), branch("e0", [1], "subagent")],
        "e1": [branch("e1", [1])],
        "e2": [branch("e2", [1]), branch("e2", [1], "subagent")],
    }
    data = assemble_rl_step(rewards, groups, branches, current_version=1)
    per_exec: dict[str, float] = {}
    for eid, w in zip(data.execution_ids, data.seq_weights):
        per_exec[eid] = per_exec.get(eid, 0.0) + w
    assert per_exec == {k: pytest.approx(1 / 3) for k in ("e0", "e1", "e2")}
    assert data.metrics["sequences"] == 6
    raw = assemble_rl_step(rewards, groups, branches, current_version=1, normalize=False)
    assert [w * 3 for w in data.seq_weights] == pytest.approx(raw.seq_weights)  # grad_scale = 1 / executions later


def test_dropped_and_non_finite_rewards_are_counted_separately():
    groups = {"a": "G", "b": "G", "c": "G", "d": "G"}
    out = group_advantages({"a": 1.0, "b": float("nan"), "c": 0.0, "d": 2.0}, groups, dropped=["d"])
    assert out.excluded == 1 and out.dropped == 1 and set(out.advantages) == {"a", "c"}
    assert out.advantages["a"] == pytest.approx(1.0, abs=1e-5)
