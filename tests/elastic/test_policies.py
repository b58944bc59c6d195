"""Tests for gyre_jax/elastic/policies.py: the colocated policy's roles over rollout events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.elastic.policies import ColocatedPolicy, Event, Role, Waterlevel, make_policy

SERVING, TRAINING = Role.SERVING, Role.TRAINING


@st.composite
def steps(draw):
    """A few RL steps: per step its execution count, whether dispatch is one bulk update before any event
    (as the trainer does) or one event per execution, and an interleaving of the executions' events."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 6))
        bulk = draw(st.booleans())
        pending = {i: (["started", "finished"] if bulk else ["dispatched", "started", "finished"]) for i in range(n)}
        order = []
        while pending:
            i = draw(st.sampled_from(sorted(pending)))
            order.append((i, pending[i].pop(0)))
            if not pending[i]:
                del pending[i]
        out.append((n, bulk, order))
    return out


@settings(max_examples=100, deadline=None)
@given(steps(), st.integers(1, 4))
def test_colocated_serves_while_executions_are_outstanding_then_all_cells_train(schedule, num_cells):
    policy = ColocatedPolicy(num_cells)
    roles = policy.initial_roles()
    assert roles == [SERVING] * num_cells
    wl = Waterlevel()
    time = 0.0
    for step, (n, bulk, order) in enumerate(schedule):
        roles = policy.decide(Event("step_began", step, time, executions_in_step=n), wl, roles)
        assert roles == [SERVING] * num_cells
        if bulk:
            wl.dispatched += n
        finished = 0
        for k, (i, kind) in enumerate(order):
            time += 1.0
            if kind == "dispatched":
                wl.dispatched += 1
            elif kind == "started":
                wl.started += 1
            else:
                wl.finished += 1
                finished += 1
            assert wl.outstanding >= 0
            roles = policy.decide(Event(kind, step, time, execution_id=f"s{step}-e{i}"), wl, roles)
            if finished < n:
                assert roles == [SERVING] * num_cells, (k, kind, wl)  # still executions outstanding
            else:
                assert k == len(order) - 1
                assert roles == [TRAINING] * num_cells  # every execution of the step finished
        assert wl.outstanding == 0
        roles = policy.decide(Event("step_trained", step, time), wl, roles)
        assert roles == [SERVING] * num_cells


def test_decide_returns_a_new_list_and_ignores_unrelated_events():
    policy = ColocatedPolicy(2)
    roles = [SERVING, SERVING]
    wl = Waterlevel()
    policy.decide(Event("step_began", 0, 0.0, executions_in_step=2), wl, roles)
    wl.dispatched = 2
    out = policy.decide(Event("started", 0, 1.0, execution_id="a"), wl, roles)
    assert out == roles and out is not roles
    wl.finished = 1
    assert policy.decide(Event("finished", 0, 2.0, execution_id="a"), wl, roles) == [SERVING, SERVING]
    wl.finished = 2
    assert policy.decide(Event("finished", 0, 3.0, execution_id="b"), wl, roles) == [TRAINING, TRAINING]


def test_waterlevel_outstanding_is_dispatched_minus_finished():
    wl = Waterlevel(dispatched=7, started=5, finished=3)
    assert wl.outstanding == 4


def test_make_policy_and_invalid_arguments():
    policy = make_policy("colocated", 3)
    assert isinstance(policy, ColocatedPolicy) and policy.name == "colocated" and policy.num_cells == 3
    for name in ("async", "elastic", "nope"):
        with pytest.raises(ValueError, match="not supported yet"):
            make_policy(name, 2)
    with pytest.raises(ValueError, match="num_cells=0"):
        ColocatedPolicy(0)
