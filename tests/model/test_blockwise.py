"""Tests for gyre_jax/model/blockwise.py: blockwise attention equals dense masked attention.

Every case compares the output and the q/k/v gradients of ``blockwise_attention`` with
``jax.nn.dot_product_attention`` over the dense mask the rest of the system builds
(``trajectory.batch.attention_mask`` for packed/tree rows, ``attention.cache_causal_mask`` for the
cache). Dense attention gives a query that sees no key the mean of V while blockwise gives 0, so
the loss weights only real query rows (as the training loss does); padding rows are checked on their own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyre_jax.model.attention import cache_causal_mask
from gyre_jax.model.blockwise import (
    MaskSpec,
    blockwise_attention,
    cache_mask_spec,
    dense_mask,
    tree_mask_spec,
)
from gyre_jax.trajectory.batch import attention_mask
from gyre_jax.trajectory.branches import Branch
from gyre_jax.trajectory.select import select
from gyre_jax.trajectory.tree import tree_chunks

REPO = Path(__file__).resolve().parents[2]
H, K, D = 4, 2, 16


def _branch(tokens: list[int]) -> Branch:
    n = len(tokens)
    return Branch("ex", "main", "main", list(tokens), [True] * n, [-0.5] * n, [1.0] * n, [0] * n)


def real_tree_chunk(rng: np.random.Generator):
    """A branching prefix tree laid out by trajectory.tree: a shared prompt, a main line that forks twice
    (two retries of its last call) and a summary branch that forks off the prompt."""
    tok = lambda n: list(rng.integers(10, 1000, size=n))  # noqa: E731
    prompt, main = tok(20), tok(25)
    branches = [
        _branch(prompt + main + tok(20)),
        _branch(prompt + main + tok(15)),
        _branch(prompt + main[:10] + tok(12)),
        _branch(prompt + tok(18)),
    ]
    (chunk,) = tree_chunks(select("ex", branches, None), 200, 8)
    assert len(set(chunk.subtree_end.tolist())) > 2, "the layout must branch"
    return chunk


def packed_rows(t: int, rng: np.random.Generator):
    """[2, t] segment_ids, subtree_end: row 0 = a real prefix tree + a plain sequence + padding;
    row 1 = three plain (causal) sequences + padding."""
    seg, end = np.zeros((2, t), np.int32), np.zeros((2, t), np.int32)
    chunk = real_tree_chunk(rng)
    n = chunk.size
    seg[0, :n], end[0, :n] = 1, chunk.subtree_end
    seg[0, n : n + 20], end[0, n : n + 20] = 2, n + 20
    lo = 0
    for s, length in enumerate((40, 55, 30), start=1):
        seg[1, lo : lo + length], end[1, lo : lo + length] = s, lo + length
        lo += length
    return seg, end


def rand(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)


def dense_attention(q, k, v, mask):
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])


def compare(q, k, v, mask, row_weight, blockwise, *, atol, rtol):
    """Asserts out and d(loss)/d(q, k, v) agree; loss = sum(out * cotangent * row_weight) with a fixed random
    cotangent and row_weight [B, T] (1 on rows that see a key)."""
    ct = rand(np.random.default_rng(7), q.shape) * row_weight[:, :, None, None]
    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]  # noqa: E731
    dense_loss = lambda q, k, v: jnp.sum(dense_attention(*f32(q, k, v), mask) * ct)  # noqa: E731
    block_loss = lambda q, k, v: jnp.sum(blockwise(q, k, v).astype(jnp.float32) * ct)  # noqa: E731
    want_out = jax.jit(dense_attention)(*f32(q, k, v), mask) * row_weight[:, :, None, None]
    got_out = jax.jit(blockwise)(q, k, v).astype(jnp.float32) * row_weight[:, :, None, None]
    np.testing.assert_allclose(got_out, want_out, atol=atol, rtol=rtol)
    want = jax.jit(jax.grad(dense_loss, (0, 1, 2)))(q, k, v)
    got = jax.jit(jax.grad(block_loss, (0, 1, 2)))(q, k, v)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == q.dtype, name
        np.testing.assert_allclose(g.astype(jnp.float32), w.astype(jnp.float32), atol=atol, rtol=rtol, err_msg=name)


def test_descriptors_describe_the_dense_masks_the_system_builds():
    rng = np.random.default_rng(0)
    seg, end = packed_rows(170, rng)
    want = attention_mask(jnp.asarray(seg), jnp.asarray(end))
    np.testing.assert_array_equal(dense_mask(tree_mask_spec(seg, end)), want)
    positions = np.array([[5, 6, 7], [40, 41, 42]], np.int32)
    np.testing.assert_array_equal(dense_mask(cache_mask_spec(positions, 64)), cache_causal_mask(positions, 64))
    bounded = dense_mask(cache_mask_spec(positions, 64, kv_length=np.array([6, 64])))
    np.testing.assert_array_equal(bounded, cache_causal_mask(positions, 64) & (np.arange(64) < [[[6]], [[64]]]))


@pytest.mark.parametrize("block_q,block_k,skip", [(32, 48, True), (64, 32, False)])
def test_packed_tree_rows_match_dense_forward_and_gradients(block_q, block_k, skip):
    # T = 170: not a multiple of either block; GQA H=4 over K=2; padding at the end of both rows.
    rng = np.random.default_rng(1)
    seg, end = packed_rows(170, rng)
    spec = tree_mask_spec(seg, end)
    q, k, v = rand(rng, (2, 170, H, D)), rand(rng, (2, 170, K, D)), rand(rng, (2, 170, K, D))
    mask = attention_mask(jnp.asarray(seg), jnp.asarray(end))

    def blockwise(q, k, v):
        return blockwise_attention(q, k, v, spec, block_q=block_q, block_k=block_k, skip_empty_blocks=skip)

    compare(q, k, v, mask, jnp.asarray(seg != 0, jnp.float32), blockwise, atol=1e-5, rtol=1e-5)


def test_bf16_inputs_accumulate_in_f32():
    rng = np.random.default_rng(2)
    seg, end = packed_rows(130, rng)
    spec = tree_mask_spec(seg, end)
    q, k, v = (rand(rng, (2, 130, h, D), jnp.bfloat16) for h in (H, K, K))
    mask = attention_mask(jnp.asarray(seg), jnp.asarray(end))

    def blockwise(q, k, v):
        out = blockwise_attention(q, k, v, spec, block_q=32, block_k=32)
        assert out.dtype == jnp.bfloat16
        return out

    # Against dense f32 attention on the same bf16 values: only the bf16 rounding of outputs/gradients differs.
    compare(q, k, v, mask, jnp.asarray(seg != 0, jnp.float32), blockwise, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("decode", [True, False])
def test_cache_layouts_match_dense(decode):
    # Each row at its own position: decode (T=1) or a chunked prefill (T=20); row 1 also bounded by kv_length.
    rng = np.random.default_rng(3)
    s = 100
    starts = np.array([37, 0, 79], np.int32)
    t = 1 if decode else 20
    positions = starts[:, None] + np.arange(t, dtype=np.int32)[None]
    kv_length = np.array([s, 12, s], np.int32)
    spec = cache_mask_spec(positions, s, kv_length=kv_length)
    mask = cache_causal_mask(jnp.asarray(positions), s) & (jnp.arange(s) < kv_length[:, None, None])
    q, k, v = rand(rng, (3, t, H, D)), rand(rng, (3, s, K, D)), rand(rng, (3, s, K, D))

    def blockwise(q, k, v):
        return blockwise_attention(q, k, v, spec, block_q=16, block_k=32)

    compare(q, k, v, mask, jnp.ones((3, t), jnp.float32), blockwise, atol=1e-5, rtol=1e-5)


def test_padding_query_rows_give_zero_and_finite_zero_gradients():
    rng = np.random.default_rng(4)
    seg = np.zeros((2, 50), np.int32)
    seg[0, :30] = 1  # row 0: 30 real tokens then padding; row 1: padding only
    end = np.where(seg != 0, 30, 0).astype(np.int32)
    spec = tree_mask_spec(seg, end)
    q, k, v = rand(rng, (2, 50, H, D)), rand(rng, (2, 50, K, D)), rand(rng, (2, 50, K, D))

    def loss(q, k, v):
        return jnp.sum(blockwise_attention(q, k, v, spec, block_q=16, block_k=16) ** 2)

    out = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, spec, block_q=16, block_k=16))(q, k, v)
    assert np.all(np.asarray(out[0, 30:]) == 0) and np.all(np.asarray(out[1]) == 0)
    assert np.all(np.abs(np.asarray(out[0, :30])) > 0)
    dq, dk, dv = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g)))
        assert np.all(np.asarray(g[0, 30:]) == 0) and np.all(np.asarray(g[1]) == 0)
    assert np.any(np.asarray(dq[0, :30]) != 0) and np.any(np.asarray(dk[0, :30]) != 0)


def test_mismatched_shapes_are_refused_with_what_to_fix():
    rng = np.random.default_rng(5)
    spec = tree_mask_spec(np.ones((1, 8), np.int32), np.full((1, 8), 8, np.int32))
    q, kv = rand(rng, (1, 8, 3, D)), rand(rng, (1, 8, 2, D))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        blockwise_attention(q, kv, kv, spec)
    with pytest.raises(ValueError, match=r"MaskSpec.q_segment has shape \(1, 8\), expected \(1, 9\)"):
        blockwise_attention(rand(rng, (1, 9, 4, D)), kv, kv, spec)
    assert isinstance(spec, MaskSpec)


def _grad_temp_bytes(t: int, dense: bool) -> int | None:
    """Compiled temp bytes of d(loss)/d(q, k, v) at B=1, T=S=t, H=4, K=2, D=32 (compile only, nothing runs)."""
    q = jax.ShapeDtypeStruct((1, t, 4, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def loss(q, k, v, seg, end):
        if dense:
            return jnp.sum(dense_attention(q, k, v, attention_mask(seg, end)) ** 2)
        return jnp.sum(blockwise_attention(q, k, v, tree_mask_spec(seg, end)) ** 2)

    analysis = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv, ids, ids).compile().memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def test_training_memory_is_linear_in_length_and_far_below_dense():
    small = _grad_temp_bytes(1024, dense=False)
    if small is None:
        pytest.skip("this backend's compiled memory_analysis() is None: no temp-size figure to compare")
    large = _grad_temp_bytes(2048, dense=False)
    dense = _grad_temp_bytes(2048, dense=True)
    assert large / small <= 2.5, (small, large)
    assert large * 10 < dense, (large, dense)


def test_benchmark_runs_and_writes_its_table(tmp_path):
    out = tmp_path / "lc.json"
    cmd = [sys.executable, "benchmarks/bench_long_context.py", "--lengths", "256", "512", "--time-max", "256"]
    proc = subprocess.run(
        [*cmd, "--reps", "1", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["T"] for r in rows] == [256, 512] and "dense MiB" in proc.stdout
    assert {"dense_ms", "blockwise_ms", "blockwise_noskip_ms"} <= set(rows[0]) and "dense_ms" not in rows[1]
    for r in rows:
        if r["dense_temp_bytes"] is not None:  # None where the backend has no memory analysis
            assert r["blockwise_temp_bytes"] < r["dense_temp_bytes"]
