"""The serving KV cache as pytrees: a prefilled prompt (``Prefix``), every decode slot (``DecodeState``) and
one sequence's KV in pages (``KVPages``), with their layouts on a cell's mesh and their empty values.

Per layer ``LayerCache(k, v)``; K = kv heads, D = head dim, S = ``max_seq_len``:
  - ``DecodeState``: an ``attention.BlockedCache`` per layer, dense per slot and heads first, split along the
    positions into blocks ``[slots, K, n_i, D]`` that are the steps between the engine's decode windows
    (``decode_blocks``), so a generate step is one plain model call that writes each stepped slot's new row in
    place and reads its window as whole blocks, with no copy and no transpose (``attention.decode_attention``);
    everything else is sequence-major, ``[.., S, K, D]``: ``insert`` transposes a prefix on its way in,
    ``save_slot`` / ``export_rows`` a slot on its way out;
  - ``Prefix``: ``[1, C, K, D]`` with C a prefill bucket (a fresh prompt) or S (a prompt prefilled on top
    of an existing prefix: chunked prefill, a session-cache hit, a migrated session);
  - page pool: ``[P, page_size, K, D]``, the fixed KV budget of the session prefix cache;
  - ``KVPages``: ``[n, page_size, K, D]``, one session's KV in transit (export -> device_put -> import).
Decode slots and pages are split over the mesh like a batch (``SLOT_CACHE_AXES``, ``CACHE_AXES``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from gyre_jax.model.attention import BlockedCache, LayerCache, init_blocked_cache, init_cache
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import Rules, logical_sharding

CACHE_AXES = ("batch", None, "kv_heads", "head_dim")  # pages (and prefixes) are split like a batch
SLOT_CACHE_AXES = ("batch", "kv_heads", None, "head_dim")  # the decode slots' heads-first blocks, likewise


def decode_blocks(windows: tuple[int, ...]) -> tuple[int, ...]:
    """The decode slots' cache blocks for decode windows (ascending, the last = max_seq_len): (128, 256, 1024) ->
    (128, 128, 768); window j is blocks 0..j."""
    return tuple(b - a for a, b in zip((0, *windows[:-1]), windows))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefix:
    """A prefilled prompt: its KV cache [1, C, K, D] per layer, its length and the first sampled token."""

    cache: list[LayerCache]
    length: jax.Array  # [] int32: tokens in the cache (positions 0 .. length-1)
    token: jax.Array  # [] int32: first generated token (not yet in the cache)
    logprob: jax.Array  # [] f32
    key: jax.Array  # [2] uint32: the request's sampling key, advanced past the first token
    # routing replay (an engine with record_experts): [Tb, L_moe, K] int16, the experts each MoE layer selected
    # for the tokens of the chunk this prefill ran (padded to its bucket); None otherwise
    experts: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """All slots' state. cache: per layer blocks [slots, K, n_i, D] (``BlockedCache``); the rest [slots] (keys
    [slots, 2])."""

    cache: list[BlockedCache]
    tokens: jax.Array  # int32: last sampled token per slot, fed to the next generate step
    lengths: jax.Array  # int32: tokens already in the slot's cache (= position of ``tokens``)
    active: jax.Array  # bool: the slot holds a request (inactive slots write nothing)
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPages:
    """One sequence's KV in pages: per layer k, v [n, page_size, K, D]; token i is at page i // page_size."""

    pages: list[LayerCache]

    @property
    def num_pages(self) -> int:
        return int(self.pages[0].k.shape[0])


def decode_state_shardings(
    cfg: ModelConfig, mesh: Mesh, rules: Rules, slots: int, blocks: tuple[int, ...]
) -> DecodeState:
    """``DecodeState`` of ``NamedSharding``: slots split like a batch, the cache blocks [slots, K, n, D] per layer
    (n in ``blocks``, ``decode_blocks``)."""
    shardings = tuple(
        logical_sharding(SLOT_CACHE_AXES, rules, mesh, (slots, cfg.num_kv_heads, n, cfg.head_dim)) for n in blocks
    )
    slot_sharding = logical_sharding(("batch",), rules, mesh, (slots,))
    key_sharding = logical_sharding(("batch", None), rules, mesh, (slots, 2))
    return DecodeState(
        cache=[BlockedCache(k=shardings, v=shardings) for _ in range(cfg.num_layers)],
        tokens=slot_sharding,
        lengths=slot_sharding,
        active=slot_sharding,
        temperature=slot_sharding,
        top_k=slot_sharding,
        top_p=slot_sharding,
        keys=key_sharding,
    )


def kv_pages_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules, page_size: int, num_pages: int) -> KVPages:
    """``KVPages`` of ``NamedSharding``: a [num_pages, page_size, K, D] page array per layer on ``mesh``, pages
    split like decode slots. Any process can compute it for any cell (no engine needed)."""
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    sh = logical_sharding(CACHE_AXES, rules, mesh, shape)
    return KVPages(pages=[LayerCache(k=sh, v=sh) for _ in range(cfg.num_layers)])


def empty_slot_fields(slots: int) -> dict[str, jax.Array]:
    """The per-slot fields of a decode state (either KV layout) with every slot free: no tokens, greedy-neutral
    sampling settings."""
    return dict(
        tokens=jnp.zeros((slots,), jnp.int32),
        lengths=jnp.zeros((slots,), jnp.int32),
        active=jnp.zeros((slots,), jnp.bool_),
        temperature=jnp.ones((slots,), jnp.float32),
        top_k=jnp.zeros((slots,), jnp.int32),
        top_p=jnp.ones((slots,), jnp.float32),
        keys=jnp.zeros((slots, 2), jnp.uint32),
    )


def empty_decode_state(cfg: ModelConfig, slots: int, blocks: tuple[int, ...]) -> DecodeState:
    """Every slot free: zero cache blocks [slots, K, n, D] (n in ``blocks``) and ``empty_slot_fields``."""
    return DecodeState(cache=init_blocked_cache(cfg, slots, blocks), **empty_slot_fields(slots))


def empty_prefix(cfg: ModelConfig, max_seq_len: int, key: jax.Array) -> Prefix:
    """A prefix of no tokens with a full-length cache [1, S, K, D]; key: [2] uint32."""
    return Prefix(
        cache=init_cache(cfg, 1, max_seq_len),
        length=jnp.int32(0),
        token=jnp.int32(0),
        logprob=jnp.float32(0),
        key=key,
    )


def heads_first(x: jax.Array) -> jax.Array:
    """[B, C, K, D] -> [B, K, C, D]: a sequence-major cache (a prefix's) in the decode slots' layout."""
    return jnp.swapaxes(x, 1, 2)


def widen(x: jax.Array, max_seq_len: int) -> jax.Array:
    """[1, C, K, D] -> [1, S, K, D] (C <= S), zero-padded."""
    grow = max_seq_len - x.shape[1]
    return x if grow == 0 else jnp.pad(x, ((0, 0), (0, grow), (0, 0), (0, 0)))
