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
        model=types.SimpleNamespace(lora=types.SimpleNamespace(enabled=False)),
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


def _result(eid: str, status: str, calls: int | None, refused: dict | None = None, reward: float | None = 0.0):
    from gyre_jax.rollout.executor import ExecutionResult

    return ExecutionResult(eid, "t", "g", status, reward, reward is None, "evaluator raised" if reward is None else None,
                           1 if status == "crashed" else 0, 1.0, "/w", "evaluator_error" if reward is None else None,
                           model_calls=calls, refused_calls=refused)  # fmt: skip


def test_a_step_whose_executions_all_failed_or_were_left_out_is_untrained_and_says_why():
    from gyre_jax.run import UntrainedSteps, untrained_reason

    refused = {"context": 3, "admission": 0, "bad_request": 1}
    crashed = [_result("a", "crashed", 0, refused), _result("b", "crashed", 0)]
    assert untrained_reason(crashed, {"executions_trained": 0}) == (
        "every execution failed (2: crashed 2, no recorded model call 2; model calls refused: context 3, bad request 1)"
    )
    quiet = [_result("a", "finished", 0, refused), _result("b", "finished", 0, refused)]  # exited 0, every call refused
    assert untrained_reason(quiet, {"executions_trained": 0}).startswith("every execution failed (2: no recorded model")
    healthy = [_result("a", "finished", 3), _result("b", "crashed", 0)]
    assert untrained_reason(healthy, {"executions_trained": 1}) is None  # something trained
    # no signal (every group's rewards equal: weight 0) is not a fault; the pipeline's own reasons are
    assert untrained_reason(healthy, {"executions_trained": 0, "left_out/weight_0": 2}) is None
    assert untrained_reason(healthy, {"executions_trained": 0, "left_out/does_not_fit": 1, "left_out/no_records": 1}) \
        == "the trajectory pipeline left every execution out (does not fit 1, no records 1)"  # fmt: skip
    assert untrained_reason(crashed, {}) is None  # a controller that does not count trained executions: no verdict
    short = UntrainedSteps(3)  # a run shorter than the limit whose one step trained nothing ends non-zero
    short.observe(0, crashed, {"executions_trained": 0})
    line = short.at_end(1)
    assert line.startswith("the run ended, but: 1 consecutive RL steps (1..1) trained nothing: every execution failed")
    assert "(e.g. a: harness exited 1, model calls refused: context 3, bad request 1; see executions/a/harness.stderr)" \
        in line  # fmt: skip


def test_the_step_line_names_refused_calls_and_executions_left_out():
    from gyre_jax.metrics import format_step_line

    m = {"reward_mean": 0.5, "crashed": 1, "refused_context": 3, "refused_bad_request": 1, "left_out/no_records": 2,
         "left_out/weight_0": 1, "executions_trained": 5, "tokens_trained": 70}  # fmt: skip
    line = format_step_line(2, 9, m)
    assert "crashed 1  refused 4 (context 3, bad request 1)  left out 3 (no records 2, weight 0 1)  trained 5  " \
           "tokens 70" in line  # fmt: skip
    quiet = format_step_line(1, 9, {"executions_trained": 8})
    assert "refused 0  left out 0  trained 8" in quiet
