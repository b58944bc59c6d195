"""The run's control-plane store: a small key-value store with blocking reads and barriers, served by process 0.

Every host-side message of a multi-process run that is not bulk data goes through it: the watchdog's
heartbeats, ``broadcast_decision`` and ``sync``, the addresses of channels and transfer servers. It is the
project's own (JAX exposes its coordination service's client only through private modules): process 0
runs a ``StoreServer`` on its host, ``process.initialize`` hands its address and a random secret to every
process once with a public device collective (``multihost_utils.broadcast_one_to_all``), and each process
talks to it through a ``StoreClient``.

``Store`` (in memory, thread-safe) holds the semantics; the server only frames them over TCP, so a test can
use a ``Store`` where a run uses a client. The method names and behaviour are those of JAX's
``DistributedRuntimeClient`` that the runtime used before (a key is written once unless
``allow_overwrite``; a blocking read past its timeout raises ``DEADLINE_EXCEEDED``; deleting a key deletes
the keys under ``key/``; ``dir_get`` lists the keys under a directory; a barrier completes when every
process of the run reached it).

Wire format, both directions: ``!II`` (header bytes, value bytes), a JSON header, the value's bytes. A
client's first frame carries the secret; a connection that does not present it is closed. When process 0
is gone, every call raises ``ConnectionError`` with ``connection closed by peer`` in its message, which
``process.peer_connection_lost`` and the watchdog recognize.
"""

from __future__ import annotations

import hmac
import json
import socket
import struct
import threading
from typing import Any

from gyre_jax.runtime.watchdog import FOREVER_MS

_FRAME = struct.Struct("!II")
MAX_VALUE_BYTES = 64 << 20  # a control-plane value; bulk data moves by runtime.transfer and channels
CALL_TIMEOUT_S = 60.0  # a non-blocking call (and the margin over a blocking one's own timeout) must answer within this
CONNECT_TIMEOUT_S = 30.0


class StoreError(RuntimeError):
    """A call the store refused (``NOT_FOUND``, ``ALREADY_EXISTS``, ``DEADLINE_EXCEEDED``: the message starts with the code)."""


def _directory(prefix: str) -> str:
    return prefix if prefix.endswith("/") else prefix + "/"


class Store:
    """The store's state and semantics, in memory (values are bytes; ``str`` values are stored UTF-8)."""

    def __init__(self, num_processes: int = 1):
        self.num_processes = num_processes
        self._data: dict[str, bytes] = {}
        self._barriers: dict[str, set[int]] = {}
        self._cond = threading.Condition()

    # the calls, with the names and arguments of jax's DistributedRuntimeClient ------------------------------
    def key_value_set_bytes(self, key: str, value: bytes, allow_overwrite: bool = False) -> None:
        with self._cond:
            if key in self._data and not allow_overwrite:
                raise StoreError(f"ALREADY_EXISTS: key {key!r} was written before (pass allow_overwrite=True)")
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self.key_value_set_bytes(key, value.encode(), allow_overwrite)

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._data, timeout=_seconds(timeout_in_ms)):
                raise StoreError(f"DEADLINE_EXCEEDED: key {key!r} was not written within {timeout_in_ms} ms")
            return self._data[key]

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        return self.blocking_key_value_get_bytes(key, timeout_in_ms).decode()

    def key_value_try_get_bytes(self, key: str) -> bytes:
        with self._cond:
            if key not in self._data:
                raise StoreError(f"NOT_FOUND: key {key!r}")
            return self._data[key]

    def key_value_try_get(self, key: str) -> str:
        return self.key_value_try_get_bytes(key).decode()

    def key_value_delete(self, key: str) -> None:
        """Deletes ``key`` and every key under ``key/`` (absent keys are not an error)."""
        with self._cond:
            under = _directory(key)
            for k in [k for k in self._data if k == key or k.startswith(under)]:
                del self._data[k]

    def key_value_increment(self, key: str, increment: int) -> int:
        """Adds ``increment`` to the decimal integer at ``key`` (0 if absent) and returns the new value."""
        with self._cond:
            value = int(self._data.get(key, b"0")) + int(increment)
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def key_value_dir_get_bytes(self, prefix: str) -> list[tuple[str, bytes]]:
        with self._cond:
            under = _directory(prefix)
            return sorted((k, v) for k, v in self._data.items() if k.startswith(under))

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        return [(k, v.decode()) for k, v in self.key_value_dir_get_bytes(prefix)]

    def wait_at_barrier(self, barrier_id: str, timeout_in_ms: int, process_id: int = 0) -> None:
        """Returns once every one of the ``num_processes`` processes called it with ``barrier_id``."""
        with self._cond:
            arrived = self._barriers.setdefault(barrier_id, set())
            arrived.add(process_id)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: len(arrived) >= self.num_processes, timeout=_seconds(timeout_in_ms)):
                missing = sorted(set(range(self.num_processes)) - arrived)
                raise StoreError(
                    f"DEADLINE_EXCEEDED: barrier {barrier_id!r}: processes {missing} did not arrive within "
                    f"{timeout_in_ms} ms"
                )


