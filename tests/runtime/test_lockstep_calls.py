"""``runtime.lockstep``'s call protocol in one process (the driver and a peer over a real channel): what each side
reports when a call fails on one of them, so that a cell whose processes fell out of lockstep says which calls
each ran last (the multi-process runs are in test_lockstep.py)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import jax
import pytest

from gyre_jax.runtime import kvstore, lockstep


def _pair():
    store = kvstore.Store(2)
    cell = SimpleNamespace(index=3, processes=(0, 1), devices=tuple(jax.devices()[:1]))
    return lockstep.Lockstep(store, cell, {}), lockstep.Replayer(store, cell, 1, {})


def test_a_call_that_fails_on_one_side_names_the_calls_each_side_ran_last(caplog):
    driver, peer = _pair()
    thread = threading.Thread(target=peer.run, daemon=True)
    thread.start()
    caplog.set_level(logging.WARNING, logger="gyre_jax.runtime.lockstep")
    assert driver.call(None, "math:sqrt", 16.0) == 4.0
    # fails on the peer only (the driver runs its own ``local``): the peer says so and lists its last calls
    assert driver.call(None, "builtins:int", "not a number", local=lambda s: 7) == 7
    # fails on the driver only: it names the call, says the peers ran it, and lists its own last calls
    with pytest.raises(ZeroDivisionError):
        driver.call(None, "operator:truediv", 1.0, 0.0)
    driver.stop()
    thread.join(timeout=30)
    assert not thread.is_alive() and peer.calls == 3 and set(peer.failed) == {1, 2}
    peer_line = next(r.getMessage() for r in caplog.records if "lockstep call #1 builtins:int failed" in r.getMessage())
    assert "last calls: #0 math:sqrt; #1 builtins:int" in peer_line
    driver_line = next(r.getMessage() for r in caplog.records if "lockstep call #2 failed here" in r.getMessage())
    assert "peers [1] were sent it" in driver_line
    me = threading.current_thread().name
    assert f"#0 math:sqrt [{me}]; #1 builtins:int [{me}]; #2 operator:truediv [{me}]" in driver_line
    with pytest.raises(lockstep.LockstepError, match="stopped"):
        driver.call(None, "math:sqrt", 1.0)
