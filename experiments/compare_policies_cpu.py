"""Colocated vs async vs elastic on this machine: the same tiny workload and seeds, real runs end to end.

Each policy runs ``python -m gyre_jax.train --config configs/tiny_cpu.py --config.schedule.policy=P
--config.seed=S`` with the shared overrides below (long-tailed tool times; serving capacity for one step's
executions), once per seed (the policies of one seed run one after another, so slow drifts of the shared
machine's load fall on every policy alike), then this script reads each run's metrics, timeline and
measured costs and writes:

    <out>/compare_policies.json     per policy: per-seed step times, idle fractions, switch times, staleness,
                                    and over the seeds: means with 95% intervals, speedups vs colocated
    <out>/summary.md                the table (also printed)
    <out>/gantt_<policy>.png        the first seed's timeline (experiments/plot_timeline.py)
    <out>/seed<S>/<policy>/         the run directories (timeline/, decisions.jsonl, cost_measurements.json ...)
                                    (with --seeds 1 and --first-seed 0: <out>/<policy>/, as before)

Run: python experiments/compare_policies_cpu.py [--steps 6] [--seeds 3] [--out experiments/results/compare_policies_cpu]
     python experiments/compare_policies_cpu.py --analyze-only --seeds 3 --out DIR   # statistics of finished runs

The baseline is colocated: speedup = colocated mean step time / policy mean step time (steps after the
first, which includes compilation), per seed (paired: the same tasks and tool times), then averaged.
Intervals: a two-level percentile bootstrap (resample the seeds, then each resampled seed's steps), so
they cover both the seed-to-seed variation and the step-to-step noise within a run. A completed run is not
run again (an interrupted invocation resumes). On CPU every cell shares the same 2 cores, so a cell that
trains slows the cells that serve: see docs/elastic.md for what this can and cannot show.
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


CONFIDENCE = 0.95


def run_policy(policy: str, seed: int, steps: int, workdir: Path, extra: list[str]) -> float:
    """Runs one policy for one seed into ``workdir`` (its log beside it); returns the wall time in seconds."""
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
            f"--config.seed={seed}",
            *extra,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    log = workdir.parent / f"{policy}.log"
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{policy} run (seed {seed}) failed (exit {proc.returncode}); see {log}")
    return time.time() - t0


def _train_metrics(workdir: Path) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [m for m in (json.loads(x) for x in lines if x.strip()) if m.get("phase") == "train"]


def complete(workdir: Path, steps: int) -> bool:
    """Whether ``workdir`` holds a finished run of ``steps`` RL steps."""
    try:
        return len(_train_metrics(workdir)) >= steps and (workdir / "cost_measurements.json").exists()
    except (OSError, ValueError):
        return False


def read_policy_run(policy: str, seed: int, workdir: Path, wall_s: float | None) -> dict:
    """One run's figures: per-step times and idle fractions (steps after the first, which compiles), switches."""
    train = _train_metrics(workdir)
    cells = sorted(k.split("/", 1)[1] for k in train[0] if k.startswith("idle_fraction/"))
    later = train[1:]  # step 0 includes the jit compiles of every cell's serving and training functions
    if not later:
        raise SystemExit(f"{workdir}: {len(train)} RL step(s); the comparison needs --steps >= 2")
    meas = json.loads((workdir / "cost_measurements.json").read_text())
    return {
        "policy": policy,
        "seed": seed,
        "wall_s": wall_s,
        "step_s": [m["step_s"] for m in train],
        "idle_fractions": [m["idle_fraction"] for m in later],
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


def _resampled_mean(values: np.ndarray, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    """[n_boot]: the mean of ``values`` (one seed's steps) over ``n_boot`` resamples."""
    return values[rng.integers(0, values.size, size=(n_boot, values.size))].mean(axis=1)


def _two_level(k: int, rng: np.random.Generator, n_boot: int, replicate) -> np.ndarray:
    """[n_boot]: the two-level bootstrap of a mean over k seeds. Each replicate resamples the seeds (k of k),
    and each picked seed contributes its own replicate ``replicate(i)`` ([n_boot]: seed i's steps resampled)."""
    picks = rng.integers(0, k, size=(n_boot, k))
    out = np.empty((n_boot, k))
    for i in range(k):
        rows = np.nonzero(picks == i)
        out[rows] = replicate(i)[rows[0]]
    return out.mean(axis=1)


def _summary(per_seed: list[float], reps: np.ndarray) -> dict:
    a = (1 - CONFIDENCE) / 2
    return {
        "mean": float(np.mean(per_seed)),
        "low": float(np.quantile(reps, a)),
        "high": float(np.quantile(reps, 1 - a)),
        "per_seed": per_seed,
    }


def interval(per_seed: list[list[float]], n_boot: int = 10_000, seed: int = 0) -> dict:
    """Mean over seeds of each seed's mean, with the 95% two-level bootstrap interval (seeds, then steps)."""
    arrays = [np.asarray(v, np.float64) for v in per_seed]
    rng = np.random.default_rng(seed)
    reps = _two_level(len(arrays), rng, n_boot, lambda i: _resampled_mean(arrays[i], rng, n_boot))
    return _summary([float(x.mean()) for x in arrays], reps)


def speedup_interval(base: list[list[float]], other: list[list[float]], n_boot: int = 10_000, seed: int = 0) -> dict:
    """Mean over seeds of base_mean_step / other_mean_step (paired by seed), with its two-level bootstrap
    interval: the same seeds are picked for both policies, their steps resampled independently."""
    b = [np.asarray(v, np.float64) for v in base]
    o = [np.asarray(v, np.float64) for v in other]
    rng = np.random.default_rng(seed)
    reps = _two_level(
        len(b), rng, n_boot, lambda i: _resampled_mean(b[i], rng, n_boot) / _resampled_mean(o[i], rng, n_boot)
    )
    return _summary([float(bi.mean() / oi.mean()) for bi, oi in zip(b, o)], reps)


def summarize(runs: list[dict], n_boot: int = 10_000) -> dict:
    """Per policy over its seeds: step time, idle fraction and speedup vs colocated (means, 95% intervals)."""
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    by = {p: sorted((r for r in runs if r["policy"] == p), key=lambda r: r["seed"]) for p in policies}
    seeds = [r["seed"] for r in by[policies[0]]]
    for p in policies:
        if [r["seed"] for r in by[p]] != seeds:
            raise SystemExit(f"policy {p} ran seeds {[r['seed'] for r in by[p]]}, {policies[0]} ran {seeds}")
    base = "colocated" if "colocated" in by else policies[0]
    out = {}
    for p in policies:
        steps = [r["step_s"][1:] for r in by[p]]
        out[p] = {
            "seeds": seeds,
            "step_s": interval(steps, n_boot),
            "idle_fraction": interval([r["idle_fractions"] for r in by[p]], n_boot),
            f"speedup_vs_{base}": speedup_interval([r["step_s"][1:] for r in by[base]], steps, n_boot),
            "staleness_mean": float(np.mean([r["staleness_mean"] for r in by[p]])),
            "serving_to_training_s": float(np.mean([x for r in by[p] for x in r["serving_to_training_s"]] or [0.0])),
            "training_to_serving_s": float(np.mean([x for r in by[p] for x in r["training_to_serving_s"]] or [0.0])),
        }
    out["baseline"] = base
    return out


def table(summary: dict) -> str:
    base = summary["baseline"]
    lines = [
        f"| policy | mean step s (steps 2..) [95%] | speedup vs {base} [95%] | idle fraction [95%] | per seed: step s / "
        "idle | switch s->t / t->s (s, mean) | staleness |",
        "|---|---|---|---|---|---|---|",
    ]
    for p, v in summary.items():
        if p == "baseline":
            continue
        st, sp, idle = v["step_s"], v[f"speedup_vs_{base}"], v["idle_fraction"]
        per_seed = ", ".join(f"{a:.1f} / {b:.2f}" for a, b in zip(st["per_seed"], idle["per_seed"]))
        s2t = f"{v['serving_to_training_s']:.3f}" if v["serving_to_training_s"] else "-"
        t2s = f"{v['training_to_serving_s']:.3f}" if v["training_to_serving_s"] else "-"
        lines.append(
            f"| {p} | {st['mean']:.1f} [{st['low']:.1f}, {st['high']:.1f}] | {sp['mean']:.2f}x [{sp['low']:.2f}, "
            f"{sp['high']:.2f}] | {idle['mean']:.2f} [{idle['low']:.2f}, {idle['high']:.2f}] | {per_seed} | "
            f"{s2t} / {t2s} | {v['staleness_mean']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "compare_policies_cpu")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--analyze-only", action="store_true", help="read finished runs under --out, run nothing")
    ap.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples")
    ap.add_argument("extra", nargs="*", help="more --config.* overrides for every run")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: the first step compiles and is left out, so at least 2 are needed")
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        ap.error(f"--policies: unknown {unknown}; choose from {','.join(POLICIES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    legacy = seeds == [0]  # one seed 0: the run directories of the single-seed layout (<out>/<policy>)
    runs = []
    for seed in seeds:
        for policy in policies:
            workdir = args.out / policy if legacy else args.out / f"seed{seed}" / policy
            wall = None
            if not complete(workdir, args.steps):
                if args.analyze_only:
                    raise SystemExit(f"error: {workdir} holds no finished {args.steps}-step run (--analyze-only)")
                print(f"running {policy}, seed {seed} ({args.steps} steps) ...", flush=True)
                wall = run_policy(policy, seed, args.steps, workdir, args.extra)
            runs.append(read_policy_run(policy, seed, workdir, wall))
    for policy in policies:
        first = next(r for r in runs if r["policy"] == policy)
        timeline = sorted((Path(first["run_dir"]) / "timeline").glob("*.json"))[-1]
        subprocess.run(
            [
                sys.executable,
                str(REPO / "experiments" / "plot_timeline.py"),
                str(timeline),
                "--out",
                str(args.out / f"gantt_{policy}.png"),
                "--title",
                f"{policy} on 8 virtual CPU devices (2 cells), seed {first['seed']}",
            ],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
    summary = summarize(runs, args.bootstrap)
    text = table(summary)
    print(text)
    (args.out / "compare_policies.json").write_text(
        json.dumps(
            {
                "steps": args.steps,
                "seeds": seeds,
                "confidence": CONFIDENCE,
                "shared_overrides": SHARED[2:],
                "extra_overrides": args.extra,
                "summary": summary,
                "runs": runs,
            },
            indent=2,
        )
    )
    (args.out / "summary.md").write_text(
        f"# Policies on CPU ({args.steps} steps, seeds {seeds}; means with 95% intervals)\n\n{text}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
