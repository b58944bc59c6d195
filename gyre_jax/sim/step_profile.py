"""Where an RL step's time went, per cell, from a real run's directory (issue 47 item 2).

A step's window is from the previous step's weight publish end (the run's first step: its first execution's
start) to its own publish end. Every instant of the window, on every cell, gets exactly one part (``PARTS``),
the first that holds in this order:

- ``prefill`` / ``decode``: the cell's serving loop is computing an iteration (``cost_measurements.json``'s
  ``serving_log``: each iteration's wall-clock end and seconds; an iteration that prefilled any token is
  ``prefill``, and it also stepped the decoding batch);
- ``training``: a micro-step of the cell (the timeline's ``micro_step``);
- ``optimizer``: the optimizer step (the core's; the timeline's ``optimizer_step``);
- ``publish``: the new weights going to the serving cells (the timeline's ``weight_publish``; every cell);
- ``switch``: the cell switching roles;
- while the cell serves but computes nothing, what the run waits for: ``proxy`` (a model call the cell serves is
  in flight: HTTP, the chat template, tokenizing, the queue; the records' ``cell``, ``t_start`` .. ``t_end``), else ``harness``
  (an execution's harness is running: tool commands, the agent's own code, process start), else ``verifier``
  (an execution's harness has exited and its hidden tests are running or its result is on its way);
- ``idle``: anything else (a training cell waiting for data or for the others, a serving cell with nothing to do).

So each cell's parts add up to the window. ``work`` counts what the compute parts did (tokens prefilled, decode
steps and the tokens and context they covered, micro-step FLOPs): with a model's sizes and a measured peak,
``benchmarks/bench_step_profile.py`` turns them into the achieved FLOP/s and bytes/s of each part against its
roofline. Times are sampled on a grid of ``resolution_s`` (default 2 ms).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PARTS = ("prefill", "decode", "training", "optimizer", "publish", "switch", "proxy", "harness", "verifier", "idle")
COMPUTE_PARTS = ("prefill", "decode", "training", "optimizer")
_CODE = {name: i for i, name in enumerate(PARTS)}
_WAIT = -1  # serving, computing nothing: split into proxy / harness / verifier / idle


@dataclass
class StepProfile:
    """One step's window and each cell's seconds per part (``PARTS``); ``work``: what the compute parts did."""

    step: int
    t_start: float  # wall-clock seconds
    t_end: float
    cells: list[str]
    seconds: dict[str, dict[str, float]]  # cell -> part -> seconds (each cell's parts add up to the window)
    work: dict[str, float] = field(default_factory=dict)
    busy_union_s: dict[str, float] = field(default_factory=dict)  # part -> seconds any cell spent in it
    # cell -> [(start, end, part)] in seconds from t_start, runs of one part (for a Gantt; not in ``to_dict``)
    segments: dict[str, list[tuple[float, float, str]]] = field(default_factory=dict, repr=False)

    @property
    def window_s(self) -> float:
        return self.t_end - self.t_start

    def fractions(self) -> dict[str, float]:
        """Each part's share of all cells' time in the window."""
        total = self.window_s * len(self.cells)
        return {p: sum(c[p] for c in self.seconds.values()) / total if total > 0 else 0.0 for p in PARTS}

    def to_dict(self) -> dict:
        out = {**asdict(self), "window_s": self.window_s, "fractions": self.fractions()}
        del out["segments"]
        return out


def _read_measurements(run: Path) -> dict:
    path = run / "cost_measurements.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the controller writes it at the end of each run segment")
    m = json.loads(path.read_text(encoding="utf-8"))
    if "serving_log" not in m:
        raise ValueError(f"{path} has no 'serving_log': written by an older gyre-jax; rerun the steps to profile")
    return m


def _executions(run: Path, spans: dict) -> list[tuple[float, float, float]]:
    """(start, harness exit, scored) wall-clock seconds of every execution the timeline and results show."""
    out = []
    for path in sorted((run / "results").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            span = spans.get(r.get("execution_id"))
            if span is None:
                continue
            start, end = span
            exit_t = min(max(start + float(r.get("duration_s") or 0.0), start), end)
            out.append((start, exit_t, end))
    return out


def _calls(run: Path) -> dict[str, list[tuple[float, float]]]:
    """Serving cell -> (t_start, t_end) of every model call it served, from the run's records."""
    from gyre_jax.proxy.records import RecordStore

    store = RecordStore(run / "records")
    out: dict[str, list[tuple[float, float]]] = {}
    for path in sorted((run / "records").glob("*.jsonl")):
        for r in store.read(path.stem):
            out.setdefault(r.cell, []).append((r.t_start, r.t_end))
    return out


def step_profiles(run_dir: str | os.PathLike, resolution_s: float = 0.002) -> list[StepProfile]:
    """Every step the run's timeline shows with its weight publish, in step order (see the module docstring)."""
    from gyre_jax.elastic.timeline import load_timeline
    from gyre_jax.sim.calibrate import execution_spans

    run = Path(run_dir)
    paths = sorted((run / "timeline").glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"{run / 'timeline'} holds no timeline: point at a run directory of gyre_jax.train")
    tls = [load_timeline(p) for p in paths]
    m = _read_measurements(run)
    cells = tls[0].cells
    execs = _executions(run, execution_spans(run, tls))
    calls = _calls(run)
    publishes = sorted((int(p.args["step"]), tl.t0 + p.start, tl.t0 + p.end) for tl in tls for p in tl.publishes)
    out = []
    for i, (step, _, end) in enumerate(publishes):
        if i > 0 and publishes[i - 1][0] == step - 1:
            start = publishes[i - 1][2]
        else:
            starts = [tl.t0 + s.start for tl in tls for s in tl.executions.values() if s.args.get("step") == step]
            if not starts:
                continue
            start = min(starts)
        out.append(_profile(step, start, end, cells, tls, m, execs, calls, resolution_s))
    return out


