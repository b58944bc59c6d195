"""Policy-gradient objectives as pure functions of one input, ``LossInputs``: GSPO, GSPO-token, GRPO (the
registered policy losses), the k3 KL term, the train/serve mismatch corrections, and ``rl_objective`` (all of
them as one micro-step's objective under a ``LossConfig``).

One signature, one registry: every policy loss is ``fn(x: LossInputs, p: <its hyperparameters>) -> (loss,
metrics)``, registered under its name with ``@policy_loss(name)`` in ``POLICY_LOSSES``; its hyperparameter
type, whose field defaults are its defaults, is ``loss_config.LOSS_PARAMS[name]`` (stated once, there).

Layout (a packed micro-batch, see ``gyre_jax.trajectory.batch.MicroBatch``): token arrays are ``[B, T]``;
every token belongs to one sequence ``seq_index[b, t]`` in ``[0, S)``; per-sequence arrays (``advantages``,
``seq_weights``) are ``[S]``. ``loss_mask`` is 1 on trainable (policy-generated) target tokens.
``seq_weights`` already carry the global normalization (each execution counts once in the step), so summing
micro-batch losses gives the step's loss exactly.

Every objective aggregates the same way: a per-sequence value (GSPO) or the mean of per-token values over the
sequence's trainable tokens (GSPO-token, GRPO, KL: "seq-mean-token-mean"), then the ``seq_weights``-weighted
sum over sequences. A sequence with no trainable token drops out. Values at non-trainable positions never reach
the loss or its gradient (they are selected away, not multiplied by zero, so a NaN in padding is harmless while
a NaN on a trained token poisons the step, as it should).

Each policy loss returns ``(loss, metrics)`` with the same metric keys, all weighted sums (divide by
``weight_sum`` for means; they add across micro-batches): ``clip_fraction`` (weight of sequences / tokens whose
clipped term was the active one), ``ratio_mean`` (importance ratio), ``weight_sum``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp

from gyre_jax.rl.loss_config import (
    LOSS_PARAMS,
    LOSSES,
    ClipRange,
    GRPOParams,
    GSPOParams,
    LossConfig,
    LossConfigError,
    hyperparameters,
)

__all__ = [
    "LOSSES",
    "LOSS_PARAMS",
    "POLICY_LOSSES",
    "GRPOParams",
    "GSPOParams",
    "LossConfig",
    "LossConfigError",
    "LossInputs",
    "PolicyLoss",
    "SequenceTotals",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "hyperparameters",
    "kl_k3",
    "policy_loss",
    "rl_objective",
    "sequence_mean",
    "sequence_totals",
    "token_keep_mask",
    "token_nll_loss",
    "token_weights",
]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SequenceTotals:
    """Per-sequence sums ``[S]`` over whole sequences, for sequences split over micro-batches.

    ``sequence_totals`` gives one part's; add the parts' (``a + b``: a forward-only pre-pass under the step's
    fixed weights) and give the sum as ``LossInputs.whole``: each part then carries its share and the parts add
    up exactly to the whole sequence's loss and gradient. The log-ratio is log pi - log pi_old (the micro-step's
    log-probs, no gradient, against ``old_logprobs``).
    """

    log_ratio_sum: jax.Array  # [S] over the tokens the loss trains on (the token mask's kept ones)
    count: jax.Array  # [S] how many: the n_i of every per-sequence mean
    all_log_ratio_sum: jax.Array  # [S] over every trainable token (the sequence mask decides on its mean)
    all_count: jax.Array  # [S]

    def __add__(self, other: SequenceTotals) -> SequenceTotals:
        return jax.tree.map(jnp.add, self, other)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LossInputs:
    """What every objective reads: a micro-batch's arrays and the log-probs of its forward pass.

    logprobs: [B, T] float32, log pi(target) under the params being differentiated;
    old_logprobs: [B, T] float32, log pi_old, the ratio's denominator: the behaviour log-probs mu the proxy
    recorded (``rl_objective`` uses the trainer's own under ``recompute_behaviour``);
    loss_mask: [B, T] float32, 1 on trainable targets; seq_index: [B, T] int32 in [0, S);
    advantages: [S] per sequence, or [B, T] per token (GSPO-token, GRPO); seq_weights: [S];
    ref_logprobs: [B, T] under the reference policy (the KL term only);
    whole: the whole sequences' ``SequenceTotals`` when sequences are split over micro-batches (None: every
    sequence is whole here).
    """

    logprobs: jax.Array
    old_logprobs: jax.Array
    loss_mask: jax.Array
    seq_index: jax.Array
    advantages: jax.Array
    seq_weights: jax.Array
    ref_logprobs: jax.Array | None = None
    whole: SequenceTotals | None = None

    @classmethod
    def of(
        cls, mb: Any, logprobs: jax.Array, ref_logprobs: jax.Array | None = None, whole: SequenceTotals | None = None
    ) -> LossInputs:
        """From a micro-batch (``MicroBatch``: its old_logprobs, loss_mask, seq_index, advantages, seq_weights)
        and the forward pass's log-probs."""
        return cls(
            logprobs, mb.old_logprobs, mb.loss_mask, mb.seq_index, mb.advantages, mb.seq_weights, ref_logprobs, whole
        )

    @property
    def num_seqs(self) -> int:
        return self.seq_weights.shape[0]


