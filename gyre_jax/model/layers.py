"""Basic layers with logically-named parameter axes: RMSNorm, Embedder, Einsum projection (with an optional LoRA
adapter: ``model/lora.py``).

Parameters carry MaxText-style logical axis names (``embed``, ``heads``, ``kv_heads``, ``head_dim``,
``mlp``, ``vocab``, ``exp``) via ``nnx.with_partitioning``; ``gyre_jax.model.sharding`` maps them to mesh axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """``x * rsqrt(mean(x^2) + eps) * scale`` over the last axis, computed in float32 (Qwen3: scale starts at 1)."""

    def __init__(self, dim: int, axis_name: str, *, eps: float, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = nnx.Param(
            nnx.with_partitioning(nnx.initializers.ones, (axis_name,))(rngs.params(), (dim,), param_dtype)
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...].astype(jnp.float32)).astype(dtype)


class Einsum(nnx.Module):
    """A weight of ``shape`` with logical ``axes``, applied as ``einsum(eqn, x, w)`` (+ an optional bias).

    ``bias_dims``: how many trailing dimensions of ``shape`` the output ends with and the bias covers
    (0 = no bias), e.g. q_proj ``[E, H, D]`` -> bias ``[H, D]`` with ``bias_dims=2``. Biases start at zero.
    ``lora``: ``(rank, scale, in_dims)`` adds a LoRA adapter over the first ``in_dims`` (input) dimensions of the
    weight (``lora.LoraAdapter``: ``lora_a`` / ``lora_b``, ``nnx.LoRAParam``s; applied beside the weight, never
    merged into it); None = none.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        axes: tuple[str | None, ...],
        *,
        fan_in: int,
        param_dtype,
        rngs: nnx.Rngs,
        bias_dims: int = 0,
        lora: tuple[int, float, int] | None = None,
    ):
        init = nnx.initializers.normal(stddev=fan_in**-0.5)
        self.w = nnx.Param(nnx.with_partitioning(init, axes)(rngs.params(), shape, param_dtype))
        if bias_dims:
            self.b = nnx.Param(
                nnx.with_partitioning(nnx.initializers.zeros, axes[-bias_dims:])(
                    rngs.params(), shape[-bias_dims:], param_dtype
                )
            )
        else:
            self.b = None
        if lora is not None:  # after the base weights: their initial values do not depend on the adapter
            from gyre_jax.model.lora import LoraAdapter

            rank, scale, in_dims = lora
            self.lora = LoraAdapter(shape, axes, in_dims, rank, scale, param_dtype=param_dtype)

    def __call__(self, eqn: str, x: jax.Array, preferred_element_type=None, weight_shape=None) -> jax.Array:
        """``einsum(eqn, x, w)`` + bias; ``weight_shape``: the weight viewed as that shape first (a reshape that
        merges adjacent dims, e.g. o_proj's [H, D, E] as [H * D, E] so one dim is contracted)."""
        w = self.w[...].astype(x.dtype)
        w = w if weight_shape is None else w.reshape(weight_shape)
        y = jnp.einsum(eqn, x, w, preferred_element_type=preferred_element_type)
        if hasattr(self, "lora"):
            y = y + self.lora(eqn, x, w.shape).astype(y.dtype)
        if self.b is not None:
            y = y + self.b[...].astype(y.dtype)
        return y


class Embedder(nnx.Module):
    """Token embedding table ``[vocab, embed]``; ``decode`` projects back to logits when embeddings are tied."""

    def __init__(self, vocab_size: int, embed_dim: int, *, param_dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=embed_dim**-0.5)  # tied logits start near unit scale
        self.table = nnx.Param(
            nnx.with_partitioning(init, ("vocab", "embed"))(rngs.params(), (vocab_size, embed_dim), param_dtype)
        )

    def encode(self, tokens: jax.Array, dtype) -> jax.Array:
        """tokens: [B, T] int32 -> [B, T, E]"""
        return jnp.take(self.table[...], tokens, axis=0).astype(dtype)

    def decode(self, x: jax.Array) -> jax.Array:
        """x: [B, T, E] -> logits [B, T, V] (float32)"""
        return jnp.einsum("bte,ve->btv", x, self.table[...].astype(x.dtype), preferred_element_type=jnp.float32)
