import pytest
from ratelimit import KeyedLimiter, TokenBucket


class FakeClock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


def test_bucket_starts_full_and_drains():
    c = FakeClock()
    b = TokenBucket(rate=1, capacity=3, clock=c)
    assert b.tokens == pytest.approx(3)
    assert [b.try_acquire() for _ in range(4)] == [True, True, True, False]
    assert b.tokens == pytest.approx(0)


def test_bucket_refills_continuously_up_to_capacity():
    c = FakeClock()
    b = TokenBucket(rate=2, capacity=5, clock=c)
    assert b.try_acquire(5)
    c.advance(1.25)
    assert b.tokens == pytest.approx(2.5)
    assert not b.try_acquire(3)
    assert b.tokens == pytest.approx(2.5)
    assert b.try_acquire(2.5)
    c.advance(1000)
    assert b.tokens == pytest.approx(5)


def test_bucket_tolerance_with_float_steps():
    c = FakeClock(0.7)
    b = TokenBucket(rate=1, capacity=1, clock=c)
    assert b.try_acquire(1)
    for _ in range(3):
        c.advance(0.1)  # 0.7 + 0.1 + 0.1 + 0.1 == 0.9999999999999999: a hair under 0.3 s elapsed
    assert b.try_acquire(0.3)
    assert b.tokens >= 0.0
    assert not b.try_acquire(0.1)


def test_bucket_wait_time():
    c = FakeClock()
    b = TokenBucket(rate=4, capacity=8, clock=c)
    assert b.wait_time(8) == 0.0
    assert b.try_acquire(6)
    assert b.wait_time(2) == 0.0
    assert b.wait_time(4) == pytest.approx(0.5)
    assert b.tokens == pytest.approx(2)  # wait_time consumed nothing
    c.advance(0.5)
    assert b.try_acquire(4)


def test_bucket_clock_backwards():
    c = FakeClock(50.0)
    b = TokenBucket(rate=1, capacity=10, clock=c)
    assert b.try_acquire(10)
    c.advance(4)
    assert b.tokens == pytest.approx(4)
    c.advance(-3)
    assert b.tokens == pytest.approx(4)
    c.advance(2)  # measured from the earlier time: +2 tokens
    assert b.tokens == pytest.approx(6)


def test_bucket_validation():
    c = FakeClock()
    for rate, cap in [(0, 1), (-1, 1), (1, 0), (True, 1), ("1", 1)]:
        with pytest.raises(ValueError):
            TokenBucket(rate, cap, clock=c)
    b = TokenBucket(1, 2, clock=c)
    for n in (0, -1, 3):
        with pytest.raises(ValueError):
            b.try_acquire(n)
        with pytest.raises(ValueError):
            b.wait_time(n)
    assert b.tokens == pytest.approx(2)


def test_keyed_independent_buckets():
    c = FakeClock()
    lim = KeyedLimiter(rate=1, capacity=2, clock=c)
    assert lim.try_acquire("a", 2)
    assert not lim.try_acquire("a")
    assert lim.try_acquire("b")
    assert lim.wait_time("a") == pytest.approx(1.0)
    assert lim.wait_time("b") == 0.0
    assert len(lim) == 2 and "a" in lim and "c" not in lim


def test_keyed_idle_eviction_resets_bucket():
    c = FakeClock()
    lim = KeyedLimiter(rate=0.001, capacity=5, clock=c, idle_timeout=10)
    assert lim.try_acquire("a", 5)
    c.advance(5)
    assert lim.try_acquire("b")
    c.advance(5)  # "a" idle for exactly 10 s: forgotten at the next call
    assert "a" in lim  # membership checks evict nothing
    assert lim.wait_time("b", 5) == pytest.approx((5 - 4.005) / 0.001)
    assert "a" not in lim and len(lim) == 1
    assert lim.try_acquire("a", 5)  # came back full


def test_keyed_lru_bound():
    c = FakeClock()
    lim = KeyedLimiter(rate=1, capacity=1, clock=c, max_keys=2)
    lim.try_acquire("a")
    c.advance(0.1)
    lim.try_acquire("b")
    c.advance(0.1)
    lim.wait_time("a")  # a use: "b" is now least recently used
    assert lim.keys() == ["b", "a"]
    c.advance(0.1)
    lim.try_acquire("c")
    assert lim.keys() == ["a", "c"]
    assert not lim.try_acquire("a")  # "a" kept its (empty) bucket


def test_keyed_validation():
    c = FakeClock()
    with pytest.raises(ValueError):
        KeyedLimiter(1, 1, clock=c, idle_timeout=0)
    with pytest.raises(ValueError):
        KeyedLimiter(1, 1, clock=c, max_keys=0)
    with pytest.raises(ValueError):
        KeyedLimiter(0, 1, clock=c)
    lim = KeyedLimiter(1, 1, clock=c)
    with pytest.raises(ValueError):
        lim.try_acquire("k", 2)
