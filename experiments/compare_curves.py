"""Two learning-curve results side by side (e.g. LoRA and full fine-tuning of one config under one protocol): each
one's evaluation gains with their intervals, and the difference of the gains (first - second) with its interval.

Usage:
    python experiments/compare_curves.py DIR_A DIR_B [--labels A B] [--out DIR]

Each ``DIR`` holds a ``learning_curves.json`` written by ``experiments/learning_curves.py`` (its ``runs``: every
seed's curves and per-execution evaluation rewards). Per split, the gain of each result is recomputed from those
runs by ``learning_curves.eval_gains`` (the same numbers as its own table), and the difference of the gains gets the
interval of the difference of two independent bootstraps of the same kind (each resamples its own seeds, then each
resampled seed's evaluation executions). The two results are only comparable when they share the config, the
number of RL steps and the evaluation (the script prints both's overrides and refuses different RL step counts or
evaluated splits). Writes ``compare.json``, ``compare.md`` (the table) and ``compare.png`` (training reward per
step of both and their gains, with intervals) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning_curves as lc  # noqa: E402  (the sibling script: runs and statistics)


def load(directory: Path) -> tuple[dict, list[lc.SeedRun]]:
    """A ``learning_curves.json`` and its seeds' runs."""
    path = directory / "learning_curves.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist: run experiments/learning_curves.py with --out {directory}")
    result = json.loads(path.read_text())
    if not result.get("runs"):
        raise SystemExit(f"error: {path} keeps no per-seed runs (written before 2026-12-07): analyze it again")
    return result, [
        lc.SeedRun.from_record(int(s), rec) for s, rec in sorted(result["runs"].items(), key=lambda kv: int(kv[0]))
    ]


def check_comparable(runs: list[list[lc.SeedRun]], labels: list[str]) -> int:
    """The RL steps both results trained (their last evaluated step); exits when they differ."""
    last = []
    for label, rs in zip(labels, runs):
        steps = {s1 for split in lc.SPLITS for _, _, s1 in lc.eval_pairs(rs, split)}
        if len(steps) != 1:
            raise SystemExit(f"error: {label}'s seeds were evaluated after different RL steps {sorted(steps)}")
        last.append(steps.pop())
    if last[0] != last[1]:
        raise SystemExit(f"error: {labels[0]} was evaluated after {last[0]} RL steps, {labels[1]} after {last[1]}")
    splits = [{sp for sp in lc.SPLITS if lc.eval_pairs(rs, sp)} for rs in runs]
    if splits[0] != splits[1]:
        raise SystemExit(f"error: {labels[0]} evaluated {sorted(splits[0])}, {labels[1]} {sorted(splits[1])}")
    return last[0]


def compare(runs: list[list[lc.SeedRun]], n_boot: int = 10_000, seed: int = 0) -> dict:
    """Per split: each result's gain (mean, interval, per seed) and the difference first - second with its interval
    (``lc.gain_replicates`` of each, independently)."""
    a = (1 - lc.CONFIDENCE) / 2
    gains = [lc.eval_gains(rs, n_boot, seed) for rs in runs]
    out: dict = {}
    for split in lc.SPLITS:
        if not all(split in g for g in gains):
            continue
        rng = np.random.default_rng(seed + 1)
        row: dict = {"results": [g[split] for g in gains]}
        reps = [lc.gain_replicates(lc.eval_pairs(rs, split), split, rng, n_boot)[0] for rs in runs]
        diff = reps[0] - reps[1]
        mean = row["results"][0]["gain"]["mean"] - row["results"][1]["gain"]["mean"]
        low, high = float(np.quantile(diff, a)), float(np.quantile(diff, 1 - a))
        row["difference"] = {"mean": mean, "low": low, "high": high, "excludes_zero": bool(low > 0 or high < 0)}
        out[split] = row
    return out


