"""Policy-gradient objectives as pure functions of per-token log-probs: GSPO, GSPO-token, GRPO, k3 KL.

Layout (a packed micro-batch, see ``gyre_jax.trajectory.batch.MicroBatch``): token arrays are
``[B, T]``; every token belongs to one sequence ``seq_index[b, t]`` in ``[0, S)``; per-sequence arrays
(``advantages``, ``seq_weights``) are ``[S]``. ``loss_mask`` is 1 on trainable (policy-generated)
target tokens. ``seq_weights`` already carry the global normalization (each execution counts once in
the step), so summing micro-batch losses gives the step's loss exactly.

Every objective aggregates the same way: a per-sequence value (GSPO) or the mean of per-token values
over the sequence's trainable tokens (GSPO-token, GRPO, KL: "seq-mean-token-mean"), then the
``seq_weights``-weighted sum over sequences. A sequence with no trainable token drops out. Values at
non-trainable positions never reach the loss or its gradient (they are selected away, not multiplied
by zero, so a NaN in padding is harmless while a NaN on a trained token poisons the step, as it should).

Each loss returns ``(loss, metrics)`` with the same metric keys, all weighted sums (divide by
``weight_sum`` for means; they add across micro-batches):
``clip_fraction`` (weight of sequences / tokens whose clipped term was the active one),
``ratio_mean`` (importance ratio), ``weight_sum``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

# Default clip ranges: GSPO paper (v2, section 5.1) for the sequence-level ratio; DAPO clip-higher for GRPO.
DEFAULT_CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.28)}
LOSSES = tuple(DEFAULT_CLIP)


def _sequence_sums(
    values: jax.Array, mask: jax.Array, seq_index: jax.Array, num_seqs: int
) -> tuple[jax.Array, jax.Array]:
    """([S] masked sums of ``values`` [B, T] per sequence, [S] mask sums)."""
    flat_idx = seq_index.reshape(-1)
    selected = jnp.where(mask > 0, values * mask, 0.0)
    total = jax.ops.segment_sum(selected.reshape(-1), flat_idx, num_segments=num_seqs)
    count = jax.ops.segment_sum(mask.reshape(-1), flat_idx, num_segments=num_seqs)
    return total, count


def sequence_mean(
    values: jax.Array, mask: jax.Array, seq_index: jax.Array, num_seqs: int
) -> tuple[jax.Array, jax.Array]:
    """Masked mean of ``values`` [B, T] per sequence -> ([S] means, [S] token counts)."""
    total, count = _sequence_sums(values, mask, seq_index, num_seqs)
    return total / jnp.maximum(count, 1.0), count


def sequence_log_ratio_sums(
    logprobs: jax.Array, old_logprobs: jax.Array, loss_mask: jax.Array, seq_index: jax.Array, num_seqs: int
) -> tuple[jax.Array, jax.Array]:
    """Per sequence: (sum of log pi - log pi_old over its trainable tokens [S], their count [S]).

    When a sequence is split over several micro-batches (a trajectory longer than a row), add these over
    its parts (a forward-only pre-pass under the step's fixed weights) and pass the totals to ``gspo_loss``
    / ``gspo_token_loss`` as ``seq_log_ratio`` (= sum / count) and ``seq_count``: the parts then add up
    exactly to the loss and gradient of the whole sequence.
    """
    return _sequence_sums(logprobs - old_logprobs, loss_mask, seq_index, num_seqs)


def token_weights(
    loss_mask: jax.Array, seq_index: jax.Array, seq_weights: jax.Array, seq_count: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The seq-mean-token-mean weights: token (b, t) of sequence i gets ``w_i / n_i`` (0 off the mask).

    ``n_i`` is the sequence's trainable-token count here, or ``seq_count`` [S] (its count over all the
    micro-batches it spans). -> (token weights [B, T], effective sequence weights [S]: ``w_i`` times the
    share of the sequence's tokens that are here (0 without trainable tokens), local counts [S]).
    """
    count = jax.ops.segment_sum(loss_mask.reshape(-1), seq_index.reshape(-1), num_segments=seq_weights.shape[0])
    if seq_count is None:
        total, weights = count, jnp.where(count > 0, seq_weights, 0.0)
    else:
        total = jnp.maximum(seq_count, count)
        weights = jnp.where(count > 0, seq_weights * count / jnp.maximum(total, 1.0), 0.0)
    per_token = jnp.where(count > 0, seq_weights / jnp.maximum(total, 1.0), 0.0)[seq_index]
    return jnp.where(loss_mask > 0, per_token * loss_mask, 0.0), weights, count


def _token_advantages(advantages: jax.Array, seq_index: jax.Array) -> jax.Array:
    """Advantages per token [B, T] from per-sequence [S] (broadcast by ``seq_index``) or per-token [B, T]."""
    if advantages.ndim == 1:
        return advantages[seq_index]
    if advantages.shape != seq_index.shape:
        raise ValueError(
            f"advantages must be [S] per sequence or [B, T]={seq_index.shape} per token, got {advantages.shape}"
        )
    return advantages


def _masked(values: jax.Array, loss_mask: jax.Array) -> jax.Array:
    return jnp.where(loss_mask > 0, values, 0.0)


def gspo_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    loss_mask: jax.Array,
    seq_index: jax.Array,
    advantages: jax.Array,
    seq_weights: jax.Array,
    clip_low: float,
    clip_high: float,
    *,
    seq_log_ratio: jax.Array | None = None,
    seq_count: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO (Zheng et al. 2025): sequence-level ratio s_i = exp(mean_t(log pi - log pi_old)) over the
    sequence's trainable tokens, clipped to [1 - clip_low, 1 + clip_high]:

        loss = sum_i w_i * -min(s_i * A_i, clip(s_i) * A_i)

    logprobs, old_logprobs, loss_mask: [B, T]; seq_index: [B, T] int32; advantages, seq_weights: [S].
    seq_log_ratio, seq_count: [S] whole-sequence statistics for sequences split over micro-batches (see
    ``sequence_log_ratio_sums``); each part then carries its share, and the parts add up to the above.
    """
    if seq_log_ratio is not None or seq_count is not None:
        # The same objective written token by token (GSPO-token with A_i,t = A_i), which splits exactly.
        return gspo_token_loss(
            logprobs,
            old_logprobs,
            loss_mask,
            seq_index,
            advantages,
            seq_weights,
            clip_low,
            clip_high,
            seq_log_ratio=seq_log_ratio,
            seq_count=seq_count,
        )
    num_seqs = advantages.shape[0]
    log_ratio, count = sequence_mean(logprobs - old_logprobs, loss_mask, seq_index, num_seqs)
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_seq = -jnp.minimum(ratio * advantages, clipped_ratio * advantages)
    weights = jnp.where(count > 0, seq_weights, 0.0)
    loss = jnp.sum(jnp.where(count > 0, weights * per_seq, 0.0))
    was_clipped = (ratio * advantages > clipped_ratio * advantages).astype(jnp.float32)
    metrics = {
        "clip_fraction": jnp.sum(weights * was_clipped),
        "ratio_mean": jnp.sum(weights * ratio),
        "weight_sum": jnp.sum(weights),
    }
    return loss, metrics


def gspo_token_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    loss_mask: jax.Array,
    seq_index: jax.Array,
    advantages: jax.Array,
    seq_weights: jax.Array,
    clip_low: float,
    clip_high: float,
    *,
    seq_log_ratio: jax.Array | None = None,
    seq_count: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO-token (GSPO paper, section 4.3): per-token advantages with the sequence-level ratio,

        s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]      (numerically s_i; its gradient flows through token t only)
        loss  = sum_i w_i * mean_t -min(s_i,t * A_i,t, clip(s_i,t) * A_i,t)

    With A_i,t = A_i for every t, value and gradient equal ``gspo_loss``.
    logprobs, old_logprobs, loss_mask: [B, T]; seq_index: [B, T] int32; advantages: [S] or [B, T];
    seq_weights: [S]. seq_log_ratio, seq_count: [S] whole-sequence statistics (``sequence_log_ratio_sums``)
    for a sequence split over micro-batches; log s_i and the 1 / n_i of the mean then come from them.
    """
    num_seqs = seq_weights.shape[0]
    if (seq_log_ratio is None) != (seq_count is None):
        raise ValueError("seq_log_ratio and seq_count go together (whole-sequence statistics); pass both or neither")
    if seq_log_ratio is None:
        log_seq_ratio, _ = sequence_mean(logprobs - old_logprobs, loss_mask, seq_index, num_seqs)
    else:
        log_seq_ratio = seq_log_ratio
    log_ratio = jax.lax.stop_gradient(log_seq_ratio)[seq_index] + logprobs - jax.lax.stop_gradient(logprobs)
    ratio = jnp.exp(_masked(log_ratio, loss_mask))  # [B, T]
    adv = _token_advantages(advantages, seq_index)
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -jnp.minimum(ratio * adv, clipped_ratio * adv)
    tw, weights, _ = token_weights(loss_mask, seq_index, seq_weights, seq_count)
    loss = jnp.sum(_masked(tw * per_token, loss_mask))
    was_clipped = (ratio * adv > clipped_ratio * adv).astype(jnp.float32)
    metrics = {
        "clip_fraction": jnp.sum(_masked(tw * was_clipped, loss_mask)),
        "ratio_mean": jnp.sum(weights * jnp.exp(log_seq_ratio)),
        "weight_sum": jnp.sum(weights),
    }
    return loss, metrics


def grpo_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    loss_mask: jax.Array,
    seq_index: jax.Array,
    advantages: jax.Array,
    seq_weights: jax.Array,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    *,
    seq_count: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO (Shao et al. 2024) with clip-higher (DAPO): token-level ratio r_t = pi(y_t) / pi_old(y_t),

        loss = sum_i w_i * mean_t -min(r_t * A_i,t, clip(r_t, 1 - clip_low, 1 + clip_high) * A_i,t)

    logprobs, old_logprobs, loss_mask: [B, T]; seq_index: [B, T] int32; advantages: [S] or [B, T];
    seq_weights: [S]; seq_count: [S] trainable tokens of each whole sequence when it is split over
    micro-batches (the n_i of the mean; default: counted here).
    """
    ratio = jnp.exp(_masked(logprobs - old_logprobs, loss_mask))  # [B, T]
    adv = _token_advantages(advantages, seq_index)
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -jnp.minimum(ratio * adv, clipped_ratio * adv)
    tw, weights, _ = token_weights(loss_mask, seq_index, seq_weights, seq_count)
    loss = jnp.sum(_masked(tw * per_token, loss_mask))
    was_clipped = (ratio * adv > clipped_ratio * adv).astype(jnp.float32)
    metrics = {
        "clip_fraction": jnp.sum(_masked(tw * was_clipped, loss_mask)),
        "ratio_mean": jnp.sum(_masked(tw * ratio, loss_mask)),
        "weight_sum": jnp.sum(weights),
    }
    return loss, metrics


def kl_k3(
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    loss_mask: jax.Array,
    seq_index: jax.Array,
    seq_weights: jax.Array,
    *,
    seq_count: jax.Array | None = None,
) -> jax.Array:
    """KL(pi || pi_ref) by Schulman's k3 estimator per sampled token, aggregated like the policy losses:

        k3_t = exp(d_t) - d_t - 1,  d_t = log pi_ref(y_t) - log pi(y_t)      (>= 0, unbiased for y_t ~ pi)
        kl   = sum_i w_i * mean_t k3_t

    The choice (k3 as a loss term, as in GRPO/DeepSeekMath) gives a non-negative, low-variance value; its
    gradient is that of the reverse KL only approximately, which is the standard trade-off. [B, T] inputs,
    seq_weights [S], seq_count [S] as in ``grpo_loss``; returns a scalar.
    """
    d = _masked(ref_logprobs - logprobs, loss_mask)
    k3 = jnp.exp(d) - d - 1.0
    tw, _, _ = token_weights(loss_mask, seq_index, seq_weights, seq_count)
    return jnp.sum(_masked(tw * k3, loss_mask))


POLICY_LOSSES = {"gspo": gspo_loss, "gspo_token": gspo_token_loss, "grpo": grpo_loss}


@dataclass(frozen=True)
class LossConfig:
    """What one RL micro-step optimizes (a static, hashable part of the jitted micro-step).

    name: ``gspo`` | ``gspo_token`` | ``grpo``; clip_low / clip_high: None = the loss's default
    (``DEFAULT_CLIP``); kl_coef: weight of ``kl_k3`` to a reference policy (0 = off, no reference
    forward pass); recompute_behaviour: pi_old is the trainer's own policy at step start (weights are
    fixed during a step, so that is ``stop_gradient`` of the micro-step's log-probs: no extra pass)
    instead of the behaviour log-probs recorded by the proxy; behaviour_is_cap: with
    recompute_behaviour, weight each sequence by the truncated importance ratio
    min(exp(mean_t(log pi_old - log mu)), cap) between the recomputed pi_old and the behaviour policy mu
    (0 = off; the decoupled-PPO correction for stale data).

    Train/serve mismatch masks, on r_t = pi_train(t) / mu(t) with pi_train = ``stop_gradient`` of the
    micro-step's log-probs (the trainer's policy at step start, in both recompute_behaviour modes) and mu
    the behaviour log-probs (0 = off, else a cap c > 1; a ratio exactly at 1/c or c is kept, NaN is out):
    is_token_mask (IcePop): a trainable token with r_t outside [1/c, c] leaves the whole objective (policy
    loss and KL: as if its loss_mask were 0); is_sequence_mask (MIS): a sequence whose geometric-mean ratio
    exp(mean_t log r_t over all its trainable tokens) lies outside [1/c, c] leaves it. Order: token mask,
    sequence mask (decided on all trainable tokens, token-masked ones included), then behaviour_is_cap
    over the tokens the token mask keeps, on the sequences that stay.
    """

    name: str = "gspo"
    clip_low: float | None = None
    clip_high: float | None = None
    kl_coef: float = 0.0
    recompute_behaviour: bool = False
    behaviour_is_cap: float = 0.0
    is_token_mask: float = 0.0
    is_sequence_mask: float = 0.0

    def __post_init__(self):
        if self.name not in POLICY_LOSSES:
            raise ValueError(f"loss {self.name!r} is not one of {LOSSES}")
        low, high = DEFAULT_CLIP[self.name]
        object.__setattr__(self, "clip_low", float(low if self.clip_low is None else self.clip_low))
        object.__setattr__(self, "clip_high", float(high if self.clip_high is None else self.clip_high))
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0.0:
            raise ValueError(
                f"clip range [1 - {self.clip_low}, 1 + {self.clip_high}] must have 0 <= clip_low < 1 and clip_high >= 0"
            )
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef={self.kl_coef} must be >= 0 (0 turns the KL term off)")
        if self.behaviour_is_cap < 0.0:
            raise ValueError(f"behaviour_is_cap={self.behaviour_is_cap} must be >= 0 (0 = off)")
        if self.behaviour_is_cap > 0.0 and not self.recompute_behaviour:
            raise ValueError(
                "behaviour_is_cap needs recompute_behaviour=True (with recorded pi_old the ratio already "
                "corrects for the behaviour policy)"
            )
        for key in ("is_token_mask", "is_sequence_mask"):
            cap = getattr(self, key)
            if not (cap == 0.0 or cap > 1.0):  # NaN fails both
                raise ValueError(
                    f"{key}={cap} must be 0 (off) or a cap > 1 (ratios outside [1/cap, cap] are masked); "
                    "e.g. 2.0 keeps tokens whose train/behaviour probability ratio is within a factor of 2"
                )


def _in_band(log_ratio: jax.Array, cap: float) -> jax.Array:
    """Elementwise: exp(log_ratio) in [1/cap, cap] (bool, same shape); NaN is out. The bound is compared in
    log space, so a ratio exactly at 1/cap or cap is kept."""
    bound = math.log(cap)
    return (log_ratio >= -bound) & (log_ratio <= bound)


def token_keep_mask(
    logprobs: jax.Array, behaviour_logprobs: jax.Array, loss_mask: jax.Array, cfg: LossConfig
) -> jax.Array:
    """[B, T] bool: the trainable tokens the token mask (``cfg.is_token_mask``) keeps (all of them when off)."""
    trainable = loss_mask > 0
    if cfg.is_token_mask == 0.0:
        return trainable
    log_r = jax.lax.stop_gradient(logprobs) - behaviour_logprobs
    return trainable & _in_band(jnp.where(trainable, log_r, 0.0), cfg.is_token_mask)


def offpolicy_sequence_sums(
    logprobs: jax.Array,
    behaviour_logprobs: jax.Array,
    loss_mask: jax.Array,
    seq_index: jax.Array,
    num_seqs: int,
    cfg: LossConfig,
) -> dict[str, jax.Array]:
    """Per-sequence sums of log r_t = log pi_train - log mu that the off-policy corrections decide on.

    [B, T] inputs -> dict of [S]: ``log_ratio_sum`` / ``count`` over the trainable tokens (the sequence
    mask's geometric mean), ``kept_log_ratio_sum`` / ``kept_count`` over the tokens the token mask keeps
    (GSPO's sequence ratio with recorded pi_old, behaviour_is_cap's weight, the n_i of every mean). They
    add over parts: for a sequence split over micro-batches sum them over its parts (a forward-only pass
    under the step's fixed weights) and pass the totals to ``rl_objective`` as ``seq_sums``.
    """
    log_r = jax.lax.stop_gradient(logprobs) - behaviour_logprobs
    kept = token_keep_mask(logprobs, behaviour_logprobs, loss_mask, cfg).astype(jnp.float32)
    total, count = _sequence_sums(log_r, loss_mask, seq_index, num_seqs)
    kept_total, kept_count = _sequence_sums(log_r, kept, seq_index, num_seqs)
    return {"log_ratio_sum": total, "count": count, "kept_log_ratio_sum": kept_total, "kept_count": kept_count}


def _offpolicy_corrections(logprobs, behaviour_logprobs, loss_mask, seq_index, seq_weights, cfg, seq_sums):
    """Token mask, sequence mask, behaviour_is_cap (in that order) -> (policy mask [B, T], seq weights [S],
    whole-sequence keywords for the losses, metrics)."""
    num_seqs = seq_weights.shape[0]
    local = offpolicy_sequence_sums(logprobs, behaviour_logprobs, loss_mask, seq_index, num_seqs, cfg)
    whole = local if seq_sums is None else seq_sums
    keep_token = token_keep_mask(logprobs, behaviour_logprobs, loss_mask, cfg)
    keep_seq = jnp.ones((num_seqs,), bool)
    if cfg.is_sequence_mask > 0.0:
        mean_log_r = jnp.where(whole["count"] > 0, whole["log_ratio_sum"] / jnp.maximum(whole["count"], 1.0), 0.0)
        keep_seq = _in_band(mean_log_r, cfg.is_sequence_mask)
    dropped = (~keep_seq) & (local["count"] > 0)
    metrics = {
        "masked_tokens": jnp.sum(jnp.where(keep_token, 0.0, loss_mask)),
        "masked_sequences": jnp.sum(jnp.where(dropped, local["count"] / jnp.maximum(whole["count"], 1.0), 0.0)),
    }
    policy_mask = jnp.where(keep_token & keep_seq[seq_index], loss_mask, 0.0)
    live = keep_seq & (whole["kept_count"] > 0)
    kept_log_r = jnp.where(live, whole["kept_log_ratio_sum"] / jnp.maximum(whole["kept_count"], 1.0), 0.0)
    seq_weights = jnp.where(keep_seq, seq_weights, 0.0)
    if cfg.behaviour_is_cap > 0.0:
        seq_weights = seq_weights * jnp.minimum(jnp.exp(kept_log_r), cfg.behaviour_is_cap)
    whole_kw = {}
    if seq_sums is not None:
        ratio = jnp.zeros_like(kept_log_r) if cfg.recompute_behaviour else kept_log_r
        whole_kw = {"seq_log_ratio": ratio, "seq_count": jnp.where(keep_seq, whole["kept_count"], 0.0)}
    return policy_mask, seq_weights, whole_kw, metrics


def rl_objective(
    logprobs: jax.Array,
    behaviour_logprobs: jax.Array,
    loss_mask: jax.Array,
    seq_index: jax.Array,
    advantages: jax.Array,
    seq_weights: jax.Array,
    cfg: LossConfig,
    ref_logprobs: jax.Array | None = None,
    *,
    seq_sums: dict[str, jax.Array] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The whole RL micro-step objective: policy loss (+ kl_coef * KL) with pi_old chosen by ``cfg``.

    logprobs: [B, T] under the current params (differentiated); behaviour_logprobs: [B, T] recorded by the
    proxy; ref_logprobs: [B, T] under the reference params (needed iff cfg.kl_coef > 0); seq_sums: the
    whole-sequence ``offpolicy_sequence_sums`` ([S] each) when sequences are split over micro-batches, so
    every mask and weight is decided on the whole sequence and the parts add up to it. Metrics (weighted
    sums that add across micro-batches): the policy loss's, plus ``loss``, ``policy_loss``, ``kl`` (when
    on), ``logprob_gap_sum`` (sum |log pi - log mu| over the trainable tokens the token mask keeps),
    ``target_tokens`` (trainable tokens), and with the off-policy corrections on (``cfg.is_token_mask``,
    ``cfg.is_sequence_mask``, ``cfg.behaviour_is_cap`` or seq_sums given) ``masked_tokens`` (trainable
    tokens the token mask drops) and ``masked_sequences`` (sequences the sequence mask drops; a split
    sequence's parts carry their token shares, which add to 1).
    """
    current = jax.lax.stop_gradient(logprobs)
    old = current if cfg.recompute_behaviour else behaviour_logprobs
    corrections = cfg.is_token_mask > 0.0 or cfg.is_sequence_mask > 0.0 or cfg.behaviour_is_cap > 0.0
    policy_mask, whole_kw, metrics = loss_mask, {}, {}
    if corrections or seq_sums is not None:
        policy_mask, seq_weights, whole_kw, metrics = _offpolicy_corrections(
            current, behaviour_logprobs, loss_mask, seq_index, seq_weights, cfg, seq_sums
        )
    loss_kw = dict(whole_kw) if cfg.name != "grpo" else {k: v for k, v in whole_kw.items() if k == "seq_count"}
    policy_loss, policy_metrics = POLICY_LOSSES[cfg.name](
        logprobs, old, policy_mask, seq_index, advantages, seq_weights, cfg.clip_low, cfg.clip_high, **loss_kw
    )
    loss = policy_loss
    metrics = dict(policy_metrics, policy_loss=policy_loss, **metrics)
    if cfg.kl_coef > 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (log-probs under the reference policy)")
        count_kw = {k: v for k, v in whole_kw.items() if k == "seq_count"}
        kl = kl_k3(logprobs, ref_logprobs, policy_mask, seq_index, seq_weights, **count_kw)
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = jax.lax.stop_gradient(kl)
    gap_mask = token_keep_mask(current, behaviour_logprobs, loss_mask, cfg)
    metrics["logprob_gap_sum"] = jnp.sum(jnp.where(gap_mask, jnp.abs(current - behaviour_logprobs), 0.0))
    metrics["target_tokens"] = jnp.sum(loss_mask)
    metrics["loss"] = loss
    return loss, metrics


def token_nll_loss(logprobs: jax.Array, token_weights: jax.Array) -> jax.Array:
    """Supervised loss: -sum(weights * log p); ``token_weights`` [B, T] carry the normalization."""
    return -jnp.sum(token_weights * logprobs)
