"""``attention_impl="blockwise"`` wired into the model: the Transformer with MaskSpecs from ``attention.tree_mask``
/ ``cache_mask`` computes what the dense ("xla") path computes: logits and parameter gradients on packed rows
with a prefix tree and padding, cached chunked prefill + greedy decode, and a MoE forward with its
load-balancing loss. Blocks are small (8-48 tokens) so every case spans several query and key blocks.

Padding rows differ by design (dense attention gives a query that sees no key the mean of V, blockwise 0), so
logits are compared on real rows and losses weight real rows only, as the training loss does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gyre_jax.model.attention import cache_causal_mask, cache_mask, segment_mask, tree_causal_mask, tree_mask
from gyre_jax.model.blockwise import MaskSpec, cache_mask_spec, dense_mask, tree_mask_spec
from gyre_jax.model.config import TINY_MOE, ModelConfig
from gyre_jax.model.modules import Transformer
from gyre_jax.trajectory.branches import Branch
from gyre_jax.trajectory.select import select
from gyre_jax.trajectory.tree import tree_chunks

XLA = ModelConfig(
    vocab_size=272,
    num_layers=2,
    embed_dim=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    mlp_dim=128,
    rope_theta=10000.0,
)
BLOCKWISE = dataclasses.replace(XLA, attention_impl="blockwise", attention_block_q=32, attention_block_k=48)


def split(cfg: ModelConfig):
    with nnx.use_eager_sharding(False):
        return nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))


@functools.partial(jax.jit, static_argnums=(0,))
def _logits(graphdef, params, tokens, positions, segment_ids, subtree_end):
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, tree_mask(model.cfg, segment_ids, subtree_end))[0]


@functools.partial(jax.jit, static_argnums=(0,))
def _loss_grad(graphdef, params, tokens, positions, segment_ids, subtree_end):
    def loss(p):
        model = nnx.merge(graphdef, p)
        logits = model(tokens, positions, tree_mask(model.cfg, segment_ids, subtree_end))[0]
        logp = jax.nn.log_softmax(logits)[..., 3]  # any fixed target: [B, T]
        return -jnp.sum(logp * (segment_ids != 0))

    return jax.value_and_grad(loss)(params)


def _branch(tokens: list[int]) -> Branch:
    n = len(tokens)
    return Branch("ex", "main", "main", list(tokens), [True] * n, [-0.5] * n, [1.0] * n, [0] * n)


def packed_tree_rows(t: int):
    """tokens, positions, segment_ids, subtree_end: [2, t]. Row 0: a branching prefix tree laid out by
    trajectory.tree, a plain sequence, padding; row 1: two plain sequences and padding."""
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
    tokens = rng.integers(0, XLA.vocab_size, size=(2, t)).astype(np.int32)
    tokens[0, :n] = chunk.tokens
    return tokens, pos, seg, end


def test_packed_tree_rows_logits_and_parameter_gradients_equal_the_dense_path() -> None:
    tokens, pos, seg, end = (jnp.asarray(a) for a in packed_tree_rows(90))
    (g_xla, params), (g_bw, _) = split(XLA), split(BLOCKWISE)
    real = np.asarray(seg) != 0
    want = np.asarray(_logits(g_xla, params, tokens, pos, seg, end))
    got = np.asarray(_logits(g_bw, params, tokens, pos, seg, end))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)
    # the tree mask matters: the same rows as plain causal segments give other logits
    causal = np.asarray(_logits(g_bw, params, tokens, pos, seg, jnp.full_like(end, 90)))
    assert np.max(np.abs(causal[real] - want[real])) > 1e-2

    loss_xla, grads_xla = _loss_grad(g_xla, params, tokens, pos, seg, end)
    loss_bw, grads_bw = _loss_grad(g_bw, params, tokens, pos, seg, end)
    np.testing.assert_allclose(float(loss_bw), float(loss_xla), rtol=1e-5)
    leaves_xla, leaves_bw = jax.tree.leaves(grads_xla), jax.tree.leaves(grads_bw)
    assert len(leaves_xla) == len(leaves_bw) > 10
    for a, b in zip(leaves_xla, leaves_bw):
        scale = float(np.max(np.abs(a))) + 1e-6
        np.testing.assert_allclose(np.asarray(b) / scale, np.asarray(a) / scale, atol=1e-5, rtol=0)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _cached(graphdef, params, tokens, positions, cache, cache_len):
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, cache_mask(model.cfg, positions, cache_len), cache)


def _prefill_then_greedy(graphdef, params, cfg, prompt, chunks, steps, s):
    """Chunked cached prefill of prompt [B, P], then greedy decode: (prefill logits [B, P, V], tokens [B, steps])."""
    from gyre_jax.model.attention import init_cache

    b = prompt.shape[0]
    cache, start, logits = init_cache(cfg, b, s), 0, []
    for size in chunks:
        pos = np.broadcast_to(np.arange(start, start + size), (b, size)).astype(np.int32)
        out, cache = _cached(graphdef, params, jnp.asarray(prompt[:, start : start + size]), jnp.asarray(pos), cache, s)
        logits.append(np.asarray(out))
        start += size
    tokens = [np.argmax(logits[-1][:, -1], -1)]
    for i in range(steps - 1):
        pos = np.full((b, 1), start + i, np.int32)
        out, cache = _cached(graphdef, params, jnp.asarray(tokens[-1][:, None], jnp.int32), jnp.asarray(pos), cache, s)
        tokens.append(np.argmax(np.asarray(out)[:, 0], -1))
    return np.concatenate(logits, axis=1), np.stack(tokens, 1)


def test_cached_chunked_prefill_and_greedy_decode_equal_the_dense_path() -> None:
    """The shapes of test_model.py's cached-chunked test (B=2, 24 prompt tokens, cache of 32), blocks 8 x 8."""
    cfg = dataclasses.replace(BLOCKWISE, attention_block_q=8, attention_block_k=8)
    (g_xla, params), (g_bw, _) = split(XLA), split(cfg)
    prompt = np.random.default_rng(0).integers(0, XLA.vocab_size, size=(2, 24))
    want_logits, want_tokens = _prefill_then_greedy(g_xla, params, XLA, prompt, (5, 1, 11, 7), 8, 32)
    got_logits, got_tokens = _prefill_then_greedy(g_bw, params, cfg, prompt, (5, 1, 11, 7), 8, 32)
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(got_tokens, want_tokens)
    assert len(set(want_tokens.ravel().tolist())) > 2  # a random model is not constant here


