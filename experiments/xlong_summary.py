"""Summarize a long-horizon run (``configs/xlong_cpu.py`` or any run): per step, the phases and what was trained;
per execution, its calls, branches and prompt reuse.

Usage: python experiments/xlong_summary.py RUN_DIR [--out JSON]
Prints two tables and writes JSON (default RUN_DIR/xlong_summary.json). Reads only what the run wrote: metrics.jsonl
(per step), the controller's log lines are not needed; records/<execution>.jsonl (the TITO records, per call).

Per step: wall time (``step_s``), rollout (first execution started -> last finished, ``rollout_first_to_last_s``),
the rest of the step (selection, training, weight update: ``step_s - rollout``), branches selected and tokens
computed / trained, executions excluded (by the executor and by the pipeline). Per execution: calls, the branches
the trajectory processor builds (label, tokens; the longest first), branch tokens summed, prompt + completion tokens
summed over calls, the largest prompt, and over continuing calls (``reused_prefix_len > 0``) the proxy's prompt
reuse (min / median / token-weighted) and the serving cell's (``cached_prompt_tokens``, token-weighted; 0 in
records written before that field existed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gyre_jax.proxy.records import RecordStore  # noqa: E402
from gyre_jax.trajectory.branches import build_branches  # noqa: E402


def step_rows(run_dir: Path) -> list[dict]:
    """One row per trained step of ``run_dir/metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {path} not found; pass a run directory (config.workdir) that has trained")
    rows = []
    for line in path.read_text().splitlines():
        m = json.loads(line) if line.strip() else {}
        if m.get("phase") != "train":
            continue
        rows.append(
            {
                "step": m["step"],
                "step_s": m["step_s"],
                "rollout_s": m["rollout_first_to_last_s"],
                "rest_s": m["step_s"] - m["rollout_first_to_last_s"],
                "executions": m["executions"],
                "calls_per_execution": m["calls_per_execution"],
                "branches_selected": m["branches_selected"],
                "micro_steps": m["micro_steps"],
                "tokens_computed": m["tokens_computed"],
                "tokens_trained": m["tokens_trained"],
                "excluded": m["excluded"] + m["executions_excluded_by_pipeline"],
                "reward_mean": m["reward_mean"],
            }
        )
    return rows


def execution_row(store: RecordStore, execution_id: str) -> dict:
    """Calls, branches and prompt reuse of one execution's records."""
    records = store.read(execution_id)
    branches = sorted(((b.label, len(b.tokens)) for b in build_branches(records)), key=lambda lb: -lb[1])
    continuing = [r for r in records if r.reused_prefix_len > 0]
    prompt = sum(len(r.prompt_ids) for r in continuing)
    reuse = [r.reused_prefix_len / len(r.prompt_ids) for r in continuing]
    return {
        "execution_id": execution_id,
        "calls": len(records),
        "branches": branches,
        "branch_tokens": sum(n for _, n in branches),
        "call_tokens": sum(len(r.prompt_ids) + len(r.completion_ids) for r in records),
        "max_prompt": max(len(r.prompt_ids) for r in records),
        "continuing_calls": len(continuing),
        "reuse_min": min(reuse, default=0.0),
        "reuse_median": statistics.median(reuse) if reuse else 0.0,
        "reuse_token_weighted": sum(r.reused_prefix_len for r in continuing) / prompt if prompt else 0.0,
        "kv_cached_token_weighted": sum(r.cached_prompt_tokens for r in continuing) / prompt if prompt else 0.0,
        "call_s_median": statistics.median(r.t_end - r.t_start for r in records),
    }


def summarize(run_dir: Path) -> dict:
    store = RecordStore(run_dir / "records")
    executions = sorted(p.stem for p in (run_dir / "records").glob("s*.jsonl"))  # training executions (not eval*)
    return {
        "run_dir": str(run_dir),
        "steps": step_rows(run_dir),
        "executions": [execution_row(store, e) for e in executions],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default RUN_DIR/xlong_summary.json)")
    args = ap.parse_args(argv)
    summary = summarize(args.run_dir)
    print("| step | wall s | rollout s | rest s | calls / execution | branches | tokens computed | excluded |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in summary["steps"]:
        print(
            f"| {s['step']} | {s['step_s']:.0f} | {s['rollout_s']:.0f} | {s['rest_s']:.0f} | "
            f"{s['calls_per_execution']:.1f} | {s['branches_selected']} | {s['tokens_computed']:,} | {s['excluded']} |"
        )
    print()
    print("| execution | calls | longest branches | branch tokens | call tokens | max prompt | reuse min / median / "
          "weighted | KV cached (weighted) |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---|---:|")
    for e in summary["executions"]:
        top = ", ".join(f"{label} {n:,}" for label, n in e["branches"][:3])
        print(
            f"| {e['execution_id']} | {e['calls']} | {top} | {e['branch_tokens']:,} | {e['call_tokens']:,} | "
            f"{e['max_prompt']:,} | {e['reuse_min']:.3f} / {e['reuse_median']:.3f} / {e['reuse_token_weighted']:.3f} | "
            f"{e['kv_cached_token_weighted']:.3f} |"
        )
    out = args.out or args.run_dir / "xlong_summary.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nwrote {out}")
    return summary


if __name__ == "__main__":
    main()
