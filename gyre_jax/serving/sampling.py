"""Per-row token sampling (temperature, top-k, top-p) that also returns the behaviour log-prob.

The log-prob is that of the temperature-scaled distribution ``log_softmax(logits / T)`` before
truncation (``T = 1`` for greedy rows): exactly what the trainer recomputes from the recorded tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """logits: [B, V] f32; keys: [B, 2] uint32 raw key data; temperature, top_p: [B] f32; top_k: [B] int32.

    Returns tokens [B] int32 and their log-probs [B] f32. ``temperature <= 0`` means greedy,
    ``top_k <= 0`` and ``top_p >= 1`` disable truncation.
    """
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature)
    scaled = logits / t[:, None]
    logp = jax.nn.log_softmax(scaled, axis=-1)

    # Truncation sorts the vocabulary (the costliest part of a decode step's sampling at batch 32): only when
    # some sampled row asks for it. Untruncated rows are left whole either way (no rounding of the top-p
    # cumulative sum can drop their tail tokens).
    truncating = ~greedy & ((top_k > 0) | (top_p < 1.0))
    truncated = jax.lax.cond(jnp.any(truncating), _truncate, lambda s, k, p: s, scaled, top_k, top_p)
    truncated = jnp.where(truncating[:, None], truncated, scaled)

    def draw(key_data, row):
        return jax.random.categorical(jax.random.wrap_key_data(key_data), row)

    sampled = jax.vmap(draw)(keys, truncated)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def advance(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode step's sampling: logits [B, V] f32, keys [B, 2] raw key data, sampling [B] each.

    Returns tokens [B] int32, their log-probs [B] f32 and the rows' next keys [B, 2]. A greedy row's key never
    advances (it draws nothing), so a row's key stream does not depend on what else is in the batch; when every
    row is greedy the step is an argmax and a log-softmax: no key split, no draw (a ``lax.cond``, taken at run
    time: one program for every mix of sampling settings).
    """
    greedy = temperature <= 0

    def all_greedy(logits, keys):
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0], keys

    def some_sampled(logits, keys):
        nxt, use = split_keys(keys)
        tokens, logprobs = sample(logits, use, temperature, top_k, top_p)
        return tokens, logprobs, jnp.where(greedy[:, None], keys, nxt)

    return jax.lax.cond(jnp.all(greedy), all_greedy, some_sampled, logits, keys)


def _truncate(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """scaled: [B, V] temperature-scaled logits -> the same with every token outside the row's top-k and its
    top-p nucleus set to -inf (``top_k <= 0``, ``top_p >= 1``: that limit off). Sorts each row once."""
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted  # mass strictly above each rank
    keep_count = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (keep_count - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def split_keys(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """keys: [B, 2] raw key data -> (next keys, keys to sample with now), each [B, 2]."""

    def one(key_data):
        a, b = jax.random.split(jax.random.wrap_key_data(key_data))
        return jax.random.key_data(a), jax.random.key_data(b)

    return jax.vmap(one)(keys)


def key_for_seed(seed: int) -> jax.Array:
    """Raw [2] uint32 key data for a request seed (all 63 bits count; equal to ``jax.random.key(seed)`` below 2**32)."""
    seed %= 2**63
    return jnp.asarray([seed >> 32, seed & 0xFFFFFFFF], jnp.uint32)
