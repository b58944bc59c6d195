"""Calibration: does the simulator predict a real run's step times from that run's own measurements?

A real run directory (``python -m gyre_jax.train``) holds ``config.json``, ``cost_measurements.json``
(format in ``cost_model.fit_cost_model``), ``metrics.jsonl`` (``step_s`` per step), ``records/`` (TITO
records with each call's ``t_start`` / ``t_end``), ``results/step_<k>.jsonl`` and ``timeline/*.json``.
``calibrate`` builds the simulator config of the run's shape (``run_sim_config``), fits the cost model to
the measurements without the warm-up (``warm_measurements``; the serving pause and training delay at step
boundaries from ``step_boundary_costs``), replays the run's own executions with their harness setup,
teardown and evaluation time (``recorded_steps``, ``execution_timing``) and the warm-up's compiles as
measured (``warmup_call_delays``), and compares the predicted step times with the measured ones
(``compare_step_times``, ``CalibrationReport``). The bar: within 15% per step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gyre_jax.disk import write_whole
from gyre_jax.sim.cost_model import (
    CostModel,
    CostModelError,
    ServingCost,
    SwitchCost,
    TrainingCost,
    fit_cost_model,
)
from gyre_jax.sim.simulator import SimConfig, SimResult, Simulator
from gyre_jax.sim.workload import (
    Dist,
    RecordedExecution,
    WorkloadSpec,
    recorded_execution,
    replay_plan,
)

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
    steps: list[int] | None = None  # the run's step numbers (None: 0, 1, ...)

    @property
    def within_tolerance(self) -> bool:
        return self.max_abs_error <= self.tolerance

    def to_dict(self) -> dict:
        return {**asdict(self), "within_tolerance": self.within_tolerance}

    def table(self) -> str:
        lines = ["step  measured_s  predicted_s  error"]
        steps = self.steps if self.steps is not None else range(len(self.measured_s))
        for i, m, p, e in zip(steps, self.measured_s, self.predicted_s, self.relative_error):
            lines.append(f"{i:4d}  {m:10.2f}  {p:11.2f}  {e:+6.1%}")
        lines.append(
            f"mean |error| {self.mean_abs_error:.1%}, max |error| {self.max_abs_error:.1%} "
            f"(tolerance {self.tolerance:.0%}: {'within' if self.within_tolerance else 'NOT within'})"
        )
        return "\n".join(lines)


def step_times(result: SimResult) -> list[float]:
    """Per-step times of a simulated run: the gaps between optimizer steps (the first from t = 0)."""
    ends = [0.0] + list(result.step_end_s)
    return [b - a for a, b in zip(ends, ends[1:])]


def compare_step_times(
    predicted: Sequence[float], measured: Sequence[float], tolerance: float = 0.15, skip_first: int = 0
) -> CalibrationReport:
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
    return CalibrationReport(
        predicted_s=p.tolist(),
        measured_s=m.tolist(),
        relative_error=err.tolist(),
        mean_abs_error=float(np.mean(np.abs(err))),
        max_abs_error=float(np.max(np.abs(err))),
        tolerance=tolerance,
        steps=list(range(skip_first, len(measured))),
    )


def predict(
    config: SimConfig, executions: Sequence[Sequence[RecordedExecution]] | None = None, **simulator_options
) -> SimResult:
    """Simulates ``config``; with ``executions`` (one list per step, in task order, ``batch_size`` each) the
    run's own executions are replayed instead of sampled from the workload spec. ``simulator_options`` go to
    ``Simulator`` (e.g. ``timeline=``, ``trace_executions=True``)."""
    plans = None
    if executions is not None:
        if len(executions) != config.steps:
            raise ValueError(f"{len(executions)} steps of recorded executions for a config of {config.steps} steps")
        plans = []
        for k, step in enumerate(executions):
            if len(step) != config.batch_size:
                raise ValueError(
                    f"step {k} has {len(step)} recorded executions; the config runs "
                    f"{config.batch_size} (tasks_per_step x group_size) per step"
                )
            plans.append(replay_plan(step, config.workload, config.cost.serving, config.segments))
    return Simulator(config, plans=plans, **simulator_options).run()


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


@dataclass(frozen=True)
class ExecutionTiming:
    """Where an execution's time went outside its model calls and tool gaps (seconds): ``setup_s`` from
    getting its slot to the harness's first call (workspace, process start, imports), ``teardown_s`` from
    its last call's end to the harness's exit, ``eval_s`` from the exit until the controller saw it scored.
    The three add up to the execution's whole span minus first-call-start .. last-call-end."""

    setup_s: float
    teardown_s: float
    eval_s: float


