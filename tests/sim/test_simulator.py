"""Tests for gyre_jax/sim/simulator.py: determinism, conservation of executions and training work, the
policies' rules as the simulator carries them out, timeouts, streaming, and clear config errors."""

from __future__ import annotations

import copy
import math

import pytest

from gyre_jax.config import ConfigError
from gyre_jax.elastic.policies import Role
from gyre_jax.elastic.timeline import TimelineWriter, load_timeline
from gyre_jax.sim.config import load_sim_config
from gyre_jax.sim.simulator import SimConfigError, Simulator, simulate

POLICIES = {"colocated": {}, "async": {"schedule.training_cells": 2}, "elastic": {}}


def _run(policy: str, **overrides):
    cfg = load_sim_config("tiny", {"schedule.policy": policy, **POLICIES[policy], **overrides})
    timeline = TimelineWriter(None, [f"cell{c}" for c in range(cfg.num_cells)], source="sim")
    sim = Simulator(cfg, timeline=timeline, trace_executions=True)
    result = sim.run()
    timeline.close(result.makespan_s)
    return cfg, sim, result, load_timeline(timeline.events)


@pytest.fixture(scope="module", params=sorted(POLICIES))
def run(request):
    return _run(request.param)


def test_every_trained_execution_ended_and_the_counts_add_up(run):
    cfg, sim, result, tl = run
    assert len(result.step_end_s) == cfg.steps
    assert all(b > a for a, b in zip(result.step_end_s, result.step_end_s[1:]))
    assert result.makespan_s == result.step_end_s[-1]
    trained = range(cfg.steps * cfg.batch_size)
    assert all(sim.fin_count[k] == cfg.batch_size for k in range(cfg.steps))  # nothing lost ...
    assert sim.wl.finished <= sim.wl.started <= sim.wl.dispatched <= cfg.steps * cfg.batch_size  # ... or invented
    ended = {eid for eid, span in tl.executions.items() if math.isfinite(span.end)}
    assert {sim._eid(i) for i in trained} <= ended
    assert len(sim.staleness) == len(trained)
    eta = dict(cfg.policy_options).get("dispatch_staleness", 0)
    assert 0 <= result.staleness["max"] <= eta


def test_training_work_is_conserved(run):
    cfg, sim, result, tl = run
    micro = sum(s.args["flops"] for cell in tl.micro_steps for s in cell)
    expected = sum(sim.total_work[k] for k in range(cfg.steps))
    assert micro == pytest.approx(expected, rel=1e-9)
    assert expected == pytest.approx(sum(sim.exec_work[: cfg.steps * cfg.batch_size]), rel=1e-9)
    assert [s.args["step"] for s in tl.optimizer_steps] == list(range(cfg.steps))
    for step_span in tl.optimizer_steps:  # the optimizer step of step k follows every micro-step of step k
        last = max(s.end for cell in tl.micro_steps for s in cell if s.args["step"] == step_span.args["step"])
        assert step_span.start >= last - 1e-6


def test_accounting_fractions_are_consistent(run):
    cfg, sim, result, tl = run
    assert 0 < result.busy_fraction <= 1
    assert result.busy_fraction == pytest.approx(result.serving_busy_fraction + result.training_busy_fraction)
    assert sum(result.role_fractions.values()) == pytest.approx(1.0)
    frac = tl.busy_fraction()
    for role in ("serving", "training", "switching"):  # the timeline says the same as the accounting
        assert frac[role] == pytest.approx(result.role_fractions[role], abs=1e-6)
    for c in range(cfg.num_cells):  # each cell's role spans tile [0, makespan]
        spans = tl.roles[c]
        assert spans[0].start == 0 and spans[-1].end == pytest.approx(result.makespan_s)
        assert all(a.end == pytest.approx(b.start) for a, b in zip(spans, spans[1:]))
        for m in tl.micro_steps[c]:  # micro-steps only inside training spans
            assert any(s.name == "training" and s.start - 1e-6 <= m.start and m.end <= s.end + 1e-6 for s in spans)


