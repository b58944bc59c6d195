"""Pallas flash attention over a ``MaskSpec`` (the GPU kernel for ``attention_impl="pallas"``).

Adapted from jax's ``jax.experimental.pallas.ops.gpu.attention`` (the Triton fused attention), with its
segment-id/causal mask replaced by the ``blockwise.MaskSpec`` rule: each program loads the descriptor
slices of its query block and of each key block and computes that ``[bq, bk]`` block's mask in the kernel

    query (b, t) sees key (b, s)  iff  q_segment[b, t] != 0 and q_segment[b, t] == k_segment[b, s]
                                       and k_first[b, s] <= q_index[b, t] < k_end[b, s]

so the mask is never ``[T, S]``; a block no query of the tile sees is skipped (``lax.cond``, no dot).
Three ``pallas_call``s: the forward (grid ``(B, H, T / bq)``, online softmax over key blocks, saves the
per-row logsumexp), and a ``custom_vjp`` backward that recomputes each block's probabilities as
``blockwise.py`` does: a dK/dV kernel (grid ``(B, H, S / bk)``, loop over query blocks) and a dQ kernel
(grid ``(B, H, T / bq)``, loop over key blocks). GQA: query head ``h`` reads KV head ``h // G`` through the
BlockSpec index map; dK/dV come out per query head and are summed over the G heads of a KV head outside.

A query that sees no key returns 0 and gets zero gradients (``blockwise_attention``'s convention). Dots take
the inputs' dtype and accumulate in f32 (p and dS are cast to the input dtype for the second dots, as the
jax kernel does); in f32 this is ``blockwise_attention`` to rounding. T, S are padded to the block sizes
(padding queries and keys get segment 0) and D to a power of two. ``interpret`` defaults to True on CPU
(the Pallas interpreter: how it is tested here), otherwise the kernel compiles through Triton (NVIDIA GPU).
TPU is refused: Splash attention does not take per-token tree masks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gyre_jax.model.blockwise import MaskSpec, _check, _pad

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: no inf - inf in the online softmax
TPU_UNSUPPORTED = (
    "attention_impl='pallas' is not supported yet on TPU: use attention_impl='blockwise' "
    "(Splash attention does not take per-token tree masks)"
)


def _block_mask(qseg, qidx, kseg, kfirst, kend) -> jax.Array:
    """q_*: [bq], k_*: [bk] int32 -> [bq, bk] bool: the MaskSpec rule on one block."""
    qs, qi = qseg[:, None], qidx[:, None]
    same = (qs == kseg[None, :]) & (qs != 0)
    return same & (kfirst[None, :] <= qi) & (qi < kend[None, :])


def _any(mask: jax.Array) -> jax.Array:
    """Whether any element of a block mask is True (an int reduction: Triton lowers reduce_max)."""
    return jnp.max(mask.astype(jnp.int32)) > 0


def _fwd_kernel(q_ref, k_ref, v_ref, qseg_ref, qidx_ref, kseg_ref, kfirst_ref, kend_ref, o_ref, lse_ref, **kw):
    """One (batch, head, query block): online softmax over the key blocks this block can see."""
    scale, bk = kw["scale"], kw["block_k"]
    q = q_ref[...]  # [bq, D]
    qseg, qidx = qseg_ref[...], qidx_ref[...]

    def body(j, carry):
        sl = pl.ds(j * bk, bk)
        mask = _block_mask(qseg, qidx, kseg_ref[sl], kfirst_ref[sl], kend_ref[sl])

        def update(c):
            acc, m, denom = c
            k, v = k_ref[sl, :], v_ref[sl, :]
            s = jnp.where(mask, plgpu.dot(q, k, trans_b=True) * scale, MASK_VALUE)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
            alpha = jnp.exp(m - m_new)
            acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
            return acc, m_new, denom * alpha + p.sum(-1)

        return lax.cond(_any(mask), update, lambda c: c, carry)

    bq, d = q.shape
    init = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, denom = lax.fori_loop(0, k_ref.shape[0] // bk, body, init)
    denom = jnp.where(denom > 0, denom, 1.0)  # a row that sees nothing: acc = 0 -> output 0
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(denom)


def _probs(q, k, mask, lse, scale):
    """Recomputed probabilities of one block: [bq, bk] f32, 0 where masked."""
    return jnp.where(mask, jnp.exp(plgpu.dot(q, k, trans_b=True) * scale - lse[:, None]), 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, qseg_ref, qidx_ref, kseg_ref, kfirst_ref, kend_ref, dq_ref, **kw):  # fmt: skip
    """One (batch, head, query block): dQ summed over the visible key blocks."""
    scale, bk = kw["scale"], kw["block_k"]
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], dl_ref[...]
    qseg, qidx = qseg_ref[...], qidx_ref[...]

    def body(j, dq):
        sl = pl.ds(j * bk, bk)
        mask = _block_mask(qseg, qidx, kseg_ref[sl], kfirst_ref[sl], kend_ref[sl])

        def update(dq):
            k, v = k_ref[sl, :], v_ref[sl, :]
            p = _probs(q, k, mask, lse, scale)
            ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None]) * scale
            return dq + plgpu.dot(ds.astype(k.dtype), k)

        return lax.cond(_any(mask), update, lambda c: c, dq)

    dq = lax.fori_loop(0, k_ref.shape[0] // bk, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, qseg_ref, qidx_ref, kseg_ref, kfirst_ref, kend_ref, dk_ref, dv_ref, **kw):  # fmt: skip
    """One (batch, query head, key block): this head's dK and dV over the query blocks that see the block."""
    scale, bq = kw["scale"], kw["block_q"]
    k, v = k_ref[...], v_ref[...]  # [bk, D]
    kseg, kfirst, kend = kseg_ref[...], kfirst_ref[...], kend_ref[...]

    def body(i, carry):
        sl = pl.ds(i * bq, bq)
        mask = _block_mask(qseg_ref[sl], qidx_ref[sl], kseg, kfirst, kend)

        def update(c):
            dk, dv = c
            q, do = q_ref[sl, :], do_ref[sl, :]
            p = _probs(q, k, mask, lse_ref[sl], scale)
            dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
            ds = p * (plgpu.dot(do, v, trans_b=True) - dl_ref[sl][:, None]) * scale
            return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True), dv

        return lax.cond(_any(mask), update, lambda c: c, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, q_ref.shape[0] // bq, body, (zeros, zeros))
    dk_ref[...], dv_ref[...] = dk, dv


def _specs(b_q: int, b_k: int, tp: int, sp: int, d: int, g: int, over: str) -> dict[str, pl.BlockSpec]:
    """BlockSpecs on a grid (B, H, n): ``over`` = "q" tiles queries by ``b_q`` (keys whole), "k" tiles keys
    by ``b_k`` (queries whole). q-like arrays are [B, Tp, H, D], k-like [B, Sp, K, D], per-row stats
    [B, H, Tp], query descriptors [B, Tp], key descriptors [B, Sp]."""
    tq, tk = (b_q, sp) if over == "q" else (tp, b_k)
    qi = (lambda b, h, n: n) if over == "q" else (lambda b, h, n: 0)
    ki = (lambda b, h, n: 0) if over == "q" else (lambda b, h, n: n)
    return {
        "q": pl.BlockSpec((None, tq, None, d), lambda b, h, n: (b, qi(b, h, n), h, 0)),
        "kv": pl.BlockSpec((None, tk, None, d), lambda b, h, n: (b, ki(b, h, n), h // g, 0)),
        "k_per_head": pl.BlockSpec((None, tk, None, d), lambda b, h, n: (b, ki(b, h, n), h, 0)),
        "stat": pl.BlockSpec((None, None, tq), lambda b, h, n: (b, h, qi(b, h, n))),
        "qdesc": pl.BlockSpec((None, tq), lambda b, h, n: (b, qi(b, h, n))),
        "kdesc": pl.BlockSpec((None, tk), lambda b, h, n: (b, ki(b, h, n))),
    }


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret: bool, name: str):
    params = None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=2)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name=name,
    )


