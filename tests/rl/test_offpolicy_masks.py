"""Tests for the train/serve mismatch masks of gyre_jax/rl/losses.py (``is_token_mask``: IcePop,
``is_sequence_mask``: MIS) against a float64 NumPy reference of the masks and of every loss."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from gyre_jax.rl.losses import LOSS_PARAMS, LossConfig, LossInputs, rl_objective, sequence_totals

B, T, S = 2, 12, 5
TOKEN_CAP, SEQ_CAP, IS_CAP = 1.25, 1.1, 1.04


def clip(name):
    """Loss ``name``'s hyperparameters with the clip range these tests use, [0.8, 1.28]."""
    return LOSS_PARAMS[name](clip_low=0.2, clip_high=0.28)


def _layout():
    """[B, T] seq_index (5 sequences: row 0 = 0..2, row 1 = 3, 4; last slot padding) and loss mask."""
    seq_index = np.array([[0] * 4 + [1] * 4 + [2] * 4, [3] * 6 + [4] * 5 + [4]], np.int32)
    mask = np.ones((B, T), np.float32)
    mask[0, 0] = mask[0, 4] = mask[1, 0] = mask[1, 6] = mask[1, 11] = 0.0  # prompts / padding
    return seq_index, mask


def _case(seed):
    """Per-sequence shifts put sequences 1 and 3 outside SEQ_CAP; per-token noise puts some tokens outside
    TOKEN_CAP (and garbage at non-trainable positions)."""
    seq_index, mask = _layout()
    rng = np.random.default_rng(seed)
    logp = rng.uniform(-4.0, -0.1, (B, T)).astype(np.float32)
    shift = np.array([0.02, 0.3, -0.03, -0.25, 0.01])[seq_index] + rng.normal(0.0, 0.12, (B, T))
    mu = (logp - shift).astype(np.float32)
    mu[mask == 0] = np.nan
    adv = rng.normal(0.0, 1.0, S).astype(np.float32)
    w = rng.uniform(0.1, 1.0, S).astype(np.float32)
    ref = (logp + rng.normal(0.0, 0.3, (B, T))).astype(np.float32)
    return logp, mu, mask, seq_index, adv, w, ref


def reference(logp, mu, mask, seq_index, adv, w, cfg, ref=None):
    """float64 objective with the masks -> (loss, dloss/dlogp [B, T], metrics)."""
    logp, mu, ref = (np.asarray(x, np.float64) for x in (logp, mu, ref if ref is not None else logp))
    w = np.asarray(w, np.float64)
    trainable = mask > 0
    with np.errstate(invalid="ignore"):
        log_r = np.where(trainable, logp - mu, 0.0)

        def in_band(x, c):
            return (x >= -math.log(c)) & (x <= math.log(c))

        keep_tok = trainable & (in_band(log_r, cfg.is_token_mask) if cfg.is_token_mask else True)
        n_all = np.bincount(seq_index[trainable], minlength=S).astype(np.float64)
        sum_all = np.bincount(seq_index[trainable], weights=log_r[trainable], minlength=S)
        mean_all = np.where(n_all > 0, sum_all / np.maximum(n_all, 1), 0.0)
        keep_seq = in_band(mean_all, cfg.is_sequence_mask) if cfg.is_sequence_mask else np.ones(S, bool)
    pmask = keep_tok & keep_seq[seq_index]
    n = np.bincount(seq_index[pmask], minlength=S).astype(np.float64)
    seq_lr = np.bincount(seq_index[pmask], weights=log_r[pmask], minlength=S) / np.maximum(n, 1)
    w = np.where(keep_seq, w, 0.0)
    if cfg.behaviour_is_cap:
        w = w * np.minimum(np.exp(np.where(n > 0, seq_lr, 0.0)), cfg.behaviour_is_cap)
    old_seq_lr = np.zeros(S) if cfg.recompute_behaviour else seq_lr
    loss, grad, clip_sum = 0.0, np.zeros((B, T)), 0.0
    for b, t in zip(*np.nonzero(pmask)):
        s = seq_index[b, t]
        tw, a = w[s] / n[s], adv[s]
        if cfg.loss == "grpo":
            ratio = 1.0 if cfg.recompute_behaviour else np.exp(log_r[b, t])
        else:
            ratio = np.exp(old_seq_lr[s])
        clipped = np.clip(ratio, 1 - cfg.params.clip_low, 1 + cfg.params.clip_high)
        loss += tw * -min(ratio * a, clipped * a)
        was_clipped = ratio * a > clipped * a
        clip_sum += tw * was_clipped
        grad[b, t] = 0.0 if was_clipped else tw * -a * ratio
        if cfg.kl_coef:
            d = ref[b, t] - logp[b, t]
            loss += cfg.kl_coef * tw * (np.exp(d) - d - 1)
            grad[b, t] += cfg.kl_coef * tw * (1 - np.exp(d))
    metrics = {
        "masked_tokens": float(np.sum(trainable & ~keep_tok)),
        "masked_sequences": float(np.sum(~keep_seq & (n_all > 0))),
        "weight_sum": float(np.sum(np.where(n > 0, w, 0.0))),
        "clip_fraction": clip_sum,
    }
    return loss, grad, metrics


