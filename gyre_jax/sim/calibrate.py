"""Calibration: does the simulator predict a real run's step times from that run's measured costs?

The path: a real run writes its measured costs (``cost_measurements.json``, format in
``cost_model.fit_cost_model``), its per-step wall times (``metrics.jsonl``, field ``step_s``) and its
TITO records (``records/<execution_id>.jsonl``) with step results (``results/step_<k>.jsonl``).
``calibrate_run`` fits a cost model to the measurements, replays the run's own executions (their
calls, tokens and tool gaps, ``workload.recorded_execution``) under the run's policy and cluster, and
compares the predicted step times with the measured ones (``compare_step_times``). The published bar
is a prediction within 15% per step.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from gyre_jax.sim.cost_model import CostModel, CostModelError, fit_cost_model
from gyre_jax.sim.simulator import SimConfig, SimResult, Simulator
from gyre_jax.sim.workload import RecordedExecution, recorded_execution, replay_plan

MEASUREMENTS_FILE = "cost_measurements.json"


@dataclass
class CalibrationReport:
    """Predicted against measured step times (seconds), with relative errors (predicted / measured - 1)."""

    predicted_s: list[float]
    measured_s: list[float]
    relative_error: list[float]
    mean_abs_error: float
    max_abs_error: float
    tolerance: float

    @property
    def within_tolerance(self) -> bool:
        return self.max_abs_error <= self.tolerance

    def to_dict(self) -> dict:
        return {**asdict(self), "within_tolerance": self.within_tolerance}

    def table(self) -> str:
        lines = ["step  measured_s  predicted_s  error"]
        for i, (m, p, e) in enumerate(zip(self.measured_s, self.predicted_s, self.relative_error)):
            lines.append(f"{i:4d}  {m:10.2f}  {p:11.2f}  {e:+6.1%}")
        lines.append(f"mean |error| {self.mean_abs_error:.1%}, max |error| {self.max_abs_error:.1%} "
                     f"(tolerance {self.tolerance:.0%}: {'within' if self.within_tolerance else 'NOT within'})")
        return "\n".join(lines)


def step_times(result: SimResult) -> list[float]:
    """Per-step times of a simulated run: the gaps between optimizer steps (the first from t = 0)."""
    ends = [0.0] + list(result.step_end_s)
    return [b - a for a, b in zip(ends, ends[1:])]


def compare_step_times(predicted: Sequence[float], measured: Sequence[float], tolerance: float = 0.15,
                       skip_first: int = 0) -> CalibrationReport:
    """Compares per-step times; ``skip_first`` leaves out warm-up steps (e.g. a real run's first step
    includes compilation, which the simulator does not model)."""
    if len(predicted) != len(measured):
        raise ValueError(f"predicted {len(predicted)} step times but measured {len(measured)}: compare the same steps")
    if len(measured) <= skip_first:
        raise ValueError(f"skip_first={skip_first} leaves no step of {len(measured)} to compare")
    p = np.asarray(predicted[skip_first:], dtype=np.float64)
    m = np.asarray(measured[skip_first:], dtype=np.float64)
    if (m <= 0).any():
        raise ValueError("measured step times must be > 0")
    err = p / m - 1.0
    return CalibrationReport(predicted_s=p.tolist(), measured_s=m.tolist(), relative_error=err.tolist(),
                             mean_abs_error=float(np.mean(np.abs(err))), max_abs_error=float(np.max(np.abs(err))),
                             tolerance=tolerance)


def predict(config: SimConfig, executions: Sequence[Sequence[RecordedExecution]] | None = None) -> SimResult:
    """Simulates ``config``; with ``executions`` (one list per step, in task order, ``batch_size`` each) the
    run's own executions are replayed instead of sampled from the workload spec."""
    plans = None
    if executions is not None:
        if len(executions) != config.steps:
            raise ValueError(f"{len(executions)} steps of recorded executions for a config of {config.steps} steps")
        plans = []
        for k, step in enumerate(executions):
            if len(step) != config.batch_size:
                raise ValueError(f"step {k} has {len(step)} recorded executions; the config runs "
                                 f"{config.batch_size} (tasks_per_step x group_size) per step")
            plans.append(replay_plan(step, config.workload, config.cost.serving, config.segments))
    return Simulator(config, plans=plans).run()


# -- reading a real run ---------------------------------------------------------------------------------
def measured_step_times(run_dir: str | os.PathLike) -> list[float]:
    """``step_s`` of every RL step in ``metrics.jsonl`` (evaluation and warm-start lines are skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: point at a run directory written by python -m gyre_jax.train")
    out: dict[int, float] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        m = json.loads(line)
        if m.get("step", -1) >= 0 and "step_s" in m:
            out[int(m["step"])] = float(m["step_s"])  # a resumed run may repeat a step: the last one counts
    return [out[k] for k in sorted(out)]


def recorded_steps(run_dir: str | os.PathLike, steps: int) -> list[list[RecordedExecution]]:
    """Each step's executions, replayable, from ``results/step_<k>.jsonl`` and ``records/``."""
    from gyre_jax.proxy.records import RecordStore

    run = Path(run_dir)
    store = RecordStore(run / "records")
    out = []
    for k in range(steps):
        path = run / "results" / f"step_{k:06d}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the run has fewer than {steps} steps of results")
        step = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            result = json.loads(line)
            records = store.read(result["execution_id"])
            if not records:
                raise ValueError(f"{result['execution_id']}: no TITO records to replay (it never called the model)")
            step.append(recorded_execution(records))
        out.append(step)
    return out


def calibrate_run(run_dir: str | os.PathLike, config: SimConfig, tolerance: float = 0.15,
                  skip_first: int = 1) -> tuple[CalibrationReport, CostModel]:
    """Fits the run's measured costs onto ``config.cost``, replays the run and compares step times."""
    run = Path(run_dir)
    path = run / MEASUREMENTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the controller writes it (see gyre_jax/sim/cost_model.py "
                                f"fit_cost_model for the format)")
    try:
        measurements = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CostModelError(f"{path}: not valid JSON ({exc})") from None
    cost = fit_cost_model(measurements, config.cost)
    measured = measured_step_times(run)
    steps = min(len(measured), config.steps)
    cfg = config.replace(cost=cost, steps=steps)
    result = predict(cfg, recorded_steps(run, steps))
    return compare_step_times(step_times(result), measured[:steps], tolerance, skip_first), cost
