"""Qwen3-MoE routing: top-k weights, the two exact expert implementations, the load-balancing loss, gradients."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gyre_jax.model.attention import segment_causal_mask
from gyre_jax.model.config import TINY_MOE, ModelConfig
from gyre_jax.model.modules import Transformer
from gyre_jax.model.moe import _dense_experts, _ragged_experts, load_balancing_loss, route
from gyre_jax.model.sharding import abstract_model

CFG = dataclasses.replace(TINY_MOE, num_layers=2, embed_dim=32, head_dim=8, mlp_dim=48, moe_mlp_dim=16, vocab_size=64)


def test_route_picks_the_top_k_probabilities_and_renormalizes() -> None:
    logits = jnp.asarray([[0.0, 2.0, 1.0, -1.0], [3.0, 3.0, 0.0, 0.0]])
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    w, ids = route(logits, 2, norm_topk_prob=False)
    np.testing.assert_array_equal(np.asarray(ids[0]), [1, 2])
    np.testing.assert_allclose(np.asarray(w[0]), probs[0, [1, 2]], rtol=1e-6)
    w_norm, ids_norm = route(logits, 2, norm_topk_prob=True)
    np.testing.assert_array_equal(np.asarray(ids_norm), np.asarray(ids))
    np.testing.assert_allclose(np.asarray(w_norm).sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(w_norm[0]), probs[0, [1, 2]] / probs[0, [1, 2]].sum(), rtol=1e-6)
    assert set(np.asarray(ids[1]).tolist()) == {0, 1}  # a tie: both tied experts are chosen


def _reference_experts(x, weights, ids, w_gate, w_up, w_down):
    """Token by token, expert by expert (the definition)."""
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            j = ids[n, slot]
            h = x[n] @ w_gate[j]
            h = h / (1 + np.exp(-h)) * (x[n] @ w_up[j])
            out[n] += weights[n, slot] * (h @ w_down[j])
    return out


@pytest.mark.parametrize("impl", [_ragged_experts, _dense_experts])
def test_expert_implementations_match_the_definition(impl) -> None:
    rng = np.random.default_rng(0)
    n, e, m, x_, k = 13, 6, 5, 4, 2
    x = rng.normal(size=(n, e)).astype(np.float32)
    w_gate, w_up = rng.normal(size=(2, x_, e, m)).astype(np.float32)
    w_down = rng.normal(size=(x_, m, e)).astype(np.float32)
    weights, ids = route(jnp.asarray(rng.normal(size=(n, x_)), jnp.float32), k, True)
    ids = np.array(ids)
    ids[:5] = [[3, 1]] * 5  # expert 0 and 2 get few tokens, 3 many; unbalanced groups
    got = impl(jnp.asarray(x), weights, jnp.asarray(ids), jnp.asarray(w_gate), jnp.asarray(w_up), jnp.asarray(w_down))
    want = _reference_experts(x, np.asarray(weights), ids, w_gate, w_up, w_down)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_load_balancing_loss_is_one_for_a_uniform_router_and_ignores_padding() -> None:
    x_, k = 8, 2
    uniform = jnp.zeros((3, 10, x_))
    assert float(load_balancing_loss(uniform, k)) == pytest.approx(k * 1.0)  # f sums to k, P = 1/X each -> k
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 12, x_)) * 3, jnp.float32)
    mask = jnp.asarray([1] * 8 + [0] * 4, jnp.float32)
    garbage = logits.at[:, 8:].set(50.0 * jnp.arange(x_))  # padding rows routed anywhere: must not matter
    np.testing.assert_allclose(
        float(load_balancing_loss(garbage, k, mask)), float(load_balancing_loss(logits[:, :8], k)), rtol=1e-6
    )
    # a router that sends every token to the same experts is penalized
    collapsed = jnp.zeros((1, 10, x_)).at[..., :2].set(10.0)
    assert float(load_balancing_loss(collapsed, k)) > 3.9 * float(load_balancing_loss(uniform, k))


@pytest.fixture(scope="module")
def split():
    with nnx.use_eager_sharding(False):
        return nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))


def _loss(graphdef, params, tokens, segs, coef):
    b, t = tokens.shape
    logits, _, aux = nnx.merge(graphdef, params)(
        tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), segment_causal_mask(segs), return_aux=True
    )
    nll = -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
    return nll + coef * aux.load_balancing_loss


def test_gradients_of_both_implementations_agree_and_reach_router_and_experts(split) -> None:
    _, params = split
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(2, 12)), jnp.int32)
    segs = jnp.asarray([[1] * 12, [1] * 9 + [0] * 3], jnp.int32)
    grad = jax.jit(jax.grad(_loss, argnums=1), static_argnums=(0,))
    ragged, _ = abstract_model(dataclasses.replace(CFG, moe_impl="ragged"))
    dense, _ = abstract_model(dataclasses.replace(CFG, moe_impl="dense"))
    g = grad(ragged, params, tokens, segs, 0.1)
    for a, b in zip(jax.tree.leaves(grad(dense, params, tokens, segs, 0.1)), jax.tree.leaves(g), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    moe = g["layers"][0]["moe"]
    assert float(jnp.abs(moe["router"][...]).sum()) > 0 and float(jnp.abs(moe["gate_proj"][...]).sum()) > 0
    # the aux loss term has its own gradient on the router
    g0 = grad(ragged, params, tokens, segs, 0.0)
    assert float(jnp.abs(g["layers"][0]["moe"]["router"][...] - g0["layers"][0]["moe"]["router"][...]).max()) > 0


def test_moe_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be in \\[1, num_experts=8\\]"):
        dataclasses.replace(TINY_MOE, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="moe_impl='fast' must be one of"):
        dataclasses.replace(TINY_MOE, moe_impl="fast")
    with pytest.raises(ValueError, match="mlp_only_layers=\\(5,\\) has layers outside"):
        dataclasses.replace(TINY_MOE, mlp_only_layers=(5,))
    assert ModelConfig.from_config_dict(dict(vars(TINY_MOE), checkpoint_dir="/x")) == TINY_MOE
