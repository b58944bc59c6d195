"""The dense serving engine: ``Engine``, the ``engine_api.ServingEngine`` of the dense KV layout.

Every slot has a ``max_seq_len`` cache (``dense.DenseSlots``' ``DecodeState``, which the engine holds); a prompt is
prefilled into a ``Prefix`` the slot keeps until ``start`` inserts it (whole prompts of a ``prefill_many`` batch:
one ``insert_many``), and a finished session's KV is copied into pages of a pool beside the slots (``release`` with
``keep``), from where ``attach`` copies it into the next request's prefix. The engine tracks on the host what it
needs to size each generate program (each slot's length, which slots decode): the smallest decode window and slot
bucket holding the live slots. ``warmup`` compiles every program shape the serving loop can dispatch, ahead of
time, without running any. The engine knows nothing about requests, queues, sessions or HTTP (``serving.loop``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import Rules
from gyre_jax.serving.dense import DenseSlots
from gyre_jax.serving.engine_api import (
    ResultTokens,
    Sampled,
    ServingEngine,
    SlotPages,
    check_num_steps,
    check_prefill_many,
)
from gyre_jax.serving.kv_cache import (  # noqa: F401 - CACHE_AXES and kv_pages_shardings are importable from here
    CACHE_AXES,
    DecodeState,
    KVPages,
    Prefix,
    kv_pages_shardings,
)
from gyre_jax.serving.prefix_cache import PrefixCache
from gyre_jax.serving.shapes import one_token_prompts, packed_row_buckets, prompt_counts
from gyre_jax.serving.types import PagePoolExhausted, SamplingParams

_NO_KEY = np.zeros((2,), np.uint32)  # a loaded prefix's key: its prefill or resume sets the request's


@dataclasses.dataclass
class _Prefilled:
    """A slot's KV waiting for ``start``: a prefix (row ``row`` of a ``prefill_many`` batch, or the whole of a
    single one) and the request's sampling settings (None: set by the next prefill or ``resume``)."""

    prefix: Prefix
    row: int | None = None
    sampling: SamplingParams | None = None


