"""Checks a Harbor task suite through the real executor, sandbox and verifier: every oracle scores 1.0 and
every untouched starting workspace scores below a bound.

Run: ``python -m gyre_jax.rollout.check_suite SUITE [--sandbox bwrap] [--tasks a,b] [--max-start 0.2]
[--parallel 2] [--json out.json] [--write-expected]`` where SUITE is a directory of Harbor tasks (or
``harbor:<dir>`` / ``jsonl:<file>``). First, what the suite's verifiers need (task.toml
``[verifier.requires]``) is checked: a missing runner stops it with exit 2 and the install line, before any
work. Then for each task two executions run exactly as in training, with a different harness: the oracle
(``bash /solution/solve.sh``, the task's ``solution/`` mounted read-only) and nothing (``true``: the starting
state). No model is called (the harness gets a proxy URL nothing listens on). Prints one row per task and
exits 1 when an oracle scores below 1.0, a starting state scores ``--max-start`` or more, or an execution is
excluded or flagged ``reward_suspect`` (its reason is printed). ``--write-expected`` writes each task's
``tests/expected_tests.txt`` from the tests its oracle run collected (the verifier kit's driver scores against
that list: a test the tested code hides or adds does not change the denominator).
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

from gyre_jax.progress import Progress
from gyre_jax.rollout import environments
from gyre_jax.rollout.evaluators import EvaluatorUnavailable
from gyre_jax.rollout.executor import ExecutionResult, ExecutionSpec, Executor
from gyre_jax.rollout.sandbox import SANDBOXES, SandboxUnavailable, make_sandbox
from gyre_jax.rollout.sandbox.environment import EnvironmentBuildError, EnvironmentUnavailable, Host, Reachability
from gyre_jax.rollout.suites import SuiteError, load_tasks, suite_warnings
from gyre_jax.rollout.tasks import Task
from gyre_jax.rollout.verifier import check_needs

ORACLE_CMD = ("bash", "{solution}/solve.sh")
START_CMD = ("true",)
NO_PROXY_URL = "http://127.0.0.1:9/v1"  # the discard port: nothing answers


class KeysOnly:
    """The executor's registry for runs that call no model: a fresh key per execution, nothing recorded."""

    def open_execution(self, execution_id: str) -> str:
        return "gyre-check-" + secrets.token_hex(8)

    def close_execution(self, execution_id: str) -> None:
        return None


def run_mode(tasks: list[Task], cmd: tuple[str, ...], root: Path, box, parallel: int,
             timeout_s: float) -> list[ExecutionResult]:  # fmt: skip
    """One execution per task with the harness ``cmd`` (the oracle or nothing), in order of ``tasks``."""
    executor = Executor(KeysOnly(), NO_PROXY_URL, root, model_name="none", timeout_s=timeout_s,
                        max_parallel=parallel, temperature=1.0, max_tokens=1, harness_cmd=list(cmd),
                        evaluator_timeout_s=timeout_s, sandbox=box, mount_solution=True, network="none")  # fmt: skip
    specs = [ExecutionSpec(f"{t.task_id}", t, t.task_id, seed=0) for t in tasks]
    what = "oracle" if cmd == ORACLE_CMD else "starting state"
    with Progress(f"checking the {what} of each task", total=len(specs), unit="tasks") as progress:
        return executor.run(specs, on_done=lambda r: progress.update(1, detail=f"{r.task_id}: {r.reward}"))


def table(tasks: list[Task], start: list[ExecutionResult], oracle: list[ExecutionResult]) -> list[dict]:
    rows = []
    for t, s, o in zip(tasks, start, oracle):
        rows.append({
            "task": t.task_id, "difficulty": t.metadata.get("difficulty", ""), "state": "ran", "start": s.reward,
            "oracle": o.reward, "oracle_s": round(o.duration_s, 2), "start_excluded": s.exclusion_reason,
            "oracle_excluded": o.exclusion_reason, "oracle_status": o.status, "sandbox": o.sandbox,
            "start_suspect": s.reward_suspect, "oracle_suspect": o.reward_suspect,
            "oracle_dir": str(Path(o.workspace).parent), "start_dir": str(Path(s.workspace).parent),
        })  # fmt: skip
    return rows


def refused_row(task: Task, state: str, reasons: list[str]) -> dict:
    """A task not run: ``state`` "refused" (this machine cannot honour it, decided before any work) or
    "build failed" (its environment's Dockerfile step failed); ``reasons`` one line each."""
    return {"task": task.task_id, "difficulty": task.metadata.get("difficulty", ""), "state": state, "start": None,
            "oracle": None, "oracle_s": 0.0, "reasons": reasons}  # fmt: skip


