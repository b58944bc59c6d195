#!/usr/bin/env bash
set -euo pipefail
cat > lrucache.py <<'PYEOF'
"""An LRU cache with optional time-to-live."""

import time
from collections import OrderedDict

_MISSING = object()


class LRUCache:
    def __init__(self, capacity, ttl=None, clock=time.monotonic):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0):
            raise ValueError(f"ttl must be None or a number > 0, got {ttl!r}")
        self.capacity = capacity
        self.ttl = ttl
        self._clock = clock
        self._data = OrderedDict()  # key -> (value, expires_at or None), least recently used first
        self.hits = 0
        self.misses = 0

    def _purge(self):
        now = self._clock()
        dead = [k for k, (_, exp) in self._data.items() if exp is not None and now >= exp]
        for k in dead:
            del self._data[k]

    def _lookup(self, key):
        self._purge()
        entry = self._data.get(key, _MISSING)
        return _MISSING if entry is _MISSING else entry[0]

    def get(self, key, default=None):
        value = self._lookup(key)
        if value is _MISSING:
            self.misses += 1
            return default
        self.hits += 1
        self._data.move_to_end(key)
        return value

    def peek(self, key, default=None):
        value = self._lookup(key)
        return default if value is _MISSING else value

    def put(self, key, value):
        self._purge()
        evicted = None
        if key not in self._data and len(self._data) >= self.capacity:
            old_key, (old_value, _) = self._data.popitem(last=False)
            evicted = (old_key, old_value)
        expires = None if self.ttl is None else self._clock() + self.ttl
        self._data[key] = (value, expires)
        self._data.move_to_end(key)
        return evicted

    def delete(self, key):
        self._purge()
        return self._data.pop(key, _MISSING) is not _MISSING

    def keys(self):
        self._purge()
        return list(self._data)

    def clear(self):
        self._data.clear()

    def __len__(self):
        self._purge()
        return len(self._data)

    def __contains__(self, key):
        return self._lookup(key) is not _MISSING
PYEOF
