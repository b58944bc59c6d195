"""The elastic controller's invariants, on a real run: 8 virtual CPU devices in 2 cells of 4, the real
serving engines behind the real proxy, real harness subprocesses with long-tailed tool times, the Grain
trajectory pipeline and orbax checkpoints.

One elastic run of 3 steps (module fixture) with serving capacity for exactly one step's executions, so
the core leaves serving while sessions are still running there (they move, KV and requests in flight,
to the other cell) and a satellite trains too. Then:

- the same micro-step contents give the same parameters whichever cells computed them (the step is
  recomputed from the saved pipeline state on the core alone and compared with the checkpoint);
- no execution is lost or counted twice across switches;
- no harness sees an error while its cell switches;
- on the same event sequence, the policy decides the same inside the controller as when driven alone;
- on the same event sequence, the simulator's books give the same ``ClusterState`` at every decision
  (``sim.replay``) and a fresh policy object the same decisions: the policy behaves the same in the
  simulator and in the real run.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from layouts import EIGHT_DEVICES
from timelimits import run_time_limits

from gyre_jax import config as config_lib
from gyre_jax.elastic.events import event_from_dict
from gyre_jax.elastic.policies import Role, make_policy
from gyre_jax.elastic.state import state_from_dict
from gyre_jax.elastic.timeline import load_timeline
from gyre_jax.sim.replay import read_decisions, replay
from gyre_jax.trajectory.pipeline import TrajectoryPipeline

STEPS = 3
N = 16  # 2 tasks x G=8
# what these tests check is the controller's wiring, not what the model learns: the smallest model compiles and runs fastest
SMALL_MODEL = ["--config.model.num_layers=1", "--config.model.embed_dim=32", "--config.model.mlp_dim=64",
               "--config.model.head_dim=8"]  # fmt: skip


def _config(workdir: Path, policy: str = "elastic"):
    return config_lib.load_config(
        [
            f"--config.workdir={workdir}",
            f"--config.total_steps={STEPS}",
            "--config.warm_start.steps=0",
            "--config.eval.samples_per_task=0",
            f"--config.schedule.policy={policy}",
            "--config.metrics.progress_bar=False",
            "--config.metrics.tensorboard=False",
            "--config.checkpoint_every=1",
            "--config.keep_checkpoints=4",
            *EIGHT_DEVICES,  # 2 cells of 4 devices: sessions and their KV move between multi-device cells
            "--config.rollout.tasks_per_step=2",  # N: 2 tasks x G=8 (the default is 4 x 8)
            "--config.rollout.num_tasks=16",
            "--config.cells.sessions_per_cell=8",  # two cells hold exactly one step: the core leaves with sessions on it
            "--config.rollout.tool_latency_median_s=0.2",
            "--config.rollout.tool_latency_sigma=1.0",
            "--config.rollout.max_tokens_per_call=48",
            "--config.trajectory.tokens_per_micro_batch=1024",
            *SMALL_MODEL,
            *run_time_limits(),  # a loaded machine must not time harnesses out: the steps need their executions
        ]
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from gyre_jax.train import build_run

    workdir = tmp_path_factory.mktemp("elastic")
    config = _config(workdir)
    trainer = build_run(config)
    try:
        assert trainer.run() == STEPS
        retries = trainer.controller.router.retries
        learner = trainer.controller.training.learner
        trajectory_cfg = trainer.controller.ledger.pipeline.config
        checkpointer = trainer.rundir.checkpointer
        abstract = learner.abstract_state()
        checkpoints = {k: checkpointer.restore(k, abstract) for k in range(STEPS + 1)}
    finally:
        trainer.close()
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return dict(
        workdir=workdir,
        config=config,
        retries=retries,
        learner=learner,
        trajectory_cfg=trajectory_cfg,
        checkpoints=checkpoints,
        metrics=[m for m in metrics if m.get("phase") == "train"],
    )


@pytest.mark.slow
def test_the_core_left_serving_with_sessions_on_it_and_a_satellite_trained(run):
    tl = load_timeline(next((run["workdir"] / "timeline").glob("*.json")))
    assert [c for c in tl.cells] == ["cell0", "cell1"]
    for cell in (0, 1):
        names = [s.name for s in tl.roles[cell]]
        assert "training" in names and "switching" in names, names
    # cell 0 (the core) left first: its first training span starts before cell 1's
    first_training = [min(s.start for s in tl.roles[c] if s.name == "training") for c in (0, 1)]
    assert first_training[0] < first_training[1]
    # the core left while executions of the step were still running (sessions moved to cell 1)
    executions = [s for s in tl.executions.values()]
    assert any(s.start < first_training[0] < s.end for s in executions)
    per_cell = {c: sum(m[f"micro_steps/cell{c}"] for m in run["metrics"]) for c in (0, 1)}
    assert per_cell[0] > 0 and per_cell[1] > 0, per_cell
    for m in run["metrics"]:
        assert 0.0 <= m["idle_fraction/cell0"] <= 1.0 and 0.0 <= m["idle_fraction/cell1"] <= 1.0
        assert m["switch_s"] >= 0.0


def test_same_micro_step_contents_give_the_same_params_whichever_cells_computed_them(run):
    """Each step is recomputed from the checkpointed pipeline state on the core alone, in one call."""
    learner, ckpts = run["learner"], run["checkpoints"]
    for k in range(STEPS):
        state_k, meta_k = ckpts[k]
        pipeline = TrajectoryPipeline(
            run["workdir"] / "records",
            run["workdir"] / "trajectory",
            run["trajectory_cfg"],
            state=meta_k["pipeline"],
            discard_unsaved=False,
        )
        batches = pipeline.next_step()
        assert batches.step == k
        assert len(batches.micro_batches) == run["metrics"][k]["micro_batches"]
        state = jax.tree.map(lambda x: x.copy(), state_k)
        recomputed, _ = learner.step(state, batches.micro_batches)
        expected, _ = ckpts[k + 1]
        got = jax.tree.leaves(jax.device_get(recomputed.params))
        want = jax.tree.leaves(jax.device_get(expected.params))
        assert int(recomputed.step) == int(expected.step) == k + 1
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


def test_no_execution_is_lost_or_counted_twice(run):
    workdir = run["workdir"]
    queued = [json.loads(line) for line in (workdir / "trajectory" / "queue.jsonl").read_text().splitlines()]
    ids = [q["execution_id"] for q in queued]
    assert len(ids) == len(set(ids)) == STEPS * N
    for k in range(STEPS):
        results = [json.loads(line) for line in (workdir / "results" / f"step_{k:06d}.jsonl").read_text().splitlines()]
        step_ids = [r["execution_id"] for r in results]
        assert len(step_ids) == len(set(step_ids)) == N
        assert sorted(step_ids) == sorted(q["execution_id"] for q in queued if q["step"] == k)
        assert sum(q["last_in_step"] for q in queued if q["step"] == k) == 1
    # every record file belongs to a queued execution, and every queued execution has its records
    recorded = {p.stem for p in (workdir / "records").glob("*.jsonl")}
    assert recorded == set(ids)
    decisions = [json.loads(line) for line in (workdir / "decisions.jsonl").read_text().splitlines()]
    last = decisions[-1]["state"]["waterlevel"]
    assert last["dispatched"] == last["started"] == last["finished"] == STEPS * N


def test_no_harness_sees_an_error_while_its_cell_switches(run):
    workdir = run["workdir"]
    for k in range(STEPS):
        for line in (workdir / "results" / f"step_{k:06d}.jsonl").read_text().splitlines():
            r = json.loads(line)
            assert r["status"] == "finished", r
            assert r["returncode"] == 0, r
            assert not r["excluded"], r
    for stderr in (workdir / "executions").glob("*/harness.stderr"):
        text = stderr.read_text()
        assert "Error" not in text and "Traceback" not in text, (stderr, text[-500:])
    for m in run["metrics"]:
        assert m["crashed"] == 0 and m["timeouts"] == 0


def test_the_policy_decides_the_same_alone_on_the_same_event_sequence(run):
    config = run["config"]
    policy = make_policy(config.schedule.policy, config.cells.num_cells, **config_lib.policy_options(config))
    lines = [json.loads(line) for line in (run["workdir"] / "decisions.jsonl").read_text().splitlines()]
    assert len(lines) > 10
    left = 0
    for line in lines:
        event = event_from_dict(line["event"])
        state = state_from_dict(line["state"])
        decision = policy.plan(event, state)
        assert [r.value for r in decision.roles] == line["roles"], line
        assert decision.dispatch == line["dispatch"], line
        left += any(r is Role.TRAINING and s is Role.SERVING for r, s in zip(decision.roles, state.roles))
    assert left > 0  # the sequence holds real decisions: cells left serving


def test_the_simulator_builds_the_same_states_and_the_policy_decides_the_same_on_the_real_runs_events(run):
    config = run["config"]
    lines = read_decisions(run["workdir"] / "decisions.jsonl")

    def policy():
        return make_policy(config.schedule.policy, config.cells.num_cells, **config_lib.policy_options(config))

    shape = dict(steps=STEPS, batch_size=N, slots=config.cells.sessions_per_cell)
    assert replay(lines, policy(), **shape) == []
    # the sequence holds what the states must agree on: switches with sessions running, every kind of event the
    # controller sends, and decisions that moved cells and dispatched every execution
    states = [line["state"] for line in lines]
    switching = [i for i, s in enumerate(states) if "switching" in s["roles"] and s["waterlevel"]["started"] > 0]
    assert switching
    assert {line["event"]["kind"] for line in lines} >= {"step_began", "started", "finished", "micro_step_done",
                                                         "switched", "step_trained"}  # fmt: skip
    assert sum(line["dispatch"] for line in lines) == STEPS * N
    # a state built another way is caught, field by field: here held (sessions waiting for a slot; this run's
    # waterlevel rule never leaves more sessions than the cells that stay can hold, so the books say 0)
    broken = [dict(line, state=dict(line["state"], held=1)) if i in switching else line for i, line in enumerate(lines)]
    found = replay(broken, policy(), **shape)
    assert [d.line for d in found if d.fields.get("held") == (1, 0)] == switching


def test_segments_between_evaluations_start_from_a_clean_state(tmp_path):
    """With an evaluation after every step the controller runs one segment per step: each starts with every
    cell serving and none of the previous segment's events, and the evaluations run on serving cells."""
    from gyre_jax.train import build_run

    config = config_lib.load_config(
        [
            f"--config.workdir={tmp_path}",
            "--config.total_steps=2",
            "--config.warm_start.steps=0",
            "--config.schedule.policy=elastic",
            "--config.metrics.progress_bar=False",
            "--config.metrics.tensorboard=False",
            "--config.rollout.tasks_per_step=1",
            "--config.rl.group_size=4",
            "--config.rollout.num_tasks=2",
            "--config.eval.samples_per_task=1",
            "--config.eval.num_tasks=1",
            "--config.eval.every_steps=1",
            "--config.cells.sessions_per_cell=2",
            "--config.rollout.max_tokens_per_call=32",
            *SMALL_MODEL,
            *run_time_limits(),
        ]
    )
    trainer = build_run(config)
    try:
        assert trainer.run() == 2
        assert all(r is Role.SERVING for r in trainer.controller.cells.role)
        assert trainer.controller.driver.idle
    finally:
        trainer.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if m.get("phase") == "train"] == [0, 1]
    evals = [m for m in lines if m.get("phase") == "eval"]
    assert [(m["step"], m["eval_split"]) for m in evals] == [(s, p) for s in (0, 1, 2) for p in ("train", "heldout")]
    for m in evals:  # the 2 training tasks and 1 held-out task, 1 sample each
        assert m["eval_executions"] == (2 if m["eval_split"] == "train" else 1) and m["eval_excluded"] == 0
    policy = make_policy("elastic", 2, **config_lib.policy_options(config))
    for line in (tmp_path / "decisions.jsonl").read_text().splitlines():
        d = json.loads(line)
        state = d["state"]  # the waterlevel counts the whole run: a segment starts with steps before it finished
        if d["event"]["kind"] == "step_began" and state["waterlevel"]["dispatched"] == state["version"] * 4:
            assert all(r == "serving" for r in d["state"]["roles"])
        decision = policy.plan(event_from_dict(d["event"]), state_from_dict(d["state"]))
        assert [r.value for r in decision.roles] == d["roles"] and decision.dispatch == d["dispatch"]


