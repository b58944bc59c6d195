"""Benchmark: one RL step of a run config split into its parts, per cell, each compute part against its roofline
(issue 47 item 2).

    python benchmarks/bench_step_profile.py                                   # configs/smollm2_cpu.py, 2 steps
    python benchmarks/bench_step_profile.py --steps 3 --config.rollout.tasks_per_step=2
    python benchmarks/bench_step_profile.py --run-dir runs/smollm2_cpu         # profile a run already made
    python benchmarks/bench_step_profile.py --workdir /tmp/profiled            # keep the run it makes
    python benchmarks/bench_step_profile.py --smoke                            # configs/tiny_cpu.py, small: for tests

1. Runs ``python -m gyre_jax.train`` on the config for ``--steps`` RL steps (no evaluation, a fresh work directory;
   ``--config.*`` overrides pass through) as a user would, in its own process.
2. Splits every step into prefill, decode, training, optimizer, publish, switch, proxy, harness, verifier and idle
   per cell (``gyre_jax.sim.step_profile``: each cell's parts add up to the step's window).
3. Measures this machine's rooflines in the same run, before and after the training (the benchmark's own process,
   one CPU device with the run's thread pool): the best float32 matmul rate (``bench_model.matmul_peak``) and the
   read bandwidth of a jitted sum over a 512 MB array. Each compute part's achieved rate over the time any cell
   spent in it (the run's cells share the host's cores):
   - training: micro-step FLOPs (``ModelConfig.train_flops``, as the controller books them) / seconds, vs the peak;
   - prefill: 2 x (matmul parameters without the embedding table) per prompt token (attention not counted: a lower
     bound) / seconds, vs the peak;
   - decode: bytes read per decode step (every parameter at the serving dtype + the KV of the batch's context) /
     seconds, vs the bandwidth;
   - optimizer: AdamW's bytes (read parameter, gradient, both moments; write parameter and moments: 7 float32 words
     per parameter) / seconds, vs the bandwidth.
4. Prints the table of the last step (the first compiles) and each part's share; writes JSON (``--out``, default
   ``benchmarks/results/step_profile.json``; ``--smoke``: ``step_profile_smoke.json``) and the step's Gantt (PNG
   beside the JSON): each cell's parts over the step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

COLORS = {
    "prefill": "#8E44AD",
    "decode": "#4C9BE8",
    "training": "#D9534F",
    "optimizer": "#5CB85C",
    "publish": "#2E8B57",
    "switch": "#B0B0B0",
    "proxy": "#F1C40F",
    "harness": "#F2A541",
    "verifier": "#A0522D",
    "idle": "#FFFFFF",
}
SMOKE = ["--config", "configs/tiny_cpu.py", "--config.warm_start.steps=20", "--config.rollout.tasks_per_step=1",
         "--config.rl.group_size=2", "--config.rollout.num_tasks=2"]  # fmt: skip


def rooflines() -> dict:
    """This process's best float32 matmul FLOP/s and the read bandwidth of a jitted sum (bytes/s)."""
    import jax
    import jax.numpy as jnp
    from bench_model import matmul_peak

    peak = matmul_peak((1024, 2048), "float32")
    x = jnp.ones((128 * 1024 * 1024,), jnp.float32)  # 512 MB
    f = jax.jit(lambda a: a.sum())
    f(x).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return {"matmul_flops_per_s": peak["flops_per_s"], "matmul_n": peak["n"], "read_bytes_per_s": x.nbytes / min(times)}


def run_training(args: list[str], workdir: Path, steps: int, timeout: float) -> float:
    """``python -m gyre_jax.train`` for ``steps`` RL steps without evaluation; its wall time (s)."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the entry point creates its own virtual devices
    cmd = [sys.executable, "-m", "gyre_jax.train", *args, f"--config.workdir={workdir}",
           f"--config.total_steps={steps}", "--config.eval.samples_per_task=0", "--config.metrics.progress_bar=false"]  # fmt: skip
    t0 = time.time()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"the training run failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return time.time() - t0


def work_rates(profile, model_cfg, serving_bytes: int, peaks: dict) -> dict:
    """Each compute part's work, achieved rate and fraction of its roofline (see the module docstring)."""
    w, union = profile.work, profile.busy_union_s
    e, v = model_cfg.embed_dim, model_cfg.vocab_size
    n_params = model_cfg.num_params
    matmul_params = model_cfg.num_active_params - v * e * (1 if model_cfg.tie_embeddings else 2) - e
    kv_bytes_per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * serving_bytes
    parts = {
        "training": (w["training_flops"], "FLOP/s", peaks["matmul_flops_per_s"]),
        "prefill": (2.0 * matmul_params * w["prefill_tokens"], "FLOP/s", peaks["matmul_flops_per_s"]),
        "decode": (
            w["decode_steps"] * n_params * serving_bytes + w["decode_context_tokens"] * kv_bytes_per_token,
            "bytes/s",
            peaks["read_bytes_per_s"],
        ),
        "optimizer": (7 * 4 * n_params, "bytes/s", peaks["read_bytes_per_s"]),
    }
    out = {}
    for name, (amount, unit, roof) in parts.items():
        sec = union[name]
        rate = amount / sec if sec > 0 else 0.0
        out[name] = {"seconds": sec, "work": amount, "unit": unit, "rate": rate, "roofline": roof,
                     "fraction_of_roofline": rate / roof if roof else 0.0}  # fmt: skip
    return out


