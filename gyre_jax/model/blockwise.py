"""Mask-free blockwise (flash-style) attention in pure JAX, with a FlashAttention-2 backward.

The mask is never materialized as ``[T, S]``. A ``MaskSpec`` holds per-token arrays (``[B, T]`` for
queries, ``[B, S]`` for keys) and the kernel computes each ``[bq, bk]`` block's mask from their slices:

    query (b, t) sees key (b, s)  iff  q_segment[b, t] != 0 and q_segment[b, t] == k_segment[b, s]
                                       and k_first[b, s] <= q_index[b, t] < k_end[b, s]

``tree_mask_spec`` is the packed-row prefix-tree layout of ``trajectory.batch.attention_mask``;
``cache_mask_spec`` is the serving layout of ``attention.cache_causal_mask`` (plus an optional per-row
live length). ``blockwise_attention`` runs an online softmax over key blocks (f32 running max, sum and
accumulator) inside a scan over query blocks; its ``custom_vjp`` saves only q, k, v, the output and the
per-row logsumexp and recomputes each block's probabilities in the backward, so memory is linear in T.
Blocks whose mask is all False are skipped with ``lax.cond``. ``Attention`` calls it when
``ModelConfig.attention_impl == "blockwise"`` (``attention.tree_mask`` / ``cache_mask`` build the spec).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

INT32_MAX = int(np.iinfo(np.int32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Compact mask descriptor. q_segment, q_index: [B, T] int32; k_segment, k_first, k_end: [B, S] int32.

    Query (b, t) sees key (b, s) iff ``q_segment[b,t] != 0``, ``q_segment[b,t] == k_segment[b,s]`` and
    ``k_first[b,s] <= q_index[b,t] < k_end[b,s]``. A query with segment 0 sees nothing (padding).
    """

    q_segment: jax.Array
    q_index: jax.Array
    k_segment: jax.Array
    k_first: jax.Array
    k_end: jax.Array

    def sees_any(self, block_k: int = 128) -> jax.Array:
        """[B, T] bool: which queries see at least one key (``jnp.any(dense_mask(self), -1)``), computed
        over key blocks of ``block_k`` (``[B, T, block_k]`` at a time, never ``[T, S]``)."""
        s = self.k_segment.shape[1]
        bk = max(1, min(block_k, s))
        sp = -(-s // bk) * bk
        ks = [_blocks(_pad(a, sp), bk) for a in (self.k_segment, self.k_first, self.k_end)]  # [N, B, bk] each

        def step(j, seen):
            mask = block_mask(self.q_segment, self.q_index, ks[0][j], ks[1][j], ks[2][j])
            return seen | jnp.any(mask, axis=-1)

        return lax.fori_loop(0, sp // bk, step, jnp.zeros(self.q_segment.shape, bool))


def tree_mask_spec(segment_ids: jax.Array, subtree_end: jax.Array) -> MaskSpec:
    """segment_ids, subtree_end: [B, T] int -> MaskSpec with S = T (key index = token index).

    Same mask as ``trajectory.batch.attention_mask``: query i sees key j iff same non-zero segment and
    ``j <= i < subtree_end[j]`` (tokens of a prefix tree laid out depth-first; plain rows are causal).
    """
    seg = jnp.asarray(segment_ids, jnp.int32)
    idx = jnp.broadcast_to(jnp.arange(seg.shape[1], dtype=jnp.int32), seg.shape)
    return MaskSpec(seg, idx, seg, idx, jnp.asarray(subtree_end, jnp.int32))


def cache_mask_spec(positions: jax.Array, cache_len: int, kv_length: jax.Array | None = None) -> MaskSpec:
    """positions: [B, T] int, kv_length: [B] int or None -> MaskSpec over S = cache_len cache slots.

    Key slot s is visible to query (b, t) iff ``s <= positions[b, t]`` (``attention.cache_causal_mask``)
    and, with ``kv_length``, ``s < kv_length[b]``.
    """
    pos = jnp.asarray(positions, jnp.int32)
    b = pos.shape[0]
    slots = jnp.broadcast_to(jnp.arange(cache_len, dtype=jnp.int32), (b, cache_len))
    if kv_length is None:
        live = jnp.ones((b, cache_len), jnp.int32)
    else:
        live = (slots < jnp.asarray(kv_length, jnp.int32)[:, None]).astype(jnp.int32)
    never_ends = jnp.full((b, cache_len), INT32_MAX, jnp.int32)
    return MaskSpec(jnp.ones_like(pos), pos, live, slots, never_ends)


def block_mask(q_segment, q_index, k_segment, k_first, k_end) -> jax.Array:
    """q_*: [B, tq], k_*: [B, sk] int32 -> [B, tq, sk] bool, the MaskSpec predicate on one block."""
    qs, qi = q_segment[:, :, None], q_index[:, :, None]
    same = (qs == k_segment[:, None, :]) & (qs != 0)
    return same & (k_first[:, None, :] <= qi) & (qi < k_end[:, None, :])


def dense_mask(spec: MaskSpec) -> jax.Array:
    """MaskSpec -> [B, T, S] bool: the whole mask (for tests and small shapes only)."""
    return block_mask(spec.q_segment, spec.q_index, spec.k_segment, spec.k_first, spec.k_end)


def _blocks(x: jax.Array, size: int) -> jax.Array:
    """[B, N * size, ...] -> [N, B, size, ...]."""
    b, n = x.shape[0], x.shape[1] // size
    return jnp.moveaxis(x.reshape(b, n, size, *x.shape[2:]), 1, 0)


def _unblocks(x: jax.Array) -> jax.Array:
    """[N, B, size, ...] -> [B, N * size, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _maybe(skip: bool, mask: jax.Array, update, carry):
    """update(carry) unless ``skip`` and the block's mask is all False (then carry unchanged)."""
    if not skip:
        return update(carry)
    return lax.cond(jnp.any(mask), update, lambda c: c, carry)


def _online_step(carry, qi, kj, vj, mask, scale):
    """One key block of the online softmax.

    carry: (m, denom [B, K, G, bq], acc [B, K, G, bq, D]) f32; qi: [B, bq, K, G, D] f32;
    kj, vj: [B, bk, K, D] f32; mask: [B, bq, bk] bool. Masked logits count as -inf; a row with no
    visible key so far keeps m = -inf, denom = 0, acc = 0 (no NaN: exponents use a finite shift).
    """
    m, denom, acc = carry
    s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj) * scale
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - shift[..., None])
    alpha = jnp.exp(m - shift)
    denom = denom * alpha + p.sum(-1)
    acc = acc * alpha[..., None] + jnp.einsum("bkgqs,bskd->bkgqd", p, vj)
    return m_new, denom, acc


