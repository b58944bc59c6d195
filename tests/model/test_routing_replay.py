"""Routing replay in the model: given expert ids replace a MoE layer's top-k, gates come from its router."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gyre_jax.model.attention import segment_causal_mask
from gyre_jax.model.config import TINY, TINY_MOE
from gyre_jax.model.modules import Transformer
from gyre_jax.model.moe import choose_route, replay_route, route

CFG = dataclasses.replace(
    TINY_MOE, num_layers=2, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=48, moe_mlp_dim=16,
    vocab_size=64,
)  # fmt: skip


def test_replay_route_gives_the_gates_route_gives_for_its_own_choice_and_honours_given_ids() -> None:
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(5, 6)), jnp.float32)
    for norm in (False, True):
        w, ids = route(logits, 2, norm)
        np.testing.assert_allclose(np.asarray(replay_route(logits, ids, norm)), np.asarray(w), rtol=1e-6)
    given = np.array([[4, 0], [-1, -1], [5, 1], [-1, -1], [2, 3]], np.int32)
    w, ids = choose_route(logits, 2, True, jnp.asarray(given))
    own_w, own_ids = route(logits, 2, True)
    probs = np.asarray(jax.nn.softmax(logits, -1))
    for n in range(5):
        if given[n, 0] < 0:  # no replayed ids: its own top-k, unchanged
            np.testing.assert_array_equal(np.asarray(ids[n]), np.asarray(own_ids[n]))
            np.testing.assert_allclose(np.asarray(w[n]), np.asarray(own_w[n]), rtol=1e-6)
        else:  # the given experts, gated by the router's renormalized probabilities at them
            np.testing.assert_array_equal(np.asarray(ids[n]), given[n])
            want = probs[n, given[n]] / probs[n, given[n]].sum()
            np.testing.assert_allclose(np.asarray(w[n]), want, rtol=1e-6)


def _build(cfg):
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, rngs=nnx.Rngs(0))


B, T = 2, 7
TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, 64, (B, T)), jnp.int32)
POSITIONS = jnp.tile(jnp.arange(T, dtype=jnp.int32), (B, 1))
MASK = segment_causal_mask(jnp.ones((B, T), jnp.int32))
SHAPE = (B, T, CFG.num_moe_layers, CFG.num_experts_per_tok)


@jax.jit
def _forward(params, expert_ids):
    """(logits [B, T, V], expert ids used [B, T, L, K]); one compile for every call (a -1 row routes itself)."""
    logits, _, aux = nnx.merge(GRAPHDEF, params)(TOKENS, POSITIONS, MASK, return_aux=True, expert_ids=expert_ids)
    return logits, jnp.transpose(aux.expert_ids.reshape(CFG.num_moe_layers, B, T, -1), (1, 2, 0, 3))


GRAPHDEF, PARAMS = nnx.split(_build(CFG))


def test_replaying_the_models_own_choice_is_exact_and_other_ids_change_the_output() -> None:
    logits, own = _forward(PARAMS, jnp.full(SHAPE, -1, jnp.int16))  # nothing replayed: the model's own routing
    same, used_same = _forward(PARAMS, own.astype(jnp.int16))
    np.testing.assert_array_equal(np.asarray(same), np.asarray(logits))
    np.testing.assert_array_equal(np.asarray(used_same), np.asarray(own))
    # force experts (0, 1) on every token of row 0; row 1 keeps routing itself (-1)
    forced = np.full(SHAPE, -1, np.int16)
    forced[0, ..., 0], forced[0, ..., 1] = 0, 1
    other, used = _forward(PARAMS, jnp.asarray(forced))
    used, own = np.asarray(used), np.asarray(own)
    assert (used[0] == [0, 1]).all() and not (own[0] == [0, 1]).all()
    np.testing.assert_array_equal(used[1], own[1])
    assert not np.allclose(np.asarray(other[0]), np.asarray(logits[0]), atol=1e-3)  # row 0 really rerouted
    np.testing.assert_allclose(np.asarray(other[1]), np.asarray(logits[1]), atol=1e-5)  # row 1 untouched


def test_gradients_reach_the_router_columns_of_the_replayed_experts_only() -> None:
    forced = np.zeros(SHAPE, np.int16)
    forced[..., 1] = 3

    @jax.jit
    def grad(p):
        return jax.grad(lambda q: jnp.mean(jax.nn.log_softmax(_forward(q, jnp.asarray(forced))[0])[..., 0]))(p)

    grads = grad(PARAMS)
    for i in range(CFG.num_layers):
        router = np.abs(np.asarray(grads["layers"][i]["moe"]["router"][...]))  # [E, X]
        # the gates are the router's renormalized probabilities at the replayed experts 0 and 3: their router
        # columns get gradient; the other experts' logits cancel in p0 / (p0 + p3) (up to rounding)
        chosen = router[:, [0, 3]].max()
        assert chosen > 1e-4
        assert router[:, [1, 2, 4, 5, 6, 7]].max() < 1e-5 * chosen


def test_expert_ids_on_a_dense_model_or_of_the_wrong_shape_are_refused() -> None:
    dense = _build(dataclasses.replace(TINY, num_layers=1, vocab_size=64))
    tokens = jnp.zeros((1, 4), jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    mask = segment_causal_mask(jnp.ones((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="MoE layers=0"):
        dense(tokens, positions, mask, expert_ids=jnp.zeros((1, 4, 1, 2), jnp.int32))
    with pytest.raises(ValueError, match="expert_ids"):
        nnx.merge(GRAPHDEF, PARAMS)(TOKENS, POSITIONS, MASK, expert_ids=jnp.zeros((B, T, 5, 2), jnp.int32))
