"""Log-probabilities of target tokens without holding the whole ``[B, T, V]`` logits.

The training objective needs ``log softmax(logits / temperature)`` at one target per token. Computed at once,
the float32 logits and their gradient cost ``8 V`` bytes per token (1.2 MB at Qwen3's V = 151936, so 150 GB
for a 128K-token branch). ``target_logprobs`` with ``chunk > 0`` scans over chunks of ``chunk`` tokens: each
chunk's logits are computed, reduced to the target's log-prob, and dropped; ``jax.checkpoint`` recomputes them
chunk by chunk in the backward, so only ``[B, chunk, V]`` is live in either pass. ``chunk = 0`` is the plain
computation. Both give the same values and gradients (tests/model/test_logprobs.py).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _chunk_logprobs(head: Callable[[jax.Array], jax.Array], x, targets, temperature) -> jax.Array:
    """x: [B, C, E]; targets: [B, C] int32; temperature: [B, C] float32 -> [B, C] float32."""
    logits = head(x) / temperature[..., None]  # [B, C, V] float32
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def target_logprobs(
    head: Callable[[jax.Array], jax.Array], x: jax.Array, targets: jax.Array, temperature: jax.Array, chunk: int = 0
) -> jax.Array:
    """log pi(targets) under ``head(x) / temperature``: x [B, T, E] (final-normed hidden states), targets [B, T]
    int32, temperature [B, T] float32 -> [B, T] float32. ``chunk`` > 0: tokens per chunk (T is padded up to a
    multiple; the padding is dropped), the logits recomputed per chunk in the backward."""
    b, t, _ = x.shape
    if chunk <= 0 or chunk >= t:
        return _chunk_logprobs(head, x, targets, temperature)
    n = -(-t // chunk)
    pad = n * chunk - t

    def split(a, fill):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
        return jnp.moveaxis(a.reshape(b, n, chunk, *a.shape[2:]), 1, 0)  # [n, B, chunk, ...]

    one = jax.checkpoint(lambda xs, ts, temps: _chunk_logprobs(head, xs, ts, temps))

    def body(carry, inputs):
        return carry, one(*inputs)

    _, out = jax.lax.scan(body, None, (split(x, 0), split(targets, 0), split(temperature, 1)))  # [n, B, chunk]
    return jnp.moveaxis(out, 0, 1).reshape(b, n * chunk)[:, :t]
