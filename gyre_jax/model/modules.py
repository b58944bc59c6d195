"""The Qwen3-style decoder: SwiGLU MLP, pre-norm blocks, and the causal LM with an optional KV cache.

``Transformer.__call__(tokens, positions, mask, cache)`` is the single forward: training passes a
packed mask and no cache; serving passes a cache and a cache-causal mask. The cache is a plain
pytree returned from the call, never hidden module state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gyre_jax.model.attention import Attention, LayerCache
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.layers import Einsum, Embedder, RMSNorm


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, m, pd = cfg.embed_dim, cfg.mlp_dim, cfg.weight_dtype
        self.gate_proj = Einsum((e, m), ("embed", "mlp"), fan_in=e, param_dtype=pd, rngs=rngs)
        self.up_proj = Einsum((e, m), ("embed", "mlp"), fan_in=e, param_dtype=pd, rngs=rngs)
        self.down_proj = Einsum((m, e), ("mlp", "embed"), fan_in=m, param_dtype=pd, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj("btm,me->bte", jax.nn.silu(self.gate_proj("bte,em->btm", x)) * self.up_proj("bte,em->btm", x))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = cfg.weight_dtype
        self.input_norm = RMSNorm(cfg.embed_dim, "embed", eps=cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.embed_dim, "embed", eps=cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, mask, cache: LayerCache | None):
        h, cache = self.attn(self.input_norm(x), positions, mask, cache)
        x = x + h
        x = x + self.mlp(self.post_attn_norm(x))
        return x, cache


class Transformer(nnx.Module):
    """Qwen3-style causal LM."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedder = Embedder(cfg.vocab_size, cfg.embed_dim, param_dtype=cfg.weight_dtype, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.embed_dim, "embed", eps=cfg.rms_norm_eps, param_dtype=cfg.weight_dtype, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = Einsum((cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"), fan_in=cfg.embed_dim,
                                  param_dtype=cfg.weight_dtype, rngs=rngs)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        cache: list[LayerCache] | None = None,
    ) -> tuple[jax.Array, list[LayerCache] | None]:
        """tokens, positions: [B, T] int32; mask: [B, T, S] bool -> (logits [B, T, V] float32, cache)."""
        x = self.embedder.encode(tokens, self.cfg.compute_dtype)
        new_cache = [] if cache is not None else None
        for i, layer in enumerate(self.layers):
            x, layer_cache = layer(x, positions, mask, None if cache is None else cache[i])
            if new_cache is not None:
                new_cache.append(layer_cache)
        x = self.final_norm(x)
        if self.cfg.tie_embeddings:
            logits = self.embedder.decode(x)
        else:
            logits = self.lm_head("bte,ev->btv", x).astype(jnp.float32)
        return logits, new_cache
