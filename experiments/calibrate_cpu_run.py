"""Calibration of the simulator against real runs: does it predict a run's step times from that run's
measured costs?

For each run directory (written by ``python -m gyre_jax.train``) this fits the simulator's cost model to the
run's ``cost_measurements.json`` (warm-up left out), builds the simulator config from its ``config.json``
(cells, slots, tasks, group size, policy, J_max, model FLOPs), replays the run's own executions from its TITO
records and timeline, and compares the predicted step times with ``metrics.jsonl``'s ``step_s`` (the first
step, which includes the jit compiles, is left out). Two predictions are compared in the same run:

- ``model``: the replay with each execution's harness start-up, teardown and evaluation time measured from
  the timeline and results (``gyre_jax.sim.calibrate.ExecutionTiming``);
- ``baseline``: the replay of the model calls and tool gaps alone (what the TITO records show).

Writes ``<out>/calibration.json`` (per run: config, fitted cost model, per-step measured / predicted / error,
phase breakdown, execution timing, what each mechanism is worth), ``<out>/summary.md`` (the printed tables)
and ``<out>/calibration.png`` (predicted against measured step times).

Run: python experiments/calibrate_cpu_run.py RUN_DIR [RUN_DIR ...] [--out experiments/results/calibration]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gyre_jax.elastic.timeline import Timeline, TimelineWriter, load_timeline  # noqa: E402
from gyre_jax.proxy.records import RecordStore  # noqa: E402
from gyre_jax.sim.calibrate import (  # noqa: E402
    calibrate,
    execution_spans,
    execution_timing,
    run_sim_config,
)


def phases(tl: Timeline, steps: int, t0: float = 0.0) -> list[dict]:
    """Per step: ``rollout_s`` (its first execution's start to its last one's end) and ``after_rollout_s``
    (its last execution's end to its optimizer step's end), from a real or simulated timeline."""
    first, last = [np.inf] * steps, [-np.inf] * steps
    for span in tl.executions.values():
        k = int(span.args.get("step", -1))
        if 0 <= k < steps and np.isfinite(span.end):
            first[k], last[k] = min(first[k], span.start), max(last[k], span.end)
    ends = {int(o.args["step"]): o.end for o in tl.optimizer_steps}
    out = []
    for k in range(steps):
        row = {"step": k}
        if np.isfinite(first[k]) and np.isfinite(last[k]):
            row["rollout_s"] = last[k] - first[k]
            if k in ends:
                row["after_rollout_s"] = ends[k] - last[k]
        out.append(row)
    return out


def timing_summary(run: Path, steps: int) -> dict:
    """Mean harness setup / teardown / evaluation and model-call span per execution (seconds)."""
    spans = execution_spans(run)
    store = RecordStore(run / "records")
    rows = []
    for k in range(steps):
        for line in (run / "results" / f"step_{k:06d}.jsonl").read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            recs = store.read(r["execution_id"])
            t = execution_timing(recs, r, spans.get(r["execution_id"]))
            if t is not None:
                span = max(x.t_end for x in recs) - min(x.t_start for x in recs)
                rows.append((t.setup_s, span, t.teardown_s, t.eval_s))
    a = np.asarray(rows) if rows else np.zeros((1, 4))
    return {
        "executions": len(rows),
        **{
            f"{name}_mean_s": float(a[:, i].mean())
            for i, name in enumerate(("setup", "calls_span", "teardown", "eval"))
        },
    }


# One mechanism of the model left out at a time: (name, calibrate() options, SimConfig changes).
ABLATIONS = (
    ("no harness setup / teardown / evaluation (records only)", {"with_timing": False}, {}),
    ("no warm-up replay (compiles of step 0)", {"warmup_replay": False}, {}),
    ("no serving pause at step boundaries", {"serving_pause": False}, {}),
    ("no packer lookahead (micro-batches stream at once)", {}, {"pack_lookahead": 0}),
    ("per-execution streaming instead of whole groups", {}, {"stream_unit": "execution"}),
    ("no prefill interference", {}, {"prefill_interference": False}),
    ("sessions on the last cell instead of balanced", {}, {"placement": "last"}),
)


def _summary(report) -> dict:
    return {
        "mean_abs_error": report.mean_abs_error,
        "max_abs_error": report.max_abs_error,
        "total_error": sum(report.predicted_s) / sum(report.measured_s) - 1,
        "within": report.within_tolerance,
    }


def calibrate_one(run: Path, skip_first: int, tolerance: float) -> dict:
    base = calibrate(run, skip_first=skip_first, tolerance=tolerance, with_timing=False)
    writer = TimelineWriter(None, [f"cell{c}" for c in range(base.config.num_cells)], source="sim", keep_in_memory=True)
    model = calibrate(run, skip_first=skip_first, tolerance=tolerance, timeline=writer, trace_executions=True)
    ablations = {}
    for name, options, changes in ABLATIONS:
        config = run_sim_config(run, steps=model.config.steps).replace(**changes) if changes else None
        ablations[name] = _summary(calibrate(run, config, skip_first=skip_first, tolerance=tolerance, **options).report)
    steps = model.config.steps
    real_tl = load_timeline(min((run / "timeline").glob("*.json")))  # the first segment's timeline
    measured_phases = phases(real_tl, steps)
    predicted_phases = phases(load_timeline(writer.events), steps)
    cfg = model.config
    return {
        "run_dir": str(run),
        "policy": cfg.policy,
        "policy_options": dict(cfg.policy_options),
        "cells": cfg.num_cells,
        "cell_accelerators": cfg.cell_accelerators,
        "slots_per_cell": cfg.slots_per_cell,
        "batch_size": cfg.batch_size,
        "steps": steps,
        "skip_first": skip_first,
        "measured_s": model.measured_s,
        "model": model.report.to_dict(),
        "baseline_records_only": base.report.to_dict(),
        "ablations": ablations,
        "phases": {"measured": measured_phases, "predicted": predicted_phases},
        "execution_timing": timing_summary(run, steps),
        "cost_model": cfg.cost.to_dict(),
        "measurement_notes": model.notes,
    }


def table(row: dict) -> str:
    m, b = row["model"], row["baseline_records_only"]
    ph_m = {p["step"]: p for p in row["phases"]["measured"]}
    ph_p = {p["step"]: p for p in row["phases"]["predicted"]}
    lines = [
        (
            f"{row['run_dir']}  ({row['policy']}, {row['cells']} cells x {row['cell_accelerators']} devices, "
            f"{row['slots_per_cell']} slots per cell, {row['batch_size']} executions per step)"
        ),
        "step  measured_s  predicted_s  error   baseline_s  error   rollout meas/pred  after-rollout meas/pred",
    ]
    for i, k in enumerate(m["steps"]):
        pm, pp = ph_m.get(k, {}), ph_p.get(k, {})
        lines.append(
            f"{k:4d}  {m['measured_s'][i]:10.2f}  {m['predicted_s'][i]:11.2f}  {m['relative_error'][i]:+6.1%}  "
            f"{b['predicted_s'][i]:10.2f}  {b['relative_error'][i]:+6.1%}   "
            f"{pm.get('rollout_s', float('nan')):6.2f} / {pp.get('rollout_s', float('nan')):6.2f}    "
            f"{pm.get('after_rollout_s', float('nan')):6.2f} / {pp.get('after_rollout_s', float('nan')):6.2f}"
        )
    t = row["execution_timing"]
    lines.append(
        f"model:    mean |error| {m['mean_abs_error']:.1%}, max {m['max_abs_error']:.1%}, total time "
        f"{sum(m['predicted_s']) / sum(m['measured_s']) - 1:+.1%} "
        f"({'within' if m['within_tolerance'] else 'NOT within'} {m['tolerance']:.0%} per step)"
    )
    lines.append(
        f"baseline: mean |error| {b['mean_abs_error']:.1%}, max {b['max_abs_error']:.1%}, total time "
        f"{sum(b['predicted_s']) / sum(b['measured_s']) - 1:+.1%} (records only: no harness start-up, "
        f"teardown or evaluation)"
    )
    lines.append("what each mechanism is worth (left out alone): mean |error| / max / total time")
    for name, a in row["ablations"].items():
        lines.append(f"  {name:<56s} {a['mean_abs_error']:6.1%} / {a['max_abs_error']:6.1%} / {a['total_error']:+6.1%}")
    lines.append(
        f"per execution: setup {t['setup_mean_s']:.2f} s, calls {t['calls_span_mean_s']:.2f} s, teardown "
        f"{t['teardown_mean_s']:.2f} s, evaluation {t['eval_mean_s']:.2f} s (mean of {t['executions']})"
    )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(rows), figsize=(4.5 * len(rows), 3.6), squeeze=False)
    for ax, row in zip(axes[0], rows):
        m, b = row["model"], row["baseline_records_only"]
        ax.plot(m["steps"], m["measured_s"], "o-", color="black", label="measured")
        ax.plot(m["steps"], m["predicted_s"], "s-", color="#D9534F", label="simulated (model)")
        ax.plot(m["steps"], b["predicted_s"], "^--", color="#999999", label="simulated (records only)")
        lo = np.asarray(m["measured_s"])
        ax.fill_between(
            m["steps"],
            lo * (1 - m["tolerance"]),
            lo * (1 + m["tolerance"]),
            color="black",
            alpha=0.08,
            label=f"measured +-{m['tolerance']:.0%}",
        )
        ax.set_title(
            f"{row['run_dir']}\n{row['policy']}: mean |error| {m['mean_abs_error']:.1%}, max {m['max_abs_error']:.1%}",
            fontsize=9,
        )
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("step time (s)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (python -m gyre_jax.train --config.workdir)")
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "calibration")
    ap.add_argument("--skip-first", type=int, default=1, help="steps left out (the first includes jit compiles)")
    ap.add_argument("--tolerance", type=float, default=0.15)
    args = ap.parse_args(argv)
    rows, tables = [], []
    for run in args.runs:
        try:
            row = calibrate_one(run, args.skip_first, args.tolerance)
        except (FileNotFoundError, ValueError, KeyError) as exc:
            print(f"error: {run}: {exc}", file=sys.stderr)
            return 2
        tables.append(table(row))
        print(tables[-1] + "\n", flush=True)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.json").write_text(
        json.dumps({"skip_first": args.skip_first, "tolerance": args.tolerance, "runs": rows}, indent=2) + "\n"
    )
    plot(rows, args.out / "calibration.png")
    command = "python experiments/calibrate_cpu_run.py " + " ".join(str(r) for r in args.runs)
    (args.out / "summary.md").write_text(
        f"# Simulator calibration against real CPU runs\n\n`{command}`\n\n```\n" + "\n\n".join(tables) + "\n```\n"
    )
    print(f"wrote {args.out / 'calibration.json'}, {args.out / 'summary.md'} and {args.out / 'calibration.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
