"""A serving loop's decode slots and session cache on a paged engine (``serving.paged.PagedEngine``).

``PagedBatch`` is ``batch.DecodeBatch`` with the KV in the engine's page pool instead of dense slots and
prefixes: a job's prompt is prefilled straight into its slot's pages; the engine owns the device state.
``PagedSessionCache`` keeps each session's KV where its last request left it: the index (a ``PrefixCache``)
is the engine's page allocator, so slots and cached sessions share the pool, a finished request's pages
become its session's entry without a copy, the session's next request decodes from them without a copy,
and slots that need pages evict cached sessions least recently used first. Used from the loop thread only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from gyre_jax.serving.batch import DecodeBatch, num_steps
from gyre_jax.serving.jobs import Job, LoopStats, Step
from gyre_jax.serving.kv_cache import KVPages
from gyre_jax.serving.paged import PagedEngine, SlotPages
from gyre_jax.serving.prefix_cache import PrefixCache, PrefixCacheStats
from gyre_jax.serving.session import SessionState
from gyre_jax.serving.types import PagePoolExhausted

log = logging.getLogger(__name__)


class PagedSessionCache:
    """Sessions' KV left in ``engine``'s pool, indexed by a ``PrefixCache`` that also allocates the slots' pages."""

    def __init__(self, engine: PagedEngine):
        self.engine = engine
        self.index = PrefixCache(engine.num_pages, engine.page_size)
        engine.use_allocator(self.index)

    @property
    def stats(self) -> PrefixCacheStats:
        return self.index.stats

    def keep(self, session_id: str, kv_tokens: Sequence[int], version: int, kept: SlotPages) -> None:
        """A finished request's pages become the session's entry (those holding ``kv_tokens``; the rest, e.g. a
        step decoded after the request ended, return to the pool)."""
        need = self.index.pages_for(len(kv_tokens))
        self.index.deallocate(kept.pages[need:])
        if need:
            self.index.adopt(session_id, kv_tokens, version, kept.pages[:need])

    def take(self, session_id: str, target: Sequence[int], version: int | None) -> tuple[SlotPages, int, int] | None:
        """The session's cached pages covering a prefix of ``target`` (computed under ``version``; None: any) as
        (pages for the request's slot, tokens reused, the entry's version), or None. The pages leave the cache
        with the request: its slot decodes from them."""
        hit = self.index.take(session_id, target, version)
        if hit is None:
            return None
        return SlotPages(tuple(hit.entry.pages), hit.reused), hit.reused, hit.entry.version

    def put(self, session_id: str, kv_tokens: Sequence[int], version: int, kv: KVPages) -> None:
        """Keeps imported KV (on this mesh) of ``kv_tokens`` as the session's entry, if the pool has room."""
        try:
            pages = self.index.allocate(self.index.pages_for(len(kv_tokens)))
        except PagePoolExhausted:
            self.index._stats.not_stored += 1
            return
        self.engine.import_pages(kv, pages)
        self.index.adopt(session_id, kv_tokens, version, pages)

    def export(self, wanted: Callable[[str | None], bool], source: str) -> list[SessionState]:
        """Removes the wanted sessions' entries and returns them as idle sessions, KV included."""
        out = []
        for sid in self.index.sessions():
            if wanted(sid):
                entry = self.index.pop(sid)
                kv = self.engine.export_pages(entry.pages)
                self.index.release(entry)  # the export is dispatched first: later writes to these pages wait for it
                out.append(SessionState(sid, kv, entry.tokens.tolist(), entry.version, source=source))
        return out

    def drop_stale(self, version: int) -> None:
        self.index.drop_stale(version)

    def give_back(self, kv: SlotPages) -> None:
        """A cache hit's pages that never reached a slot (its request ended or moved first) return to the pool."""
        self.index.deallocate(kv.pages)


