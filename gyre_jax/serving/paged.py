"""Paged KV decoding on one cell: ``PagedEngine`` serves its slots from one page pool through block tables.

The dense ``Engine`` gives every slot ``max_seq_len`` cached tokens, fixed at construction: the longest session a
cell can hold is that, and every slot pays for it. Here a cell has one pool of ``num_pages`` pages of
``page_size`` tokens (the device programs and the state are in ``paged_steps``); a slot holds the pages its
context has reached, taken from the pool as it grows, so a session's length is bounded by the free pages (and by
``max_pages_per_slot``, by default the whole pool) and the bytes a session holds follow its length. When a slot
ends, its pages can stay where they are as the session's KV (``release(slot, keep=n)`` -> ``SlotPages``) and be
handed to the slot of the session's next request without a copy (``attach``); a session moves between cells
as ``KVPages`` (``export`` / ``import_kv``), the format of the dense engine's migration.

``PagedEngine`` is the ``engine_api.ServingEngine`` of this layout: the serving loop drives it exactly as it drives
the dense ``Engine``. It owns its ``PagedState`` and mirrors on the host what it needs to place pages (each slot's
pages and length); the pages are allocated by a ``PrefixCache`` (its own, or a session cache's after ``use_pages``:
slots and cached sessions then share the pool). Prefill writes a prompt straight into its slot's pages in chunks of
at most ``max_prefill_length`` tokens (no per-request prefix buffer), or several whole prompts into their empty
slots in one program (``prefill_many``, packed as the dense engine packs them). The decode step is
``steps.decode_step`` over ``paged_steps.PagedLayout``. Not here yet: routing-replay recording.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import Rules
from gyre_jax.serving import paged_steps, steps
from gyre_jax.serving.engine_api import (
    ResultTokens,
    Sampled,
    ServingEngine,
    SlotPages,
    check_num_steps,
    check_prefill_many,
)
from gyre_jax.serving.kv_cache import KVPages, kv_pages_shardings
from gyre_jax.serving.kv_pages import PageOps, gather_pages, scatter_pages
from gyre_jax.serving.paged_steps import PagedState
from gyre_jax.serving.prefix_cache import PrefixCache
from gyre_jax.serving.programs import FlatParams, Programs
from gyre_jax.serving.shapes import (
    bucket,
    buckets,
    key_rows,
    one_token_prompts,
    pack_prompts,
    packed_row_buckets,
    pow2_at_least,
    prompt_counts,
    sampling_args,
    sampling_rows,
    slot_buckets,
)
from gyre_jax.serving.types import ContextTooLongError, PagePoolExhausted, SamplingParams  # noqa: F401

log = logging.getLogger(__name__)


def _state_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules, page_size: int, num_pages: int) -> PagedState:
    """The pool split like the session cache's pages (``kv_pages_shardings``); the table and slot fields replicated."""
    rep = NamedSharding(mesh, PartitionSpec())
    pool = kv_pages_shardings(cfg, mesh, rules, page_size, num_pages).pages
    return PagedState(pool, rep, rep, rep, rep, rep, rep, rep, rep)


def _export(state: PagedState, ids) -> KVPages:
    return gather_pages(KVPages(pages=state.pool), ids)


def _import(state: PagedState, kv: KVPages, ids) -> PagedState:
    return dataclasses.replace(state, pool=scatter_pages(KVPages(pages=state.pool), kv, ids).pages)


