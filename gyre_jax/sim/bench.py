"""Simulator speed: 48 steps of a 1024-accelerator cluster with 1024 executions per step, per policy.

    python -m gyre_jax.sim.bench [--preset deepswe] [--steps 48] [--out benchmarks/results/sim_speed.json]

The bar: at most 10 s on this CPU (CPU seconds of this process, which a shared machine does not inflate;
wall seconds are reported too). The named baseline, in the same run: the same simulation at per-call
resolution (every model call its own event, ``segments`` = the workload's most turns) over fewer steps;
the table gives the speed ratio and how far the default resolution's step time is from it. The same
seed is run twice to check that the result is identical.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from gyre_jax.sim.config import load_sim_config
from gyre_jax.sim.simulator import simulate

REPO = Path(__file__).resolve().parents[2]


def timed(preset: str, overrides: dict) -> dict:
    cfg = load_sim_config(preset, overrides)
    c0, w0 = time.process_time(), time.perf_counter()
    r = simulate(cfg)
    return {
        "policy": cfg.policy,
        "steps": cfg.steps,
        "segments": cfg.segments,
        "accelerators": cfg.accelerators,
        "executions_per_step": cfg.batch_size,
        "events": r.sim["events"],
        "cpu_s": time.process_time() - c0,
        "wall_s": time.perf_counter() - w0,
        "step_time_min": r.step_time_s / 60,
        "makespan_s": r.makespan_s,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="deepswe")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--baseline-steps", type=int, default=8, help="steps for the per-call baseline")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sim_speed.json"))
    args = ap.parse_args(argv)
    most_turns = int(load_sim_config(args.preset).workload.turns.hi)
    rows = [
        dict(name=f"{p}, 8 segments per execution", **timed(args.preset, {"steps": args.steps, "schedule.policy": p}))
        for p in ("colocated", "async", "elastic")
    ]
    again = timed(args.preset, {"steps": args.steps})
    short = timed(args.preset, {"steps": args.baseline_steps})
    base = timed(args.preset, {"steps": args.baseline_steps, "segments": most_turns})
    rows += [
        dict(name="elastic, 8 segments (same steps as the baseline)", **short),
        dict(name="baseline: elastic, per call", **base),
    ]
    report = {
        "preset": args.preset,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
        "rows": rows,
        "bar_cpu_s": 10.0,
        "within_bar": all(r["cpu_s"] <= 10.0 for r in rows[:3]),
        "deterministic": again["makespan_s"] == rows[2]["makespan_s"],
        "speedup_over_per_call": base["cpu_s"] / short["cpu_s"],
        "step_time_vs_per_call": short["step_time_min"] / base["step_time_min"] - 1,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"{'run':<52} {'steps':>5} {'events':>9} {'CPU s':>7} {'wall s':>7} {'min/step':>8}")
    for r in rows:
        print(
            f"{r['name']:<52} {r['steps']:>5} {r['events']:>9,} {r['cpu_s']:>7.2f} {r['wall_s']:>7.2f} "
            f"{r['step_time_min']:>8.2f}"
        )
    print(
        f"per-call baseline: {report['speedup_over_per_call']:.1f}x slower to simulate; the 8-segment step time "
        f"differs from it by {report['step_time_vs_per_call']:+.1%}"
    )
    print(
        f"bar (<= 10 CPU s for {args.steps} steps): {'met' if report['within_bar'] else 'NOT met'}; "
        f"same seed, same result: {report['deterministic']}; load average {report['load_average'][0]:.1f} "
        f"on {os.cpu_count()} cores; wrote {out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
