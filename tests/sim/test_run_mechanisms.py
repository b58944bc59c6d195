"""Tests for the simulator's mechanisms that a real run needs (gyre_jax/sim/simulator.py, used by calibration):
balanced session placement, streaming whole groups in task order, the packer's open micro-batches, prefill
interference, the host time at step boundaries and the jit-compile warm-up of cells and the optimizer."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from gyre_jax.elastic.timeline import TimelineWriter, load_timeline
from gyre_jax.sim.config import load_sim_config
from gyre_jax.sim.simulator import SimConfigError, Simulator


def _run(changes=None, cost=None, **overrides):
    cfg = load_sim_config("tiny", {"steps": 3, "schedule.policy": "async", "schedule.training_cells": 2, **overrides})
    if cost:
        cfg = cfg.replace(cost=cfg.cost.replace(**cost))
    if changes:
        cfg = cfg.replace(**changes)
    timeline = TimelineWriter(None, [f"cell{c}" for c in range(cfg.num_cells)], source="sim")
    sim = Simulator(cfg, timeline=timeline, trace_executions=True)
    result = sim.run()
    timeline.close(result.makespan_s)
    return cfg, sim, result, load_timeline(timeline.events)


def _first_micro(tl, step):
    return min(s.start for cell in tl.micro_steps for s in cell if s.args["step"] == step)


def test_balanced_placement_spreads_sessions_like_the_router():
    over = {"schedule.policy": "colocated", "cost.slots_per_replica": 2}  # 64 slots for 32 executions
    counts = {}
    for placement in ("last", "balanced"):
        _, _, _, tl = _run({"placement": placement}, **over)
        per_cell = collections.Counter(s.args["cell"] for s in tl.executions.values() if s.args["step"] == 0)
        counts[placement] = [per_cell.get(c, 0) for c in range(8)]
    assert counts["last"][:4] == [0, 0, 0, 0]  # the cells that leave serving first hold nothing
    assert counts["balanced"] == [4] * 8
    with pytest.raises(SimConfigError, match="placement='random' must be one of last, balanced"):
        _run({"placement": "random"})


def test_groups_stream_whole_and_in_task_order():
    cfg, sim, _, tl = _run({"stream_unit": "group_in_order"})
    g = cfg.group_size
    for k in range(cfg.steps):
        first_task_end = max(tl.executions[sim._eid(k * cfg.batch_size + j)].end for j in range(g))
        assert _first_micro(tl, k) >= first_task_end  # nothing trains before the first group is whole
    _, _, _, per_exec = _run({"stream_unit": "execution"})
    assert _first_micro(per_exec, 0) < _first_micro(tl, 0)
    with pytest.raises(SimConfigError, match="stream_unit='task' must be one of"):
        _run({"stream_unit": "task"})


def test_open_micro_batches_hold_a_steps_data_until_it_is_complete():
    cfg, sim, _, tl = _run({"pack_lookahead": 1000})  # more than a step's micro-steps: nothing leaves early
    for k in range(cfg.steps):
        last_end = max(tl.executions[sim._eid(i)].end for i in range(k * cfg.batch_size, (k + 1) * cfg.batch_size))
        assert _first_micro(tl, k) >= last_end
    _, _, _, free = _run({"pack_lookahead": 0})
    assert _first_micro(free, 0) < _first_micro(tl, 0)


def test_prefill_interference_slows_decoding_only_when_there_are_prefills():
    heavy = {"serving": {"prefill_per_token_s": 2e-4}}
    _, _, plain, _ = _run(cost=heavy)
    _, _, slowed, _ = _run({"prefill_interference": True}, cost=heavy)
    assert slowed.executions["duration_mean_s"] > plain.executions["duration_mean_s"]
    free = {"serving": {"prefill_base_s": 0.0, "prefill_per_token_s": 0.0, "prefill_per_token_context_s": 0.0}}
    _, _, a, _ = _run(cost=free)
    _, _, b, _ = _run({"prefill_interference": True}, cost=free)
    assert a.step_end_s == b.step_end_s


def test_step_boundary_and_warm_up_delay_training():
    cfg, _, _, tl = _run(
        cost={
            "pipeline": {"step_boundary_s": 40.0},
            "training": {"warmup_micro_step_s": 25.0, "warmup_optimizer_step_s": 7.0},
        }
    )
    opt = {s.args["step"]: s for s in tl.optimizer_steps}
    for k in range(1, cfg.steps):
        assert _first_micro(tl, k) >= opt[k - 1].end + 40.0 - 1e-6
    _, _, _, base = _run()
    first = [min(cell, key=lambda s: s.start) for cell in tl.micro_steps if cell]
    base_first = [min(cell, key=lambda s: s.start) for cell in base.micro_steps if cell]
    assert np.mean([s.duration for s in first]) == pytest.approx(
        np.mean([s.duration for s in base_first]) + 25.0, rel=0.05
    )
    base_opt = {s.args["step"]: s for s in base.optimizer_steps}
    assert opt[0].duration == pytest.approx(base_opt[0].duration + 7.0)
    assert opt[1].duration == pytest.approx(base_opt[1].duration)  # compiled once
