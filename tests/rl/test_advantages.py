"""Tests for gyre_jax/rl/advantages.py: group-normalized advantages, exclusions and skipped groups."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.rl.advantages import group_advantages


def test_advantages_are_normalized_within_each_group():
    rewards = {"a0": 1.0, "a1": 0.0, "a2": 0.5, "b0": 10.0, "b1": 30.0}
    groups = {"a0": "A", "a1": "A", "a2": "A", "b0": "B", "b1": "B"}
    out = group_advantages(rewards, groups, eps=0.0)
    assert set(out.advantages) == set(rewards)
    ra = np.array([1.0, 0.0, 0.5])
    expected_a = (ra - ra.mean()) / ra.std()
    np.testing.assert_allclose([out.advantages[k] for k in ("a0", "a1", "a2")], expected_a, rtol=1e-12)
    # Group B is normalized on its own scale: +-1 regardless of the reward magnitudes.
    assert out.advantages["b0"] == pytest.approx(-1.0)
    assert out.advantages["b1"] == pytest.approx(1.0)
    assert out.skipped_groups == 0 and out.excluded == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.one_of(st.none(), st.floats(-100, 100, allow_nan=False)), min_size=1, max_size=6),
        min_size=1,
        max_size=5,
    )
)
def test_group_statistics_property(group_rewards):
    rewards, groups = {}, {}
    for g, rs in enumerate(group_rewards):
        for j, r in enumerate(rs):
            rewards[f"g{g}-{j}"] = r
            groups[f"g{g}-{j}"] = f"g{g}"
    out = group_advantages(rewards, groups)
    valid = [[r for r in rs if r is not None] for rs in group_rewards]
    assert out.excluded == sum(r is None for rs in group_rewards for r in rs)
    assert out.skipped_groups == sum(len(v) < 2 for v in valid)
    expected_ids = {
        f"g{g}-{j}"
        for g, rs in enumerate(group_rewards)
        if len(valid[g]) >= 2
        for j, r in enumerate(rs)
        if r is not None
    }
    assert set(out.advantages) == expected_ids
    for g, rs in enumerate(group_rewards):
        if len(valid[g]) < 2:
            continue
        a = np.array([out.advantages[f"g{g}-{j}"] for j, r in enumerate(rs) if r is not None])
        assert abs(a.mean()) < 1e-6  # centered over the valid members only
        if np.std(valid[g]) > 1e-2:
            assert a.std() == pytest.approx(1.0, rel=1e-3)  # unit scale over the valid members only
        # Order is preserved: a higher reward never gets a lower advantage.
        order = np.argsort(valid[g], kind="stable")
        assert np.all(np.diff(a[order]) >= -1e-9)


def test_excluded_execution_leaves_its_group_which_is_renormalized():
    groups = {"e0": "T", "e1": "T", "e2": "T"}
    with_all = group_advantages({"e0": 0.0, "e1": 1.0, "e2": 100.0}, groups)
    excluded = group_advantages({"e0": 0.0, "e1": 1.0, "e2": None}, groups)
    assert "e2" in with_all.advantages and "e2" not in excluded.advantages
    assert excluded.excluded == 1 and excluded.skipped_groups == 0
    # Without the outlier, the two remaining executions are exactly -1 and +1.
    assert excluded.advantages["e0"] == pytest.approx(-1.0, abs=1e-5)
    assert excluded.advantages["e1"] == pytest.approx(1.0, abs=1e-5)
    # A reward missing from ``rewards`` altogether counts as excluded too.
    missing = group_advantages({"e0": 0.0, "e1": 1.0}, groups)
    assert missing.advantages == excluded.advantages and missing.excluded == 1


def test_group_with_fewer_than_two_valid_executions_is_skipped_and_counted():
    rewards = {"a0": 1.0, "a1": None, "b0": None, "b1": None, "c0": 2.0, "c1": 3.0, "d0": 5.0}
    groups = {"a0": "A", "a1": "A", "b0": "B", "b1": "B", "c0": "C", "c1": "C", "d0": "D"}
    out = group_advantages(rewards, groups)
    assert out.skipped_groups == 3  # A (one valid), B (none valid), D (singleton)
    assert out.excluded == 3
    assert set(out.advantages) == {"c0", "c1"}


def test_all_equal_rewards_give_zero_advantages():
    rewards = {f"e{i}": 0.75 for i in range(8)}
    out = group_advantages(rewards, {k: "G" for k in rewards})
    assert out.skipped_groups == 0
    assert out.advantages == {k: 0.0 for k in rewards}
    assert all(np.isfinite(v) for v in out.advantages.values())
