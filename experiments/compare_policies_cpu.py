"""Colocated vs async vs elastic on this machine: the same tiny workload and seed, real runs end to end.

Each policy runs ``python -m gyre_jax.train --config configs/tiny_cpu.py --config.schedule.policy=P`` with
the shared overrides below (long-tailed tool times; serving capacity for one step's executions), then
this script reads each run's metrics, timeline and measured costs and writes:

    <out>/compare_policies.json     per policy: step times, idle fractions, switch times, staleness
    <out>/summary.md                the table (also printed)
    <out>/gantt_<policy>.png        the run's timeline (experiments/plot_timeline.py)
    <out>/<policy>/                 the run directory itself (timeline/, decisions.jsonl, cost_measurements.json ...)

Run: python experiments/compare_policies_cpu.py [--steps 6] [--out experiments/results/compare_policies_cpu]

The baseline is colocated: speedup = colocated mean step time / policy mean step time (steps after the
first, which includes compilation). On CPU every cell shares the same 2 cores, so a cell that trains
slows the cells that serve: see docs/elastic.md for what this can and cannot show.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
POLICIES = ("colocated", "async", "elastic")
SHARED = [
    "--config",
    "configs/tiny_cpu.py",
    # 8 virtual devices in 2 cells of 4 (the default run has 2 devices; the recorded comparisons used these)
    "--config.devices.num_cpu_devices=8",
    "--config.mesh.data=4",
    "--config.mesh.fsdp=2",
    "--config.cells.data=4",
    "--config.eval.samples_per_task=0",
    "--config.rollout.tasks_per_step=2",  # the recorded workload: 2 tasks x 8 of a 16-task set (the default is 4 x 8 of 64)
    "--config.rollout.num_tasks=16",
    "--config.metrics.progress_bar=false",
    "--config.metrics.tensorboard=false",
    "--config.warm_start.steps=150",
    "--config.rollout.tool_latency_median_s=0.5",  # lognormal tool times: a long tail of slow tools
    "--config.rollout.tool_latency_sigma=1.2",
    "--config.cells.sessions_per_cell=8",  # 2 cells x 8 = one step's 16 executions
    "--config.checkpoint_every=100",
]


def run_policy(policy: str, steps: int, out: Path, extra: list[str]) -> dict:
    workdir = out / policy
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    t0 = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gyre_jax.train",
            *SHARED,
            f"--config.workdir={workdir}",
            f"--config.total_steps={steps}",
            f"--config.schedule.policy={policy}",
            *extra,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    (out / f"{policy}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{policy} run failed (exit {proc.returncode}); see {out / f'{policy}.log'}")
    metrics = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [m for m in metrics if m.get("phase") == "train"]
    cells = sorted(k.split("/", 1)[1] for k in train[0] if k.startswith("idle_fraction/"))
    later = train[1:]  # step 0 includes the jit compiles of every cell's serving and training functions
    meas = json.loads((workdir / "cost_measurements.json").read_text())
    timeline = sorted((workdir / "timeline").glob("*.json"))[-1]
    subprocess.run(
        [
            sys.executable,
            str(REPO / "experiments" / "plot_timeline.py"),
            str(timeline),
            "--out",
            str(out / f"gantt_{policy}.png"),
            "--title",
            f"{policy} on 8 virtual CPU devices (2 cells)",
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return {
        "policy": policy,
        "wall_s": time.time() - t0,
        "step_s": [m["step_s"] for m in train],
        "mean_step_s": float(np.mean([m["step_s"] for m in later])),
        "idle_fraction": float(np.mean([m["idle_fraction"] for m in later])),
        "idle_fraction_per_cell": {c: float(np.mean([m[f"idle_fraction/{c}"] for m in later])) for c in cells},
        "micro_steps_per_cell": {c: int(sum(m[f"micro_steps/{c}"] for m in train)) for c in cells},
        "staleness_mean": float(np.mean([m["staleness_mean"] for m in train])),
        "reward_mean": float(np.mean([m["reward_mean"] for m in train])),
        "serving_to_training_s": meas["serving_to_training"],
        "training_to_serving_s": meas["training_to_serving"],
        "weight_sync_s": float(np.mean(meas["weight_syncs"])) if meas["weight_syncs"] else 0.0,
        "run_dir": str(workdir),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "compare_policies_cpu")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("extra", nargs="*", help="more --config.* overrides for every run")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for policy in args.policies.split(","):
        print(f"running {policy} ({args.steps} steps) ...", flush=True)
        rows.append(run_policy(policy, args.steps, args.out, args.extra))
    base = next((r for r in rows if r["policy"] == "colocated"), rows[0])
    lines = [
        "| policy | mean step s (steps 2..) | speedup vs colocated | idle fraction | switch s->t / t->s (s, mean) | "
        "weight sync s | staleness | micro-steps per cell |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        r["speedup_vs_colocated"] = base["mean_step_s"] / r["mean_step_s"]
        s2t = f"{np.mean(r['serving_to_training_s']):.3f}" if r["serving_to_training_s"] else "-"
        t2s = f"{np.mean(r['training_to_serving_s']):.3f}" if r["training_to_serving_s"] else "-"
        lines.append(
            f"| {r['policy']} | {r['mean_step_s']:.1f} | {r['speedup_vs_colocated']:.2f}x | "
            f"{r['idle_fraction']:.2f} | {s2t} / {t2s} | {r['weight_sync_s']:.3f} | {r['staleness_mean']:.2f} | "
            f"{r['micro_steps_per_cell']} |"
        )
    table = "\n".join(lines)
    print(table)
    (args.out / "compare_policies.json").write_text(
        json.dumps(
            {"steps": args.steps, "shared_overrides": SHARED[2:], "extra_overrides": args.extra, "runs": rows}, indent=2
        )
    )
    (args.out / "summary.md").write_text(f"# Policies on CPU ({args.steps} steps, same workload and seed)\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
