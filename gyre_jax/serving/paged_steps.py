"""The device programs of paged KV decoding: every slot's KV lives in one page pool, found through a block table.

``PagedState`` holds the pool (per layer ``[P, page_size, K, D]``), the block table ``[slots, max_pages]``
(entry j of a slot's row: the pool page holding its positions ``j * page_size ...``; ``P``, past the pool, for
none) and the per-slot decoding fields of ``kv_cache.DecodeState``. A program reads a slot's KV as a view
gathered from its first ``num_pages`` table entries (``num_pages`` static: a bucket of the longest live
context, so cost follows the live length, not the pool), runs the model on that view exactly as the dense
engine runs it on a window of its cache (``attention.cache_mask``: dense or a ``MaskSpec``), and scatters
the rows the step wrote back into their pages: the decode step is ``steps.decode_step`` over ``PagedLayout``,
a prefill ``steps.forward_and_sample`` on a slot's view. Reads of table entries past a slot's pages fall on some page
whose positions the mask never shows; writes to them are dropped.

A pure-JAX gather, the same on every platform; a paged-attention kernel (Pallas ragged paged attention on
TPU/GPU) would read the pages in place instead (docs/long_context.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from gyre_jax.model.attention import LayerCache, init_cache
from gyre_jax.model.config import ModelConfig
from gyre_jax.serving import steps
from gyre_jax.serving.kv_cache import empty_slot_fields


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedState:
    """The pool and the slots. pool: per layer k, v [P, page_size, K, D]; table [slots, max_pages] int32; the
    rest [slots] (keys [slots, 2]) as in ``DecodeState``."""

    pool: list[LayerCache]
    table: jax.Array  # int32: pool page of each slot's j-th page of positions (P: none)
    tokens: jax.Array  # int32: last sampled token per slot, fed to the next generate step
    lengths: jax.Array  # int32: tokens already in the slot's pages (= position of ``tokens``)
    active: jax.Array  # bool: the slot decodes
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array


def empty_state(cfg: ModelConfig, slots: int, num_pages: int, page_size: int, max_pages: int) -> PagedState:
    """Zero pages, an empty table (every entry ``num_pages``), no slot active."""
    return PagedState(
        pool=init_cache(cfg, num_pages, page_size),
        table=jnp.full((slots, max_pages), num_pages, jnp.int32),
        **empty_slot_fields(slots),
    )


def gather_view(pool: list[LayerCache], rows: jax.Array, num_pages: int) -> list[LayerCache]:
    """rows: [B, max_pages] table rows -> per layer a cache [B, num_pages * page_size, K, D] of their first
    ``num_pages`` pages in position order."""
    ids = jnp.minimum(rows[:, :num_pages], pool[0].k.shape[0] - 1)  # no page: read any, never attended

    def one(x):  # [P, p, K, D] -> [B, n * p, K, D]
        return x[ids].reshape((ids.shape[0], -1) + x.shape[2:])

    return [LayerCache(k=one(c.k), v=one(c.v)) for c in pool]


def scatter_rows(pool: list[LayerCache], view: list[LayerCache], rows: jax.Array, positions: jax.Array):
    """Writes the view's rows at ``positions`` [B, T] (a position at or past the view's length: nothing) into the
    pool pages the table ``rows`` [B, max_pages] map them to."""
    num_pool, p = pool[0].k.shape[:2]
    w = view[0].k.shape[1]
    b = jnp.arange(positions.shape[0])[:, None]
    at = jnp.minimum(positions, w - 1)
    page = jnp.where(positions < w, rows[b, at // p], num_pool)  # out of the pool: dropped
    offset = at % p

    def one(dst, src):  # dst: [P, p, K, D]; src: [B, w, K, D]
        return dst.at[page, offset].set(src[b, at].astype(dst.dtype), mode="drop")

    return [LayerCache(k=one(d.k, s.k), v=one(d.v, s.v)) for d, s in zip(pool, view)]


def prefill(
    graphdef: nnx.GraphDef,
    leaves,
    treedef,
    state: PagedState,
    slot,
    tokens,
    true_length,
    num_pages: int,
    temperature,
    top_k,
    top_p,
    key,
):
    """Prefills tokens [1, Tb] (``true_length`` real) into ``slot``'s pages after its ``lengths[slot]`` cached
    tokens (its table must map every position written; ``num_pages`` static covers them), samples the next token
    from the last one with ``key`` [2] and records it, the advanced key, the new length and the sampling settings
    in the slot (not activated). Returns (state, token [] int32, log-prob [] f32)."""
    w = num_pages * state.pool[0].k.shape[1]
    start = state.lengths[slot]
    idx = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    positions = jnp.where(idx < true_length, start + idx, w)[None, :]  # padding writes are dropped
    rows = jax.lax.dynamic_index_in_dim(state.table, slot, axis=0, keepdims=True)  # [1, max_pages]
    view, token, logprob, key, _ = steps.forward_and_sample(
        (graphdef, leaves, treedef), gather_view(state.pool, rows, num_pages), positions, tokens, true_length,
        temperature, top_k, top_p, key, False,
    )  # fmt: skip
    state = dataclasses.replace(
        state,
        pool=scatter_rows(state.pool, view, rows, positions),
        tokens=state.tokens.at[slot].set(token),
        lengths=state.lengths.at[slot].set(start + true_length),
        temperature=state.temperature.at[slot].set(temperature),
        top_k=state.top_k.at[slot].set(top_k),
        top_p=state.top_p.at[slot].set(top_p),
        keys=state.keys.at[slot].set(key),
    )
    return state, token, logprob


def prefill_many(
    graphdef: nnx.GraphDef,
    cfg: ModelConfig,
    leaves,
    treedef,
    state: PagedState,
    slots,
    tokens,
    positions,
    segments,
    rows,
    offsets,
    true_lengths,
    temperature,
    top_k,
    top_p,
    keys,
):
    """Several whole prompts, each into the pages of its own empty slot, in one forward: the packed layout of
    ``steps.prefill_many`` (tokens, positions, segments [R, L]; rows, offsets, true_lengths [P]; sampling [P] each,
    keys [P, 2]) and slots [P] int32 (a padding prompt's: any out of range). Each slot's table must map
    positions [0, true_length); its KV, next token, key, length and sampling settings are recorded as ``prefill``
    of that prompt alone records them, to float rounding (not activated). Returns (state, tokens [P] int32,
    log-probs [P] f32)."""
    out = steps.prefill_many(
        graphdef, cfg, leaves, treedef, tokens, positions, segments, rows, offsets, true_lengths,
        temperature, top_k, top_p, keys,
    )  # fmt: skip
    width = tokens.shape[1]
    idx = jnp.arange(width, dtype=jnp.int32)[None, :]
    at = jnp.where(idx < true_lengths[:, None], idx, width)  # [P, L]; past each prompt: dropped
    table = state.table[jnp.minimum(slots, state.table.shape[0] - 1)]  # [P, max_pages]

    def put(field, value):  # a padding prompt's slot is out of range: dropped
        return field.at[slots].set(value.astype(field.dtype), mode="drop")

    state = dataclasses.replace(
        state,
        pool=scatter_rows(state.pool, out.cache, table, at),
        tokens=put(state.tokens, out.token),
        lengths=put(state.lengths, true_lengths),
        temperature=put(state.temperature, temperature),
        top_k=put(state.top_k, top_k),
        top_p=put(state.top_p, top_p),
        keys=put(state.keys, out.key),
    )
    return state, out.token, out.logprob


class PagedLayout:
    """The paged KV layout of the decode step (``steps.decode_step``): the model runs on a view gathered from each
    stepped slot's first ``window`` table entries (``window`` in pages), and the rows it wrote are scattered back
    into their pages."""

    @staticmethod
    def read(state: PagedState, num_slots: int, window: int):
        """(the view [num_slots, window x page_size], the positions it attends over, a position dropped on write)."""
        span = window * state.pool[0].k.shape[1]
        return gather_view(state.pool, state.table[:num_slots], window), span, span

    @staticmethod
    def write(state: PagedState, view, positions, num_slots: int) -> PagedState:
        return dataclasses.replace(state, pool=scatter_rows(state.pool, view, state.table[:num_slots], positions))


def set_slot(state: PagedState, slot, row, length, active) -> PagedState:
    """Gives ``slot`` the table row ``row`` [max_pages], ``length`` cached tokens and the ``active`` flag."""
    return dataclasses.replace(
        state,
        table=state.table.at[slot].set(row),
        lengths=state.lengths.at[slot].set(length),
        active=state.active.at[slot].set(active),
    )


def set_row(state: PagedState, slot, row) -> PagedState:
    """Replaces ``slot``'s table row (pages added as its context grows)."""
    return dataclasses.replace(state, table=state.table.at[slot].set(row))


def set_pending(state: PagedState, slot, token, key, temperature, top_k, top_p) -> PagedState:
    """``slot``'s next input token, sampling key [2] and settings (a request resuming on KV it brought)."""
    return dataclasses.replace(
        state,
        tokens=state.tokens.at[slot].set(token),
        keys=state.keys.at[slot].set(key),
        temperature=state.temperature.at[slot].set(temperature),
        top_k=state.top_k.at[slot].set(top_k),
        top_p=state.top_p.at[slot].set(top_p),
    )
