"""Ordered one-way host messages between two processes of a run, through the coordination service's
key-value store (commands from the leader to a follower, replies back). Device data never travels here:
it moves by ``transfer`` programs (``runtime.transfer``)."""

from __future__ import annotations

import pickle
import threading
from typing import Any

PREFIX = "gyre/ch"
POLL_MS = 500  # a reader wakes this often to notice it was closed


class Channel:
    """Ordered one-way messages (pickled Python objects) through the coordination service's key-value store.

    One writer and one reader: message ``k`` is key ``gyre/ch/<name>/<k>``; the reader deletes each key
    after reading it. Both ends are the same program (one run, one code version), so pickle is safe here.
    """

    def __init__(self, client: Any, name: str):
        self.client = client
        self.name = name
        self._send_seq = 0
        self._recv_seq = 0
        self._lock = threading.Lock()

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            key = f"{PREFIX}/{self.name}/{self._send_seq}"
            self._send_seq += 1
            self.client.key_value_set_bytes(key, data)

    def recv(self, timeout_ms: int = POLL_MS) -> Any:
        """The next message; ``TimeoutError`` if none arrived within ``timeout_ms``."""
        key = f"{PREFIX}/{self.name}/{self._recv_seq}"
        try:
            data = self.client.blocking_key_value_get_bytes(key, timeout_ms)
        except Exception as exc:  # noqa: BLE001 - jax raises its runtime error type for a deadline
            if "DEADLINE" in str(exc).upper():
                raise TimeoutError(key) from None
            raise
        self._recv_seq += 1
        try:
            self.client.key_value_delete(key)
        except Exception:  # noqa: BLE001 - a leftover key costs memory only
            pass
        return pickle.loads(data)
