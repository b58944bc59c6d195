"""``attention_impl="pallas"`` (model/pallas_attention.py, run here in the Pallas interpreter): the kernel's output
and its dq, dk, dv equal ``blockwise_attention``'s (1e-5 of each array's largest magnitude, f32) on a packed row
with a real prefix tree and padding, on a cache mask for a chunked prefill against a longer cache, and on rows
where some queries see nothing (0 output, 0 gradient); blocks no query sees are skipped (NaN keys there do not
reach anything). The Transformer with "pallas" gives blockwise's logits and parameter gradients, and cached
prefill + decode. Sizes are tiny (T <= 160, 4 heads over 2 KV heads, head dim 16, blocks 16-32) so every case
spans several query and key blocks and shapes that are not block multiples.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gyre_jax.model import pallas_attention as pallas_module
from gyre_jax.model.attention import cache_mask, init_cache, tree_causal_mask, tree_mask
from gyre_jax.model.blockwise import MaskSpec, blockwise_attention, cache_mask_spec, dense_mask, tree_mask_spec
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.modules import Transformer
from gyre_jax.model.pallas_attention import pallas_attention
from gyre_jax.trajectory.branches import Branch
from gyre_jax.trajectory.select import select
from gyre_jax.trajectory.tree import tree_chunks

B, H, K, D = 2, 4, 2, 16
BLOCKS = {"block_q": 32, "block_k": 16}
BLOCKWISE = ModelConfig(
    vocab_size=272,
    num_layers=2,
    embed_dim=64,
    num_heads=H,
    num_kv_heads=K,
    head_dim=D,
    mlp_dim=128,
    rope_theta=10000.0,
    attention_impl="blockwise",
    attention_block_q=32,
    attention_block_k=16,
)
PALLAS = dataclasses.replace(BLOCKWISE, attention_impl="pallas")


def _branch(tokens: list[int]) -> Branch:
    n = len(tokens)
    return Branch("ex", "main", "main", list(tokens), [True] * n, [-0.5] * n, [1.0] * n, [0] * n)


def packed_tree_rows(t: int):
    """tokens, positions, segment_ids, subtree_end: [2, t] (as tests/model/test_attention_impls.py builds them).
    Row 0: a branching prefix tree laid out by trajectory.tree, a plain sequence, padding; row 1: two plain
    sequences and padding."""
    rng = np.random.default_rng(0)
    tok = lambda n: list(rng.integers(0, 256, size=n))  # noqa: E731
    prompt, main = tok(12), tok(10)
    branches = [_branch(prompt + main + tok(8)), _branch(prompt + main + tok(6)), _branch(prompt + tok(9))]
    (chunk,) = tree_chunks(select("ex", branches, None), 100, 8)
    assert len(set(chunk.subtree_end.tolist())) > 2, "the layout must branch"
    n = chunk.size
    seg, end, pos = (np.zeros((2, t), np.int32) for _ in range(3))
    seg[0, :n], end[0, :n], pos[0, :n] = 1, chunk.subtree_end, chunk.positions
    seg[0, n : n + 15], end[0, n : n + 15], pos[0, n : n + 15] = 2, n + 15, np.arange(15)
    for s, (lo, length) in enumerate(((0, 40), (40, 33)), start=1):
        seg[1, lo : lo + length], end[1, lo : lo + length], pos[1, lo : lo + length] = s, lo + length, np.arange(length)
    tokens = rng.integers(0, PALLAS.vocab_size, size=(2, t)).astype(np.int32)
    tokens[0, :n] = chunk.tokens
    return tokens, pos, seg, end


def _qkv(t: int, s: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    return normal(B, t, H, D), normal(B, s, K, D), normal(B, s, K, D), normal(B, t, H, D)


@functools.partial(jax.jit, static_argnums=(0,))
def _out_and_grads(fn, q, k, v, spec, w):
    """fn's output and the gradients of sum(out * w) in q, k, v."""
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, spec, **BLOCKS), q, k, v)
    return out, *vjp(w)


