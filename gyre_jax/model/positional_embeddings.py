"""Rotary position embedding in Qwen3's (Llama's "rotate half") convention."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """x: [B, T, N, D], positions: [B, T] int32 -> [B, T, N, D] (computed in float32)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], axis=-1))[:, :, None, :]  # [B, T, 1, D]
    sin = jnp.sin(jnp.concatenate([angles, angles], axis=-1))[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : d // 2], x32[..., d // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)
