"""The Qwen3 decoder: SwiGLU MLP or sparse MoE per layer, pre-norm blocks, and the causal LM with an optional KV cache.

``Transformer.__call__(tokens, positions, mask, cache)`` is the single forward: training passes a
packed mask and no cache; serving passes a cache and a cache-causal mask (dense, or a ``MaskSpec`` for
``attention_impl="blockwise"``: ``attention.tree_mask`` / ``cache_mask``). The cache is a plain
pytree returned from the call, never hidden module state. ``return_aux=True`` adds a ``ModelAux``
(MoE router logits, the expert ids each MoE layer used and the load-balancing loss) as a third output;
``expert_ids=`` replays given expert ids in the MoE layers (routing replay, ``moe.choose_route``). ``cfg.remat_policy`` wraps each
block in ``nnx.remat`` so the backward pass recomputes its activations.

``cfg.scan_layers``: ``self.layers`` is one ``Block`` whose parameters are stacked ``[L, ...]`` (``layer_stack.py``)
instead of an ``nnx.List`` of blocks; the forward without a cache is one ``lax.scan`` over them (remat wraps the
scan body), the cached forward runs layer by layer over their slices (the cache stays a list of ``LayerCache``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from gyre_jax.model import layer_stack
from gyre_jax.model.attention import Attention, LayerCache
from gyre_jax.model.blockwise import MaskSpec
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.layers import Einsum, Embedder, RMSNorm
from gyre_jax.model.logprobs import LinearHead
from gyre_jax.model.lora import init_adapters, lora_arg
from gyre_jax.model.moe import MoEBlock, load_balancing_loss

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelAux:
    """Auxiliary outputs of a forward pass.

    router_logits: [L_moe, B*T, X] (one row per token of each MoE layer) or None for a dense model.
    load_balancing_loss: [] float32, ``moe.load_balancing_loss`` over real tokens (queries that see at least
    one key: rows of a dense mask with a True, ``MaskSpec.sees_any``); 0 for a dense model. Not multiplied by ``cfg.router_aux_loss_coef``.

    expert_ids: [L_moe, B*T, k] int32, the experts each MoE layer used for each token (its own top-k, or the
    replayed ids), or None for a dense model.
    """

    router_logits: jax.Array | None
    load_balancing_loss: jax.Array
    expert_ids: jax.Array | None = None


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, m, pd = cfg.embed_dim, cfg.mlp_dim, cfg.weight_dtype
        up = dict(fan_in=e, param_dtype=pd, rngs=rngs)
        self.gate_proj = Einsum((e, m), ("embed", "mlp"), **up, lora=lora_arg(cfg, "gate_proj", 1))
        self.up_proj = Einsum((e, m), ("embed", "mlp"), **up, lora=lora_arg(cfg, "up_proj", 1))
        self.down_proj = Einsum(
            (m, e), ("mlp", "embed"), fan_in=m, param_dtype=pd, rngs=rngs, lora=lora_arg(cfg, "down_proj", 1)
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(
            "btm,me->bte", jax.nn.silu(self.gate_proj("bte,em->btm", x)) * self.up_proj("bte,em->btm", x)
        )


class Block(nnx.Module):
    """Pre-norm decoder layer; ``moe`` selects the sparse MoE block instead of the dense MLP."""

    def __init__(self, cfg: ModelConfig, *, moe: bool = False, rngs: nnx.Rngs):
        pd = cfg.weight_dtype
        self.input_norm = RMSNorm(cfg.embed_dim, "embed", eps=cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.embed_dim, "embed", eps=cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        if moe:
            self.moe = MoEBlock(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, mask, cache: LayerCache | None, replay_ids: jax.Array | None = None):
        """x: [B, T, E]; replay_ids: [B*T, k] int or None (MoE only) -> (x [B, T, E], cache,
        router logits [B*T, X] or None, expert ids [B*T, k] int32 or None)."""
        h, cache = self.attn(self.input_norm(x), positions, mask, cache)
        x = x + h
        if hasattr(self, "moe"):
            h, router_logits, ids = self.moe(self.post_attn_norm(x), replay_ids)
        else:
            h, router_logits, ids = self.mlp(self.post_attn_norm(x)), None, None
        return x + h, cache, router_logits, ids


def _call_block(block: Block, x, positions, mask, cache, replay_ids):
    return block(x, positions, mask, cache, replay_ids)


class Transformer(nnx.Module):
    """Qwen3 causal LM (dense or MoE)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedder = Embedder(cfg.vocab_size, cfg.embed_dim, param_dtype=cfg.weight_dtype, rngs=rngs)
        blocks = [Block(cfg, moe=cfg.is_moe_layer(i), rngs=rngs) for i in range(cfg.num_layers)]
        self.final_norm = RMSNorm(cfg.embed_dim, "embed", eps=cfg.rms_norm_eps, param_dtype=cfg.weight_dtype, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = Einsum(
                (cfg.embed_dim, cfg.vocab_size),
                ("embed", "vocab"),
                fan_in=cfg.embed_dim,
                param_dtype=cfg.weight_dtype,
                rngs=rngs,
            )
        if cfg.lora.enabled:  # LoRA's A from its own key, after every base weight: a seed's base is the same without it
            init_adapters(blocks, rngs.params())
        # scan_layers: one Block with every parameter stacked [L, ...] (model/layer_stack.py), the same values
        self.layers = layer_stack.stack_modules(blocks) if cfg.scan_layers else nnx.List(blocks)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        mask: jax.Array | MaskSpec,
        cache: list[LayerCache] | None = None,
        *,
        return_aux: bool = False,
        expert_ids: jax.Array | None = None,
        head: bool = True,
    ):
        """tokens, positions: [B, T] int32; mask: [B, T, S] bool or a MaskSpec (per ``cfg.attention_impl``:
        ``attention.tree_mask`` / ``cache_mask`` build it) -> (logits [B, T, V] float32, cache)
        or, with ``return_aux``, (logits, cache, ModelAux). ``expert_ids``: [B, T, L_moe, k] int (MoE
        models only; a token whose row is -1 routes itself): replayed instead of each MoE layer's top-k.
        ``head=False``: the final-normed hidden states [B, T, E] in place of the logits (``self.head`` maps
        them; ``model.logprobs`` does it in chunks)."""
        b, t = tokens.shape
        if expert_ids is not None and expert_ids.shape[:3] != (b, t, self.cfg.num_moe_layers):
            raise ValueError(
                f"expert_ids {expert_ids.shape} must be [B={b}, T={t}, MoE layers={self.cfg.num_moe_layers}, k]"
            )
        x = self.embedder.encode(tokens, self.cfg.compute_dtype)
        if self.cfg.scan_layers and cache is None:
            x, router_logits, used_ids = self._scan_layers(x, positions, mask, expert_ids)
            new_cache = None
        else:
            x, new_cache, router_logits, used_ids = self._loop_layers(x, positions, mask, cache, expert_ids)
        x = self.final_norm(x)
        logits = self.head(x) if head else x
        if not return_aux:
            return logits, new_cache
        if router_logits is not None:  # [L_moe, B*T, X]
            sees = mask.sees_any(self.cfg.attention_block_k) if isinstance(mask, MaskSpec) else jnp.any(mask, -1)
            real = sees.reshape(-1)  # [B*T]: padding rows attend to nothing
            lb = load_balancing_loss(router_logits, self.cfg.num_experts_per_tok, real)
        else:
            lb = jnp.zeros((), jnp.float32)
        return logits, new_cache, ModelAux(router_logits=router_logits, load_balancing_loss=lb, expert_ids=used_ids)

    def _block(self, i: int, stacked) -> Block:
        """Layer ``i``'s ``Block``; in the stacked layout (``stacked``: ``nnx.split(self.layers)``) one over slice ``i``
        of every stacked weight (XLA slices it out of the stack: on CPU a copy of the weights each call)."""
        if stacked is None:
            return self.layers[i]
        graphdef, state = stacked
        return nnx.merge(graphdef, layer_stack.layer_subtree(state, i))

    def _loop_layers(self, x, positions, mask, cache, expert_ids):
        """The layers one after another (a Python loop: one copy of the block per layer in the program) ->
        (x, new cache or None, router logits [L_moe, B*T, X] or None, expert ids [L_moe, B*T, k] or None)."""
        b, t = positions.shape
        call = _call_block
        if self.cfg.remat_policy != "none":
            call = nnx.remat(_call_block, policy=REMAT_POLICIES[self.cfg.remat_policy], prevent_cse=True)
        new_cache = [] if cache is not None else None
        router_logits, used_ids = [], []
        stacked = nnx.split(self.layers) if self.cfg.scan_layers else None
        for i in range(self.cfg.num_layers):
            layer = self._block(i, stacked)
            replay = None
            if expert_ids is not None and hasattr(layer, "moe"):
                replay = expert_ids[:, :, len(used_ids)].reshape(b * t, -1)
            x, layer_cache, logits_i, ids_i = call(
                layer, x, positions, mask, None if cache is None else cache[i], replay
            )
            if new_cache is not None:
                new_cache.append(layer_cache)
            if logits_i is not None:
                router_logits.append(logits_i)
                used_ids.append(ids_i)
        if not router_logits:
            return x, new_cache, None, None
        return x, new_cache, jnp.stack(router_logits), jnp.stack(used_ids)

    def _scan_layers(self, x, positions, mask, expert_ids):
        """The stacked layers as one ``lax.scan`` body (no cache; every layer of one kind) -> (x, router logits
        [L, B*T, X] or None, expert ids [L, B*T, k] or None). Remat applies to the body: the backward keeps what
        the policy saves of each iteration and recomputes the rest."""
        b, t = positions.shape
        graphdef, state = nnx.split(self.layers)
        replay = None
        if expert_ids is not None:  # [B, T, L, k] -> [L, B*T, k]
            replay = jnp.moveaxis(expert_ids, 2, 0).reshape(self.cfg.num_layers, b * t, -1)

        def body(h, layer, ids):
            block = nnx.merge(graphdef, layer_stack.without_layer_axis(layer))
            h, _, logits, used = block(h, positions, mask, None, ids)
            return h, (logits, used)

        if self.cfg.remat_policy != "none":  # prevent_cse is not needed inside a scan (jax.checkpoint's docs)
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat_policy], prevent_cse=False)
        x, (router_logits, used_ids) = jax.lax.scan(lambda h, xs: body(h, *xs), x, (state, replay))
        return x, router_logits, used_ids

    def head(self, x: jax.Array) -> jax.Array:
        """Final-normed hidden states [B, T, E] -> logits [B, T, V] float32 (tied embedding or ``lm_head``)."""
        if self.cfg.tie_embeddings:
            return self.embedder.decode(x)
        return self.lm_head("bte,ev->btv", x, preferred_element_type=jnp.float32).astype(jnp.float32)

    def linear_head(self) -> LinearHead:
        """``head`` as its weight in the compute dtype (the tied table [V, E], or ``lm_head`` [E, V]), for
        ``logprobs.target_logprobs``' own backward. The same logits as ``head``."""
        dtype = self.cfg.compute_dtype
        if self.cfg.tie_embeddings:
            return LinearHead(self.embedder.table[...].astype(dtype), vocab_major=True)
        return LinearHead(self.lm_head.w[...].astype(dtype), vocab_major=False)