def failures(rows: list[dict], max_start: float) -> list[str]:
    """What fails the check, one line per task and reason (tasks refused before any work are not failures)."""
    out = []
    for r in rows:
        if r["state"] != "ran":
            continue
        if r["oracle"] is None or r["start"] is None:
            out.append(f"{r['task']}: excluded: {r['oracle_excluded'] or r['start_excluded']}")
            continue
        if r["oracle_suspect"] or r["start_suspect"]:
            out.append(f"{r['task']}: flagged reward_suspect: {r['oracle_suspect'] or r['start_suspect']}")
        if r["oracle"] < 1.0:
            out.append(f"{r['task']}: the oracle scored {r['oracle']} (status {r['oracle_status']}), expected 1.0")
        if r["start"] >= max_start:
            out.append(f"{r['task']}: the starting state scored {r['start']}, expected < {max_start}")
    return out


def tail(path: Path, lines: int = 12) -> str:
    """The last ``lines`` lines of a text file (empty when absent)."""
    try:
        text = path.read_bytes()[-8192:].decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def explain(row: dict) -> list[str]:
    """For a failing task: the directories and the tails of its oracle's and verifier's output."""
    out = []
    for mode in ("oracle", "start"):
        d = Path(row[f"{mode}_dir"])
        out.append(f"  {mode} execution: {d}")
        for name in ("harness.stdout", "harness.stderr", "verifier/test.stdout", "verifier/test.stderr"):
            text = tail(d / name)
            if text:
                out.append(f"    --- {name} (last lines)")
                out += [f"    {line}" for line in text.splitlines()]
    return out


def write_expected(tasks: list[Task], oracle: list[ExecutionResult]) -> None:
    """Each task's ``tests/expected_tests.txt``: the test ids its oracle's verifier ran (the kit driver's
    ``summary.json``); a task whose verifier is not the kit driver is left alone."""
    for task, result in zip(tasks, oracle):
        summary = Path(result.workspace).parent / "verifier" / "logs" / "verifier" / "summary.json"
        if not summary.is_file():
            continue
        ids = sorted(json.loads(summary.read_text(encoding="utf-8")).get("tests", {}))
        head = "# the tests the verifier must run (check_suite --write-expected, from the oracle's run)\n"
        (Path(task.source) / "tests" / "expected_tests.txt").write_text(head + "".join(i + "\n" for i in ids))
        print(f"wrote {len(ids)} test ids to {Path(task.source) / 'tests' / 'expected_tests.txt'}")


def print_table(rows: list[dict]) -> None:
    print(f"{'task':34s} {'difficulty':10s} {'start':>6s} {'oracle':>6s} {'oracle s':>8s}  state")
    for r in rows:
        fmt = lambda v: "excl" if v is None else f"{v:.2f}"  # noqa: E731
        if r["state"] != "ran":
            print(
                f"{r['task']:34s} {r['difficulty']:10s} {'-':>6s} {'-':>6s} {'-':>8s}  {r['state']}: {r['reasons'][0]}"
            )
            continue
        print(f"{r['task']:34s} {r['difficulty']:10s} {fmt(r['start']):>6s} {fmt(r['oracle']):>6s} "
              f"{r['oracle_s']:8.2f}  ran")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", help="a directory of Harbor tasks, or harbor:<dir> / jsonl:<file>")
    parser.add_argument("--sandbox", default="bwrap", choices=SANDBOXES)
    parser.add_argument("--tasks", default="", help="comma-separated task names (default: all)")
    parser.add_argument("--max-start", type=float, default=0.2, help="the starting state must score below this")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="oracle time limit when task.toml has none")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (it is kept anyway on failure)")
    parser.add_argument("--workdir", default="", help="where the run directory goes (default: the system's temp)")
    parser.add_argument(
        "--preflight",
        action="store_true",
        help="only list what each task needs from this machine and whether it is here, then exit",
    )
    parser.add_argument("--write-expected", action="store_true",
                        help="write each task's tests/expected_tests.txt from its oracle run's collected tests")  # fmt: skip
    return parser.parse_args(argv)