def test_policy_rules_as_carried_out():
    _, _, colo, tl = _run("colocated")
    change_times = [{round(s.start, 6) for s in tl.roles[c]} for c in range(len(tl.cells))]
    assert all(t == change_times[0] for t in change_times)  # all cells switch together
    cfg, _, asy, tl = _run("async")
    assert asy.switches["serving_to_training"] == asy.switches["training_to_serving"] == 0
    for c in range(cfg.num_cells):
        assert [s.name for s in tl.roles[c]] == ["training" if c < 2 else "serving"]
    cfg, _, el, tl = _run("elastic")
    assert el.switches["serving_to_training"] > 0
    leaves = sorted(
        (s.start, c)
        for c in range(cfg.num_cells)
        for s in tl.roles[c]
        if s.name == "switching" and s.args.get("to") == "training"
    )

    def role_at(c, t):
        return next(s.name for s in tl.roles[c] if s.start <= t < s.end)

    for t, c in leaves:  # the cell that leaves is the first one in the order (core first) that still serves
        assert all(role_at(i, t) != "serving" for i in range(c)), (t, c)
    for (t1, c1), (t2, _) in zip(leaves, leaves[1:]):  # one at a time: the next leaves once the last has switched
        switch_end = next(s.end for s in tl.roles[c1] if s.start == t1 and s.name == "switching")
        assert t2 >= switch_end - 1e-6


def test_same_seed_same_result_and_another_seed_differs():
    cfg = load_sim_config("tiny", {"steps": 3})
    a, b = simulate(cfg).to_dict(), simulate(cfg).to_dict()
    a.pop("sim"), b.pop("sim")
    assert a == b
    c = simulate(cfg.replace(seed=1))
    assert c.makespan_s != a["makespan_s"]


def test_the_policy_decides_the_same_when_replayed_outside_the_simulator():
    cfg = load_sim_config("tiny", {"steps": 3})
    sim = Simulator(cfg)
    recorded = []
    plan = sim.policy.plan

    def recording(event, state):
        decision = plan(event, state)
        recorded.append((event, copy.deepcopy(state), decision))
        return decision

    sim.policy.plan = recording
    sim.run()
    assert len(recorded) > 100
    fresh = Simulator(cfg).policy  # the same policy object type and options, never driven
    assert [fresh.plan(e, s) for e, s, _ in recorded] == [d for _, _, d in recorded]


def test_timeouts_end_executions_at_the_limit():
    cfg = load_sim_config("tiny", {"steps": 2, "schedule.policy": "colocated", "workload.timeout_s": 120.0})
    sim = Simulator(cfg)
    result = sim.run()
    assert result.executions["timeout_fraction"] > 0.5
    assert result.executions["duration_max_s"] <= 120.0 + 1e-6
    full = load_sim_config("tiny", {"steps": 2, "schedule.policy": "colocated"})
    assert result.executions["tokens_mean"] < simulate(full).executions["tokens_mean"]  # cut short: fewer tokens


def test_without_streaming_training_waits_for_the_whole_batch():
    cfg, sim, result, tl = _run("async", **{"schedule.streaming": False})
    for k in range(cfg.steps):
        last_end = max(tl.executions[sim._eid(i)].end for i in range(k * cfg.batch_size, (k + 1) * cfg.batch_size))
        first_micro = min(s.start for cell in tl.micro_steps for s in cell if s.args["step"] == k)
        assert first_micro > last_end
    _, _, streamed, _ = _run("async")
    assert streamed.makespan_s < result.makespan_s


def test_segments_converge_to_per_call_resolution():
    """Grouping calls into segments is an approximation of following every call; it stays close."""
    times = {}
    for segments in (4, 8, 40):  # 40 >= every execution's turns in the tiny preset: one segment per call
        cfg = load_sim_config("tiny", {"segments": segments, "schedule.policy": "colocated", "steps": 3})
        times[segments] = simulate(cfg).makespan_s
    assert times[8] == pytest.approx(times[40], rel=0.05)
    assert times[4] == pytest.approx(times[40], rel=0.10)