def table(result: dict, labels: list[str], wall: list[dict]) -> str:
    """Markdown: one row per result and split, then the difference per split."""
    lines = ["| run | seeds | wall time per seed (min) | split | before -> after | gain [95% interval] |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for i, label in enumerate(labels):
        minutes = ", ".join(f"{v / 60:.0f}" for _, v in sorted(wall[i].items(), key=lambda kv: int(kv[0])))
        for split, row in result.items():
            r = row["results"][i]
            g = r["gain"]
            lines.append(f"| {label} | {len(r['seeds'])} | {minutes or '-'} | {split} | {r['before']['mean']:.3f} -> "
                         f"{r['after']['mean']:.3f} | {g['mean']:+.3f} [{g['low']:+.3f}, {g['high']:+.3f}] |")  # fmt: skip
    for split, row in result.items():
        d = row["difference"]
        lines.append(f"| {labels[0]} - {labels[1]} | | | {split} | | {d['mean']:+.3f} [{d['low']:+.3f}, "
                     f"{d['high']:+.3f}]{'' if d['excludes_zero'] else ' (includes 0)'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(curves: list[dict], result: dict, labels: list[str], path: Path, title: str) -> None:
    """Two panels: training reward per step of each result (mean over seeds, 95% interval) and each result's
    evaluation gain per split with its 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for j, (curve, label) in enumerate(zip(curves, labels)):
        steps = np.asarray(curve["steps"]) + 1
        ax.plot(steps, curve["mean"], color=f"C{j}", label=f"{label} (mean over seeds)")
        ax.fill_between(steps, curve["low"], curve["high"], color=f"C{j}", alpha=0.2)
    ax.set_xlabel("RL step")
    ax.set_ylabel("training reward (mean of the step's executions)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="upper left")
    ax.set_title(title)
    splits, width = list(result), 0.35
    for j, label in enumerate(labels):
        gains = [result[sp]["results"][j]["gain"] for sp in splits]
        err = np.asarray([[g["mean"] - g["low"], g["high"] - g["mean"]] for g in gains]).T
        x = np.arange(len(splits)) + (j - 0.5) * width
        ax2.bar(x, [g["mean"] for g in gains], width, yerr=err if splits else None, capsize=4, color=f"C{j}",
                label=label)  # fmt: skip
    ax2.axhline(0, color="black", linewidth=0.8)
    ax2.set_xticks(np.arange(len(splits)))
    ax2.set_xticklabels([f"{sp} tasks" for sp in splits])
    ax2.set_ylabel("evaluation gain (after - before RL)")
    ax2.legend(loc="upper left")
    ax2.set_title("gains (95% intervals)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", type=Path, nargs=2, help="two --out directories of learning_curves.py")
    parser.add_argument("--labels", nargs=2, default=None, help="names for the two (default: the directories')")
    parser.add_argument("--out", type=Path, default=None, help="default: <first dir>_vs_<second dir's name>")
    parser.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples")
    args = parser.parse_args(argv)
    labels = args.labels or [d.name for d in args.dirs]
    loaded = [load(d) for d in args.dirs]
    results, runs = [r for r, _ in loaded], [rs for _, rs in loaded]
    steps = check_comparable(runs, labels)
    for label, r in zip(labels, results):
        print(f"{label}: {r['config']} {' '.join(r.get('overrides', []))} ({len(r['runs'])} seeds)")
    result = compare(runs, args.bootstrap)
    out = args.out or args.dirs[0].with_name(f"{args.dirs[0].name}_vs_{args.dirs[1].name}")
    out.mkdir(parents=True, exist_ok=True)
    wall = [r.get("wall_s", {}) for r in results]
    curves = [lc.curves(rs, args.bootstrap) for rs in runs]
    record = {"labels": labels, "dirs": [str(d) for d in args.dirs], "rl_steps": steps, "confidence": lc.CONFIDENCE,
              "bootstrap": args.bootstrap, "wall_s": wall, "eval": result, "train_reward": curves}  # fmt: skip
    (out / "compare.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "compare.md").write_text(table(result, labels, wall))
    plot(curves, result, labels, out / "compare.png", f"{' vs '.join(labels)}: training reward ({steps} RL steps)")
    print(table(result, labels, wall))
    print(f"wrote {out / 'compare.json'}, {out / 'compare.md'} and {out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
