"""Summarize a run directory: eval rewards, training reward by window of steps, step times.

Usage: python experiments/summarize_run.py RUN_DIR [--window 10]
Prints a table and writes RUN_DIR/summary.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def summarize(run_dir: Path, window: int) -> dict:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {path} not found; pass a run directory (config.workdir) that has trained")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [m for m in lines if m.get("phase") == "train"]
    evals = [m for m in lines if m.get("phase") == "eval"]
    windows = []
    for start in range(0, len(train), window):
        chunk = train[start : start + window]
        windows.append(
            {
                "steps": f"{chunk[0]['step'] + 1}-{chunk[-1]['step'] + 1}",
                "reward_mean": statistics.mean(m["reward_mean"] for m in chunk),
                "pass_rate": statistics.mean(m["pass_rate"] for m in chunk),
                "step_s": statistics.mean(m["step_s"] for m in chunk),
            }
        )
    return {
        "run_dir": str(run_dir),
        "steps": len(train),
        "evals": [
            {
                "after_steps": m["step"],
                "split": m.get("eval_split"),
                "reward_mean": m["eval_reward_mean"],
                "pass_rate": m["eval_pass_rate"],
                "executions": m["eval_executions"],
            }
            for m in evals
        ],
        "train_windows": windows,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--window", type=int, default=10)
    args = parser.parse_args(argv)
    summary = summarize(args.run_dir, args.window)
    print(f"{'eval after':>10} {'split':>8} {'reward':>8} {'pass':>6}")
    for e in summary["evals"]:
        print(f"{e['after_steps']:>10} {e['split']:>8} {e['reward_mean']:>8.3f} {e['pass_rate']:>6.2f}")
    print(f"\n{'steps':>10} {'reward':>8} {'pass':>6} {'step s':>7}")
    for w in summary["train_windows"]:
        print(f"{w['steps']:>10} {w['reward_mean']:>8.3f} {w['pass_rate']:>6.2f} {w['step_s']:>7.1f}")
    out = args.run_dir / "summary.json"
    out.write_text(json.dumps(summary, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
