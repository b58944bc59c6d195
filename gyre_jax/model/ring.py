"""Context parallelism: ring attention over a ``context`` mesh axis, mask-free, load-balanced by a zigzag layout.

A row of T tokens is split over the ``n`` devices of the mesh's ``context`` axis: each holds ``T / n``
queries, keys and values and their ``MaskSpec`` descriptors (``blockwise.py``). ``ring_attention`` runs
inside ``jax.shard_map``: at each of ``n`` ring steps a device attends its queries to the key/value
block it holds (``blockwise._forward``: blocks whose mask is all False are skipped), merges the partial
result into a running (output, logsumexp) pair and passes the block, with its key descriptors
(``k_segment, k_first, k_end``), to the next device with ``lax.ppermute``. The mask is computed from the
descriptors, never from where a token sits, so the layout of the sequence over the shards is free and
tree masks (``subtree_end``) work across shards unchanged.

Load balance: with a causal (or tree) mask, shard ``i`` of a contiguous split would see ``i + 1`` blocks'
worth of keys. ``zigzag_permutation(T, n)`` cuts the row into ``2n`` chunks and gives shard ``i`` chunks
``i`` and ``2n - 1 - i``, so every shard does the same work per ring step (the empty blocks it skips are
balanced too). Callers permute the ``[B, T]`` inputs and the descriptors with it (``to_zigzag``); the
descriptors keep the original token indices, so the attention result is the same permutation of the
single-device result.

Backward (``jax.custom_vjp``): the forward saves q, this device's k and v, the output and the per-row
logsumexp; the backward passes k, v, their descriptors and f32 ``dk, dv`` accumulators around the ring
once more (``blockwise._backward`` per step with the global logsumexp), so after ``n`` steps every
block's gradient is back on its owner. Gradients equal the single-device computation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from gyre_jax.model.blockwise import MaskSpec, _backward, _forward, _pad
from gyre_jax.model.rules import CONTEXT_AXIS


def zigzag_permutation(t: int, n: int) -> np.ndarray:
    """[t] int32: the token order laid out over ``n`` shards (contiguous ``t / n`` per shard): shard i holds
    chunks i and 2n-1-i of 2n equal chunks. ``t`` must be a multiple of 2n; n = 1 is the identity."""
    if n < 1 or t % (2 * n):
        raise ValueError(
            f"a row of {t} tokens cannot be split into 2 x {n} equal chunks for {n} context shards: make the row "
            f"length (trajectory.row_length) a multiple of {2 * n}"
        )
    c = t // (2 * n)
    chunks = [np.arange(i * c, (i + 1) * c) for i in range(2 * n)]
    order = [np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)]
    return np.concatenate(order).astype(np.int32)


def to_zigzag(x: jax.Array, perm: np.ndarray) -> jax.Array:
    """x: [B, T, ...] -> x[:, perm] (the layout ``zigzag_permutation`` describes)."""
    return jnp.take(x, jnp.asarray(perm), axis=1)


def from_zigzag(x: jax.Array, perm: np.ndarray) -> jax.Array:
    """Inverse of ``to_zigzag``: x[:, argsort(perm)]."""
    return jnp.take(x, jnp.asarray(np.argsort(perm)), axis=1)


def spec_to_zigzag(spec: MaskSpec, perm: np.ndarray) -> MaskSpec:
    """Every descriptor array ([B, T], S = T) permuted by ``perm``; the indices they hold are unchanged."""
    return jax.tree.map(lambda a: to_zigzag(a, perm), spec)


def _rows(lse: jax.Array, b: int, tp: int) -> jax.Array:
    """blockwise lse [nq, B, K, G, bq] (+inf = sees nothing) -> [B, Tp, K, G] with -inf for 'sees nothing'."""
    nq, _, kh, g, bq = lse.shape
    rows = jnp.einsum("nbkgq->bnqkg", lse).reshape(b, tp, kh, g)
    return jnp.where(jnp.isposinf(rows), -jnp.inf, rows)


def _blocks_lse(rows: jax.Array, bq: int) -> jax.Array:
    """Inverse of ``_rows``: [B, Tp, K, G] (-inf = sees nothing) -> [nq, B, K, G, bq] with +inf."""
    b, tp, kh, g = rows.shape
    blocks = jnp.einsum("bnqkg->nbkgq", rows.reshape(b, tp // bq, bq, kh, g))
    return jnp.where(jnp.isneginf(blocks), jnp.inf, blocks)


def _merge(out, lse, out_i, lse_i):
    """Merges two partial softmax results. out: [B, T, K, G, D] f32, lse: [B, T, K, G] (-inf: no key yet)."""
    m = jnp.maximum(lse, lse_i)
    shift = jnp.where(jnp.isfinite(m), m, 0.0)
    a, c = jnp.exp(lse - shift), jnp.exp(lse_i - shift)
    total = a + c
    safe = jnp.where(total > 0, total, 1.0)
    new = (out * a[..., None] + out_i * c[..., None]) / safe[..., None]
    return new, jnp.where(total > 0, shift + jnp.log(safe), -jnp.inf)


def _rotate(tree, axis: str, n: int):
    """Sends every array of ``tree`` to the next device of the ring (device i -> i + 1 mod n)."""
    pairs = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(lambda a: lax.ppermute(a, axis, pairs), tree)


def _ring_forward(q, k, v, spec: MaskSpec, axis, n, bq, bk, skip):
    """Per-device shapes (padded): q [B, Tp, H, D] f32, k, v [B, Tp, K, D], spec over Tp -> (out [B, Tp, H, D]
    f32, lse rows [B, Tp, K, G] f32, -inf where the query sees no key anywhere)."""
    b, tp, h, d = q.shape
    kh = k.shape[2]
    g = h // kh

    def step(_, carry):
        out, lse, kv = carry
        nxt = _rotate(kv, axis, n)
        kj, vj, kdesc = kv
        o, l_blocks = _forward(q, kj, vj, MaskSpec(spec.q_segment, spec.q_index, *kdesc), bq, bk, skip)
        out, lse = _merge(out, lse, o.reshape(b, tp, kh, g, d), _rows(l_blocks, b, tp))
        return out, lse, nxt

    init = (
        jnp.zeros((b, tp, kh, g, d), jnp.float32),
        jnp.full((b, tp, kh, g), -jnp.inf, jnp.float32),
        (k, v, (spec.k_segment, spec.k_first, spec.k_end)),
    )
    out, lse, _ = lax.fori_loop(0, n, step, init)
    return out.reshape(b, tp, h, d), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _ring(q, k, v, spec, axis, n, bq, bk, skip):
    return _ring_forward(q, k, v, spec, axis, n, bq, bk, skip)[0]


def _ring_fwd(q, k, v, spec, axis, n, bq, bk, skip):
    out, lse = _ring_forward(q, k, v, spec, axis, n, bq, bk, skip)
    return out, (q, k, v, spec, out, lse)


def _ring_bwd(axis, n, bq, bk, skip, res, dout):
    q, k, v, spec, out, lse_rows = res
    lse = _blocks_lse(lse_rows, bq)

    def step(_, carry):
        dq, kv, dkv = carry
        kj, vj, kdesc = kv
        local = MaskSpec(spec.q_segment, spec.q_index, *kdesc)
        dq_j, dk_j, dv_j = _backward(q, kj, vj, local, out, lse, dout, bq, bk, skip)
        dkv = (dkv[0] + dk_j.astype(jnp.float32), dkv[1] + dv_j.astype(jnp.float32))
        kv, dkv = _rotate((kv, dkv), axis, n)  # after n steps each block and its gradient are home
        return dq + dq_j.astype(jnp.float32), kv, dkv

    zeros = jnp.zeros(k.shape, jnp.float32)
    kv = (k, v, (spec.k_segment, spec.k_first, spec.k_end))
    dq, _, (dk, dv) = lax.fori_loop(0, n, step, (jnp.zeros(q.shape, jnp.float32), kv, (zeros, zeros)))
    spec_zero = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), spec)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), spec_zero


_ring.defvjp(_ring_fwd, _ring_bwd)


def _local(q, k, v, spec: MaskSpec, *, axis: str, n: int, block_q: int, block_k: int, skip: bool):
    """The per-device body: pads this shard's tokens to whole blocks (segment 0) and runs the ring."""
    t = q.shape[1]
    bq, bk = min(block_q, t), min(block_k, t)
    tp = -(-t // np.lcm(bq, bk)) * int(np.lcm(bq, bk))
    padded = jax.tree.map(lambda a: _pad(a, tp), spec)
    out = _ring(_pad(q, tp).astype(jnp.float32), _pad(k, tp), _pad(v, tp), padded, axis, n, bq, bk, skip)
    return out[:, :t].astype(q.dtype)


def batch_axes(mesh, batch: int, axis: str = CONTEXT_AXIS) -> tuple[str, ...]:
    """The mesh axes (other than ``axis``, size > 1) that split the batch dimension, in mesh order, as long
    as their product divides ``batch``: the rows stay data-parallel inside the ring's shard_map."""
    out, size = [], 1
    for name in mesh.axis_names:
        k = mesh.shape[name]
        if name == axis or k == 1 or batch % (size * k):
            continue
        out.append(name)
        size *= k
    return tuple(out)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    spec: MaskSpec,
    *,
    mesh=None,
    axis: str = CONTEXT_AXIS,
    block_q: int = 128,
    block_k: int = 128,
    skip_empty_blocks: bool = True,
) -> jax.Array:
    """q: [B, T, H, D], k, v: [B, T, K, D], spec: MaskSpec with S = T -> [B, T, H, D] in q.dtype.

    ``blockwise_attention(q, k, v, spec)`` computed with T split over the ``axis`` devices of ``mesh``
    (default: the mesh set with ``jax.set_mesh``): device i holds tokens ``[i T/n, (i+1) T/n)`` of the
    layout given (permute with ``zigzag_permutation`` / ``to_zigzag`` first to balance a causal mask).
    T must be a multiple of the axis size. Rows are split over the mesh's other axes where they divide B.
    Differentiable in q, k, v (``custom_vjp``; gradients equal the single-device ones).
    """
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or axis not in mesh.axis_names:
        raise ValueError(
            f"ring attention needs a mesh with a {axis!r} axis (model.context_parallel > 1): pass mesh= or run "
            "under jax.set_mesh(mesh) with mesh axes including 'context' (sharding.make_mesh(..., {'context': n}))"
        )
    n = int(mesh.shape[axis])
    b, t = q.shape[:2]
    if k.shape[1] != t or t % n:
        raise ValueError(
            f"ring attention over {n} {axis!r} shards needs q and k of one length divisible by {n}; got "
            f"q {q.shape}, k {k.shape}"
        )
    rows = batch_axes(mesh, b, axis) or None
    tok = P(rows, axis)
    body = functools.partial(_local, axis=axis, n=n, block_q=block_q, block_k=block_k, skip=bool(skip_empty_blocks))
    spec_specs = jax.tree.map(lambda _: tok, spec)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, spec_specs), out_specs=tok, check_vma=False)
    return fn(q, k, v, spec)