class PagedBatch(DecodeBatch):
    """``DecodeBatch`` on a ``PagedEngine`` (no routing replay)."""

    def __init__(
        self,
        engine: PagedEngine,
        params,
        version: int,
        *,
        name: str,
        prefill_chunk: int,
        lock: threading.Condition,
        stats: LoopStats,
        cache: PagedSessionCache | None,
        prefill_together: bool = True,
        lookahead: int = 2,
    ):
        super().__init__(
            engine,
            params,
            version,
            name=name,
            prefill_chunk=prefill_chunk,
            lock=lock,
            stats=stats,
            cache=None,
            prefill_together=prefill_together,
            lookahead=lookahead,
        )
        self.cache = cache  # type: ignore[assignment]  # the paged cache: same role, pages in the engine's pool

    def ensure_state(self) -> None:  # the engine holds its state
        return None

    def admit(self, job: Job, reuse_stale_kv: bool) -> None:
        """Notes the KV a job starts from (imported, or its session's cached pages); its slot gets it at its first
        prefill (``_place``)."""
        if job.kv is not None:
            job.done = job.done if job.resuming else min(job.done, len(job.target) - 1)
            if job.done == 0:
                job.kv = None
            return
        sid = job.request.session_id
        if self.cache is None or sid is None or job.resuming:
            return
        hit = self.cache.take(sid, job.target, None if reuse_stale_kv else self.version)
        if hit is not None:
            job.pages, job.done, job.kv_version = hit
            job.cached_tokens = job.done

    def _place(self, slot: int, job: Job) -> None:
        """Gives ``slot`` the KV the job starts from, once."""
        if job.pages is not None:
            self.engine.attach(slot, job.pages)
            job.pages = None
        elif job.kv is not None:
            self.engine.import_kv(slot, job.kv, job.done)
            job.kv = None

    def _prefill_chunk(self, slot: int, job: Job, n: int) -> bool:
        """Prefills the next ``n`` ids of the job's target into its slot's pages; False if that failed (the job
        failed, its slot is free)."""
        try:
            self._place(slot, job)
            job.first = self.engine.prefill(
                self.params, slot, job.target[job.done : job.done + n], job.request.sampling, job.key
            )
        except Exception as exc:  # this request fails; the loop serves on
            log.warning("serving loop %s: prefill of %s failed: %s", self.name, job.request.request_id, exc)
            with self.lock:
                self.slots[slot] = None
                self._free(slot, job)
            if not job.future.done():
                job.future.set_exception(exc)
            return False
        if job.kv_version is None:
            job.kv_version = self.version
        job.done += n
        self.stats.prefill_tokens += n
        self.stats.prefill_calls += 1
        return True

    def prefill_group(self, slots: Sequence[int], jobs: Sequence[Job]) -> list[tuple]:
        """Prefills the whole targets of ``jobs`` into ``slots``' pages in one program (``PagedEngine.prefill_many``)
        and starts the slots; returns each job's first sampled (token, log-prob)."""
        firsts = self.engine.prefill_many(
            self.params, slots, [j.target for j in jobs], [j.request.sampling for j in jobs], [j.key for j in jobs]
        )
        for slot in slots:
            self.engine.start(slot)
        return firsts

    def _start_decoding(self, slot: int, job: Job) -> None:
        self._place(slot, job)  # a resumed job whose KV covers its whole target prefills nothing
        if job.resuming:  # its last token was sampled before the move/update: decode from it, with the key after it
            self.engine.start(slot, (job.tokens[-1], job.key, job.request.sampling))
            self.begin(slot, job, None)
            return
        self.engine.start(slot)
        self.begin(slot, job, job.first)

    def _dispatch_generate(self, in_flight: Sequence[Step], multi_step: bool = False) -> Step | None:
        """Starts a generate program for the started slots (not waiting for it); the engine sizes it by their
        lengths. One step, or the engine's ``decode_steps`` with ``multi_step`` when no slot is still prefilling."""
        decoding, owes = self._decoding(in_flight)
        if not decoding:
            return None
        n = num_steps(self, decoding, owes, multi_step)
        result = self.engine.generate(self.params, num_steps=n, wait=False)
        self.stats.generate_steps += n
        self.stats.generate_calls += 1
        return Step(result=result, jobs=decoding, version=self.version, num_steps=n)

    def _free(self, slot: int, job: Job, keep: bool = False):
        """Releases ``slot``'s pages (``keep``: returned as the session's) and any cached pages the job never placed."""
        if job.pages is not None and self.cache is not None:
            self.cache.give_back(job.pages)
            job.pages = None
        return self.engine.release(slot, keep=keep)

    def finish(self, slot: int, reason: str, stop_reason=None, save: bool = True) -> None:
        """Ends the request in ``slot``: its pages become its session's cache entry (or return to the pool), its
        future resolves."""
        job = self.slots[slot]
        self.slots[slot] = None
        if job is None:
            return
        sid = job.request.session_id
        keep = save and job.decoding and self.cache is not None and sid is not None
        kept = self._free(slot, job, keep=keep)
        if kept is not None:
            kv_tokens = list(job.request.prompt_ids) + job.tokens[:-1]  # the newest token is sampled, not cached
            self.cache.keep(sid, kv_tokens, self.version if job.kv_version is None else job.kv_version, kept)
            self.stats.cache = self.cache.stats  # before the request's future resolves
        self.stats.requests_done += 1
        job.resolve(reason, self.name, stop_reason)

    def recompute_in_flight(self) -> None:
        """on_update="recompute": every request in a slot prefills its KV again under the new weights."""
        keys = self.engine.keys()
        for slot, job in enumerate(self.slots):
            if job is None:
                continue
            if job.decoding:
                job.key = jax.numpy.asarray(keys[slot])
                job.target = list(job.request.prompt_ids) + job.tokens[:-1]
                job.decoding = False
            self._free(slot, job)
            job.kv = None
            job.done, job.first, job.kv_version, job.cached_tokens = 0, None, None, 0

    def export(self, wanted) -> list[tuple[Job, KVPages | None, list[int], np.ndarray | None]]:
        """Takes the wanted jobs (by session id) out of their slots: (job, KV, ids the KV holds, sampling key)."""
        out, keys = [], None
        for slot, job in enumerate(self.slots):
            if job is None or not wanted(job.request.session_id):
                continue
            self._place(slot, job)
            if job.decoding:
                keys = self.engine.keys() if keys is None else keys
                kv_tokens, key = list(job.request.prompt_ids) + job.tokens[:-1], keys[slot]
            else:
                kv_tokens, key = job.target[: job.done], None if job.key is None else np.asarray(job.key)
            kv = self.engine.export(slot) if kv_tokens and self.engine.slot_length(slot) else None
            self._free(slot, job)
            self.slots[slot] = None
            out.append((job, kv, kv_tokens if kv is not None else [], key))
        return out
