"""Tests for gyre_jax/elastic/policies.py: colocated, async and elastic decisions over rollout events.

The colocated tests drive the trainer's older ``decide(event, waterlevel, roles)`` call; async and
elastic are driven through ``plan(event, state)`` on random cluster states (hypothesis), checking the
published rules: staleness admission, the waterlevel condition w <= C_R - C_e, one cell leaving at a
time in the fixed order (core first), returns in reverse order with the core last.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.elastic.events import (
    DataReady,
    Finished,
    MicroStepDone,
    Started,
    StepBegan,
    StepTrained,
    Switched,
    Tick,
    event_from_dict,
)
from gyre_jax.elastic.policies import (
    AsyncPolicy,
    ClusterState,
    ColocatedPolicy,
    Decision,
    ElasticPolicy,
    Role,
    Waterlevel,
    admissible,
    make_policy,
)

SERVING, TRAINING, SWITCHING = Role.SERVING, Role.TRAINING, Role.SWITCHING


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
        roles = policy.decide(StepBegan(step, time, executions=n), wl, roles)
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
            # a dispatch is announced by no event of its own: the next decision (here a tick) sees it in the counters
            event = {"dispatched": Tick(step, time), "started": Started(step, time)}.get(kind)
            roles = policy.decide(event or Finished(step, time, execution_id=f"s{step}-e{i}"), wl, roles)
            if finished < n:
                assert roles == [SERVING] * num_cells, (k, kind, wl)  # still executions outstanding
            else:
                assert k == len(order) - 1
                assert roles == [TRAINING] * num_cells  # every execution of the step finished
        assert wl.outstanding == 0
        roles = policy.decide(StepTrained(step, time), wl, roles)
        assert roles == [SERVING] * num_cells


def test_decide_returns_a_new_list_and_ignores_unrelated_events():
    policy = ColocatedPolicy(2)
    roles = [SERVING, SERVING]
    wl = Waterlevel()
    policy.decide(StepBegan(0, 0.0, executions=2), wl, roles)
    wl.dispatched = 2
    out = policy.decide(Started(0, 1.0), wl, roles)
    assert out == roles and out is not roles
    wl.finished = 1
    assert policy.decide(Finished(0, 2.0, execution_id="a"), wl, roles) == [SERVING, SERVING]
    wl.finished = 2
    assert policy.decide(Finished(0, 3.0, execution_id="b"), wl, roles) == [TRAINING, TRAINING]


def test_waterlevel_counters():
    wl = Waterlevel(dispatched=7, started=5, finished=3)
    assert wl.outstanding == 4 and wl.queued == 2 and wl.sessions == 2


def test_make_policy_and_invalid_arguments():
    policy = make_policy("colocated", 3)
    assert isinstance(policy, ColocatedPolicy) and policy.name == "colocated" and policy.num_cells == 3
    a = make_policy("async", 4, training_cells=1, dispatch_staleness=2)
    assert isinstance(a, AsyncPolicy) and a.initial_roles() == [TRAINING, SERVING, SERVING, SERVING]
    assert make_policy("async", 4).training_cells == 2  # default: half the cells train
    e = make_policy("elastic", 4, dispatch_staleness=0)
    assert isinstance(e, ElasticPolicy) and e.initial_roles() == [SERVING] * 4
    with pytest.raises(ValueError, match="unknown scheduling policy 'nope'"):
        make_policy("nope", 2)
    with pytest.raises(ValueError, match="num_cells=0"):
        ColocatedPolicy(0)
    with pytest.raises(ValueError, match="needs >= 2 cells"):
        make_policy("async", 1)
    with pytest.raises(ValueError, match=r"training_cells=4 must be in \[1, 3\]"):
        make_policy("async", 4, training_cells=4)
    with pytest.raises(ValueError, match="unknown async policy options"):
        make_policy("async", 4, leave_on="backlog")
    with pytest.raises(ValueError, match="colocated policy takes no options"):
        make_policy("colocated", 4, dispatch_staleness=1)
    with pytest.raises(ValueError, match="leave_on='sometimes'"):
        make_policy("elastic", 4, leave_on="sometimes")
    with pytest.raises(ValueError, match="dispatch_staleness=-1"):
        make_policy("elastic", 4, dispatch_staleness=-1)
    with pytest.raises(ValueError, match="max_staleness was renamed: use dispatch_staleness"):
        make_policy("elastic", 4, max_staleness=1)
    with pytest.raises(ValueError, match="unknown event kind 'exploded'"):
        event_from_dict({"kind": "exploded", "step": 0, "time": 0.0})


def test_a_policy_refuses_a_state_with_another_number_of_cells():
    with pytest.raises(ValueError, match="elastic policy has 3 cells but the state has 2"):
        ElasticPolicy(3).plan(Tick(0, 0.0), ClusterState(0.0, [SERVING] * 2, [4, 4]))


# -- staleness admission ------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3), st.integers(1, 16), st.integers(0, 6), st.integers(0, 200), st.none() | st.integers(0, 50))
def test_admission_never_lets_an_execution_be_trained_more_than_eta_versions_late(
    eta, n, version, dispatched, undispatched
):
    state = ClusterState(
        0.0, [SERVING], [8], Waterlevel(dispatched=dispatched), version=version, batch_size=n, undispatched=undispatched
    )
    allowed = admissible(state, eta)
    assert allowed >= 0
    if undispatched is not None:
        assert allowed <= undispatched
    if allowed:
        last = dispatched + allowed - 1  # index of the last execution it lets through
        assert last // n - version <= eta  # trained as step last // n, dispatched at version `version`
        if undispatched is None or allowed < undispatched:
            assert (dispatched + allowed) // n - version > eta  # and it lets through all it may


def test_async_keeps_its_split_and_dispatches_ahead_within_the_staleness_bound():
    policy = AsyncPolicy(4, training_cells=1, dispatch_staleness=1)
    state = ClusterState(0.0, policy.initial_roles(), [8] * 4, Waterlevel(), batch_size=10)
    d = policy.plan(Tick(0, 0.0), state)
    assert d.roles == [TRAINING, SERVING, SERVING, SERVING] and d.dispatch == 20  # steps 0 and 1
    state.waterlevel.dispatched = 20
    assert policy.plan(Finished(0, 1.0), state).dispatch == 0
    state.version = 1
    assert policy.plan(StepTrained(0, 2.0), state) == Decision(roles=[TRAINING] + [SERVING] * 3, dispatch=10)


# -- elastic: the waterlevel rules on random states ----------------------------------------------------
@st.composite
def elastic_states(draw):
    k = draw(st.integers(2, 6))
    cap = draw(st.integers(1, 6))
    n = draw(st.integers(1, 3 * cap * k))
    roles, targets, busy = [], [], []
    for _ in range(k):
        r = draw(st.sampled_from([SERVING, TRAINING, SWITCHING]))
        roles.append(r)
        targets.append(draw(st.sampled_from([SERVING, TRAINING])) if r is SWITCHING else None)
        busy.append(r is TRAINING and draw(st.booleans()))
    version = draw(st.integers(0, 3))
    dispatched = draw(st.integers(version * n, (version + 2) * n))
    finished = draw(st.integers(0, dispatched))
    started = draw(st.integers(finished, dispatched))
    due_dispatched = min(dispatched, (version + 1) * n)
    due_finished = min(finished, due_dispatched)
    step_dispatched = max(0, due_dispatched - version * n)
    step_finished = max(0, due_finished - version * n)
    step_processed = draw(st.integers(0, step_finished))
    state = ClusterState(
        time=draw(st.floats(0, 1e4)),
        roles=roles,
        capacity=[cap] * k,
        waterlevel=Waterlevel(dispatched, started, finished),
        targets=targets,
        busy=busy,
        version=version,
        batch_size=n,
        step_dispatched=step_dispatched,
        step_finished=step_finished,
        step_processed=step_processed,
        ready=draw(st.integers(0, 3)),
        in_flight=sum(busy),
        due_outstanding=due_dispatched - due_finished,
        held=draw(st.integers(0, 3)),
    )
    return state, draw(st.integers(0, 2)), draw(st.sampled_from(["waterlevel", "backlog"]))


@settings(max_examples=400, deadline=None)
@given(elastic_states())
def test_elastic_leaves_one_at_a_time_in_order_within_the_waterlevel_and_returns_in_reverse(args):
    state, eta, leave_on = args
    before = copy.deepcopy(state)
    policy = ElasticPolicy(state.num_cells, dispatch_staleness=eta, leave_on=leave_on)
    d = policy.plan(Tick(0, state.time), state)
    assert state == before  # the policy never changes the driver's facts
    k = state.num_cells
    effective = [state.effective_role(c) for c in range(k)]
    assert all(r in (SERVING, TRAINING) for r in d.roles) and len(d.roles) == k
    assert d.dispatch <= admissible(state, eta)
    for c in range(k):  # a switching cell keeps its target
        if state.roles[c] is SWITCHING:
            assert d.roles[c] is state.targets[c]
    leaving = [c for c in range(k) if effective[c] is SERVING and d.roles[c] is TRAINING]
    returning = [c for c in range(k) if effective[c] is TRAINING and d.roles[c] is SERVING]
    assert not (leaving and returning)
    if leaving:
        assert len(leaving) == 1  # one at a time ...
        c = leaving[0]
        assert c == min(i for i in range(k) if effective[i] is SERVING)  # ... in the fixed order, core first
        assert not any(state.roles[i] is SWITCHING and state.targets[i] is TRAINING for i in range(k))
        w = state.waterlevel.outstanding + d.dispatch
        serving = sum(state.capacity[i] for i in range(k) if effective[i] is SERVING)
        assert w <= serving - state.capacity[c]  # the published condition w <= C_R - C_e
    if returning:
        assert all(state.roles[c] is TRAINING for c in returning)  # a switching cell finishes its switch first
        kept = [i for i in range(k) if effective[i] is TRAINING and i not in returning]
        if 0 in returning:
            assert kept == []  # the core returns last
        due_new = min(
            admissible(state, eta), max(0, (state.version + 1) * state.batch_size - state.waterlevel.dispatched)
        )
        serving = sum(state.capacity[i] for i in range(k) if effective[i] is SERVING)
        due_case = state.due_outstanding + due_new > serving
        for c in returning:  # reverse order: a cell stays only if it is switching, or busy when ahead work waits
            for i in kept:
                if i > c:
                    assert state.roles[i] is SWITCHING or (not due_case and state.is_busy(i)), (c, i)


def test_elastic_core_leaves_first_when_the_waterlevel_falls_and_cells_return_when_a_batch_needs_them():
    policy = ElasticPolicy(4, dispatch_staleness=0)
    state = ClusterState(0.0, [SERVING] * 4, [2] * 4, Waterlevel(), targets=[None] * 4, busy=[False] * 4, batch_size=8)
    d = policy.plan(Tick(0, 0.0), state)
    assert d == Decision(roles=[SERVING] * 4, dispatch=8)  # the step's 8 executions fill the 4 x 2 slots
    state.waterlevel = Waterlevel(8, 8, 0)
    state.step_dispatched = state.due_outstanding = 8
    assert policy.plan(Started(0, 1.0), state).roles == [SERVING] * 4  # w = 8 > C_R - C_e = 6
    state.waterlevel.finished = 2
    state.step_finished, state.due_outstanding = 2, 6
    d = policy.plan(Finished(0, 2.0), state)
    assert d.roles == [TRAINING, SERVING, SERVING, SERVING]  # w = 6 <= 8 - 2: the core leaves first
    state.roles[0], state.targets[0] = SWITCHING, TRAINING
    state.waterlevel.finished = 6
    state.step_finished, state.due_outstanding = 6, 2
    assert policy.plan(Finished(0, 3.0), state).roles == [TRAINING, SERVING, SERVING, SERVING]  # one at a time
    state.roles[0], state.targets[0] = TRAINING, None
    d = policy.plan(Switched(0, 4.0, cell=0), state)
    assert d.roles == [TRAINING, TRAINING, SERVING, SERVING]  # then satellite 1
    state.roles = [TRAINING, TRAINING, TRAINING, SERVING]
    state.waterlevel.finished = 8
    state.step_finished = state.step_processed = 8
    state.due_outstanding = 0
    state.version = 1  # the step was trained: the next batch needs every slot
    state.step_dispatched = state.step_finished = state.step_processed = 0
    d = policy.plan(StepTrained(0, 5.0), state)
    assert d.dispatch == 8 and d.roles == [SERVING] * 4  # 8 executions need all 4 cells: every cell returns


def test_elastic_keeps_the_core_training_while_its_step_has_work():
    policy = ElasticPolicy(2, dispatch_staleness=0)
    state = ClusterState(
        0.0,
        [TRAINING, SERVING],
        [1, 1],
        Waterlevel(2, 2, 0),
        targets=[None, None],
        busy=[True, False],
        batch_size=4,
        step_dispatched=2,
        in_flight=1,
        due_outstanding=2,
    )
    # two due executions waiting for one free slot; the core is computing a micro-step: it stays
    state.waterlevel = Waterlevel(4, 1, 0)
    state.step_dispatched, state.due_outstanding = 4, 4
    assert policy.plan(Tick(0, 0.0), state).roles == [TRAINING, SERVING]
    state.busy, state.in_flight = [False, False], 0  # nothing to train now: the core goes back to serve them
    assert policy.plan(MicroStepDone(0, 1.0, cell=0), state).roles == [SERVING, SERVING]


def test_same_events_and_states_give_the_same_decisions():
    """A policy's decisions depend only on what it is given (the controller/simulator invariant)."""
    script = []
    for t in range(60):
        roles = [SERVING if (t + c) % 3 else TRAINING for c in range(4)]
        state = ClusterState(
            float(t),
            roles,
            [3] * 4,
            Waterlevel(4 + t // 2, 3 + t // 3, t // 4),
            targets=[None] * 4,
            busy=[bool((t * c) % 2) for c in range(4)],
            version=t // 20,
            batch_size=6,
            step_dispatched=6,
            step_finished=min(6, t % 7),
            step_processed=min(6, t % 5),
            ready=t % 3,
            due_outstanding=max(0, 6 - t % 7),
        )
        script.append(
            (
                [Finished, MicroStepDone, Switched, DataReady][t % 4](
                    t // 20, float(t), **({"cell": t % 4} if t % 4 in (1, 2) else {})
                ),
                state,
            )
        )
    for make in (
        lambda: ElasticPolicy(4, idle_before_return_s=5.0),
        lambda: AsyncPolicy(4, 1),
        lambda: ColocatedPolicy(4),
    ):
        a, b = make(), make()
        assert [a.plan(e, s) for e, s in script] == [b.plan(e, copy.deepcopy(s)) for e, s in script]