def _descriptors(spec: MaskSpec) -> tuple[jax.Array, ...]:
    return spec.q_segment, spec.q_index, spec.k_segment, spec.k_first, spec.k_end


def _forward(q, k, v, spec: MaskSpec, bq: int, bk: int, scale: float, interpret: bool):
    """Padded q [B, Tp, H, D], k, v [B, Sp, K, D] -> (out [B, Tp, H, D] in q.dtype, lse [B, H, Tp] f32)."""
    b, tp, h, d = q.shape
    g = h // k.shape[2]
    s = _specs(bq, bk, tp, k.shape[1], d, g, "q")
    kernel = functools.partial(_fwd_kernel, scale=scale, block_k=bk)
    in_specs = [s["q"], s["kv"], s["kv"], s["qdesc"], s["qdesc"], s["kdesc"], s["kdesc"], s["kdesc"]]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, tp), jnp.float32)]
    call = _call(kernel, (b, h, tp // bq), in_specs, [s["q"], s["stat"]], out_shape, interpret, "maskspec_fwd")
    out, lse = call(q, k, v, *_descriptors(spec))
    return out, lse


def _backward(q, k, v, spec: MaskSpec, out, lse, dout, bq: int, bk: int, scale: float, interpret: bool):
    """The two backward kernels on padded arrays -> dq, dk, dv in the dtypes of q, k, v."""
    b, tp, h, d = q.shape
    sp, kh = k.shape[1], k.shape[2]
    g = h // kh
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), dout.astype(jnp.float32))
    args = (q, k, v, dout, lse, delta, *_descriptors(spec))
    s = _specs(bq, bk, tp, sp, d, g, "q")
    in_specs = [s["q"], s["kv"], s["kv"], s["q"], s["stat"], s["stat"], s["qdesc"], s["qdesc"], *[s["kdesc"]] * 3]
    kernel = functools.partial(_dq_kernel, scale=scale, block_k=bk)
    out_dq = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    dq = _call(kernel, (b, h, tp // bq), in_specs, s["q"], out_dq, interpret, "maskspec_dq")(*args)

    s = _specs(bq, bk, tp, sp, d, g, "k")
    in_specs = [s["q"], s["kv"], s["kv"], s["q"], s["stat"], s["stat"], s["qdesc"], s["qdesc"], *[s["kdesc"]] * 3]
    kernel = functools.partial(_dkv_kernel, scale=scale, block_q=bq)
    per_head = jax.ShapeDtypeStruct((b, sp, h, d), jnp.float32)  # summed over each KV head's G query heads below
    outs = [s["k_per_head"], s["k_per_head"]]
    dk, dv = _call(kernel, (b, h, sp // bk), in_specs, outs, [per_head, per_head], interpret, "maskspec_dkv")(*args)
    dk, dv = (x.reshape(b, sp, kh, g, d).sum(3) for x in (dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(q, k, v, spec, bq, bk, scale, interpret):
    return _forward(q, k, v, spec, bq, bk, scale, interpret)[0]


def _attention_fwd(q, k, v, spec, bq, bk, scale, interpret):
    out, lse = _forward(q, k, v, spec, bq, bk, scale, interpret)
    return out, (q, k, v, spec, out, lse)


def _attention_bwd(bq, bk, scale, interpret, res, dout):
    q, k, v, spec, out, lse = res
    dq, dk, dv = _backward(q, k, v, spec, out, lse, dout, bq, bk, scale, interpret)
    spec_zero = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), spec)
    return dq, dk, dv, spec_zero


_attention.defvjp(_attention_fwd, _attention_bwd)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _block(requested: int, length: int, interpret: bool) -> int:
    """The block size used: ``requested`` capped at the length rounded up to a power of two (Triton tiles are
    powers of two, at least 16 for its dots; the interpreter takes any size)."""
    size = min(requested, _pow2(length) if not interpret else length)
    if not interpret and (size < 16 or size != _pow2(size)):
        raise ValueError(
            f"attention block size {requested} (for length {length}) must be a power of two >= 16 for the Triton "
            "kernel: set model.attention_block_q / attention_block_k accordingly"
        )
    return size


def pallas_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    spec: MaskSpec,
    *,
    block_q: int = 128,
    block_k: int = 128,
    interpret: bool | None = None,
) -> jax.Array:
    """q: [B, T, H, D], k, v: [B, S, K, D] (H a multiple of K), spec: MaskSpec -> [B, T, H, D] in q.dtype.

    What ``blockwise.blockwise_attention`` computes (a query that sees no key returns 0), as Pallas kernels;
    differentiable in q, k, v. ``interpret=None`` interprets on CPU and compiles through Triton elsewhere;
    TPU raises (not supported yet: use "blockwise").
    """
    _check(q, k, v, spec)
    backend = jax.default_backend()
    if backend == "tpu":
        raise NotImplementedError(TPU_UNSUPPORTED)
    interpret = backend == "cpu" if interpret is None else bool(interpret)
    t, s, d = q.shape[1], k.shape[1], q.shape[3]
    bq, bk = _block(block_q, t, interpret), _block(block_k, s, interpret)
    tp, sp, dp = -(-t // bq) * bq, -(-s // bk) * bk, max(_pow2(d), 1 if interpret else 16)
    pad_d = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, dp - d)])  # noqa: E731 (zeros: same logits, cut below)
    padded = MaskSpec(
        _pad(spec.q_segment, tp), _pad(spec.q_index, tp), _pad(spec.k_segment, sp), _pad(spec.k_first, sp),
        _pad(spec.k_end, sp),
    )  # fmt: skip
    q_, k_, v_ = pad_d(_pad(q, tp)), pad_d(_pad(k, sp)), pad_d(_pad(v, sp))
    out = _attention(q_, k_, v_, padded, bq, bk, float(d) ** -0.5, interpret)
    return out[:, :t, :, :d]
