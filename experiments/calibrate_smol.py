"""Measures a model's success on the `smol` suite through the project's executor, bwrap sandbox, verifier and the
mini-swe-agent harness exactly as configs/smollm2_cpu.py runs it, against any OpenAI-compatible server (the
calibration server experiments/smollm2_ref_server.py until the project serves SmolLM2 itself).

    python experiments/calibrate_smol.py --base-url http://127.0.0.1:8765/v1 --split heldout --samples 6 \
        --out experiments/results/smol_baseline/heldout.json

Each task of the split runs ``--samples`` times (seeds 0..samples-1), ``--parallel`` at a time per server
(``--base-url`` may list several servers, e.g. two one-thread calibration servers on 2 cores). Success = the
hidden tests' reward is 1.0. Prints one row per task (successes / runs), then per split the success rate with a
95% Wilson interval, calls per execution (mini's own count of model calls, from its trajectory), the harness's
wall time per execution and how executions ended (mini's exit status); writes all of it, and each execution's
commands, to ``--out`` (JSON). A run is resumable: ``--out`` keeps finished executions, and rerunning the same
command runs only the missing ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from gyre_jax.rollout.check_suite import KeysOnly
from gyre_jax.rollout.executor import ExecutionSpec, Executor
from gyre_jax.rollout.harnesses import harness_spec
from gyre_jax.rollout.sandbox import make_sandbox
from gyre_jax.rollout.suites import load_tasks

REPO = Path(__file__).resolve().parent.parent


def smol_config():
    """configs/smollm2_cpu.py as a module (its constants: the harness command line, step limit, max tokens)."""
    spec = importlib.util.spec_from_file_location("smollm2_cpu", REPO / "configs" / "smollm2_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of k successes in n trials."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def trajectory_info(exec_dir: Path) -> dict:
    """Calls, exit status and the commands the model ran, from mini's trajectory file."""
    path = exec_dir / "harness" / "trajectory.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {"calls": None, "exit_status": "no trajectory", "commands": [], "replies": []}
    info = data.get("info", {})
    commands = [a.get("command", "") for m in data.get("messages", []) for a in m.get("extra", {}).get("actions", [])]
    replies = [str(m.get("content", ""))[:400] for m in data.get("messages", []) if m.get("role") == "assistant"]
    return {"calls": info.get("model_stats", {}).get("api_calls"), "exit_status": info.get("exit_status"),
            "commands": commands, "replies": replies}  # fmt: skip


