"""PrefixCache (host index of the session prefix cache): matching, LRU eviction within a fixed page
budget, stale versions, counters; and its invariants under random operation sequences."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.serving.prefix_cache import PrefixCache, common_prefix_len


def test_take_reuses_the_longest_common_prefix_and_leaves_one_token_to_prefill() -> None:
    cache = PrefixCache(num_pages=8, page_size=4)
    pages = cache.store("s", [1, 2, 3, 4, 5, 6], version=0)
    assert pages == [0, 1] and cache.stats.pages_used == 2 and cache.stats.tokens_stored == 6
    # the next prompt extends the cached tokens: all 6 are reused
    hit = cache.take("s", [1, 2, 3, 4, 5, 6, 7, 8], version=0)
    assert hit is not None and hit.reused == 6 and hit.entry.pages == [0, 1]
    assert "s" not in cache and cache.stats.pages_used == 2  # taken, not yet released
    cache.release(hit.entry)
    assert cache.stats.pages_used == 0

    cache.store("s", [1, 2, 3, 4, 5, 6], version=0)
    hit = cache.take("s", [1, 2, 9, 9], version=0)  # diverges after 2 tokens: only those are reused
    assert hit.reused == 2
    cache.release(hit.entry)
    cache.store("s", [1, 2, 3], version=0)
    hit = cache.take("s", [1, 2, 3], version=0)  # the same prompt again: the last token is prefilled to sample from
    assert hit.reused == 2
    cache.release(hit.entry)
    cache.store("s", [1, 2, 3], version=0)
    assert cache.take("s", [9, 2, 3], version=0) is None and "s" in cache  # nothing in common: a miss keeps it
    assert cache.take("other", [1, 2, 3], version=0) is None
    s = cache.stats
    assert (s.hits, s.misses, s.tokens_reused) == (3, 2, 6 + 2 + 2)


def test_lru_eviction_within_the_page_budget() -> None:
    cache = PrefixCache(num_pages=5, page_size=4)
    cache.store("a", list(range(8)), 0)  # 2 pages
    cache.store("b", list(range(5)), 0)  # 2 pages
    assert cache.stats.pages_used == 4
    cache.release(cache.take("a", list(range(10)), 0).entry)  # a's next call starts ...
    cache.store("a", list(range(13)), 0)  # ... and ends: 4 pages; b (least recently used) is evicted to make room
    assert cache.sessions() == ["a"] and cache.stats.evictions == 1
    cache.store("c", list(range(8)), 0)  # 2 more pages: a must go
    assert cache.sessions() == ["c"] and cache.stats.evictions == 2
    assert cache.store("huge", list(range(21)), 0) is None  # 6 pages > the whole pool: not cached
    assert cache.stats.not_stored == 1 and "huge" not in cache and "c" in cache
    cache.store("c", [7], 0)  # storing a session again replaces its entry (and frees its pages)
    assert cache.stats.pages_used == 1 and cache.stats.entries == 1


def test_stale_versions_are_dropped() -> None:
    cache = PrefixCache(num_pages=8, page_size=4)
    cache.store("old", [1, 2, 3], 0)
    cache.store("new", [1, 2, 3], 1)
    assert cache.take("old", [1, 2, 3, 4], version=1) is None and "old" not in cache  # computed by another policy
    assert cache.take("new", [1, 2, 3, 4], version=None).reused == 3  # None: any version will do
    cache.store("a", [1], 1)
    cache.store("b", [1], 2)
    assert cache.drop_stale(2) == 1 and cache.sessions() == ["b"]
    assert cache.stats.stale_drops == 2


def test_common_prefix_len() -> None:
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len(np.array([1, 2, 3], np.int32), [1, 5]) == 1
    assert common_prefix_len([7], [8]) == 0


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_pages=0"):
        PrefixCache(0, 16)


_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "take", "drop_stale"]), st.integers(0, 4), st.integers(1, 30), st.integers(0, 2)
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_pages_are_never_shared_or_lost(ops) -> None:
    """Against a model of the cache: every page is free xor held by exactly one entry or one taken hit,
    entries hold ceil(n / page_size) pages, and the LRU order is the order of last store."""
    cache = PrefixCache(num_pages=6, page_size=4)
    taken = []
    order = collections.OrderedDict()  # model: session -> tokens, in LRU order
    for op, s, n, version in ops:
        sid = f"s{s}"
        tokens = list(range(100 * s, 100 * s + n))
        if op == "store":
            pages = cache.store(sid, tokens, version)
            order.pop(sid, None)
            if pages is not None:
                assert len(pages) == -(-n // 4)
                order[sid] = tokens
        elif op == "take":
            hit = cache.take(sid, tokens + [1], version)
            if hit is not None:
                assert hit.reused == min(n, len(order[sid]))
                taken.append(hit.entry)
                order.pop(sid)
        else:
            cache.drop_stale(version)
        for gone in [x for x in order if x not in cache]:  # evicted or dropped: only ever from the cache's side
            order.pop(gone)
        assert list(order) == cache.sessions()
        held = [p for e in cache._entries.values() for p in e.pages] + [p for e in taken for p in e.pages]
        assert len(held) == len(set(held))  # no page in two places
        assert sorted(held + cache._free) == list(range(6))  # none lost
        assert cache.stats.pages_used == len(held)
        if taken and len(taken) % 2 == 0:
            cache.release(taken.pop(0))
