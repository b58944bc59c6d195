"""Rotary position embedding in HF's "rotate half" convention (Qwen3, Llama, Qwen2), with HF's linear, YaRN and
Llama 3 scaling.

``rope_frequencies(cfg)`` gives the per-pair inverse frequencies and the cos/sin scale exactly as
transformers' ``ROPE_INIT_FUNCTIONS`` compute them (default, linear, yarn, llama3); ``apply_rope`` rotates.
(llama.cpp's GGUF files hold Llama's q/k rows permuted for its interleaved layout: ``gguf_config`` undoes that at
load, so the weights here are always in HF's layout.)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def default_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """[D/2] float32: theta^(-2i/D)."""
    return (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))).astype(np.float32)


def rope_frequencies(cfg) -> tuple[np.ndarray, float]:
    """(inv_freq [D/2] float32, attention_scaling) for a ModelConfig's rope_type."""
    d, base = cfg.head_dim, cfg.rope_theta
    if cfg.rope_type == "default":
        return default_inv_freq(d, base), 1.0
    if cfg.rope_type == "linear":
        return (default_inv_freq(d, base) / np.float32(cfg.rope_factor)).astype(np.float32), 1.0
    if cfg.rope_type == "llama3":
        return llama3_inv_freq(cfg), 1.0
    if cfg.rope_type != "yarn":
        raise ValueError(f"rope_type={cfg.rope_type!r} is not supported (default, linear, yarn, llama3)")
    factor = cfg.rope_factor

    def correction_dim(rotations: float) -> float:
        return (d * math.log(cfg.rope_original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    pos_freqs = (base ** (np.arange(0, d, 2, dtype=np.float32) / d)).astype(np.float32)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.astype(np.float32), float(cfg.yarn_attention_factor)


def llama3_inv_freq(cfg) -> np.ndarray:
    """[D/2] float32: Llama 3.1's scaling (HF ``_compute_llama3_parameters``): wavelengths longer than
    original / low_freq_factor divided by ``factor``, shorter than original / high_freq_factor kept, between them
    interpolated smoothly."""
    inv_freq = default_inv_freq(cfg.head_dim, cfg.rope_theta)
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old = cfg.rope_original_max_position
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float, *, inv_freq=None, scale: float = 1.0) -> jax.Array:
    """x: [B, T, N, D], positions: [B, T] int32 -> [B, T, N, D] (computed in float32).

    ``inv_freq`` ([D/2], default ``theta^(-2i/D)``) and ``scale`` (cos/sin factor, YaRN) come from
    ``rope_frequencies``.
    """
    d = x.shape[-1]
    if inv_freq is None:
        inv_freq = default_inv_freq(d, theta)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : d // 2], x32[..., d // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)
