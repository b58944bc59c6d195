"""The host side of the proxy bridge: a Unix socket (bound into sandboxes) whose every connection is spliced
to the proxy's TCP address. One per sandbox object, served by threads of this process; the in-sandbox half
is ``forward.py``.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
from pathlib import Path

from gyre_jax.rollout.sandbox.base import short_socket_path
from gyre_jax.rollout.sandbox.forward import serve

CONNECT_TIMEOUT_S = 10.0


def _connectable(host: str) -> str:
    """A wildcard listen address (0.0.0.0, ::, "") -> the loopback address to connect to."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


class ProxyBridge:
    """Listens on the Unix socket ``socket_path`` and forwards each connection to ``target`` (host, port).

    ``start()`` is idempotent; ``close()`` stops accepting and removes the socket file (connections already
    spliced run to their end)."""

    def __init__(self, socket_path: Path, target: tuple[str, int]) -> None:
        self.socket_path = Path(socket_path)
        self.target = (_connectable(target[0]), int(target[1]))
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            self.socket_path.parent.mkdir(parents=True, exist_ok=True)
            if self.socket_path.exists() or self.socket_path.is_symlink():
                self.socket_path.unlink()  # a stale socket from an earlier run in the same state_dir
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(str(self.socket_path))
                listener.listen(256)
            except OSError as exc:
                listener.close()
                raise OSError(f"cannot listen on the proxy bridge socket {self.socket_path}: {exc}") from exc
            self._listener = listener
            self._thread = threading.Thread(
                target=serve, args=(listener, self._connect), name="gyre-proxy-bridge", daemon=True
            )
            self._thread.start()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
        sock.settimeout(None)
        return sock

    def close(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            thread, self._thread = self._thread, None
        if listener is None:
            return
        try:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() of the serving thread
        except OSError:
            pass
        listener.close()
        if thread is not None:
            thread.join(timeout=5.0)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass


class LazyBridge:
    """A sandbox's one bridge to the proxy, started on first use; ``close()`` is idempotent."""

    def __init__(self, proxy_address: tuple[str, int] | None, state_dir: Path) -> None:
        self.proxy_address = proxy_address
        self.state_dir = Path(state_dir)
        self._lock = threading.Lock()
        self._bridge: ProxyBridge | None = None

    @property
    def port(self) -> int:
        """The proxy's port (also served on 127.0.0.1 inside the sandbox)."""
        return int(self._address()[1])

    def _address(self) -> tuple[str, int]:
        if self.proxy_address is None:
            raise ValueError(
                "network='proxy' needs the proxy's address, but this sandbox was made with proxy_address=None; "
                "pass make_sandbox(..., proxy_address=(host, port)) or launch with network='none'"
            )
        return self.proxy_address

    def socket_path(self) -> Path:
        """The host path of the bridge's Unix socket (the bridge is started if it is not running)."""
        address = self._address()
        with self._lock:
            if self._bridge is None:
                bridge = ProxyBridge(short_socket_path(self.state_dir, "proxy.sock"), address)
                bridge.start()
                self._bridge = bridge
            return self._bridge.socket_path

    def close(self) -> None:
        with self._lock:
            bridge, self._bridge = self._bridge, None
        if bridge is None:
            return
        bridge.close()
        if bridge.socket_path.parent != self.state_dir:  # a short directory of short_socket_path's
            shutil.rmtree(bridge.socket_path.parent, ignore_errors=True)
