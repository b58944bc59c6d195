"""Ordered one-way host messages between two processes of a run (commands from the leader to a follower,
replies back), over a direct TCP connection: a message costs what its bytes cost. The run's control-plane
store (``kvstore``) only carries the connection's address, once. Device data never travels here:
it moves by ``transfer`` (``runtime.transfer``)."""

from __future__ import annotations

import hmac
import os
import pickle
import secrets
import select
import socket
import struct
import threading
from typing import Any

import numpy as np

PREFIX = "gyre/ch"
POLL_MS = 500  # a reader wakes this often to notice it was closed
CONNECT_TIMEOUT_MS = 300_000  # a writer waits this long for its reader to appear (processes start at once)
FRAME_TIMEOUT_S = 300.0  # once a message has begun, the rest of it must arrive within this
SOCKET_BUFFER = 4 << 20  # bytes: a ~200 KB micro-batch fits the kernel's buffers in one go
HOST_ENV = "GYRE_HOST_ADDRESS"  # the address other processes reach this one at (default: see local_address)
_HEADER = struct.Struct("!QI")  # pickle bytes, number of out-of-band buffers
_LENGTH = struct.Struct("!Q")
_SECRET_BYTES = 32
_MAX_VIEWS = 512  # buffers per sendmsg call (IOV_MAX is 1024 on Linux)


class ChannelClosed(ConnectionError):
    """The other end of a channel went away (its process exited, was killed, or its host is gone)."""


