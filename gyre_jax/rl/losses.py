"""Policy-gradient objectives as pure functions of per-token log-probs.

Layout (a packed micro-batch, see ``gyre_jax.trajectory.batch.MicroBatch``): token arrays are
``[B, T]``; every token belongs to one sequence ``seq_index[b, t]`` in ``[0, S)``; per-sequence arrays
(``advantages``, ``seq_weights``) are ``[S]``. ``loss_mask`` is 1 on trainable (policy-generated)
target tokens. ``seq_weights`` already carry the global normalization (each execution counts once in
the step), so summing micro-batch losses gives the step's loss exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sequence_mean(values: jax.Array, mask: jax.Array, seq_index: jax.Array, num_seqs: int) -> tuple[jax.Array, jax.Array]:
    """Masked mean of ``values`` [B, T] per sequence -> ([S] means, [S] token counts)."""
    flat_idx = seq_index.reshape(-1)
    total = jax.ops.segment_sum((values * mask).reshape(-1), flat_idx, num_segments=num_seqs)
    count = jax.ops.segment_sum(mask.reshape(-1), flat_idx, num_segments=num_seqs)
    return total / jnp.maximum(count, 1.0), count


def gspo_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    loss_mask: jax.Array,
    seq_index: jax.Array,
    advantages: jax.Array,
    seq_weights: jax.Array,
    clip_low: float,
    clip_high: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO (Zheng et al. 2025): sequence-level ratio s_i = exp(mean_t(log pi - log pi_old)) over the
    sequence's trainable tokens, clipped to [1 - clip_low, 1 + clip_high]:

        loss = sum_i w_i * -min(s_i * A_i, clip(s_i) * A_i)

    logprobs, old_logprobs, loss_mask: [B, T]; seq_index: [B, T] int32; advantages, seq_weights: [S].
    """
    num_seqs = advantages.shape[0]
    log_ratio, count = sequence_mean(logprobs - old_logprobs, loss_mask, seq_index, num_seqs)
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_seq = -jnp.minimum(ratio * advantages, clipped_ratio * advantages)
    weights = seq_weights * (count > 0)
    loss = jnp.sum(weights * per_seq)
    was_clipped = (ratio * advantages > clipped_ratio * advantages).astype(jnp.float32)
    metrics = {
        "clip_fraction": jnp.sum(weights * was_clipped),
        "ratio_mean": jnp.sum(weights * ratio),
        "weight_sum": jnp.sum(weights),
    }
    return loss, metrics


def token_nll_loss(logprobs: jax.Array, token_weights: jax.Array) -> jax.Array:
    """Supervised loss: -sum(weights * log p); ``token_weights`` [B, T] carry the normalization."""
    return -jnp.sum(token_weights * logprobs)
