"""Qwen3-MoE sparse block: a softmax top-k router over stacked SwiGLU experts, and the load-balancing loss.

Math as in transformers' ``Qwen3MoeSparseMoeBlock``: router logits ``x @ W_r`` -> softmax (float32) ->
top-k -> optionally renormalized to sum to 1 (``norm_topk_prob``) -> each chosen expert's
``down(silu(gate(x)) * up(x))`` weighted and summed. Two exact implementations:

- ``ragged`` (default): the N*k (token, expert) pairs are sorted by expert and run through
  ``jax.lax.ragged_dot`` (grouped matmul), so FLOPs scale with k, not with the number of experts.
- ``dense``: every expert runs on every token and a [N, X] combine matrix that is zero off the top-k
  selects; X/k times the FLOPs, but plain einsums that GSPMD splits over an ``expert`` mesh axis.

Expert weights are ``[X, E, M]`` / ``[X, M, E]`` with logical axes ``exp``, ``embed``, ``mlp``. With ``experts`` among
``cfg.lora.targets`` each of the three carries a LoRA adapter per expert (``<proj>_lora``: A ``[X, in, r]``, B
``[X, r, out]``), applied beside the expert's weight in both implementations.

Routing replay (R3, docs/learner.md ``rl.routing_replay``): ``MoEBlock(x, replay_ids)`` uses given expert
ids (the ones the serving engine selected) instead of its own top-k for every token whose row of ids is
not -1; the gates are recomputed from this forward's router logits at those ids (``replay_route``), so the
router still gets gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gyre_jax.model.config import ModelConfig
from gyre_jax.model.lora import LoraAdapter

Lora = tuple[jax.Array, jax.Array, float] | None  # an expert projection's adapter: (A [X, in, r], B [X, r, out], scale)


def route(router_logits: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """router_logits: [N, X] -> (weights [N, k] float32, expert ids [N, k] int32), highest probability first."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def replay_route(router_logits: jax.Array, ids: jax.Array, norm_topk_prob: bool) -> jax.Array:
    """router_logits: [N, X]; ids: [N, k] int (each in [0, X)) -> weights [N, k] float32: the router's
    softmax probabilities at the given experts (renormalized to sum to 1 with ``norm_topk_prob``), the gates
    ``route`` would give if its top-k had chosen ``ids``."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights = jnp.take_along_axis(probs, ids.astype(jnp.int32), axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights


def choose_route(
    router_logits: jax.Array, k: int, norm_topk_prob: bool, replay_ids: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """``route``, except that tokens with replayed ids use them: replay_ids [N, k] int (a row of -1 = this
    token has none: its own top-k) or None. Returns (weights [N, k] float32, ids [N, k] int32)."""
    weights, ids = route(router_logits, k, norm_topk_prob)
    if replay_ids is None:
        return weights, ids
    given = replay_ids.astype(jnp.int32)
    use = given[:, :1] >= 0  # [N, 1]
    ids = jnp.where(use, given, ids)
    return jnp.where(use, replay_route(router_logits, ids, norm_topk_prob), weights), ids


def load_balancing_loss(router_logits: jax.Array, k: int, token_mask: jax.Array | None = None) -> jax.Array:
    """Switch-Transformer auxiliary loss over all MoE layers pooled, exactly as transformers computes it.

    router_logits: [L, N, X] (L MoE layers, N tokens); token_mask: [N] (1 = real token, 0 = padding) or None.
    Returns ``X * sum_x f_x * P_x`` where f_x is the fraction of (token, top-k slot) assignments that go
    to expert x and P_x the mean router probability of x, both pooled over layers and real tokens
    (a float32 scalar; 1.0 for a perfectly uniform router). The model does not multiply by
    ``router_aux_loss_coef``; the caller does.
    """
    num_experts = router_logits.shape[-1]
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [L, N, X]
    _, ids = jax.lax.top_k(probs, k)  # [L, N, k]
    counts = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32), axis=2)  # [L, N, X]
    if token_mask is None:
        token_mask = jnp.ones(router_logits.shape[1], jnp.float32)
    w = token_mask.astype(jnp.float32)[None, :, None]  # [1, N, 1]
    rows = jnp.maximum(jnp.sum(w) * router_logits.shape[0], 1.0)
    tokens_per_expert = jnp.sum(counts * w, axis=(0, 1)) / rows  # [X]
    prob_per_expert = jnp.sum(probs * w, axis=(0, 1)) / rows  # [X]
    return jnp.sum(tokens_per_expert * prob_per_expert) * num_experts


def _ragged_experts(
    x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate, w_up, w_down, lora: tuple[Lora, Lora, Lora] = (None,) * 3
) -> jax.Array:
    """x: [N, E]; weights, ids: [N, k]; w_gate, w_up: [X, E, M]; w_down: [X, M, E]; ``lora``: each projection's
    adapter or None -> [N, E]."""
    n, k = ids.shape
    num_experts = w_gate.shape[0]
    flat_ids = ids.reshape(-1)  # [N*k]
    order = jnp.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    token_of = order // k  # [N*k]
    xs = jnp.take(x, token_of, axis=0)  # [N*k, E]
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)  # [X]

    def proj(v, w, adapter: Lora):  # v: [N*k, in] grouped by expert -> [N*k, out]
        y = jax.lax.ragged_dot(v, w, group_sizes)
        if adapter is not None:
            a, b, scale = adapter
            y = y + jax.lax.ragged_dot(
                jax.lax.ragged_dot(v, a, group_sizes) * jnp.asarray(scale, v.dtype), b, group_sizes
            )
        return y

    h = jax.nn.silu(proj(xs, w_gate, lora[0])) * proj(xs, w_up, lora[1])  # [N*k, M]
    ys = proj(h, w_down, lora[2])  # [N*k, E]
    ys = ys * jnp.take(weights.reshape(-1), order)[:, None].astype(ys.dtype)
    return jnp.zeros_like(x).at[token_of].add(ys)


def _dense_experts(
    x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate, w_up, w_down, lora: tuple[Lora, Lora, Lora] = (None,) * 3
) -> jax.Array:
    """Same contract as ``_ragged_experts``; runs all X experts on all N tokens."""
    num_experts = w_gate.shape[0]
    combine = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32) * weights[..., None], axis=1)  # [N, X]

    def up(w, adapter: Lora):  # x: [N, E] -> [N, X, M]
        y = jnp.einsum("ne,xem->nxm", x, w)
        if adapter is not None:
            a, b, scale = adapter
            y = y + jnp.einsum("nxr,xrm->nxm", jnp.einsum("ne,xer->nxr", x, a) * jnp.asarray(scale, x.dtype), b)
        return y

    h = jax.nn.silu(up(w_gate, lora[0])) * up(w_up, lora[1])  # [N, X, M]
    ys = jnp.einsum("nxm,xme->nxe", h, w_down)  # [N, X, E]
    if lora[2] is not None:
        a, b, scale = lora[2]
        ys = ys + jnp.einsum("nxr,xre->nxe", jnp.einsum("nxm,xmr->nxr", h, a) * jnp.asarray(scale, h.dtype), b)
    return jnp.einsum("nxe,nx->ne", ys, combine.astype(ys.dtype))


class MoEBlock(nnx.Module):
    """Router ``[E, X]`` + X stacked SwiGLU experts; ``__call__`` returns (output, router logits, expert ids)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, x, m, pd = cfg.embed_dim, cfg.num_experts, cfg.moe_mlp_dim, cfg.weight_dtype
        self.cfg = cfg
        normal = nnx.initializers.normal
        self.router = nnx.Param(
            nnx.with_partitioning(normal(stddev=e**-0.5), ("embed", None))(rngs.params(), (e, x), pd)
        )
        self.gate_proj = nnx.Param(
            nnx.with_partitioning(normal(stddev=e**-0.5), ("exp", "embed", "mlp"))(rngs.params(), (x, e, m), pd)
        )
        self.up_proj = nnx.Param(
            nnx.with_partitioning(normal(stddev=e**-0.5), ("exp", "embed", "mlp"))(rngs.params(), (x, e, m), pd)
        )
        self.down_proj = nnx.Param(
            nnx.with_partitioning(normal(stddev=m**-0.5), ("exp", "mlp", "embed"))(rngs.params(), (x, m, e), pd)
        )
        if cfg.lora.adapts("experts"):  # an adapter per expert of each projection (batch dim: the expert)
            lo = dict(in_dims=1, rank=cfg.lora.rank, scale=cfg.lora.scale, batch_dims=1, param_dtype=pd)
            self.gate_proj_lora = LoraAdapter((x, e, m), ("exp", "embed", "mlp"), **lo)
            self.up_proj_lora = LoraAdapter((x, e, m), ("exp", "embed", "mlp"), **lo)
            self.down_proj_lora = LoraAdapter((x, m, e), ("exp", "mlp", "embed"), **lo)

    def __call__(self, x: jax.Array, replay_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [B, T, E]; replay_ids: [B*T, k] int (a row of -1: route that token itself) or None ->
        (out [B, T, E], router logits [B*T, X] in x's dtype, expert ids used [B*T, k] int32)."""
        b, t, e = x.shape
        flat = x.reshape(b * t, e)
        dtype = x.dtype
        router_logits = flat @ self.router[...].astype(dtype)  # [N, X]
        cfg = self.cfg
        weights, ids = choose_route(router_logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, replay_ids)
        weights = weights.astype(dtype)  # HF casts the top-k weights back to the hidden dtype
        experts = _ragged_experts if self.cfg.moe_impl == "ragged" else _dense_experts
        lora = (None,) * 3
        if hasattr(self, "gate_proj_lora"):
            adapters = (self.gate_proj_lora, self.up_proj_lora, self.down_proj_lora)
            lora = tuple((a.a[...].astype(dtype), a.b[...].astype(dtype), a.scale) for a in adapters)
        out = experts(
            flat,
            weights,
            ids,
            self.gate_proj[...].astype(dtype),
            self.up_proj[...].astype(dtype),
            self.down_proj[...].astype(dtype),
            lora,
        )
        return out.reshape(b, t, e), router_logits, ids
