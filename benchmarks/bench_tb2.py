"""The whole Terminal-Bench 2 set through ``check_suite`` on this machine: every task loads, its environment is built
or refused with the reason, its oracle scores 1.0 and its untouched start < 0.2, or it is excluded with the cause.

Run: ``python benchmarks/bench_tb2.py [--suite ../shared/data/terminal-bench-2] [--parallel 1] [--tasks a,b]``.
Prints the table of docs/tasks.md ("Terminal-Bench 2 on this machine"), writes the rows, counts, wall time and
the machine's load to ``benchmarks/results/tb2.json``. The named baseline is gyre-jax before issue 48: 0 of 89
tasks loaded (every task.toml set ``[environment] docker_image``, then refused). Long: run it at low parallelism.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gyre_jax.rollout import check_suite  # noqa: E402
from gyre_jax.rollout.suites import load_tasks  # noqa: E402

BASELINE_LOADED = 0  # before issue 48


def short(reason: str, n: int = 150) -> str:
    text = " ".join(str(reason).split())
    for prefix in ("evaluator raised EvaluatorUnavailable: ", "evaluator raised "):
        text = text.removeprefix(prefix)
    return text if len(text) <= n else text[: n - 3] + "..."


def outcome(row: dict) -> tuple[str, str, str]:
    """(environment, oracle / start, reason) of one row."""
    if row["state"] == "refused":
        phase = row["reasons"][0].split(": ", 2)[1] if ": " in row["reasons"][0] else ""
        env = "refused" if phase == "environment" else "not built (task refused)"
        return env, "excluded", short(row["reasons"][0].split(": ", 1)[1])
    if row["state"] == "build failed":
        return "build failed", "excluded", short(row["reasons"][0])
    scores = (
        f"{row['oracle']:.2f} / {row['start']:.2f}" if row["oracle"] is not None and row["start"] is not None else ""
    )
    reason = row.get("oracle_excluded") or row.get("start_excluded") or ""
    return "built", scores or "excluded", short(reason) if reason else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    beside = [p / "shared" / "data" / "terminal-bench-2" for p in (REPO.parent, REPO.parent.parent)]  # or a worktree's
    parser.add_argument("--suite", default=str(next((p for p in beside if p.is_dir()), beside[0])))
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--tasks", default="")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "tb2.json"))
    args = parser.parse_args()
    if not Path(args.suite).is_dir():
        print(f"error: no Terminal-Bench 2 set at {args.suite} (see ../shared/data/README.md)", file=sys.stderr)
        return 2
    tasks, _ = load_tasks(f"harbor:{args.suite}")
    load_before, t0 = os.getloadavg(), time.monotonic()
    rows_file = Path(tempfile.mkdtemp(prefix="bench-tb2-")) / "rows.json"
    argv = [args.suite, "--parallel", str(args.parallel), "--json", str(rows_file), "--workdir", "/var/tmp"]
    code = check_suite.main(argv + (["--tasks", args.tasks] if args.tasks else []))
    wall_s = time.monotonic() - t0
    rows = json.loads(rows_file.read_text())["rows"]
    table = [(r["task"], "yes", *outcome(r)) for r in rows]
    print("\n| task | loads | environment | oracle / start | exclusion reason |\n|---|---|---|---|---|")
    for name, loads, env, score, reason in table:
        print(f"| {name} | {loads} | {env} | {score} | {reason} |")
    counts = {
        "tasks": len(tasks), "loaded": len(tasks), "baseline_loaded": BASELINE_LOADED,
        "environment_built": sum(1 for t in table if t[2] == "built"),
        "environment_refused": sum(1 for t in table if t[2] == "refused"),
        "build_failed": sum(1 for t in table if t[2] == "build failed"),
        "task_refused": sum(1 for r in rows if r["state"] == "refused"),
        "oracle_1_start_below_0.2": sum(1 for r in rows if r["state"] == "ran" and r["oracle"] == 1.0
                                        and r["start"] is not None and r["start"] < 0.2),
        "ran_but_failed_or_excluded": sum(1 for r in rows if r["state"] == "ran" and not (
            r["oracle"] == 1.0 and r["start"] is not None and r["start"] < 0.2)),
    }  # fmt: skip
    hosts = Counter(reason.split("host ")[1].split(" ")[0] for r in rows if r["state"] == "refused"
                    for reason in r["reasons"][:1] if "host " in reason)  # fmt: skip
    counts["first_refusal_by_host"] = dict(hosts.most_common())
    print(f"\n{json.dumps(counts)}\nwall {wall_s:.0f} s, load average before {load_before}, after {os.getloadavg()}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"counts": counts, "wall_s": round(wall_s, 1), "parallel": args.parallel,
                                          "load_before": load_before, "load_after": os.getloadavg(),
                                          "check_suite_exit": code, "rows": rows}, indent=1, default=str))  # fmt: skip
    return 0 if counts["ran_but_failed_or_excluded"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
