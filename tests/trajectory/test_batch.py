"""Tests for gyre_jax/trajectory/batch.py: padded micro-batches for RL and the supervised warm start."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.rl.learner import count_tokens
from gyre_jax.rl.losses import GSPOParams, LossInputs, gspo_loss
from gyre_jax.trajectory.batch import make_micro_batches, row_length, supervised_micro_batch
from gyre_jax.trajectory.branches import Branch

# one compiled program per micro-batch shape instead of op-by-op dispatch of each of the loss's primitives (the
# drawn shapes vary, so eager dispatch compiled every primitive once per shape: most of this file's time)
_gspo_loss = jax.jit(gspo_loss, static_argnums=1)


@st.composite
def branch_lists(draw):
    n = draw(st.integers(1, 7))
    branches = []
    for i in range(n):
        length = draw(st.integers(1, 40))
        trainable = draw(st.lists(st.booleans(), min_size=length, max_size=length))
        b = Branch(execution_id=f"e{i}", thread_id="main", label="main")
        b.tokens = draw(st.lists(st.integers(0, 271), min_size=length, max_size=length))
        b.trainable = trainable
        b.logprobs = [(-0.1 - 0.01 * j) if tr else 0.0 for j, tr in enumerate(trainable)]
        b.temperature = [0.7 if tr else 1.0 for tr in trainable]
        b.versions = [3 if tr else -1 for tr in trainable]
        branches.append(b)
    advantages = draw(st.lists(st.floats(-3, 3, allow_nan=False, width=32), min_size=n, max_size=n))
    weights = [1.0 / n] * n
    return branches, advantages, weights


@settings(max_examples=30, deadline=None)
@given(branch_lists(), st.integers(1, 4), st.sampled_from([8, 16, 128]))
def test_micro_batches_shift_targets_and_mask_exactly_the_trainable_targets(case, mbs_size, multiple):
    branches, advantages, weights = case
    mbs = make_micro_batches(branches, advantages, weights, mbs_size, multiple=multiple)
    assert len(mbs) == math.ceil(len(branches) / mbs_size)
    length = row_length(max(len(b.tokens) - 1 for b in branches), multiple)
    assert length % multiple == 0 and length >= max(len(b.tokens) - 1 for b in branches)
    for mb in mbs:
        for name in (
            "tokens",
            "positions",
            "segment_ids",
            "targets",
            "loss_mask",
            "old_logprobs",
            "temperature",
            "seq_index",
        ):
            assert getattr(mb, name).shape == (mbs_size, length), name
        assert mb.advantages.shape == mb.seq_weights.shape == (mbs_size,)
        np.testing.assert_array_equal(mb.seq_index, np.arange(mbs_size)[:, None] * np.ones((1, length), np.int32))
    for i, br in enumerate(branches):
        mb, row = mbs[i // mbs_size], i % mbs_size
        n = len(br.tokens) - 1
        np.testing.assert_array_equal(mb.tokens[row, :n], br.tokens[:-1])
        np.testing.assert_array_equal(mb.targets[row, :n], br.tokens[1:])
        # Targets are the inputs shifted by one.
        np.testing.assert_array_equal(mb.targets[row, : max(n - 1, 0)], mb.tokens[row, 1:n])
        np.testing.assert_array_equal(mb.loss_mask[row, :n], np.asarray(br.trainable[1:], np.float32))
        np.testing.assert_array_equal(mb.old_logprobs[row, :n], np.asarray(br.logprobs[1:], np.float32))
        np.testing.assert_array_equal(mb.temperature[row, :n], np.asarray(br.temperature[1:], np.float32))
        np.testing.assert_array_equal(mb.positions[row, :n], np.arange(n))
        np.testing.assert_array_equal(mb.segment_ids[row, :n], 1)
        assert np.all(mb.segment_ids[row, n:] == 0) and np.all(mb.loss_mask[row, n:] == 0)
        assert np.all(mb.temperature[row, n:] == 1.0)
        assert mb.advantages[row] == np.float32(advantages[i]) and mb.seq_weights[row] == np.float32(weights[i])
    # Padding rows of the last micro-batch carry nothing.
    last = mbs[-1]
    used = len(branches) - (len(mbs) - 1) * mbs_size
    assert np.all(last.seq_weights[used:] == 0) and np.all(last.loss_mask[used:] == 0)
    assert np.all(last.segment_ids[used:] == 0) and np.all(last.advantages[used:] == 0)
    # Every trainable target (not the first token: nothing predicts it) is masked in exactly once.
    trained = sum(sum(b.trainable[1:]) for b in branches)
    assert sum(mb.num_target_tokens for mb in mbs) == trained
    assert count_tokens(mbs) == (sum(len(b.tokens) - 1 for b in branches), trained)
    # On-policy (logprobs == old_logprobs) every ratio is 1: the loss is -sum(w * A) over trainable sequences.
    loss = sum(
        float(_gspo_loss(LossInputs.of(mb, mb.old_logprobs), GSPOParams(clip_low=0.2, clip_high=0.2))[0]) for mb in mbs
    )
    expected = -sum(w * a for b, a, w in zip(branches, advantages, weights) if sum(b.trainable[1:]) > 0)
    assert loss == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_no_branches_gives_no_micro_batches():
    assert make_micro_batches([], [], [], 4) == []


def test_row_length_buckets():
    assert row_length(1) == 128 and row_length(128) == 128 and row_length(129) == 256
    assert row_length(17, multiple=16) == 32 and row_length(0, multiple=16) == 16


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.tuples(st.integers(0, 271), st.booleans()), min_size=2, max_size=30), min_size=1, max_size=5),
    st.integers(0, 8),
)
def test_supervised_micro_batch_weights_sum_to_one_over_trainable_targets(seqs, slack):
    sequences = [([t for t, _ in s], [m for _, m in s]) for s in seqs]
    total = sum(sum(tr[1:]) for _, tr in sequences)
    length = max(len(ids) for ids, _ in sequences) - 1 + slack
    mb = supervised_micro_batch(sequences, total, length)
    assert mb.tokens.shape == (len(sequences), length)
    if total:
        assert float(mb.loss_mask.sum()) == pytest.approx(1.0, rel=1e-5)
        assert np.all(np.isin(mb.loss_mask, [0.0, np.float32(1.0 / total)]))
    else:
        assert float(mb.loss_mask.sum()) == 0.0
    for row, (ids, tr) in enumerate(sequences):
        n = len(ids) - 1
        np.testing.assert_array_equal(mb.tokens[row, :n], ids[:-1])
        np.testing.assert_array_equal(mb.targets[row, :n], ids[1:])
        np.testing.assert_array_equal(mb.loss_mask[row, :n] > 0, np.asarray(tr[1:]))
        assert np.all(mb.segment_ids[row, :n] == 1) and np.all(mb.segment_ids[row, n:] == 0)
        assert np.all(mb.loss_mask[row, n:] == 0)


def test_supervised_micro_batch_truncates_to_length():
    ids, tr = list(range(10)), [False, False] + [True] * 8
    mb = supervised_micro_batch([(ids, tr)], total_targets=4, length=4)
    np.testing.assert_array_equal(mb.tokens[0], [0, 1, 2, 3])
    np.testing.assert_array_equal(mb.targets[0], [1, 2, 3, 4])
    np.testing.assert_allclose(mb.loss_mask[0], [0.0, 0.25, 0.25, 0.25])


def test_attention_mask_is_segment_causal_for_plain_rows_and_ancestor_only_for_trees():
    import jax.numpy as jnp

    from gyre_jax.model.attention import segment_causal_mask
    from gyre_jax.trajectory.batch import attention_mask

    # Plain packing: two sequences (lengths 3 and 2) and padding; subtree_end = end of each segment.
    seg = np.array([[1, 1, 1, 2, 2, 0]], np.int32)
    end = np.array([[3, 3, 3, 5, 5, 0]], np.int32)
    np.testing.assert_array_equal(
        np.asarray(attention_mask(jnp.asarray(seg), jnp.asarray(end))),
        np.asarray(segment_causal_mask(jnp.asarray(seg))),
    )
    # A tree in depth-first order: root 0 -> 1 -> {2, 3}: token 3 must not see its sibling 2.
    seg = np.array([[1, 1, 1, 1]], np.int32)
    end = np.array([[4, 4, 3, 4]], np.int32)
    mask = np.asarray(attention_mask(jnp.asarray(seg), jnp.asarray(end)))[0]
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]], bool)
    np.testing.assert_array_equal(mask, expected)
