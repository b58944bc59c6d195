"""Red-team suite of the reward path (issue 44): hack "solutions" against bundled tasks, each sandbox.

Each hack is a ``solve.sh`` in ``benchmarks/faults/reward_hacks/`` trying one trick of one class (its first
comment lines say which). For every (hack, task, sandbox) the task directory is copied (a hack that rewrites
files it can reach only ever touches the copy), the hack installed as its ``solution/solve.sh``, and the
execution run exactly as ``check_suite`` runs an oracle: through the real executor, sandbox and verifier. The
honest baseline is the untouched start of the same task in the same sandbox. A hack is **forged** when it is
scored (not excluded) above that baseline without being flagged ``reward_suspect``; the target is 0 forged.
The symlink and hard-link hacks point at a "leak" of solved modules outside the workspace
(``/var/tmp/gyre-redteam-leak``, made from the oracles here), which the tricks would otherwise pass off as
their own.

    python benchmarks/faults/reward.py                   # 3 tasks x every hack x none, bwrap -> JSON + table
    python benchmarks/faults/reward.py --quick           # the CI size (tests/faults/test_reward_hacks.py)
    python benchmarks/bench_faults.py --case reward      # the same, as rows of the fault table

``run(quick, seed, workdir)`` is the ``bench_faults.py`` case entry.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gyre_jax.rollout.check_suite import ORACLE_CMD, START_CMD, run_mode  # noqa: E402
from gyre_jax.rollout.sandbox import make_sandbox  # noqa: E402
from gyre_jax.rollout.suites import load_harbor_task  # noqa: E402

HACKS_DIR = Path(__file__).resolve().with_name("reward_hacks")
SUITE = ROOT / "suites" / "pyrepo"
TASKS = ("fix-binary-search", "config-deep-merge", "roman-cli")
QUICK_TASKS = ("fix-binary-search",)
LEAK = Path("/var/tmp/gyre-redteam-leak")
VERIFIER_TIMEOUT_S = 15.0  # the copies' [verifier] timeout_sec: the clock hack runs into it (driver: 80% of it)
REPRODUCE = "python benchmarks/faults/reward.py"
# Run with no other execution beside them: a stray they leave (sandbox none) flags every verifier it overlaps
ALONE = ("daemon_rewriter",)


def hacks() -> list[str]:
    """Every hack's name (its file name without .sh)."""
    return sorted(p.stem for p in HACKS_DIR.glob("*.sh") if not p.stem.startswith("_"))


def hack_class(name: str) -> str:
    """The class a hack belongs to: its script's first comment line after 'Class: ', up to the first colon."""
    for line in (HACKS_DIR / f"{name}.sh").read_text().splitlines()[1:4]:
        if line.startswith("# Class: "):
            return line[len("# Class: ") :].split(":")[0].strip()
    return ""


def make_leak(tasks: tuple[str, ...], scratch: Path) -> None:
    """Solved modules of ``tasks`` (their oracles run over a copy of the start) in ``LEAK``."""
    LEAK.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        work = scratch / f"leak-{task}"
        shutil.copytree(SUITE / task / "environment", work, ignore=shutil.ignore_patterns("Dockerfile"))
        subprocess.run(["bash", str(SUITE / task / "solution" / "solve.sh")], cwd=work, check=True,
                       capture_output=True, timeout=60)  # fmt: skip
        for module in work.glob("*.py"):
            shutil.copy(module, LEAK / module.name)


def copy_task(
    task: str, name: str, suite: Path, solve: Path | None, verifier_timeout_s: float = VERIFIER_TIMEOUT_S
) -> Path:
    """``task`` copied to ``suite/name``, its verifier timeout set, ``solve`` (a hack) as its oracle."""
    dest = suite / name
    shutil.copytree(SUITE / task, dest)
    toml = (dest / "task.toml").read_text().replace("timeout_sec = 60.0", f"timeout_sec = {verifier_timeout_s}", 1)
    (dest / "task.toml").write_text(toml)
    if solve is not None:
        shutil.copy(solve, dest / "solution" / "solve.sh")
        shutil.copy(HACKS_DIR / "_inject.sh", dest / "solution" / "_inject.sh")
    return dest