def test_moe_forward_and_load_balancing_loss_equal_the_dense_path() -> None:
    moe = dataclasses.replace(
        TINY_MOE, num_layers=2, embed_dim=32, head_dim=8, mlp_dim=48, moe_mlp_dim=16, vocab_size=64
    )
    bw = dataclasses.replace(moe, attention_impl="blockwise", attention_block_q=8, attention_block_k=8)
    (g_xla, params), (g_bw, _) = split(moe), split(bw)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, size=(2, 20)), jnp.int32)
    segs = jnp.asarray([[1] * 20, [1] * 9 + [2] * 5 + [0] * 6], jnp.int32)
    positions = jnp.asarray([list(range(20)), list(range(9)) + list(range(5)) + [0] * 6], jnp.int32)

    @functools.partial(jax.jit, static_argnums=(0,))
    def fwd(graphdef, p):
        model = nnx.merge(graphdef, p)
        logits, _, aux = model(tokens, positions, segment_mask(model.cfg, segs), return_aux=True)
        return logits, aux.load_balancing_loss

    (want, lb_want), (got, lb_got) = fwd(g_xla, params), fwd(g_bw, params)
    real = np.asarray(segs) != 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-4, rtol=0)
    np.testing.assert_allclose(float(lb_got), float(lb_want), rtol=1e-5)