def execution_spans(run_dir: str | os.PathLike, timelines: Sequence | None = None) -> dict[str, tuple[float, float]]:
    """Execution id -> (slot taken, harness ended and scored), wall-clock seconds, from every timeline file of
    the run (``timeline/*.json``: one per run segment; the controller writes an execution's span from the
    moment it is submitted to the harness to the moment its scored result reaches the driver); ``timelines``:
    those files already loaded."""
    from gyre_jax.elastic.timeline import load_timeline

    if timelines is None:
        timelines = [load_timeline(path) for path in sorted((Path(run_dir) / "timeline").glob("*.json"))]
    spans: dict[str, tuple[float, float]] = {}
    for tl in timelines:
        for eid, span in tl.executions.items():
            if np.isfinite(span.end):
                spans[eid] = (tl.t0 + span.start, tl.t0 + span.end)
    return spans


def execution_timing(records: Sequence, result: dict, span: tuple[float, float] | None) -> ExecutionTiming | None:
    """Setup, teardown and evaluation time of one execution from its records (first / last call), its result
    (``duration_s``: harness spawn to exit) and its timeline span; None without a span."""
    if span is None or not records:
        return None
    start, end = span
    first = min(r.t_start for r in records)
    last = max(r.t_end for r in records)
    exit_t = min(max(start + float(result.get("duration_s") or 0.0), last), end)  # harness exit, in [last, end]
    return ExecutionTiming(
        setup_s=max(0.0, first - start), teardown_s=max(0.0, exit_t - last), eval_s=max(0.0, end - exit_t)
    )


def recorded_steps(
    run_dir: str | os.PathLike,
    steps: int,
    with_timing: bool = True,
    missing: list[str] | None = None,
    call_delays: dict[str, list[float]] | None = None,
) -> list[list[RecordedExecution]]:
    """Each step's executions, replayable, from ``results/step_<k>.jsonl`` and ``records/``.

    ``with_timing``: each execution's harness setup, teardown and evaluation time (``ExecutionTiming``) are
    measured from the run's timeline and added to its replay (setup before the first call, teardown after
    the last, evaluation after the harness ends); executions the timeline does not show replay without them
    and their ids are appended to ``missing``. ``call_delays``: execution id -> seconds to wait before each of
    its calls (``warmup_call_delays``).
    """
    from gyre_jax.proxy.records import RecordStore

    run = Path(run_dir)
    store = RecordStore(run / "records")
    spans = execution_spans(run) if with_timing else {}
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
            eid = result["execution_id"]
            records = store.read(eid)
            if not records:
                raise ValueError(f"{eid}: no TITO records to replay (it never called the model)")
            timing = execution_timing(records, result, spans.get(eid)) if with_timing else None
            if timing is None:
                if with_timing and missing is not None:
                    missing.append(eid)
                step.append(recorded_execution(records))
            else:
                step.append(
                    recorded_execution(
                        records, eval_s=timing.eval_s, setup_s=timing.setup_s, teardown_s=timing.teardown_s
                    )
                )
            delays = (call_delays or {}).get(eid)
            if delays:  # a wait before call c is tool time after call c - 1 (before call 0: its setup)
                x = step[-1]
                for c, d in enumerate(delays[: len(x.tool_s)]):
                    x.tool_s[max(0, c - 1)] += d
        out.append(step)
    return out


# -- a real run's measured costs, warm-up left out ------------------------------------------------------
# a serving sample this long, and COMPILE_FACTOR x the median, is a stall, not a steady step: a jit compile, or
# the pause at a step boundary (measured separately, step_boundary_costs)
COMPILE_MIN_S = 1.0
COMPILE_FACTOR = 20.0


