"""The leader/follower cell protocol (``gyre_jax.runtime.remote`` / ``runtime.host``) in one process.

The run's control-plane store is a real one on loopback (tests/helpers/local_store.py), served in this
process (``tests/runtime/test_train_multiprocess.py`` runs this protocol, transfer programs included,
between two real processes). Everything else is real: the router, a
``RemoteCell`` in front of a ``CellHost`` whose cell serves with a real ``ServingLoop`` on the 4-device
cell mesh.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import jax
import pytest
from timelimits import scaled

from gyre_jax.proxy.router import Router
from gyre_jax.runtime import commands as cmd
from gyre_jax.runtime.cells import Cell, CellLayout
from gyre_jax.runtime.channel import Channel
from gyre_jax.runtime.host import CellHost, HostedCell
from gyre_jax.runtime.local import LocalCell
from gyre_jax.runtime.remote import FollowerLink, RemoteCell, TransferLog
from gyre_jax.serving.loop import ServingLoop
from gyre_jax.serving.types import ContextTooLongError, GenerationRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from local_store import local_store  # noqa: E402

MAX_SEQ_LEN = 128  # the serving fixtures' engine (tests/serving/conftest.py)


def test_channel_keeps_order_times_out_and_deletes_what_it_read():
    kv = local_store()
    a, b = Channel(kv, "x"), Channel(kv, "x")
    for i in range(5):
        a.send({"i": i, "payload": list(range(i))})
    assert [b.recv(100)["i"] for _ in range(5)] == [0, 1, 2, 3, 4]
    assert kv.key_value_dir_get_bytes("gyre") == []
    with pytest.raises(TimeoutError):
        b.recv(50)
    a.send("late")
    assert b.recv(100) == "late"


@pytest.fixture()
def remote_cell(engine, model_params):
    """A follower's ``CellHost`` serving ``cell1`` with a real loop, and the leader's router in front of its
    ``RemoteCell``."""
    kv = local_store()
    loop = ServingLoop(engine, model_params[1], policy_version=3, name="cell1", seed=0).start()
    cell = Cell(index=1, devices=tuple(engine.mesh.devices.flat), mesh=engine.mesh)
    layout = CellLayout.of(cell, engine.cfg, engine.rules, engine.page_size)
    hosted = HostedCell(LocalCell(cell, layout, loop, worker=None))
    host = CellHost(kv, 1, {1: hosted}, {1: layout}, core_abstract=None)
    failures = []

    def serve() -> None:
        try:
            host.serve()
        except Exception as exc:  # a failed command ends serve(); the leader heard of it by a Failure reply
            failures.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    stops, errors = [], []
    link = FollowerLink(kv, 1, on_error=errors.append, on_stop=lambda: stops.append(True))
    remote = RemoteCell(link, TransferLog(), cell, layout, core_shardings=None, max_context=engine.max_seq_len)
    yield Router({"cell1": remote}), remote, host, thread, stops, errors, loop
    link.close(timeout_s=scaled(60.0) if thread.is_alive() else 0.1)  # a follower that stopped answers nothing
    thread.join(timeout=scaled(10))


def _wait_for(items: list, timeout_s: float = 5.0) -> None:
    done = threading.Event()
    for _ in range(int(scaled(timeout_s) / 0.05)):
        if items:
            return
        done.wait(0.05)


def test_requests_through_the_remote_cell_get_the_loops_own_completions(
    remote_cell, engine, model_params, prompts, reference
):
    router, remote, host, thread, stops, errors, loop = remote_cell
    assert engine.max_seq_len == MAX_SEQ_LEN
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    futures = [router.submit(GenerationRequest(p, greedy, session_id=f"s{i}")) for i, p in enumerate(prompts[:4])]
    for p, f in zip(prompts[:4], futures):
        r = f.result(timeout=scaled(120))
        assert r.token_ids == reference.greedy(model_params[1], p, 6)[0]  # what the loop itself computes
        assert r.policy_versions == [3] * 6 and r.cell == "cell1"
    # a token listener stays in the leader's process: the follower streams nothing, the result holds every token
    heard = []
    streamed = router.submit(GenerationRequest(prompts[0], greedy, session_id="s0", on_tokens=heard.append))
    assert streamed.result(timeout=scaled(120)).token_ids == reference.greedy(model_params[1], prompts[0], 6)[0]
    assert heard == []
    # a prompt that cannot fit: the caller's future raises the loop's own error
    with pytest.raises(ContextTooLongError):
        router.submit(GenerationRequest(list(range(MAX_SEQ_LEN + 5)), greedy)).result(timeout=scaled(60))
    # stats answer from the follower's loop
    stats = remote.stats()
    assert stats.busy_s == pytest.approx(loop.stats.busy_s, rel=0.5) and stats.busy_s > 0
    assert stats.in_flight == 0
    assert len(stats.step_log) > 0
    assert errors == []


def test_cancel_and_drop_resolve_requests_as_cancelled(remote_cell, prompts):
    router, remote, host, thread, stops, errors, loop = remote_cell
    slow = SamplingParams(temperature=1.0, max_tokens=MAX_SEQ_LEN, seed=1)
    req = GenerationRequest(prompts[0], slow)
    fut = router.submit(req)
    router.cancel(req.request_id)
    assert fut.result(timeout=scaled(60)).finish_reason == "cancelled"
    inner = remote.submit(GenerationRequest(prompts[1], slow, session_id="d"))
    assert remote.drop_sessions() == 1  # the request in flight, cancelled on the follower
    assert inner.result(timeout=scaled(60)).finish_reason == "cancelled"


def test_a_signal_on_the_follower_asks_the_leader_to_stop_once(remote_cell):
    router, remote, host, thread, stops, errors, loop = remote_cell
    host._signalled(15, None)
    _wait_for(stops)
    assert stops == [True]
    remote.link.close()  # the leader's stop: the follower's serve returns and its loop stops
    thread.join(timeout=scaled(10))
    assert not thread.is_alive()
    assert jax.device_count() >= 8


def test_a_transfer_out_of_order_stops_the_follower_before_it_runs(remote_cell):
    """The follower checks each program's number in the run's transfer log before running its side: a
    command announcing program #5 when #0 is due fails at once (a deadlock would follow otherwise)."""
    router, remote, host, thread, stops, errors, loop = remote_cell
    remote.link.send(cmd.SetWeights(cell=1, version=4, transfer=5))
    _wait_for(errors)
    assert len(errors) == 1 and "transfer #5 but #0 is due" in errors[0], errors
    thread.join(timeout=scaled(10))
    assert not thread.is_alive()  # the follower stopped (the leader then stops the run)


def test_a_micro_step_must_name_weights_the_cell_holds(remote_cell):
    router, remote, host, thread, stops, errors, loop = remote_cell
    stale = cmd.WeightsRef(cell=1, slot="params", serial=7)
    remote.link.send(cmd.MicroStep(cell=1, token=99, weights=stale, ref_weights=None, batch=None, kind="rl"))
    _wait_for(errors)
    assert len(errors) == 1 and "weights params#7" in errors[0] and "holds params#None" in errors[0], errors