def test_bad_cluster_shapes_fail_with_a_clear_error():
    with pytest.raises(ConfigError, match="accelerators=60 must be a positive multiple of cell_accelerators=8"):
        load_sim_config("tiny", {"cluster.accelerators": 60})
    with pytest.raises(ConfigError, match="cell_accelerators=12 must be a multiple of the serving replica size 8"):
        load_sim_config("deepswe", {"cluster.cell_accelerators": 12, "cluster.accelerators": 1200})
    with pytest.raises(ConfigError, match="below the 32 accelerators a training replica needs"):
        load_sim_config("deepswe", {"cluster.cell_accelerators": 16})
    with pytest.raises(ConfigError, match="unknown scheduling policy 'fifo'"):
        load_sim_config("tiny", {"schedule.policy": "fifo"})
    with pytest.raises(ConfigError, match="unknown simulator preset 'swe'"):
        load_sim_config("swe")
    cfg = load_sim_config("tiny")
    with pytest.raises(SimConfigError, match="the timeline has 2 cells, the config 8"):
        Simulator(cfg, timeline=TimelineWriter(None, ["a", "b"], source="sim"))


def test_role_enum_values_are_what_the_timeline_writes():
    assert [r.value for r in Role] == ["serving", "training", "switching"]


def test_training_starts_as_soon_as_its_data_and_weights_are_there():
    """Regression: a step whose whole batch was processed while the previous step trained starts its
    micro-steps the moment the previous optimizer step ends (it once waited for an event that never came)."""
    cfg = load_sim_config(
        "tiny",
        {
            "schedule.policy": "async",
            "schedule.training_cells": 1,
            "schedule.streaming": False,
            "steps": 6,
            "cost.train_mfu": 0.002,
        },
    )  # slow training: data waits for it
    timeline = TimelineWriter(None, [f"cell{c}" for c in range(cfg.num_cells)], source="sim")
    sim = Simulator(cfg, timeline=timeline)
    ready_at = {}
    on_batch_ready = sim._on_batch_ready

    def record(step, y):
        ready_at[step] = sim.now
        on_batch_ready(step, y)

    sim._on_batch_ready = record
    result = sim.run()
    timeline.close(result.makespan_s)
    tl = load_timeline(timeline.events)
    opt_end = {s.args["step"]: s.end for s in tl.optimizer_steps}
    for k in range(1, cfg.steps):
        first = min(s.start for cell in tl.micro_steps for s in cell if s.args["step"] == k)
        assert first == pytest.approx(max(opt_end[k - 1], ready_at[k]))
    assert any(ready_at[k] < opt_end[k - 1] for k in range(1, cfg.steps))  # the case that matters happened


def test_the_dispatch_bound_has_the_run_configs_name():
    """``schedule.dispatch_staleness`` (eta) in the simulator's presets as in the run config; the old name is
    refused with the new one."""
    assert dict(load_sim_config("tiny", {"schedule.dispatch_staleness": 2}).policy_options)["dispatch_staleness"] == 2
    with pytest.raises(ConfigError, match="schedule.max_staleness was renamed: use config.schedule.dispatch_staleness"):
        load_sim_config("tiny", {"schedule.max_staleness": 2})


def test_a_slower_network_between_hosts_slows_the_optimizer_step_by_each_satellites_gradients():
    """Cells over hosts: the optimizer step waits for every satellite's gradients to cross to the core, so a 100x
    slower network (cluster.host_bandwidth) makes the elastic run slower, and by no more than its moves explain."""
    fast, slow = (load_sim_config("tiny", {"cluster.host_bandwidth": bw}) for bw in (400e9, 4e9))
    assert slow.cost.training.grad_receive_s == pytest.approx(100 * fast.cost.training.grad_receive_s)
    a, b = simulate(fast), simulate(slow)
    assert b.makespan_s > a.makespan_s
    per_step = 100 * (fast.cost.training.grad_receive_s * (fast.num_cells - 1) + fast.cost.switch.weight_sync_s)
    assert b.makespan_s - a.makespan_s < fast.steps * per_step
