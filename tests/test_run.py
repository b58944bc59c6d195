"""``run.Run`` on stand-in parts (a real run is in tests/test_train.py and tests/elastic/test_controller.py): how
the loop ends when a part stops it or fails. The parts are the ones ``Run`` takes (``RunDir``, ``Rollouts``,
``Cells``, the controller, ``RunStop``); each stand-in records what the loop did with it."""

from __future__ import annotations

import types

import pytest

from gyre_jax.run import Run, RunStop


def _run(controller_run, total_steps: int = 3):
    saved, cancelled, costs = [], [], []
    config = types.SimpleNamespace(
        total_steps=total_steps, seed=0, checkpoint_every=1,
        eval=types.SimpleNamespace(samples_per_task=0, every_steps=0),
        metrics=types.SimpleNamespace(progress_bar=False), schedule=types.SimpleNamespace(policy="colocated"),
        rl=types.SimpleNamespace(max_untrained_steps=3),
    )  # fmt: skip
    rundir = types.SimpleNamespace(
        checkpointer=types.SimpleNamespace(save=lambda step, state, meta: saved.append(step)),
        write_costs=lambda c, logs: costs.append(logs),
    )
    controller = types.SimpleNamespace(
        run=controller_run, costs=None, training=types.SimpleNamespace(state=types.SimpleNamespace(step=0))
    )
    rollouts = types.SimpleNamespace(executor=types.SimpleNamespace(cancel=lambda: cancelled.append(1)))
    cells = types.SimpleNamespace(step_logs=lambda: [[]])
    stop = RunStop()
    run = Run(config, 0, rundir, rollouts, cells, controller, stop, pipeline_state=None)
    return run, stop, saved, cancelled, costs


def test_a_follower_failure_fails_the_run_without_a_checkpoint_and_kills_the_harnesses():
    def segment(start, end, on_step):
        stop.fail("process 1: MicroStep failed: boom")  # what a FollowerLink reports from its reader thread
        return start  # the controller ends its segment on the stop, mid-way

    run, stop, saved, cancelled, costs = _run(segment)
    with pytest.raises(RuntimeError, match="process 1: MicroStep failed: boom"):
        run.run()
    assert saved == [] and cancelled == [1] and costs == [[[]]]  # no checkpoint; harnesses killed; costs written


def test_a_stop_request_ends_the_run_at_the_step_boundary_with_a_checkpoint():
    def segment(start, end, on_step):
        stop.follower_asks()  # a follower relays Slurm's preemption notice
        return start + 1

    run, stop, saved, cancelled, _ = _run(segment)
    assert run.run() == 1
    assert saved == [1] and cancelled == [1] and run.untrained_error is None


def test_a_run_that_ends_normally_kills_nothing():
    run, stop, saved, cancelled, _ = _run(lambda start, end, on_step: end, total_steps=2)
    assert run.run() == 2
    assert saved == [2] and cancelled == [] and not stop.is_set()