def write_measurements(path: str | os.PathLike, costs: Any, step_logs: Sequence[Sequence[tuple]]) -> None:
    """A run's measured costs in ``fit_cost_model``'s format: the controller's ``CostLog`` (micro-steps as
    [FLOPs, seconds], optimizer steps, switches by direction, weight syncs) and every serving cell's step
    log (``(batch, context, prefilled tokens, seconds, wall-clock end)`` per loop iteration), split into decode
    steps and prefills (and kept whole as ``serving_log``); a prefill iteration also stepped the decoding batch,
    so a linear fit of the decode steps takes that off its time."""
    decode, prefill = [], []
    for cell_log in step_logs:
        for batch, context, prefilled, seconds, *_ in cell_log:
            (prefill if prefilled else decode).append((batch, context, prefilled, seconds))
    out = {"source": "gyre_jax controller", **asdict(costs)}
    # each cell's iterations as logged, with their wall-clock end (gyre_jax/sim/step_profile.py places them in time)
    out["serving_log"] = [[[end, b, ctx, n, s] for b, ctx, n, s, end in cell_log] for cell_log in step_logs]
    out["decode_steps"] = [[b, ctx, s] for b, ctx, _, s in decode if b > 0]
    coef = np.zeros(3)
    if len(out["decode_steps"]) >= 3:
        d = np.asarray(out["decode_steps"], dtype=np.float64)
        x = np.stack([np.ones(len(d)), d[:, 0], d[:, 1]], axis=1)
        coef, *_ = np.linalg.lstsq(x, d[:, 2], rcond=None)
    out["prefills"] = [
        [n, ctx + n, max(1e-6, s - (float(coef @ [1.0, b, ctx]) if b else 0.0))] for b, ctx, n, s in prefill
    ]
    write_whole(Path(path), json.dumps(out) + "\n")  # whole or not at all (a full disk: ``DiskFull``)


def read_measurements(run_dir: str | os.PathLike) -> dict:
    path = Path(run_dir) / MEASUREMENTS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the controller writes it (see gyre_jax/sim/cost_model.py fit_cost_model for the format)"
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CostModelError(f"{path}: not valid JSON ({exc})") from None


def _drop_stalls(m: dict, note: dict) -> None:
    """Leaves the stalls (longer than ``COMPILE_MIN_S`` and ``COMPILE_FACTOR`` x the median) out of the serving
    samples ``m["decode_steps"]`` and ``m["prefills"]``; ``note`` says how many and how long."""
    for key in ("decode_steps", "prefills"):
        rows = m.get(key) or []
        if rows:
            t = np.asarray([r[-1] for r in rows], dtype=np.float64)
            cut = max(COMPILE_MIN_S, COMPILE_FACTOR * float(np.median(t)))
            keep = t <= cut
            m[key] = [r for r, k in zip(rows, keep) if k]
            note[key] = {
                "samples": len(rows),
                "left_out": int((~keep).sum()),
                "left_out_s": float(t[~keep].sum()),
                "threshold_s": cut,
            }


