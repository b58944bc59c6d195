"""Stop requests on the leader (``run.Run.request_stop`` / ``follower_asks_stop``): Slurm's preemption notice
reaches every process, so process 0 gets its own SIGTERM and a follower's relayed one in either order; both are
the same notice (one stop, a checkpoint kept), and only a second signal to process 0 itself forces an exit."""

from __future__ import annotations

import threading
import types

import pytest

from gyre_jax import run as run_mod


class _Exit(Exception):
    pass


def _leader(monkeypatch) -> types.SimpleNamespace:
    """The fields and methods of ``Run`` that stop requests use, on a stand-in (a whole Run needs cells and a
    proxy); os._exit raises instead of exiting."""

    def exit_(status):
        raise _Exit(status)

    monkeypatch.setattr(run_mod.os, "_exit", exit_)
    cancels = []
    leader = types.SimpleNamespace(
        stop=threading.Event(), signalled=False, executor=types.SimpleNamespace(cancel=lambda: cancels.append(1))
    )
    for name in ("request_stop", "follower_asks_stop", "_begin_stop"):
        setattr(leader, name, types.MethodType(getattr(run_mod.Run, name), leader))
    leader.cancels = cancels
    return leader


@pytest.mark.parametrize("follower_first", [True, False])
def test_own_signal_and_follower_request_in_either_order_are_one_stop(monkeypatch, follower_first) -> None:
    leader = _leader(monkeypatch)
    if follower_first:
        leader.follower_asks_stop()
        leader.request_stop(15, None)
    else:
        leader.request_stop(15, None)
        leader.follower_asks_stop()
    assert leader.stop.is_set() and leader.cancels == [1]  # one stop: harnesses cancelled once, no forced exit
    leader.follower_asks_stop()  # a follower repeating itself never forces
    with pytest.raises(_Exit) as exc:  # a second signal to this process does
        leader.request_stop(15, None)
    assert exc.value.args == (130,)


def test_a_signal_after_the_run_stopped_itself_is_not_the_forcing_second(monkeypatch) -> None:
    leader = _leader(monkeypatch)
    leader.stop.set()  # e.g. the untrained-steps guard stopped the run
    leader.request_stop(2, None)
    assert leader.cancels == []  # already stopping: nothing more to do
    with pytest.raises(_Exit):
        leader.request_stop(2, None)
