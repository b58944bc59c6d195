"""Token-bucket rate limiting (see instruction.md)."""

import time


class TokenBucket:
    def __init__(self, rate, capacity, clock=time.monotonic):
        raise NotImplementedError

    @property
    def tokens(self):
        raise NotImplementedError

    def try_acquire(self, n=1):
        raise NotImplementedError

    def wait_time(self, n=1):
        raise NotImplementedError


class KeyedLimiter:
    def __init__(self, rate, capacity, clock=time.monotonic, idle_timeout=60.0, max_keys=None):
        raise NotImplementedError

    def try_acquire(self, key, n=1):
        raise NotImplementedError

    def wait_time(self, key, n=1):
        raise NotImplementedError

    def keys(self):
        raise NotImplementedError

    def __len__(self):
        raise NotImplementedError

    def __contains__(self, key):
        raise NotImplementedError
