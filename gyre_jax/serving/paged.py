"""Paged KV decoding on one cell: ``PagedEngine`` serves its slots from one page pool through block tables.

The dense ``Engine`` gives every slot ``max_seq_len`` cached tokens, fixed at construction: the longest session a
cell can hold is that, and every slot pays for it. Here a cell has one pool of ``num_pages`` pages of
``page_size`` tokens (the device programs and the state are in ``paged_steps``); a slot holds the pages its
context has reached, taken from the pool as it grows, so a session's length is bounded by the free pages (and by
``max_pages_per_slot``, by default the whole pool) and the bytes a session holds follow its length. When a slot
ends, its pages can stay where they are as the session's KV (``release(keep=True)`` -> ``SlotPages``) and be
handed to the slot of the session's next request without a copy (``attach``); a session moves between cells
as ``KVPages`` (``export`` / ``import_kv``), the format of the dense engine's migration.

The engine owns its ``PagedState`` and mirrors on the host what it needs to place pages (each slot's pages and
length): every call is a method, none takes or returns the state. Prefill writes a prompt straight into its
slot's pages in chunks of at most ``max_prefill_length`` tokens (no per-request prefix buffer), or several
whole prompts into their empty slots in one program (``prefill_many``, packed as the dense engine packs them).
The serving loop runs it through ``paged_batch.PagedBatch``. Not here yet: routing-replay recording.
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
from gyre_jax.serving import paged_steps
from gyre_jax.serving.engine import (
    FlatParams,
    ResultTokens,
    _buckets,
    _one_token_prompts,
    _pack_prompts,
    _sampling_args,
    _sampling_rows,
    _slot_buckets,
    check_num_steps,
    packed_row_buckets,
)
from gyre_jax.serving.kv_cache import KVPages, kv_pages_shardings
from gyre_jax.serving.kv_pages import PageOps, gather_pages, scatter_pages
from gyre_jax.serving.paged_steps import PagedState
from gyre_jax.serving.types import ContextTooLongError, PagePoolExhausted, SamplingParams


@dataclasses.dataclass(frozen=True)
class SlotPages:
    """A session's KV left in the pool by ``release(keep=True)``: its pages in position order, and the tokens they
    hold. Give it to ``attach`` (the session goes on) or ``drop`` (its pages return to the pool)."""

    pages: tuple[int, ...]
    length: int


log = logging.getLogger(__name__)


class PageAllocator:
    """The free pages of a pool of ``num_pages`` (host side; lowest ids first)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PagePoolExhausted(
                f"the KV page pool is spent: {n} more page(s) needed, {len(self._free)} of {self.num_pages} free; "
                "end or drop sessions (release without keep, drop), or build the engine with more num_pages"
            )
        return [self._free.pop() for _ in range(n)]

    def deallocate(self, pages: Sequence[int]) -> None:
        self._free.extend(reversed(pages))


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _state_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules, page_size: int, num_pages: int) -> PagedState:
    """The pool split like the session cache's pages (``kv_pages_shardings``); the table and slot fields replicated."""
    rep = NamedSharding(mesh, PartitionSpec())
    pool = kv_pages_shardings(cfg, mesh, rules, page_size, num_pages).pages
    return PagedState(pool, rep, rep, rep, rep, rep, rep, rep, rep)


def _export(state: PagedState, ids) -> KVPages:
    return gather_pages(KVPages(pages=state.pool), ids)


def _import(state: PagedState, kv: KVPages, ids) -> PagedState:
    return dataclasses.replace(state, pool=scatter_pages(KVPages(pages=state.pool), kv, ids).pages)


def _programs(g: nnx.GraphDef, cfg: ModelConfig, mesh: Mesh, sh: PagedState) -> tuple:
    """The jit boundaries: every device computation of a ``PagedEngine`` is one of these (donating the state):
    (prefill, prefill_many, generate, generate_steps, set_slot, set_row, set_pending, export, import)."""
    rep = NamedSharding(mesh, PartitionSpec())
    out3 = (sh, rep, rep)
    return (
        jax.jit(
            functools.partial(paged_steps.prefill, g), static_argnums=(1, 6), donate_argnums=(2,), out_shardings=out3
        ),
        jax.jit(
            functools.partial(paged_steps.prefill_many, g, cfg),
            static_argnums=(1,),
            donate_argnums=(2,),
            out_shardings=out3,
        ),
        jax.jit(
            functools.partial(paged_steps.generate, g),
            static_argnums=(1, 3, 4),
            donate_argnums=(2,),
            out_shardings=out3,
        ),
        jax.jit(
            functools.partial(paged_steps.generate_steps, g),
            static_argnums=(1, 3, 4, 5),
            donate_argnums=(2,),
            out_shardings=out3,
        ),
        jax.jit(paged_steps.set_slot, donate_argnums=(0,), out_shardings=sh),
        jax.jit(paged_steps.set_row, donate_argnums=(0,), out_shardings=sh),
        jax.jit(paged_steps.set_pending, donate_argnums=(0,), out_shardings=sh),
        jax.jit(_export),
        jax.jit(_import, donate_argnums=(0,), out_shardings=sh),
    )