def _assert_close(got, want, what: str) -> None:
    scale = float(np.max(np.abs(want)))
    assert scale > 1e-3, f"{what}: the reference is ~0, the comparison would be empty"
    np.testing.assert_allclose(np.asarray(got) / scale, np.asarray(want) / scale, atol=1e-5, rtol=0, err_msg=what)


def _compare(q, k, v, w, spec: MaskSpec):
    """Asserts pallas == blockwise (output, dq, dk, dv); returns pallas's (out, dq, dk, dv) as numpy."""
    got = _out_and_grads(pallas_attention, q, k, v, spec, w)
    want = _out_and_grads(blockwise_attention, q, k, v, spec, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        _assert_close(a, b, name)
    return [np.asarray(a) for a in got]


def test_packed_tree_row_with_padding_equals_blockwise() -> None:
    _, _, seg, end = packed_tree_rows(90)  # 90: neither block size divides it
    spec = tree_mask_spec(jnp.asarray(seg), jnp.asarray(end))
    q, k, v, w = _qkv(90, 90)
    out, *_ = _compare(q, k, v, w, spec)
    # and both are attention over the dense tree mask on the real rows (the tree matters: causal differs)
    dense = tree_causal_mask(jnp.asarray(seg), jnp.asarray(end))
    want = np.asarray(jax.nn.dot_product_attention(q, k, v, mask=dense[:, None]))
    real = seg != 0
    np.testing.assert_allclose(out[real], want[real], atol=1e-5, rtol=0)
    causal = tree_causal_mask(jnp.asarray(seg), jnp.full_like(jnp.asarray(end), 90))
    other = np.asarray(jax.nn.dot_product_attention(q, k, v, mask=causal[:, None]))
    assert np.max(np.abs(other[real] - out[real])) > 1e-2


def test_chunked_prefill_cache_mask_equals_blockwise() -> None:
    """A 40-query chunk at positions 50.. / 100.. against a 160-slot cache, live lengths 90 and 140."""
    positions = jnp.asarray(np.stack([np.arange(50, 90), np.arange(100, 140)]), jnp.int32)
    spec = cache_mask_spec(positions, 160, jnp.asarray([90, 140], jnp.int32))
    q, k, v, w = _qkv(40, 160, seed=1)
    _, _, dk, dv = _compare(q, k, v, w, spec)
    # slots beyond a query's position or the live length get no gradient
    assert np.all(dk[0, 90:] == 0) and np.all(dv[1, 140:] == 0)
    assert np.any(dk[0, :90] != 0) and np.any(dv[1, 100:140] != 0)


def test_queries_that_see_nothing_give_zero_and_unseen_blocks_are_skipped() -> None:
    """Row 0: 20 real tokens, then padding (a whole padding query block); row 1 all padding. The keys of the
    unseen blocks (slots 32..) hold NaN: a kernel that touched them would return NaN."""
    seg = np.zeros((B, 70), np.int32)
    seg[0, :20] = 1
    spec = tree_mask_spec(jnp.asarray(seg), jnp.full((B, 70), 70, jnp.int32))
    q, k, v, w = _qkv(70, 70, seed=2)
    k, v = k.at[:, 32:].set(jnp.nan), v.at[:, 32:].set(jnp.nan)
    out, dq, dk, dv = _compare(q, k, v, w, spec)
    for name, a in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.all(np.isfinite(a)), name
    pad = seg == 0
    assert np.all(out[pad] == 0) and np.all(dq[pad] == 0)
    assert np.all(dk[:, 20:] == 0) and np.all(dv[:, 20:] == 0)
    assert np.any(out[~pad] != 0)


def split(cfg: ModelConfig):
    with nnx.use_eager_sharding(False):
        return nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))


@functools.partial(jax.jit, static_argnums=(0,))
def _logits_and_grads(graphdef, params, tokens, positions, segment_ids, subtree_end):
    def loss(p):
        model = nnx.merge(graphdef, p)
        logits = model(tokens, positions, tree_mask(model.cfg, segment_ids, subtree_end))[0]
        logp = jax.nn.log_softmax(logits)[..., 3]  # any fixed target: [B, T]
        return -jnp.sum(logp * (segment_ids != 0)), logits

    return jax.value_and_grad(loss, has_aux=True)(params)