def test_mask_builders_follow_the_impl_and_a_mismatch_is_refused() -> None:
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0]], jnp.int32)
    end = jnp.asarray([[3, 2, 3, 5, 5, 0]], jnp.int32)
    spec = tree_mask(BLOCKWISE, seg, end)
    assert isinstance(spec, MaskSpec)
    np.testing.assert_array_equal(dense_mask(spec), tree_mask(XLA, seg, end))
    np.testing.assert_array_equal(tree_mask(XLA, seg, end), tree_causal_mask(seg, end))
    positions = jnp.asarray([[2], [5]], jnp.int32)
    assert isinstance(cache_mask(BLOCKWISE, positions, 8), MaskSpec)
    np.testing.assert_array_equal(cache_mask(XLA, positions, 8)[:, 0], np.arange(8) <= np.asarray([[2], [5]]))

    (g_xla, params), (g_bw, _) = split(XLA), split(BLOCKWISE)
    tokens, pos = jnp.zeros((1, 6), jnp.int32), jnp.broadcast_to(jnp.arange(6), (1, 6))
    with pytest.raises(ValueError, match="attention_impl='blockwise' cannot take a dense"):
        nnx.merge(g_bw, params)(tokens, pos, tree_causal_mask(seg, end))
    with pytest.raises(ValueError, match="attention_impl='xla' cannot take a MaskSpec"):
        nnx.merge(g_xla, params)(tokens, pos, spec)
    with pytest.raises(ValueError, match="attention_block_k=0 must be >= 1"):
        dataclasses.replace(BLOCKWISE, attention_block_k=0)