Metrics = dict[str, jax.Array]
PolicyLossFn = Callable[[LossInputs, Any], tuple[jax.Array, Metrics]]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: ``fn(x: LossInputs, p: params) -> (loss, metrics)``; ``params`` is its
    hyperparameter type (``loss_config.LOSS_PARAMS[name]``), whose field defaults are its defaults."""

    name: str
    fn: PolicyLossFn
    params: type[ClipRange]


_REGISTERED: dict[str, PolicyLoss] = {}  # filled once, at import, by @policy_loss below
POLICY_LOSSES: Mapping[str, PolicyLoss] = MappingProxyType(_REGISTERED)


def policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Registers ``fn(x: LossInputs, p) -> (loss, metrics)`` as policy loss ``name``, whose hyperparameter type
    and defaults ``loss_config.LOSS_PARAMS`` states."""

    def register(fn: PolicyLossFn) -> PolicyLossFn:
        if name not in LOSS_PARAMS:
            raise ValueError(f"policy loss {name!r}: add its hyperparameter type to loss_config.LOSS_PARAMS first")
        if name in _REGISTERED:
            raise ValueError(
                f"policy loss {name!r} is registered twice ({_REGISTERED[name].fn.__name__}, {fn.__name__})"
            )
        _REGISTERED[name] = PolicyLoss(name, fn, LOSS_PARAMS[name])
        return fn

    return register


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


def _whole_log_ratio(x: LossInputs) -> jax.Array:
    """[S] each sequence's mean log pi - log pi_old over its trained tokens: the whole sequence's if given."""
    if x.whole is None:
        return sequence_mean(x.logprobs - x.old_logprobs, x.loss_mask, x.seq_index, x.num_seqs)[0]
    return x.whole.log_ratio_sum / jnp.maximum(x.whole.count, 1.0)


