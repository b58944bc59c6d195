"""Trajectory-cap ablation: J_max = 1, 3, 5 and uncapped, from forward-backward work to end-to-end step time.

    python experiments/ablate_traj_cap.py                                  # flagship + nl2repo, 48 steps
    python experiments/ablate_traj_cap.py --measured benchmarks/results/trajectory_cpu.json
    python experiments/ablate_traj_cap.py --quick                          # seconds, for CI

Two levels:
1. Forward-backward work per execution under each cap, from the trajectory cost model
   (``gyre_jax/sim/trajectory_cost.py``: main branch, context-summary branches, sub-agent branches; a
   branch of l tokens costs 6 N l + 6 L d l^2 FLOPs), on the preset's sampled executions, as a share of
   the uncapped work, beside the published shares (J_max = 5: 74.8%, J_max = 1: 41.4% of the uncapped
   forward-backward time).
2. What the cap does to a whole run: the simulator (``gyre_jax.sim``) runs each cap under colocated and
   elastic scheduling; the step time falls less than the training work, because rollouts dominate.

``--measured`` takes the ratios measured by ``benchmarks/bench_trajectory.py`` (real packing and real
micro-steps of a tiny model on CPU: ``step_time_vs_uncapped`` per variant) and runs the simulator with
them instead of the modelled ones. Writes ``<out>/ablate_traj_cap.json``, ``summary.md`` and
``traj_cap.png``. A progress bar shows on a terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gyre_jax.sim.config import load_sim_config  # noqa: E402
from gyre_jax.sim.simulator import simulate  # noqa: E402
from gyre_jax.sim.trajectory_cost import branches, capped_flops, capped_tokens  # noqa: E402
from gyre_jax.sim.workload import sample_step  # noqa: E402

PUBLISHED = {5: 0.748, 1: 0.414}  # share of the uncapped forward-backward time (seed articles)
CAPS = (1, 3, 5, None)
# --quick: the tiny preset with compactions and sub-agents, so that the caps bite
QUICK = {
    "workload.context_window": 8000,
    "workload.summary_tokens": 1000,
    "workload.subagent_fraction": 0.3,
    "workload.subagent_tokens": 3000.0,
}


def cap_name(cap) -> str:
    return "uncapped" if cap is None else f"J={cap}"


def work_shares(preset: str, sample_steps: int, overrides: dict) -> dict:
    """Forward-backward FLOPs and tokens of each cap relative to uncapped, over sampled executions."""
    cfg = load_sim_config(preset, overrides)
    tokens = np.concatenate(
        [
            sample_step(
                cfg.workload,
                cfg.cost.serving,
                step=k,
                tasks=cfg.tasks_per_step,
                group_size=cfg.group_size,
                seed=cfg.seed,
                segments=cfg.segments,
            ).tokens
            for k in range(sample_steps)
        ]
    )
    b = branches(tokens, cfg.workload.trajectory_shape())
    base_f = capped_flops(b, None, cfg.cost.training).sum()
    base_t = capped_tokens(b, None).sum()
    out = {
        "executions": int(len(tokens)),
        "tokens_mean": float(tokens.mean()),
        "branches_mean": float(b.count.mean()),
        "branches_p90": float(np.percentile(b.count, 90)),
        "caps": {},
    }
    for cap in CAPS:
        out["caps"][cap_name(cap)] = {
            "flops_share": float(capped_flops(b, cap, cfg.cost.training).sum() / base_f),
            "tokens_share": float(capped_tokens(b, cap).sum() / base_t),
            "published_share": PUBLISHED.get(cap),
        }
    return out


def measured_ratios(path: str) -> dict[str, float]:
    data = json.loads(Path(path).read_text())
    try:
        variants = data["training"]["variants"]
    except (KeyError, TypeError):
        raise SystemExit(
            f"error: {path} has no training.variants: expected the JSON of benchmarks/bench_trajectory.py"
        ) from None
    return {v["name"]: float(v["step_time_vs_uncapped"]) for v in variants if v.get("packing", "plain") == "plain"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="flagship,nl2repo")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--sample-steps", type=int, default=4, help="steps of executions for the work shares")
    ap.add_argument("--measured", default=None, help="bench_trajectory.py JSON: use its measured time ratios too")
    ap.add_argument("--quick", action="store_true", help="the tiny preset, 3 steps: seconds")
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "ablate_traj_cap"))
    args = ap.parse_args(argv)
    presets = ["tiny"] if args.quick else [p.strip() for p in args.presets.split(",") if p.strip()]
    steps = 3 if args.quick else args.steps
    extra = QUICK if args.quick else {}
    measured = measured_ratios(args.measured) if args.measured else {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    report: dict = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "steps": steps,
        "published_share": {cap_name(k): v for k, v in PUBLISHED.items()},
        "measured_ratios": measured or None,
        "presets": {},
    }
    jobs = [(p, pol, cap, None) for p in presets for pol in ("colocated", "elastic") for cap in CAPS]
    jobs += [
        (p, pol, None, (name, r))
        for p in presets
        for pol in ("colocated", "elastic")
        for name, r in measured.items()
        if name != "uncapped"
    ]
    runs: dict = {}
    for p, pol, cap, meas in tqdm(jobs, desc="simulating", unit="run", disable=not sys.stderr.isatty()):
        cfg = load_sim_config(p, {**extra, "steps": steps, "schedule.policy": pol, "max_branches": cap or 0})
        label = cap_name(cap)
        if meas is not None:
            label = f"{meas[0]} (measured)"
            cfg = cfg.replace(max_branches=None, train_work_scale=meas[1])
        r = simulate(cfg)
        runs.setdefault(p, {}).setdefault(pol, {})[label] = {
            "step_time_s": r.step_time_s,
            "training_flops": r.training["flops"],
            "busy_fraction": r.busy_fraction,
            "training_busy_fraction": r.training_busy_fraction,
            "micro_steps": r.training["micro_steps"],
        }
    for p in presets:
        shares = work_shares(p, 1 if args.quick else args.sample_steps, extra)
        per_policy = {}
        for pol, rows in runs[p].items():
            base = rows["uncapped"]
            per_policy[pol] = {
                k: {
                    **v,
                    "step_time_vs_uncapped": v["step_time_s"] / base["step_time_s"],
                    "training_flops_vs_uncapped": v["training_flops"] / base["training_flops"],
                }
                for k, v in rows.items()
            }
        report["presets"][p] = {"work_shares": shares, "runs": per_policy}
    report["wall_s"] = time.time() - t0
    (out / "ablate_traj_cap.json").write_text(json.dumps(report, indent=1))

    lines = [f"### Trajectory cap: forward-backward work and step time ({steps} steps)", ""]
    for p, d in report["presets"].items():
        s = d["work_shares"]
        lines += [
            f"**{p}**: {s['executions']} executions, {s['tokens_mean'] / 1e3:.0f}K trajectory tokens and "
            f"{s['branches_mean']:.1f} branches on average (p90 {s['branches_p90']:.0f})",
            "",
            "| cap | FB FLOPs vs uncapped (model) | FB tokens vs uncapped | published FB time | "
            "colocated step vs uncapped | elastic step vs uncapped | elastic training share |",
            "|---|---|---|---|---|---|---|",
        ]
        labels = list(d["runs"]["elastic"])
        for label in labels:
            c = s["caps"].get(label, {})
            pub = c.get("published_share")
            co, el = d["runs"]["colocated"][label], d["runs"]["elastic"][label]
            lines.append(
                f"| {label} | {c['flops_share']:.1%} | {c['tokens_share']:.1%} | "
                if c
                else f"| {label} | {el['training_flops_vs_uncapped']:.1%} (measured) | | "
            )
            lines[-1] += (f"{pub:.1%} | " if pub else "| ") + (
                f"{co['step_time_vs_uncapped']:.1%} | "
                f"{el['step_time_vs_uncapped']:.1%} | "
                f"{el['training_busy_fraction']:.1%} |"
            )
        lines.append("")
    md = "\n".join(lines)
    (out / "summary.md").write_text(md)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [cap_name(c) for c in CAPS]
    for i, p in enumerate(presets):
        s = report["presets"][p]["work_shares"]["caps"]
        axes[0].bar([j + 0.25 * i for j in range(len(names))], [s[n]["flops_share"] for n in names], 0.25, label=p)
        for pol, marker in (("colocated", "s"), ("elastic", "o")):
            rows = report["presets"][p]["runs"][pol]
            axes[1].plot(names, [rows[n]["step_time_vs_uncapped"] for n in names], marker=marker, label=f"{p} {pol}")
    axes[0].scatter(
        [j + 0.25 for j, n in enumerate(names) if PUBLISHED.get(CAPS[j])],
        [PUBLISHED[CAPS[j]] for j, n in enumerate(names) if PUBLISHED.get(CAPS[j])],
        color="k",
        marker="*",
        s=120,
        zorder=3,
        label="published (FB time)",
    )
    axes[0].set_ylabel("forward-backward work / uncapped")
    axes[0].set_xticks([j + 0.25 * (len(presets) - 1) / 2 for j in range(len(names))])
    axes[0].set_xticklabels(names)
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("step time / uncapped")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "traj_cap.png", dpi=120)
    plt.close(fig)
    print(md)
    print(
        f"{len(jobs)} simulated runs in {time.time() - t0:.0f} s; wrote {out}/ablate_traj_cap.json, summary.md, traj_cap.png"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
