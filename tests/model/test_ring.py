"""Tests for gyre_jax/model/ring.py: context parallelism over 2, 4 and 8 devices equals one device.

Attention level: ``ring_attention`` on the zigzag layout (permuted back) against single-device
``blockwise_attention``, outputs and q/k/v gradients, over packed rows holding a real branching prefix tree
(``trajectory.tree``), plain causal segments and padding. Learner level: a ``GradWorker`` micro-step with
``model.context_parallel = n`` (mesh with a ``context`` axis: 2 devices, and 4 x data 2 = 8 devices) against
the same micro-step on one device: loss, per-token log-probs of the forward and every parameter gradient
within 1e-5 (fp32). The tree chunk (60 tokens) is longer than one shard's share of the 96-token row (48 or
24), so the branch spans context shards, with the short sequences packed densely beside it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from layouts import EIGHT_DEVICES

from gyre_jax.config import load_config
from gyre_jax.model.blockwise import blockwise_attention, tree_mask_spec
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.ring import (
    from_zigzag,
    ring_attention,
    spec_to_zigzag,
    to_zigzag,
    zigzag_permutation,
)
from gyre_jax.model.sharding import abstract_model, init_params, make_mesh
from gyre_jax.rl.micro_step import GradWorker, token_logprobs
from gyre_jax.trajectory.batch import MicroBatch, empty_micro_batch
from gyre_jax.trajectory.branches import Branch
from gyre_jax.trajectory.select import select
from gyre_jax.trajectory.tree import tree_chunks

H, K, D = 4, 2, 16


def _branch(tokens: list[int]) -> Branch:
    n = len(tokens)
    return Branch("ex", "main", "main", list(tokens), [True] * n, [-0.5] * n, [1.0] * n, [0] * n)


def tree_chunk(rng: np.random.Generator):
    """A real branching prefix tree (shared prompt, a main line forking twice, a side branch) laid out by
    trajectory.tree in one chunk of 60 nodes."""
    tok = lambda n: list(rng.integers(10, 250, size=n))  # noqa: E731
    prompt, main = tok(10), tok(12)
    branches = [
        _branch(prompt + main + tok(10)),
        _branch(prompt + main + tok(8)),
        _branch(prompt + main[:5] + tok(6)),
        _branch(prompt + tok(7)),
    ]
    (chunk,) = tree_chunks(select("ex", branches, None), 128, 8)
    assert len(set(chunk.subtree_end.tolist())) > 2, "the layout must branch"
    return chunk


def packed_micro_batch(t: int, rng: np.random.Generator) -> MicroBatch:
    """[2, t] rows: row 0 = a real prefix tree + a plain sequence + padding; row 1 = two plain sequences +
    padding. Every token trainable (loss weights from the tree chunk's loss mask), random advantages."""
    mb = empty_micro_batch(2, t, 8)
    chunk = tree_chunk(rng)
    n = chunk.size
    row1 = [(rng.integers(10, 250, size=30), 1), (rng.integers(10, 250, size=25), 2)]
    lo = 0
    sl = slice(0, n)
    mb.tokens[0, sl], mb.targets[0, sl], mb.positions[0, sl] = chunk.tokens, chunk.targets, chunk.positions
    mb.segment_ids[0, sl], mb.subtree_end[0, sl], mb.loss_mask[0, sl] = 1, chunk.subtree_end, chunk.loss_mask
    mb.seq_index[0, sl] = chunk.seq
    extra = rng.integers(10, 250, size=21)
    mb.tokens[0, n : n + 20], mb.targets[0, n : n + 20], mb.positions[0, n : n + 20] = extra[:-1], extra[1:], range(20)
    mb.segment_ids[0, n : n + 20], mb.subtree_end[0, n : n + 20], mb.loss_mask[0, n : n + 20] = 2, n + 20, 1.0
    mb.seq_index[0, n : n + 20] = 4
    for s, (toks, seg) in enumerate(row1):
        m = len(toks) - 1
        mb.tokens[1, lo : lo + m], mb.targets[1, lo : lo + m], mb.positions[1, lo : lo + m] = (
            toks[:-1],
            toks[1:],
            range(m),
        )
        mb.segment_ids[1, lo : lo + m], mb.subtree_end[1, lo : lo + m], mb.loss_mask[1, lo : lo + m] = seg, lo + m, 1.0
        mb.seq_index[1, lo : lo + m] = 5 + s
        lo += m
    mb.old_logprobs[:] = -5.5
    mb.advantages[:] = rng.normal(size=8).astype(np.float32)
    mb.seq_weights[:] = 1.0 / 7
    return mb


def rand(rng, shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


@pytest.fixture(scope="module")
def attention_case():
    rng = np.random.default_rng(0)
    mb = packed_micro_batch(96, rng)
    spec = tree_mask_spec(mb.segment_ids, mb.subtree_end)
    q, k, v = rand(rng, (2, 96, H, D)), rand(rng, (2, 96, K, D)), rand(rng, (2, 96, K, D))
    weight = jnp.asarray(mb.segment_ids != 0, jnp.float32)[..., None, None]  # real query rows
    dout = rand(rng, (2, 96, H, D)) * weight

    def loss(out):
        return jnp.sum(out * dout)

    ref = jax.jit(
        jax.value_and_grad(lambda q, k, v: loss(blockwise_attention(q, k, v, spec, block_q=16, block_k=16)), (0, 1, 2))
    )
    return (q, k, v), spec, loss, ref(q, k, v)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_attention_equals_one_device(attention_case, n):
    (q, k, v), spec, loss, (ref_loss, ref_grads) = attention_case
    mesh = Mesh(np.asarray(jax.devices()[:n]), ("context",))
    perm = zigzag_permutation(96, n)

    def ring_loss(q, k, v):
        z = lambda x: to_zigzag(x, perm)  # noqa: E731
        out = ring_attention(z(q), z(k), z(v), spec_to_zigzag(spec, perm), mesh=mesh, block_q=8, block_k=8)
        return loss(from_zigzag(out, perm))

    got_loss, got_grads = jax.jit(jax.value_and_grad(ring_loss, (0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-5)
    for got, want, name in zip(got_grads, ref_grads, "qkv"):
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * scale, err_msg=f"d{name}")


def test_zigzag_layout_balances_causal_work():
    perm = zigzag_permutation(16, 2)
    assert perm.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    # causal (query, key) pairs each shard's queries own: equal under zigzag, 1:3 under a contiguous split
    for n in (2, 4, 8):
        owned = zigzag_permutation(64, n).reshape(n, -1)
        pairs = [int(np.sum(shard + 1)) for shard in owned]
        assert len(set(pairs)) == 1
    x = jnp.arange(32).reshape(2, 16)
    assert (from_zigzag(to_zigzag(x, perm), perm) == x).all()
    with pytest.raises(ValueError, match="multiple of 8"):
        zigzag_permutation(20, 4)


def test_ring_attention_without_a_context_mesh_says_what_to_do():
    q, k = jnp.zeros((1, 8, H, D)), jnp.zeros((1, 8, K, D))
    spec = tree_mask_spec(np.ones((1, 8), np.int32), np.full((1, 8), 8, np.int32))
    with pytest.raises(ValueError, match="needs a mesh with a 'context' axis"):
        ring_attention(q, k, k, spec)
    with pytest.raises(ValueError, match="one length divisible by 3"):
        ring_attention(q, k, k, spec, mesh=Mesh(np.asarray(jax.devices()[:3]), ("context",)))


BASE = ModelConfig(
    vocab_size=256, num_layers=1, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
    rope_theta=10000.0, attention_impl="blockwise", attention_block_q=8, attention_block_k=8,
)  # fmt: skip


def flat(tree):
    leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(tree))
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


@pytest.fixture(scope="module")
def learner_case():
    rules = load_config([]).sharding_rules
    mesh = make_mesh(jax.devices()[:1], {})
    graphdef, params = init_params(BASE, mesh, rules, seed=0)
    mb = packed_micro_batch(96, np.random.default_rng(1))
    grads, aux = GradWorker(BASE, graphdef, mesh, rules).micro_step(params, mb)
    logp = jax.jit(lambda p, b: token_logprobs(graphdef, p, b))(params, mb)
    return rules, jax.device_get(params), mb, (float(aux["loss"]), flat(grads), np.asarray(logp))


@pytest.mark.parametrize("shape", [{"context": 2}, {"data": 2, "context": 4}])
def test_context_parallel_micro_step_equals_one_device(learner_case, shape):
    """Loss, forward log-probs and every parameter gradient of a micro-step with model.context_parallel =
    the mesh's context axis (rows over 'data' where it is there) equal the single-device micro-step."""
    rules, params, mb, (want_loss, want_grads, want_logp) = learner_case
    n = shape["context"]
    cfg = dataclasses.replace(BASE, context_parallel=n)
    mesh = make_mesh(jax.devices()[: n * shape.get("data", 1)], shape)
    graphdef, _ = abstract_model(cfg)
    worker = GradWorker(cfg, graphdef, mesh, rules)
    on_mesh = worker.snapshot(params)
    grads, aux = worker.micro_step(on_mesh, mb)
    assert float(aux["loss"]) == pytest.approx(want_loss, rel=1e-5)
    got = flat(grads)
    for name, want in want_grads.items():
        np.testing.assert_allclose(got[name], want, atol=1e-5 * float(np.abs(want).max()), err_msg=name)
    with jax.set_mesh(mesh):
        logp = jax.jit(lambda p, b: token_logprobs(graphdef, p, b))(on_mesh, worker.put_batch(mb))
    real = mb.segment_ids != 0
    np.testing.assert_allclose(np.asarray(logp)[real], want_logp[real], rtol=1e-5, atol=1e-5)


def test_context_parallel_config_is_checked():
    with pytest.raises(ValueError, match="needs attention_impl='blockwise'"):
        dataclasses.replace(BASE, attention_impl="xla", context_parallel=2)
    with pytest.raises(ValueError, match="context_parallel=0 must be >= 1"):
        dataclasses.replace(BASE, context_parallel=0)
    cfg = dataclasses.replace(BASE, context_parallel=2)
    graphdef, _ = abstract_model(cfg)
    mesh = make_mesh(jax.devices()[:2], {"data": 2})
    with pytest.raises(ValueError, match="'context' axis of 2 devices"):
        GradWorker(cfg, graphdef, mesh, load_config([]).sharding_rules)


def test_run_config_carves_the_context_axis_out_of_data():
    from gyre_jax.config import ConfigError

    cp = [*EIGHT_DEVICES, "--config.model.attention_impl=blockwise", "--config.model.context_parallel=2"]
    c = load_config(cp)
    assert c.mesh.shape(c.model.context_parallel) == {"data": c.mesh.data // 2, "fsdp": 2, "tensor": 1, "context": 2}
    assert c.cells.shape(2)["context"] == 2 and c.mesh.shape() == {"data": c.mesh.data, "fsdp": 2, "tensor": 1}
    mesh = make_mesh(jax.devices()[: c.mesh.num_devices], c.mesh.shape(2))
    assert mesh.axis_names[-1] == "context" and mesh.shape["context"] == 2  # neighbouring devices
    with pytest.raises(ConfigError, match=r"context_parallel=8 must divide config.mesh.data=4"):
        load_config([*EIGHT_DEVICES, "--config.model.attention_impl=blockwise", "--config.model.context_parallel=8"])
    with pytest.raises(ConfigError, match=r"row_length=1030 must be a multiple of 2 x model.context_parallel = 4"):
        load_config(cp + ["--config.trajectory.row_length=1030", "--config.trajectory.tokens_per_micro_batch=2060"])
    with pytest.raises(ConfigError, match="needs attention_impl='blockwise'"):
        load_config([*EIGHT_DEVICES, "--config.model.attention_impl=xla", "--config.model.context_parallel=2"])
    # left to derive ("auto"), the kernel follows the context split
    assert load_config([*EIGHT_DEVICES, "--config.model.context_parallel=2"]).model.attention_impl == "blockwise"