def preflight(tasks: list[Task], sandbox: str) -> dict[str, tuple[list, list[str]]]:
    """Per task: what it needs from this machine (``environments.needs``) and why it is refused (none: [])."""
    reach, host = Reachability(), Host.detect()
    out = {}
    for task in tasks:
        found = environments.needs(task, reach, host) if task.source else []
        out[task.task_id] = (found, environments.problems(task, sandbox, found, oracle=True))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = args.suite if args.suite.startswith(("harbor:", "jsonl:")) else f"harbor:{args.suite}"
    try:
        tasks, suite_root = load_tasks(spec)
        make_sandbox(args.sandbox, proxy_address=None, state_dir=Path(tempfile.gettempdir())).check()
        check_needs([t for t in tasks if t.environment.get("mode") != "build"], args.sandbox)
    except (SuiteError, SandboxUnavailable, EvaluatorUnavailable, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    wanted = [n for n in args.tasks.split(",") if n]
    unknown = sorted(set(wanted) - {t.task_id for t in tasks})
    if unknown:
        print(f"error: no such task(s) {unknown} in {suite_root}", file=sys.stderr)
        return 2
    tasks = [t for t in tasks if not wanted or t.task_id in wanted]
    for line in suite_warnings(tasks):
        print(f"warning: {line}")
    t0 = time.monotonic()
    checked = preflight(tasks, args.sandbox)
    if args.preflight:
        for task in tasks:
            found, refused = checked[task.task_id]
            print(f"{task.task_id}: {'REFUSED' if refused else 'ok'}")
            for need in found:
                print(f"  {need.line()}")
        return 0
    rows: dict[str, dict] = {t.task_id: refused_row(t, "refused", checked[t.task_id][1]) for t in tasks
                             if checked[t.task_id][1]}  # fmt: skip
    runnable = [t for t in tasks if t.task_id not in rows]
    base = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="gyre-check-suite-", dir=base))
    box = make_sandbox(args.sandbox, proxy_address=None, hide=[root, suite_root], state_dir=root / "sandbox")
    try:
        runnable = build_environments(runnable, box, rows)
        start = run_mode(runnable, START_CMD, root / "start", box, args.parallel, args.timeout)
        oracle = run_mode(runnable, ORACLE_CMD, root / "oracle", box, args.parallel, args.timeout)
    finally:
        box.close()
    if args.write_expected:
        write_expected(runnable, oracle)
    rows.update({r["task"]: r for r in table(runnable, start, oracle)})
    ordered = [rows[t.task_id] for t in tasks]
    print_table(ordered)
    bad = failures(ordered, args.max_start)
    refused = [r for r in ordered if r["state"] != "ran"]
    ran = len(ordered) - len(refused)
    verdict = (f"all {ran} oracles 1.0 and all starts below {args.max_start}" if not bad
               else f"{len(bad)} failure(s)")  # fmt: skip
    print(f"{len(tasks)} tasks, sandbox {args.sandbox}, {time.monotonic() - t0:.1f} s: {ran} ran: {verdict}; "
          f"{len(refused)} not run (refused or build failed, with the reason)")  # fmt: skip
    for r in refused:
        for reason in r["reasons"]:
            print(f"NOT RUN {r['task']}: {r['state']}: {reason}")
    by_task = {r["task"]: r for r in ordered}
    for line in bad:
        print(f"FAIL {line}")
        for text in explain(by_task[line.split(":")[0]]):
            print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"sandbox": args.sandbox, "rows": ordered}, indent=2, default=str),
                                   encoding="utf-8")  # fmt: skip
    if bad or args.keep:
        print(f"run directory kept: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if bad else 0


def build_environments(tasks: list[Task], box, rows: dict[str, dict]) -> list[Task]:
    """Builds the environment layer of each task that runs in one (once per content, cached); a failed build is
    a "build failed" row with its reason. Returns the tasks left to run."""
    left = []
    for task in tasks:
        if not environments.uses_environment(task, box):
            left.append(task)
            continue
        t0 = time.monotonic()
        try:
            built = environments.layer(task, box)
        except (EnvironmentBuildError, EnvironmentUnavailable) as exc:
            rows[task.task_id] = refused_row(task, "build failed", [str(exc)])
            print(f"environment of {task.task_id}: build failed: {str(exc)[:300]}", flush=True)
            continue
        how = "cached" if built.cached else f"built in {time.monotonic() - t0:.1f} s"
        print(f"environment of {task.task_id}: {how} ({built.base.image}"
              f"{', approximated: ' + built.base.approximated if built.base.approximated else ''})", flush=True)  # fmt: skip
        left.append(task)
    return left


if __name__ == "__main__":
    sys.exit(main())