def test_a_segment_after_an_evaluation_or_a_resume_dispatches_only_its_own_steps(tmp_path):
    """Colocated (eta = 0) trains only on-policy data: no step's executions are dispatched before the step
    before it has trained, in the first segment, in a segment that starts after a mid-run evaluation, and in
    one that starts from a resumed checkpoint. (Counters restarted at 0 in each segment once let a segment
    starting at step s dispatch s + 1 steps' executions at once, so its later steps trained on stale data.)"""
    from gyre_jax.train import build_run

    n = 4  # 1 task x G=4

    def run_to(total_steps: int) -> int:
        config = config_lib.load_config(
            [
                f"--config.workdir={tmp_path}",
                f"--config.total_steps={total_steps}",
                "--config.warm_start.steps=0",
                "--config.schedule.policy=colocated",
                "--config.metrics.progress_bar=False",
                "--config.metrics.tensorboard=False",
                "--config.checkpoint_every=1",
                "--config.rollout.tasks_per_step=1",
                "--config.rl.group_size=4",
                "--config.rollout.num_tasks=2",
                "--config.eval.samples_per_task=1",
                "--config.eval.num_tasks=1",
                "--config.eval.every_steps=2",  # segments [0, 2), [2, 4); then the resumed run's [4, 6)
                "--config.rollout.max_tokens_per_call=32",
                *SMALL_MODEL,
                *run_time_limits(),
            ]
        )
        trainer = build_run(config)
        try:
            return trainer.run()
        finally:
            trainer.close()

    assert run_to(4) == 4
    assert run_to(6) == 6  # resumes from step 4's checkpoint
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["next_step"] for m in lines if m.get("phase") == "resume"] == [4]
    train = [m for m in lines if m.get("phase") == "train"]
    assert [m["step"] for m in train] == list(range(6))
    assert [m["staleness_max"] for m in train] == [0] * 6  # every step trained on its own policy's rollouts
    decisions = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert decisions
    for d in decisions:  # counted over the whole run: never more than step ``version``'s executions dispatched
        state = d["state"]
        assert state["waterlevel"]["dispatched"] + d["dispatch"] <= (state["version"] + 1) * n, d
