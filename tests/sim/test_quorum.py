"""The group quorum of the simulator (issue 21): a group trains once ``group_quorum`` of its G executions have
ended; its other members are aborted at that moment, train nothing, and the slot time they held is wasted
(not busy). Real runs refuse the knob until the controller honours it."""

from __future__ import annotations

import pytest

from gyre_jax.config import ConfigError, ScheduleSection
from gyre_jax.sim.config import load_sim_config
from gyre_jax.sim.simulator import Simulator


def _run(**overrides):
    sim = Simulator(load_sim_config("tiny", overrides))
    return sim, sim.run()


def _groups(sim, v):
    g = sim.cfg.group_size
    return sorted({i // g for i in sim.ledger.members(v)})


@pytest.mark.parametrize(
    "extra",
    [{}, {"schedule.stream_unit": "group", "schedule.partial_rollouts": True, "schedule.dispatch_staleness": 2}],
    ids=["elastic", "partial-rollouts"],
)
def test_a_group_trains_its_first_q_members_and_the_rest_are_aborted_when_the_qth_ends(extra):
    sim, result = _run(steps=5, **{"schedule.group_quorum": 6}, **extra)  # tiny: G = 8
    cfg, ledger, sv, tr = sim.cfg, sim.ledger, sim.serving, sim.training
    g, aborted_slot_s, aborted = cfg.group_size, 0.0, 0
    for v in range(cfg.steps):
        assert len(_groups(sim, v)) == cfg.tasks_per_step
        for gi in _groups(sim, v):
            members = range(gi * g, (gi + 1) * g)
            kept = [i for i in members if not ledger.aborted[i]]
            cut = [i for i in members if ledger.aborted[i]]
            assert len(kept) == 6 and len(cut) == 2
            quorum_t = max(sv.start_t[i] + sv.slot_s[i] for i in kept)  # when the 6th member ended
            for i in cut:
                assert tr.exec_work[i] == 0.0
                if sv.slot_s[i] > 0:  # it had a slot: it left it when the quorum was reached
                    assert sv.start_t[i] + sv.slot_s[i] == pytest.approx(quorum_t)
            aborted_slot_s += sum(sv.slot_s[i] for i in cut)
            aborted += len(cut)
        kept_v = [i for i in ledger.members(v) if ledger.trains(i)]
        assert tr.total_work[v] == pytest.approx(sum(tr.exec_work[i] for i in kept_v))
    cell_time = cfg.num_cells * result.makespan_s
    assert result.partial["aborted"] == aborted == 2 * cfg.tasks_per_step * cfg.steps
    assert result.idle["aborted_slots"] == pytest.approx(aborted_slot_s / cfg.slots_per_cell / cell_time)
    assert result.idle["aborted_slots"] > 0 and result.group_quorum == 6
    assert result.busy_fraction == pytest.approx(
        result.serving_busy_fraction + result.training_busy_fraction - result.partial["wasted_fraction"]
    )
    # the duration history holds only the executions that ended by themselves (an aborted one's is cut short)
    assert sim.versions.history.n == len(sv.durations)
    assert sv.aborts >= aborted


def test_the_quorum_shortens_the_step_that_waits_for_its_slowest_member():
    _, whole = _run(steps=5)
    _, quorum = _run(steps=5, **{"schedule.group_quorum": 6})
    assert quorum.makespan_s < whole.makespan_s
    assert whole.partial["aborted"] == 0 and whole.idle["aborted_slots"] == 0.0


def test_quorum_settings_are_checked_and_real_runs_refuse_the_knob():
    with pytest.raises(ConfigError, match=r"group_quorum=9 must be in 0 .. group_size=8"):
        load_sim_config("tiny", {"schedule.group_quorum": 9})
    assert load_sim_config("tiny", {"schedule.group_quorum": 8}).group_quorum == 8  # the whole group: no aborts
    with pytest.raises(ConfigError, match=r"config.schedule.group_quorum=15: not supported yet in real runs"):
        ScheduleSection(policy="elastic", group_quorum=15)
    assert ScheduleSection(policy="elastic").group_quorum == 0
