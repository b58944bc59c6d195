"""Tests for gyre_jax/rl/losses.py: GSPO loss value, gradient and metrics against a NumPy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.rl.losses import gspo_loss, sequence_mean, token_nll_loss

B, T, S = 3, 12, 6  # fixed shapes: the jitted loss compiles once for every generated layout
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def reference_gspo(logp, old, mask, seq_index, adv, w, cl, ch):
    """Straightforward float64 GSPO: (loss, dloss/dlogp [B, T], per-sequence ratio, was_clipped, weights)."""
    logp, old, mask = (np.asarray(x, np.float64) for x in (logp, old, mask))
    adv, w = np.asarray(adv, np.float64), np.asarray(w, np.float64)
    num = len(adv)
    total, count = np.zeros(num), np.zeros(num)
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            s = seq_index[b, t]
            total[s] += (logp[b, t] - old[b, t]) * mask[b, t]
            count[s] += mask[b, t]
    ratio = np.exp(total / np.maximum(count, 1.0))
    clipped = np.clip(ratio, 1.0 - cl, 1.0 + ch)
    unclipped_term, clipped_term = ratio * adv, clipped * adv
    per_seq = -np.minimum(unclipped_term, clipped_term)
    weights = np.where(count > 0, w, 0.0)
    loss = float(np.sum(weights * per_seq))
    was_clipped = unclipped_term > clipped_term
    # d per_seq / d ratio: -A unless the clipped (constant) term is the smaller one.
    dper_dratio = np.where(was_clipped, 0.0, -adv)
    grad = np.zeros_like(logp)
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            s = seq_index[b, t]
            if count[s] > 0:
                grad[b, t] = weights[s] * dper_dratio[s] * ratio[s] * mask[b, t] / count[s]
    return loss, grad, ratio, was_clipped, weights


@jax.jit
def _loss_and_grad(logp, old, mask, seq_index, adv, w):
    def f(lp):
        return gspo_loss(lp, old, mask, seq_index, adv, w, CLIP_LOW, CLIP_HIGH)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(logp)
    return loss, metrics, grad


@st.composite
def packed_layouts(draw):
    """seq_index [B, T] with several sequences per row (contiguous runs), trailing padding, and masks."""
    seq_index = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), np.float32)
    next_seq = 0
    for b in range(B):
        t = 0
        while t < T and next_seq < S:
            length = draw(st.integers(1, T - t))
            seq_index[b, t : t + length] = next_seq
            # Each token trainable or not (a sequence may end up with no trainable token at all).
            mask[b, t : t + length] = draw(st.lists(st.booleans(), min_size=length, max_size=length))
            next_seq += 1
            t += length
        seq_index[b, t:] = draw(st.integers(0, S - 1))  # padding: any index, never trainable
    # Force at least one sequence with zero trainable tokens but a non-zero weight (it must drop out).
    empty = draw(st.integers(0, S - 1))
    mask[seq_index == empty] = 0.0
    return seq_index, mask, empty


@settings(max_examples=40, deadline=None)
@given(layout=packed_layouts(), seed=st.integers(0, 2**31 - 1))
def test_gspo_value_and_gradient_match_numpy_reference(layout, seed):
    seq_index, mask, empty = layout
    rng = np.random.default_rng(seed)
    logp = rng.uniform(-6.0, -0.05, (B, T)).astype(np.float32)
    # Per-sequence log-ratio shifts spanning clipped and unclipped ratios on both sides.
    shift = rng.uniform(-0.6, 0.6, S)[seq_index] + rng.normal(0.0, 0.05, (B, T))
    old = (logp - shift).astype(np.float32)
    adv = rng.normal(0.0, 1.0, S).astype(np.float32)
    w = rng.uniform(0.1, 1.0, S).astype(np.float32)

    ref_loss, ref_grad, ref_ratio, ref_clipped, ref_w = reference_gspo(logp, old, mask, seq_index, adv, w, CLIP_LOW, CLIP_HIGH)
    # Keep away from the exact clip boundaries, where float32 and float64 may pick different branches.
    assert np.all(np.abs(ref_ratio - (1 - CLIP_LOW)) > 1e-4) and np.all(np.abs(ref_ratio - (1 + CLIP_HIGH)) > 1e-4)

    loss, metrics, grad = _loss_and_grad(logp, old, mask, seq_index, adv, w)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-4, atol=1e-7)
    assert ref_w[empty] == 0.0
    np.testing.assert_allclose(float(metrics["weight_sum"]), ref_w.sum(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["clip_fraction"]), np.sum(ref_w * ref_clipped), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["ratio_mean"]), np.sum(ref_w * ref_ratio), rtol=1e-5)
    # Non-trainable tokens never receive gradient.
    assert np.all(np.asarray(grad)[mask == 0] == 0.0)


def test_sequence_without_trainable_tokens_drops_out_of_loss_and_metrics():
    seq_index = np.array([[0, 0, 1, 1]], np.int32)
    mask = np.array([[1, 1, 0, 0]], np.float32)
    logp = np.array([[-1.0, -2.0, -3.0, -4.0]], np.float32)
    old = logp - 0.1
    w = np.array([0.5, 0.5], np.float32)
    loss_a, m_a = gspo_loss(logp, old, mask, seq_index, np.array([1.0, 7.0], np.float32), w, CLIP_LOW, CLIP_HIGH)
    loss_b, m_b = gspo_loss(logp, old, mask, seq_index, np.array([1.0, -3.0], np.float32), w, CLIP_LOW, CLIP_HIGH)
    assert float(loss_a) == pytest.approx(float(loss_b))
    assert float(loss_a) == pytest.approx(-0.5 * np.exp(0.1), rel=1e-6)
    assert float(m_a["weight_sum"]) == pytest.approx(0.5)


def test_clip_fraction_and_ratio_mean_on_constructed_case():
    # One token per sequence: log-ratio = +-log(1.5) / log(0.5) exactly.
    r = np.array([1.5, 0.5, 0.5, 1.5, 1.1], np.float32)
    adv = np.array([1.0, 1.0, -1.0, -1.0, 2.0], np.float32)
    # clipped:   yes   no    yes    no    no (inside the range)
    w = np.array([0.1, 0.2, 0.3, 0.15, 0.25], np.float32)
    logp = np.full((1, 5), -2.0, np.float32)
    old = (logp - np.log(r)[None]).astype(np.float32)
    seq_index = np.arange(5, dtype=np.int32)[None]
    mask = np.ones((1, 5), np.float32)

    def f(lp):
        return gspo_loss(lp, old, mask, seq_index, adv, w, CLIP_LOW, CLIP_HIGH)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
    assert float(metrics["clip_fraction"]) == pytest.approx(0.1 + 0.3, rel=1e-6)
    assert float(metrics["ratio_mean"]) == pytest.approx(float(np.sum(w * r)), rel=1e-6)
    assert float(metrics["weight_sum"]) == pytest.approx(1.0, rel=1e-6)
    expected = -(0.1 * 1.28 * 1.0 + 0.2 * 0.5 * 1.0 + 0.3 * 0.8 * -1.0 + 0.15 * 1.5 * -1.0 + 0.25 * 1.1 * 2.0)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    g = np.asarray(grad)[0]
    # Clipped sequences get no gradient; the others get -w * A * ratio (one token each).
    np.testing.assert_allclose(g, [0.0, -0.2 * 0.5, 0.0, 0.15 * 1.5, -0.25 * 2.0 * 1.1], rtol=1e-5, atol=1e-8)


def test_sequence_mean_over_packed_rows():
    values = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], np.float32)
    mask = np.array([[1, 1, 0, 1], [1, 0, 0, 0]], np.float32)
    seq_index = np.array([[0, 0, 1, 1], [2, 2, 3, 3]], np.int32)
    means, counts = sequence_mean(values, mask, seq_index, 4)
    np.testing.assert_allclose(np.asarray(means), [1.5, 4.0, 5.0, 0.0])
    np.testing.assert_allclose(np.asarray(counts), [2, 1, 1, 0])


def test_token_nll_loss_value_and_gradient():
    rng = np.random.default_rng(0)
    logp = jnp.asarray(rng.uniform(-5, 0, (2, 7)).astype(np.float32))
    w = rng.uniform(0, 1, (2, 7)).astype(np.float32)
    w[1, 3:] = 0.0
    loss, grad = jax.value_and_grad(token_nll_loss)(logp, w)
    assert float(loss) == pytest.approx(-float(np.sum(w * np.asarray(logp))), rel=1e-6)
    np.testing.assert_allclose(np.asarray(grad), -w, rtol=1e-6)
