"""A serving loop's session prefix cache: the host index (``PrefixCache``: session -> pages, LRU, counters)
together with the page pool on the engine's mesh that holds those pages' KV ([P, page_size, K, D] per layer).

Every page write and read goes through the engine (``save_slot``, ``load_prefix``, ``export_pages``,
``import_pages``); the pool is donated on writes, so this object is the only holder of it. Used from the
loop thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from gyre_jax.serving.engine import DecodeState, Engine, KVPages, Prefix
from gyre_jax.serving.prefix_cache import PrefixCache, PrefixCacheStats
from gyre_jax.serving.session import SessionState


class SessionCache:
    """``num_pages`` pages of ``engine.page_size`` tokens; the pool is allocated by ``ensure_pool``."""

    def __init__(self, engine: Engine, num_pages: int):
        self.engine = engine
        self.index = PrefixCache(num_pages, engine.page_size)
        self.pool: KVPages | None = None

    @property
    def stats(self) -> PrefixCacheStats:
        return self.index.stats

    def ensure_pool(self) -> None:
        if self.pool is None:
            self.pool = self.engine.init_page_pool(self.index.num_pages)

    def store(self, session_id: str, kv_tokens: Sequence[int], version: int, state: DecodeState, slot: int) -> None:
        """Keeps the KV of ``kv_tokens`` in decode ``slot`` as the session's entry (if it fits)."""
        pages = self.index.store(session_id, kv_tokens, version)
        if pages is not None:
            self.pool = self.engine.save_slot(self.pool, state, slot, pages)

    def take(
        self, session_id: str, target: Sequence[int], version: int | None, key: jax.Array
    ) -> tuple[Prefix, int, int] | None:
        """The session's cached prefix of ``target`` (computed under ``version``; None: any) as (prefix, tokens
        reused, the entry's policy version), or None; the entry leaves the cache."""
        hit = self.index.take(session_id, target, version)
        if hit is None:
            return None
        prefix = self.engine.load_prefix(self.pool, hit.entry.pages, hit.reused, key)
        self.index.release(hit.entry)  # the load above is dispatched first: later writes to these pages wait for it
        return prefix, hit.reused, hit.entry.version

    def put(self, session_id: str, kv_tokens: Sequence[int], version: int, kv: KVPages) -> None:
        """Keeps imported KV (``kv``, on this mesh) of ``kv_tokens`` as the session's entry (if it fits)."""
        pages = self.index.store(session_id, kv_tokens, version)
        if pages is not None:
            self.pool = self.engine.import_pages(self.pool, kv, pages)

    def export(self, wanted: Callable[[str | None], bool], source: str) -> list[SessionState]:
        """Removes the wanted sessions' entries and returns them as idle sessions, KV included."""
        out = []
        for sid in self.index.sessions():
            if wanted(sid):
                entry = self.index.pop(sid)
                kv = self.engine.export_pages(self.pool, entry.pages)
                self.index.release(entry)
                out.append(SessionState(sid, kv, entry.tokens.tolist(), entry.version, source=source))
        return out

    def drop_stale(self, version: int) -> None:
        self.index.drop_stale(version)
