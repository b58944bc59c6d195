"""``ModelConfig.scan_layers``: the stacked parameter layout run as one ``lax.scan`` body computes what the
per-layer loop computes, and both layouts convert into each other (``model/layer_stack.py``).

- Training forward on packed rows (segments, a prefix tree, padding): logits and every parameter gradient
  within 1e-5 under each remat policy; ``attention_impl="blockwise"`` with its ``MaskSpec``; MoE with
  ``return_aux`` (router logits, load-balancing loss, expert ids), routing replay on and off.
- Cached decode (prefill + decode steps; the cache stays a list of per-layer ``LayerCache``).
- The same seed gives the same weights in both layouts; layouts convert both ways (params, an optax state,
  abstract shapes with shardings); a run checkpoint saved in one layout restores in the other; a Hugging Face
  checkpoint loads into either and saves the same files from either.
- Mixed dense/MoE layers are refused at config validation.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gyre_jax.checkpoint import Checkpointer, abstract_like
from gyre_jax.model import layer_stack
from gyre_jax.model.attention import cache_mask, init_cache, tree_mask
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.hf_checkpoint import load_hf_checkpoint, load_hf_params, save_hf_checkpoint
from gyre_jax.model.modules import Transformer
from gyre_jax.model.sharding import RULES_FSDP_TENSOR, abstract_model, make_mesh, param_shardings

DENSE = ModelConfig(
    vocab_size=64,
    num_layers=2,
    embed_dim=32,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    mlp_dim=64,
    rope_theta=10000.0,
)
MOE = dataclasses.replace(DENSE, num_experts=4, num_experts_per_tok=2, moe_mlp_dim=32, norm_topk_prob=True)
FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "model" / "qwen3_dense"
B, T, L = 2, 16, DENSE.num_layers


def split(cfg: ModelConfig, seed: int = 0):
    with nnx.use_eager_sharding(False):
        return nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))


def scanned(cfg: ModelConfig, **changes) -> nnx.GraphDef:
    """The graphdef of ``cfg`` with ``scan_layers`` (and ``changes``: a remat policy ...)."""
    cfg = dataclasses.replace(cfg, scan_layers=True, **changes)
    with nnx.use_eager_sharding(False):
        return nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def layouts(cfg: ModelConfig):
    """(graphdef, params) per-layer and scanned: the scanned params are the per-layer ones stacked."""
    graphdef, params = split(cfg)
    return (graphdef, params), (scanned(cfg), layer_stack.stack_layers(params))


def batch():
    """Two packed rows: two plain segments then padding; a prefix tree (a prompt, two branches) then a segment."""
    seg = np.asarray([[1] * 6 + [2] * 7 + [0] * 3, [1] * 11 + [2] * 5], np.int32)
    end = np.full((B, T), T, np.int32)
    end[1, 4:7], end[1, 7:11] = 7, 11  # row 1: prompt 0-3, branch 4-6, branch 7-10 (sees 0-3, not 4-6)
    positions = np.asarray(
        [list(range(6)) + list(range(7)) + [0] * 3, list(range(7)) + list(range(4, 8)) + list(range(5))]
    )
    tokens = np.random.default_rng(0).integers(0, DENSE.vocab_size, (B, T))
    weights = np.random.default_rng(1).normal(size=(B, T, DENSE.vocab_size)) * (seg != 0)[..., None]
    return tuple(jnp.asarray(a) for a in (tokens, positions, seg, end, weights.astype(np.float32)))


def loss_fn(graphdef, params, tokens, positions, seg, end, weights, expert_ids):
    model = nnx.merge(graphdef, params)
    logits, _, aux = model(tokens, positions, tree_mask(model.cfg, seg, end), return_aux=True, expert_ids=expert_ids)
    return jnp.sum(logits * weights) / T + aux.load_balancing_loss, (logits, aux)


# Compiled without LLVM's optimizations: the same XLA program (the same HLO passes), half the compile time on CPU.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.partial(jax.jit, static_argnums=(0,), compiler_options=FAST_COMPILE)
def loss_and_grads(graphdef, params, *inputs):
    """-> (logits [B, T, V], ModelAux, gradients of sum(logits * weights) + the load-balancing loss)."""
    (_, (logits, aux)), grads = jax.value_and_grad(lambda p: loss_fn(graphdef, p, *inputs), has_aux=True)(params)
    return logits, aux, grads


@functools.cache
def reference(cfg: ModelConfig, replay: bool):
    """The per-layer loop (no remat) on ``batch()``: (params, expert ids, (logits, aux, grads))."""
    graphdef, params = split(cfg)
    ids = replay_ids() if replay else None
    return params, ids, loss_and_grads(graphdef, params, *batch(), ids)


def replay_ids() -> jax.Array:
    """[B, T, L, k]: given experts, and rows of -1 (those tokens route themselves)."""
    rng = np.random.default_rng(2)
    ids = np.stack([rng.permutation(MOE.num_experts)[:2] for _ in range(B * T * L)]).reshape(B, T, L, 2)
    ids[:, ::3] = -1
    return jnp.asarray(ids, jnp.int32)


def assert_close(got, want, what: str, tol: float = 1e-5) -> None:
    want = np.asarray(want)
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    np.testing.assert_allclose(np.asarray(got), want, atol=tol * scale, rtol=0, err_msg=what)


def compare_with_loop(cfg: ModelConfig, remat: str, replay: bool = False):
    """The scanned model under ``remat`` vs the per-layer loop without remat (the loop under each policy equals
    it: test_model.py) on ``batch()``: logits and every gradient. Returns both (logits, aux, grads)."""
    params, ids, want = reference(cfg, replay)
    graphdef = scanned(cfg, remat_policy=remat)
    stacked = layer_stack.stack_layers(params)
    if remat != "none":  # the policy is in the scanned program
        assert "remat" in str(jax.make_jaxpr(lambda p: loss_fn(graphdef, p, *batch(), ids)[0])(stacked))
    got = loss_and_grads(graphdef, stacked, *batch(), ids)
    assert_close(got[0], want[0], "logits")
    assert float(jnp.max(jnp.abs(want[0]))) > 0.1  # not trivially equal
    grads = got[2]
    assert layer_stack.tree_is_stacked(grads) and not layer_stack.tree_is_stacked(want[2])
    grads = layer_stack.unstack_layers(grads)
    assert jax.tree.structure(grads) == jax.tree.structure(want[2])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want[2])):
        assert_close(a, b, jax.tree_util.keystr(path))
    return got, want


# -- the training forward ------------------------------------------------------------------------------


@pytest.mark.parametrize("remat", ["none", "full", "dots", "dots_no_batch"])
def test_dense_scan_equals_the_layer_loop(remat) -> None:
    got, _ = compare_with_loop(DENSE, remat)
    assert got[1].router_logits is None and float(got[1].load_balancing_loss) == 0.0


def test_blockwise_tree_mask_scan_equals_the_layer_loop() -> None:
    compare_with_loop(
        dataclasses.replace(DENSE, attention_impl="blockwise", attention_block_q=8, attention_block_k=8), "full"
    )


@pytest.mark.parametrize("remat,replay", [("none", False), ("dots", True)])
def test_moe_scan_equals_the_layer_loop(remat, replay) -> None:
    (_, aux, _), (_, want, _) = compare_with_loop(MOE, remat, replay)
    assert aux.router_logits.shape == (MOE.num_layers, B * T, MOE.num_experts)
    assert_close(aux.router_logits, want.router_logits, "router logits")
    assert_close(aux.load_balancing_loss, want.load_balancing_loss, "load-balancing loss")
    np.testing.assert_array_equal(aux.expert_ids, want.expert_ids)
    if replay:
        flat = np.moveaxis(np.asarray(replay_ids()), 2, 0).reshape(L, B * T, 2)
        replayed = flat[:, :, 0] >= 0
        np.testing.assert_array_equal(np.asarray(aux.expert_ids)[replayed], flat[replayed])


# -- cached decode ------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 4), compiler_options=FAST_COMPILE)
def cached_step(graphdef, params, tokens, positions, cache_len, cache):
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, cache_mask(model.cfg, positions, cache_len), cache)


def test_cached_prefill_and_decode_equal_the_layer_loop() -> None:
    """The cached path runs the stacked weights layer by layer (the cache is a list of per-layer arrays: scanning
    it would stack and unstack it every step); the uncached forward equals the loop above, the loop's cached
    forward equals its uncached one (test_model.py)."""
    (g0, p0), (g1, p1) = layouts(DENSE)
    tokens, s = np.random.default_rng(3).integers(0, DENSE.vocab_size, (B, 8)), 12
    positions = np.broadcast_to(np.arange(8), (B, 8))
    outs = {}
    for name, g, p in (("loop", g0, p0), ("scan", g1, p1)):
        cache, chunks = init_cache(DENSE, B, s), []
        for start, size in ((0, 5), (5, 1), (6, 1), (7, 1)):  # prefill, then three decode steps
            part = slice(start, start + size)
            logits, cache = cached_step(g, p, jnp.asarray(tokens[:, part]), jnp.asarray(positions[:, part]), s, cache)
            chunks.append(logits)
        assert isinstance(cache, list) and len(cache) == DENSE.num_layers
        assert cache[0].k.shape == (B, s, DENSE.num_kv_heads, DENSE.head_dim)
        outs[name] = (np.concatenate(chunks, axis=1), cache)
    assert_close(outs["scan"][0], outs["loop"][0], "cached logits")
    for a, b in zip(jax.tree.leaves(outs["scan"][1]), jax.tree.leaves(outs["loop"][1])):
        assert_close(a, b, "cache")


# -- configuration -------------------------------------------------------------------------------------------


def test_mixed_dense_and_moe_layers_are_refused_at_validation() -> None:
    with pytest.raises(ValueError, match="scan_layers=True: not supported yet with mixed dense/MoE layers"):
        dataclasses.replace(MOE, mlp_only_layers=(1,), scan_layers=True)
    with pytest.raises(ValueError, match="set scan_layers=False"):
        dataclasses.replace(MOE, decoder_sparse_step=2, scan_layers=True)
    dataclasses.replace(MOE, scan_layers=True)  # every layer MoE: fine
    dataclasses.replace(MOE, mlp_only_layers=(1,))  # mixed without scan: fine


# -- layouts and checkpoints ---------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_weights_and_layouts_convert_both_ways() -> None:
    (_, p0), (g1, p1) = layouts(MOE)
    _, fresh = split(dataclasses.replace(MOE, scan_layers=True))
    assert jax.tree.structure(fresh) == jax.tree.structure(p1)
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(p1)):
        np.testing.assert_array_equal(a, b)
    q = p1["layers"]["attn"]["q_proj"]["w"]
    assert q.shape == (L, 32, 2, 16) and q.get_metadata()["out_sharding"] == ("layers", "embed", "heads", "head_dim")
    back = layer_stack.unstack_layers(p1)
    assert jax.tree.structure(back) == jax.tree.structure(p0)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(p0)):
        np.testing.assert_array_equal(a, b)
    assert layer_stack.stack_layers(p1) is not p1 and layer_stack.tree_is_stacked(layer_stack.stack_layers(p1))
    with pytest.raises(ValueError, match="mixed dense/MoE"):
        layer_stack.stack_layers(split(dataclasses.replace(MOE, mlp_only_layers=(1,)))[1])


def test_stacked_params_shard_like_their_layers_with_the_layer_axis_replicated() -> None:
    mesh = make_mesh(jax.devices()[:4], dict(fsdp=2, tensor=2))
    per_layer = param_shardings(abstract_model(DENSE)[1], RULES_FSDP_TENSOR, mesh)
    stacked = param_shardings(abstract_model(dataclasses.replace(DENSE, scan_layers=True))[1], RULES_FSDP_TENSOR, mesh)
    assert jax.tree.structure(layer_stack.stack_layers(per_layer)) == jax.tree.structure(stacked)
    for (path, sh), want in zip(
        jax.tree_util.tree_leaves_with_path(stacked), jax.tree.leaves(layer_stack.stack_layers(per_layer))
    ):
        assert sh.spec == want.spec, jax.tree_util.keystr(path)
    q = stacked["layers"]["attn"]["q_proj"]["w"].get_value()
    assert q.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    back = layer_stack.unstack_layers(stacked, num_layers=L)  # shardings alone do not say how many layers
    assert [sh.spec for sh in jax.tree.leaves(back)] == [sh.spec for sh in jax.tree.leaves(per_layer)]


def test_a_run_checkpoint_saved_in_one_layout_restores_in_the_other(tmp_path) -> None:
    mesh = make_mesh(jax.devices()[:4], dict(fsdp=2, tensor=2))
    tx = optax.adamw(1e-3)
    states = {}
    _, params = split(DENSE, seed=5)
    for stacked in (False, True):
        layout = layer_stack.to_layout(params, stacked)
        layout = jax.device_put(
            layout,
            param_shardings(
                abstract_model(dataclasses.replace(DENSE, scan_layers=stacked))[1], RULES_FSDP_TENSOR, mesh
            ),
        )
        states[stacked] = {"params": layout, "opt": tx.init(layout)}  # the moments mirror the params' layout
    ckpt = Checkpointer(tmp_path / "checkpoints", max_to_keep=4)
    ckpt.save(1, states[False], {"layout": "per-layer"})
    ckpt.save(2, states[True], {"layout": "stacked"})
    for step, saved, want in ((1, False, True), (2, True, False), (1, False, False)):
        state, meta = layer_stack.restore(ckpt, step, abstract_like(states[want]))
        assert meta["layout"] == ("stacked" if saved else "per-layer")
        assert jax.tree.structure(state) == jax.tree.structure(states[want])
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(states[want])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim), jax.tree_util.keystr(path)
    ckpt.close()


def test_hugging_face_checkpoints_load_into_and_save_from_the_stacked_layout(tmp_path) -> None:
    mesh = make_mesh(jax.devices()[:1], {})
    cfg, _, per_layer = load_hf_checkpoint(FIXTURE, mesh, RULES_FSDP_TENSOR)
    scfg, _, stacked = load_hf_checkpoint(FIXTURE, mesh, RULES_FSDP_TENSOR, scan_layers=True)
    assert scfg.scan_layers and layer_stack.tree_is_stacked(stacked)
    for a, b in zip(jax.tree.leaves(layer_stack.stack_layers(per_layer)), jax.tree.leaves(stacked)):
        np.testing.assert_array_equal(a, b)
    # MoE (experts stacked inside the stacked layers): save from either layout -> the same files; load into either
    moe = dataclasses.replace(MOE, attention_bias=True, tie_embeddings=False)
    _, params = split(moe, seed=7)
    save_hf_checkpoint(tmp_path / "a", moe, params)
    save_hf_checkpoint(tmp_path / "b", dataclasses.replace(moe, scan_layers=True), layer_stack.stack_layers(params))
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    _, loaded = load_hf_params(tmp_path / "b", dataclasses.replace(moe, scan_layers=True), mesh, RULES_FSDP_TENSOR)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(layer_stack.stack_layers(params))):
        np.testing.assert_array_equal(a, b)