def test_transformer_logits_and_parameter_gradients_equal_blockwise() -> None:
    tokens, pos, seg, end = (jnp.asarray(a) for a in packed_tree_rows(90))
    (g_bw, params), (g_pl, _) = split(BLOCKWISE), split(PALLAS)
    (loss_bw, logits_bw), grads_bw = _logits_and_grads(g_bw, params, tokens, pos, seg, end)
    (loss_pl, logits_pl), grads_pl = _logits_and_grads(g_pl, params, tokens, pos, seg, end)
    real = np.asarray(seg) != 0
    np.testing.assert_allclose(np.asarray(logits_pl)[real], np.asarray(logits_bw)[real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(float(loss_pl), float(loss_bw), rtol=1e-5)
    leaves_bw, leaves_pl = jax.tree.leaves(grads_bw), jax.tree.leaves(grads_pl)
    assert len(leaves_bw) == len(leaves_pl) > 10
    for a, b in zip(leaves_bw, leaves_pl):
        _assert_close(b, a, "parameter gradient")


@functools.partial(jax.jit, static_argnums=(0, 5))
def _cached(graphdef, params, tokens, positions, cache, cache_len):
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, cache_mask(model.cfg, positions, cache_len), cache)


def test_cached_chunked_prefill_and_decode_equal_blockwise() -> None:
    """Prefill chunks of 5 and 19 tokens into a 40-slot cache, then two decode steps (T = 1: the dense path)."""
    (g_bw, params), (g_pl, _) = split(BLOCKWISE), split(PALLAS)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 272, size=(B, 26)), jnp.int32)
    outs = {}
    for name, graphdef in (("bw", g_bw), ("pl", g_pl)):
        cache, logits = init_cache(PALLAS, B, 40), []
        for lo, hi in ((0, 5), (5, 24), (24, 25), (25, 26)):
            pos = jnp.broadcast_to(jnp.arange(lo, hi, dtype=jnp.int32), (B, hi - lo))
            out, cache = _cached(graphdef, params, tokens[:, lo:hi], pos, cache, 40)
            logits.append(np.asarray(out))
        outs[name] = np.concatenate(logits, axis=1)
    _assert_close(outs["pl"], outs["bw"], "cached logits")


def test_mask_builders_config_and_platform_errors() -> None:
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0]], jnp.int32)
    end = jnp.asarray([[3, 2, 3, 5, 5, 0]], jnp.int32)
    spec = tree_mask(PALLAS, seg, end)
    assert isinstance(spec, MaskSpec) and isinstance(cache_mask(PALLAS, jnp.asarray([[2]]), 8), MaskSpec)
    np.testing.assert_array_equal(dense_mask(spec), tree_causal_mask(seg, end))
    g_pl, params = split(PALLAS)
    tokens, pos = jnp.zeros((1, 6), jnp.int32), jnp.broadcast_to(jnp.arange(6), (1, 6))
    with pytest.raises(ValueError, match="attention_impl='pallas' cannot take a dense"):
        nnx.merge(g_pl, params)(tokens, pos, tree_causal_mask(seg, end))
    with pytest.raises(ValueError, match="needs attention_impl='blockwise'.*'pallas' has no ring version"):
        dataclasses.replace(PALLAS, context_parallel=2)
    q, k, v, _ = _qkv(40, 40)
    causal = tree_mask_spec(jnp.ones((B, 40), jnp.int32), jnp.full((B, 40), 40, jnp.int32))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pallas_module.jax, "default_backend", lambda: "tpu")
        with pytest.raises(NotImplementedError, match="not supported yet on TPU: use attention_impl='blockwise'"):
            pallas_attention(q, k, v, causal)
    with pytest.raises(ValueError, match="must be a power of two >= 16 for the Triton kernel"):
        pallas_attention(q, k, v, causal, block_q=24, interpret=False)