def _forward(q, k, v, spec: MaskSpec, bq: int, bk: int, skip: bool):
    """q: [B, Tp, H, D], k, v: [B, Sp, K, D] (Tp % bq == 0, Sp % bk == 0), spec padded to Tp/Sp ->
    (out [B, Tp, H, D] in q.dtype, lse [nq, B, K, G, bq] f32; +inf on rows that see no key)."""
    b, tp, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    scale = d**-0.5
    kb, vb = _blocks(k, bk), _blocks(v, bk)
    ks = [_blocks(a, bk) for a in (spec.k_segment, spec.k_first, spec.k_end)]

    def q_block(_, xs):
        qi, qseg, qidx = xs
        qi = qi.astype(jnp.float32)

        def k_step(j, carry):
            mask = block_mask(qseg, qidx, ks[0][j], ks[1][j], ks[2][j])
            kj, vj = kb[j].astype(jnp.float32), vb[j].astype(jnp.float32)
            return _maybe(skip, mask, lambda c: _online_step(c, qi, kj, vj, mask, scale), carry)

        stat = jnp.zeros((b, kh, g, bq), jnp.float32)
        init = (jnp.full_like(stat, -jnp.inf), stat, jnp.zeros((b, kh, g, bq, d), jnp.float32))
        m, denom, acc = lax.fori_loop(0, kb.shape[0], k_step, init)
        seen = denom > 0
        out = acc / jnp.where(seen, denom, 1.0)[..., None]  # [B, K, G, bq, D]; 0 where nothing is seen
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), jnp.inf)
        return None, (jnp.einsum("bkgqd->bqkgd", out).astype(q.dtype), lse)

    qb = _blocks(q.reshape(b, tp, kh, g, d), bq)
    _, (ob, lse) = lax.scan(q_block, None, (qb, _blocks(spec.q_segment, bq), _blocks(spec.q_index, bq)))
    return _unblocks(ob).reshape(b, tp, h, d), lse


def _block_grads(qi, kj, vj, doi, lse_i, delta_i, mask, scale):
    """Recomputes one block's probabilities and returns its gradient contributions (all f32).

    qi, doi: [B, bq, K, G, D]; kj, vj: [B, bk, K, D]; lse_i, delta_i: [B, K, G, bq]; mask: [B, bq, bk]
    -> (dq [B, bq, K, G, D], dk [B, bk, K, D], dv [B, bk, K, D]); dk and dv are summed over the G
    query heads of each KV head.
    """
    s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj) * scale
    p = jnp.where(mask[:, None, None], jnp.exp(s - lse_i[..., None]), 0.0)
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p, doi)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj)
    ds = p * (dp - delta_i[..., None]) * scale
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, kj)
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, qi)
    return dq, dk, dv