class Engine(ServingEngine):
    """``max_concurrent_decodes`` dense slots of ``max_seq_len`` tokens on ``mesh``, and a pool of ``num_pages``
    pages of ``page_size`` tokens for sessions' KV (the session cache's; default as many tokens as the slots
    hold)."""

    def __init__(
        self,
        cfg: ModelConfig,
        graphdef: nnx.GraphDef,
        mesh: Mesh,
        rules: Rules,
        *,
        num_pages: int | None = None,
        **sizes,
    ):
        """``sizes``: ``DenseSlots``' (``max_concurrent_decodes``, ``max_seq_len``, ``max_prefill_length``,
        ``prefill_buckets``, and optionally ``page_size``, ``decode_windows``, ``decode_slot_buckets``,
        ``record_experts``, ``decode_steps``); ``num_pages``: the session pool's pages (0: sessions are not kept)."""
        self.dense = d = DenseSlots(cfg, graphdef, mesh, rules, **sizes)
        self.cfg, self.graphdef, self.mesh, self.rules, self.programs = cfg, graphdef, mesh, rules, d.programs
        self.max_concurrent_decodes = slots = d.max_concurrent_decodes
        self.max_seq_len, self.max_prefill_length, self.decode_steps = (
            d.max_seq_len,
            d.max_prefill_length,
            d.decode_steps,
        )
        self.page_size, self.pages_per_seq, self.record_experts = d.page_size, d.pages_per_seq, d.record_experts
        self.prefill_buckets, self.decode_windows = d.prefill_buckets, d.decode_windows
        self.decode_slot_buckets = d.decode_slot_buckets
        self.num_pages = slots * d.pages_per_seq if num_pages is None else num_pages
        if self.num_pages < 0:
            raise ValueError(f"num_pages={num_pages} must be >= 0 (0: no session pool)")
        self.state: DecodeState = d.init_decode_state()
        self._prefilled: list[_Prefilled | None] = [None] * slots
        self._lengths = [0] * slots  # host mirror: tokens in each slot's KV after the steps dispatched
        self._active = [False] * slots
        self._index: PrefixCache | None = None  # the session pool's allocator (``use_pages``)
        self._pool: KVPages | None = None

    # -- prefill ----------------------------------------------------------------------------------------
    def _check_empty(self, slot: int) -> None:
        if self._active[slot] or self._prefilled[slot] is not None:
            raise ValueError(f"slot {slot} holds a request or a session's KV; release it first")

    def prefill(
        self,
        params: nnx.State,
        slot: int,
        tokens: Sequence[int],
        sampling: SamplingParams,
        key: jax.Array,
        *,
        final: bool = True,
    ) -> Sampled:
        """``ServingEngine.prefill``: chunks of at most ``max_prefill_length`` into the slot's prefix. A prompt whose
        tokens do not all come in one call starts from an empty full-length prefix, so that every chunk runs the
        same compiled shapes (one per chunk bucket); a whole prompt gets a prefix of its bucket."""
        if self._active[slot]:
            raise ValueError(f"slot {slot} is decoding; release it before prefilling into it")
        if len(tokens) == 0:
            raise ValueError("cannot prefill an empty prompt")
        held = self._prefilled[slot]
        if held is not None and held.row is not None:
            raise ValueError(f"slot {slot} was prefilled with other prompts (prefill_many): start it")
        prefix, experts, size = None if held is None else held.prefix, [], self.max_prefill_length
        for i in range(0, len(tokens), size):
            chunk = tokens[i : i + size]
            if prefix is None and not (final and i + size >= len(tokens)):
                prefix = self.dense.empty_prefix(key)
            prefix = self.dense.prefill(
                params=params, tokens=chunk, sampling_params=sampling, key=key, existing_prefix=prefix
            )
            if prefix.experts is not None:  # routing replay: the experts of these prompt tokens
                experts.append(np.asarray(jax.device_get(prefix.experts))[: len(chunk)])
        self._prefilled[slot] = _Prefilled(prefix, None, sampling)
        self._lengths[slot] += len(tokens)
        return Sampled(prefix.token, prefix.logprob, np.concatenate(experts) if experts else None)

    def prefill_many(
        self,
        params: nnx.State,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams],
        keys: Sequence[jax.Array],
    ) -> Sampled:
        """``ServingEngine.prefill_many``: one packed prefill program; ``start`` inserts its rows (one program)."""
        check_prefill_many(slots, prompts, sampling, keys, self._check_empty)
        batch = self.dense.prefill_many(params=params, prompts=prompts, sampling=sampling, keys=keys)
        for i, (slot, prompt, sp) in enumerate(zip(slots, prompts, sampling)):
            self._prefilled[slot] = _Prefilled(batch, i, sp)
            self._lengths[slot] = len(prompt)
        experts = None if batch.experts is None else np.asarray(jax.device_get(batch.experts))
        return Sampled(batch.token, batch.logprob, experts)

    # -- start -----------------------------------------------------------------------------------------
    def start(self, slots: Sequence[int]) -> None:
        """``ServingEngine.start``: each single prefix is inserted into its slot; the rows of one ``prefill_many``
        batch go in together (``insert_many``)."""
        batches: dict[int, tuple[Prefix, dict[int, int]]] = {}  # id(batch) -> (batch, row -> slot)
        for slot in slots:
            held = self._prefilled[slot]
            if held is None or held.sampling is None:
                raise ValueError(f"slot {slot} holds no prefilled prompt: prefill it first")
            if held.row is None:
                self.state = self.dense.insert(held.prefix, self.state, slot, held.sampling)
            else:
                batches.setdefault(id(held.prefix), (held.prefix, {}))[1][held.row] = slot
        for batch, rows in batches.values():
            at = [rows.get(r, -1) for r in range(max(rows) + 1)]  # -1: a row not started now is left out
            first = self._prefilled[at[max(rows)]].sampling
            sampling = [first if s < 0 else self._prefilled[s].sampling for s in at]
            self.state = self.dense.insert_many(batch, self.state, at, sampling)
        for slot in slots:
            self._prefilled[slot], self._active[slot] = None, True

    def resume(self, slot: int, token: int, key: jax.Array, sampling: SamplingParams) -> None:
        """``ServingEngine.resume``: the slot's prefix goes in with ``token`` pending and ``key``."""
        held = self._prefilled[slot]
        if held is None or held.row is not None:
            raise ValueError(f"slot {slot} holds no KV of a single request to resume from")
        prefix = dataclasses.replace(
            held.prefix, token=np.int32(token), logprob=np.float32(0), key=np.asarray(key, np.uint32)
        )
        self.state = self.dense.insert(prefix, self.state, slot, sampling)
        self._prefilled[slot], self._active[slot] = None, True

    # -- generate ------------------------------------------------------------------------------------------
    def generate(self, params: nnx.State, *, num_steps: int = 1, wait: bool = True) -> ResultTokens:
        """``ServingEngine.generate``: over the smallest decode window and slot bucket that hold the started slots."""
        check_num_steps(num_steps, self.decode_steps)
        live = [s for s, a in enumerate(self._active) if a]
        if not live:
            raise ValueError("no slot is decoding: prefill and start one first")
        self.state, result = self.dense.generate(
            params, self.state, max_length=max(self._lengths[s] for s in live), slot_limit=live[-1] + 1,
            wait=wait, num_steps=num_steps,
        )  # fmt: skip
        for s in live:
            self._lengths[s] = min(self._lengths[s] + num_steps, self.max_seq_len)
        return result

    # -- a slot's end, a session's KV --------------------------------------------------------------------
    def release(self, slot: int, keep: int = 0) -> SlotPages | None:
        """``ServingEngine.release``: with ``keep``, its first ``keep`` tokens' KV is copied into session pool pages
        (``use_pages``'s allocator evicts cached sessions, least recently used first, to make room)."""
        kept = None
        if keep > 0 and self._active[slot] and self._index is not None:
            try:
                pages = self._index.allocate(self._index.pages_for(keep))
            except PagePoolExhausted:  # longer than the pool: not kept
                pages = None
            if pages is not None:
                self._pool = self.dense.save_slot(self._pool, self.state, slot, pages)
                kept = SlotPages(tuple(pages), keep)
        if self._active[slot]:
            self.state = self.dense.release(self.state, slot)
        self._prefilled[slot], self._active[slot], self._lengths[slot] = None, False, 0
        return kept

    def attach(self, slot: int, pages: SlotPages) -> None:
        """``ServingEngine.attach``: the pages' KV is copied into the slot's prefix; the pages return to the pool."""
        self._check_empty(slot)
        prefix = self.dense.load_prefix(self._pool, pages.pages, pages.length, _NO_KEY)
        self._index.deallocate(pages.pages)  # the load is dispatched first: later writes to these pages wait for it
        self._prefilled[slot], self._lengths[slot] = _Prefilled(prefix), pages.length

    def import_kv(self, slot: int, kv: KVPages, length: int) -> None:
        self._check_empty(slot)
        self._prefilled[slot] = _Prefilled(self.dense.prefix_from_pages(kv, length, _NO_KEY))
        self._lengths[slot] = length

    def export(self, slot: int, num_tokens: int) -> KVPages:
        if self._active[slot]:
            return self.dense.export_slot(self.state, slot, num_tokens)
        held = self._prefilled[slot]
        if held is None:
            raise ValueError(f"slot {slot} holds no tokens")
        return self.dense.export_prefix(held.prefix, num_tokens, held.row or 0)

    def slot_length(self, slot: int) -> int:
        return self._lengths[slot]

    def keys(self) -> np.ndarray:
        return np.asarray(jax.device_get(self.state.keys))

    # -- the session pool ------------------------------------------------------------------------------------
    def use_pages(self, index: PrefixCache) -> None:
        """``ServingEngine.use_pages``: the session pool becomes ``index.num_pages`` pages; sessions an earlier index
        kept there are dropped (a loop built on an engine whose last loop stopped)."""
        if index.page_size != self.page_size:
            raise ValueError(f"the session cache's page_size={index.page_size} must be the engine's {self.page_size}")
        self._index, self.num_pages = index, index.num_pages
        if self._pool is None or self._pool.num_pages != index.num_pages:
            self._pool = self.dense.init_page_pool(index.num_pages)

    def export_pages(self, page_ids: Sequence[int]) -> KVPages:
        return self.dense.export_pages(self._pool, page_ids)

    def import_pages(self, kv: KVPages, page_ids: Sequence[int]) -> None:
        self._pool = self.dense.import_pages(self._pool, kv, page_ids)

    def check_kv(self, kv: KVPages) -> None:
        self.dense.check_kv(kv)

    def to_mesh(self, kv: KVPages) -> KVPages:
        return self.dense.to_mesh(kv)

    # -- warm-up ------------------------------------------------------------------------------------------
    def warmup(self, params: nnx.State) -> int:
        """``ServingEngine.warmup``: compiles, without running, every program shape the serving loop can dispatch:

        - one prompt: prefill per bucket up to ``max_prefill_length``'s, fresh and on top of a prefix (an empty
          full-length one: a chunked prompt; a chunk; a session's pages loaded from the pool), and its insert;
        - several whole prompts in one program (``batch.prefill_together``): ``prefill_many`` per bucket, power-of-2
          prompt count from 2 up to the one holding every slot and its ``packed_row_buckets``, and ``insert_many``;
        - generate per decode window, slot bucket and number of steps (1 and ``decode_steps``); release;
        - with a session pool (``num_pages`` > 0): the pool, ``save_slot`` and ``load_prefix``.

        Not compiled: the migration programs (``export``, ``import_kv``, ``export_pages`` / ``import_pages``: one
        shape per power-of-2 page count), compiled when a session first moves. Returns the number of program shapes
        compiled (0 when already warm)."""
        d, flat, before = self.dense, self.dense.flat_params(params), self.programs.count()
        i32, f32 = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32)
        key, sampling = jax.ShapeDtypeStruct((2,), jnp.uint32), (f32, i32, f32)
        d.init_program.compile()
        d.release_program.compile(self.state, i32)
        starts = [d.empty_prefix_program.out_info(key)]  # what a chunk is prefilled on top of
        if self.num_pages > 0:
            pool = d.pages.init_pool_program(self.num_pages).out_info()
            ids = jax.ShapeDtypeStruct((self.pages_per_seq,), jnp.int32)
            d.pages.save.compile(pool, self.state, i32, ids)
            starts.append(d.pages.load.out_info(pool, ids, i32, key))
        widths = [b for b in d.prefill_buckets if b <= d.bucket(self.max_prefill_length)]

        def prefill(width: int, existing=None) -> Prefix:  # compiles the prefill and the insert of its prefix
            args = (jax.ShapeDtypeStruct((1, width), jnp.int32), i32, *sampling, key)
            if existing is None:
                prefix = d.prefill_program.out_info(*flat, *args)
            else:
                prefix = d.prefill_extend_program.out_info(*flat, dataclasses.replace(existing, experts=None), *args)
            prefix = dataclasses.replace(prefix, experts=None)
            d.insert_program.compile(prefix, self.state, i32, *sampling)
            return prefix

        starts.append(prefill(widths[0], starts[0]))  # a chunk on top of the chunk before
        for width in widths:
            for existing in (None, *starts):
                prefill(width, existing)
        for count in prompt_counts(self.max_concurrent_decodes):
            rows_f32, rows_i32 = (jax.ShapeDtypeStruct((count,), t) for t in (jnp.float32, jnp.int32))
            keys = jax.ShapeDtypeStruct((count, 2), jnp.uint32)
            for width in widths:
                for rows in packed_row_buckets(count):
                    packed = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in one_token_prompts(rows, width, count)]
                    batch = d.prefill_many_program.out_info(*flat, *packed, rows_f32, rows_i32, rows_f32, keys)
                batch = dataclasses.replace(batch, experts=None)
                d.insert_many_program.compile(batch, self.state, rows_i32, rows_f32, rows_i32, rows_f32)
        for window in d.decode_windows:
            for slots in d.decode_slot_buckets:
                d.generate_program.compile(*flat, self.state, window, slots)
                if self.decode_steps > 1:
                    d.generate_steps_program.compile(*flat, self.state, window, slots, self.decode_steps, i32)
        return self.programs.count() - before
