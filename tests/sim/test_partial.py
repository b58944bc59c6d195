"""Tests for the issue-21 mechanisms of the simulator: partial rollouts (a step trains the first groups to
complete, the others carry on across weight updates, every token keeps its version, the drop bound holds on
the oldest token) and admission in order of per-task duration history (``policies.DurationHistory``)."""

from __future__ import annotations

import pytest

from gyre_jax.config import ConfigError
from gyre_jax.elastic.policies import DurationHistory
from gyre_jax.sim.config import load_sim_config
from gyre_jax.sim.ledger import SimLedger
from gyre_jax.sim.partial import VersionBooks
from gyre_jax.sim.simulator import SimConfigError, Simulator
from gyre_jax.sim.workload import task_ids

PARTIAL = {"steps": 6, "schedule.stream_unit": "group", "schedule.partial_rollouts": True}


def _run(**overrides):
    sim = Simulator(load_sim_config("tiny", overrides))
    return sim, sim.run()


def _end_t(sim, i):
    return sim.serving.start_t[i] + sim.serving.slot_s[i]


def test_partial_rollouts_carry_groups_across_versions_with_per_token_versions():
    sim, result = _run(**PARTIAL, **{"schedule.dispatch_staleness": 2})
    cfg, ledger, sv = sim.cfg, sim.ledger, sim.serving
    g, per_step = cfg.group_size, cfg.tasks_per_step
    assert ledger.swaps > 0 and result.partial["carried_groups"] == ledger.swaps
    carried = [gi for v in range(cfg.steps) for gi in ledger.assigned[v] if gi // per_step != v]
    assert carried  # groups trained in another step than the batch they were dispatched with
    for v in range(cfg.steps):
        members = list(ledger.members(v))
        assert len(members) == cfg.batch_size and len(ledger.assigned[v]) == per_step
        # a step trains whole groups that all ended before its optimizer step did
        assert all(ledger.grp_fin[i // g] == g and _end_t(sim, i) <= ledger.step_end[v] for i in members)
    # executions that ran across weight updates: tokens of more than one version
    mixed = [i for gi in carried for i in range(gi * g, (gi + 1) * g) if sv.tok_v[i] > sv.ver0[i] * sv.tok_n[i] + 1e-6]
    assert mixed
    # per-token staleness is reported per step: the oldest token goes past the dispatch bound (no drop bound here)
    per_step_stale = result.token_staleness["per_step"]
    assert len(per_step_stale) == cfg.steps
    oldest = [max(v - sv.ver0[i] for i in ledger.members(v)) for v in range(cfg.steps)]
    assert [m for m, _ in per_step_stale] == oldest and max(oldest) == result.token_staleness["max"] > 2
    assert all(0 <= mean <= m for m, mean in per_step_stale)


def test_the_drop_bound_holds_on_the_oldest_token_and_dropped_work_is_wasted():
    sim, result = _run(**PARTIAL, **{"schedule.dispatch_staleness": 2, "schedule.drop_staleness": 2})
    cfg, ledger, sv, tr = sim.cfg, sim.ledger, sim.serving, sim.training
    dropped = [i for v in range(cfg.steps) for i in ledger.members(v) if ledger.dropped[i]]
    assert dropped and result.partial["dropped"] == len(dropped)
    for v in range(cfg.steps):
        kept = [i for i in ledger.members(v) if not ledger.dropped[i]]
        assert all(v - sv.ver0[i] <= 2 for i in kept)
        assert all(v - sv.ver0[i] > 2 for i in ledger.members(v) if ledger.dropped[i])
        assert tr.total_work[v] == pytest.approx(sum(tr.exec_work[i] for i in kept))
    assert all(tr.exec_work[i] == 0.0 for i in dropped)
    assert result.token_staleness["max"] <= 2
    waste = sum(sv.slot_s[i] for i in dropped) / cfg.slots_per_cell / (cfg.num_cells * result.makespan_s)
    assert result.partial["wasted_fraction"] == pytest.approx(waste) and waste > 0
    assert result.busy_fraction == pytest.approx(
        result.serving_busy_fraction + result.training_busy_fraction - result.partial["wasted_fraction"]
    )


def test_without_partial_rollouts_each_step_trains_its_own_batch():
    sim, result = _run(steps=4)
    ledger = sim.ledger
    assert ledger.swaps == 0 and result.partial["dropped"] == 0
    assert all(list(ledger.members(v)) == list(range(v * 32, (v + 1) * 32)) for v in range(4))
    # tokens start no earlier than dispatch, so per-token staleness stays within eta = 1
    assert result.token_staleness["max"] <= 1 and result.staleness["max"] <= 1


def test_duration_history_predicts_per_task_and_orders_longest_first():
    h = DurationHistory()
    assert h.predict(7) == 0.0 and h.order([1, 2, 3]) == [0, 1, 2]
    for task, s in ((1, 10.0), (1, 30.0), (2, 50.0), (3, 5.0)):
        h.record(task, s)
    assert h.predict(1) == 20.0 and h.predict(2) == 50.0
    assert h.predict(9) == pytest.approx(95.0 / 4)  # never seen: the mean over every task seen
    assert h.order([1, 2, 3, 9]) == [1, 3, 0, 2]  # 50, 23.75 (unseen), 20, 5


def test_admission_dispatches_the_tasks_predicted_longest_first(monkeypatch):
    over = {"steps": 5, "workload.task_pool": 4, "schedule.admission": "longest_first"}  # tiny: 4 tasks per step
    cfg = load_sim_config("tiny", over)
    assert list(task_ids(cfg.workload, 3, 4)) == [0, 1, 2, 3]  # the same 4 tasks come round every step
    g, n = cfg.group_size, cfg.batch_size
    predicted, dispatched = {}, []
    order, dispatch = VersionBooks.admission_order, SimLedger.dispatch

    def spy_order(books, step):
        predicted[step] = [books.history.predict(t) for t in range(4)] if books.history.n else None
        return order(books, step)

    def spy_dispatch(ledger):
        i = dispatch(ledger)
        dispatched.append(i)
        return i

    monkeypatch.setattr(VersionBooks, "admission_order", spy_order)
    monkeypatch.setattr(SimLedger, "dispatch", spy_dispatch)
    Simulator(cfg).run()
    with_history = {s: p for s, p in predicted.items() if p is not None}
    assert with_history and 0 not in with_history  # step 0 starts before anything ended: no history
    reordered = 0
    for s, pred in with_history.items():
        tasks = [(i % n) // g for i in dispatched if i // n == s]
        want = sorted(range(4), key=lambda t: -pred[t])  # longest predicted first, ties in task order
        assert tasks == [t for t in want for _ in range(g)]
        reordered += want != [0, 1, 2, 3]
    assert reordered  # the history changed the order at least once
    # without it, task order
    dispatched.clear()
    Simulator(load_sim_config("tiny", {"steps": 3})).run()
    assert dispatched == sorted(dispatched)


def test_bad_mechanism_settings_fail_before_the_run_with_what_to_do():
    with pytest.raises(ConfigError, match="partial_rollouts needs streaming=True and stream_unit='group'"):
        load_sim_config("tiny", {"schedule.partial_rollouts": True})
    cfg = load_sim_config("tiny", {"schedule.stream_unit": "group"})
    with pytest.raises(SimConfigError, match="the colocated policy trains each batch whole"):
        cfg.replace(policy="colocated", policy_options={}, partial_rollouts=True)
    with pytest.raises(ConfigError, match="drop_staleness=1 applies to partial rollouts"):
        load_sim_config("tiny", {"schedule.drop_staleness": 1})
    with pytest.raises(ConfigError, match="admission='longest_first' predicts from each task's earlier executions"):
        load_sim_config("tiny", {"schedule.admission": "longest_first"})
    with pytest.raises(ConfigError, match="admission='shortest' must be one of task, longest_first"):
        load_sim_config("tiny", {"schedule.admission": "shortest"})


def test_steady_busy_fraction_leaves_out_the_first_step_and_the_end():
    sim, result = _run(steps=8)
    marks = sim.versions.busy_at_step_end
    assert len(marks) == 8 and result.steady["steps"] == [2, 4]
    (t0, b0), (t1, b1) = marks[1], marks[4]
    assert result.steady["busy_fraction"] == pytest.approx((b1 - b0) / (sim.cfg.num_cells * (t1 - t0)))
    assert 0 < result.steady["busy_fraction"] <= 1
    # busy cell-seconds at the last step's end are the whole run's
    assert marks[-1][1] / (sim.cfg.num_cells * marks[-1][0]) == pytest.approx(result.busy_fraction)
    assert _run(steps=4)[1].steady == {"busy_fraction": None, "steps": None}
