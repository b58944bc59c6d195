"""Tests for gyre_jax/elastic/events.py and gyre_jax/elastic/state.py: the typed scheduler events and their
serialized form, and the one ``ClusterState`` builder both drivers call."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gyre_jax.elastic.events import (
    EVENT_KINDS,
    EVENT_TYPES,
    DataReady,
    Finished,
    MicroStepDone,
    StepBegan,
    Switched,
    Tick,
    WeightsPulled,
    event_from_dict,
)
from gyre_jax.elastic.state import Cells, Role, TrainingFacts, Waterlevel, cluster_state, state_dict, state_from_dict

SERVING, TRAINING, SWITCHING = Role.SERVING, Role.TRAINING, Role.SWITCHING


def test_every_event_kind_round_trips_through_its_serialized_form():
    samples = [
        StepBegan(0, 0.5, executions=16),
        Finished(2, 10.25, execution_id="s2-t0-g3", result=object()),
        DataReady(2, 11.0),
        MicroStepDone(2, 12.0, cell=1, slot=4, flops=3.5e9, t_start=11.5),
        WeightsPulled(3, 13.0, cell=2),
        Switched(3, 14.0, cell=0, seconds=2.5),
        Tick(3, 15.0),
    ]
    assert {e.kind for e in samples} | {"started", "step_trained"} == set(EVENT_KINDS) == set(EVENT_TYPES)
    for e in samples:
        d = json.loads(json.dumps(e.to_dict()))
        assert d["kind"] == e.kind and d["step"] == e.step and d["time"] == e.time
        assert event_from_dict(d) == e
        assert type(event_from_dict(d)) is type(e)
    finished = samples[1].to_dict()
    assert "result" not in finished  # the real run's ExecutionResult stays in the process
    with pytest.raises(dataclasses.FrozenInstanceError):
        samples[0].step = 1  # type: ignore[misc]


def test_decision_lines_written_before_the_typed_events_still_read():
    old = {"kind": "step_began", "step": 0, "time": 1.0, "execution_id": None, "executions_in_step": 16, "cell": None}
    assert event_from_dict(old) == StepBegan(0, 1.0, executions=16)
    old = {"kind": "switched", "step": 1, "time": 2.0, "execution_id": None, "executions_in_step": 0, "cell": 1}
    assert event_from_dict(old) == Switched(1, 2.0, cell=1)
    with pytest.raises(ValueError, match=r"event 'tick' has no field\(s\) \['cell'\]"):
        event_from_dict({"kind": "tick", "step": 0, "time": 0.0, "cell": 3})
    with pytest.raises(ValueError, match="unknown event kind 'dispatched'"):
        event_from_dict({"kind": "dispatched", "step": 0, "time": 0.0})


class _Books:
    """A ledger's books as ``cluster_state`` reads them."""

    def __init__(self, wl: Waterlevel):
        self.wl, self.batch_size = wl, 8

    @property
    def undispatched(self) -> int:
        return 24 - self.wl.dispatched

    def step_counts(self, step: int) -> tuple[int, int]:
        return (8, 3) if step == 1 else (0, 0)

    def due_outstanding(self, version: int) -> int:
        return 5


def test_the_builder_derives_held_from_the_sessions_beyond_the_serving_slots():
    cells = Cells([SERVING, SERVING, SERVING], [4, 4, 4])
    wl = Waterlevel(dispatched=14, started=12, finished=2)  # 10 sessions on 12 slots
    state = cluster_state(7.0, 1, cells, _Books(wl), TrainingFacts(2, 1, 0))
    assert state.held == 0 and state.waterlevel == wl
    assert (state.step_dispatched, state.step_finished, state.step_processed, state.ready) == (8, 3, 2, 1)
    assert (state.undispatched, state.due_outstanding, state.version, state.batch_size) == (10, 5, 1, 8)
    cells.begin_switch(0, TRAINING)  # the core leaves: its 4 slots go, 10 sessions on 8 slots
    state = cluster_state(8.0, 1, cells, _Books(wl), TrainingFacts())
    assert state.roles == [SWITCHING, SERVING, SERVING] and state.targets == [TRAINING, None, None]
    assert state.held == 2
    cells.role[1] = cells.role[2] = TRAINING  # none serves: every session waits
    assert cluster_state(9.0, 1, cells, _Books(wl), TrainingFacts()).held == 10
    assert state_from_dict(json.loads(json.dumps(state_dict(state)))) == state


def test_a_busy_cell_owes_its_switch_until_it_is_free():
    cells = Cells([TRAINING, TRAINING, SERVING], [2, 2, 2], owner="policy elastic")
    cells.busy[1] = True
    assert list(cells.switches_to_begin([SERVING, SERVING, SERVING])) == [(0, SERVING)]
    assert cells.pending_switch == [None, SERVING, None]
    assert cells.take_pending(1) is SERVING and cells.take_pending(1) is None
    cells.busy[1] = True
    list(cells.switches_to_begin([TRAINING, SERVING, SERVING]))
    list(cells.switches_to_begin([TRAINING, TRAINING, SERVING]))  # the policy changed its mind: nothing owed
    assert cells.pending_switch == [None, None, None]
    with pytest.raises(RuntimeError, match="policy elastic returned 2 roles for 3 cells"):
        list(cells.switches_to_begin([SERVING, SERVING]))
    with pytest.raises(RuntimeError, match="cell 2 ended a switch it never began"):
        cells.end_switch(2)
