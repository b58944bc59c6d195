"""Grouped-query attention with RoPE (and Qwen3's q/k RMSNorm: ``cfg.qk_norm``), over a mask and an optional KV cache.

A mask is either dense, ``mask[b, q, k]`` True where query ``q`` may attend to key ``k`` ([B, T, S] bool,
for ``attention_impl`` "xla": ``dense_attention``, and "cudnn": ``jax.nn.dot_product_attention``), or a
``blockwise.MaskSpec`` (per-token descriptors, never [T, S]: ``attention_impl="blockwise"``,
``blockwise.blockwise_attention``; with ``context_parallel > 1`` and no cache, ``ring.ring_attention`` over the
current mesh's ``context`` axis; ``attention_impl="pallas"``, ``pallas_attention.pallas_attention``, the same mask
in a Pallas kernel).
Two layouts are in use: the packed training row (a prefix tree per segment; plain rows are causal) and
the cache (serving, where a key's cache index equals its position). ``tree_mask`` and ``cache_mask``
build either kind for a config: every forward of the system takes its mask from them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gyre_jax.model.blockwise import MaskSpec, blockwise_attention, cache_mask_spec, dense_mask, tree_mask_spec
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.layers import Einsum, RMSNorm
from gyre_jax.model.lora import lora_arg
from gyre_jax.model.pallas_attention import pallas_attention
from gyre_jax.model.positional_embeddings import apply_rope, rope_frequencies
from gyre_jax.model.ring import ring_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
    """One layer's KV cache. k, v: [B, S, K, D]; index s holds the key/value of the token at position s."""

    k: jax.Array
    v: jax.Array

    @property
    def length(self) -> int:
        """S: the positions the cache holds."""
        return self.k.shape[1]

    def write(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> LayerCache:
        """k, v: [B, T, K, D] written at positions [B, T] of rows 0..B-1 (the cache may hold more rows than the
        batch); positions >= S are dropped."""
        return LayerCache(k=write_cache(self.k, k, positions), v=write_cache(self.v, v, positions))

    def read(self, batch: int, length: int) -> tuple[jax.Array, jax.Array]:
        """Rows [0, batch) and positions [0, length) as k, v [batch, length, K, D]."""
        return self.k[:batch, :length], self.v[:batch, :length]

    def window(self, batch: int, length: int) -> tuple[str, list[tuple[jax.Array, jax.Array]]]:
        """``decode_attention``'s view: (einsum spec of a chunk, [(k, v)] chunks covering positions [0, length))."""
        return "bskd", [self.read(batch, length)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowCache(LayerCache):
    """The cache of a forward over packed rows (``serving.steps.prefill_many``): index t of row b holds the key/value
    of the row's token t, whatever its position. A packed row holds several prompts, each from position 0 (its
    RoPE positions), so the positions cannot be the indexes; a ``LayerCache`` would write two prompts' tokens at one
    index. k, v: [B, T, K, D], the forward's own shape."""

    def write(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> RowCache:
        """k, v: [B, T, K, D], the whole rows (``positions`` unused: index = column)."""
        if k.shape != self.k.shape:
            raise ValueError(f"a RowCache of {self.k.shape} holds exactly its forward's rows; got keys {k.shape}")
        return RowCache(k=k.astype(self.k.dtype), v=v.astype(self.v.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockedCache:
    """The decode slots' KV cache of one layer (``serving.kv_cache.DecodeState``): heads first and split along the
    positions into blocks, one buffer each. k, v: tuples of [B, K, n_i, D]; block i holds positions
    [sum(n_<i), sum(n_<=i)).

    The blocks are the steps between the engine's decode windows, so a decode step over a window reads whole blocks
    where they lie: no copy of the window out of a longer buffer and no transpose (one key head's positions are
    contiguous), where a [B, S, K, D] cache cost two copies of the window per array and step. A step writes its one
    new row per slot in place (a scatter into each block, rows outside it dropped)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(b.shape[2]) for b in self.k)

    @property
    def length(self) -> int:
        return sum(self.sizes)

    def _offsets(self) -> list[int]:
        return [sum(self.sizes[:i]) for i in range(len(self.sizes))]

    def write(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> BlockedCache:
        """k, v: [B, T, K, D] written at positions [B, T] of rows 0..B-1 (B <= the slots); positions >= S dropped.

        A single row (B = T = 1) goes in with a second, dropped copy: XLA rewrites a scatter of one update as a
        dynamic-update-slice and, on a cache of one slot, fuses that update into each reader of the block (the
        attention's matmuls see it through a bitcast that drops the slot axis), copying the whole block two to four
        times per step; a scatter of two updates stays one in-place write. Measured on a 2-core CPU: bench_vs_tunix's
        batch-1 step 1.38x faster (~0.5 ms less; median of 15 pairs), one layer's write + attention over 1024
        positions of 8 KV heads x 128 0.38 vs 1.04 ms (docs/serving.md)."""
        if k.shape[0] * k.shape[1] == 1:
            k, v = (jnp.concatenate([x, x], axis=1) for x in (k, v))
            positions = jnp.concatenate([positions, jnp.full_like(positions, self.length)], axis=1)
        b = jnp.arange(k.shape[0])[:, None]

        def row(block, rel, new):  # one slot: block [K, n, D], rel [T], new [T, K, D]
            return block.at[:, rel].set(jnp.swapaxes(new, 0, 1), mode="drop")

        def put(blocks, new):
            out = []
            for block, first in zip(blocks, self._offsets()):
                n = block.shape[2]
                rel = jnp.where((positions >= first) & (positions < first + n), positions - first, n)  # n: dropped
                new = new.astype(block.dtype)
                if new.shape[0] == block.shape[0]:  # every slot: the slot axis is the scatter's batch axis, so slots
                    out.append(jax.vmap(row)(block, rel, new))  # split over devices (processes) write locally
                else:  # rows 0..B-1 of more slots: an index scatter (the partitioner gathers its indices, updates)
                    out.append(block.at[b, :, rel].set(new, mode="drop"))  # indexes [B, T, K, D]
            return tuple(out)

        return BlockedCache(k=put(self.k, k), v=put(self.v, v))

    def window(self, batch: int, length: int) -> tuple[str, list[tuple[jax.Array, jax.Array]]]:
        """Rows [0, batch) of the blocks covering positions [0, length) as [batch, K, n, D] chunks (the last one cut
        when ``length`` is not on a block boundary): ``decode_attention``'s view."""
        chunks = []
        for kb, vb, first in zip(self.k, self.v, self._offsets()):
            if first >= length:
                break
            n = min(kb.shape[2], length - first)
            chunks.append((kb[:batch, :, :n], vb[:batch, :, :n]))
        return "bksd", chunks

    def read(self, batch: int, length: int) -> tuple[jax.Array, jax.Array]:
        """Rows [0, batch) and positions [0, length) as k, v [batch, length, K, D] (a copy)."""
        _, chunks = self.window(batch, length)
        return _sequence_major([k for k, _ in chunks]), _sequence_major([v for _, v in chunks])

    def rows(self, start: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
        """Rows [start, start + count) (start traced) as k, v [count, S, K, D]."""
        cut = lambda blocks: [jax.lax.dynamic_slice_in_dim(x, start, count, axis=0) for x in blocks]  # noqa: E731
        return _sequence_major(cut(self.k)), _sequence_major(cut(self.v))


def _sequence_major(blocks: list[jax.Array]) -> jax.Array:
    """Consecutive blocks [B, K, n_i, D] -> [B, sum(n_i), K, D] (a copy)."""
    return jnp.swapaxes(jnp.concatenate(blocks, axis=2), 1, 2)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> list[LayerCache]:
    """Zero caches [batch, length, K, D] per layer."""
    dtype = dtype or cfg.compute_dtype
    shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    return [LayerCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]


def init_row_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> list[RowCache]:
    """``RowCache`` per layer for a forward over [batch, length] packed rows (zeros until the forward writes them)."""
    return [RowCache(k=c.k, v=c.v) for c in init_cache(cfg, batch, length, dtype)]


def init_blocked_cache(cfg: ModelConfig, batch: int, sizes: tuple[int, ...], dtype=None) -> list[BlockedCache]:
    """Zero ``BlockedCache`` per layer: blocks [batch, K, n, D] for n in ``sizes``."""
    dtype = dtype or cfg.compute_dtype
    shapes = [(batch, cfg.num_kv_heads, n, cfg.head_dim) for n in sizes]
    return [
        BlockedCache(k=tuple(jnp.zeros(x, dtype) for x in shapes), v=tuple(jnp.zeros(x, dtype) for x in shapes))
        for _ in range(cfg.num_layers)
    ]


MASK_SPEC_IMPLS = ("blockwise", "pallas")  # the attention_impls that take a MaskSpec; the others a dense mask


def tree_causal_mask(segment_ids: jax.Array, subtree_end: jax.Array) -> jax.Array:
    """segment_ids, subtree_end: [B, T] int -> [B, T, T] bool: query i sees key j iff same non-zero segment
    and ``j <= i < subtree_end[j]`` (``blockwise.tree_mask_spec``, the one statement of the rule, made dense)."""
    return dense_mask(tree_mask_spec(segment_ids, subtree_end))


def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """segment_ids: [B, T] int32 (0 = padding) -> mask [B, T, T]: same non-zero segment and key index <= query index."""
    t = segment_ids.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids != 0)[:, :, None]
    return causal[None] & same & real


def cache_causal_mask(positions: jax.Array, cache_len: int) -> jax.Array:
    """positions: [B, T] int32 -> mask [B, T, S]: key cache index <= query position."""
    return jnp.arange(cache_len)[None, None, :] <= positions[:, :, None]


def tree_mask(cfg: ModelConfig, segment_ids: jax.Array, subtree_end: jax.Array) -> jax.Array | MaskSpec:
    """The packed-row mask for ``cfg.attention_impl``: segment_ids, subtree_end: [B, T] int -> a MaskSpec
    ("blockwise", "pallas") or ``tree_causal_mask``'s [B, T, T] bool. A plain causal row has ``subtree_end = T``."""
    if cfg.attention_impl in MASK_SPEC_IMPLS:
        return tree_mask_spec(segment_ids, subtree_end)
    return tree_causal_mask(segment_ids, subtree_end)


def segment_mask(cfg: ModelConfig, segment_ids: jax.Array) -> jax.Array | MaskSpec:
    """``tree_mask`` of plain causal segments (no prefix trees): segment_ids [B, T] int, 0 = padding."""
    t = segment_ids.shape[1]
    return tree_mask(cfg, segment_ids, jnp.full(segment_ids.shape, t, jnp.int32))


def cache_mask(cfg: ModelConfig, positions: jax.Array, cache_len: int) -> jax.Array | MaskSpec:
    """The serving mask for ``cfg.attention_impl``: positions [B, T] int -> a MaskSpec over ``cache_len``
    slots ("blockwise", "pallas") or ``cache_causal_mask``'s [B, T, cache_len] bool (slot s visible iff
    s <= position)."""
    if cfg.attention_impl in MASK_SPEC_IMPLS:
        return cache_mask_spec(positions, cache_len)
    return cache_causal_mask(positions, cache_len)


def _check_mask_kind(impl: str, mask) -> None:
    """Raises when the mask's kind is not the one ``impl`` computes with."""
    spec = isinstance(mask, MaskSpec)
    if spec != (impl in MASK_SPEC_IMPLS):
        got = "a MaskSpec" if spec else "a dense [B, T, S] mask"
        raise ValueError(
            f"attention_impl={impl!r} cannot take {got}: build the mask with attention.tree_mask / cache_mask / "
            "segment_mask for the same ModelConfig (they return a MaskSpec for 'blockwise' and 'pallas', a dense mask "
            "otherwise)"
        )


def write_cache(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Scatters new: [B, T, K, D] into rows 0..B-1 of cache: [B', S, K, D] (B' >= B) at positions: [B, T];
    positions >= S are dropped."""
    b = jnp.arange(new.shape[0])[:, None]
    return cache.at[b, positions].set(new.astype(cache.dtype), mode="drop")


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B, T, H, D], k and v [B, S, K, D] (H = K * G), mask [B, T, S] bool -> [B, T, H, D] in q's dtype:
    ``jax.nn.dot_product_attention``'s result to float rounding, a query that sees no key included (the mean of
    all S values there, as ``jax.nn.dot_product_attention``: the masked scores are the float32 minimum, not -inf).

    Laid out for the batched matmuls: each KV head's G query heads and T queries are one [G * T, D] operand against
    its keys where they lie ([B, K, ...] leading: no copies of the [B, K, G, T, S] scores), the scores kept in float32
    and exponentiated against their row maximum, the values' products normalised after the matmul (in float32, as
    flash attention does). Measured on a 2-core CPU (forward + backward of [8, 256] queries, 8 heads x 32, 4 KV heads,
    causal; best of 7 x 5): 41 ms against 66 ms through ``jax.nn.dot_product_attention``, whose XLA implementation
    transposes the scores and probabilities for its [B, N, T, S] matmuls."""
    b, t, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    qg = q.reshape(b, t, kh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, d)
    k, v = (x.astype(q.dtype).transpose(0, 2, 1, 3) for x in (k, v))  # [B, K, S, D]
    scores = jnp.einsum("bkmd,bksd->bkms", qg, k, preferred_element_type=jnp.float32).reshape(b, kh, g, t, -1)
    scores = jnp.where(mask[:, None, None], scores * np.float32(1 / np.sqrt(d)), jnp.finfo(jnp.float32).min)
    top = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))  # the softmax is shift-invariant
    e = jnp.exp(scores - top)  # [B, K, G, T, S] float32
    out = jnp.einsum(
        "bkms,bksd->bkmd", e.astype(q.dtype).reshape(b, kh, g * t, -1), v, preferred_element_type=jnp.float32
    )
    out = out.reshape(b, kh, g, t, d) / jnp.sum(e, axis=-1, keepdims=True)
    return out.astype(q.dtype).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def decode_attention(q: jax.Array, cache: LayerCache | BlockedCache, mask: jax.Array) -> jax.Array:
    """One query per row over the first W keys of rows 0..B-1 of ``cache``: q [B, 1, H, D] (H = K * G), mask
    [B, 1, W] bool with at least one True per row (W <= the cache's length) -> [B, 1, H, D];
    ``jax.nn.dot_product_attention``'s result to float rounding.

    The query heads are grouped per KV head and contracted with the keys where they lie (``cache.window``: one chunk
    of a [B, S, K, D] cache, or the blocks of a ``BlockedCache``, scores joined before the softmax and the values'
    products summed after), the mask broadcast over the heads only inside the fused select. Measured on a 2-core CPU
    (one layer's write + attention over a [32, 256] window of 32 x 1024 positions, best of 5 x 50): 0.19-0.26 ms on
    a ``BlockedCache`` of blocks (128, 128, 256, 512), 0.37-0.58 ms on one heads-first [32, K, 1024, D] buffer
    (the window copied out), 0.86-1.5 ms on [32, 1024, K, D] (XLA also transposes the keys for the matmul) and
    1.5-1.7 ms through ``jax.nn.dot_product_attention`` (docs/serving.md)."""
    b, _, h, d = q.shape
    spec, chunks = cache.window(b, mask.shape[-1])
    kh = chunks[0][0].shape[spec.index("k")]
    qg = q.reshape(b, kh, h // kh, d)
    scale = np.sqrt(d).astype(np.float32)
    scores = [
        jnp.einsum(f"bkgd,{spec}->bkgs", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) for k, _ in chunks
    ]
    scores = jnp.concatenate(scores, axis=-1) / scale if len(scores) > 1 else scores[0] / scale
    scores = jnp.where(mask[:, :, None, :], scores, jnp.finfo(jnp.float32).min)  # mask [B, 1, W] -> [B, 1, 1, W]
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out, first = None, 0
    for _, v in chunks:
        n = v.shape[spec.index("s")]
        part = jnp.einsum(f"bkgs,{spec}->bkgd", probs[..., first : first + n], v.astype(q.dtype))
        out, first = part if out is None else out + part, first + n
    return out.reshape(b, 1, h, d)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, h, k, d = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd = cfg.weight_dtype
        self.cfg = cfg
        bias = 2 if cfg.qkv_bias else 0
        self.q_proj = Einsum(
            (e, h, d), ("embed", "heads", "head_dim"), fan_in=e, param_dtype=pd, rngs=rngs, bias_dims=bias,
            lora=lora_arg(cfg, "q_proj", 1),
        )  # fmt: skip
        self.k_proj = Einsum(
            (e, k, d), ("embed", "kv_heads", "head_dim"), fan_in=e, param_dtype=pd, rngs=rngs, bias_dims=bias,
            lora=lora_arg(cfg, "k_proj", 1),
        )  # fmt: skip
        self.v_proj = Einsum(
            (e, k, d), ("embed", "kv_heads", "head_dim"), fan_in=e, param_dtype=pd, rngs=rngs, bias_dims=bias,
            lora=lora_arg(cfg, "v_proj", 1),
        )  # fmt: skip
        self.o_proj = Einsum(
            (h, d, e), ("heads", "head_dim", "embed"), fan_in=h * d, param_dtype=pd, rngs=rngs,
            bias_dims=1 if cfg.o_bias else 0, lora=lora_arg(cfg, "o_proj", 2),
        )  # fmt: skip
        if cfg.qk_norm:  # Qwen3; Llama and Qwen2 have none
            self.q_norm = RMSNorm(d, "head_dim", eps=cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
            self.k_norm = RMSNorm(d, "head_dim", eps=cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: jax.Array | MaskSpec,
        cache: LayerCache | BlockedCache | None = None,
    ) -> tuple[jax.Array, LayerCache | BlockedCache | None]:
        """x: [B, T, E], positions: [B, T], mask: [B, T, S] bool or a MaskSpec over S keys, per
        ``cfg.attention_impl`` (S = T without cache, cache length with one).

        With a cache, this call's keys/values are first written at ``positions``, then queries attend
        over the whole cache; a decode step (T = 1) attends over its first S keys only (S from the mask: a window of
        a longer cache) and over its first B rows (a batch of the first B decode slots). Returns ([B, T, E], updated
        cache or None). "blockwise" and "pallas" compute a single query (T = 1: a decode step) as "xla" does, over
        the MaskSpec's dense [B, 1, S] mask.
        """
        q = self.q_proj("bte,ehd->bthd", x)
        k = self.k_proj("bte,ekd->btkd", x)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj("bte,ekd->btkd", x)
        inv_freq, scale = rope_frequencies(self.cfg)  # numpy constants, folded at trace time
        q = apply_rope(q, positions, self.cfg.rope_theta, inv_freq=inv_freq, scale=scale)
        k = apply_rope(k, positions, self.cfg.rope_theta, inv_freq=inv_freq, scale=scale)
        impl = self.cfg.attention_impl
        _check_mask_kind(impl, mask)
        if cache is not None:
            cache = cache.write(k, v, positions)
        if q.shape[1] == 1 and impl != "cudnn":  # a decode step: its mask [B, 1, S] is small (for a MaskSpec:
            # one query over S keys in blocks would be S / block_k dependent loop steps)
            dense = dense_mask(mask) if impl in MASK_SPEC_IMPLS else mask
            out = decode_attention(q, LayerCache(k, v) if cache is None else cache, dense)
            return self._project_out(out), cache
        if cache is not None:  # the mask's S keys: the whole cache, or a window of it
            keys = mask.k_segment.shape[1] if isinstance(mask, MaskSpec) else mask.shape[-1]
            k, v = (x.astype(q.dtype) for x in cache.read(q.shape[0], keys))
        if impl == "pallas":
            bq, bk = self.cfg.attention_block_q, self.cfg.attention_block_k
            out = pallas_attention(q, k, v, mask, block_q=bq, block_k=bk)  # [B, T, H, D]
        elif impl == "blockwise":
            bq, bk = self.cfg.attention_block_q, self.cfg.attention_block_k
            if self.cfg.context_parallel > 1 and cache is None:  # T split over the mesh's context axis
                out = ring_attention(q, k, v, mask, block_q=bq, block_k=bk)
            else:
                out = blockwise_attention(q, k, v, mask, block_q=bq, block_k=bk)  # [B, T, H, D]
        elif impl == "cudnn":
            out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None, :, :], implementation="cudnn")
        else:
            out = dense_attention(q, k, v, mask)
        return self.o_proj("bthd,hde->bte", out), cache

    def _project_out(self, out: jax.Array) -> jax.Array:
        """A decode step's [B, 1, H, D] -> [B, 1, E]: o_proj as one contraction over H * D (its [H, D, E] weight
        viewed as [H * D, E], a free reshape). Contracting two dims, XLA's CPU backend copied the weight transposed
        in every decode step (0.25 MB per layer for 8 x 32 -> 256: ~13% of a batch-1 step). The forwards with T > 1
        keep the two-dim einsum: one copy per call there, and the 4-D output stays the single saved residual."""
        b, t, h, d = out.shape
        return self.o_proj("btf,fe->bte", out.reshape(b, t, h * d), weight_shape=(h * d, -1))