@dataclass
class _TimelineCosts:
    """A run's training-side samples from its timeline files: micro-steps ([FLOPs, seconds]), optimizer steps
    and switches by direction (seconds) of steps >= ``skip_first``, and the first micro-step of each cell and
    the first optimizer step (their compiles)."""

    skip_first: int
    micro: list = field(default_factory=list)
    optim: list = field(default_factory=list)
    to_train: list = field(default_factory=list)
    to_serve: list = field(default_factory=list)
    first_micro: dict = field(default_factory=dict)  # cell -> [FLOPs, seconds] of its first micro-step
    first_optim: list = field(default_factory=list)

    def add(self, tl) -> None:
        """Takes the samples of one timeline (``elastic.timeline.Timeline``)."""
        ends = sorted((o.args.get("step", 0), o.end) for o in tl.optimizer_steps)
        for o in sorted(tl.optimizer_steps, key=lambda o: o.start):
            if not self.first_optim:
                self.first_optim.append(o.duration)
            elif o.args.get("step", 0) >= self.skip_first:
                self.optim.append(o.duration)
        for c, cell in enumerate(tl.micro_steps):
            for ms in sorted(cell, key=lambda ms: ms.start):
                if "work" not in ms.args:
                    continue
                if c not in self.first_micro:
                    self.first_micro[c] = [float(ms.args["work"]), ms.duration]
                elif ms.args.get("step", 0) >= self.skip_first:
                    self.micro.append([float(ms.args["work"]), ms.duration])
        for cell in tl.roles:
            for span in cell:
                if span.name != "switching" or span.args.get("to") not in ("training", "serving"):
                    continue
                step = next((k for k, end in ends if end >= span.start), None)
                if step is None or step < self.skip_first:
                    continue
                (self.to_train if span.args["to"] == "training" else self.to_serve).append(span.duration)

    def apply(self, m: dict, note: dict) -> None:
        """Replaces the controller's lists in ``m`` by these samples, with the warm-up compiles beyond a steady
        step (``warmup_micro_steps``, ``warmup_optimizer_steps``); ``note`` records what changed."""
        micro, optim = self.micro, self.optim
        for key, values in (
            ("micro_steps", micro),
            ("optimizer_steps", optim),
            ("serving_to_training", self.to_train),
            ("training_to_serving", self.to_serve),
        ):
            note[key] = {"controller_samples": len(m.get(key) or []), "after_warm_up": len(values)}
            m[key] = values
        if micro and self.first_micro:  # a cell's first micro-step beyond a steady one of the same FLOPs
            s_per_flop = sum(s for _, s in micro) / sum(f for f, _ in micro)
            m["warmup_micro_steps"] = [max(0.0, s - f * s_per_flop) for f, s in self.first_micro.values()]
            note["warmup_micro_steps"] = m["warmup_micro_steps"]
        if optim and self.first_optim:
            m["warmup_optimizer_steps"] = [max(0.0, self.first_optim[0] - float(np.mean(optim)))]
            note["warmup_optimizer_steps"] = m["warmup_optimizer_steps"]


def warm_measurements(run_dir: str | os.PathLike, skip_first: int = 1) -> tuple[dict, dict]:
    """The run's measured costs without its warm-up (the steps ``< skip_first``, whose times include the jit
    compiles and are not compared), and a note of what was left out.

    - Micro-steps, optimizer steps and switches are taken from the run's timeline, where each carries its
      step (micro-steps, optimizer steps) or time (switches: the step whose optimizer step ends after the
      switch starts); the timeline's switch spans include the driver noticing the switch's end.
    - Serving samples (``decode_steps``, ``prefills``) carry no time: a sample longer than ``COMPILE_MIN_S``
      and ``COMPILE_FACTOR`` x the median is a stall, not a steady step (a jit compile: first decode of a
      cell, first prefill of a bucket; or the pause at a step boundary, which ``step_boundary_costs``
      measures from the calls) and is left out.
    - Each cell's first micro-step and the first optimizer step, less a steady one, are the compiles
      (``warmup_micro_steps``, ``warmup_optimizer_steps``); the serving pause and training delay at step
      boundaries replace the controller's ``weight_syncs`` where they can be measured.
    Without a timeline the controller's lists are used as they are.
    """
    from gyre_jax.elastic.timeline import load_timeline

    m = dict(read_measurements(run_dir))
    note: dict = {}
    _drop_stalls(m, note)
    paths = sorted((Path(run_dir) / "timeline").glob("*.json"))
    if not paths:
        note["timeline"] = (
            "none: micro-steps, optimizer steps and switches as the controller listed them (warm-up included)"
        )
        return m, note
    costs = _TimelineCosts(skip_first)
    for path in paths:
        costs.add(load_timeline(path))
    costs.apply(m, note)
    pauses, boundaries = step_boundary_costs(run_dir, skip_first)
    if pauses:
        note["weight_syncs"] = {
            "controller_s": float(np.mean(m["weight_syncs"])) if m.get("weight_syncs") else None,
            "serving_pause_s": pauses,
        }
        m["weight_syncs"] = pauses
    if boundaries:
        note["step_boundaries"] = boundaries
        m["step_boundaries"] = boundaries
    return m, note


