#!/usr/bin/env bash
set -euo pipefail
cat > ratelimit.py <<'EOF'
"""Token-bucket rate limiting."""

import time
from collections import OrderedDict

EPS = 1e-9


def _positive(name, x):
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
        raise ValueError(f"{name} must be a number > 0, got {x!r}")
    return x


class TokenBucket:
    def __init__(self, rate, capacity, clock=time.monotonic):
        self.rate = _positive("rate", rate)
        self.capacity = _positive("capacity", capacity)
        self._clock = clock
        self._tokens = float(capacity)
        self._last = clock()

    def _refill(self):
        now = self._clock()
        if now > self._last:
            self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.rate)
        self._last = now

    def _check(self, n):
        _positive("n", n)
        if n > self.capacity:
            raise ValueError(f"n={n} exceeds the capacity {self.capacity}")

    @property
    def tokens(self):
        self._refill()
        return self._tokens

    def try_acquire(self, n=1):
        self._check(n)
        self._refill()
        if self._tokens >= n - EPS:
            self._tokens = max(0.0, self._tokens - n)
            return True
        return False

    def wait_time(self, n=1):
        self._check(n)
        self._refill()
        if self._tokens >= n - EPS:
            return 0.0
        return (n - self._tokens) / self.rate


class KeyedLimiter:
    def __init__(self, rate, capacity, clock=time.monotonic, idle_timeout=60.0, max_keys=None):
        _positive("rate", rate)
        _positive("capacity", capacity)
        _positive("idle_timeout", idle_timeout)
        if max_keys is not None and (isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1):
            raise ValueError(f"max_keys must be None or an int >= 1, got {max_keys!r}")
        self.rate, self.capacity, self._clock = rate, capacity, clock
        self.idle_timeout, self.max_keys = idle_timeout, max_keys
        self._buckets = OrderedDict()  # key -> (bucket, last_use); LRU first

    def _bucket(self, key):
        now = self._clock()
        for k in [k for k, (_, last) in self._buckets.items() if now - last >= self.idle_timeout]:
            del self._buckets[k]
        if key in self._buckets:
            bucket = self._buckets.pop(key)[0]
        else:
            if self.max_keys is not None:
                while len(self._buckets) >= self.max_keys:
                    self._buckets.popitem(last=False)
            bucket = TokenBucket(self.rate, self.capacity, self._clock)
        self._buckets[key] = (bucket, now)
        return bucket

    def try_acquire(self, key, n=1):
        return self._bucket(key).try_acquire(n)

    def wait_time(self, key, n=1):
        return self._bucket(key).wait_time(n)

    def keys(self):
        return list(self._buckets)

    def __len__(self):
        return len(self._buckets)

    def __contains__(self, key):
        return key in self._buckets
EOF
