"""Basic layers with logically-named parameter axes: RMSNorm, Embedder, Einsum projection.

Parameters carry MaxText-style logical axis names (``embed``, ``heads``, ``kv_heads``, ``head_dim``,
``mlp``, ``vocab``) via ``nnx.with_partitioning``; ``gyre_jax.model.sharding`` maps them to mesh axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """``x * rsqrt(mean(x^2) + eps) * scale`` over the last axis, computed in float32 (Qwen3: scale starts at 1)."""

    def __init__(self, dim: int, axis_name: str, *, eps: float, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, (axis_name,))(rngs.params(), (dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...].astype(jnp.float32)).astype(dtype)


class Einsum(nnx.Module):
    """A weight of ``shape`` with logical ``axes``, applied as ``einsum(eqn, x, w)``."""

    def __init__(self, shape: tuple[int, ...], axes: tuple[str | None, ...], *, fan_in: int, param_dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=fan_in**-0.5)
        self.w = nnx.Param(nnx.with_partitioning(init, axes)(rngs.params(), shape, param_dtype))

    def __call__(self, eqn: str, x: jax.Array) -> jax.Array:
        return jnp.einsum(eqn, x, self.w[...].astype(x.dtype))


class Embedder(nnx.Module):
    """Token embedding table ``[vocab, embed]``; ``decode`` projects back to logits when embeddings are tied."""

    def __init__(self, vocab_size: int, embed_dim: int, *, param_dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=embed_dim**-0.5)  # tied logits start near unit scale
        self.table = nnx.Param(nnx.with_partitioning(init, ("vocab", "embed"))(rngs.params(), (vocab_size, embed_dim), param_dtype))

    def encode(self, tokens: jax.Array, dtype) -> jax.Array:
        """tokens: [B, T] int32 -> [B, T, E]"""
        return jnp.take(self.table[...], tokens, axis=0).astype(dtype)

    def decode(self, x: jax.Array) -> jax.Array:
        """x: [B, T, E] -> logits [B, T, V] (float32)"""
        return jnp.einsum("bte,ve->btv", x, self.table[...].astype(x.dtype)).astype(jnp.float32)
