"""Tests for gyre_jax/rl/micro_step.py: a GradWorker on its own submesh, and the MoE load-balancing term."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from gyre_jax.config import load_config
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import abstract_model, init_params, make_mesh
from gyre_jax.rl.micro_step import GradWorker
from gyre_jax.trajectory.batch import make_micro_batches, replace
from gyre_jax.trajectory.branches import Branch

DENSE = ModelConfig(
    vocab_size=272, num_layers=2, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, rope_theta=10000.0
)
MOE = dataclasses.replace(DENSE, num_experts=4, num_experts_per_tok=2, moe_mlp_dim=16, router_aux_loss_coef=0.01)


def micro_batch(advantages):
    rng = np.random.default_rng(0)
    branches = []
    for i in range(2):
        b = Branch(execution_id=f"e{i}", thread_id="main", label="main")
        b._append(rng.integers(0, 256, 5).tolist(), trainable=False)
        b._append(rng.integers(0, 256, 9).tolist(), trainable=True, logprobs=[-5.6] * 9, versions=[0] * 9)
        branches.append(b)
    return make_micro_batches(branches, list(advantages), [0.5, 0.5], 2, multiple=16)[0]


def flat(tree):
    return {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))
    }


def test_moe_load_balancing_term_trains_the_router_with_its_share_of_the_step():
    mesh = make_mesh(jax.devices()[:2], dict(data=2))
    rules = load_config([]).sharding_rules
    graphdef, params = init_params(MOE, mesh, rules, seed=0)
    worker = GradWorker(MOE, graphdef, mesh, rules)
    assert worker.moe_coef == pytest.approx(0.01)
    # Zero advantages: no policy gradient, so every gradient comes from the load-balancing term.
    grads, aux = worker.micro_step(params, micro_batch([0.0, 0.0]))
    g = flat(grads)
    router = [k for k in g if "router" in k]
    assert router and all(np.abs(g[k]).max() > 0 for k in router)
    assert float(aux["load_balancing_loss"]) > 0.5  # about 1 for a near-uniform router, x share 1.0
    assert float(aux["loss"]) == pytest.approx(0.01 * float(aux["load_balancing_loss"]), rel=1e-5)
    # Half the step's weight in this micro-batch: half the term (micro-steps still add up to the step).
    mb = micro_batch([0.0, 0.0])
    half, aux_half = worker.micro_step(params, replace(mb, seq_weights=mb.seq_weights * 0.5))
    assert float(aux_half["load_balancing_loss"]) == pytest.approx(0.5 * float(aux["load_balancing_loss"]), rel=1e-5)
    for k in router:
        np.testing.assert_allclose(flat(half)[k], 0.5 * g[k], rtol=1e-4, atol=1e-9)
    # A dense model has no such term; an unknown kind is refused before any work.
    dense_graphdef, _ = abstract_model(DENSE)
    assert GradWorker(DENSE, dense_graphdef, mesh, rules).moe_coef == 0.0
    with pytest.raises(ValueError, match="kind 'ppo' must be one of"):
        worker.micro_step(params, mb, kind="ppo")


def test_blockwise_attention_micro_step_equals_the_dense_one():
    """attention_impl='blockwise' (MaskSpec from the packed rows, 8-token blocks) gives the xla micro-step's loss,
    gradients and grad norm on the same params and micro-batch (rows split over 2 devices)."""
    mesh = make_mesh(jax.devices()[:2], dict(data=2))
    rules = load_config([]).sharding_rules
    graphdef, params = init_params(DENSE, mesh, rules, seed=0)
    blockwise = dataclasses.replace(DENSE, attention_impl="blockwise", attention_block_q=8, attention_block_k=8)
    mb = micro_batch([1.0, -0.5])
    assert mb.tokens.shape[1] > 8 and (mb.segment_ids == 0).any()  # several blocks, and padding
    results = []
    for cfg in (DENSE, blockwise):
        cfg_graphdef, _ = abstract_model(cfg)
        grads, aux = GradWorker(cfg, cfg_graphdef, mesh, rules).micro_step(params, mb)
        results.append((float(aux["loss"]), flat(grads)))
    (loss_xla, g_xla), (loss_bw, g_bw) = results
    assert loss_xla != 0.0
    assert loss_bw == pytest.approx(loss_xla, rel=1e-5)
    norm = lambda g: float(np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in g.values())))  # noqa: E731
    assert norm(g_xla) > 0 and norm(g_bw) == pytest.approx(norm(g_xla), rel=1e-5)
    for k in g_xla:
        np.testing.assert_allclose(g_bw[k], g_xla[k], atol=1e-5 * np.abs(g_xla[k]).max() + 1e-9, rtol=0, err_msg=k)
