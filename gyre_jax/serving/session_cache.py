"""A serving loop's session prefix cache: the host index (``PrefixCache``: session -> pages, LRU, counters) of the
pages of its engine's pool that hold cached sessions' KV, on either KV layout.

The engine owns the pool and allocates its pages through this index (``ServingEngine.use_pages``): on the dense
layout a pool beside the slots, into which a finished request's KV is copied (``release(keep=...)``) and from which
the next request's prefix is loaded (``attach``); on the paged layout the slots' own pool, so a finished request's
pages become its session's entry where they are, the next request decodes from them without a copy, and slots
that need pages evict cached sessions least recently used first. Used from the loop thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gyre_jax.serving.engine_api import ServingEngine, SlotPages
from gyre_jax.serving.kv_cache import KVPages
from gyre_jax.serving.prefix_cache import PrefixCache, PrefixCacheStats
from gyre_jax.serving.session import SessionState


class SessionCache:
    """``num_pages`` pages of ``engine.page_size`` tokens of ``engine``'s pool, indexed by session."""

    def __init__(self, engine: ServingEngine, num_pages: int):
        self.engine = engine
        self.index = PrefixCache(num_pages, engine.page_size)
        engine.use_pages(self.index)

    @property
    def stats(self) -> PrefixCacheStats:
        return self.index.stats

    def store(self, session_id: str, kv_tokens: Sequence[int], version: int, slot: int) -> None:
        """Ends decode ``slot``, keeping the KV of ``kv_tokens`` (computed under ``version``) as the session's entry
        if the pool can hold it (its previous entry makes room first)."""
        self.index.discard(session_id)
        kept = self.engine.release(slot, keep=len(kv_tokens))
        if kept is None:
            self.index.count_not_stored()
        else:
            self.index.adopt(session_id, kv_tokens, version, kept.pages)

    def take(self, session_id: str, target: Sequence[int], version: int | None) -> tuple[SlotPages, int, int] | None:
        """The session's cached pages covering a prefix of ``target`` (computed under ``version``; None: any) as
        (pages for the request's slot: ``engine.attach``, tokens reused, the entry's version), or None. The pages
        leave the cache with the request."""
        hit = self.index.take(session_id, target, version)
        if hit is None:
            return None
        return SlotPages(tuple(hit.entry.pages), hit.reused), hit.reused, hit.entry.version

    def put(self, session_id: str, kv_tokens: Sequence[int], version: int, kv: KVPages) -> None:
        """Keeps imported KV (on this mesh) of ``kv_tokens`` as the session's entry, if the pool has room."""
        pages = self.index.store(session_id, kv_tokens, version)
        if pages is not None:
            self.engine.import_pages(kv, pages)

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