def token_weights(x: LossInputs) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The seq-mean-token-mean weights: token (b, t) of sequence i gets ``w_i / n_i`` (0 off the mask).

    ``n_i`` is the sequence's trainable-token count here, or ``x.whole.count`` (its count over all the
    micro-batches it spans). -> (token weights [B, T], effective sequence weights [S]: ``w_i`` times the share
    of the sequence's tokens that are here (0 without trainable tokens), local counts [S]).
    """
    count = jax.ops.segment_sum(x.loss_mask.reshape(-1), x.seq_index.reshape(-1), num_segments=x.num_seqs)
    if x.whole is None:
        total, weights = count, jnp.where(count > 0, x.seq_weights, 0.0)
    else:
        total = jnp.maximum(x.whole.count, count)
        weights = jnp.where(count > 0, x.seq_weights * count / jnp.maximum(total, 1.0), 0.0)
    per_token = jnp.where(count > 0, x.seq_weights / jnp.maximum(total, 1.0), 0.0)[x.seq_index]
    return jnp.where(x.loss_mask > 0, per_token * x.loss_mask, 0.0), weights, count


def _token_advantages(x: LossInputs) -> jax.Array:
    """Advantages per token [B, T] from per-sequence [S] (broadcast by ``seq_index``) or per-token [B, T]."""
    if x.advantages.ndim == 1:
        return x.advantages[x.seq_index]
    if x.advantages.shape != x.seq_index.shape:
        raise ValueError(
            f"advantages must be [S] per sequence or [B, T]={x.seq_index.shape} per token, got {x.advantages.shape}"
        )
    return x.advantages


def _masked(values: jax.Array, loss_mask: jax.Array) -> jax.Array:
    return jnp.where(loss_mask > 0, values, 0.0)


def _clipped_token_objective(x: LossInputs, p: ClipRange, log_ratio: jax.Array, ratio_mean: jax.Array):
    """sum_i w_i mean_t -min(r_t A_i,t, clip(r_t) A_i,t) with r_t = exp(log_ratio) [B, T] (GSPO-token, GRPO)."""
    ratio = jnp.exp(_masked(log_ratio, x.loss_mask))  # [B, T]
    adv = _token_advantages(x)
    clipped_ratio = jnp.clip(ratio, 1.0 - p.clip_low, 1.0 + p.clip_high)
    per_token = -jnp.minimum(ratio * adv, clipped_ratio * adv)
    tw, weights, _ = token_weights(x)
    loss = jnp.sum(_masked(tw * per_token, x.loss_mask))
    was_clipped = (ratio * adv > clipped_ratio * adv).astype(jnp.float32)
    metrics = {
        "clip_fraction": jnp.sum(_masked(tw * was_clipped, x.loss_mask)),
        "ratio_mean": ratio_mean if ratio_mean is not None else jnp.sum(_masked(tw * ratio, x.loss_mask)),
        "weight_sum": jnp.sum(weights),
    }
    return loss, metrics


@policy_loss("gspo")
def gspo_loss(x: LossInputs, p: GSPOParams) -> tuple[jax.Array, Metrics]:
    """GSPO (Zheng et al. 2025): sequence-level ratio s_i = exp(mean_t(log pi - log pi_old)) over the
    sequence's trainable tokens, clipped to [1 - clip_low, 1 + clip_high]:

        loss = sum_i w_i * -min(s_i * A_i, clip(s_i) * A_i)

    x.advantages: [S] (per-token advantages need ``gspo_token``). With ``x.whole`` (a sequence split over
    micro-batches) each part carries its share, and the parts add up to the above.
    """
    if x.advantages.ndim != 1:
        raise ValueError(
            f"gspo takes per-sequence advantages [S], got {x.advantages.shape}: per-token advantages need gspo_token"
        )
    if x.whole is not None:
        # The same objective written token by token (GSPO-token with A_i,t = A_i), which splits exactly.
        return gspo_token_loss(x, p)
    log_ratio, count = sequence_mean(x.logprobs - x.old_logprobs, x.loss_mask, x.seq_index, x.num_seqs)
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - p.clip_low, 1.0 + p.clip_high)
    per_seq = -jnp.minimum(ratio * x.advantages, clipped_ratio * x.advantages)
    weights = jnp.where(count > 0, x.seq_weights, 0.0)
    loss = jnp.sum(jnp.where(count > 0, weights * per_seq, 0.0))
    was_clipped = (ratio * x.advantages > clipped_ratio * x.advantages).astype(jnp.float32)
    metrics = {
        "clip_fraction": jnp.sum(weights * was_clipped),
        "ratio_mean": jnp.sum(weights * ratio),
        "weight_sum": jnp.sum(weights),
    }
    return loss, metrics


@policy_loss("gspo_token")
def gspo_token_loss(x: LossInputs, p: GSPOParams) -> tuple[jax.Array, Metrics]:
    """GSPO-token (GSPO paper, section 4.3): per-token advantages with the sequence-level ratio,

        s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]      (numerically s_i; its gradient flows through token t only)
        loss  = sum_i w_i * mean_t -min(s_i,t * A_i,t, clip(s_i,t) * A_i,t)

    With A_i,t = A_i for every t, value and gradient equal ``gspo_loss``. x.advantages: [S] or [B, T]; with
    ``x.whole``, log s_i and the 1 / n_i of the mean come from the whole sequences' totals.
    """
    log_seq_ratio = _whole_log_ratio(x)
    log_ratio = jax.lax.stop_gradient(log_seq_ratio)[x.seq_index] + x.logprobs - jax.lax.stop_gradient(x.logprobs)
    _, weights, _ = token_weights(x)
    return _clipped_token_objective(x, p, log_ratio, jnp.sum(weights * jnp.exp(log_seq_ratio)))


@policy_loss("grpo")
def grpo_loss(x: LossInputs, p: GRPOParams) -> tuple[jax.Array, Metrics]:
    """GRPO (Shao et al. 2024) with clip-higher (DAPO): token-level ratio r_t = pi(y_t) / pi_old(y_t),

        loss = sum_i w_i * mean_t -min(r_t * A_i,t, clip(r_t, 1 - clip_low, 1 + clip_high) * A_i,t)

    x.advantages: [S] or [B, T]; with ``x.whole`` the n_i of the mean is the whole sequence's count.
    """
    return _clipped_token_objective(x, p, x.logprobs - x.old_logprobs, None)


def kl_k3(x: LossInputs) -> jax.Array:
    """KL(pi || pi_ref) by Schulman's k3 estimator per sampled token, aggregated like the policy losses:

        k3_t = exp(d_t) - d_t - 1,  d_t = log pi_ref(y_t) - log pi(y_t)      (>= 0, unbiased for y_t ~ pi)
        kl   = sum_i w_i * mean_t k3_t

    The choice (k3 as a loss term, as in GRPO/DeepSeekMath) gives a non-negative, low-variance value; its
    gradient is that of the reverse KL only approximately, which is the standard trade-off. Reads
    ``x.ref_logprobs`` (needed) and, with ``x.whole``, the whole sequences' counts; returns a scalar.
    """
    if x.ref_logprobs is None:
        raise ValueError("the KL term needs LossInputs.ref_logprobs (log-probs under the reference policy)")
    d = _masked(x.ref_logprobs - x.logprobs, x.loss_mask)
    k3 = jnp.exp(d) - d - 1.0
    tw, _, _ = token_weights(x)
    return jnp.sum(_masked(tw * k3, x.loss_mask))


def _in_band(log_ratio: jax.Array, cap: float) -> jax.Array:
    """Elementwise: exp(log_ratio) in [1/cap, cap] (bool, same shape); NaN is out. The bound is compared in
    log space, so a ratio exactly at 1/cap or cap is kept."""
    bound = math.log(cap)
    return (log_ratio >= -bound) & (log_ratio <= bound)


def token_keep_mask(x: LossInputs, cfg: LossConfig) -> jax.Array:
    """[B, T] bool: the trainable tokens the token mask (``cfg.is_token_mask``) keeps (all of them when off), on
    r_t = pi_train / mu with pi_train = sg[x.logprobs] and mu = x.old_logprobs."""
    trainable = x.loss_mask > 0
    if cfg.is_token_mask == 0.0:
        return trainable
    log_r = jax.lax.stop_gradient(x.logprobs) - x.old_logprobs
    return trainable & _in_band(jnp.where(trainable, log_r, 0.0), cfg.is_token_mask)


def sequence_totals(x: LossInputs, cfg: LossConfig | None = None) -> SequenceTotals:
    """This micro-batch's ``SequenceTotals`` of log r_t = log sg[pi] - log pi_old: over the tokens ``cfg``'s
    token mask keeps (all trainable ones without ``cfg``) and over every trainable token. Summed over a split
    sequence's parts, they are the ``whole`` a policy loss or ``rl_objective`` takes."""
    log_r = jax.lax.stop_gradient(x.logprobs) - x.old_logprobs
    kept = x.loss_mask if cfg is None else token_keep_mask(x, cfg).astype(jnp.float32)
    total, count = _sequence_sums(log_r, x.loss_mask, x.seq_index, x.num_seqs)
    kept_total, kept_count = _sequence_sums(log_r, kept, x.seq_index, x.num_seqs)
    return SequenceTotals(kept_total, kept_count, total, count)