class PagedEngine(ServingEngine):
    """``max_concurrent_decodes`` slots over one pool of ``num_pages`` x ``page_size`` tokens on ``mesh``."""

    def __init__(
        self,
        cfg: ModelConfig,
        graphdef: nnx.GraphDef,
        mesh: Mesh,
        rules: Rules,
        *,
        max_concurrent_decodes: int,
        num_pages: int,
        page_size: int,
        max_prefill_length: int,
        prefill_buckets: Sequence[int],
        max_pages_per_slot: int | None = None,
        decode_slot_buckets: Sequence[int] | None = None,
        decode_steps: int = 1,
    ):
        """``max_pages_per_slot`` (default ``num_pages``): the longest session, in pages. A program attends over a
        power-of-2 number of pages covering the longest live context (one compile per such count in use, per
        prefill bucket or slot bucket); ``decode_slot_buckets`` and ``decode_steps`` as in ``Engine``."""
        max_pages = num_pages if max_pages_per_slot is None else max_pages_per_slot
        for name, v in (("max_concurrent_decodes", max_concurrent_decodes), ("num_pages", num_pages),
                        ("page_size", page_size), ("max_prefill_length", max_prefill_length),
                        ("max_pages_per_slot", max_pages), ("decode_steps", decode_steps)):  # fmt: skip
            if v < 1:
                raise ValueError(f"{name}={v} must be >= 1")
        self.cfg, self.graphdef, self.mesh, self.rules, self.page_size = cfg, graphdef, mesh, rules, page_size
        self.max_concurrent_decodes, self.max_prefill_length = max_concurrent_decodes, max_prefill_length
        self.max_pages_per_slot, self.decode_steps = max_pages, decode_steps
        self.max_seq_len = max_pages * page_size  # the longest session a slot holds, while free pages last
        self.prefill_buckets = buckets(prefill_buckets, max_prefill_length)
        self.decode_slot_buckets = slot_buckets(decode_slot_buckets, max_concurrent_decodes, True)
        self.allocator = PrefixCache(num_pages, page_size)  # the pool's pages; a session cache's, once ``use_pages``
        self._pages: list[list[int]] = [[] for _ in range(max_concurrent_decodes)]  # host mirror of the table
        self._lengths = [0] * max_concurrent_decodes
        self._active = [False] * max_concurrent_decodes
        self._flat = FlatParams()
        self.programs = Programs()
        self._page_ops = PageOps(cfg, mesh, rules, page_size, self.max_seq_len, self.programs)  # KV in transit
        self.record_experts = False  # routing replay is not recorded by the paged engine yet
        self._jit_programs()
        self.state: PagedState = self._init()

    def _jit_programs(self) -> None:
        """The jit boundaries: every device computation of a ``PagedEngine`` is one of these (each donating the
        state, the engine's own: ``fixed``), or one of the page operations' (``kv_pages.PageOps``)."""
        g, cfg, mesh, add = self.graphdef, self.cfg, self.mesh, self.programs.add
        rep = NamedSharding(mesh, PartitionSpec())
        sh = _state_shardings(cfg, mesh, self.rules, self.page_size, self.num_pages)
        out3 = (sh, rep, rep)
        init = functools.partial(paged_steps.empty_state, cfg, self.max_concurrent_decodes, self.num_pages,
                                 self.page_size, self.max_pages_per_slot)  # fmt: skip
        self._init = add("init_state", jax.jit(init, out_shardings=sh))
        self._prefill = add(
            "prefill",
            jax.jit(functools.partial(paged_steps.prefill, g), static_argnums=(1, 6), donate_argnums=(2,),
                    out_shardings=out3),
            static=(1, 6), fixed=(2,), params=0,
        )  # fmt: skip
        self._prefill_many = add(
            "prefill_many",
            jax.jit(functools.partial(paged_steps.prefill_many, g, cfg), static_argnums=(1,), donate_argnums=(2,),
                    out_shardings=out3),
            static=(1,), fixed=(2,), params=0,
        )  # fmt: skip
        step = functools.partial(steps.decode_step, paged_steps.PagedLayout, g)
        self._generate = add(
            "generate",
            jax.jit(step, static_argnums=(1, 3, 4), donate_argnums=(2,), out_shardings=out3),
            static=(1, 3, 4), fixed=(2,), params=0,
        )  # fmt: skip
        multi = functools.partial(steps.decode_steps, paged_steps.PagedLayout, g)
        self._generate_steps = add(
            "generate_steps",
            jax.jit(multi, static_argnums=(1, 3, 4, 5), donate_argnums=(2,), out_shardings=out3),
            static=(1, 3, 4, 5), fixed=(2,), params=0,
        )  # fmt: skip
        slot_update = dict(donate_argnums=(0,), out_shardings=sh)
        self._set_slot = add("set_slot", jax.jit(paged_steps.set_slot, **slot_update), fixed=(0,))
        self._set_row = add("set_row", jax.jit(paged_steps.set_row, **slot_update), fixed=(0,))
        self._set_pending = add("set_pending", jax.jit(paged_steps.set_pending, **slot_update), fixed=(0,))
        self._export = add("export", jax.jit(_export), fixed=(0,))
        self._import = add("import", jax.jit(_import, **slot_update), fixed=(0,))

    # -- sizes, allocator, KV in transit ----------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def use_pages(self, index: PrefixCache) -> None:
        """``ServingEngine.use_pages``: takes pages from ``index`` (a session cache's) from now on, so that slots and
        cached sessions share the pool, cached sessions evicted least recently used first when slots need pages.
        Only while no slot holds pages (sessions an earlier index kept are dropped), and only an index of this
        pool's size."""
        if index.num_pages != self.num_pages or index.page_size != self.page_size:
            raise ValueError(
                f"a session cache of {index.num_pages} pages of {index.page_size} tokens: on a paged engine the "
                f"session cache shares the engine's pool (num_pages={self.num_pages}, page_size={self.page_size}); "
                "pass kv_pages=None (cache on) or 0 (no cache)"
            )
        if any(self._pages) or index.num_used:
            raise ValueError("an engine's allocator changes only while no slot holds pages")
        self.allocator = index

    def check_kv(self, kv: KVPages) -> None:
        """Raises ValueError if ``kv`` was not made by an engine of this KV layout."""
        self._page_ops.check(kv)

    def to_mesh(self, kv: KVPages) -> KVPages:
        """Moves ``kv`` (possibly on another mesh) onto this engine's mesh."""
        return self._page_ops.to_mesh(kv)

    def export_pages(self, page_ids: Sequence[int]) -> KVPages:
        """Pool pages ``page_ids`` as one KVPages (count rounded up to a power of 2; the padding reads page 0)."""
        ids = np.zeros((pow2_at_least(len(page_ids)),), np.int32)
        ids[: len(page_ids)] = page_ids
        return self._export(self.state, ids)

    def import_pages(self, kv: KVPages, page_ids: Sequence[int]) -> None:
        """Writes the first ``len(page_ids)`` pages of ``kv`` (on this mesh) into pool pages ``page_ids``."""
        self.check_kv(kv)
        ids = np.full((kv.num_pages,), self.num_pages, np.int32)  # the rest: dropped
        ids[: len(page_ids)] = page_ids
        self.state = self._import(self.state, kv, ids)

    # -- what the pool holds --------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer (K and V)."""
        c = self.state.pool[0].k
        return 2 * len(self.state.pool) * int(np.prod(c.shape[1:])) * c.dtype.itemsize

    def kv_bytes_held(self) -> int:
        """Bytes of the pages in use (slots' and sessions' kept by ``release(keep=...)``)."""
        return self.allocator.num_used * self.page_bytes

    def slot_length(self, slot: int) -> int:
        """Tokens in ``slot``'s pages."""
        return self._lengths[slot]

    # -- pages ------------------------------------------------------------------------------------------
    def _row(self, slot: int) -> jax.Array:
        row = np.full((self.max_pages_per_slot,), self.num_pages, np.int32)
        row[: len(self._pages[slot])] = self._pages[slot]
        return row

    def _ensure_pages(self, slot: int, num_tokens: int) -> None:
        """Gives ``slot`` pages for positions [0, num_tokens)."""
        need = -(-num_tokens // self.page_size)
        if need > self.max_pages_per_slot:
            raise ContextTooLongError(
                f"a session of {num_tokens} tokens needs {need} pages of {self.page_size}; a slot holds at most "
                f"max_pages_per_slot={self.max_pages_per_slot} ({self.max_pages_per_slot * self.page_size} tokens): "
                "raise max_pages_per_slot (and num_pages)"
            )
        have = len(self._pages[slot])
        if need > have:
            self._pages[slot] += self.allocator.allocate(need - have)
            self.state = self._set_row(self.state, np.int32(slot), self._row(slot))

    def _window(self, num_tokens: int) -> int:
        """Pages a program attends over for contexts of at most ``num_tokens``: a power of 2, capped."""
        return min(pow2_at_least(-(-num_tokens // self.page_size)), self.max_pages_per_slot)

    def _check_empty(self, slot: int) -> None:
        if self._pages[slot] or self._active[slot]:
            raise ValueError(f"slot {slot} holds a request or a session's pages; release it first")

    # -- prefill, decode ----------------------------------------------------------------------------
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
        """``ServingEngine.prefill``: straight into the slot's pages (taken from the pool as the context grows)."""
        if self._active[slot]:
            raise ValueError(f"slot {slot} is decoding; release it before prefilling into it")
        if len(tokens) == 0:
            raise ValueError("cannot prefill an empty prompt")
        leaves = self._flat(params)
        settings = sampling_args(sampling)
        done, out = 0, None
        while done < len(tokens):
            n = min(self.max_prefill_length, len(tokens) - done)
            start = self._lengths[slot]
            self._ensure_pages(slot, start + n + 1)  # + 1: room for the token sampled next
            padded = np.zeros((1, bucket(self.prefill_buckets, n)), np.int32)
            padded[0, :n] = tokens[done : done + n]
            self.state, *out = self._prefill(
                *leaves, self.state, np.int32(slot), padded, np.int32(n),
                self._window(start + n), *settings, key,
            )  # fmt: skip
            self._lengths[slot] = start + n
            done += n
        return Sampled(*out)

    def prefill_many(
        self,
        params: nnx.State,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams],
        keys: Sequence[jax.Array],
    ) -> Sampled:
        """``ServingEngine.prefill_many``: each prompt's KV scattered into its slot's pages in the program."""
        check_prefill_many(slots, prompts, sampling, keys, self._check_empty)
        packed = pack_prompts(prompts, self)
        count = len(packed[-1])
        for slot, prompt in zip(slots, prompts):
            self._ensure_pages(slot, len(prompt) + 1)  # + 1: room for the token sampled next
        at = np.full((count,), self.max_concurrent_decodes, np.int32)  # padding prompts: out of range, dropped
        at[: len(slots)] = slots
        self.state, tokens, logprobs = self._prefill_many(
            *self._flat(params), self.state, at, *packed,
            *sampling_rows(sampling, count), key_rows(keys, count),
        )  # fmt: skip
        for slot, prompt in zip(slots, prompts):
            self._lengths[slot] = len(prompt)
        return Sampled(tokens, logprobs)

    def start(self, slots: Sequence[int]) -> None:
        """``ServingEngine.start``."""
        for slot in slots:
            if self._lengths[slot] == 0:
                raise ValueError(f"slot {slot} holds no tokens: prefill it first")
        for slot in slots:
            self._active[slot] = True
            self._set(slot)

    def resume(self, slot: int, token: int, key: jax.Array, sampling: SamplingParams) -> None:
        """``ServingEngine.resume``: the slot's pending token, key and sampling settings are set, then it starts."""
        if self._lengths[slot] == 0:
            raise ValueError(f"slot {slot} holds no tokens: prefill or import its KV first")
        key = np.asarray(key, np.uint32)
        self.state = self._set_pending(self.state, np.int32(slot), np.int32(token), key, *sampling_args(sampling))
        self.start([slot])

    def keys(self) -> np.ndarray:
        """[slots, 2] each slot's next sampling key (host copy; waits for the programs in flight)."""
        return np.asarray(jax.device_get(self.state.keys))

    def _set(self, slot: int) -> None:
        self.state = self._set_slot(
            self.state, np.int32(slot), self._row(slot), np.int32(self._lengths[slot]), np.bool_(self._active[slot])
        )

    def generate(self, params: nnx.State, *, num_steps: int = 1, wait: bool = True) -> ResultTokens:
        """``ServingEngine.generate``: each started slot is given the pages its next tokens need first; a slot at its
        page limit stops (``valid`` False from then on)."""
        check_num_steps(num_steps, self.decode_steps)
        live = [s for s, a in enumerate(self._active) if a]
        if not live:
            raise ValueError("no slot is decoding: prefill and start one first")
        for s in list(live):
            try:
                self._ensure_pages(s, self._lengths[s] + num_steps)
            except ContextTooLongError as exc:  # its context is at its limit: it stops (``valid`` False from now)
                log.warning("paged engine: slot %d stops at %d tokens: %s", s, self._lengths[s], exc)
                self._active[s] = False
                self._set(s)
                live.remove(s)
        if not live:
            return self._nothing_stepped(num_steps)
        pages = self._window(max(self._lengths[s] for s in live) + num_steps)
        slots = next(b for b in self.decode_slot_buckets if b > max(live))
        leaves = self._flat(params)
        if num_steps == 1:
            self.state, *outputs = self._generate(*leaves, self.state, pages, slots)
        else:
            args = (*leaves, self.state, pages, slots, self.decode_steps, np.int32(num_steps))
            self.state, *outputs = self._generate_steps(*args)
        for s in live:
            self._lengths[s] += num_steps
        return ResultTokens.of(outputs, num_steps, wait)

    def _nothing_stepped(self, num_steps: int) -> ResultTokens:
        """The result of a step in which no slot could run: nothing valid."""
        lead = () if num_steps == 1 else (num_steps,)
        ints = np.zeros(lead + (3, self.max_concurrent_decodes), np.int32)
        ints[..., 2, :] = self._lengths
        return ResultTokens(_ints=ints, _logprobs=np.zeros(lead + (self.max_concurrent_decodes,), np.float32))

    # -- a slot's end, a session's pages --------------------------------------------------------------
    def release(self, slot: int, keep: int = 0) -> SlotPages | None:
        """``ServingEngine.release``: the pages holding the first ``keep`` tokens stay where they are as the
        session's KV (returned: hand them to ``attach``, or to a session cache); the rest return to the pool."""
        held = self._pages[slot][: -(-keep // self.page_size)] if keep > 0 else []
        kept = SlotPages(tuple(held), keep) if held else None
        self.allocator.deallocate(self._pages[slot][len(held) :])
        self._pages[slot], self._lengths[slot], self._active[slot] = [], 0, False
        self._set(slot)
        return kept

    def attach(self, slot: int, pages: SlotPages) -> None:
        """``ServingEngine.attach``: the slot reads the session's pages as they are (no copy)."""
        self._check_empty(slot)
        self._pages[slot], self._lengths[slot] = list(pages.pages), pages.length
        self._set(slot)

    # -- migration ------------------------------------------------------------------------------------
    def export(self, slot: int, num_tokens: int) -> KVPages:
        """``ServingEngine.export``: the slot's pages holding its first ``num_tokens`` tokens (the page count rounded
        up to a power of 2; the padding reads page 0)."""
        pages = self._pages[slot][: -(-num_tokens // self.page_size)]
        if not pages or num_tokens > self._lengths[slot]:
            raise ValueError(f"slot {slot} holds {self._lengths[slot]} tokens, not {num_tokens}")
        return self.export_pages(pages)

    def import_kv(self, slot: int, kv: KVPages, length: int) -> None:
        """Places ``length`` tokens of a session's ``kv`` (on this mesh) into an empty ``slot``'s new pages."""
        self._check_empty(slot)
        need = -(-length // self.page_size)
        if not 0 < need <= kv.num_pages:
            raise ValueError(f"length={length} must be in [1, {kv.num_pages} pages x {self.page_size} tokens]")
        self._ensure_pages(slot, length)
        self.import_pages(kv, self._pages[slot][:need])
        self._lengths[slot] = length
        self._set(slot)

    # -- warm-up ------------------------------------------------------------------------------------------
    def _windows(self, lo: int, hi: int) -> list[int]:
        """The page counts a program attends over for contexts of ``lo`` ... ``hi`` tokens."""
        out, t = [], lo
        while t <= hi:
            out.append(self._window(t))
            if out[-1] >= self.max_pages_per_slot:
                break
            t = out[-1] * self.page_size + 1
        return out

    def warmup(self, params: nnx.State) -> int:
        """``ServingEngine.warmup``: compiles, without running (the pool, the tables and the allocator are left as
        they are), prefill per bucket and page window a chunk of that bucket can reach; ``prefill_many`` per bucket,
        power-of-2 prompt count from 2 up to the one holding every slot and its ``packed_row_buckets``; generate per
        page window, slot bucket and number of steps; the slot updates. Not compiled: the migration programs
        (export, import: one shape per power-of-2 page count). Returns the number of program shapes compiled (0 when
        already warm)."""
        flat, state, before = self._flat(params), self.state, self.programs.count()
        i32, f32 = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32)
        key, sampling = jax.ShapeDtypeStruct((2,), jnp.uint32), (f32, i32, f32)
        lo = 1
        for width in self.prefill_buckets:  # a chunk of lo..width tokens on top of 0.. cached ones
            tokens = jax.ShapeDtypeStruct((1, width), jnp.int32)
            for window in self._windows(lo, self.max_seq_len - 1):
                self._prefill.compile(*flat, state, i32, tokens, i32, window, *sampling, key)
            lo = width + 1
        for count in prompt_counts(self.max_concurrent_decodes):
            rows_f32, rows_i32 = (jax.ShapeDtypeStruct((count,), t) for t in (jnp.float32, jnp.int32))
            keys = jax.ShapeDtypeStruct((count, 2), jnp.uint32)
            for width in self.prefill_buckets:
                for rows in packed_row_buckets(count):
                    packed = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in one_token_prompts(rows, width, count)]
                    args = (*flat, state, rows_i32, *packed, rows_f32, rows_i32, rows_f32, keys)
                    self._prefill_many.compile(*args)
        for steps_ in sorted({1, self.decode_steps}):
            for window in self._windows(1 + min(steps_, 2), self.max_seq_len):  # a multi-step call runs >= 2
                for slots in self.decode_slot_buckets:
                    if steps_ == 1:
                        self._generate.compile(*flat, state, window, slots)
                    else:
                        self._generate_steps.compile(*flat, state, window, slots, steps_, i32)
        row = jax.ShapeDtypeStruct((self.max_pages_per_slot,), jnp.int32)
        self._set_slot.compile(state, i32, row, i32, jax.ShapeDtypeStruct((), jnp.bool_))
        self._set_row.compile(state, i32, row)
        self._set_pending.compile(state, i32, i32, key, *sampling)
        return self.programs.count() - before