class PagedEngine:
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
        self.cfg, self.graphdef, self.mesh, self.page_size = cfg, graphdef, mesh, page_size
        self.max_concurrent_decodes, self.max_prefill_length = max_concurrent_decodes, max_prefill_length
        self.max_pages_per_slot, self.decode_steps = max_pages, decode_steps
        self.prefill_buckets = _buckets(prefill_buckets, max_prefill_length)
        self.decode_slot_buckets = _slot_buckets(decode_slot_buckets, max_concurrent_decodes, True)
        self.allocator = PageAllocator(num_pages)
        self._pages: list[list[int]] = [[] for _ in range(max_concurrent_decodes)]  # host mirror of the table
        self._lengths = [0] * max_concurrent_decodes
        self._active = [False] * max_concurrent_decodes
        self._flat = FlatParams()
        self._page_ops = PageOps(cfg, mesh, rules, page_size, max_pages * page_size)  # KV in transit: checks, moves
        self.record_experts = False  # routing replay is not recorded by the paged engine yet
        sh = _state_shardings(cfg, mesh, rules, page_size, num_pages)
        (self._prefill_jit, self._prefill_many_jit, self._generate_jit, self._generate_steps_jit, self._set_slot_jit,
         self._set_row_jit, self._pending_jit, self._export_jit, self._import_jit) = _programs(graphdef, cfg, mesh, sh)  # fmt: skip
        init = functools.partial(paged_steps.empty_state, cfg, max_concurrent_decodes, num_pages, page_size, max_pages)
        self.state: PagedState = jax.jit(init, out_shardings=sh)()

    # -- sizes, allocator, KV in transit ----------------------------------------------------------------
    @property
    def max_seq_len(self) -> int:
        """The longest session a slot can hold (``max_pages_per_slot`` pages), while free pages last."""
        return self.max_pages_per_slot * self.page_size

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def use_allocator(self, allocator) -> None:
        """Takes pages from ``allocator`` from now on (a session cache's ``PrefixCache``: slots and cached sessions
        then share the pool, cached sessions evicted least recently used first when slots need pages). Only
        while no page is in use."""
        if self.allocator.num_used or allocator.num_pages != self.allocator.num_pages or allocator.num_used:
            raise ValueError("an engine's allocator changes only while no page is in use, to one of the same pool size")
        self.allocator = allocator

    def check_kv(self, kv: KVPages) -> None:
        """Raises ValueError if ``kv`` was not made by an engine of this KV layout."""
        self._page_ops.check(kv)

    def to_mesh(self, kv: KVPages) -> KVPages:
        """Moves ``kv`` (possibly on another mesh) onto this engine's mesh."""
        return self._page_ops.to_mesh(kv)

    def export_pages(self, page_ids: Sequence[int]) -> KVPages:
        """Pool pages ``page_ids`` as one KVPages (count rounded up to a power of 2; the padding reads page 0)."""
        ids = np.zeros((_pow2_at_least(len(page_ids)),), np.int32)
        ids[: len(page_ids)] = page_ids
        return self._export_jit(self.state, jnp.asarray(ids))

    def import_pages(self, kv: KVPages, page_ids: Sequence[int]) -> None:
        """Writes the first ``len(page_ids)`` pages of ``kv`` (on this mesh) into pool pages ``page_ids``."""
        self.check_kv(kv)
        ids = np.full((kv.num_pages,), self.allocator.num_pages, np.int32)  # the rest: dropped
        ids[: len(page_ids)] = page_ids
        self.state = self._import_jit(self.state, kv, jnp.asarray(ids))

    # -- what the pool holds --------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer (K and V)."""
        c = self.state.pool[0].k
        return 2 * len(self.state.pool) * int(np.prod(c.shape[1:])) * c.dtype.itemsize

    def kv_bytes_held(self) -> int:
        """Bytes of the pages in use (slots' and sessions' kept by ``release(keep=True)``)."""
        return self.allocator.num_used * self.page_bytes

    def slot_length(self, slot: int) -> int:
        """Tokens in ``slot``'s pages."""
        return self._lengths[slot]

    # -- pages ------------------------------------------------------------------------------------------
    def _row(self, slot: int) -> jax.Array:
        row = np.full((self.max_pages_per_slot,), self.allocator.num_pages, np.int32)
        row[: len(self._pages[slot])] = self._pages[slot]
        return jnp.asarray(row)

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
            self.state = self._set_row_jit(self.state, jnp.int32(slot), self._row(slot))

    def _window(self, num_tokens: int) -> int:
        """Pages a program attends over for contexts of at most ``num_tokens``: a power of 2, capped."""
        return min(_pow2_at_least(-(-num_tokens // self.page_size)), self.max_pages_per_slot)

    def _bucket(self, n: int) -> int:
        return next(b for b in self.prefill_buckets if b >= n)

    # -- prefill, decode ----------------------------------------------------------------------------
    def prefill(
        self, params: nnx.State, slot: int, tokens: Sequence[int], sampling_params: SamplingParams, key: jax.Array
    ) -> tuple[int, float]:
        """Prefills ``tokens`` into ``slot``'s pages after the tokens it holds (none, or an attached session's), in
        chunks of at most ``max_prefill_length``, each with ``key`` (so chunking is invisible: the sampled token
        depends only on the whole sequence and the key). Returns the token sampled after the last one and its
        log-prob; ``start`` the slot to decode from there."""
        if self._active[slot]:
            raise ValueError(f"slot {slot} is decoding; release it before prefilling into it")
        if len(tokens) == 0:
            raise ValueError("cannot prefill an empty prompt")
        leaves = self._flat(params)
        temperature, top_k, top_p = _sampling_args(sampling_params)
        done, out = 0, None
        while done < len(tokens):
            n = min(self.max_prefill_length, len(tokens) - done)
            start = self._lengths[slot]
            self._ensure_pages(slot, start + n + 1)  # + 1: room for the token sampled next
            padded = np.zeros((1, self._bucket(n)), np.int32)
            padded[0, :n] = tokens[done : done + n]
            self.state, *out = self._prefill_jit(
                *leaves, self.state, jnp.int32(slot), jnp.asarray(padded), jnp.int32(n),
                self._window(start + n), temperature, top_k, top_p, key,
            )  # fmt: skip
            self._lengths[slot] = start + n
            done += n
        token, logprob = jax.device_get(out)
        return int(token), float(logprob)

    def prefill_many(
        self,
        params: nnx.State,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams],
        keys: Sequence[jax.Array],
    ) -> list[tuple[int, float]]:
        """Several whole prompts, ``prompts[i]`` into empty ``slots[i]`` (no pages, not decoding) with ``keys[i]``, in
        one program: packed side by side in rows as wide as the prefill bucket of the longest (``_pack_prompts``;
        each prompt at most ``max_prefill_length``, else prefill it alone, in chunks). Each slot ends as ``prefill``
        of its prompt alone leaves it, to float rounding; returns each prompt's sampled token and its log-prob
        (``start`` the slots to decode)."""
        return _prefill_many(self, params, slots, prompts, sampling, keys)

    def start(self, slot: int, resume: tuple[int, jax.Array, SamplingParams] | None = None) -> None:
        """``slot`` (prefilled) decodes from the next ``generate`` on, from the token its last prefill sampled, or
        ``resume``: (token, sampling key [2], sampling params) for a request resumed on KV it brought (its last
        sampled token is not in the pages yet)."""
        if self._lengths[slot] == 0:
            raise ValueError(f"slot {slot} holds no tokens: prefill it first")
        if resume is not None:
            token, key, sp = resume
            self.state = self._pending_jit(
                self.state, jnp.int32(slot), jnp.int32(token), jnp.asarray(key, jnp.uint32), *_sampling_args(sp)
            )
        self._active[slot] = True
        self._set(slot)

    def keys(self) -> np.ndarray:
        """[slots, 2] each slot's next sampling key (host copy; waits for the programs in flight)."""
        return np.asarray(jax.device_get(self.state.keys))

    def _set(self, slot: int) -> None:
        self.state = self._set_slot_jit(
            self.state, jnp.int32(slot), self._row(slot), jnp.int32(self._lengths[slot]), jnp.bool_(self._active[slot])
        )

    def generate(self, params: nnx.State, num_steps: int = 1, wait: bool = True) -> ResultTokens:
        """``num_steps`` (1 to ``decode_steps``) decode steps for every started slot, in one program; each slot is
        given the pages its next tokens need first. The result as ``Engine.generate``'s."""
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
            self.state, ints, logprobs = self._generate_jit(*leaves, self.state, pages, slots)
        else:
            self.state, ints, logprobs = self._generate_steps_jit(
                *leaves, self.state, pages, slots, self.decode_steps, jnp.int32(num_steps)
            )
        for s in live:
            self._lengths[s] += num_steps
        result = ResultTokens(_ints=ints, _logprobs=logprobs, _rows=None if num_steps == 1 else num_steps)
        if wait:
            return result.to_host()
        ints.copy_to_host_async()
        logprobs.copy_to_host_async()
        return result

    def _nothing_stepped(self, num_steps: int) -> ResultTokens:
        """The result of a step in which no slot could run: nothing valid."""
        lead = () if num_steps == 1 else (num_steps,)
        ints = np.zeros(lead + (3, self.max_concurrent_decodes), np.int32)
        ints[..., 2, :] = self._lengths
        return ResultTokens(_ints=ints, _logprobs=np.zeros(lead + (self.max_concurrent_decodes,), np.float32))

    # -- warm-up ------------------------------------------------------------------------------------------
    def _programs(self) -> list:
        return [self._prefill_jit, self._prefill_many_jit, self._generate_jit, self._generate_steps_jit,
                self._set_slot_jit, self._set_row_jit, self._pending_jit]  # fmt: skip

    def warmup(self, params: nnx.State) -> int:
        """Compiles every program shape the serving loop can dispatch on this engine, on no page (``warmup``);
        returns the number compiled."""
        return warmup(self, params)

    # -- a slot's end, a session's pages --------------------------------------------------------------
    def release(self, slot: int, keep: bool = False) -> SlotPages | None:
        """Ends ``slot``. ``keep``: its pages stay in the pool as the session's KV (returned: hand them to
        ``attach`` or ``drop``); else they return to the pool. The slot's KV holds every token but the newest
        sampled one."""
        kept = SlotPages(tuple(self._pages[slot]), self._lengths[slot]) if keep and self._pages[slot] else None
        if not keep:
            self.allocator.deallocate(self._pages[slot])
        self._pages[slot], self._lengths[slot], self._active[slot] = [], 0, False
        self._set(slot)
        return kept

    def attach(self, slot: int, kv: SlotPages) -> None:
        """Gives an empty ``slot`` a kept session's pages, as they are (no copy): prefill its next tokens on top."""
        if self._pages[slot] or self._active[slot]:
            raise ValueError(f"slot {slot} holds a request; release it first")
        self._pages[slot], self._lengths[slot] = list(kv.pages), kv.length
        self._set(slot)

    def drop(self, kv: SlotPages) -> None:
        """Returns a kept session's pages to the pool."""
        self.allocator.deallocate(kv.pages)

    # -- migration ------------------------------------------------------------------------------------
    def export(self, slot: int) -> KVPages:
        """``slot``'s tokens as ``KVPages`` (the page count rounded up to a power of 2; the padding reads page 0)."""
        pages = self._pages[slot][: -(-self._lengths[slot] // self.page_size)]
        if not pages:
            raise ValueError(f"slot {slot} holds no tokens")
        return self.export_pages(pages)

    def import_kv(self, slot: int, kv: KVPages, length: int) -> None:
        """Places ``length`` tokens of a session's ``kv`` (on this mesh) into an empty ``slot``'s new pages."""
        if self._pages[slot] or self._active[slot]:
            raise ValueError(f"slot {slot} holds a request; release it first")
        need = -(-length // self.page_size)
        if not 0 < need <= kv.num_pages:
            raise ValueError(f"length={length} must be in [1, {kv.num_pages} pages x {self.page_size} tokens]")
        self._ensure_pages(slot, length)
        self.import_pages(kv, self._pages[slot][:need])
        self._lengths[slot] = length
        self._set(slot)


def _prefill_many(engine: PagedEngine, params, slots, prompts, sampling, keys) -> list[tuple[int, float]]:
    """``PagedEngine.prefill_many``."""
    if not len(slots) == len(prompts) == len(sampling) == len(keys) or len(set(slots)) != len(slots):
        raise ValueError("prefill_many takes one distinct slot, sampling and key per prompt")
    for slot in slots:
        if engine._active[slot] or engine._pages[slot]:
            raise ValueError(f"slot {slot} holds a request or a session's pages; prefill_many fills empty slots")
    packed = _pack_prompts(prompts, engine)
    count = len(packed[-1])
    for slot, prompt in zip(slots, prompts):
        engine._ensure_pages(slot, len(prompt) + 1)  # + 1: room for the token sampled next
    at = np.full((count,), engine.max_concurrent_decodes, np.int32)  # padding prompts: out of range, dropped
    at[: len(slots)] = slots
    k = jnp.stack([*keys, *[keys[0]] * (count - len(keys))])
    engine.state, tokens, logprobs = engine._prefill_many_jit(
        *engine._flat(params), engine.state, jnp.asarray(at), *map(jnp.asarray, packed),
        *_sampling_rows(sampling, count), k,
    )  # fmt: skip
    for slot, prompt in zip(slots, prompts):
        engine._lengths[slot] = len(prompt)
    tokens, logprobs = jax.device_get((tokens, logprobs))
    return [(int(tokens[i]), float(logprobs[i])) for i in range(len(prompts))]


def _windows(engine: PagedEngine, lo: int, hi: int) -> list[int]:
    """The page counts a program of ``engine`` attends over for contexts of ``lo`` ... ``hi`` tokens."""
    out, t = [], lo
    while t <= hi:
        out.append(engine._window(t))
        if out[-1] >= engine.max_pages_per_slot:
            break
        t = out[-1] * engine.page_size + 1
    return out


def warmup(engine: PagedEngine, params: nnx.State) -> int:
    """Compiles every program shape the serving loop can dispatch on ``engine`` (prefill per bucket and page window
    a chunk of that bucket can reach; ``prefill_many`` per bucket, power-of-2 prompt count from 2 up to the one
    holding every slot and its ``packed_row_buckets``; generate per page window, slot bucket and number of steps;
    the slot updates),
    so that no compile stalls a running cell later. Runs on an engine with no slot decoding, through an empty slot
    whose block table maps no page: every KV write of these programs is dropped, the pool and the allocator are
    untouched, and the slot is reset to empty afterwards (the fields a prefill sets are set again by the next
    request's prefill or resume). Not run: the migration programs (export, import: one shape per power-of-2 page
    count). Returns the number of program shapes compiled (0 when already warm)."""
    if any(engine._active):
        raise ValueError("warmup runs before serving: a slot is decoding")
    slot = next((s for s in range(engine.max_concurrent_decodes) if not engine._pages[s]), None)
    if slot is None:
        raise ValueError("warmup needs an empty slot (one holding no pages)")
    before = sum(f._cache_size() for f in engine._programs())
    leaves = engine._flat(params)
    key = jnp.zeros((2,), jnp.uint32)
    greedy = _sampling_args(SamplingParams(temperature=0.0))
    lo = 1
    for bucket in engine.prefill_buckets:  # a chunk of lo..bucket tokens on top of 0.. cached ones
        n = min(bucket, engine.max_prefill_length)
        for window in _windows(engine, lo, engine.max_seq_len - 1):
            padded = jnp.zeros((1, bucket), jnp.int32)
            engine.state, *_ = engine._prefill_jit(
                *leaves, engine.state, jnp.int32(slot), padded, jnp.int32(n), window, *greedy, key
            )
        lo = bucket + 1
    count = 2
    while count // 2 < engine.max_concurrent_decodes:  # prefill_many: 2..slots prompts, packed in rows of each bucket
        for bucket in engine.prefill_buckets:
            for rows in packed_row_buckets(count):
                at = np.full((count,), engine.max_concurrent_decodes, np.int32)
                at[:rows] = slot  # the empty slot: its table maps no page, every KV write is dropped
                engine.state, *_ = engine._prefill_many_jit(
                    *leaves, engine.state, jnp.asarray(at), *map(jnp.asarray, _one_token_prompts(rows, bucket, count)),
                    *_sampling_rows([SamplingParams(temperature=0.0)], count), jnp.zeros((count, 2), jnp.uint32),
                )  # fmt: skip
        count *= 2
    for steps in sorted({1, engine.decode_steps}):  # no slot is active: nothing is stepped
        for window in _windows(engine, 1 + min(steps, 2), engine.max_seq_len):  # a multi-step call runs >= 2
            for slots in engine.decode_slot_buckets:
                if steps == 1:
                    engine.state, *_ = engine._generate_jit(*leaves, engine.state, window, slots)
                else:
                    engine.state, *_ = engine._generate_steps_jit(
                        *leaves, engine.state, window, slots, steps, jnp.int32(1)
                    )
    engine.state = engine._pending_jit(engine.state, jnp.int32(slot), jnp.int32(0), key, *greedy)
    engine.state = engine._set_row_jit(engine.state, jnp.int32(slot), engine._row(slot))
    engine._set(slot)  # the slot as it was: no pages, no tokens, not active
    jax.block_until_ready(engine.state)
    return sum(f._cache_size() for f in engine._programs()) - before