def _seconds(timeout_in_ms: int) -> float | None:
    return None if timeout_in_ms >= FOREVER_MS else max(0, timeout_in_ms) / 1000


# -- the wire -----------------------------------------------------------------------------------------------
def _send(sock: socket.socket, header: dict, value: bytes = b"") -> None:
    head = json.dumps(header).encode()
    sock.sendall(_FRAME.pack(len(head), len(value)) + head + value)


def _recv_exact(sock: socket.socket, n: int, peer: str) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    while view.nbytes:
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError(f"control-plane store {peer}: connection closed by peer")
        view = view[got:]
    return bytes(buf)


def _recv(sock: socket.socket, peer: str) -> tuple[dict, bytes]:
    n_head, n_value = _FRAME.unpack(_recv_exact(sock, _FRAME.size, peer))
    if n_head > 1 << 20 or n_value > MAX_VALUE_BYTES:
        raise ConnectionError(f"control-plane store {peer}: frame of {n_head} + {n_value} bytes is not a store message")
    return json.loads(_recv_exact(sock, n_head, peer)), _recv_exact(sock, n_value, peer)


_CALLS = {  # op -> how the server calls the Store with (header, value)
    "set": lambda s, h, v: s.key_value_set_bytes(h["key"], v, h["overwrite"]),
    "get": lambda s, h, v: s.blocking_key_value_get_bytes(h["key"], h["timeout_ms"]),
    "try_get": lambda s, h, v: s.key_value_try_get_bytes(h["key"]),
    "delete": lambda s, h, v: s.key_value_delete(h["key"]),
    "increment": lambda s, h, v: str(s.key_value_increment(h["key"], h["by"])).encode(),
    "dir_get": lambda s, h, v: json.dumps([[k, x.hex()] for k, x in s.key_value_dir_get_bytes(h["key"])]).encode(),
    "barrier": lambda s, h, v: s.wait_at_barrier(h["key"], h["timeout_ms"], h["process"]),
}