def _boundaries(run: Path) -> list[tuple[int, float]]:
    """(step, wall-clock end) of every optimizer step in the run's timeline files."""
    from gyre_jax.elastic.timeline import load_timeline

    return sorted(
        (int(o.args.get("step", 0)), tl.t0 + o.end)
        for tl in (load_timeline(p) for p in sorted((run / "timeline").glob("*.json")))
        for o in tl.optimizer_steps
    )


def call_latency_model(run_dir: str | os.PathLike, skip_first: int = 1) -> tuple[np.ndarray, int]:
    """``latency = a + b x completion tokens + c x new prompt tokens`` (coefficients [a, b, c], seconds) fitted
    to the run's model calls of steps >= ``skip_first`` that span no step boundary, and how many calls."""
    run = Path(run_dir)
    ups = np.asarray([u for _, u in _boundaries(run)])
    rows = []
    for k, calls in _calls_by_step(run).items():
        if k < skip_first:
            continue
        for r in calls:
            if not ((r.t_start < ups) & (ups < r.t_end)).any():
                rows.append([1.0, len(r.completion_ids), len(r.prompt_ids) - r.reused_prefix_len, r.t_end - r.t_start])
    if len(rows) < 3:
        return np.zeros(3), len(rows)
    a = np.asarray(rows)
    coef, *_ = np.linalg.lstsq(a[:, :3], a[:, 3], rcond=None)
    return coef, len(rows)


def _calls_by_step(run: Path) -> dict[int, list]:
    from gyre_jax.proxy.records import RecordStore

    store = RecordStore(run / "records")
    out, k = {}, 0
    while (path := run / "results" / f"step_{k:06d}.jsonl").is_file():
        out[k] = [
            r
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()
            for r in store.read(json.loads(line)["execution_id"])
        ]
        k += 1
    return out


def warmup_call_delays(run_dir: str | os.PathLike, skip_first: int = 1) -> dict[str, list[float]]:
    """Per execution, per call: how much longer the call took than ``call_latency_model`` says (>= 0), for
    calls that started during the warm-up (before the optimizer step of step ``skip_first - 1`` ended: the
    serving jit compiles at first use), whichever step they belong to (async and elastic run later steps'
    executions during the warm-up); 0 for later calls. ``calibrate`` replays these as waits before the
    calls, so the pipeline enters the first compared step as late as the run did."""
    run = Path(run_dir)
    coef, n = call_latency_model(run, skip_first)
    ends = [u for k, u in _boundaries(run) if k == skip_first - 1]
    if n < 3 or not ends or skip_first < 1:
        return {}
    warm_end = ends[0]
    out: dict[str, list[float]] = {}
    for calls in _calls_by_step(run).values():
        for r in sorted(calls, key=lambda r: (r.execution_id, r.call_index)):
            model = coef @ [1.0, len(r.completion_ids), len(r.prompt_ids) - r.reused_prefix_len]
            late = max(0.0, (r.t_end - r.t_start) - float(model)) if r.t_start < warm_end else 0.0
            out.setdefault(r.execution_id, []).append(late)
    return {eid: d for eid, d in out.items() if any(d)}


