"""Frozen model configuration (one dataclass per architecture, Flax-gemma style) and presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax.numpy as jnp


@dataclass(frozen=True)
class ModelConfig:
    """A Qwen3-style dense decoder."""

    vocab_size: int
    num_layers: int
    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self):
        return jnp.dtype(self.param_dtype)

    @property
    def num_params(self) -> int:
        e, h, k, d, m, v = self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim, self.mlp_dim, self.vocab_size
        per_layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * m + 2 * e + 2 * d
        return self.num_layers * per_layer + v * e * (1 if self.tie_embeddings else 2) + e

    @classmethod
    def from_config_dict(cls, model_cfg) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(model_cfg).items() if k in names})


TINY = ModelConfig(vocab_size=272, num_layers=2, embed_dim=128, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384, rope_theta=10_000.0)
