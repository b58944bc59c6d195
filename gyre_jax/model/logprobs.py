"""Log-probabilities of target tokens without holding the whole ``[B, T, V]`` logits.

The training objective needs ``log softmax(logits / temperature)`` at one target per token. Computed at once,
the float32 logits and their gradient cost ``8 V`` bytes per token (1.2 MB at Qwen3's V = 151936, so 150 GB
for a 128K-token branch). ``target_logprobs`` with ``chunk > 0`` scans over chunks of ``chunk`` tokens: each
chunk's logits are computed, reduced to the target's log-prob, and dropped; ``jax.checkpoint`` recomputes them
chunk by chunk in the backward, so only ``[B, chunk, V]`` is live in either pass. ``chunk = 0`` is the plain
computation. Both give the same values and gradients (tests/model/test_logprobs.py).

The head is either any callable ``hidden -> logits`` (differentiated by JAX as written) or a ``LinearHead``
(``Transformer.linear_head``: the vocabulary projection's weight itself), whose log-probs have their own backward
(``linear_logprobs``): it keeps only the per-token log-sum-exp from the forward, recomputes the logits, and forms
the softmax's gradient once, in the layout the two weight-gradient matmuls read. JAX's own backward of
``log_softmax`` + ``take_along_axis`` + the projection materialized a zero ``[B, T, V]`` scatter for the target,
computed the logits' gradient twice, once written transposed (``[V, B*T]``) for the weight's gradient; on a 2-core
CPU at SmolLM2's shapes ([4, 512] tokens, V = 49152, E = 576) that backward took 7.3 CPU-s against 3.9 for this
one, which does one more matmul (the recomputed logits) but no transposed ``[V, B*T]`` write (docs/model.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearHead:
    """The vocabulary projection as its weight: ``weight`` [V, E] (``vocab_major``: a tied embedding table, logits
    = x @ weight.T) or [E, V] (an ``lm_head``, logits = x @ weight), already in the compute dtype. Calling it gives
    the float32 logits, as ``Transformer.head`` does."""

    weight: jax.Array
    vocab_major: bool = dataclasses.field(metadata=dict(static=True))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, T, E] -> logits [B, T, V] float32."""
        return _logits(self.weight, x, self.vocab_major)


def _logits(weight: jax.Array, x: jax.Array, vocab_major: bool) -> jax.Array:
    spec = "bte,ve->btv" if vocab_major else "bte,ev->btv"
    return jnp.einsum(spec, x, weight.astype(x.dtype), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _linear_logprobs(weight, x, targets, temperature, vocab_major: bool):
    out, _ = _linear_logprobs_fwd(weight, x, targets, temperature, vocab_major)
    return out


def _scaled_logits(weight, x, temperature, vocab_major):
    return _logits(weight, x, vocab_major) / temperature[..., None]  # [B, T, V] float32


def _linear_logprobs_fwd(weight, x, targets, temperature, vocab_major):
    logits = _scaled_logits(weight, x, temperature, vocab_major)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    out = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - lse
    return out, (weight, x, targets, temperature, lse)


def _linear_logprobs_bwd(vocab_major, residuals, g):
    """g: [B, T] -> (d weight, d x, None, None). d logits = (onehot(target) - softmax) * g / temperature, formed
    once ([B, T, V] float32, cast to the compute dtype for the two matmuls, which give it); the weight's gradient is computed as
    [E, V] (x's small [B*T, E] is the operand laid out again for the matmul) and, for a tied table, transposed."""
    weight, x, targets, temperature, lse = residuals
    logits = _scaled_logits(weight, x, temperature, vocab_major)  # recomputed: one matmul, no [B, T, V] residual
    onehot = jnp.arange(logits.shape[-1], dtype=targets.dtype) == targets[..., None]
    d = (onehot.astype(jnp.float32) - jnp.exp(logits - lse[..., None])) * (g / temperature)[..., None]
    d = d.astype(x.dtype)
    w = weight.astype(x.dtype)
    dx = jnp.einsum("btv,ve->bte" if vocab_major else "btv,ev->bte", d, w)
    dw = jnp.einsum("bte,btv->ev", x, d)  # [E, V]
    if vocab_major:
        dw = dw.T
    return dw.astype(weight.dtype), dx.astype(x.dtype), None, None


_linear_logprobs.defvjp(_linear_logprobs_fwd, _linear_logprobs_bwd)


def linear_logprobs(head: LinearHead, x: jax.Array, targets: jax.Array, temperature: jax.Array) -> jax.Array:
    """log softmax(head(x) / temperature) at ``targets``: x [B, T, E], targets [B, T] int32, temperature [B, T]
    float32 -> [B, T] float32, with the backward described in the module docstring (gradients to the weight and
    to x; none to targets or temperature)."""
    return _linear_logprobs(head.weight, x, targets, temperature, head.vocab_major)


def _chunk_logprobs(head: Callable[[jax.Array], jax.Array] | LinearHead, x, targets, temperature) -> jax.Array:
    """x: [B, C, E]; targets: [B, C] int32; temperature: [B, C] float32 -> [B, C] float32."""
    if isinstance(head, LinearHead):
        return linear_logprobs(head, x, targets, temperature)
    logits = head(x) / temperature[..., None]  # [B, C, V] float32
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def target_logprobs(
    head: Callable[[jax.Array], jax.Array] | LinearHead,
    x: jax.Array,
    targets: jax.Array,
    temperature: jax.Array,
    chunk: int = 0,
) -> jax.Array:
    """log pi(targets) under ``head(x) / temperature``: x [B, T, E] (final-normed hidden states), targets [B, T]
    int32, temperature [B, T] float32 -> [B, T] float32. ``head``: a callable or a ``LinearHead`` (its own backward,
    above). ``chunk`` > 0: tokens per chunk (T is padded up to a multiple; the padding is dropped), the logits
    recomputed per chunk in the backward."""
    b, t, _ = x.shape
    if chunk <= 0 or chunk >= t:
        return _chunk_logprobs(head, x, targets, temperature)
    n = -(-t // chunk)
    pad = n * chunk - t

    def split(a, fill):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
        return jnp.moveaxis(a.reshape(b, n, chunk, *a.shape[2:]), 1, 0)  # [n, B, chunk, ...]

    one = lambda xs, ts, temps: _chunk_logprobs(head, xs, ts, temps)  # noqa: E731
    if not isinstance(head, LinearHead):  # a LinearHead's backward already keeps no [B, chunk, V] residual
        one = jax.checkpoint(one)

    def body(carry, inputs):
        return carry, one(*inputs)

    _, out = jax.lax.scan(body, None, (split(x, 0), split(targets, 0), split(temperature, 1)))  # [n, B, chunk]
    return jnp.moveaxis(out, 0, 1).reshape(b, n * chunk)[:, :t]