MODES = {
    "token": dict(is_token_mask=TOKEN_CAP),
    "sequence": dict(is_sequence_mask=SEQ_CAP),
    "both": dict(is_token_mask=TOKEN_CAP, is_sequence_mask=SEQ_CAP),
    "both+is_cap": dict(
        is_token_mask=TOKEN_CAP, is_sequence_mask=SEQ_CAP, recompute_behaviour=True, behaviour_is_cap=IS_CAP
    ),
    "token+kl": dict(is_token_mask=TOKEN_CAP, kl_coef=0.1),
}
LOSS_NAMES = ("gspo", "gspo_token", "grpo")
_JITS: dict = {}


def _objective(cfg: LossConfig):
    """Jitted value_and_grad of ``rl_objective`` under ``cfg`` (compiled once per config)."""
    if cfg not in _JITS:

        def f(lp, mu, mask, si, adv, w, ref, whole=None):
            return rl_objective(LossInputs(lp, mu, mask, si, adv, w, ref if cfg.kl_coef else None, whole), cfg)

        _JITS[cfg] = jax.jit(jax.value_and_grad(f, has_aux=True))
    return _JITS[cfg]


def _run(cfg, logp, mu, mask, seq_index, adv, w, ref, whole=None):
    (loss, metrics), grad = _objective(cfg)(logp, mu, mask, seq_index, adv, w, ref, whole)
    return float(loss), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_value_gradient_and_counts_match_reference(name, mode):
    cfg = LossConfig(name, clip(name), **MODES[mode])
    for seed in (0, 1, 2):
        logp, mu, mask, seq_index, adv, w, ref = _case(seed)
        want, want_grad, want_m = reference(logp, mu, mask, seq_index, adv, w, cfg, ref)
        loss, grad, m = _run(cfg, logp, mu, mask, seq_index, adv, w, ref)
        assert np.isfinite(loss)
        np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
        for k, v in want_m.items():
            np.testing.assert_allclose(m[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
        # The case really exercises the masks: some tokens / sequences dropped, some kept.
        if cfg.is_token_mask:
            assert 0 < m["masked_tokens"] < float(mask.sum()) - 4
        if cfg.is_sequence_mask:
            assert m["masked_sequences"] == 2.0  # sequences 1 and 3 (shift 0.3 and -0.25 > log 1.1)


def test_ratios_exactly_at_the_bounds_are_kept():
    """log r = +-0.5 exactly with cap e^0.5: kept by both masks; one step further out is dropped."""
    cap = math.exp(0.5)
    logp = np.full((1, 6), -1.0, np.float32)
    mu = np.array([[-1.5, -0.5, -1.5, -0.5, -1.5, -1.5]], np.float32)  # log r = +0.5, -0.5, ...
    mask = np.ones((1, 6), np.float32)
    seq_index = np.array([[0, 0, 1, 1, 2, 2]], np.int32)  # sequence 2: mean log r = +0.5 exactly
    adv, w = np.ones(3, np.float32), np.full(3, 1 / 3, np.float32)
    cfg = LossConfig("grpo", is_token_mask=cap, is_sequence_mask=cap)
    _, _, m = _run(cfg, logp, mu, mask, seq_index, adv, w, logp)
    assert m["masked_tokens"] == 0.0 and m["masked_sequences"] == 0.0
    out = mu.copy()
    out[0, 4] = np.nextafter(np.float32(-1.5), np.float32(-2.0))  # log r just above 0.5
    _, grad, m = _run(cfg, logp, out, mask, seq_index, adv, w, logp)
    assert m["masked_tokens"] == 1.0 and grad[0, 4] == 0.0
    # The sequence mask on its own: sequence 2's mean is now just above 0.5 as well.
    _, _, m = _run(LossConfig("grpo", is_sequence_mask=cap), logp, out, mask, seq_index, adv, w, logp)
    assert m["masked_sequences"] == 1.0 and "masked_tokens" in m and m["masked_tokens"] == 0.0


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("bad", [np.nan, -np.inf, np.inf])
def test_non_finite_behaviour_on_a_masked_token_does_not_poison_the_loss(name, bad):
    logp, mu, mask, seq_index, adv, w, ref = _case(0)
    dirty = mu.copy()
    dirty[0, 1] = bad  # a trainable token of sequence 0
    for mode in ("token", "both", "both+is_cap", "token+kl"):
        cfg = LossConfig(name, clip(name), **MODES[mode])
        loss, grad, m = _run(cfg, logp, dirty, mask, seq_index, adv, w, ref)
        assert np.isfinite(loss) and np.all(np.isfinite(grad)) and grad[0, 1] == 0.0, mode
        assert all(np.isfinite(v) for v in m.values()), (mode, m)
        want, want_grad, _ = reference(logp, dirty, mask, seq_index, adv, w, cfg, ref)
        np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    # The sequence mask alone drops the whole sequence (its mean is not finite); the loss stays finite.
    cfg = LossConfig(name, clip(name), is_sequence_mask=SEQ_CAP)
    loss, grad, m = _run(cfg, logp, dirty, mask, seq_index, adv, w, ref)
    assert np.isfinite(loss) and np.all(grad[seq_index == 0] == 0.0) and m["masked_sequences"] == 3.0
    # Without any mask a NaN behaviour log-prob on a trained token still poisons the step.
    if np.isnan(bad):
        loss, _, _ = _run(LossConfig(name, clip(name)), logp, dirty, mask, seq_index, adv, w, ref)
        assert not np.isfinite(loss)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_masked_gradients_are_zero_and_other_sequences_unchanged(name):
    logp, mu, mask, seq_index, adv, w, ref = _case(1)
    for mode, off_kw in (("token+kl", dict(kl_coef=0.1)), ("both", {})):
        cfg = LossConfig(name, clip(name), **MODES[mode])
        off = LossConfig(name, clip(name), **off_kw)
        _, grad, _ = _run(cfg, logp, mu, mask, seq_index, adv, w, ref)
        _, grad_off, _ = _run(off, logp, mu, mask, seq_index, adv, w, ref)
        log_r = np.where(mask > 0, logp.astype(np.float64) - mu, 0.0)
        masked = (mask > 0) & (np.abs(log_r) > math.log(TOKEN_CAP))
        assert masked.any() and np.all(grad[masked] == 0.0)
        touched = set(seq_index[masked].tolist())
        if cfg.is_sequence_mask:
            touched |= {1, 3}
            assert np.all(grad[np.isin(seq_index, [1, 3])] == 0.0)
        clean = ~np.isin(seq_index, sorted(touched)) & (mask > 0)
        assert clean.any(), mode
        np.testing.assert_array_equal(grad[clean], grad_off[clean])


def _split(x, cut):
    """[1, T] -> two parts [1, cut], [1, T - cut] (token arrays)."""
    return x[:, :cut], x[:, cut:]


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_split_sequence_is_masked_and_weighted_as_a_whole(name):
    """One row, sequences 0 (tokens 0..7) and 1 (8..11), cut at token 4 inside sequence 0: its first half
    alone is outside the sequence cap (mean log r 0.1125), the whole is inside (0.06875). With the summed
    ``sequence_totals`` the two parts add up to the whole; deciding per part differs."""
    seq_index = np.array([[0] * 8 + [1] * 4], np.int32)
    mask = np.ones((1, 12), np.float32)
    rng = np.random.default_rng(3)
    logp = rng.uniform(-3.0, -0.2, (1, 12)).astype(np.float32)
    shift = np.array([0.12, 0.11, 0.12, 0.10, -0.05, -0.06, -0.04, 0.25, 0.01, -0.02, 0.02, 0.0])
    mu = (logp - shift[None]).astype(np.float32)  # token 7 (log r 0.3) is outside the token cap
    adv, w = np.array([0.8, -0.6], np.float32), np.array([0.5, 0.5], np.float32)
    ref = (logp + 0.2).astype(np.float32)
    for mode in ("both", "both+is_cap", "token+kl"):
        cfg = LossConfig(name, clip(name), **dict(MODES[mode], is_sequence_mask=SEQ_CAP))
        whole_loss, whole_grad, whole_m = _run(cfg, logp, mu, mask, seq_index, adv, w, ref)
        assert whole_m["masked_sequences"] == 0.0 and whole_m["masked_tokens"] == 1.0
        parts = list(zip(*(_split(x, 4) for x in (logp, mu, mask, seq_index, ref))))
        sums = [sequence_totals(LossInputs(lp, m_, mk, si, adv, w), cfg) for lp, m_, mk, si, _ in parts]
        total = sums[0] + sums[1]
        losses, grads, counts = [], [], {"masked_tokens": 0.0, "masked_sequences": 0.0}
        for lp, m_, mk, si, r in parts:
            loss, grad, m = _run(cfg, lp, m_, mk, si, adv, w, r, whole=total)
            losses.append(loss)
            grads.append(grad)
            counts = {k: counts[k] + m[k] for k in counts}
        np.testing.assert_allclose(sum(losses), whole_loss, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.concatenate(grads, axis=1), whole_grad, rtol=1e-4, atol=1e-7)
        assert counts == {k: whole_m[k] for k in counts}
        # Deciding on each part's own statistics would drop the first half (mean log r 0.1125 > log 1.1).
        _, grad0, m0 = _run(cfg, *(p for p in parts[0][:4]), adv, w, parts[0][4])
        assert m0["masked_sequences"] == 1.0 and np.all(grad0 == 0.0)


def test_loss_config_validates_the_masks():
    assert LossConfig(is_token_mask=2.0, is_sequence_mask=1.001).is_token_mask == 2.0
    for key in ("is_token_mask", "is_sequence_mask"):
        for bad in (1.0, 0.5, -2.0, float("nan")):
            with pytest.raises(ValueError, match=f"{key}=.* must be 0 \\(off\\) or a cap > 1"):
                LossConfig(**{key: bad})


def test_metrics_without_corrections_have_no_mask_counts():
    logp, mu, mask, seq_index, adv, w, ref = _case(0)
    mu = np.where(mask > 0, mu, 0.0).astype(np.float32)
    _, _, m = _run(LossConfig("grpo"), logp, mu, mask, seq_index, adv, w, ref)
    assert "masked_tokens" not in m and "masked_sequences" not in m
    _, _, m = _run(LossConfig("grpo", is_token_mask=1e6), logp, mu, mask, seq_index, adv, w, ref)
    assert m["masked_tokens"] == 0.0 and m["masked_sequences"] == 0.0