def step_boundary_costs(run_dir: str | os.PathLike, skip_first: int = 1) -> tuple[list[float], list[float]]:
    """What a step boundary (an optimizer step's end, time u) costs the run, measured from its records and
    timeline: (serving pauses, training delays), one value per boundary where it can be measured.

    - *Serving pause*: the model calls in flight at u take longer than calls of the same size that span no
      boundary (the serving loop takes the new weights while the host runs the step's bookkeeping and the
      pipeline); per boundary, the mean excess latency of its calls over ``latency = a + b x completion
      tokens + c x new prompt tokens`` fitted to the calls that span none. The simulator's
      ``weight_sync_s`` is this pause (the controller's ``weight_syncs`` time only the hand-over call).
      Not measurable where no call spans a boundary (colocated: nothing serves while a step trains).
    - *Training delay*: from u to the first micro-step of the next step, at boundaries where that step's
      first group of executions (in task order) had already ended before u, so its data only waited for
      the boundary: ``pipeline.step_boundary_s``.
    """
    from gyre_jax.elastic.timeline import load_timeline

    run = Path(run_dir)
    paths = sorted((run / "timeline").glob("*.json"))
    if not paths:
        return [], []
    tls = [load_timeline(p) for p in paths]
    ups = _boundaries(run)
    if not ups:
        return [], []
    calls = [r for rs in _calls_by_step(run).values() for r in rs]
    coef, n = call_latency_model(run, skip_first)
    pauses: list[float] = []
    if calls and n >= 3:
        t = np.asarray([[r.t_start, r.t_end] for r in calls], dtype=np.float64)
        x = np.asarray([[1.0, len(r.completion_ids), len(r.prompt_ids) - r.reused_prefix_len] for r in calls])
        excess = (t[:, 1] - t[:, 0]) - x @ coef
        u = np.asarray([v for _, v in ups])
        spans = (t[:, :1] < u[None, :]) & (u[None, :] < t[:, 1:])  # [calls, boundaries]
        pauses = [max(0.0, float(excess[spans[:, j]].mean())) for j in range(len(ups)) if spans[:, j].any()]
    # training delay: boundaries whose next step's first group had ended before them
    ends: dict[int, dict[str, float]] = {}
    for tl in tls:
        for eid, span in tl.executions.items():
            if np.isfinite(span.end) and "step" in span.args:
                ends.setdefault(int(span.args["step"]), {})[eid] = tl.t0 + span.end
    first_micro: dict[int, float] = {}
    for tl in tls:
        for cell in tl.micro_steps:
            for ms in cell:
                k = int(ms.args.get("step", -1))
                first_micro[k] = min(first_micro.get(k, np.inf), tl.t0 + ms.start)
    boundaries = []
    for k, u_k in ups:
        nxt = k + 1
        group = _first_group(run, nxt)
        if nxt not in first_micro or not group or nxt not in ends:
            continue
        if all(ends[nxt].get(e, np.inf) < u_k for e in group):
            boundaries.append(max(0.0, first_micro[nxt] - u_k))
    return pauses, boundaries


def _first_group(run: Path, step: int) -> list[str]:
    """Execution ids of the first task group (task order) of ``step`` from its results file."""
    path = run / "results" / f"step_{step:06d}.jsonl"
    if not path.is_file():
        return []
    results = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    if not results:
        return []
    group = results[0].get("group_id")
    return [r["execution_id"] for r in results if r.get("group_id") == group]


# -- a real run's shape as a simulator config ------------------------------------------------------------
def read_run_config(run_dir: str | os.PathLike) -> dict:
    """The run's ``config.json`` (written by ``python -m gyre_jax.train``) as a dict."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: point at a run directory written by python -m gyre_jax.train")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def _lookup(config: dict, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _get(config: dict, key: str, default=None):
    """``config.json``'s value of ``key``; a run written before a key was renamed has it under its old name
    (``schedule.max_staleness`` for ``schedule.dispatch_staleness``: new configs refuse the old names)."""
    from gyre_jax.config import RENAMED_KEYS

    value = _lookup(config, key)
    old = next((old for old, (new, _) in RENAMED_KEYS.items() if new == key), None)
    if value is None and old is not None:
        value = _lookup(config, old)
    if value is None:
        if default is None:
            raise KeyError(f"config.json has no {key!r}: is this a gyre_jax run directory?")
        return default
    return value


def _pipeline_default(name: str):
    """A default of the real trajectory pipeline's config (what a run used when its config.json omits it)."""
    import dataclasses as dc

    from gyre_jax.trajectory.pipeline import TrajectoryConfig

    return next(f.default for f in dc.fields(TrajectoryConfig) if f.name == name)


