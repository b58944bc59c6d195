"""GSPO vs GSPO-token vs GRPO on one config across seeds: each loss runs ``learning_curves.py`` (N seeds, same
seeds for every loss), then one table, one JSON and one figure compare them: evaluation gains with 95% intervals
(training and held-out tasks), training reward, gradient norm and clip fraction per step.

Usage:
    python experiments/compare_losses.py --config configs/tiny_cpu.py --seeds 3
    python experiments/compare_losses.py --analyze-only --runs-root runs/compare_losses/tiny_cpu

Each loss's seeds run in ``<runs-root>/<loss>/seed<k>`` (default runs-root: ``runs/compare_losses/<config>``,
git-ignored; ``--reuse gspo=DIR`` takes one loss's seeds from an existing runs-dir, e.g. the default config's
``learning_curves.py`` runs, which are GSPO). A complete seed is not rerun, an interrupted one resumes. Losses and
their overrides (``LOSSES``): ``gspo`` (the default: sequence ratio, clip 3e-4 / 4e-4), ``gspo_token`` (the
sequence ratio per token, same clip), ``grpo`` (token ratios, DAPO's clip-higher 0.2 / 0.28). Writes
``<out>/compare_losses.json`` (``notebooks/gspo_vs_grpo.ipynb`` reads the default config's, committed under
``experiments/results/compare_losses/tiny_cpu/``) and ``compare_losses.png``, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning_curves as lc  # noqa: E402  (the sibling script: runs and statistics)

REPO = lc.REPO
LOSSES = {
    "gspo": [],
    "gspo_token": ["--config.rl.loss=gspo_token"],
    "grpo": ["--config.rl.loss=grpo", "--config.rl.clip_low=0.2", "--config.rl.clip_high=0.28"],
}
CURVES = ("reward_mean", *lc.TRAIN_METRICS)


def summarize(name: str, result: dict, tail: int = 10) -> dict:
    """One loss's row from its ``learning_curves.json`` (``result``): eval gains per split, the per-step curves, and
    last-``tail``-steps means over seeds."""
    curves = {"reward_mean": result["train_reward"], **result["train_metrics"]}
    row: dict = {"loss": name, "seeds": result["seeds"], "eval": result["eval"], "curves": curves}
    for key, curve in curves.items():
        values = np.asarray(curve["mean"][-tail:], np.float64)
        row[f"{key}_last{tail}"] = float(values.mean()) if values.size else float("nan")
    return row


def table(rows: list[dict], tail: int = 10) -> list[str]:
    """The comparison as markdown lines: one row per loss."""

    def gain(row: dict, split: str) -> str:
        g = row["eval"].get(split)
        if g is None:
            return "n/a"
        gg = g["gain"]
        return (
            f"{g['before']['mean']:.3f} -> {g['after']['mean']:.3f} ({gg['mean']:+.3f} [{gg['low']:+.3f}, "
            f"{gg['high']:+.3f}])"
        )

    lines = [
        f"| loss | seeds | eval, training tasks: before -> after (gain [95%]) | eval, held-out tasks | "
        f"train reward, last {tail} steps | grad norm, last {tail} | clip fraction, last {tail} |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['loss']} | {len(row['seeds'])} | {gain(row, 'train')} | {gain(row, 'heldout')} | "
            f"{row[f'reward_mean_last{tail}']:.3f} | {row[f'grad_norm_last{tail}']:.3f} | "
            f"{row[f'clip_fraction_last{tail}']:.4f} |"
        )
    return lines


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Three panels, one line per loss (mean over seeds, 95% band): training reward, gradient norm, clip fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(15, 4))
    labels = {"reward_mean": "training reward", "grad_norm": "gradient norm", "clip_fraction": "clip fraction"}
    for ax, key in zip(axes, CURVES):
        for i, row in enumerate(rows):
            c = row["curves"][key]
            steps = np.asarray(c["steps"]) + 1
            ax.plot(steps, c["mean"], color=f"C{i}", label=row["loss"])
            ax.fill_between(steps, c["low"], c["high"], color=f"C{i}", alpha=0.2)
        ax.set_xlabel("RL step")
        ax.set_title(labels[key])
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny_cpu.py")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--losses", default=",".join(LOSSES), help=f"comma-separated, of {list(LOSSES)}")
    parser.add_argument("--runs-root", type=Path, default=None, help="default: runs/compare_losses/<config>")
    parser.add_argument("--reuse", action="append", default=[], help="LOSS=RUNS_DIR: that loss's seeds live there")
    parser.add_argument("--out", type=Path, default=None, help="default: experiments/results/compare_losses/<config>")
    parser.add_argument("--analyze-only", action="store_true", help="read the runs' metrics, run nothing")
    parser.add_argument("--bootstrap", type=int, default=10_000)
    args, overrides = parser.parse_known_args(argv)
    losses = [x for x in args.losses.split(",") if x]
    unknown = [x for x in losses if x not in LOSSES]
    if unknown:
        parser.error(f"--losses: unknown {unknown}; choose from {list(LOSSES)}")
    reuse = dict(item.split("=", 1) for item in args.reuse)
    stem = Path(args.config).stem
    runs_root = args.runs_root or REPO / "runs" / "compare_losses" / stem
    out = args.out or REPO / "experiments" / "results" / "compare_losses" / stem
    rows = []
    for name in losses:
        runs_dir = Path(reuse.get(name, runs_root / name))
        cmd = ["--config", args.config, "--seeds", str(args.seeds), "--first-seed", str(args.first_seed)]
        cmd += ["--runs-dir", str(runs_dir), "--out", str(out / name), "--bootstrap", str(args.bootstrap)]
        if args.analyze_only:
            cmd.append("--analyze-only")
        print(f"== {name}", flush=True)
        lc.main([*cmd, *LOSSES[name], *overrides])  # runs the seeds, writes the loss's statistics
        rows.append(summarize(name, json.loads((out / name / "learning_curves.json").read_text())))
    result = {"config": args.config, "overrides": overrides, "losses": {n: LOSSES[n] for n in losses}, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare_losses.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, out / "compare_losses.png", f"{args.config}: GSPO vs GSPO-token vs GRPO, {args.seeds} seeds")
    print("\n".join(table(rows)))
    print(f"wrote {out / 'compare_losses.json'} and {out / 'compare_losses.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
