"""``runtime.channel.Channel``: ordered host messages over a real TCP connection on loopback, the address
exchanged through the run's control-plane store (a real one on loopback: tests/helpers/local_store.py)."""

from __future__ import annotations

import pickle
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

from gyre_jax.runtime.channel import Channel, ChannelClosed
from gyre_jax.runtime.process import peer_connection_lost

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from local_store import local_store  # noqa: E402


def test_arrays_and_objects_arrive_in_order_and_equal():
    kv = local_store()
    writer, reader = Channel(kv, "t"), Channel(kv, "t")
    rng = np.random.default_rng(0)
    batch = {
        "tokens": rng.integers(0, 151_936, (5, 1024), dtype=np.int32),
        "mask": rng.random((5, 1024), dtype=np.float32),
        "strided": np.arange(64, dtype=np.int64)[::2],  # not contiguous: travels inside the pickle
        "empty": np.zeros((0, 3), np.float32),
    }
    for i in range(3):  # sent before the reader exists: queued, then written in order
        writer.send({"i": i, "batch": batch, "text": "x" * i})
    got = [reader.recv(5000) for _ in range(3)]
    assert [g["i"] for g in got] == [0, 1, 2] and got[2]["text"] == "xx"
    for name, value in batch.items():
        assert got[1]["batch"][name].dtype == value.dtype
        np.testing.assert_array_equal(got[1]["batch"][name], value)
    got[0]["batch"]["tokens"][0, 0] = -1  # the received arrays are ordinary writable arrays
    assert kv.key_value_dir_get_bytes("gyre") == []  # the address key is gone once the writer connected
    with pytest.raises(TimeoutError):
        reader.recv(50)


def test_a_connection_without_the_secret_is_refused_and_the_writer_still_gets_through():
    kv = local_store()
    writer, reader = Channel(kv, "s"), Channel(kv, "s")
    with pytest.raises(TimeoutError):
        reader.recv(10)  # the reader listens and publishes its address
    host, port = kv.key_value_try_get_bytes("gyre/ch/s/addr")[32:].decode().rsplit(":", 1)
    with socket.create_connection((host, int(port))) as intruder:
        intruder.sendall(b"\0" * 32 + pickle.dumps("not from the run"))
        writer.send("from the run")
        assert reader.recv(5000) == "from the run"


def test_a_peer_that_goes_away_is_a_lost_connection_on_both_ends():
    kv = local_store()
    writer, reader = Channel(kv, "c"), Channel(kv, "c")
    writer.send(1)
    assert reader.recv(5000) == 1
    writer.close()  # the writer's process is gone
    with pytest.raises(ChannelClosed) as closed:
        reader.recv(5000)
    assert peer_connection_lost(closed.value)  # the watchdog decides (exit 75), not this process's own failure

    writer, reader = Channel(kv, "d"), Channel(kv, "d")
    writer.send(1)
    assert reader.recv(5000) == 1
    reader.close()  # the reader's process is gone
    with pytest.raises(ChannelClosed) as lost:
        for _ in range(100):  # the kernel may take a write or two before it reports the reset
            writer.send(np.zeros(1 << 16, np.uint8))
    assert peer_connection_lost(lost.value)
