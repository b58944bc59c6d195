"""The run's control-plane store (gyre_jax/runtime/kvstore.py) over real TCP: the calls' semantics, barriers
across processes' clients, refusal of strangers and garbage without harm to the others, and what a client
sees when process 0 (which serves the store) is killed."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from timelimits import scaled

from gyre_jax.runtime import kvstore
from gyre_jax.runtime.process import peer_connection_lost

SECRET = bytes(range(32))


@pytest.fixture
def served():
    """A store for 2 processes on loopback; yields (server, client of process 0, client of process 1)."""
    server = kvstore.StoreServer(kvstore.Store(num_processes=2), SECRET)
    clients = [kvstore.StoreClient(f"127.0.0.1:{server.port}", SECRET, p) for p in (0, 1)]
    yield server, *clients
    for c in clients:
        c.close()
    server.close()


def test_the_calls_behave_as_the_runtime_expects(served):
    _, a, b = served
    a.key_value_set("gyre/x", "one")
    assert b.blocking_key_value_get("gyre/x", 1000) == "one" and b.key_value_try_get("gyre/x") == "one"
    with pytest.raises(kvstore.StoreError, match="ALREADY_EXISTS"):
        b.key_value_set("gyre/x", "two")
    b.key_value_set("gyre/x", "two", allow_overwrite=True)
    assert a.key_value_try_get("gyre/x") == "two"
    with pytest.raises(kvstore.StoreError, match="NOT_FOUND"):
        a.key_value_try_get("gyre/nothing")
    blob = bytes(range(256)) * 1000  # bytes survive as they are
    a.key_value_set_bytes("gyre/d/1/value", blob)
    assert b.blocking_key_value_get_bytes("gyre/d/1/value", 1000) == blob
    assert [a.key_value_increment("gyre/d/1/acks", 1), b.key_value_increment("gyre/d/1/acks", 2)] == [1, 3]
    assert a.key_value_try_get("gyre/d/1/acks") == "3"
    a.key_value_set("gyre/d/10", "other")  # not under gyre/d/1/
    assert [k for k, _ in b.key_value_dir_get_bytes("gyre/d/")] == ["gyre/d/1/acks", "gyre/d/1/value", "gyre/d/10"]
    a.key_value_delete("gyre/d/1")  # the key and everything under it
    assert b.key_value_dir_get("gyre/d") == [("gyre/d/10", "other")]


def test_a_blocking_read_waits_for_the_write_and_times_out_without_it(served):
    _, a, b = served
    threading.Timer(0.3, a.key_value_set, ("gyre/later", "v")).start()
    t0 = time.monotonic()
    assert b.blocking_key_value_get("gyre/later", scaled(10_000)) == "v"
    assert time.monotonic() - t0 >= 0.25
    with pytest.raises(kvstore.StoreError, match="DEADLINE_EXCEEDED: key 'gyre/never'"):
        b.blocking_key_value_get("gyre/never", 200)
    b.key_value_set("gyre/after", "fine")  # the connection still works after a timeout
    assert a.key_value_try_get("gyre/after") == "fine"


def test_a_blocking_read_does_not_hold_up_another_thread_of_the_same_process(served):
    _, a, b = served
    waiter = threading.Thread(target=b.blocking_key_value_get, args=("gyre/slow", scaled(20_000)))
    waiter.start()
    t0 = time.monotonic()
    b.key_value_set("gyre/fast", "1")  # another thread of process 1 while one of its threads waits
    assert time.monotonic() - t0 < scaled(5)
    a.key_value_set("gyre/slow", "done")
    waiter.join(timeout=scaled(10))
    assert not waiter.is_alive()


def test_a_barrier_completes_when_every_process_arrived_and_names_the_missing_one_otherwise(served):
    _, a, b = served
    done = []
    first = threading.Thread(target=lambda: (a.wait_at_barrier("gyre/sync/0", scaled(10_000)), done.append(0)))
    first.start()
    time.sleep(0.2)
    assert done == []  # process 0 waits for process 1
    b.wait_at_barrier("gyre/sync/0", scaled(10_000))
    first.join(timeout=scaled(10))
    assert done == [0]
    with pytest.raises(kvstore.StoreError, match=r"barrier 'gyre/sync/1': processes \[1\] did not arrive"):
        a.wait_at_barrier("gyre/sync/1", 200)


def _frame(header: bytes, value: bytes = b"") -> bytes:
    return struct.pack("!II", len(header), len(value)) + header + value


@pytest.mark.parametrize(
    "intruder",
    [
        _frame(b'{"secret": "00"}'),  # the wrong secret
        _frame(b'["not", "a", "dict"]'),
        _frame(b"\xff\xfe not json"),
        b"\xff" * 64,  # a frame that claims gigabytes
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
    ids=["wrong-secret", "json-list", "not-json", "huge-frame", "http"],
)
def test_a_stranger_or_garbage_is_dropped_and_the_store_keeps_serving(served, intruder):
    server, a, b = served
    with socket.create_connection(("127.0.0.1", server.port), timeout=scaled(10)) as sock:
        sock.sendall(intruder)
        sock.settimeout(scaled(10))
        try:  # the server may already have dropped us: then this send or the read is reset
            sock.sendall(_frame(b'{"op": "try_get", "key": "gyre/secret", "timeout_ms": 0}'))
            answer = sock.recv(1 << 16)
        except (ConnectionResetError, BrokenPipeError):  # closed with our request unread
            answer = b""
        assert answer == b""  # closed without an answer
    a.key_value_set("gyre/still", "serving")
    assert b.key_value_try_get("gyre/still") == "serving"


_SERVE = """
import sys, time
from gyre_jax.runtime import kvstore
server = kvstore.StoreServer(kvstore.Store(2), bytes(range(32)))
print(server.port, flush=True)
time.sleep(600)
"""


def test_when_process_0_is_killed_every_call_says_the_connection_closed():
    proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        client = kvstore.StoreClient(f"127.0.0.1:{port}", SECRET, 1)
        client.key_value_set("gyre/status/1", "beat")
        errors = []
        waiter = threading.Thread(
            target=lambda: _record(errors, client.blocking_key_value_get, "gyre/decision/0", 2**31 - 1)
        )
        waiter.start()
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=scaled(10))
        waiter.join(timeout=scaled(10))
        assert not waiter.is_alive(), "a read waiting forever on a dead process 0 must end"
        with pytest.raises(ConnectionError) as later:
            client.key_value_set("gyre/status/1", "beat", allow_overwrite=True)
        for exc in (*errors, later.value):
            assert isinstance(exc, ConnectionError) and "(process 0)" in str(exc)
            assert peer_connection_lost(exc), exc  # what the excepthook and watchdog read as a lost peer
    finally:
        proc.kill()
        proc.wait()


def _record(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        errors.append(exc)