def gantt(profile, out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(profile.segments)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * len(cells)))
    for i, cell in enumerate(cells):
        y = len(cells) - 1 - i
        by_part: dict[str, list] = {}
        for a, b, part in profile.segments[cell]:
            by_part.setdefault(part, []).append((a, b - a))
        for part, bars in by_part.items():
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLORS[part], edgecolor="none")
    ax.set_yticks(range(len(cells)), list(reversed(cells)))
    ax.set_xlim(0, profile.window_s)
    ax.set_xlabel("seconds from the step's start")
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=COLORS[p], edgecolor="black", linewidth=0.3) for p in COLORS]
    ax.legend(handles, list(COLORS), ncol=len(COLORS), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def rates_table(rates: dict) -> str:
    rows = ["| part | seconds (any cell) | achieved | roofline | fraction |", "|---|---:|---:|---:|---:|"]
    for name, r in rates.items():
        unit = "GFLOP/s" if r["unit"] == "FLOP/s" else "GB/s"
        rows.append(f"| {name} | {r['seconds']:.1f} | {r['rate'] / 1e9:.1f} {unit} | {r['roofline'] / 1e9:.1f} "
                    f"{unit} | {100 * r['fraction_of_roofline']:.1f}% |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/smollm2_cpu.py")
    ap.add_argument(
        "--steps", type=int, default=2, help="RL steps to run (the last one is reported; the first compiles)"
    )
    ap.add_argument("--run-dir", default=None, help="profile this run directory instead of running the config")
    ap.add_argument("--workdir", default=None, help="run the config here and keep the run (default: a temporary one)")
    ap.add_argument("--smoke", action="store_true", help="configs/tiny_cpu.py, small, 2 steps")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds the training run may take")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        ap.error(f"unknown arguments {bad}: only --config.<key>=<value> overrides pass through to the run")
    from gyre_jax import config as config_lib
    from gyre_jax.config.run import RunConfig
    from gyre_jax.export import export_model_config
    from gyre_jax.sim.step_profile import step_profiles, table

    train_args = SMOKE if args.smoke else ["--config", args.config]
    train_args = [*train_args, *overrides]
    if args.run_dir:  # the run's own config
        config = RunConfig.from_config_dict(json.loads((Path(args.run_dir) / "config.json").read_text()))
    else:
        config = config_lib.load_config(train_args)  # a bad config or override fails here, before any work
    out = Path(
        args.out or REPO / "benchmarks" / "results" / ("step_profile_smoke.json" if args.smoke else "step_profile.json")
    )
    load_before = os.getloadavg()[0]
    before = rooflines()
    wall = None
    if args.workdir and Path(args.workdir).exists():
        ap.error(f"--workdir {args.workdir} exists: name a new directory (the run must start fresh)")
    with tempfile.TemporaryDirectory(prefix="step_profile_") as tmp:
        run = Path(args.run_dir or args.workdir or Path(tmp) / "run")
        if not args.run_dir:
            wall = run_training(train_args, run, args.steps, args.timeout)
        after = rooflines()
        profiles = step_profiles(run)
    if not profiles:
        raise SystemExit(f"{run}: no step with a weight publish in its timeline to profile")
    peaks = {k: max(before[k], after[k]) for k in ("matmul_flops_per_s", "read_bytes_per_s")}
    model_cfg = export_model_config(config)
    serving_bytes = 2 if config.model.dtype == "bfloat16" else 4
    steps = []
    for prof in profiles:
        steps.append({**prof.to_dict(), "rates": work_rates(prof, model_cfg, serving_bytes, peaks)})
    last = profiles[-1]
    title = f"{'smoke: tiny_cpu' if args.smoke else args.config}: step {last.step} ({last.window_s:.1f} s)"
    png = gantt(last, out.with_suffix(".png"), title)
    report = {
        "benchmark": "step_profile",
        "config": args.run_dir or ("configs/tiny_cpu.py (smoke)" if args.smoke else args.config),
        "overrides": overrides,
        "steps_run": args.steps,
        "run_wall_s": wall,
        "baseline": "this machine's float32 matmul peak and read bandwidth, measured in the same run before and after "
        "the training (the better of the two)",
        "rooflines": {"before": before, "after": after, "used": peaks},
        "model": {
            "params": model_cfg.num_params,
            "layers": model_cfg.num_layers,
            "embed_dim": model_cfg.embed_dim,
            "vocab": model_cfg.vocab_size,
            "serving_bytes_per_param": serving_bytes,
        },  # fmt: skip
        "load_avg_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "steps": steps,
        "gantt": str(png.relative_to(REPO)) if png.is_relative_to(REPO) else str(png),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"step {last.step}: {last.window_s:.1f} s (run of {args.steps} steps in {wall or 0:.0f} s; load "
          f"{load_before:.1f} -> {report['load_avg_1min']['after']:.1f})")  # fmt: skip
    print(table(last))
    print()
    print(rates_table(steps[-1]["rates"]))
    print(f"\nwrote {out} and {png}")
    return report


if __name__ == "__main__":
    main()