def _backward(q, k, v, spec: MaskSpec, out, lse, dout, bq: int, bk: int, skip: bool):
    """FlashAttention-2 backward: a scan over key blocks, each looping over query blocks; dq is one
    [nq, B, bq, K, G, D] f32 accumulator carried through. Shapes as ``_forward``; returns dq, dk, dv
    in the dtypes of q, k, v."""
    b, tp, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    scale = d**-0.5
    grouped = (b, tp, kh, g, d)
    qb = _blocks(q.reshape(grouped), bq)
    dob = _blocks(dout.reshape(grouped), bq)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1).reshape(b, tp, kh, g)
    delta = jnp.einsum("nbqkg->nbkgq", _blocks(delta, bq))  # [nq, B, K, G, bq]
    qseg, qidx = _blocks(spec.q_segment, bq), _blocks(spec.q_index, bq)

    def k_block(dq, xs):
        kj, vj, kseg, kfirst, kend = xs
        kj, vj = kj.astype(jnp.float32), vj.astype(jnp.float32)

        def q_step(i, carry):
            mask = block_mask(qseg[i], qidx[i], kseg, kfirst, kend)

            def update(c):
                qi, doi = qb[i].astype(jnp.float32), dob[i].astype(jnp.float32)
                dq_i, dk_j, dv_j = _block_grads(qi, kj, vj, doi, lse[i], delta[i], mask, scale)
                return c[0].at[i].add(dq_i), c[1] + dk_j, c[2] + dv_j

            return _maybe(skip, mask, update, carry)

        zeros = jnp.zeros(kj.shape, jnp.float32)
        dq, dk, dv = lax.fori_loop(0, qb.shape[0], q_step, (dq, zeros, zeros))
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    xs = (_blocks(k, bk), _blocks(v, bk), *(_blocks(a, bk) for a in (spec.k_segment, spec.k_first, spec.k_end)))
    dq, (dkb, dvb) = lax.scan(k_block, jnp.zeros(qb.shape, jnp.float32), xs)
    return _unblocks(dq).reshape(b, tp, h, d).astype(q.dtype), _unblocks(dkb), _unblocks(dvb)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, spec, bq, bk, skip):
    return _forward(q, k, v, spec, bq, bk, skip)[0]


def _attention_fwd(q, k, v, spec, bq, bk, skip):
    out, lse = _forward(q, k, v, spec, bq, bk, skip)
    return out, (q, k, v, spec, out, lse)


def _attention_bwd(bq, bk, skip, res, dout):
    q, k, v, spec, out, lse = res
    dq, dk, dv = _backward(q, k, v, spec, out, lse, dout, bq, bk, skip)
    spec_zero = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), spec)
    return dq, dk, dv, spec_zero


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check(q, k, v, spec: MaskSpec) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"expected q [B, T, H, D] and k, v [B, S, K, D]; got {q.shape}, {k.shape}, {v.shape}")
    (b, t, h, d), (bk_, s, kh, dk) = q.shape, k.shape
    if b != bk_ or d != dk or h % kh:
        raise ValueError(
            f"q {q.shape} and k {k.shape}: batch and head_dim must match and num_heads a multiple of "
            "num_kv_heads (GQA); fix the projections' shapes"
        )
    want = {"q_segment": (b, t), "q_index": (b, t), "k_segment": (b, s), "k_first": (b, s), "k_end": (b, s)}
    for name, shape in want.items():
        got = getattr(spec, name).shape
        if got != shape:
            raise ValueError(f"MaskSpec.{name} has shape {got}, expected {shape}: build it for these q, k")


def _pad(x: jax.Array, length: int, value=0) -> jax.Array:
    """Pads axis 1 of x up to ``length`` with ``value``."""
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return jnp.pad(x, widths, constant_values=value)


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    spec: MaskSpec,
    *,
    block_q: int = 128,
    block_k: int = 128,
    skip_empty_blocks: bool = True,
) -> jax.Array:
    """q: [B, T, H, D], k, v: [B, S, K, D] (H a multiple of K), spec: MaskSpec -> [B, T, H, D] in q.dtype.

    ``softmax(q k^T / sqrt(D))`` over the keys ``spec`` lets each query see, as
    ``jax.nn.dot_product_attention`` with ``dense_mask(spec)``, except that a query that sees no key
    returns 0 (and a zero gradient), never NaN. f32 accumulation whatever the input dtype. T and S are
    padded internally to multiples of the block sizes (capped at T and S). Differentiable in q, k, v.
    """
    _check(q, k, v, spec)
    t, s = q.shape[1], k.shape[1]
    bq, bk = min(block_q, t), min(block_k, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    padded = MaskSpec(
        _pad(spec.q_segment, tp), _pad(spec.q_index, tp), _pad(spec.k_segment, sp), _pad(spec.k_first, sp),
        _pad(spec.k_end, sp),
    )  # fmt: skip
    out = _attention(_pad(q, tp), _pad(k, sp), _pad(v, sp), padded, bq, bk, bool(skip_empty_blocks))
    return out[:, :t]
