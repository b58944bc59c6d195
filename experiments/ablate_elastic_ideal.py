"""Elastic against the ideal (every accelerator-second busy), with the mechanisms of issue 21 one by one.

    python experiments/ablate_elastic_ideal.py --workers 2                  # every preset, 24 steps, eta 1, 2, 3
    python experiments/ablate_elastic_ideal.py --presets terminal --steps 8  # one preset, quicker
    python experiments/ablate_elastic_ideal.py --quick                       # seconds: the tiny preset

Per preset, the simulator (``gyre_jax.sim``) drives the real policy objects on one workload in which tasks
recur (``workload.task_pool``, default 128: each step's 64 tasks come round again every 2 steps, so a task's
earlier executions predict its later ones; every row uses it, so all rows see the same executions). Rows:

- ``async best (eta)``: the fastest fixed split of a sweep of training cells, at dispatch bound eta;
- ``elastic`` at eta = 1 (before this work), ``+ group streaming`` (what partial rollouts need: a task's
  executions enter training together), ``+ partial rollouts`` (a step trains the first groups to complete;
  the others carry on across the weight update, each token keeps the version that produced it; an execution
  whose oldest token is more than eta + 1 versions behind its step is dropped), ``+ longest first``
  (admission in order of per-task duration history, ``policies.DurationHistory``), ``+ group quorum`` (a group
  trains once G - 1 of its members ended, ``--quorum``; the last is aborted: it trains nothing and its slot
  time is wasted; advantages over the members that ended);
- the same at eta = 2 and eta = 3 (stated, larger bounds).

Columns: busy fraction (the ideal is 1) in steady state (between the ends of step 2 and step ``steps - 4``:
partial rollouts may dispatch past the last step, a fixed batch per step may not, so the whole run's
fraction favours them by up to a batch of slot time) and over the whole run, step time, speedup over the best async split at the same eta and
at eta = 1, per-token staleness (max: oldest token; mean: token-weighted), executions dropped (beyond the
per-token bound) and aborted (by the group quorum), and where the idle accelerator-time went. Writes ``<out>/elastic_vs_ideal.json`` and ``summary.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "experiments"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from ablate_scheduling import Run, run_all  # noqa: E402
from tables import markdown_table, pct, times  # noqa: E402

from gyre_jax.sim.config import load_sim_config  # noqa: E402

PRESETS = ("deepswe", "terminal", "nl2repo", "flagship")
MECHANISMS = (  # (row name, overrides on top of the previous rows'); partial rollouts' drop bound is eta + 1
    ("elastic", {}),
    ("+ group streaming", {"schedule.stream_unit": "group"}),
    ("+ partial rollouts", {"schedule.partial_rollouts": True}),
    ("+ longest first", {"schedule.admission": "longest_first"}),
    ("+ group quorum", {"schedule.group_quorum": -1}),  # -1: G - 1 (the preset's group size less one)
)


def plan(presets, steps: int, etas, task_pool: int, splits_arg: str = "", quorum: int = 0) -> list[Run]:
    """The runs, per preset and eta: the async sweep and the mechanisms added one at a time (``quorum``: the
    group quorum of the last row; 0: G - 1)."""
    runs = []
    for p in presets:
        cells = load_sim_config(p).num_cells
        base = {"steps": steps, "workload.task_pool": task_pool}
        grid = [int(t) for t in splits_arg.split(",")] if splits_arg else (1, 2, cells // 8, cells // 4)
        splits = sorted({t for t in grid if 1 <= t < cells // 2} or {1})
        for eta in etas:
            b = {**base, "schedule.dispatch_staleness": eta}
            runs += [
                Run(f"{p}/eta{eta}/async-T{t}", p, {**b, "schedule.policy": "async", "schedule.training_cells": t})
                for t in splits
            ]
            o = dict(b)
            group = load_sim_config(p).group_size
            for name, extra in MECHANISMS:
                o = {**o, **extra}
                if o.get("schedule.group_quorum") == -1:
                    o["schedule.group_quorum"] = quorum if quorum > 0 else group - 1
                if name == "+ group streaming" and eta != etas[0]:
                    continue  # the prerequisite of partial rollouts, measured at the reference bound
                if extra.get("schedule.partial_rollouts"):
                    o["schedule.drop_staleness"] = eta + 1
                runs.append(Run(f"{p}/eta{eta}/{name}", p, dict(o)))
    return runs


def summarize(res: dict[str, dict], presets, etas) -> dict:
    out: dict = {}
    for p in presets:
        rows, best = {}, {}
        for eta in etas:
            asyncs = {k: v for k, v in res.items() if k.startswith(f"{p}/eta{eta}/async-")}
            k = min(asyncs, key=lambda k: asyncs[k]["step_time_s"])
            best[eta] = res[k]
            rows[f"async best (eta={eta})"] = _row(res[k], None, None, label=k.rsplit("/", 1)[1])
        for eta in etas:
            for name, _ in MECHANISMS:
                if f"{p}/eta{eta}/{name}" not in res:
                    continue
                r = res[f"{p}/eta{eta}/{name}"]
                rows[f"{name} (eta={eta})"] = _row(r, best[eta], best[etas[0]])
        out[p] = rows
    return out


def _row(r: dict, best_same: dict | None, best_first: dict | None, label: str = "") -> dict:
    row = {
        "busy": r["busy_fraction"],
        "busy_steady": r["steady"]["busy_fraction"],
        "steady_steps": r["steady"]["steps"],
        "step_min": r["step_time_s"] / 60,
        "ideal_step_min": r["step_time_s"] * r["busy_fraction"] / 60,
        "token_staleness_max": r["token_staleness"]["max"],
        "token_staleness_mean": r["token_staleness"]["mean"],
        "dropped_fraction": r["partial"]["dropped_fraction"],
        "aborted_fraction": r["partial"].get("aborted_fraction", 0.0),
        "group_quorum": r.get("group_quorum", 0),
        "carried_groups": r["partial"]["carried_groups"],
        "idle": r["idle"],
        "split": label,
    }
    if best_same is not None:
        row["speedup_vs_async_best_same_eta"] = best_same["step_time_s"] / r["step_time_s"]
        row["speedup_vs_async_best_eta1"] = best_first["step_time_s"] / r["step_time_s"]
    return row


def markdown(summary: dict, steps: int, task_pool: int) -> str:
    def cells(p: str, name: str, r: dict) -> list[str]:
        sp = (
            f"{times(r['speedup_vs_async_best_same_eta'])} / {times(r['speedup_vs_async_best_eta1'])}"
            if "speedup_vs_async_best_same_eta" in r
            else f"({r['split']})"
        )
        i = r["idle"]
        return [
            p,
            name,
            f"{pct(r['busy_steady'])} / {pct(r['busy'])}",
            f"{r['step_min']:.1f}",
            sp,
            f"{r['token_staleness_max']} / {r['token_staleness_mean']:.2f}",
            f"{pct(r['dropped_fraction'], 1)} / {pct(r['aborted_fraction'], 1)}",
            f"{pct(i['serving_empty'])} / {pct(i['training_idle'])} / {pct(i['dropped_slots'])} / "
            f"{pct(i.get('aborted_slots', 0.0))}",
        ]

    return (
        "\n".join(
            markdown_table(
                [
                    "preset",
                    "row",
                    "busy, steady / whole run",
                    "step (min)",
                    "vs async best, same eta / eta=1",
                    "token staleness max / mean",
                    "dropped / aborted",
                    "idle: empty slots / training idle / dropped slots / aborted slots",
                ],
                (cells(p, name, r) for p, rows in summary.items() for name, r in rows.items()),
                title=f"Elastic against the ideal ({steps} steps, task pool {task_pool}; busy: share of "
                "accelerator-time doing useful work, the ideal is 100%)",
            )
        )
        + "\n"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--etas", default="1,2,3", help="dispatch bounds to compare (the first is the reference)")
    ap.add_argument("--quorum", type=int, default=0, help="group quorum of the last row (0: the group size less 1)")
    ap.add_argument("--task-pool", type=int, default=128, help="tasks in the dataset (they recur)")
    ap.add_argument("--splits", default="", help="async training cells to sweep (default: 1, 2, cells/8, cells/4)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the tiny preset, 4 steps: seconds")
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "ablate_elastic_ideal"))
    args = ap.parse_args(argv)
    presets = ["tiny"] if args.quick else [p.strip() for p in args.presets.split(",") if p.strip()]
    steps = 4 if args.quick else args.steps
    etas = [int(e) for e in args.etas.split(",")]
    task_pool = 8 if args.quick else args.task_pool
    t0 = time.time()
    runs = plan(presets, steps, etas, task_pool, args.splits, args.quorum)
    results = run_all(runs, args.workers)
    summary = summarize(results, presets, etas)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "steps": steps,
        "etas": etas,
        "task_pool": task_pool,
        "summary": summary,
        "runs": results,
        "wall_s": time.time() - t0,
        "cpu_count": os.cpu_count(),
    }
    (out / "elastic_vs_ideal.json").write_text(json.dumps(report, indent=1, default=float))
    md = markdown(summary, steps, task_pool)
    (out / "summary.md").write_text(md)
    print(md)
    print(f"{len(runs)} simulated runs in {time.time() - t0:.0f} s; wrote {out}/elastic_vs_ideal.json and summary.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