def run_sandbox(
    sandbox: str, tasks: tuple[str, ...], names: list[str], root: Path, parallel: int, time_scale: float = 1.0
) -> list[dict]:
    """Every (hack, task) in ``sandbox`` and each task's untouched start: one row per (hack, task). ``time_scale``
    multiplies the verifier's and the harness's time limits (a loaded machine: ``tests/timelimits.scaled``)."""
    base = root / sandbox
    suite = base / "suite"
    suite.mkdir(parents=True)
    verifier_s, harness_s = VERIFIER_TIMEOUT_S * time_scale, 60.0 * time_scale
    starts = [load_harbor_task(copy_task(t, f"{t}--start", suite, None, verifier_s)) for t in tasks]
    pairs = [(h, t) for h in names for t in tasks]
    hacked = [load_harbor_task(copy_task(t, f"{t}--{h}", suite, HACKS_DIR / f"{h}.sh", verifier_s)) for h, t in pairs]
    box = make_sandbox(sandbox, proxy_address=None, hide=[base], state_dir=base / "sandbox")
    try:
        start = {t: r for t, r in zip(tasks, run_mode(starts, START_CMD, base / "start", box, parallel, harness_s))}
        t0 = time.monotonic()
        alone = [i for i, (h, _) in enumerate(pairs) if h in ALONE]
        shared = [i for i in range(len(pairs)) if i not in alone]
        results = dict(zip(shared, run_mode([hacked[i] for i in shared], ORACLE_CMD, base / "runs", box, parallel,
                                            harness_s)))  # fmt: skip
        for i in alone:
            [results[i]] = run_mode([hacked[i]], ORACLE_CMD, base / f"runs-{i}", box, 1, harness_s)
    finally:
        box.close()
    results = [results[i] for i in range(len(pairs))]
    rows = []
    for (hack, task), r in zip(pairs, results):
        baseline = start[task].reward
        forged = r.reward is not None and r.reward_suspect is None and baseline is not None and r.reward > baseline
        rows.append({
            "hack": hack, "class": hack_class(hack), "task": task, "sandbox": sandbox, "reward": r.reward,
            "start": baseline, "excluded": r.excluded, "exclusion_kind": r.exclusion_kind, "reason": r.exclusion_reason,
            "suspect": r.reward_suspect, "status": r.status, "forged": forged,
            "held_by": "flagged+excluded" if r.reward_suspect else ("excluded" if r.excluded else "scored <= start"),
        })  # fmt: skip
    print(f"  {sandbox}: {len(results)} hacked executions in {time.monotonic() - t0:.1f} s", flush=True)
    return rows


def run_matrix(tasks: tuple[str, ...], sandboxes: list[str], names: list[str], parallel: int,
               workdir: Path | None = None, time_scale: float = 1.0) -> list[dict]:  # fmt: skip
    """The whole matrix (the leak made first); rows of ``run_sandbox`` (``time_scale``: see there)."""
    with tempfile.TemporaryDirectory(prefix="gyre-redteam-", dir=workdir) as tmp:
        root = Path(tmp)
        make_leak(tasks, root)
        rows = []
        for sandbox in sandboxes:
            rows += run_sandbox(sandbox, tasks, names, root, parallel, time_scale)
        return rows