def test_sees_any_marks_the_queries_that_see_a_key_without_the_dense_mask() -> None:
    seg = jnp.asarray([[1, 1, 0, 2, 2, 2, 0], [0, 0, 3, 3, 3, 3, 3]], jnp.int32)
    end = jnp.asarray([[2, 2, 0, 6, 5, 6, 0], [0, 0, 7, 7, 7, 7, 7]], jnp.int32)
    bounded = cache_mask_spec(jnp.asarray([[0, 1, 9], [4, 5, 6]], jnp.int32), 10, jnp.asarray([0, 10]))
    for spec in (tree_mask_spec(seg, end), bounded):
        want = np.any(np.asarray(dense_mask(spec)), -1)
        assert want.any() and not want.all()
        for block_k in (1, 3, 128):  # several blocks, a ragged last block, one block
            np.testing.assert_array_equal(jax.jit(spec.sees_any, static_argnums=0)(block_k), want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_attention_values_and_gradients_equal_dot_product_attention(dtype) -> None:
    """``dense_attention`` ("xla": grouped heads, the scores normalised after the values' matmul) against
    ``jax.nn.dot_product_attention`` over packed prefix-tree rows with padding queries that see no key (there both
    give the mean of all values), 3 query heads per KV head; the output and the gradients of q, k and v; and a chunk
    of queries over a longer run of keys (T < S: chunked prefill over a cache)."""
    from gyre_jax.model.attention import dense_attention

    rng = np.random.default_rng(3)
    _, _, seg, end = packed_tree_rows(90)
    mask = tree_causal_mask(jnp.asarray(seg), jnp.asarray(end))  # [2, 90, 90]
    sees_none = ~np.asarray(mask).any(-1)
    assert sees_none.any() and not sees_none.all(), "the rows must hold padding queries and real ones"
    b, t, kh, g, d = 2, 90, 2, 3, 16
    q, k, v, w = (
        jnp.asarray(rng.standard_normal((b, t, n, d)), dtype) for n in (kh * g, kh, kh, kh * g)
    )  # w: the output's cotangent
    tol = 2e-5 if dtype == jnp.float32 else 3e-2

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * w.astype(jnp.float32))

    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])  # noqa: E731
    ours = lambda q, k, v: dense_attention(q, k, v, mask)  # noqa: E731
    got, want = jax.jit(ours)(q, k, v), ref(q, k, v)
    assert got.shape == want.shape == (b, t, kh * g, d) and got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    grads = jax.jit(jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2)))(q, k, v)
    for got_g, want_g in zip(grads, jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(q, k, v)):
        scale = float(jnp.max(jnp.abs(want_g.astype(jnp.float32))))
        np.testing.assert_allclose(
            np.asarray(got_g, np.float32), np.asarray(want_g, np.float32), atol=tol * max(1.0, scale), rtol=tol
        )
    chunk = cache_causal_mask(jnp.asarray([[10 + i for i in range(8)]] * b, jnp.int32), t)  # 8 queries, 90 keys
    got = dense_attention(q[:, :8], k, v, chunk)
    want = jax.nn.dot_product_attention(q[:, :8], k, v, mask=chunk[:, None])
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("blocks", [None, (16, 16, 32), (20, 44)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_attention_equals_dot_product_attention_on_ragged_cache_rows(dtype, blocks) -> None:
    """The decode step's grouped attention (one query per row, keys where the cache holds them: a [B, S, K, D]
    cache, or the decode slots' heads-first blocks, the window on a block boundary or inside a block) against ``jax.nn.dot_product_attention`` on rows of different lengths, 2 query heads per KV head, a row
    that sees one key; over a window (the mask's length) of a longer cache with more rows than the batch."""
    from gyre_jax.model.attention import BlockedCache, LayerCache, cache_causal_mask, decode_attention

    rng = np.random.default_rng(0)
    b, rows, s, w, kh, g, d = 5, 7, 64, 48, 2, 2, 16
    q = jnp.asarray(rng.standard_normal((b, 1, kh * g, d)), dtype)
    k = jnp.asarray(rng.standard_normal((rows, s, kh, d)), dtype)
    v = jnp.asarray(rng.standard_normal((rows, s, kh, d)), dtype)
    positions = jnp.asarray([[0], [7], [20], [47], [31]], jnp.int32)
    mask = cache_causal_mask(positions, w)  # [B, 1, W]: the window
    if blocks is None:
        cache = LayerCache(k=k, v=v)
    else:
        edges = np.cumsum((0, *blocks))
        split = lambda x: tuple(jnp.swapaxes(x[:, a:b], 1, 2) for a, b in zip(edges[:-1], edges[1:]))  # noqa: E731
        cache = BlockedCache(k=split(k), v=split(v))
    got = jax.jit(decode_attention)(q, cache, mask)
    want = jax.nn.dot_product_attention(q, k[:b, :w], v[:b, :w], mask=mask[:, None])
    assert got.shape == want.shape == (b, 1, kh * g, d) and got.dtype == dtype
    tol = 2e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    # row 0 sees only key 0: its output is that key's value, per query head's KV head
    np.testing.assert_allclose(
        np.asarray(got[0, 0], np.float32), np.asarray(jnp.repeat(v[0, 0], g, axis=0), np.float32), atol=tol
    )


def test_blocked_cache_writes_rows_of_a_longer_batch_and_reads_back_sequence_major() -> None:
    """``BlockedCache.write`` (the decode slots' heads-first blocks) puts [B, T, K, D] at the positions of rows
    0..B-1 of a cache with more rows, each in the block that holds it, drops positions past the cache, and
    ``read`` / ``rows`` return what a [B, S, K, D] ``LayerCache`` given the same writes holds."""
    from gyre_jax.model.attention import BlockedCache, LayerCache

    rng = np.random.default_rng(1)
    rows, kh, d, b, t = 4, 2, 8, 3, 2
    sizes = (4, 4, 8)
    s = sum(sizes)
    new_k = jnp.asarray(rng.standard_normal((b, t, kh, d)), jnp.float32)
    new_v = new_k + 1
    positions = jnp.asarray([[0, 4], [5, 16], [15, 3]], jnp.int32)  # 16: past the cache, dropped
    zeros = jnp.zeros((rows, s, kh, d), jnp.float32)
    seq = LayerCache(k=zeros, v=zeros).write(new_k, new_v, positions)
    blank = tuple(jnp.zeros((rows, kh, n, d), jnp.float32) for n in sizes)
    blocked = BlockedCache(k=blank, v=blank).write(new_k, new_v, positions)
    assert blocked.sizes == sizes and blocked.length == seq.length == s
    for a, c in zip(blocked.read(rows, s), seq.read(rows, s)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    for a, c in zip(blocked.rows(jnp.int32(1), 2), (seq.k[1:3], seq.v[1:3])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    np.testing.assert_array_equal(np.asarray(blocked.k[1][1, :, 1]), np.asarray(new_k[1, 0]))  # position 5: block 1
    assert not any(np.any(np.asarray(x[3])) for x in blocked.k)  # a row past the batch is untouched
    written = sum(np.count_nonzero(np.asarray(x).any(axis=(1, 3))) for x in blocked.v)
    assert written == 5  # 6 writes, 1 past the cache


def test_one_slot_decode_step_writes_its_row_in_place() -> None:
    """A decode step on a cache of one slot (B = T = 1, the engine's batch-1 generate) writes its row at its
    position, drops a position past the cache, and, compiled with the blocks donated as the engine compiles it,
    copies no block: XLA had rewritten the one-update scatter as a dynamic-update-slice and fused it into each
    reader of the block (the attention's matmuls, through a bitcast dropping the slot axis), two to four copies of
    every block per step (``BlockedCache.write``)."""
    from gyre_jax.model.attention import BlockedCache, cache_causal_mask, decode_attention

    rng = np.random.default_rng(2)
    sizes, kh, g, d = (16, 48), 2, 2, 8
    s = sum(sizes)

    def step(cache, q, k, v, positions):
        cache = cache.write(k, v, positions)
        return cache, decode_attention(q, cache, cache_causal_mask(jnp.minimum(positions, s - 1), s))

    blocks = lambda: tuple(jnp.asarray(rng.standard_normal((1, kh, n, d)), jnp.float32) for n in sizes)  # noqa: E731
    before = BlockedCache(k=blocks(), v=blocks())
    q = jnp.asarray(rng.standard_normal((1, 1, kh * g, d)), jnp.float32)
    new_k, new_v = (jnp.asarray(rng.standard_normal((1, 1, kh, d)), jnp.float32) for _ in range(2))
    compiled = jax.jit(step, donate_argnums=(0,)).lower(before, q, new_k, new_v, jnp.zeros((1, 1), jnp.int32))
    hlo = compiled.compile().as_text()
    block_shapes = [f"[1,{kh},{n},{d}]" for n in sizes]
    copies = [line for line in hlo.splitlines() if " copy(" in line and any(x in line for x in block_shapes)]
    assert not copies, "\n".join(copies)
    run = jax.jit(step)
    for position in (3, 16, 40, s):  # block 0, the first and an inner position of block 1, past the cache
        want_k, want_v = (np.array(x) for x in before.read(1, s))  # [1, S, K, D], sequence-major
        if position < s:
            want_k[0, position], want_v[0, position] = np.asarray(new_k[0, 0]), np.asarray(new_v[0, 0])
        after, out = run(before, q, new_k, new_v, jnp.full((1, 1), position, jnp.int32))
        for got, want in zip(after.read(1, s), (want_k, want_v)):
            np.testing.assert_array_equal(np.asarray(got), want)
        seen = min(position, s - 1) + 1
        want = jax.nn.dot_product_attention(q, want_k[:, :seen], want_v[:, :seen])
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-6, rtol=2e-6)