def _offpolicy_corrections(x: LossInputs, cfg: LossConfig) -> tuple[LossInputs, Metrics]:
    """Token mask, sequence mask, behaviour_is_cap (in that order), on x.old_logprobs = mu -> (the policy loss's
    inputs: its loss mask, sequence weights and whole-sequence totals; the mask counts)."""
    local = sequence_totals(x, cfg)
    whole = local if x.whole is None else x.whole
    keep_token = token_keep_mask(x, cfg)
    keep_seq = jnp.ones((x.num_seqs,), bool)
    if cfg.is_sequence_mask > 0.0:
        n_all = jnp.maximum(whole.all_count, 1.0)
        keep_seq = _in_band(jnp.where(whole.all_count > 0, whole.all_log_ratio_sum / n_all, 0.0), cfg.is_sequence_mask)
    dropped = (~keep_seq) & (local.all_count > 0)
    metrics = {
        "masked_tokens": jnp.sum(jnp.where(keep_token, 0.0, x.loss_mask)),
        "masked_sequences": jnp.sum(jnp.where(dropped, local.all_count / jnp.maximum(whole.all_count, 1.0), 0.0)),
    }
    live = keep_seq & (whole.count > 0)
    kept_log_r = jnp.where(live, whole.log_ratio_sum / jnp.maximum(whole.count, 1.0), 0.0)
    seq_weights = jnp.where(keep_seq, x.seq_weights, 0.0)
    if cfg.behaviour_is_cap > 0.0:
        seq_weights = seq_weights * jnp.minimum(jnp.exp(kept_log_r), cfg.behaviour_is_cap)
    loss_whole = None
    if x.whole is not None:  # the loss's view: its trained tokens are the kept ones of the sequences that stay
        ratio_sum = jnp.zeros_like(kept_log_r) if cfg.recompute_behaviour else jnp.where(live, whole.log_ratio_sum, 0.0)
        count = jnp.where(keep_seq, whole.count, 0.0)
        loss_whole = SequenceTotals(ratio_sum, count, ratio_sum, count)
    policy_mask = jnp.where(keep_token & keep_seq[x.seq_index], x.loss_mask, 0.0)
    return dataclasses.replace(x, loss_mask=policy_mask, seq_weights=seq_weights, whole=loss_whole), metrics