def _profile(step, start, end, cells, tls, m, execs, calls, res) -> StepProfile:
    n = max(1, int(np.ceil((end - start) / res)))
    grid = start + (np.arange(n) + 0.5) * res  # bin centres

    def mask(a: float, b: float) -> slice:
        return slice(
            int(np.clip(np.floor((a - start) / res + 0.5), 0, n)), int(np.clip(np.floor((b - start) / res + 0.5), 0, n))
        )

    labels = np.full((len(cells), n), _CODE["idle"], dtype=np.int8)
    for tl in tls:  # lowest priority first: later marks overwrite
        for c in range(len(cells)):
            for s in tl.roles[c]:
                code = {"serving": _WAIT, "switching": _CODE["switch"]}.get(s.name, _CODE["idle"])
                labels[c, mask(tl.t0 + s.start, tl.t0 + s.end)] = code
        for p in tl.publishes:
            sl = mask(tl.t0 + p.start, tl.t0 + p.end)
            labels[:, sl] = _CODE["publish"]
        for o in tl.optimizer_steps:
            labels[int(o.args.get("cell", 0)), mask(tl.t0 + o.start, tl.t0 + o.end)] = _CODE["optimizer"]
    work = {"prefill_tokens": 0.0, "decode_steps": 0.0, "decode_tokens": 0.0, "decode_context_tokens": 0.0,
            "training_flops": 0.0, "micro_steps": 0.0}  # fmt: skip
    for tl in tls:
        for c, cell_steps in enumerate(tl.micro_steps):
            for s in cell_steps:
                a, b = tl.t0 + s.start, tl.t0 + s.end
                labels[c, mask(a, b)] = _CODE["training"]
                if start <= b <= end:
                    work["training_flops"] += float(s.args.get("work", 0.0))
                    work["micro_steps"] += 1
    for c, cell_log in enumerate(m["serving_log"][: len(cells)]):
        for t_end, batch, context, prefilled, seconds in cell_log:
            if not start - seconds <= t_end <= end + seconds:
                continue
            labels[c, mask(t_end - seconds, t_end)] = _CODE["prefill" if prefilled else "decode"]
            if start <= t_end <= end:
                if prefilled:
                    work["prefill_tokens"] += prefilled
                else:
                    work["decode_steps"] += 1
                    work["decode_tokens"] += batch
                    work["decode_context_tokens"] += context
    _split_waits(labels, grid, execs, calls, cells)
    seconds = {name: {p: float((labels[c] == _CODE[p]).sum() * res) for p in PARTS} for c, name in enumerate(cells)}
    union = {p: float((labels == _CODE[p]).any(axis=0).sum() * res) for p in PARTS}
    segments = {name: _runs(labels[c], res) for c, name in enumerate(cells)}
    return StepProfile(step, start, end, list(cells), seconds, work, union, segments)


def _runs(row: np.ndarray, res: float) -> list[tuple[float, float, str]]:
    """Runs of equal labels as (start, end, part), seconds from the window's start."""
    cut = np.flatnonzero(np.diff(row)) + 1
    starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [len(row)]])
    return [(float(a * res), float(b * res), PARTS[row[a]]) for a, b in zip(starts, ends)]


def _active(grid: np.ndarray, intervals: list[tuple[float, float]]) -> np.ndarray:
    """Whether any interval covers each grid time."""
    if not intervals:
        return np.zeros(len(grid), dtype=bool)
    iv = np.asarray(intervals, dtype=np.float64)
    starts, ends = np.sort(iv[:, 0]), np.sort(iv[:, 1])
    return np.searchsorted(starts, grid, side="right") > np.searchsorted(ends, grid, side="right")


def _split_waits(labels: np.ndarray, grid: np.ndarray, execs, calls: dict, cells: list[str]) -> None:
    """A serving cell's instants computing nothing: proxy (a call it serves is in flight), else harness, else
    verifier, else idle."""
    wait = labels == _WAIT
    if not wait.any():
        return
    in_call = np.stack([_active(grid, calls.get(name, [])) for name in cells])
    in_harness = _active(grid, [(s, x) for s, x, _ in execs])
    verifying = _active(grid, [(x, e) for _, x, e in execs])
    for flag, part in ((in_call, "proxy"), (in_harness[None, :], "harness"), (verifying[None, :], "verifier")):
        hit = wait & flag
        labels[hit] = _CODE[part]
        wait &= ~hit
    labels[wait] = _CODE["idle"]


def table(profile: StepProfile) -> str:
    """Markdown: one row per cell (seconds per part) and the parts' shares of all cells' time."""
    head = "| cell | " + " | ".join(PARTS) + " | window |"
    rows = [head, "|" + "---|" * (len(PARTS) + 2)]
    for name, sec in profile.seconds.items():
        rows.append(f"| {name} | " + " | ".join(f"{sec[p]:.1f}" for p in PARTS) + f" | {profile.window_s:.1f} |")
    frac = profile.fractions()
    rows.append("| share | " + " | ".join(f"{100 * frac[p]:.1f}%" for p in PARTS) + " | |")
    return "\n".join(rows)
