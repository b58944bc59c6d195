"""Tests for calibrating against a run directory in the real controller's format (gyre_jax/sim/calibrate.py:
run_sim_config, execution_timing, warm_measurements, calibrate): config.json as the trainer writes it,
records/, results/step_<k>.jsonl, timeline/step000000.json, metrics.jsonl and cost_measurements.json.

The synthetic run's executions spend known time before their first call (harness start-up), after their
last (teardown) and in evaluation; its step times come from a ground-truth cost model the calibration
does not see, and its measurements carry warm-up compiles that must be left out."""

from __future__ import annotations

import json

import numpy as np
import pytest
from layouts import EIGHT_DEVICES

from gyre_jax.config import load_config
from gyre_jax.elastic.policies import Role
from gyre_jax.elastic.timeline import TimelineWriter
from gyre_jax.proxy.records import RecordStore, TitoRecord
from gyre_jax.sim.calibrate import (
    MEASUREMENTS_FILE,
    calibrate,
    execution_spans,
    execution_timing,
    predict,
    recorded_steps,
    run_sim_config,
    step_times,
    warm_measurements,
)

STEPS, T0 = 4, 1.8e9


def _write_config(run, *overrides: str) -> None:
    config = load_config(list(overrides))
    (run / "config.json").write_text(json.dumps(config.to_dict(), indent=2, default=str))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    _write_config(
        run,
        "--config.rollout.tasks_per_step=2",
        "--config.rl.group_size=4",
        f"--config.total_steps={STEPS}",
        "--config.cells.sessions_per_cell=4",
        "--config.schedule.policy=colocated",
    )
    cfg = run_sim_config(run)
    cell = cfg.cell_accelerators
    rate = 5.5e9 / 2.0  # a full micro-step of ~5.5 GFLOP takes 2 s on a cell
    truth = cfg.cost.replace(
        serving={
            "decode_base_s": 0.012,
            "decode_per_seq_s": 0.001,
            "decode_per_context_token_s": 2e-7,
            "prefill_base_s": 0.03,
            "prefill_per_token_s": 3e-4,
        },
        training={"accelerator_flops": rate / cell, "micro_step_overhead_s": 0.0, "optimizer_step_s": 0.01},
        switch={"serving_to_training_s": 0.5, "training_to_serving_s": 0.3, "weight_sync_s": 0.0},
    )
    rng = np.random.default_rng(1)
    store = RecordStore(run / "records")
    (run / "results").mkdir()
    tl = TimelineWriter(run / "timeline" / "step000000.json", ["cell0", "cell1"], source="controller", t0=T0)
    timing = {}
    for k in range(STEPS):
        lines = []
        base = T0 + 100.0 * k
        for j in range(cfg.batch_size):
            eid = f"s{k:06d}-t{j // 4}-g{j % 4:02d}"
            setup, teardown, ev = rng.uniform(3, 6), rng.uniform(0.5, 2), rng.uniform(0, 0.5)
            start = base + rng.uniform(0, 0.05)
            t, prompt = start + setup, 0
            first = t
            for c in range(int(rng.integers(2, 5))):
                new, gen = int(rng.integers(30, 300)), int(rng.integers(10, 120))
                dur = 0.03 + 3e-4 * new + 0.02 * gen
                store.append(
                    TitoRecord(
                        execution_id=eid,
                        call_index=c,
                        thread_id="main",
                        request_id=f"{eid}-{c}",
                        prompt_ids=[1] * (prompt + new),
                        completion_ids=[2] * gen,
                        completion_logprobs=[-1.0] * gen,
                        policy_versions=[k] * gen,
                        finish_reason="stop",
                        temperature=1.0,
                        reused_prefix_len=prompt,
                        t_start=t,
                        t_end=t + dur,
                    )
                )
                prompt += new + gen
                last = t + dur
                t = last + float(rng.exponential(0.8))
            end = last + teardown + ev
            timing[eid] = (setup, teardown, ev, first, last)
            tl.execution_started(start, eid, step=k)
            tl.execution_ended(end, eid, "finished", step=k)
            lines.append(
                json.dumps(
                    {
                        "execution_id": eid,
                        "task_id": eid[:-4],
                        "group_id": eid[:-4],
                        "status": "finished",
                        "reward": 1.0,
                        "excluded": False,
                        "duration_s": setup + (last - first) + teardown,
                    }
                )
            )
        (run / "results" / f"step_{k:06d}.jsonl").write_text("\n".join(lines) + "\n")
        t_train = base + 60.0
        for c in range(2):  # both cells switch to training; step 0's first switch includes a compile
            tl.role(t_train, c, Role.SWITCHING, reason="finished", to=Role.TRAINING)
            tl.role(t_train + (5.0 if k == 0 else 0.5), c, Role.TRAINING, reason="switched")
        micro = []
        for m in range(4):  # 5.4-5.7 GFLOP each (one packed shape); step 0's first one compiles (30 s)
            flops = float(rng.uniform(5.4e9, 5.7e9))
            dur = 30.0 if (k == 0 and m == 0) else flops / rate
            tl.micro_step(t_train + 6 + 3 * m, t_train + 6 + 3 * m + dur, m % 2, k, slot=m, work=flops)
            micro.append([flops, dur])
        tl.optimizer_step(t_train + 20, t_train + 20.01, 0, k, k + 1)
        for c in range(2):
            tl.role(t_train + 20.02, c, Role.SWITCHING, reason="step_trained", to=Role.SERVING)
            tl.role(t_train + 20.32, c, Role.SERVING, reason="switched")
        timing.setdefault("micro", []).extend(micro)
    tl.close(T0 + 100.0 * STEPS)

    executions = recorded_steps(run, STEPS)
    measured = np.array(step_times(predict(cfg.replace(cost=truth), executions)))
    measured *= 1 + 0.03 * rng.standard_normal(len(measured))  # timing noise of a real machine
    metrics = [{"step": -1, "phase": "warm_start"}, {"step": 0, "phase": "eval", "eval_s": 9.0}]
    metrics += [{"step": k, "phase": "train", "step_s": float(s)} for k, s in enumerate(measured)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    sv = truth.serving
    batch, ctx = rng.integers(1, 5, 200), rng.uniform(0, 4000, 200)
    decode = [[int(b), float(x), sv.decode_step_s(b, x)] for b, x in zip(batch, ctx)] + [[1, 300.0, 6.0]]  # compile
    q, c = rng.uniform(20, 300, 60), rng.uniform(0, 3000, 60)
    prefills = [[float(a), float(b), float(sv.prefill_s(a, b))] for a, b in zip(q, c)] + [[280.0, 280.0, 12.0]]
    (run / MEASUREMENTS_FILE).write_text(
        json.dumps(
            {
                "source": "gyre_jax controller",
                "cell_accelerators": cell,
                "decode_steps": decode,
                "prefills": prefills,
                "micro_steps": timing.pop("micro"),
                "optimizer_steps": [1.5] + [0.01] * (STEPS - 1),
                "serving_to_training": [5.0, 5.0] + [0.5] * (2 * STEPS - 2),
                "training_to_serving": [0.3] * (2 * STEPS),
                "weight_syncs": [0.0] * STEPS,
            }
        )
    )
    return run, truth, measured, timing


def test_run_sim_config_reads_the_runs_shape(tmp_path):
    _write_config(
        tmp_path,
        *EIGHT_DEVICES,  # 2 cells of 4 devices
        "--config.schedule.policy=elastic",
        "--config.schedule.dispatch_staleness=2",
        "--config.cells.sessions_per_cell=6",
        "--config.total_steps=7",
    )
    cfg = run_sim_config(tmp_path)
    assert (cfg.num_cells, cfg.cell_accelerators, cfg.slots_per_cell) == (2, 4, 6)
    assert cfg.policy == "elastic" and dict(cfg.policy_options)["dispatch_staleness"] == 2 and cfg.steps == 7
    assert cfg.placement == "balanced" and cfg.prefill_interference
    from gyre_jax.model.config import ModelConfig

    c = json.loads((tmp_path / "config.json").read_text())
    model = ModelConfig.from_config_dict(c["model"])
    assert cfg.cost.training.flops_per_token == 6.0 * model.num_params  # the controller's FLOPs formula
    assert cfg.cost.training.micro_step_tokens == c["trajectory"]["tokens_per_micro_batch"]
    assert cfg.batch_size == c["rollout"]["tasks_per_step"] * c["rl"]["group_size"]
    _write_config(tmp_path, "--config.schedule.policy=async", "--config.cells.sessions_per_cell=0")
    cfg = run_sim_config(tmp_path)
    assert cfg.slots_per_cell == c["serving"]["max_concurrent_decodes"]  # 0: the engine's decode slots
    assert dict(cfg.policy_options)["training_cells"] == 1  # 0: half the cells
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        run_sim_config(tmp_path / "nowhere")


def test_run_sim_config_reads_runs_written_before_the_staleness_keys_were_renamed(tmp_path):
    _write_config(tmp_path, "--config.schedule.policy=elastic", "--config.schedule.dispatch_staleness=3")
    c = json.loads((tmp_path / "config.json").read_text())
    assert "dispatch_staleness" in c["schedule"] and "max_staleness" not in c["schedule"]
    c["schedule"]["max_staleness"] = c["schedule"].pop("dispatch_staleness")  # an old run's config.json
    c["rl"]["max_staleness"] = c["rl"].pop("drop_staleness")
    (tmp_path / "config.json").write_text(json.dumps(c))
    assert dict(run_sim_config(tmp_path).policy_options)["dispatch_staleness"] == 3


def test_execution_timing_comes_from_the_timeline_and_results(run_dir):
    run, _, _, timing = run_dir
    spans = execution_spans(run)
    store = RecordStore(run / "records")
    results = [json.loads(x) for x in (run / "results" / "step_000002.jsonl").read_text().splitlines()]
    for r in results:
        t = execution_timing(store.read(r["execution_id"]), r, spans[r["execution_id"]])
        setup, teardown, ev, *_ = timing[r["execution_id"]]
        assert (t.setup_s, t.teardown_s, t.eval_s) == pytest.approx((setup, teardown, ev), abs=0.06)
    assert execution_timing(store.read(results[0]["execution_id"]), results[0], None) is None
    replay = recorded_steps(run, 1)[0][0]
    setup, teardown, ev, *_ = timing[replay.execution_id]
    assert replay.eval_s == pytest.approx(ev, abs=0.06)
    assert replay.tool_s[-1] == pytest.approx(teardown, abs=0.06)  # after the last call, before the harness exits
    bare = recorded_steps(run, 1, with_timing=False)[0][0]
    assert sum(replay.tool_s) - sum(bare.tool_s) == pytest.approx(setup + teardown, abs=0.1)


def test_warm_up_is_left_out_of_the_measured_costs(run_dir):
    run, truth, _, _ = run_dir
    m, note = warm_measurements(run, skip_first=1)
    assert len(m["micro_steps"]) == 4 * (STEPS - 1) and max(s for _, s in m["micro_steps"]) < 3.0
    assert m["serving_to_training"] == pytest.approx([0.5] * (2 * STEPS - 2))
    assert m["optimizer_steps"] == pytest.approx([0.01] * (STEPS - 1), abs=1e-3)
    assert note["decode_steps"]["left_out"] == 1 and note["prefills"]["left_out"] == 1
    warm = calibrate(run)
    cold = calibrate(run, warm_up=False)
    assert warm.config.cost.training.accelerator_flops == pytest.approx(truth.training.accelerator_flops, rel=1e-6)
    assert warm.config.cost.switch.serving_to_training_s == pytest.approx(0.5)
    assert cold.config.cost.training.accelerator_flops < 0.8 * truth.training.accelerator_flops  # the compile counted


def test_calibration_predicts_the_run_and_the_records_alone_do_not(run_dir):
    run, _, measured, _ = run_dir
    c = calibrate(run, tolerance=0.15, skip_first=1)
    assert c.measured_s == pytest.approx(measured.tolist())
    assert c.report.steps == list(range(1, STEPS)) and c.report.within_tolerance, c.report.table()
    assert c.report.max_abs_error < 0.1
    sv = c.config.cost.serving
    assert (sv.decode_base_s, sv.decode_per_seq_s, sv.prefill_per_token_s) == pytest.approx(
        (0.012, 0.001, 3e-4), rel=1e-3
    )
    # the model calls and tool gaps alone leave out seconds of harness start-up and teardown per execution
    baseline = calibrate(run, tolerance=0.15, skip_first=1, with_timing=False)
    assert not baseline.report.within_tolerance
    assert sum(baseline.report.predicted_s) < 0.8 * sum(c.report.predicted_s)
    assert "step" in c.report.table().splitlines()[0] and c.report.table().splitlines()[1].split()[0] == "1"
