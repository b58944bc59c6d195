import pytest
from lrucache import LRUCache


class FakeClock:
    def __init__(self, now=1000.0):
        self.now = now
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.now


def test_get_put_basic():
    c = LRUCache(2)
    assert c.put("a", 1) is None
    assert c.get("a") == 1
    assert c.get("zz") is None
    assert c.get("zz", "dflt") == "dflt"
    c.put("a", 5)
    assert c.get("a") == 5 and len(c) == 1


def test_eviction_of_least_recently_used():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.put("c", 3) == ("a", 1)
    assert c.keys() == ["b", "c"]
    assert "a" not in c


def test_get_and_put_refresh_recency():
    c = LRUCache(3)
    for k in "abc":
        c.put(k, k.upper())
    c.get("a")
    assert c.keys() == ["b", "c", "a"]
    c.put("b", "B2")
    assert c.keys() == ["c", "a", "b"]
    assert c.put("d", "D") == ("c", "C")
    assert c.put("a", "A2") is None  # replacing never evicts
    assert c.keys() == ["b", "d", "a"]


def test_peek_and_contains_do_not_touch_recency_or_counters():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.peek("a") == 1 and "a" in c and c.peek("x", 7) == 7
    assert (c.hits, c.misses) == (0, 0)
    assert c.put("c", 3) == ("a", 1)


def test_hit_and_miss_counters():
    c = LRUCache(1)
    c.put("a", 1)
    c.get("a")
    c.get("a")
    c.get("b")
    c.clear()
    c.get("a")
    assert (c.hits, c.misses) == (2, 2)
    assert len(c) == 0 and c.keys() == []


def test_delete():
    c = LRUCache(2)
    c.put("a", None)
    assert "a" in c and c.get("a", "d") is None
    assert c.delete("a") is True
    assert c.delete("a") is False
    assert len(c) == 0


@pytest.mark.parametrize("kwargs", [{"capacity": 0}, {"capacity": -1}, {"capacity": 1.5}, {"capacity": True}])
def test_bad_capacity(kwargs):
    with pytest.raises(ValueError):
        LRUCache(**kwargs)


def test_bad_ttl():
    for ttl in (0, -1, "5", True):
        with pytest.raises(ValueError):
            LRUCache(2, ttl=ttl)
    assert len(LRUCache(2, ttl=0.5)) == 0


def test_expiry_uses_injected_clock_and_boundary():
    clock = FakeClock()
    c = LRUCache(3, ttl=10, clock=clock)
    c.put("a", 1)
    clock.now += 9.999
    assert c.get("a") == 1
    clock.now += 0.001  # exactly t + ttl: expired
    assert c.get("a") is None
    assert "a" not in c and len(c) == 0
    assert clock.calls > 0


def test_put_restarts_ttl_but_get_does_not():
    clock = FakeClock(0)
    c = LRUCache(3, ttl=5, clock=clock)
    c.put("a", 1)
    c.put("b", 2)
    clock.now = 4
    c.put("a", 10)
    c.get("b")
    clock.now = 6
    assert c.keys() == ["a"]
    assert c.get("a") == 10 and c.get("b") is None


def test_expired_entries_free_capacity_without_eviction():
    clock = FakeClock(0)
    c = LRUCache(2, ttl=5, clock=clock)
    c.put("old", 1)
    clock.now = 3
    c.put("mid", 2)
    clock.now = 5  # "old" expired
    assert c.put("new", 3) is None
    assert c.keys() == ["mid", "new"]
    assert c.put("newer", 4) == ("mid", 2)


def test_delete_of_expired_entry_is_false_and_len_counts_live_only():
    clock = FakeClock(0)
    c = LRUCache(5, ttl=2, clock=clock)
    for i in range(4):
        clock.now = i
        c.put(i, i)
    clock.now = 3
    assert len(c) == 2 and c.keys() == [2, 3]
    assert c.delete(0) is False
    assert c.peek(1) is None


def test_large_workload_matches_reference_model():
    import random

    rng = random.Random(7)
    c = LRUCache(8)
    ref = []  # list of [key, value], LRU first
    for step in range(3000):
        k = rng.randrange(20)
        if rng.random() < 0.5:
            ev = c.put(k, step)
            hit = [e for e in ref if e[0] == k]
            expected = None
            if hit:
                ref.remove(hit[0])
            elif len(ref) == 8:
                expected = tuple(ref.pop(0))
            ref.append([k, step])
            assert ev == expected
        else:
            hit = [e for e in ref if e[0] == k]
            assert c.get(k) == (hit[0][1] if hit else None)
            if hit:
                ref.remove(hit[0])
                ref.append(hit[0])
    assert c.keys() == [e[0] for e in ref]
