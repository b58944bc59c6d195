"""Admission by duration history in a real run (``schedule.admission=longest_first``): the controller's ledger
dispatches each step's task groups in the order of their tasks' mean harness time so far, longest first, with
``policies.DurationHistory`` (the simulator's policy object). A real run: the serving engines behind the real
proxy, real harness subprocesses, colocated (every step is dispatched after the one before it ended, so the
history of step k holds every execution of steps < k)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_jax import config as config_lib
from gyre_jax.elastic.policies import DurationHistory
from gyre_jax.elastic.timeline import load_timeline

SMALL_MODEL = ["--config.model.num_layers=1", "--config.model.embed_dim=32", "--config.model.mlp_dim=64",
               "--config.model.head_dim=8"]  # fmt: skip
STEPS, TASKS, G = 3, 4, 2


@pytest.mark.slow
def test_a_real_run_dispatches_the_tasks_predicted_longest_first(tmp_path):
    from gyre_jax.train import build_run

    config = config_lib.load_config(
        [
            f"--config.workdir={tmp_path}",
            f"--config.total_steps={STEPS}",
            "--config.warm_start.steps=0",
            "--config.eval.samples_per_task=0",
            "--config.schedule.policy=colocated",
            "--config.schedule.admission=longest_first",
            "--config.metrics.progress_bar=False",
            "--config.metrics.tensorboard=False",
            f"--config.rollout.tasks_per_step={TASKS}",
            f"--config.rollout.num_tasks={TASKS}",  # the same tasks every step: their history predicts
            f"--config.rl.group_size={G}",
            "--config.cells.sessions_per_cell=4",
            "--config.rollout.tool_latency_median_s=0.2",
            "--config.rollout.tool_latency_sigma=1.0",
            "--config.rollout.max_tokens_per_call=32",
            *SMALL_MODEL,
        ]
    )
    trainer = build_run(config)
    try:
        assert trainer.run() == STEPS
        assert (
            trainer.controller.ledger.history is not None and trainer.controller.ledger.history.n == STEPS * TASKS * G
        )
    finally:
        trainer.close()
    results = {
        k: [json.loads(x) for x in (tmp_path / "results" / f"step_{k:06d}.jsonl").read_text().splitlines()]
        for k in range(STEPS)
    }
    tl = load_timeline(next((Path(tmp_path) / "timeline").glob("*.json")))
    task_of = {r["execution_id"]: r["task_id"] for rs in results.values() for r in rs}
    history = DurationHistory()
    for k in range(STEPS):
        started = [task_of[e] for e, span in tl.executions.items() if span.args.get("step") == k]
        assert len(started) == TASKS * G
        groups = list(dict.fromkeys(started))  # task groups in the order their executions took slots
        assert all(started[i * G : (i + 1) * G] == [t] * G for i, t in enumerate(groups))  # a group at once
        task_order = list(dict.fromkeys(r["task_id"] for r in results[k]))  # results are in task order
        if k == 0:
            assert groups == task_order  # no history yet: task order
        else:
            predicted = {t: history.predict(t) for t in task_order}
            assert groups == sorted(task_order, key=lambda t: -predicted[t])  # longest predicted first
        for r in results[k]:
            history.record(r["task_id"], r["duration_s"])
