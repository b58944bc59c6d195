"""Tests for gyre_jax/sim/workload.py and trajectory_cost.py: segment plans keep every call's time and
tokens, compaction keeps the context inside its window, replays match the records they come from, and
the J_max cap keeps the branches the trajectory processor would keep."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.proxy.records import TitoRecord
from gyre_jax.sim.config import cost_model, preset, workload
from gyre_jax.sim.trajectory_cost import TrajectoryShape, branches, capped_flops, capped_tokens
from gyre_jax.sim.workload import Dist, WorkloadSpec, build_plan, recorded_execution, replay_plan, sample_step

SERVING = cost_model(preset("tiny")).serving
TRAINING = cost_model(preset("tiny")).training


def _spec(window=0, summary=0, initial=500):
    return WorkloadSpec(
        name="t",
        turns=Dist(5, 0.5, 1, 30),
        task_sigma=0.3,
        gen_tokens=Dist(100, 0.5),
        obs_tokens=Dist(300, 1.0),
        initial_context=initial,
        tool_s=Dist(2.0, 1.0),
        setup_s=Dist(10.0),
        eval_s=Dist(5.0),
        timeout_s=600.0,
        context_window=window,
        summary_tokens=summary,
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 25), min_size=1, max_size=6),
    st.integers(1, 10),
    st.sampled_from([0, 3000]),
    st.integers(0, 2**31 - 1),
)
def test_segments_keep_every_calls_time_and_tokens(turns, segments, window, seed):
    rng = np.random.default_rng(seed)
    turns = np.array(turns)
    calls = int(turns.sum())
    obs, gen, tool = rng.uniform(10, 900, calls), rng.uniform(5, 300, calls), rng.uniform(0, 20, calls)
    setup, ev = rng.uniform(0, 30, len(turns)), rng.uniform(0, 9, len(turns))
    spec = _spec(window=window, summary=400 if window else 0)
    p = build_plan(turns, obs, gen, tool, setup, ev, spec, SERVING, segments)
    assert p.count == np.minimum(turns, segments).tolist()
    assert sum(p.tool_s) == pytest.approx(tool.sum() + setup.sum())
    compactions = p.compactions.sum()
    assert sum(p.gen) == pytest.approx(gen.sum() + compactions * spec.summary_tokens)
    assert p.tokens == pytest.approx(spec.initial_context + np.add.reduceat(obs + gen, np.r_[0, np.cumsum(turns)[:-1]]))
    for j in range(len(turns)):
        ends = p.tokens_end[p.offset[j] : p.offset[j] + p.count[j]]
        assert ends == sorted(ends) and ends[-1] == pytest.approx(p.tokens[j])
        ctx = p.ctx[p.offset[j] : p.offset[j] + p.count[j]]
        if window:  # the context a call decodes on stays within the window plus that call's own tokens
            assert max(ctx) <= window + obs.max() + gen.max()
    if window == 0:
        assert compactions == 0


def test_sampling_is_seeded_per_step_and_respects_the_turn_limits():
    spec = workload(preset("deepswe"))
    a = sample_step(spec, SERVING, step=3, tasks=8, group_size=4, seed=7, segments=8)
    b = sample_step(spec, SERVING, step=3, tasks=8, group_size=4, seed=7, segments=8)
    c = sample_step(spec, SERVING, step=4, tasks=8, group_size=4, seed=7, segments=8)
    assert a.tool_s == b.tool_s and a.tool_s != c.tool_s
    assert a.turns.min() >= 8 and a.turns.max() <= 100
    assert a.size == 32


def test_replay_of_recorded_calls():
    def rec(i, prompt, reused, completion, t0, t1, thread="main"):
        return TitoRecord(
            execution_id="x",
            call_index=i,
            thread_id=thread,
            request_id=str(i),
            prompt_ids=list(range(prompt)),
            completion_ids=[1] * completion,
            completion_logprobs=[0.0] * completion,
            policy_versions=[0] * completion,
            finish_reason="stop",
            temperature=1.0,
            reused_prefix_len=reused,
            t_start=t0,
            t_end=t1,
        )

    records = [rec(1, 150, 120, 20, 12.0, 13.0), rec(0, 100, 0, 20, 10.0, 11.0), rec(2, 200, 170, 5, 20.0, 20.5)]
    x = recorded_execution(records, eval_s=3.0)
    assert x.obs == [100.0, 30.0, 30.0] and x.gen == [20.0, 20.0, 5.0] and x.tool_s == [1.0, 7.0, 0.0]
    plan = replay_plan([x, x], _spec(), SERVING, segments=2)
    assert plan.size == 2 and plan.count == [2, 2] and plan.eval_s == [3.0, 3.0]
    assert sum(plan.tool_s) == pytest.approx(16.0) and sum(plan.gen) == pytest.approx(90.0)
    with pytest.raises(ValueError, match="at least one record"):
        recorded_execution([])


def test_bad_workload_values_are_refused():
    with pytest.raises(ValueError, match="timeout_s=0"):
        WorkloadSpec(**{**_spec().__dict__, "timeout_s": 0.0})
    with pytest.raises(ValueError, match="context_window=900 must exceed"):
        _spec(window=900, summary=400, initial=500)
    with pytest.raises(ValueError, match="bad distribution"):
        Dist(-1.0)


# -- trajectory cost --------------------------------------------------------------------------------
SHAPE = TrajectoryShape(
    context_window=10_000, summary_tokens=1_000, initial_context=2_000, subagent_fraction=0.3, subagent_tokens=3_000
)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(2_000, 200_000), min_size=1, max_size=8))
def test_branches_cover_the_tokens_and_the_cap_keeps_the_priority_order(tokens):
    t = np.array(tokens)
    b = branches(t, SHAPE)
    # every token is in one branch; each main-summary branch repeats the initial context and a summary
    repeated = (b.summary_full + (b.summary_last > 0)) * (SHAPE.initial_context + SHAPE.summary_tokens)
    assert capped_tokens(b, None) == pytest.approx(t + repeated)
    assert (b.main <= SHAPE.context_window + 1e-9).all() and b.summary_len == SHAPE.context_window
    flops = [capped_flops(b, cap, TRAINING) for cap in (1, 2, 3, 5, 8, None)]
    for lo, hi in zip(flops, flops[1:]):
        assert (lo <= hi + 1e-3).all()  # more branches never cost less
    assert capped_flops(b, 1, TRAINING) == pytest.approx(TRAINING.branch_flops(b.main))  # J_max = 1: the main branch
    kept = np.minimum(b.count, 5)
    assert (capped_tokens(b, 5) <= capped_tokens(b, None) + 1e-6).all()
    assert ((kept == b.count) == np.isclose(capped_flops(b, 5, TRAINING), flops[-1])).all()


def test_without_compaction_or_subagents_there_is_one_branch():
    b = branches(np.array([5_000.0, 50_000.0]), TrajectoryShape(context_window=0))
    assert b.count.tolist() == [1, 1] and b.main.tolist() == [5_000.0, 50_000.0]
    with pytest.raises(ValueError, match="cap=0 must be >= 1"):
        capped_flops(b, 0, TRAINING)