class StoreServer:
    """Serves a ``Store`` over TCP on ``host`` (``""``: every interface), one thread per connection."""

    def __init__(self, store: Store, secret: bytes, host: str = "127.0.0.1", port: int = 0):
        self.store = store
        self._secret = secret
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="gyre-kvstore", daemon=True).start()

    def close(self) -> None:
        """Stops serving: the listener and every client's connection close (their calls raise ``ConnectionError``)."""
        self._closed.set()
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for sock in [self._listener, *connections]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed.is_set():
                    sock.close()
                    return
                self._connections.add(sock)
            threading.Thread(target=self._serve, args=(sock, f"{peer[0]}:{peer[1]}"), daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        with sock:
            try:
                sock.settimeout(CONNECT_TIMEOUT_S)
                hello, _ = _recv(sock, peer)
                if not hmac.compare_digest(bytes.fromhex(hello.get("secret", "")), self._secret):
                    return  # not a process of this run
                sock.settimeout(None)
                _send(sock, {"ok": True})
                while not self._closed.is_set():
                    header, value = _recv(sock, peer)
                    try:
                        out = _CALLS[header["op"]](self.store, header, value)
                    except StoreError as exc:
                        _send(sock, {"error": str(exc)})
                        continue
                    _send(sock, {"ok": True}, out or b"")
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass  # the client went away or sent garbage: its connection ends, the store keeps serving
            finally:
                with self._lock:
                    self._connections.discard(sock)


class StoreClient:
    """A process's connection to the run's store at ``address`` (``host:port``); safe to use from any thread
    (each thread has its own connection, so one thread's blocking read never delays another's call)."""

    def __init__(self, address: str, secret: bytes, process_id: int):
        host, _, port = address.rpartition(":")
        self.address = address
        self._where = (host.strip("[]"), int(port))
        self._secret = secret
        self.process_id = process_id
        self._local = threading.local()

    def _connection(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            try:
                sock = socket.create_connection(self._where, timeout=CONNECT_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                _send(sock, {"secret": self._secret.hex(), "process": self.process_id})
                _recv(sock, self.address)
            except OSError as exc:
                raise ConnectionError(
                    f"control-plane store at {self.address} (process 0): connection closed by peer or refused "
                    f"({type(exc).__name__}: {exc})"
                ) from None
            self._local.sock = sock
        return sock

    def _call(self, op: str, key: str, value: bytes = b"", timeout_ms: int = 0, **fields: Any) -> bytes:
        sock = self._connection()
        wait = _seconds(timeout_ms) if op in ("get", "barrier") else 0.0
        sock.settimeout(None if wait is None else wait + CALL_TIMEOUT_S)
        try:
            _send(sock, {"op": op, "key": key, "timeout_ms": timeout_ms, **fields}, value)
            header, out = _recv(sock, self.address)
        except (OSError, ValueError) as exc:
            self._local.sock = None
            sock.close()
            raise ConnectionError(
                f"control-plane store at {self.address} (process 0): connection closed by peer during {op} "
                f"{key!r} ({type(exc).__name__}: {exc})"
            ) from None
        if "error" in header:
            raise StoreError(header["error"])
        return out

    def close(self) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            sock.close()
            self._local.sock = None

    # the calls of Store, over the wire ---------------------------------------------------------------------
    def key_value_set_bytes(self, key: str, value: bytes, allow_overwrite: bool = False) -> None:
        self._call("set", key, bytes(value), overwrite=bool(allow_overwrite))

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self.key_value_set_bytes(key, value.encode(), allow_overwrite)

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        return self._call("get", key, timeout_ms=int(timeout_in_ms))

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        return self.blocking_key_value_get_bytes(key, timeout_in_ms).decode()

    def key_value_try_get_bytes(self, key: str) -> bytes:
        return self._call("try_get", key)

    def key_value_try_get(self, key: str) -> str:
        return self.key_value_try_get_bytes(key).decode()

    def key_value_delete(self, key: str) -> None:
        self._call("delete", key)

    def key_value_increment(self, key: str, increment: int) -> int:
        return int(self._call("increment", key, by=int(increment)))

    def key_value_dir_get_bytes(self, prefix: str) -> list[tuple[str, bytes]]:
        return [(k, bytes.fromhex(v)) for k, v in json.loads(self._call("dir_get", prefix))]

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        return [(k, v.decode()) for k, v in self.key_value_dir_get_bytes(prefix)]

    def wait_at_barrier(self, barrier_id: str, timeout_in_ms: int) -> None:
        self._call("barrier", barrier_id, timeout_ms=int(timeout_in_ms), process=self.process_id)