def rl_objective(x: LossInputs, cfg: LossConfig) -> tuple[jax.Array, Metrics]:
    """The whole RL micro-step objective: the policy loss ``cfg.loss`` with ``cfg.params`` (+ kl_coef * KL),
    with pi_old and the off-policy corrections as ``cfg`` says.

    x.old_logprobs: the behaviour log-probs mu recorded by the proxy; x.ref_logprobs: needed iff cfg.kl_coef > 0;
    x.whole: the ``sequence_totals(part, cfg)`` of the whole sequences, summed over their parts, when sequences
    are split over micro-batches (every mask and weight is then decided on the whole sequence and the parts add
    up to it). Metrics (weighted sums that add across micro-batches): the policy loss's, plus ``loss``,
    ``policy_loss``, ``kl`` (when on), ``logprob_gap_sum`` (sum |log pi - log mu| over the trainable tokens the
    token mask keeps), ``target_tokens`` (trainable tokens), and with the off-policy corrections on (or
    ``x.whole`` given) ``masked_tokens`` (trainable tokens the token mask drops) and ``masked_sequences``
    (sequences the sequence mask drops; a split sequence's parts carry their token shares, which add to 1).
    """
    current = jax.lax.stop_gradient(x.logprobs)
    loss_x, metrics = x, {}
    if cfg.corrections or x.whole is not None:
        loss_x, metrics = _offpolicy_corrections(x, cfg)
    if cfg.recompute_behaviour:
        loss_x = dataclasses.replace(loss_x, old_logprobs=current)
    policy_loss_value, policy_metrics = POLICY_LOSSES[cfg.loss].fn(loss_x, cfg.params)
    loss = policy_loss_value
    metrics = dict(policy_metrics, policy_loss=policy_loss_value, **metrics)
    if cfg.kl_coef > 0.0:
        kl = kl_k3(loss_x)
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = jax.lax.stop_gradient(kl)
    gap_mask = token_keep_mask(x, cfg)
    metrics["logprob_gap_sum"] = jnp.sum(jnp.where(gap_mask, jnp.abs(current - x.old_logprobs), 0.0))
    metrics["target_tokens"] = jnp.sum(x.loss_mask)
    metrics["loss"] = loss
    return loss, metrics


def token_nll_loss(logprobs: jax.Array, token_weights: jax.Array) -> jax.Array:
    """Supervised loss: -sum(weights * log p); ``token_weights`` [B, T] carry the normalization."""
    return -jnp.sum(token_weights * logprobs)


if set(POLICY_LOSSES) != set(LOSS_PARAMS):  # every loss of loss_config.LOSS_PARAMS has its function here
    raise ImportError(f"losses {sorted(set(LOSS_PARAMS) - set(POLICY_LOSSES))} have no @policy_loss function")
