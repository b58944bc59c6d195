"""Stop requests on the leader (``run.RunStop``): Slurm's preemption notice reaches every process, so process 0
gets its own SIGTERM and a follower's relayed one in either order; both are the same notice (one stop, a checkpoint
kept), and only a second signal to process 0 itself forces an exit. Whatever stops the run (a request or a
follower's failure), the running harnesses are killed once, at once (``RunStop.cancelling``)."""

from __future__ import annotations

import threading

import pytest
from timelimits import scaled

from gyre_jax import run as run_mod
from gyre_jax.run import RunStop


class _Exit(Exception):
    pass


@pytest.fixture()
def stop(monkeypatch) -> RunStop:
    """A ``RunStop`` whose forced exit (os._exit) raises instead of exiting."""

    def exit_(status):
        raise _Exit(status)

    monkeypatch.setattr(run_mod.os, "_exit", exit_)
    return RunStop()


@pytest.mark.parametrize("follower_first", [True, False])
def test_own_signal_and_follower_request_in_either_order_are_one_stop(stop, follower_first) -> None:
    cancels = []
    with stop.cancelling(lambda: cancels.append(1)):
        if follower_first:
            stop.follower_asks()
            stop.signal(15, None)
        else:
            stop.signal(15, None)
            stop.follower_asks()
        stop.follower_asks()  # a follower repeating itself never forces
    assert stop.is_set() and stop.failure is None
    assert cancels == [1]  # one stop: harnesses cancelled once, no forced exit
    with pytest.raises(_Exit) as exc:  # a second signal to this process does
        stop.signal(15, None)
    assert exc.value.args == (130,)


def test_a_signal_after_the_run_stopped_itself_is_not_the_forcing_second(stop) -> None:
    stop.request()  # e.g. the untrained-steps guard stopped the run
    stop.signal(2, None)
    assert stop.is_set() and stop.signalled
    with pytest.raises(_Exit):
        stop.signal(2, None)


def test_harnesses_are_killed_as_soon_as_the_run_stops_and_not_when_it_ends_normally(stop) -> None:
    cancelled = threading.Event()
    with stop.cancelling(cancelled.set):
        assert not cancelled.wait(0.2)  # nothing asked to stop: nothing killed
        stop.follower_asks()
        assert cancelled.wait(scaled(10))  # within the block, from the watcher: not only when the block exits
    quiet = RunStop()
    calls = []
    with quiet.cancelling(lambda: calls.append(1)):
        pass
    assert calls == [] and not quiet.is_set()


def test_a_follower_failure_stops_the_run_without_a_request_and_keeps_the_first_message(stop) -> None:
    calls = []
    with stop.cancelling(lambda: calls.append(1)):
        stop.fail("process 1: MicroStep failed: boom")
        stop.fail("process 1: a later echo")
    assert stop.is_set() and calls == [1]
    assert stop.failure == "process 1: MicroStep failed: boom"
    assert not stop.signalled
