"""Tests for gyre_jax/sim/calibrate.py on a synthetic run directory laid out as a real run writes it
(records/, results/step_<k>.jsonl, metrics.jsonl, cost_measurements.json). The "measured" step times
come from a ground-truth cost model the calibration does not see; it has to recover it from the
measurements and replay the recorded executions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gyre_jax.proxy.records import RecordStore, TitoRecord
from gyre_jax.sim.calibrate import (
    MEASUREMENTS_FILE,
    calibrate_run,
    compare_step_times,
    measured_step_times,
    predict,
    recorded_steps,
    step_times,
)
from gyre_jax.sim.config import load_sim_config


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    base = load_sim_config("tiny", {"steps": 3, "schedule.policy": "colocated"})
    truth = base.cost.replace(
        serving={
            "decode_base_s": 0.05,
            "decode_per_seq_s": 0.004,
            "decode_per_context_token_s": 1e-8,
            "prefill_per_token_s": 2e-4,
        },
        training={
            "accelerator_flops": base.cost.training.accelerator_flops / 5,
            "micro_step_overhead_s": 0.8,
            "optimizer_step_s": 12.0,
        },
        switch={"serving_to_training_s": 20.0, "training_to_serving_s": 9.0},
    )
    rng = np.random.default_rng(0)
    store = RecordStore(run / "records")
    (run / "results").mkdir()
    for k in range(base.steps):
        lines = []
        for j in range(base.batch_size):
            eid = f"s{k}-e{j}"
            prompt, t = 0, 1000.0 * k
            for c in range(int(rng.integers(3, 9))):
                new, gen = int(rng.integers(50, 400)), int(rng.integers(20, 120))
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
                        t_end=t + 1.0,
                    )
                )
                prompt += new + gen
                t += 1.0 + float(rng.exponential(20.0))
            lines.append(json.dumps({"execution_id": eid, "status": "finished", "reward": 1.0}))
        (run / "results" / f"step_{k:06d}.jsonl").write_text("\n".join(lines) + "\n")
    executions = recorded_steps(run, base.steps)
    measured = np.array(step_times(predict(base.replace(cost=truth), executions)))
    measured *= 1 + 0.03 * rng.standard_normal(len(measured))  # timing noise of a real machine
    metrics = [{"step": -1, "phase": "warm_start"}] + [{"step": k, "step_s": float(s)} for k, s in enumerate(measured)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    sv = truth.serving
    batch, ctx = rng.integers(1, 4, 40), rng.uniform(0, 5e4, 40)
    flops = rng.uniform(1e13, 1e15, 20)
    rate = truth.training.cell_flops(base.cell_accelerators)
    (run / MEASUREMENTS_FILE).write_text(
        json.dumps(
            {
                "source": "synthetic run",
                "decode_steps": [[int(b), float(x), sv.decode_step_s(b, x)] for b, x in zip(batch, ctx)],
                "prefills": [
                    [float(q), float(c), float(sv.prefill_s(q, c))]
                    for q, c in zip(rng.uniform(50, 400, 20), rng.uniform(0, 5e4, 20))
                ],
                "micro_steps": [[float(f), 0.8 + float(f) / rate] for f in flops],
                "cell_accelerators": base.cell_accelerators,
                "optimizer_steps": [12.0],
                "serving_to_training": [20.0],
                "training_to_serving": [9.0],
            }
        )
    )
    return run, base, truth, measured


def test_calibration_recovers_the_run_and_predicts_its_step_times(run_dir):
    run, base, truth, measured = run_dir
    assert measured_step_times(run) == pytest.approx(measured.tolist())
    report, fitted = calibrate_run(run, base, tolerance=0.15, skip_first=0)
    assert fitted.serving.decode_base_s == pytest.approx(0.05) and fitted.switch.serving_to_training_s == 20.0
    assert fitted.source == "measured: synthetic run"
    assert report.within_tolerance and report.max_abs_error < 0.1, report.table()
    # without the measured costs the same replay misses by far more: the fit is what makes it right
    uncalibrated = compare_step_times(step_times(predict(base, recorded_steps(run, base.steps))), measured.tolist())
    assert not uncalibrated.within_tolerance
    assert "max |error|" in report.table() and report.to_dict()["within_tolerance"] is True


def test_compare_and_missing_files_say_what_is_wrong(tmp_path, run_dir):
    report = compare_step_times([11.0, 9.0, 30.0], [10.0, 10.0, 20.0], tolerance=0.15, skip_first=1)
    assert report.relative_error == pytest.approx([-0.1, 0.5]) and not report.within_tolerance
    with pytest.raises(ValueError, match="predicted 2 step times but measured 3"):
        compare_step_times([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="leaves no step"):
        compare_step_times([1.0], [1.0], skip_first=1)
    _, base, _, _ = run_dir
    with pytest.raises(FileNotFoundError, match="cost_measurements.json not found"):
        calibrate_run(tmp_path, base)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found"):
        measured_step_times(tmp_path)
    with pytest.raises(ValueError, match="step 0 has 1 recorded executions"):
        predict(base, [[recorded_steps(run_dir[0], 1)[0][0]]] * base.steps)
