"""The in-sandbox forwarder: makes the run's proxy reachable at 127.0.0.1:PORT inside a sandbox whose network
is only loopback, then runs the harness as its child.

    python -I -S .../gyre_jax/rollout/sandbox/forward.py --port P --socket /run/gyre/proxy.sock -- ARGV...
    python -m gyre_jax.rollout.sandbox.forward --port P --socket /run/gyre/proxy.sock -- ARGV...

It listens on 127.0.0.1:P (and [::1]:P when the sandbox has IPv6), forwards every accepted connection to the
Unix socket (a bidirectional byte stream; many concurrent connections; half-close passed on), runs ARGV
as its child with the environment and directory it was given (less ``--unset`` names: the interpreter's
own locale coercion), forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT/
SIGUSR1/SIGUSR2 to it, and exits with the child's exit status (a child killed by signal N kills the
forwarder with N too). Standard library only and no package imports: it runs as a plain script (``-I -S``)
in sandboxes where nothing but the interpreter and this file is known to exist. The host side of the
socket is ``bridge.ProxyBridge``; both use ``splice`` and ``serve``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

CHUNK = 65536
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _copy(src: socket.socket, dst: socket.socket) -> None:
    """Copies src -> dst until src's end of stream (then half-closes dst) or an error (then shuts both)."""
    try:
        while True:
            data = src.recv(CHUNK)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        for sock in (src, dst):  # a reset on either side ends both directions
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def splice(a: socket.socket, b: socket.socket) -> None:
    """Copies bytes both ways between two connected sockets until both directions have ended; closes both.
    TCP sockets get TCP_NODELAY: a relayed small write (a streamed event) must not wait for an ACK."""
    for sock in (a, b):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
    other = threading.Thread(target=_copy, args=(b, a), name="gyre-splice", daemon=True)
    other.start()
    try:
        _copy(a, b)
        other.join()
    finally:
        a.close()
        b.close()


def serve(listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
    """Accepts on ``listener`` until it is shut down; each connection is spliced to a fresh ``connect()``
    in its own thread (a failed connect closes the accepted connection)."""

    def handle(conn: socket.socket) -> None:
        try:
            upstream = connect()
        except OSError as exc:
            print(f"gyre forward: cannot reach the proxy: {exc}", file=sys.stderr, flush=True)
            conn.close()
            return
        splice(conn, upstream)

    while True:
        try:
            conn, _ = listener.accept()
        except OSError:  # shut down or closed: stop serving
            return
        threading.Thread(target=handle, args=(conn,), name="gyre-forward-conn", daemon=True).start()


def _listen(port: int) -> list[socket.socket]:
    """Listening sockets on 127.0.0.1:port and, where the sandbox has it, [::1]:port."""
    listeners = []
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
        except OSError:
            sock.close()
            if family == socket.AF_INET:
                raise
            continue
        listeners.append(sock)
    return listeners


def _connect_unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def run_child(argv: list[str], unset: list[str]) -> int:
    """Runs ``argv`` with this environment less ``unset`` and signals forwarded; returns its status as
    subprocess does (-N: killed by signal N)."""
    env = {k: v for k, v in os.environ.items() if k not in unset}
    try:
        child = subprocess.Popen(argv, env=env)
    except OSError as exc:
        print(f"gyre forward: cannot start {argv[0]!r}: {exc}", file=sys.stderr, flush=True)
        return 127

    def forward(signum: int, _frame: object) -> None:
        try:
            child.send_signal(signum)
        except OSError:
            pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    return child.wait()


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Forward 127.0.0.1:PORT to a Unix socket and run ARGV.")
    parser.add_argument("--port", type=int, required=True, help="the proxy's port, served on 127.0.0.1 inside")
    parser.add_argument("--socket", required=True, help="the Unix socket that reaches the proxy")
    parser.add_argument("--unset", action="append", default=[], help="a variable the command must not get")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command to run")
    ns = parser.parse_args(args)
    argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    if not argv:
        parser.error("no command given after --")
    if not os.path.exists(ns.socket):
        print(f"gyre forward: the proxy socket {ns.socket} does not exist (is it mounted?)", file=sys.stderr)
        return 2
    try:
        listeners = _listen(ns.port)
    except OSError as exc:
        print(f"gyre forward: cannot listen on 127.0.0.1:{ns.port}: {exc}", file=sys.stderr)
        return 2
    for listener in listeners:
        threading.Thread(target=serve, args=(listener, lambda: _connect_unix(ns.socket)), daemon=True).start()
    status = run_child(argv, ns.unset)
    if status < 0:  # die the way the child did, so the sandbox reports the same signal
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            signal.signal(-status, signal.SIG_DFL)  # (SIGKILL and SIGSTOP cannot be caught anyway)
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), -status)
        return 128 - status
    return status


if __name__ == "__main__":
    sys.exit(main())