def local_address(store: str = "") -> str:
    """The address of this host that other processes of the run can reach: ``$GYRE_HOST_ADDRESS`` if set,
    else the local address of the interface that routes to ``store`` (the control-plane store's ``host:port``,
    on process 0's host; nothing is sent), else ``127.0.0.1`` (one machine)."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    host = store.rsplit(":", 1)[0].strip("[]") if store else ""
    if host in ("", "localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), 9))  # UDP connect only picks the route
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _tuned(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a message goes out at once
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
    return sock


def _send_views(sock: socket.socket, parts: list) -> None:
    """Writes every buffer of ``parts`` in order (scatter/gather, as few system calls as the kernel allows)."""
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if v.nbytes]
    while views:
        sent = sock.sendmsg(views[:_MAX_VIEWS])
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def _recv_into(sock: socket.socket, buf: bytearray | memoryview, what: str) -> None:
    view = memoryview(buf).cast("B")
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ChannelClosed(f"channel {what}: connection closed by peer (its process exited or was killed)")
        view = view[n:]


class Channel:
    """Ordered one-way messages (pickled Python objects) from one process to another over TCP.

    Both ends construct ``Channel(client, name)`` with the same ``name``; the end that first calls ``recv``
    is the reader, the one that first calls ``send`` the writer. The reader listens on this host's address
    (``local_address``) and publishes ``address + secret`` under ``gyre/ch/<name>/addr`` in the run's
    control-plane store (``client``: a ``kvstore.StoreClient``, or a ``kvstore.Store`` in one process); the writer connects
    and proves it read the secret; the key is deleted once connected. Messages are pickle protocol 5 frames
    whose array buffers travel out of band (no copy into the pickle). Both ends are one program (one run,
    one code version), and only a process that read the secret from the run's control-plane store can
    write, so unpickling is safe here. ``send`` is thread-safe; one thread reads.

    A peer that goes away makes ``recv`` / ``send`` raise ``ChannelClosed`` (``connection closed by peer``,
    which ``process.peer_connection_lost`` recognizes: the watchdog then reports the lost peer).
    """

    def __init__(self, client: Any, name: str):
        self.client = client
        self.name = name
        self._key = f"{PREFIX}/{name}/addr"
        self._sock: socket.socket | None = None
        self._listener: socket.socket | None = None
        self._secret = b""
        self._send_lock = threading.Lock()
        self._pending: list[list] = []  # messages sent before the reader connected, in order
        self._connector: threading.Thread | None = None
        self._error = ""  # why this writer cannot send any more

    # -- writer -------------------------------------------------------------------------------------------
    def send(self, obj: Any) -> None:
        """Queues ``obj`` for the reader; never waits for the reader to appear (messages sent before it
        connects are written, in order, once it has)."""
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        header = _HEADER.pack(len(data), len(raws)) + b"".join(_LENGTH.pack(r.nbytes) for r in raws)
        with self._send_lock:
            if self._error:
                raise ChannelClosed(self._error)
            if self._sock is None:
                self._pending.append([header, data, *raws])
                if self._connector is None:
                    self._connector = threading.Thread(target=self._connect, name=f"channel-{self.name}", daemon=True)
                    self._connector.start()
                return
            self._write([header, data, *raws])

    def _write(self, parts: list) -> None:
        try:
            _send_views(self._sock, parts)
        except OSError as exc:  # EPIPE / ECONNRESET: the reader is gone
            self._error = f"channel {self.name!r}: connection closed by peer while sending ({exc})"
            raise ChannelClosed(self._error) from None

    def _connect(self) -> None:
        """The writer's connector thread: waits for the reader's address, connects, writes what is queued."""
        try:
            record = bytes(self.client.blocking_key_value_get_bytes(self._key, CONNECT_TIMEOUT_MS))
            secret, address = record[:_SECRET_BYTES], record[_SECRET_BYTES:].decode()
            host, port = address.rsplit(":", 1)
            sock = _tuned(socket.create_connection((host, int(port)), timeout=FRAME_TIMEOUT_S))
            sock.settimeout(FRAME_TIMEOUT_S)
            sock.sendall(secret)
        except Exception as exc:  # noqa: BLE001 - jax raises its runtime error type for a deadline
            with self._send_lock:
                self._error = (
                    f"channel {self.name!r}: could not reach its reader within {CONNECT_TIMEOUT_MS / 1000:.0f} s "
                    f"({type(exc).__name__}: {str(exc)[:200]}); is the other process running?"
                )
                self._pending.clear()
            return
        with self._send_lock:
            self._sock = sock
            pending, self._pending = self._pending, []
            try:
                for parts in pending:
                    self._write(parts)
            except ChannelClosed:
                pass  # the next send raises it

    # -- reader -------------------------------------------------------------------------------------------
    def recv(self, timeout_ms: int = POLL_MS) -> Any:
        """The next message; ``TimeoutError`` if none began to arrive within ``timeout_ms``."""
        sock = self._sock or self._accept(timeout_ms)
        ready, _, _ = select.select([sock], [], [], timeout_ms / 1000)
        if not ready:
            raise TimeoutError(f"channel {self.name!r}: no message within {timeout_ms} ms")
        head = bytearray(_HEADER.size)
        _recv_into(sock, head, repr(self.name))
        size, count = _HEADER.unpack(head)
        lengths = bytearray(_LENGTH.size * count)
        _recv_into(sock, lengths, repr(self.name))
        sizes = [n for (n,) in _LENGTH.iter_unpack(lengths)]
        blob = memoryview(np.empty(size + sum(sizes), np.uint8)).cast("B")  # one read, no zero-fill
        _recv_into(sock, blob, repr(self.name))
        buffers, offset = [], size
        for n in sizes:  # the arrays of the message keep these views of the blob (no copy)
            buffers.append(blob[offset : offset + n])
            offset += n
        return pickle.loads(blob[:size], buffers=buffers)

    def _accept(self, timeout_ms: int) -> socket.socket:
        if self._listener is None:
            listener = _tuned(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            listener.bind((local_address(getattr(self.client, "address", "")), 0))  # routes to the store's host
            listener.listen(4)
            self._secret = secrets.token_bytes(_SECRET_BYTES)
            host, port = listener.getsockname()[:2]
            self.client.key_value_set_bytes(self._key, self._secret + f"{host}:{port}".encode())
            self._listener = listener
        self._listener.settimeout(timeout_ms / 1000)
        while True:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                raise TimeoutError(f"channel {self.name!r}: no writer connected within {timeout_ms} ms") from None
            sock.settimeout(FRAME_TIMEOUT_S)
            proof = bytearray(_SECRET_BYTES)
            try:
                _recv_into(sock, proof, repr(self.name))
            except (OSError, ChannelClosed):
                sock.close()
                continue
            if hmac.compare_digest(bytes(proof), self._secret):
                break
            sock.close()  # not our writer: keep waiting for it
        self._listener.close()
        self._sock = sock
        try:
            self.client.key_value_delete(self._key)
        except Exception:  # noqa: BLE001 - a leftover key costs memory only
            pass
        return sock

    def close(self) -> None:
        """Closes this end (the other end's next ``recv`` / ``send`` raises ``ChannelClosed``)."""
        for s in (self._sock, self._listener):
            if s is not None:
                s.close()