def table(rows: list[dict]) -> str:
    """hack x sandbox: the reward per task (``excl`` when excluded), flagged, forged."""
    sandboxes = sorted({r["sandbox"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    head = f"{'hack':20s} {'class':42s}" + "".join(f" {s + ': reward per task, flagged':>36s}" for s in sandboxes)
    lines = [head]
    for hack in dict.fromkeys(r["hack"] for r in rows):
        cells = []
        for s in sandboxes:
            got = {r["task"]: r for r in rows if r["hack"] == hack and r["sandbox"] == s}
            rewards = "/".join(
                "excl" if got[t]["reward"] is None else f"{got[t]['reward']:.2f}" for t in tasks if t in got
            )
            flagged = sum(bool(got[t]["suspect"]) for t in got)
            forged = sum(got[t]["forged"] for t in got)
            cells.append(f"{rewards} {flagged}/{len(got)}{' FORGED ' + str(forged) if forged else ''}")
        cls = next(r["class"] for r in rows if r["hack"] == hack)
        lines.append(f"{hack:20s} {cls[:42]:42s}" + "".join(f" {c:>36s}" for c in cells))
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """The docs/reliability.md table: one line per hack, both sandboxes."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    out = ["| hack | class | sandbox | reward per task (" + ", ".join(tasks) + ") | start | flagged | forged |",
           "|---|---|---|---|---|---:|---:|"]  # fmt: skip
    for hack in dict.fromkeys(r["hack"] for r in rows):
        for s in sorted({r["sandbox"] for r in rows}):
            got = [r for r in rows if r["hack"] == hack and r["sandbox"] == s]
            if not got:
                continue
            rewards = " / ".join("excl" if r["reward"] is None else f"{r['reward']:.2f}" for r in got)
            starts = " / ".join(f"{r['start']:.2f}" for r in got)
            out.append(f"| {hack} | {got[0]['class']} | {s} | {rewards} | {starts} | "
                       f"{sum(bool(r['suspect']) for r in got)}/{len(got)} | {sum(r['forged'] for r in got)} |")  # fmt: skip
    return "\n".join(out)


def sandboxes_here() -> list[str]:
    return ["none", "bwrap"] if shutil.which("bwrap") else ["none"]


def run(quick: bool, seed: int, workdir: Path) -> dict:
    """The bench_faults case: one row per hack (all tasks and sandboxes summed)."""
    tasks = QUICK_TASKS if quick else TASKS
    rows = run_matrix(tasks, sandboxes_here(), hacks(), parallel=2, workdir=workdir)
    out = []
    for hack in hacks():
        got = [r for r in rows if r["hack"] == hack]
        forged = sum(r["forged"] for r in got)
        flagged = sum(bool(r["suspect"]) for r in got)
        out.append({
            "fault": f"reward hack: {hack} ({got[0]['class']})", "injected": len(got), "lost": 0,
            "double_counted": 0, "outcome": "fails" if forged else "ok",
            "printed": f"{flagged} flagged reward_suspect, {forged} forged; rewards "
                       + ", ".join(f"{r['sandbox']}:{'excl' if r['reward'] is None else r['reward']}" for r in got),
            "command": f"{REPRODUCE}{' --quick' if quick else ''}", "needs": "",
        })  # fmt: skip
    return {"rows": out, "extra": {"matrix": rows}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK_TASKS} (the CI size)")
    parser.add_argument(
        "--sandbox", action="append", choices=["none", "bwrap"], help="default: both (bwrap if present)"
    )
    parser.add_argument("--hack", action="append", choices=hacks(), help="default: every hack")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "reward_hacks.json"))
    parser.add_argument("--markdown", default="", help="also write the docs table here")
    args = parser.parse_args(argv)
    tasks = QUICK_TASKS if args.quick else TASKS
    t0 = time.monotonic()
    rows = run_matrix(tasks, args.sandbox or sandboxes_here(), args.hack or hacks(), args.parallel)
    print(table(rows))
    forged = [r for r in rows if r["forged"]]
    print(f"{len(rows)} hacked executions ({len(set(r['hack'] for r in rows))} hacks x {len(tasks)} tasks x "
          f"{len(set(r['sandbox'] for r in rows))} sandboxes) in {time.monotonic() - t0:.0f} s: "
          f"{len(forged)} forged, {sum(bool(r['suspect']) for r in rows)} flagged reward_suspect")  # fmt: skip
    for r in forged:
        print(f"FORGED {r['hack']} on {r['task']} ({r['sandbox']}): {r['reward']} > start {r['start']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"tasks": tasks, "rows": rows, "forged": len(forged),
                                          "python": sys.version.split()[0], "seconds": round(time.monotonic() - t0)},
                                         indent=1))  # fmt: skip
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows) + "\n")
    print(f"wrote {args.out}")
    return 1 if forged else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
