"""An in-memory stand-in for the key-value store of jax's coordination client (``jax.distributed``).

It has the calls ``gyre_jax.runtime.channel.Channel`` uses (``key_value_set_bytes``,
``blocking_key_value_get_bytes``, ``key_value_delete``), so channel and remote-cell tests run in one
process without ``jax.distributed``. Like the real store it refuses to overwrite a key (a second write of
one key is a protocol bug), and a blocking get past its timeout raises a ``DEADLINE_EXCEEDED`` error.

Import it from a test module with::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    from memory_kv import MemoryKV
"""

from __future__ import annotations

import threading


class MemoryKV:
    """The subset of jax's DistributedRuntimeClient the channels use, in memory; ``data`` maps key -> bytes."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        with self.cond:
            assert key not in self.data, f"{key} written twice"
            self.data[key] = value
            self.cond.notify_all()

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout=timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.data[key]

    def key_value_delete(self, key: str) -> None:
        with self.cond:
            self.data.pop(key, None)
