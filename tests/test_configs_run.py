"""Configs that ``validate`` accepts run: sampled across every policy, loss, KL on/off, behaviour recomputation,
off-policy masks, packing mode, staleness bounds and cell layouts on 8 devices, each trains one RL step end to end (real
proxy, harness subprocesses, the controller, the Grain pipeline, a checkpoint) without crashing.

Sizes are tiny (a 1-layer model, 1 task x 2 executions, short calls); what varies is the wiring.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layouts import EIGHT_DEVICES_OVERRIDES
from timelimits import run_time_limits

from gyre_jax import config as config_lib

RUNS = 5  # configs trained end to end (each compiles its own programs: the suite's CI time)
BASE = {
    **EIGHT_DEVICES_OVERRIDES,  # the cell layouts below are of 8 devices
    "total_steps": 1,
    "warm_start.steps": 0,
    "eval.samples_per_task": 0,
    "metrics.progress_bar": False,
    "metrics.tensorboard": False,
    "rollout.tasks_per_step": 1,
    "rl.group_size": 2,
    "rollout.num_tasks": 2,
    "rollout.max_turns": 2,
    "rollout.max_tokens_per_call": 24,
    "rollout.tool_latency_median_s": 0.01,
    "model.num_layers": 1,
    "model.embed_dim": 64,
    "model.mlp_dim": 128,
    "model.head_dim": 16,
    "serving.max_seq_len": 512,
    # one prefill length (a prompt is one chunk): one prefill program per cell layout to compile, not one per bucket
    # (chunked prefill, bucket choice: tests/serving/ and tests/test_train.py's default-sized runs)
    "serving.max_prefill_length": 512,
    "serving.prefill_buckets": (512,),
    "trajectory.row_length": 512,
    "trajectory.tokens_per_micro_batch": 1024,
}
# (cells, cell mesh) on 8 devices; the training mesh stays data=4 x fsdp=2
LAYOUTS = [
    (1, {"cells.data": 4, "cells.fsdp": 2}),
    (2, {"cells.data": 4}),
    (2, {"cells.data": 2, "cells.fsdp": 2}),
    (4, {"cells.data": 2}),
    (4, {"cells.fsdp": 2, "cells.data": 1}),
]


@st.composite
def overrides(draw) -> dict:
    num_cells, layout = draw(st.sampled_from(LAYOUTS))
    policy = draw(st.sampled_from(["colocated", "async", "elastic"] if num_cells > 1 else ["colocated"]))
    loss = draw(st.sampled_from(["gspo", "gspo_token", "grpo"]))
    recompute = draw(st.booleans())
    dispatch = draw(st.integers(0, 2))
    drop = draw(st.sampled_from([-1, dispatch, dispatch + 1]))
    return {
        "cells.num_cells": num_cells,
        **{k: v for k, v in {"cells.data": 1, "cells.fsdp": 1}.items() if k not in layout},
        **layout,
        "schedule.policy": policy,
        "rl.loss": loss,
        **({"rl.clip_low": 0.2, "rl.clip_high": 0.28} if loss == "grpo" else {}),
        "rl.kl_coef": draw(st.sampled_from([0.0, 0.1])),
        "rl.recompute_behaviour": recompute,
        "rl.behaviour_is_cap": draw(st.sampled_from([0.0, 2.0])) if recompute else 0.0,
        "rl.is_token_mask": draw(st.sampled_from([0.0, 2.0])),
        "rl.is_sequence_mask": draw(st.sampled_from([0.0, 2.0])),
        "trajectory.packing": draw(st.sampled_from(["tree", "plain"])),
        "trajectory.stream_order": draw(st.sampled_from(["task", "arrival"])),
        "schedule.dispatch_staleness": dispatch,
        "rl.drop_staleness": drop,
        "cells.sessions_per_cell": draw(st.sampled_from([0, 1, 2])),
    }


@pytest.mark.slow
@settings(max_examples=RUNS, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(chosen=overrides())
def test_every_accepted_config_trains_a_step(chosen, tmp_path_factory):
    from gyre_jax.train import build_run

    workdir = tmp_path_factory.mktemp("config")
    try:
        base = config_lib.load_config(run_time_limits())  # a loaded machine must not time the 2 executions out
        config = config_lib.config_from_dict(base, {**BASE, **chosen, "workdir": str(workdir)})
    except config_lib.ConfigError as exc:  # only configs validate() accepts are in scope
        pytest.fail(f"the sampler made a config validate() refuses ({exc}); fix the sampler: {chosen}")
    run = build_run(config)
    try:
        assert run.run() == 1, chosen
    finally:
        run.close()
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if m.get("phase") == "train"]
    assert len(train) == 1 and train[0]["executions"] == 2, (chosen, train)
    assert train[0].get("optimizer_skipped") == 1 or math.isfinite(train[0]["loss"]), (chosen, train)
    assert (workdir / "checkpoints" / "1").is_dir(), chosen
    if chosen["rl.kl_coef"] > 0:
        assert (workdir / "reference").is_dir(), chosen  # the reference policy is kept for a resume
