"""KV pages: the session prefix cache's page pool and one session's KV in transit between cells.

Pure functions over page arrays (per layer ``[P, page_size, K, D]``; ``kv_cache.py`` has the layouts), and
``PageOps``, which jits them once for one engine's KV layout (the pool is donated where it is updated), into the
engine's ``programs.Programs`` table, and calls them with host-side checks and page ids padded to fixed counts, so the compiled shapes stay fixed.
Page ids past the pool (padding) are dropped on writes; on reads, padding reads any valid page whose
positions are never attended.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from gyre_jax.model.attention import BlockedCache, LayerCache, init_cache
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import Rules
from gyre_jax.serving.kv_cache import DecodeState, KVPages, Prefix, kv_pages_shardings, widen
from gyre_jax.serving.programs import Program, Programs
from gyre_jax.serving.shapes import pow2_at_least
from gyre_jax.serving.types import ContextTooLongError


def empty_pool(cfg: ModelConfig, num_pages: int, page_size: int) -> KVPages:
    """A pool of ``num_pages`` zero pages [P, page_size, K, D]."""
    return KVPages(pages=init_cache(cfg, num_pages, page_size))


def save_slot(pool: KVPages, state: DecodeState, slot: jax.Array, page_ids: jax.Array) -> KVPages:
    """page_ids: [S / page_size]; page j of the slot goes to pool page page_ids[j] (out of range: skipped)."""

    def one(dst, seq):  # dst: [P, p, K, D]; seq: [1, S, K, D]
        return dst.at[page_ids].set(seq.reshape((-1,) + dst.shape[1:]).astype(dst.dtype), mode="drop")

    pages = []
    for d, s in zip(pool.pages, state.cache):  # s: the slots' BlockedCache
        k, v = s.rows(slot, 1)
        pages.append(LayerCache(k=one(d.k, k), v=one(d.v, v)))
    return KVPages(pages=pages)


def load_prefix(pool: KVPages, page_ids: jax.Array, length: jax.Array, key: jax.Array) -> Prefix:
    """page_ids: [S / page_size] (padding: any valid id; positions >= length are never attended)."""

    def one(src):  # [P, p, K, D] -> [1, S, K, D]
        return src[page_ids].reshape((1, -1) + src.shape[2:])

    cache = [LayerCache(k=one(c.k), v=one(c.v)) for c in pool.pages]
    return Prefix(cache=cache, length=length, token=jnp.int32(0), logprob=jnp.float32(0), key=key)


def export_rows(page_size: int, cache: list[LayerCache | BlockedCache], row: jax.Array, num_pages: int) -> KVPages:
    """The first num_pages x page_size tokens of ``row`` of a cache [B, C, K, D] (a prefix's) or of the decode slots'
    ``BlockedCache`` as [num_pages, p, K, D]."""
    n = num_pages * page_size

    def one(seq):  # [1, C, K, D] -> its first n tokens as [num_pages, p, K, D]
        if seq.shape[1] < n:
            seq = jnp.pad(seq, ((0, 0), (0, n - seq.shape[1]), (0, 0), (0, 0)))
        return seq[:, :n].reshape((num_pages, page_size) + seq.shape[2:])

    pages = []
    for c in cache:
        if isinstance(c, BlockedCache):
            k, v = c.rows(row, 1)
        else:
            k, v = (jax.lax.dynamic_slice_in_dim(x, row, 1, axis=0) for x in (c.k, c.v))
        pages.append(LayerCache(k=one(k), v=one(v)))
    return KVPages(pages=pages)


def gather_pages(pool: KVPages, page_ids: jax.Array) -> KVPages:
    """Pool pages ``page_ids`` [n] as one KVPages [n, p, K, D]."""
    return KVPages(pages=[LayerCache(k=c.k[page_ids], v=c.v[page_ids]) for c in pool.pages])


def scatter_pages(pool: KVPages, kv: KVPages, page_ids: jax.Array) -> KVPages:
    """Writes page j of ``kv`` [n, p, K, D] into pool page page_ids[j] (page_ids: [n]; out of range: skipped)."""
    return KVPages(
        pages=[
            LayerCache(
                k=d.k.at[page_ids].set(s.k.astype(d.k.dtype), mode="drop"),
                v=d.v.at[page_ids].set(s.v.astype(d.v.dtype), mode="drop"),
            )
            for d, s in zip(pool.pages, kv.pages)
        ]
    )


def prefix_from_pages(
    max_seq_len: int, kv: KVPages, length: jax.Array, token: jax.Array, logprob: jax.Array, key: jax.Array
) -> Prefix:
    """A Prefix with cache [1, S, K, D] holding the session's pages [n, p, K, D] in order (n x p <= S)."""

    def one(src):  # [n, p, K, D] -> [1, S, K, D]
        return widen(src.reshape((1, -1) + src.shape[2:]), max_seq_len)

    cache = [LayerCache(k=one(c.k), v=one(c.v)) for c in kv.pages]
    return Prefix(cache=cache, length=length, token=token, logprob=logprob, key=key)


class PageOps:
    """The page operations of one engine's KV layout (``cfg``, ``page_size``, ``max_seq_len``) on ``mesh``.

    Public methods mirror the engine's page methods (``Engine.save_slot`` ...), which call them."""

    def __init__(
        self, cfg: ModelConfig, mesh: Mesh, rules: Rules, page_size: int, max_seq_len: int, programs: Programs
    ):
        self.cfg, self.mesh, self.rules = cfg, mesh, rules
        self.page_size, self.max_seq_len = page_size, max_seq_len
        self.pages_per_seq = max_seq_len // page_size
        # jit boundaries (the pool is donated where it is rewritten), compiled into the engine's table
        self._programs = programs
        self._init_pools: dict[int, Program] = {}  # num_pages -> the pool constructor
        self.save = programs.add("save_slot", jax.jit(save_slot, donate_argnums=(0,)), fixed=(1,))
        self.load = programs.add("load_prefix", jax.jit(load_prefix))
        self._export = programs.add(
            "export_rows", jax.jit(functools.partial(export_rows, page_size), static_argnums=(2,)), static=(2,)
        )
        self._gather = programs.add("gather_pages", jax.jit(gather_pages))
        self._scatter = programs.add("scatter_pages", jax.jit(scatter_pages, donate_argnums=(0,)))
        self._prefix = programs.add("prefix_from_pages", jax.jit(functools.partial(prefix_from_pages, max_seq_len)))

    def shardings(self, num_pages: int) -> KVPages:
        return kv_pages_shardings(self.cfg, self.mesh, self.rules, self.page_size, num_pages)

    def init_pool_program(self, num_pages: int) -> Program:
        """The program making a pool of ``num_pages`` zero pages (one per pool size)."""
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be >= 1")
        if num_pages not in self._init_pools:
            jitted = jax.jit(
                functools.partial(empty_pool, self.cfg, num_pages, self.page_size),
                out_shardings=self.shardings(num_pages),
            )
            self._init_pools[num_pages] = self._programs.add(f"init_pool_{num_pages}", jitted)
        return self._init_pools[num_pages]

    def init_pool(self, num_pages: int) -> KVPages:
        return self.init_pool_program(num_pages)()

    @staticmethod
    def _ids(page_ids: Sequence[int], count: int, fill: int) -> jax.Array:
        """[count] int32: ``page_ids`` padded with ``fill``."""
        ids = np.full((count,), fill, np.int32)
        ids[: len(page_ids)] = page_ids
        return ids

    def save_slot(self, pool: KVPages, decode_state: DecodeState, slot: int, page_ids: Sequence[int]) -> KVPages:
        ids = self._ids(page_ids, self.pages_per_seq, pool.num_pages)
        return self.save(pool, decode_state, np.int32(slot), ids)

    def load_prefix(self, pool: KVPages, page_ids: Sequence[int], length: int, key: jax.Array) -> Prefix:
        if not 0 < length <= len(page_ids) * self.page_size:
            raise ValueError(f"length={length} must be in [1, {len(page_ids)} pages x {self.page_size} tokens]")
        return self.load(pool, self._ids(page_ids, self.pages_per_seq, 0), np.int32(length), key)

    def _num_export_pages(self, num_tokens: int) -> int:
        """Pages for ``num_tokens`` tokens, rounded up to a power of two (bounds the compiled shapes)."""
        return min(pow2_at_least(-(-num_tokens // self.page_size)), self.pages_per_seq)

    def export(self, cache: list[LayerCache], row: int, num_tokens: int) -> KVPages:
        """The first ``num_tokens`` tokens of ``row`` of ``cache`` as pages (count rounded up to a power of 2)."""
        if not 0 < num_tokens <= self.max_seq_len:
            raise ValueError(f"num_tokens={num_tokens} must be in [1, max_seq_len={self.max_seq_len}]")
        return self._export(cache, np.int32(row), self._num_export_pages(num_tokens))

    def export_pages(self, pool: KVPages, page_ids: Sequence[int]) -> KVPages:
        count = self._num_export_pages(len(page_ids) * self.page_size)
        return self._gather(pool, self._ids(page_ids, count, 0))

    def import_pages(self, pool: KVPages, kv: KVPages, page_ids: Sequence[int]) -> KVPages:
        self.check(kv)
        if len(page_ids) > kv.num_pages:
            raise ValueError(f"{len(page_ids)} page ids for a KVPages of {kv.num_pages} pages")
        return self._scatter(pool, kv, self._ids(page_ids, kv.num_pages, pool.num_pages))

    def prefix_from_pages(self, kv: KVPages, length: int, key: jax.Array, token: int, logprob: float) -> Prefix:
        self.check(kv)
        if not 0 < length <= min(kv.num_pages * self.page_size, self.max_seq_len - 1):
            raise ContextTooLongError(
                f"a session of {length} cached tokens does not fit this engine "
                f"(max_seq_len={self.max_seq_len}, {kv.num_pages} pages given)"
            )
        return self._prefix(kv, np.int32(length), np.int32(token), np.float32(logprob), key)

    def check(self, kv: KVPages) -> None:
        want = (self.page_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        got = tuple(kv.pages[0].k.shape[1:]) if kv.pages else None
        if len(kv.pages) != self.cfg.num_layers or got != want:
            raise ValueError(
                f"KV pages of {len(kv.pages)} layers x [n, {got}] do not match this engine's layout "
                f"({self.cfg.num_layers} layers x [n, {want}] as [n, page_size, kv_heads, head_dim]); "
                "sessions move only between engines of the same model and page size"
            )

    def to_mesh(self, kv: KVPages) -> KVPages:
        self.check(kv)
        return jax.device_put(kv, self.shardings(kv.num_pages))
