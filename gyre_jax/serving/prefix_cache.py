"""The session prefix cache's index: which pages of the KV page pool hold which session's tokens.

Host-side bookkeeping only (the pages themselves are in a pool its engine owns, which allocates them through this
index: ``ServingEngine.use_pages``; a paged engine's slots take theirs from it too). One entry per session: the
token ids whose KV its pages hold, the policy version that computed them, and the pages. The budget is the pool's
page count, fixed at start; storing a session evicts the least recently used entries until its pages fit.
Counters say how well it works.

Rule of use (the serving loop follows it): when a request of session ``s`` is admitted, ``take`` removes
``s``'s entry and reports how many leading prompt tokens it covers (the longest common prefix, at most
``len(prompt) - 1``, so at least one token is prefilled to sample from); the request's slot takes those pages
(``ServingEngine.attach``). When the request ends, its slot's KV of prompt + completion (all tokens whose KV is in
the slot) becomes ``s``'s new entry (``adopt``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from gyre_jax.serving.types import PagePoolExhausted


@dataclasses.dataclass
class CacheEntry:
    session_id: str
    tokens: np.ndarray  # [n] int32: ids whose KV the pages hold, positions 0 .. n-1
    pages: list[int]  # pool page ids, ceil(n / page_size) of them, in position order
    version: int  # policy version that computed the KV (the oldest, if it spans an update)


@dataclasses.dataclass
class Hit:
    entry: CacheEntry
    reused: int  # leading prompt tokens whose KV comes from the entry


@dataclasses.dataclass
class PrefixCacheStats:
    """Counters (monotonic) and the current occupancy of a session prefix cache."""

    hits: int = 0  # admitted requests that reused >= 1 cached token
    misses: int = 0  # admitted requests of a session that reused nothing
    tokens_reused: int = 0  # prompt tokens not prefilled thanks to the cache
    stores: int = 0
    tokens_stored: int = 0
    evictions: int = 0  # entries dropped to make room (LRU)
    stale_drops: int = 0  # entries dropped because the policy version changed
    not_stored: int = 0  # sessions that did not fit (longer than the pool, or pages held by taken entries)
    entries: int = 0
    pages_used: int = 0
    pages_total: int = 0


class PrefixCache:
    """LRU index over a fixed pool of ``num_pages`` pages of ``page_size`` tokens (not thread-safe: one owner)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self._entries: collections.OrderedDict[str, CacheEntry] = collections.OrderedDict()  # LRU first
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: low ids first
        self._stats = PrefixCacheStats(pages_total=num_pages)

    # -- queries ------------------------------------------------------------------------------------
    @property
    def stats(self) -> PrefixCacheStats:
        return dataclasses.replace(self._stats, entries=len(self._entries), pages_used=self.num_pages - len(self._free))

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def sessions(self) -> list[str]:
        """Cached session ids, least recently used first."""
        return list(self._entries)

    def entry(self, session_id: str) -> CacheEntry | None:
        """The session's entry (not a use: its LRU place stays), or None."""
        return self._entries.get(session_id)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- lookups ------------------------------------------------------------------------------------
    def take(self, session_id: str, prompt: Sequence[int], version: int | None = None) -> Hit | None:
        """Removes ``session_id``'s entry if it covers >= 1 leading token of ``prompt`` (and was computed by
        ``version``, unless None) and returns it with the reused length. Call ``release`` once its pages
        have been read. A miss leaves the entry in place."""
        entry = self._entries.get(session_id)
        if entry is None:
            self._stats.misses += 1
            return None
        if version is not None and entry.version != version:
            self._drop(session_id)
            self._stats.stale_drops += 1
            self._stats.misses += 1
            return None
        reused = min(common_prefix_len(entry.tokens, prompt), len(prompt) - 1)
        if reused < 1:
            self._stats.misses += 1
            return None
        del self._entries[session_id]
        self._stats.hits += 1
        self._stats.tokens_reused += reused
        return Hit(entry=entry, reused=reused)

    def release(self, entry: CacheEntry) -> None:
        """Returns a taken entry's pages to the pool."""
        self._free.extend(reversed(entry.pages))

    def pop(self, session_id: str) -> CacheEntry | None:
        """Removes and returns an entry (for export) without counting a hit; ``release`` it after reading."""
        return self._entries.pop(session_id, None)

    # -- updates ------------------------------------------------------------------------------------
    def store(self, session_id: str, tokens: Sequence[int], version: int) -> list[int] | None:
        """Makes ``tokens`` the session's entry and returns the pages to write their KV to (in position
        order), evicting least recently used entries as needed; None if it cannot fit the whole pool."""
        self.discard(session_id)
        need = self.pages_for(len(tokens))
        if need == 0:
            return None
        try:
            pages = self.allocate(need)
        except PagePoolExhausted:
            self.count_not_stored()
            return None
        self.adopt(session_id, tokens, version, pages)
        return pages

    def discard(self, session_id: str) -> None:
        """Drops the session's entry, if any (its pages return to the pool)."""
        self._drop(session_id)

    def count_not_stored(self) -> None:
        """Counts a session whose KV did not fit (``stats.not_stored``)."""
        self._stats.not_stored += 1

    # -- as the page allocator of an engine's pool (``ServingEngine.use_pages``; a paged engine's slots too) ------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` free pages for a decode slot, evicting least recently used entries as needed; raises
        ``PagePoolExhausted`` when slots hold too many pages for that."""
        if n > len(self._free) + sum(len(e.pages) for e in self._entries.values()):
            raise PagePoolExhausted(
                f"the KV page pool is spent: {n} more page(s) needed, {len(self._free)} of {self.num_pages} free and "
                f"{len(self._entries)} cached session(s) to evict; fewer concurrent sessions, or more num_pages"
            )
        while len(self._free) < n:
            self._drop(next(iter(self._entries)))
            self._stats.evictions += 1
        return [self._free.pop() for _ in range(n)]

    def deallocate(self, pages: Sequence[int]) -> None:
        """Returns pages a slot held to the pool."""
        self._free.extend(reversed(pages))

    def adopt(self, session_id: str, tokens: Sequence[int], version: int, pages: Sequence[int]) -> None:
        """Makes ``pages`` (in position order, taken by ``allocate``, holding ``tokens``' KV) the session's entry:
        a finished slot's pages become the session's cache entry where they are."""
        self._drop(session_id)
        self._entries[session_id] = CacheEntry(session_id, np.asarray(tokens, np.int32), list(pages), version)
        self._stats.stores += 1
        self._stats.tokens_stored += len(tokens)

    def drop_stale(self, version: int) -> int:
        """Drops every entry not computed by ``version`` (after a weight update). Returns how many."""
        stale = [s for s, e in self._entries.items() if e.version != version]
        for s in stale:
            self._drop(s)
        self._stats.stale_drops += len(stale)
        return len(stale)

    def _drop(self, session_id: str) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self.release(entry)


def common_prefix_len(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n