def summarize(rows: list[dict]) -> dict:
    n = len(rows)
    k = sum(r["success"] for r in rows)
    calls = [r["calls"] for r in rows if r["calls"] is not None]
    lo, hi = wilson(k, n)
    exits: dict[str, int] = {}
    for r in rows:
        exits[str(r["exit_status"])] = exits.get(str(r["exit_status"]), 0) + 1
    return {
        "executions": n, "successes": k, "rate": k / n if n else 0.0, "wilson95": [lo, hi],
        "mean_reward": sum(r["reward"] or 0 for r in rows) / n if n else 0.0,
        "calls_per_execution": sum(calls) / len(calls) if calls else None,
        "seconds_per_execution": sum(r["duration_s"] for r in rows) / n if n else None,
        "exit_status": exits, "excluded": sum(r["reward"] is None for r in rows),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--base-url",
        required=True,
        help="an OpenAI-compatible server's base URL (.../v1); several, comma-separated, share the work",
    )
    p.add_argument("--suite", default=str(REPO / "suites" / "smol"))
    p.add_argument("--split", default="heldout", choices=("train", "heldout", "all"))
    p.add_argument("--tasks", default="", help="comma-separated task names (default: the whole split)")
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    cfg = smol_config()
    tasks, suite_root = load_tasks(f"harbor:{a.suite}", max_turns=cfg.MAX_TURNS)
    wanted = {n for n in a.tasks.split(",") if n}
    tasks = [t for t in tasks if (a.split == "all" or t.metadata.get("split") == a.split)]
    tasks = [t for t in tasks if not wanted or t.task_id in wanted]
    out = Path(a.out)
    done = {r["execution_id"]: r for r in json.loads(out.read_text())["executions"]} if out.exists() else {}
    specs = [ExecutionSpec(f"{t.task_id}-s{k}", t, t.task_id, seed=k) for k in range(a.samples) for t in tasks]
    todo = [s for s in specs if s.execution_id not in done]
    urls = a.base_url.split(",")
    for u in urls:  # fail before any execution when nothing answers (every harness would only retry and fail)
        try:
            urllib.request.urlopen(u.rstrip("/") + "/models", timeout=10).read()
        except OSError as exc:
            print(f"error: --base-url {u}: GET /models failed ({exc}); start the server first", file=sys.stderr)
            return 2
    spec = harness_spec("mini-swe-agent", cfg.SMOL_HARNESS_CMD)
    print(f"{len(specs)} executions ({len(todo)} to run) of {len(tasks)} tasks, split {a.split}", flush=True)
    t0 = time.monotonic()
    lock = threading.Lock()

    def serve(k: int, u: str, root: Path) -> None:
        """Runs every len(urls)-th execution against the server ``u``, ``--parallel`` at a time."""
        url = urlparse(u)
        box = make_sandbox("bwrap", proxy_address=(url.hostname, url.port), hide=[root, suite_root],
                           state_dir=root / f"sandbox{k}")  # fmt: skip
        executor = Executor(KeysOnly(), u, root / "runs", model_name=a.model, timeout_s=300,
                            max_parallel=a.parallel, temperature=cfg.TEMPERATURE, max_tokens=cfg.MAX_TOKENS_PER_CALL,
                            harness_cmd=list(spec.cmd), extra_env=spec.env, harness_files=spec.files, sandbox=box,
                            network="proxy")  # fmt: skip
        mine = todo[k :: len(urls)]
        try:
            for i in range(0, len(mine), a.parallel):  # in chunks, saved after each
                chunk = mine[i : i + a.parallel]
                for s, r in zip(chunk, executor.run(chunk)):
                    info = trajectory_info(root / "runs" / s.execution_id)
                    with lock:
                        done[s.execution_id] = {
                            "execution_id": s.execution_id, "task": s.task.task_id,
                            "split": s.task.metadata.get("split"), "seed": s.seed, "reward": r.reward,
                            "success": r.reward is not None and r.reward >= 1.0, "status": r.status,
                            "duration_s": round(r.duration_s, 2), **info,
                        }  # fmt: skip
                        print(f"  {s.execution_id:28s} reward {r.reward} calls {info['calls']} "
                              f"{r.duration_s:5.1f}s {info['exit_status']} {info['commands'][:2]!r:.120s}", flush=True)  # fmt: skip
                        write(out, done, a, time.monotonic() - t0)
        finally:
            box.close()

    with tempfile.TemporaryDirectory(prefix="gyre-calibrate-") as tmp:
        threads = [threading.Thread(target=serve, args=(k, u, Path(tmp))) for k, u in enumerate(urls)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    report = write(out, done, a, time.monotonic() - t0)
    print_report(report)
    return 0


def write(out: Path, done: dict, a, seconds: float) -> dict:
    rows = sorted(done.values(), key=lambda r: (r["task"], r["seed"]))
    per_task = {}
    for r in rows:
        per_task.setdefault(r["task"], []).append(r)
    report = {
        "base_url": a.base_url, "samples": a.samples, "wall_s": round(seconds, 1),
        "per_task": {t: {"split": rs[0]["split"], **summarize(rs)} for t, rs in per_task.items()},
        "splits": {s: summarize([r for r in rows if r["split"] == s]) for s in ("train", "heldout")
                   if any(r["split"] == s for r in rows)},
        "executions": rows,
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return report


def print_report(report: dict) -> None:
    print(f"\n{'task':22s} {'split':8s} {'succ/n':>7s} {'rate':>5s} {'calls':>5s} {'s/exec':>6s}")
    for t, s in report["per_task"].items():
        print(f"{t:22s} {s['split']:8s} {s['successes']:>3d}/{s['executions']:<3d} {s['rate']:5.2f} "
              f"{s['calls_per_execution'] or 0:5.2f} {s['seconds_per_execution']:6.1f}")  # fmt: skip
    for name, s in report["splits"].items():
        lo, hi = s["wilson95"]
        print(f"{name}: {s['successes']}/{s['executions']} = {s['rate']:.3f} (95% Wilson [{lo:.3f}, {hi:.3f}]), "
              f"mean reward {s['mean_reward']:.3f}, {s['calls_per_execution']:.2f} calls/execution, "
              f"{s['seconds_per_execution']:.1f} s/execution, exits {s['exit_status']}, excluded {s['excluded']}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
