"""Scheduling ablation at cluster scale: colocated vs async vs elastic, streaming, cell granularity.

    python experiments/ablate_scheduling.py                      # every preset, 48 steps (several minutes)
    python experiments/ablate_scheduling.py --presets deepswe --steps 12 --workers 2
    python experiments/ablate_scheduling.py --quick              # seconds: the tiny preset, for CI

Every run is the discrete-event simulator (``gyre_jax.sim``) driving the real policy objects
(``gyre_jax.elastic.policies``) on a preset's workload and cost model (``gyre_jax/sim/presets.py``). All
policies of a preset see exactly the same executions (common random numbers) on the same accelerators.

What it compares, per preset (speedup = step time of the baseline / step time of elastic):
- colocated (on-policy), async with half the cells training (the split the published flagship numbers
  imply: 134.55 h = 2 x the rollout time), async with the best fixed split in a sweep, elastic at
  staleness eta = 1 (matched with async) and eta = 0 (matched with colocated);
- streaming: async and colocated with and without streaming micro-steps;
- cell granularity: elastic with cells of 32 .. 256 accelerators, and 8 cells of 4 nodes against 4 cells
  of 8 nodes on 256 accelerators (the published 2.2%);
- the flagship's timeout: how the elastic gain depends on the share of executions that hit it;
- elastic rule variants (leave on backlog, ahead executions that yield, a return hysteresis).

Writes ``<out>/ablate_scheduling.json`` (every run's result), ``summary.md`` (the tables) and PNGs:
``speedups.png``, ``utilization.png``, ``granularity.png``, ``flagship_timeout.png``,
``gantt_<preset>.png`` (the first steps of each policy). A progress bar shows on a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "experiments"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from plot_timeline import draw_gantt  # noqa: E402
from tables import markdown_table, pct, times  # noqa: E402

from gyre_jax.elastic.timeline import TimelineWriter, load_timeline  # noqa: E402
from gyre_jax.sim.config import load_sim_config  # noqa: E402
from gyre_jax.sim.simulator import Simulator  # noqa: E402

# Published speedups of elastic (QwenGyre), at matched accelerator budget and staleness (the seed articles).
PUBLISHED = {
    "nl2repo": {"model": "Qwen3.6 122B", "vs_colocated": (1.36, 1.47), "vs_async": (1.42, 1.53)},
    "deepswe": {"model": "Qwen3.6 122B", "vs_colocated": (1.610, 1.824), "vs_async": (1.569, 1.572)},
    "terminal": {"model": "Qwen3.6 122B", "vs_colocated": (1.809, 1.849), "vs_async": (1.383, 1.430)},
    "flagship": {
        "model": "Qwen3.8 2.4T",
        "vs_colocated": (1.21, 1.21),
        "vs_async": (1.78, 1.78),
        "hours_48_steps": {"elastic": 75.42, "colocated": 91.47, "async": 134.55},
    },
}
PUBLISHED_ABLATIONS = {
    "streaming_saves_over_async": 0.116,
    "elastic_over_colocated_plus_streaming": 1.19,
    "cells_4x8_instead_of_8x4_costs": 0.022,
}
PRESETS = ("deepswe", "terminal", "nl2repo", "flagship")
ELASTIC_122B_CELLS = (64, 128, 256)


@dataclass
class Run:
    label: str
    preset: str
    overrides: dict = field(default_factory=dict)
    policy_options: dict | None = None  # replaces the options the preset's schedule section gives


def simulate_run(run: Run) -> dict:
    cfg = load_sim_config(run.preset, run.overrides)
    if run.policy_options is not None:
        cfg = cfg.replace(policy_options=run.policy_options)
    t0 = time.process_time()
    result = Simulator(cfg).run()
    out = result.to_dict()
    out.update(
        label=run.label,
        preset=run.preset,
        overrides=run.overrides,
        cpu_s=time.process_time() - t0,
        slots_per_cell=cfg.slots_per_cell,
    )
    return out


def plan_runs(presets, steps: int, quick: bool) -> list[Run]:
    runs = []
    base = {"steps": steps}
    for p in presets:
        cells = load_sim_config(p).num_cells
        grid = sorted({t for t in (cells // 16, cells // 8, cells // 4, 3 * cells // 8) if 1 <= t < cells // 2})
        runs += [
            Run(f"{p}/colocated", p, {**base, "schedule.policy": "colocated"}),
            Run(f"{p}/colocated-nostream", p, {**base, "schedule.policy": "colocated", "schedule.streaming": False}),
            Run(f"{p}/async-half", p, {**base, "schedule.policy": "async"}),
            Run(f"{p}/async-half-nostream", p, {**base, "schedule.policy": "async", "schedule.streaming": False}),
            Run(f"{p}/elastic", p, {**base}),
            Run(f"{p}/elastic-eta0", p, {**base, "schedule.dispatch_staleness": 0}),
            Run(f"{p}/elastic-nostream", p, {**base, "schedule.streaming": False}),
        ]
        for t in grid:
            o = {**base, "schedule.policy": "async", "schedule.training_cells": t}
            runs += [
                Run(f"{p}/async-T{t}", p, o),
                Run(f"{p}/async-T{t}-nostream", p, {**o, "schedule.streaming": False}),
            ]
        if quick:
            continue
        if p != "flagship":
            runs += [
                Run(f"{p}/elastic-cell{c}", p, {**base, "cluster.cell_accelerators": c}) for c in ELASTIC_122B_CELLS
            ]
            small = {**base, "cluster.accelerators": 256, "tasks_per_step": 16}
            runs += [
                Run(f"{p}/elastic-256acc-8x4", p, {**small, "cluster.cell_accelerators": 32}),
                Run(f"{p}/elastic-256acc-4x8", p, {**small, "cluster.cell_accelerators": 64}),
            ]
        if p in ("deepswe", "flagship"):
            runs += [
                Run(f"{p}/elastic-leave-backlog", p, dict(base), {"dispatch_staleness": 1, "leave_on": "backlog"}),
                Run(f"{p}/elastic-yield-ahead", p, dict(base), {"dispatch_staleness": 1, "yield_ahead": True}),
                Run(
                    f"{p}/elastic-return-after-30s",
                    p,
                    dict(base),
                    {"dispatch_staleness": 1, "idle_before_return_s": 30.0},
                ),
            ]
        if p == "flagship":
            for hours in (1.5, 3.0, 4.0):
                o = {**base, "workload.timeout_s": hours * 3600}
                runs += [
                    Run(f"flagship/timeout{hours}h/colocated", p, {**o, "schedule.policy": "colocated"}),
                    Run(f"flagship/timeout{hours}h/elastic", p, dict(o)),
                    Run(f"flagship/timeout{hours}h/elastic-eta0", p, {**o, "schedule.dispatch_staleness": 0}),
                ]
    return runs


def run_all(runs: list[Run], workers: int) -> dict[str, dict]:
    results = {}
    bar = tqdm(total=len(runs), desc="simulating", unit="run", disable=not sys.stderr.isatty())
    if workers <= 1:
        for r in runs:
            results[r.label] = simulate_run(r)
            bar.update(1)
    else:
        with ProcessPoolExecutor(workers) as pool:
            for r, out in zip(runs, pool.map(simulate_run, runs)):
                results[r.label] = out
                bar.update(1)
    bar.close()
    return results


# -- summary -------------------------------------------------------------------------------------------
def summarize(res: dict[str, dict], presets) -> dict:
    s: dict = {"presets": {}, "ablations": {}}
    for p in presets:
        step = {
            k.split("/", 1)[1]: v["step_time_s"] for k, v in res.items() if k.startswith(p + "/") and k.count("/") == 1
        }
        asyncs = {k: v for k, v in step.items() if k.startswith("async-") and "nostream" not in k}
        best_async = min(asyncs, key=asyncs.get)
        el, el0 = step["elastic"], step["elastic-eta0"]
        row = {
            "step_min": {k: v / 60 for k, v in step.items()},
            "best_async": best_async,
            "elastic_vs_colocated": step["colocated"] / el,
            "elastic_eta0_vs_colocated": step["colocated"] / el0,
            "best_elastic_vs_colocated": step["colocated"] / min(el, el0),
            "elastic_vs_async_half": step["async-half"] / el,
            "elastic_vs_async_best": step[best_async] / el,
            "busy": {
                k.split("/", 1)[1]: v["busy_fraction"]
                for k, v in res.items()
                if k.startswith(p + "/") and k.count("/") == 1
            },
            "timeout_fraction": res[f"{p}/colocated"]["executions"]["timeout_fraction"],
            "training_share_colocated": res[f"{p}/colocated"]["training_busy_fraction"],
            "published": PUBLISHED.get(p),
        }
        if p == "flagship":
            row["hours_48_steps"] = {
                k: step[k] * 48 / 3600 for k in ("elastic", "elastic-eta0", "colocated", "async-half")
            }
        s["presets"][p] = row
    a = s["ablations"]
    for p in presets:
        st = s["presets"][p]["step_min"]
        a.setdefault("streaming_saves_over_async_half", {})[p] = 1 - st["async-half"] / st["async-half-nostream"]
        best = s["presets"][p]["best_async"]
        if f"{best}-nostream" in st:
            a.setdefault("streaming_saves_over_async_best", {})[p] = 1 - st[best] / st[f"{best}-nostream"]
        a.setdefault("streaming_saves_over_colocated", {})[p] = 1 - st["colocated"] / st["colocated-nostream"]
        a.setdefault("elastic_over_colocated_plus_streaming", {})[p] = st["colocated"] / min(
            st["elastic"], st["elastic-eta0"]
        )
        a.setdefault("elastic_streaming_saves", {})[p] = 1 - st["elastic"] / st["elastic-nostream"]
        if "elastic-256acc-8x4" in st:
            a.setdefault("cells_4x8_instead_of_8x4_costs", {})[p] = (
                st["elastic-256acc-4x8"] / st["elastic-256acc-8x4"] - 1
            )
        cells = {c: st.get(f"elastic-cell{c}") for c in ELASTIC_122B_CELLS}
        if all(cells.values()):
            a.setdefault("granularity_step_vs_32", {})[p] = {
                32: 1.0,
                **{c: v / st["elastic"] for c, v in cells.items()},
            }
        variants = {
            k: v / st["elastic"]
            for k, v in st.items()
            if k.startswith("elastic-") and k.split("-", 1)[1] in ("leave-backlog", "yield-ahead", "return-after-30s")
        }
        if variants:
            a.setdefault("elastic_variants_step_vs_default", {})[p] = variants
    sweep = {}
    for k, v in res.items():
        if k.startswith("flagship/timeout"):
            _, t, pol = k.split("/")
            sweep.setdefault(t, {})[pol] = v
    if "flagship" in presets and "flagship/colocated" in res:
        sweep["timeout2.0h"] = {pol: res[f"flagship/{pol}"] for pol in ("colocated", "elastic", "elastic-eta0")}
    if len(sweep) > 1:
        a["flagship_timeout_sweep"] = {
            t: {
                "timeout_fraction": d["colocated"]["executions"]["timeout_fraction"],
                "colocated_busy": d["colocated"]["busy_fraction"],
                "elastic_vs_colocated": d["colocated"]["step_time_s"] / d["elastic"]["step_time_s"],
                "elastic_eta0_vs_colocated": d["colocated"]["step_time_s"] / d["elastic-eta0"]["step_time_s"],
            }
            for t, d in sorted(sweep.items(), key=lambda kv: float(kv[0][7:-1]))
        }
    return s


def markdown(summary: dict, steps: int) -> str:
    def speedup_row(p: str, r: dict) -> list[str]:
        st, pub = r["step_min"], r["published"] or {}
        return [
            p,
            f"{st['colocated']:.1f}",
            f"{st['async-half']:.1f}",
            f"{st[r['best_async']]:.1f} ({r['best_async'][6:]})",
            f"{st['elastic']:.1f}",
            f"{st['elastic-eta0']:.1f}",
            f"{times(r['elastic_vs_colocated'])} / {times(r['elastic_eta0_vs_colocated'])}",
            "{:.2f}-{:.2f}x".format(*pub["vs_colocated"]) if pub else "-",
            f"{times(r['elastic_vs_async_half'])} / {times(r['elastic_vs_async_best'])}",
            "{:.2f}-{:.2f}x".format(*pub["vs_async"]) if pub else "-",
            f"{pct(r['busy']['elastic'])} / {pct(r['busy']['colocated'])}",
        ]

    presets = list(summary["presets"])
    lines = markdown_table(
        [
            "preset",
            "colocated min/step",
            "async (half)",
            "async (best split)",
            "elastic eta=1",
            "elastic eta=0",
            "vs colocated (eta=1 / eta=0)",
            "published",
            "vs async half / best",
            "published",
            "busy elastic / colocated",
        ],
        (speedup_row(p, r) for p, r in summary["presets"].items()),
        title=f"Elastic speedups ({steps} steps; step time of the baseline / step time of elastic)",
    )
    a = summary["ablations"]

    def share(v: float) -> str:
        return pct(v, 1)

    published = (  # (name, key, published, format)
        ("streaming saves over async (half split)", "streaming_saves_over_async_half", "11.6%", share),
        ("streaming saves over async (best split)", "streaming_saves_over_async_best", "11.6%", share),
        ("streaming saves over colocated", "streaming_saves_over_colocated", "", share),
        ("elastic over colocated + streaming", "elastic_over_colocated_plus_streaming", "1.19x", times),
        ("4 cells x 8 nodes instead of 8 x 4 costs", "cells_4x8_instead_of_8x4_costs", "2.2%", lambda v: f"{v:+.1%}"),
        ("streaming saves, elastic", "elastic_streaming_saves", "", share),
    )
    lines += [""] + markdown_table(
        ["ablation", "published", *presets],
        (
            [name, pub, *(fmt(a[key][p]) if p in a.get(key, {}) else "" for p in presets)]
            for name, key, pub, fmt in published
        ),
        title="Published ablations",
    )
    if "granularity_step_vs_32" in a:
        lines += [""] + markdown_table(
            ["preset", "32", "64", "128", "256"],
            ([p, *(f"{g[c]:.3f}" for c in (32, 64, 128, 256))] for p, g in a["granularity_step_vs_32"].items()),
            title="Cell granularity (elastic step time relative to cells of 32 accelerators, 1024 in all)",
        )
    if "flagship_timeout_sweep" in a:
        lines += [""] + markdown_table(
            [
                "timeout",
                "executions at the timeout",
                "colocated busy",
                "elastic eta=1 vs colocated",
                "eta=0 vs colocated",
            ],
            (
                [t[7:], pct(d["timeout_fraction"]), pct(d["colocated_busy"])]
                + [times(d["elastic_vs_colocated"]), times(d["elastic_eta0_vs_colocated"])]
                for t, d in a["flagship_timeout_sweep"].items()
            ),
            title="Flagship: the elastic gain against the share of executions at the timeout",
        )
    if "elastic_variants_step_vs_default" in a:
        lines += ["", "### Elastic rule variants (step time relative to the default rules)", ""]
        for p, v in a["elastic_variants_step_vs_default"].items():
            lines.append(f"- {p}: " + ", ".join(f"{k[8:]} {x:.3f}" for k, x in sorted(v.items())))
    return "\n".join(lines) + "\n"


# -- plots ---------------------------------------------------------------------------------------------
def plot_speedups(summary: dict, out: Path) -> None:
    presets = list(summary["presets"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key, pubkey, title in (
        (axes[0], "elastic_vs_colocated", "vs_colocated", "elastic over colocated"),
        (axes[1], "elastic_vs_async_half", "vs_async", "elastic over async"),
    ):
        x = range(len(presets))
        sim = [summary["presets"][p][key] for p in presets]
        ax.bar([i - 0.2 for i in x], sim, 0.4, label="simulated (eta=1; async: half the cells train)", color="#4C9BE8")
        if key == "elastic_vs_colocated":
            ax.scatter(
                [i - 0.2 for i in x],
                [summary["presets"][p]["elastic_eta0_vs_colocated"] for p in presets],
                color="k",
                marker="_",
                s=300,
                label="simulated, eta=0",
                zorder=3,
            )
        else:
            ax.scatter(
                [i - 0.2 for i in x],
                [summary["presets"][p]["elastic_vs_async_best"] for p in presets],
                color="k",
                marker="_",
                s=300,
                label="simulated, vs best async split",
                zorder=3,
            )
        pub = [summary["presets"][p]["published"] for p in presets]
        lo = [v[pubkey][0] if v else 0.0 for v in pub]
        hi = [v[pubkey][1] if v else 0.0 for v in pub]
        ax.bar([i + 0.2 for i in x], hi, 0.4, color="#F2A541", alpha=0.5, label="published (range)")
        ax.bar([i + 0.2 for i in x], lo, 0.4, color="#F2A541")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(list(x))
        ax.set_xticklabels(presets)
        ax.set_ylabel("speedup")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_utilization(summary: dict, out: Path) -> None:
    presets = list(summary["presets"])
    policies = [
        ("colocated", "colocated"),
        ("async-half", "async (half)"),
        ("elastic-eta0", "elastic eta=0"),
        ("elastic", "elastic eta=1"),
    ]
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.8 / len(policies)
    for j, (key, name) in enumerate(policies):
        ax.bar(
            [i + (j - 1.5) * w for i in range(len(presets))],
            [summary["presets"][p]["busy"][key] for p in presets],
            w,
            label=name,
        )
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="ideal")
    ax.set_xticks(range(len(presets)))
    ax.set_xticklabels(presets)
    ax.set_ylabel("accelerator-busy fraction")
    ax.set_ylim(0, 1.1)
    ax.legend(fontsize=7, ncol=5, loc="upper center")
    ax.set_title("useful accelerator-time (occupied serving slots + micro-steps + optimizer steps)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_granularity(summary: dict, out: Path) -> None:
    g = summary["ablations"].get("granularity_step_vs_32")
    if not g:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for p, v in g.items():
        xs = sorted(v)
        ax.plot(xs, [v[c] for c in xs], marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("accelerators per cell (1024 in all)")
    ax.set_ylabel("elastic step time / step time with cells of 32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_timeout_sweep(summary: dict, out: Path) -> None:
    sweep = summary["ablations"].get("flagship_timeout_sweep")
    if not sweep:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [d["timeout_fraction"] for d in sweep.values()]
    ax.plot(xs, [d["elastic_vs_colocated"] for d in sweep.values()], marker="o", label="elastic eta=1")
    ax.plot(xs, [d["elastic_eta0_vs_colocated"] for d in sweep.values()], marker="s", label="elastic eta=0")
    ax.plot(xs, [1 / d["colocated_busy"] for d in sweep.values()], "k--", label="bound: 1 / colocated busy fraction")
    ax.axhline(1.21, color="#F2A541", label="published (1.21x)")
    ax.set_xlabel("share of executions that hit the timeout")
    ax.set_ylabel("speedup over colocated")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_gantts(presets, out_dir: Path, steps: int) -> list[Path]:
    paths = []
    policies = (
        ("colocated", {"schedule.policy": "colocated"}),
        ("async (half the cells train)", {"schedule.policy": "async"}),
        ("elastic", {}),
    )
    for p in presets:
        fig, axes = plt.subplots(len(policies), 1, figsize=(12, 3.2 * len(policies)))
        for ax, (name, ov) in zip(axes, policies):
            cfg = load_sim_config(p, {"steps": steps, **ov})
            tl = TimelineWriter(None, cfg.cell_names, source="sim")
            result = Simulator(cfg, timeline=tl).run()
            tl.close(result.makespan_s)
            draw_gantt(
                load_timeline(tl.events),
                ax,
                title=f"{p}: {name}, {steps} steps in "
                f"{result.makespan_s / 3600:.2f} h (busy {result.busy_fraction:.0%})",
            )
        fig.tight_layout()
        path = out_dir / f"gantt_{p}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--workers", type=int, default=1, help="processes to simulate in parallel")
    ap.add_argument("--quick", action="store_true", help="the tiny preset, 4 steps, no sweeps: seconds")
    ap.add_argument("--gantt-steps", type=int, default=4, help="steps drawn in the Gantt charts")
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "ablate_scheduling"))
    args = ap.parse_args(argv)
    presets = ["tiny"] if args.quick else [p.strip() for p in args.presets.split(",") if p.strip()]
    steps = 4 if args.quick else args.steps
    from gyre_jax.sim.presets import PRESETS as SIM_PRESETS

    unknown = [p for p in presets if p not in SIM_PRESETS]
    if unknown:
        print(f"error: unknown preset(s) {unknown} (known: {', '.join(SIM_PRESETS)})", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    runs = plan_runs(presets, steps, args.quick)
    results = run_all(runs, args.workers)
    summary = summarize(results, presets)
    report = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "steps": steps,
        "presets": presets,
        "published": {p: PUBLISHED.get(p) for p in presets},
        "published_ablations": PUBLISHED_ABLATIONS,
        "summary": summary,
        "runs": results,
        "wall_s": time.time() - t0,
        "cpu_count": os.cpu_count(),
    }
    (out / "ablate_scheduling.json").write_text(json.dumps(report, indent=1, default=float))
    md = markdown(summary, steps)
    (out / "summary.md").write_text(md)
    plot_speedups(summary, out / "speedups.png")
    plot_utilization(summary, out / "utilization.png")
    plot_granularity(summary, out / "granularity.png")
    plot_timeout_sweep(summary, out / "flagship_timeout.png")
    plot_gantts(presets, out, min(args.gantt_steps, steps))
    print(md)
    print(
        f"{len(runs)} simulated runs in {time.time() - t0:.0f} s; wrote {out}/ablate_scheduling.json, summary.md and PNGs"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
