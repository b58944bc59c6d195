"""Tests for gyre_jax/rl/losses.py: GSPO loss value, gradient and metrics against a NumPy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gyre_jax.rl.losses import GRPOParams, GSPOParams, LossInputs, gspo_loss, sequence_mean, token_nll_loss

B, T, S = 3, 12, 6  # fixed shapes: the jitted loss compiles once for every generated layout
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
GSPO_P, GRPO_P = GSPOParams(CLIP_LOW, CLIP_HIGH), GRPOParams(CLIP_LOW, CLIP_HIGH)  # the clip range these tests use


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
        return gspo_loss(LossInputs(lp, old, mask, seq_index, adv, w), GSPO_P)

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

    ref_loss, ref_grad, ref_ratio, ref_clipped, ref_w = reference_gspo(
        logp, old, mask, seq_index, adv, w, CLIP_LOW, CLIP_HIGH
    )
    # Keep away from the exact clip boundaries, where float32 and float64 may pick different branches.
    assume(np.all(np.abs(ref_ratio - (1 - CLIP_LOW)) > 1e-4) and np.all(np.abs(ref_ratio - (1 + CLIP_HIGH)) > 1e-4))

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
    loss_a, m_a = gspo_loss(LossInputs(logp, old, mask, seq_index, np.array([1.0, 7.0], np.float32), w), GSPO_P)
    loss_b, m_b = gspo_loss(LossInputs(logp, old, mask, seq_index, np.array([1.0, -3.0], np.float32), w), GSPO_P)
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
        return gspo_loss(LossInputs(lp, old, mask, seq_index, adv, w), GSPO_P)

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


# --- GSPO-token, GRPO, KL (k3) and the full objective -------------------------------------------------

from gyre_jax.rl.losses import (  # noqa: E402
    LossConfig,
    grpo_loss,
    gspo_token_loss,
    kl_k3,
    rl_objective,
)


def _seq_counts(mask, seq_index, num):
    count = np.zeros(num)
    for (b, t), m in np.ndenumerate(mask):
        count[seq_index[b, t]] += m
    return count


def reference_token_level(logp, old, mask, seq_index, tok_adv, w, cl, ch, level):
    """float64 GSPO-token (level='sequence': ratio value s_i, d ratio / d logp_t = s_i) or GRPO
    (level='token': r_t = exp(logp_t - old_t)), seq-mean-token-mean aggregation.
    -> (loss, dloss/dlogp [B, T], clip weight sum, ratio weight sum)."""
    logp, old, mask, tok_adv = (np.asarray(x, np.float64) for x in (logp, old, mask, tok_adv))
    w = np.asarray(w, np.float64)
    num = len(w)
    count = _seq_counts(mask, seq_index, num)
    seq_log_ratio = np.zeros(num)
    for (b, t), m in np.ndenumerate(mask):
        seq_log_ratio[seq_index[b, t]] += m * (logp[b, t] - old[b, t])
    seq_log_ratio /= np.maximum(count, 1.0)
    loss, clip_sum, ratio_sum = 0.0, 0.0, 0.0
    grad = np.zeros_like(logp)
    for (b, t), m in np.ndenumerate(mask):
        s = seq_index[b, t]
        if m == 0 or count[s] == 0:
            continue
        tw = w[s] / count[s]
        ratio = np.exp(seq_log_ratio[s]) if level == "sequence" else np.exp(logp[b, t] - old[b, t])
        a = tok_adv[b, t]
        clipped = np.clip(ratio, 1 - cl, 1 + ch)
        loss += tw * -min(ratio * a, clipped * a)
        was_clipped = ratio * a > clipped * a
        clip_sum += tw * was_clipped
        ratio_sum += tw * ratio
        # Both variants: d ratio_t / d logp_t = ratio (the sg trick for GSPO-token; exp for GRPO).
        grad[b, t] = 0.0 if was_clipped else tw * -a * ratio
    return loss, grad, clip_sum, ratio_sum


def _random_case(layout, seed, spread=0.6):
    seq_index, mask, empty = layout
    rng = np.random.default_rng(seed)
    logp = rng.uniform(-6.0, -0.05, (B, T)).astype(np.float32)
    shift = rng.uniform(-spread, spread, S)[seq_index] + rng.normal(0.0, 0.05, (B, T))
    old = (logp - shift).astype(np.float32)
    seq_adv = rng.normal(0.0, 1.0, S).astype(np.float32)
    tok_adv = rng.normal(0.0, 1.0, (B, T)).astype(np.float32)
    w = rng.uniform(0.1, 1.0, S).astype(np.float32)
    return seq_index, mask, empty, logp, old, seq_adv, tok_adv, w


def _value_and_grad(fn, params):
    @jax.jit
    def run(logp, old, mask, seq_index, adv, w):
        (loss, metrics), grad = jax.value_and_grad(
            lambda lp: fn(LossInputs(lp, old, mask, seq_index, adv, w), params), has_aux=True
        )(logp)
        return loss, metrics, grad

    return run


_gspo_token_vg = _value_and_grad(gspo_token_loss, GSPO_P)
_grpo_vg = _value_and_grad(grpo_loss, GRPO_P)
_gspo_vg = _value_and_grad(gspo_loss, GSPO_P)


def _away_from_clip_edges(ratios, cl, ch):
    return np.all(np.abs(ratios - (1 - cl)) > 1e-4) and np.all(np.abs(ratios - (1 + ch)) > 1e-4)


@settings(max_examples=30, deadline=None)
@given(layout=packed_layouts(), seed=st.integers(0, 2**31 - 1), per_token=st.booleans())
def test_gspo_token_value_and_gradient_match_numpy_reference(layout, seed, per_token):
    seq_index, mask, empty, logp, old, seq_adv, tok_adv, w = _random_case(layout, seed)
    adv = tok_adv if per_token else seq_adv
    ref_tok_adv = tok_adv if per_token else seq_adv[seq_index]
    ref_loss, ref_grad, ref_clip, ref_ratio = reference_token_level(
        logp, old, mask, seq_index, ref_tok_adv, w, CLIP_LOW, CLIP_HIGH, "sequence"
    )
    _, _, seq_ratio, _, ref_w = reference_gspo(logp, old, mask, seq_index, seq_adv, w, CLIP_LOW, CLIP_HIGH)
    assume(_away_from_clip_edges(seq_ratio, CLIP_LOW, CLIP_HIGH))
    loss, metrics, grad = _gspo_token_vg(logp, old, mask, seq_index, adv, w)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(float(metrics["clip_fraction"]), ref_clip, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["ratio_mean"]), np.sum(ref_w * seq_ratio), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["weight_sum"]), ref_w.sum(), rtol=1e-6)
    assert np.all(np.asarray(grad)[mask == 0] == 0.0)
    if per_token:
        # Per-token advantages really change the result (the reference would be blind to them otherwise).
        other, _, _, _ = reference_token_level(
            logp, old, mask, seq_index, seq_adv[seq_index], w, CLIP_LOW, CLIP_HIGH, "sequence"
        )
        assert ref_w.sum() == 0 or abs(other - ref_loss) > 1e-6


@settings(max_examples=30, deadline=None)
@given(layout=packed_layouts(), seed=st.integers(0, 2**31 - 1), per_token=st.booleans())
def test_grpo_value_and_gradient_match_numpy_reference(layout, seed, per_token):
    # Token-level log-ratios spread over [-0.5, 0.5]: inside and outside the 0.2 / 0.28 clip range.
    seq_index, mask, empty, logp, old, seq_adv, tok_adv, w = _random_case(layout, seed, spread=0.0)
    rng = np.random.default_rng(seed + 1)
    old = (logp - rng.uniform(-0.5, 0.5, (B, T))).astype(np.float32)
    adv = tok_adv if per_token else seq_adv
    ref_tok_adv = tok_adv if per_token else seq_adv[seq_index]
    token_ratio = np.exp(logp.astype(np.float64) - old)
    assume(_away_from_clip_edges(token_ratio[mask > 0], CLIP_LOW, CLIP_HIGH))
    ref_loss, ref_grad, ref_clip, ref_ratio = reference_token_level(
        logp, old, mask, seq_index, ref_tok_adv, w, CLIP_LOW, CLIP_HIGH, "token"
    )
    loss, metrics, grad = _grpo_vg(logp, old, mask, seq_index, adv, w)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(float(metrics["clip_fraction"]), ref_clip, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["ratio_mean"]), ref_ratio, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(grad)[mask == 0] == 0.0)


@settings(max_examples=30, deadline=None)
@given(layout=packed_layouts(), seed=st.integers(0, 2**31 - 1))
def test_gspo_token_equals_gspo_when_advantages_are_per_sequence(layout, seed):
    seq_index, mask, empty, logp, old, seq_adv, tok_adv, w = _random_case(layout, seed)
    _, _, seq_ratio, _, _ = reference_gspo(logp, old, mask, seq_index, seq_adv, w, CLIP_LOW, CLIP_HIGH)
    assume(_away_from_clip_edges(seq_ratio, CLIP_LOW, CLIP_HIGH))
    loss_s, metrics_s, grad_s = _gspo_vg(logp, old, mask, seq_index, seq_adv, w)
    # Both the [S] form and the same advantages written out per token [B, T].
    for adv in (seq_adv, seq_adv[seq_index]):
        loss_t, metrics_t, grad_t = _gspo_token_vg(logp, old, mask, seq_index, adv, w)
        np.testing.assert_allclose(float(loss_t), float(loss_s), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(grad_t), np.asarray(grad_s), rtol=1e-4, atol=1e-7)
        for k in ("clip_fraction", "ratio_mean", "weight_sum"):
            np.testing.assert_allclose(float(metrics_t[k]), float(metrics_s[k]), rtol=1e-5, atol=1e-7)


def test_gspo_token_differs_from_gspo_with_per_token_advantages():
    """Constructed: one sequence of two tokens, ratio 1 (unclipped), A = (+1, -1): GSPO-token's gradient is
    -w/2 * A_t * s per token; GSPO with the mean advantage (0) has zero gradient."""
    logp = np.array([[-1.0, -2.0]], np.float32)
    mask = np.ones((1, 2), np.float32)
    seq_index = np.zeros((1, 2), np.int32)
    w = np.array([0.5], np.float32)
    tok_adv = np.array([[1.0, -1.0]], np.float32)
    grad = jax.grad(lambda lp: gspo_token_loss(LossInputs(lp, logp, mask, seq_index, tok_adv, w), GSPO_P)[0])(
        jnp.asarray(logp)
    )
    np.testing.assert_allclose(np.asarray(grad), [[-0.25, 0.25]], rtol=1e-6)
    zero_adv = np.zeros(1, np.float32)
    grad_seq = jax.grad(lambda lp: gspo_loss(LossInputs(lp, logp, mask, seq_index, zero_adv, w), GSPO_P)[0])(
        jnp.asarray(logp)
    )
    np.testing.assert_allclose(np.asarray(grad_seq), 0.0)


def _kl(logp, ref, mask, seq_index, w):
    """kl_k3 of LossInputs with these arrays (the policy-loss fields it does not read: zeros)."""
    zeros = jnp.zeros_like(w)
    return kl_k3(LossInputs(logp, jnp.zeros_like(logp), mask, seq_index, zeros, w, ref_logprobs=ref))


_kl_vg = jax.jit(jax.value_and_grad(_kl))


@settings(max_examples=25, deadline=None)
@given(layout=packed_layouts(), seed=st.integers(0, 2**31 - 1))
def test_kl_k3_value_and_gradient_match_numpy_reference(layout, seed):
    seq_index, mask, empty, logp, old, seq_adv, tok_adv, w = _random_case(layout, seed)
    ref = (logp + np.random.default_rng(seed).normal(0, 0.3, (B, T))).astype(np.float32)
    lp64, ref64 = logp.astype(np.float64), ref.astype(np.float64)
    count = _seq_counts(mask, seq_index, S)
    want, want_grad = 0.0, np.zeros((B, T))
    for (b, t), m in np.ndenumerate(mask):
        s = seq_index[b, t]
        if m == 0:
            continue
        d = ref64[b, t] - lp64[b, t]
        want += w[s] / count[s] * (np.exp(d) - d - 1)
        want_grad[b, t] = w[s] / count[s] * (1 - np.exp(d))
    value, grad = _kl_vg(logp, ref, mask, seq_index, w)
    np.testing.assert_allclose(float(value), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
    assert float(value) >= 0.0
    assert float(_kl(logp, logp, mask, seq_index, w)) == 0.0


def test_padding_values_never_reach_loss_or_gradient():
    """NaN / inf at non-trainable positions (padding, prompts) is selected away; NaN on a trained token is not."""
    logp = np.array([[-1.0, -2.0, -0.5, -0.7]], np.float32)
    mask = np.array([[1, 1, 0, 0]], np.float32)
    seq_index = np.array([[0, 0, 1, 1]], np.int32)
    adv, w = np.array([1.0, 2.0], np.float32), np.array([0.5, 0.5], np.float32)
    old = logp - 0.01
    dirty = old.copy()
    dirty[0, 2], dirty[0, 3] = np.nan, -np.inf
    for fn, params in ((gspo_loss, GSPO_P), (gspo_token_loss, GSPO_P), (grpo_loss, GRPO_P)):

        def f(lp, o, fn=fn, params=params):
            return fn(LossInputs(lp, o, mask, seq_index, adv, w), params)[0]

        clean_v, clean_g = jax.value_and_grad(f)(jnp.asarray(logp), old)
        dirty_v, dirty_g = jax.value_and_grad(f)(jnp.asarray(logp), dirty)
        assert np.isfinite(float(dirty_v)) and float(dirty_v) == pytest.approx(float(clean_v)), fn.__name__
        np.testing.assert_array_equal(np.asarray(dirty_g), np.asarray(clean_g))
        poisoned = old.copy()
        poisoned[0, 1] = np.nan
        assert not np.isfinite(float(f(jnp.asarray(logp), poisoned))), fn.__name__


def test_loss_config_defaults_and_errors():
    assert LossConfig().params == GSPOParams() and (GSPOParams().clip_low, GSPOParams().clip_high) == (3e-4, 4e-4)
    assert LossConfig("grpo").params == GRPOParams(0.2, 0.28)
    assert LossConfig("gspo_token", GSPOParams(clip_low=0.1)).params.clip_low == 0.1
    with pytest.raises(ValueError, match="must be one of"):
        LossConfig("ppo")
    with pytest.raises(ValueError, match="kl_coef"):
        LossConfig(kl_coef=-1.0)
    with pytest.raises(ValueError, match="clip"):
        LossConfig(params=GSPOParams(clip_low=1.5))
    with pytest.raises(ValueError, match="recompute_behaviour"):
        LossConfig(behaviour_is_cap=2.0)
    with pytest.raises(ValueError, match="must be a GRPOParams"):  # each loss takes its own hyperparameter type
        LossConfig("grpo", GSPOParams())


def _objective_case():
    rng = np.random.default_rng(7)
    seq_index = np.repeat(np.arange(4, dtype=np.int32), 5)[None]  # [1, 20]: 4 sequences of 5 tokens
    mask = (rng.uniform(size=(1, 20)) > 0.2).astype(np.float32)
    mask[0, ::5] = 1.0
    logp = rng.uniform(-3, -0.1, (1, 20)).astype(np.float32)
    behaviour = (logp - rng.normal(0.0, 0.2, (1, 20))).astype(np.float32)
    adv = np.array([1.0, -0.5, 0.7, 1.2], np.float32)
    w = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    return logp, behaviour, mask, seq_index, adv, w


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_recomputed_behaviour_is_on_policy_and_keeps_the_gap_metric(name):
    logp, behaviour, mask, seq_index, adv, w = _objective_case()
    cfg = LossConfig(name, recompute_behaviour=True)

    def f(lp):
        return rl_objective(LossInputs(lp, behaviour, mask, seq_index, adv, w), cfg)

    (loss, m), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
    assert float(m["ratio_mean"]) == pytest.approx(float(m["weight_sum"]), rel=1e-6)  # every ratio is exactly 1
    assert float(m["clip_fraction"]) == 0.0
    assert float(loss) == pytest.approx(-float(np.sum(w * adv)), rel=1e-6)
    # The on-policy gradient: -w_i * A_i / n_i on every trainable token of sequence i.
    count = _seq_counts(mask, seq_index, 4)
    want = np.where(mask > 0, -(w * adv / count)[seq_index], 0.0)
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-8)
    gap = np.sum(np.abs(logp - behaviour) * mask)
    assert float(m["logprob_gap_sum"]) == pytest.approx(gap, rel=1e-5) and gap > 0.1


def test_behaviour_importance_weights_are_truncated_sequence_ratios():
    logp, behaviour, mask, seq_index, adv, w = _objective_case()
    cap = 1.05
    x = LossInputs(logp, behaviour, mask, seq_index, adv, w)
    plain = rl_objective(x, LossConfig(recompute_behaviour=True))[0]
    weighted, m = rl_objective(x, LossConfig(recompute_behaviour=True, behaviour_is_cap=cap))
    seq_log_w, _ = sequence_mean(logp - behaviour, mask, seq_index, 4)
    iw = np.minimum(np.exp(np.asarray(seq_log_w, np.float64)), cap)
    assert np.any(iw == cap) and np.any(iw < cap)  # the case exercises the cap and the plain ratio
    assert float(weighted) == pytest.approx(-float(np.sum(w * iw * adv)), rel=1e-5)
    assert float(plain) != pytest.approx(float(weighted))
    assert float(m["weight_sum"]) == pytest.approx(float(np.sum(w * iw)), rel=1e-5)


def test_kl_term_is_added_with_its_coefficient_and_needs_reference_logprobs():
    logp, behaviour, mask, seq_index, adv, w = _objective_case()
    ref = logp + 0.3
    x = LossInputs(logp, behaviour, mask, seq_index, adv, w)
    base, _ = rl_objective(x, LossConfig())
    with_kl, m = rl_objective(LossInputs(logp, behaviour, mask, seq_index, adv, w, ref), LossConfig(kl_coef=0.1))
    kl = float(_kl(logp, ref, mask, seq_index, w))
    assert kl > 0 and float(m["kl"]) == pytest.approx(kl)
    assert float(with_kl) == pytest.approx(float(base) + 0.1 * kl, rel=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        rl_objective(x, LossConfig(kl_coef=0.1))


from gyre_jax.rl.losses import SequenceTotals, sequence_totals  # noqa: E402

SPLIT_NAMES = ("gspo", "gspo_token", "grpo", "kl")


@jax.jit
def _split_value_and_grads(lp, o, r, m, a, si, seq_adv, w, whole):
    """{objective: (value, d value / d logp)} of the four objectives over (logp, old, ref, mask, adv, seq_index);
    ``whole``: the whole sequences' SequenceTotals, or None (each sequence taken as whole here)."""

    def f(name, lp):
        if name == "kl":
            return kl_k3(LossInputs(lp, o, m, si, seq_adv, w, ref_logprobs=r, whole=whole))
        if name == "gspo":
            return gspo_loss(LossInputs(lp, o, m, si, seq_adv, w, whole=whole), GSPO_P)[0]
        fn, params = (gspo_token_loss, GSPO_P) if name == "gspo_token" else (grpo_loss, GRPO_P)
        return fn(LossInputs(lp, o, m, si, a, w, whole=whole), params)[0]

    return {name: jax.value_and_grad(lambda lp, name=name: f(name, lp))(lp) for name in SPLIT_NAMES}


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), cut=st.integers(1, 11), per_token=st.booleans())
def test_a_sequence_split_over_micro_batches_adds_up_exactly_with_whole_sequence_statistics(seed, cut, per_token):
    """Row 0 holds sequence 0 (12 tokens) and row 1 sequences 1 and 2. Splitting row 0 at ``cut`` into two
    micro-batches (the second also carrying row 1), with the whole-sequence log-ratio and token count from a
    pre-pass, gives the unsplit loss and gradient for GSPO, GSPO-token, GRPO and KL."""
    rng = np.random.default_rng(seed)
    t = 12
    seq_index = np.array([[0] * t, [1] * 5 + [2] * 7], np.int32)
    mask = (rng.uniform(size=(2, t)) > 0.25).astype(np.float32)
    mask[0, 0] = mask[0, -1] = mask[1, 0] = mask[1, 5] = 1.0  # every part and sequence has a trainable token
    logp = rng.uniform(-4, -0.1, (2, t)).astype(np.float32)
    old = (logp - rng.uniform(-0.3, 0.3, 3)[seq_index] - rng.normal(0, 0.05, (2, t))).astype(np.float32)
    ref = (logp + rng.normal(0, 0.2, (2, t))).astype(np.float32)
    adv = (rng.normal(size=(2, t)) if per_token else rng.normal(size=3)[seq_index]).astype(np.float32)
    seq_adv = adv[[0, 1, 1], [0, 0, 5]]
    w = np.array([0.5, 0.3, 0.2], np.float32)
    # Part A: row 0 up to ``cut`` (padded); part B: the rest of row 0 (padded) + row 1. Same sequence slots.
    part_a = [
        np.concatenate([np.pad(x[:1, :cut], ((0, 0), (0, t - cut))), np.zeros_like(x[1:])])
        for x in (logp, old, ref, mask, adv)
    ] + [seq_index]
    part_b = [np.concatenate([np.pad(x[:1, cut:], ((0, 0), (0, cut))), x[1:]]) for x in (logp, old, ref, mask, adv)]
    part_b += [seq_index]
    # the pre-pass: whole-sequence statistics, added over the parts
    part_sums = [sequence_totals(LossInputs(lp, o, m, si, seq_adv, w)) for lp, o, _, m, _, si in (part_a, part_b)]
    totals = part_sums[0] + part_sums[1]
    assert (
        isinstance(totals, SequenceTotals)
        and np.asarray(totals.count).tolist() == _seq_counts(mask, seq_index, 3).tolist()
    )
    unsplit = _split_value_and_grads(logp, old, ref, mask, adv, seq_index, seq_adv, w, None)
    split_a = _split_value_and_grads(*part_a, seq_adv, w, totals)
    split_b = _split_value_and_grads(*part_b, seq_adv, w, totals)
    alone_a = _split_value_and_grads(*part_a, seq_adv, w, None)
    alone_b = _split_value_and_grads(*part_b, seq_adv, w, None)
    for name in SPLIT_NAMES:
        if name == "gspo" and per_token:
            continue
        whole, g_whole = unsplit[name]
        (va, ga), (vb, gb) = split_a[name], split_b[name]
        assert float(va) + float(vb) == pytest.approx(float(whole), rel=1e-5, abs=1e-7), name
        ga, gb = np.asarray(ga), np.asarray(gb)
        glued = np.stack([np.concatenate([ga[0, :cut], gb[0, : t - cut]]), gb[1]])
        np.testing.assert_allclose(glued, np.asarray(g_whole), rtol=1e-4, atol=1e-7, err_msg=name)
        assert np.all(ga[1] == 0.0)
        if name in ("gspo", "gspo_token"):  # without the statistics each part has its own ratio: no longer exact
            na, nb = alone_a[name][0], alone_b[name][0]
            assert abs(float(na) + float(nb) - float(whole)) > 1e-7 or abs(float(whole)) < 1e-6, name
    # The whole-sequence log-ratio and count travel together (they were two keywords, checked "both or neither").
    with pytest.raises(TypeError):
        SequenceTotals(totals.log_ratio_sum)
