"""The leader/follower serving protocol (``gyre_jax.elastic.remote``) in one process.

The coordination service's key-value store is replaced by an in-memory one with the same calls (the
real one needs ``jax.distributed``; ``tests/runtime/test_train_multiprocess.py`` runs this protocol
between two real processes). Everything else is real: the router, a ``RemoteLoop`` in front of a
``Follower`` whose cell serves with a real ``ServingLoop`` on the 4-device cell mesh.
"""

from __future__ import annotations

import threading

import jax
import pytest

from gyre_jax.elastic.remote import Channel, Follower, FollowerCell, RemoteLoop, RemoteProcess
from gyre_jax.proxy.router import Router
from gyre_jax.serving.loop import ServingLoop
from gyre_jax.serving.types import ContextTooLongError, GenerationRequest, SamplingParams

MAX_SEQ_LEN = 128  # the serving fixtures' engine (tests/serving/conftest.py)


class MemoryKV:
    """The subset of jax's DistributedRuntimeClient the channels use, in memory."""

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


def test_channel_keeps_order_times_out_and_deletes_what_it_read():
    kv = MemoryKV()
    a, b = Channel(kv, "x"), Channel(kv, "x")
    for i in range(5):
        a.send({"i": i, "payload": list(range(i))})
    assert [b.recv(100)["i"] for _ in range(5)] == [0, 1, 2, 3, 4]
    assert kv.data == {}
    with pytest.raises(TimeoutError):
        b.recv(50)
    a.send("late")
    assert b.recv(100) == "late"


@pytest.fixture()
def remote_cell(engine, model_params):
    """A follower serving ``cell1`` with a real loop, and the leader's router in front of its RemoteLoop."""
    kv = MemoryKV()
    loop = ServingLoop(engine, model_params[1], policy_version=3, name="cell1", seed=0).start()
    stops = []
    cell = FollowerCell(index=1, name="cell1", make_loop=None, serving_shardings=None, worker=None, loop=loop)
    follower = Follower(kv, 1, [cell], core_shardings=None)
    thread = threading.Thread(target=follower.serve, args=(None,), daemon=True)
    follower._abstract_core = None
    thread.start()
    proc = RemoteProcess(kv, 1, on_stop=lambda: stops.append(True))
    remote = RemoteLoop(proc, 1, "cell1", engine.max_seq_len, serving_shardings=None, policy_version=3)
    yield Router({"cell1": remote}), proc, follower, thread, stops, loop
    proc.close()
    thread.join(timeout=10)


def test_requests_through_the_remote_loop_get_the_loops_own_completions(
    remote_cell, engine, model_params, prompts, reference
):
    router, proc, follower, thread, stops, loop = remote_cell
    assert engine.max_seq_len == MAX_SEQ_LEN
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    futures = [router.submit(GenerationRequest(p, greedy, session_id=f"s{i}")) for i, p in enumerate(prompts[:4])]
    for p, f in zip(prompts[:4], futures):
        r = f.result(timeout=120)
        assert r.token_ids == reference.greedy(model_params[1], p, 6)[0]  # what the loop itself computes
        assert r.policy_versions == [3] * 6 and r.cell == "cell1"
    # a prompt that cannot fit: the caller's future raises the loop's own error
    with pytest.raises(ContextTooLongError):
        router.submit(GenerationRequest(list(range(MAX_SEQ_LEN + 5)), greedy)).result(timeout=60)
    # stats and queries answer from the follower's loop
    remote = router._backends["cell1"]
    assert remote.stats.busy_s == pytest.approx(loop.stats.busy_s, rel=0.5) and remote.stats.busy_s > 0
    assert remote.num_in_flight() == 0
    assert len(remote.step_log) > 0


def test_cancel_and_drain_resolve_requests_as_cancelled(remote_cell, prompts):
    router, proc, follower, thread, stops, loop = remote_cell
    slow = SamplingParams(temperature=1.0, max_tokens=MAX_SEQ_LEN, seed=1)
    req = GenerationRequest(prompts[0], slow)
    fut = router.submit(req)
    router.cancel(req.request_id)
    assert fut.result(timeout=60).finish_reason == "cancelled"
    inner = router._backends["cell1"].submit(GenerationRequest(prompts[1], slow, session_id="d"))
    assert router._backends["cell1"].drain() == []  # no KV crosses processes: in-flight work is cancelled
    assert inner.result(timeout=60).finish_reason == "cancelled"


def test_a_signal_on_the_follower_asks_the_leader_to_stop_once(remote_cell):
    router, proc, follower, thread, stops, loop = remote_cell
    follower._signalled(15, None)
    deadline = threading.Event()
    for _ in range(100):
        if stops:
            break
        deadline.wait(0.05)
    assert stops == [True]
    proc.close()  # the leader's stop: the follower's serve returns and its loop stops
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert jax.device_count() >= 8