def _policy_options(c: dict, num_cells: int) -> dict:
    """The run's scheduling policy options, from its config.json (old runs' key names too)."""
    policy = _get(c, "schedule.policy")
    if policy == "async":
        return {
            "dispatch_staleness": int(_get(c, "schedule.dispatch_staleness", 1)),
            "training_cells": int(_get(c, "schedule.training_cells", 0)) or max(1, num_cells // 2),
        }
    if policy == "elastic":
        return {
            "dispatch_staleness": int(_get(c, "schedule.dispatch_staleness", 1)),
            "leave_on": _get(c, "schedule.leave_on", "waterlevel"),
            "idle_before_return_s": float(_get(c, "schedule.idle_before_return_s", 0.0)),
        }
    return {}


def _placeholder_cost(run_dir, model, cell: int, slots: int, micro_step_tokens: int) -> CostModel:
    """A cost model of the run's shape (``model``: its ``ModelConfig``; cells of ``cell`` accelerators, one
    serving replica of ``slots`` slots each) whose times are placeholders for ``fit_cost_model``."""
    return CostModel(
        serving=ServingCost(
            replica_accelerators=cell,
            slots_per_replica=slots,
            decode_base_s=1e-3,
            decode_per_seq_s=0.0,
            decode_per_context_token_s=0.0,
            prefill_base_s=0.0,
            prefill_per_token_s=0.0,
            prefill_per_token_context_s=0.0,
        ),
        training=TrainingCost(
            # the controller's micro-step FLOPs count (ModelConfig.train_flops): a branch of l tokens has l^2/2 pairs
            flops_per_token=model.train_flops(1, 0),
            flops_per_token_sq=model.train_flops(0, 0.5),
            accelerator_flops=1e9,
            reference_cell_accelerators=cell,
            scaling_exponent=1.0,
            min_cell_accelerators=cell,
            micro_step_tokens=micro_step_tokens,
        ),
        switch=SwitchCost(serving_to_training_s=0.0, training_to_serving_s=0.0, weight_sync_s=0.0),
        source=f"placeholder for {run_dir}",
    )


def _replay_workload(name: str, timeout_s: float) -> WorkloadSpec:
    """A workload spec for replaying recorded executions: only the timeout and the context shape matter."""
    return WorkloadSpec(
        name=name,
        turns=Dist(1.0),
        task_sigma=0.0,
        gen_tokens=Dist(1.0),
        obs_tokens=Dist(1.0),
        initial_context=0,
        tool_s=Dist(0.0),
        setup_s=Dist(0.0),
        eval_s=Dist(0.0),
        timeout_s=timeout_s,
    )


def run_sim_config(run_dir: str | os.PathLike, steps: int | None = None, segments: int | None = None) -> SimConfig:
    """A ``SimConfig`` of the run's shape, from its ``config.json``: cluster (cells x devices per cell), one
    serving engine per cell with ``cells.sessions_per_cell`` slots (0: ``serving.max_concurrent_decodes``),
    tasks per step, group size, steps (``total_steps``, or ``steps``), the policy and its options, J_max,
    the harness timeout, micro-steps of ``trajectory.tokens_per_micro_batch`` tokens, the model's training
    FLOPs (the controller's formula: 6 x params per token + 6 x layers x heads x head_dim per token pair),
    sessions placed on the least loaded cell (the proxy's router). Costs are placeholders until
    ``fit_cost_model`` puts the run's measurements in (``calibrate_run``). ``segments`` defaults to one per
    model call (``rollout.max_turns``): the simulator's reference resolution.
    """
    from gyre_jax.model.config import ModelConfig

    c = read_run_config(run_dir)
    num_cells = int(_get(c, "cells.num_cells"))
    cell = 1
    for axis in ("data", "fsdp", "tensor", "expert"):
        cell *= int(_get(c, f"cells.{axis}", 1))
    slots = int(_get(c, "cells.sessions_per_cell", 0)) or int(_get(c, "serving.max_concurrent_decodes"))
    model = ModelConfig.from_config_dict(_get(c, "model"))
    cost = _placeholder_cost(run_dir, model, cell, slots, int(_get(c, "trajectory.tokens_per_micro_batch")))
    name = f"run:{Path(run_dir).name}"
    return SimConfig(
        workload=_replay_workload(name, float(_get(c, "rollout.timeout_s"))),
        cost=cost,
        accelerators=num_cells * cell,
        cell_accelerators=cell,
        policy=_get(c, "schedule.policy"),
        policy_options=tuple(sorted(_policy_options(c, num_cells).items())),
        steps=int(steps or _get(c, "total_steps")),
        tasks_per_step=int(_get(c, "rollout.tasks_per_step")),
        group_size=int(_get(c, "rl.group_size")),
        seed=int(_get(c, "seed", 0)),
        max_branches=int(_get(c, "rl.max_branches", 0)) or None,
        streaming=True,
        segments=int(segments or _get(c, "rollout.max_turns", 8)),
        placement="balanced",
        prefill_interference=True,
        stream_unit="group_in_order" if _get(c, "trajectory.stream_order", "task") == "task" else "group",
        pack_lookahead=int(_get(c, "trajectory.open_micro_batches", _pipeline_default("open_micro_batches"))),
        name=name,
    )


@dataclass
class RunCalibration:
    """Everything one calibration computed: the simulated config (with the fitted costs), its result, the
    comparison, and what the measurements left out (``notes``)."""

    run_dir: str
    config: SimConfig
    result: SimResult
    report: CalibrationReport
    measured_s: list[float]  # every step, warm-up included
    notes: dict


def calibrate(
    run_dir: str | os.PathLike,
    config: SimConfig | None = None,
    tolerance: float = 0.15,
    skip_first: int = 1,
    with_timing: bool = True,
    warm_up: bool = True,
    warmup_replay: bool = True,
    serving_pause: bool = True,
    **simulator_options,
) -> RunCalibration:
    """Predicts a real run's step times from its own measurements and compares them with ``metrics.jsonl``'s.

    - Costs: the run's ``cost_measurements.json`` fitted onto ``config.cost`` (default: ``run_sim_config``,
      the run's own shape); with ``warm_up`` the warm-up steps (< ``skip_first``) are left out of the fit
      (``warm_measurements``), and (``serving_pause``) the serving pause at each step boundary is measured
      from the calls in flight across it (``step_boundary_costs``).
    - Executions: the run's own, replayed (``recorded_steps``) with each one's harness setup, teardown and
      evaluation time (``with_timing``).
    - Warm-up (``warmup_replay``, needs ``warm_up``): the jit compiles of the warm-up are replayed as measured
      (each cell's first micro-step, the first optimizer step, the warm-up calls' excess latency), so the
      pipeline enters the first compared step in the state the run did (async and elastic dispatch ahead).
    The first ``skip_first`` steps are simulated but not compared.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(
            f"{run} is not a directory: point at a run directory written by python -m gyre_jax.train"
        )
    if warm_up:
        measurements, notes = warm_measurements(run, skip_first)
        if not warmup_replay:
            for key in ("warmup_micro_steps", "warmup_optimizer_steps"):
                measurements.pop(key, None)
        if not serving_pause:
            measurements["weight_syncs"] = read_measurements(run).get("weight_syncs") or []
    else:
        measurements, notes = read_measurements(run), {}
    measured = measured_step_times(run)
    if config is None:
        config = run_sim_config(run, steps=len(measured))
    cost = fit_cost_model(measurements, config.cost)
    steps = min(len(measured), config.steps)
    cfg = config.replace(cost=cost, steps=steps)
    missing: list[str] = []
    delays = warmup_call_delays(run, skip_first) if (warm_up and warmup_replay and with_timing) else {}
    if delays:
        notes["warmup_call_delay_s"] = float(sum(map(sum, delays.values())))
    result = predict(
        cfg,
        recorded_steps(run, steps, with_timing=with_timing, missing=missing, call_delays=delays),
        **simulator_options,
    )
    if missing:
        notes["executions_without_timing"] = len(missing)
    report = compare_step_times(step_times(result), measured[:steps], tolerance, skip_first)
    return RunCalibration(
        run_dir=str(run), config=cfg, result=result, report=report, measured_s=measured[:steps], notes=notes
    )


def calibrate_run(
    run_dir: str | os.PathLike,
    config: SimConfig | None = None,
    tolerance: float = 0.15,
    skip_first: int = 1,
    with_timing: bool = True,
    warm_up: bool = True,
) -> tuple[CalibrationReport, CostModel]:
    """``calibrate`` reduced to (report, fitted cost model)."""
    c = calibrate(run_dir, config, tolerance, skip_first, with_timing, warm_up)
    return c.report, c.config.cost
