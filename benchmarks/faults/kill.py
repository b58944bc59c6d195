"""SIGKILL anywhere, then resume (issue 19 item 1): kills ``python -m gyre_jax.train`` (small sizes) at seeded
moments, runs the same command again until the run completes, then audits the run directory
(``python -m gyre_jax.audit``) and compares the final params with an unkilled run of the same command.

Kills: named kill points (``GYRE_KILL_AT=<point>:<n>[:<delay_s>]``, ``gyre_jax/faultpoints.py``: warm start,
rollouts, record writes (torn and whole), the queue (torn append), the pipeline, a micro-step, the optimizer
step, a role switch under ``schedule.policy=elastic``, a checkpoint write (at its start and inside it), after
a step's results are written), and SIGKILLs sent by this driver after a seeded random delay. A campaign is one
run directory: each attempt gets the next kill of the campaign's list, then attempts run unkilled until the
run completes. The final train state (params, optimizer state, step) must equal the unkilled run's in every
colocated campaign, wherever the kills land (a step cut short runs again from its checkpoint with the same
execution ids and seeds); elastic campaigns report their difference from an unkilled elastic run
(``params_max_abs_diff``) without requiring 0. At this size every reward is 0 (RL gradients are 0): weight decay
makes the state depend on the warm start and on how many optimizer steps ran, not on which tokens were trained.

Also: SIGKILL of one process of a 2-process run (``two_process``: the survivor exits, then both are rerun), and
of one process of a cell spanning both processes (``lockstep_cell``, >= 10 kills: every survivor stops within the
heartbeat bound with its line, the reruns complete, audited; alone: ``kill.py --lockstep-cell 10``).

``run(quick, seed, workdir)`` -> ``{"rows": [...], "extra": {...}}`` (benchmarks/faults layout); standalone:
``python benchmarks/faults/kill.py [--long] [--seed N] [--workdir DIR]``.
"""

import argparse  # no "from __future__ import annotations": the module is loaded by path (dataclasses)
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable

# The smallest run of the default config that still has every phase: a 1-layer model on 2 virtual devices,
# 1 task x 2 samples a step, checkpoint every step, no evaluation.
SMALL = [
    "--config",
    "configs/tiny_cpu.py",
    "--config.checkpoint_every=1",
    "--config.warm_start.steps=2",
    "--config.rollout.tasks_per_step=1",
    "--config.rl.group_size=2",
    "--config.rollout.num_tasks=2",
    "--config.rollout.max_turns=2",
    "--config.eval.samples_per_task=0",
    "--config.metrics.progress_bar=false",
    "--config.metrics.tensorboard=false",
    "--config.model.num_layers=1",
    "--config.model.embed_dim=32",
    "--config.model.mlp_dim=64",
    "--config.model.head_dim=8",
    "--config.devices.num_cpu_devices=2",  # 2 cells of 1 device: the least compiling and moving
    "--config.mesh.data=2",
    "--config.mesh.fsdp=1",
    "--config.cells.data=1",
    "--config.rollout.timeout_s=300",  # a harness timeout on a loaded machine would change what is trained
    # At this size every reward is 0, so RL gradients are 0: weight decay makes the params depend on how many
    # optimizer steps ran (a repeated or dropped step shows in the final params).
    "--config.optimizer.weight_decay=0.1",
]
ELASTIC = ["--config.schedule.policy=elastic", "--config.rollout.tool_latency_median_s=0.05"]
COLOCATED = [*SMALL, "--config.total_steps=2"]
ELASTIC_RUN = [*SMALL, *ELASTIC, "--config.total_steps=2", "--config.warm_start.steps=0"]

# Named kill points that any colocated attempt reaches early (cheap), then the later ones.
EARLY_POINTS = ["warm_start:1", "warm_start:2", "checkpoint:1", "checkpoint:1:0.05", "rollout:1", "rollout:2",
                "record_torn:1", "record_write:1", "record_torn:2", "record_write:3"]  # fmt: skip
LATE_POINTS = ["queue_torn:1", "pipeline:1", "micro_step:1", "optimizer_step:1", "results_written:1",
               "checkpoint:1:0.02", "record_torn:1", "rollout:1", "optimizer_step:1"]  # fmt: skip
LONG_KILLS = 200  # the long version runs rounds until this many kills have landed
MAX_ROUNDS = 16
# mostly first visits: a resumed attempt has fewer steps left, so a later visit may never come
ELASTIC_POINTS = ["role_switch:1", "micro_step:1", "role_switch:2", "queue_torn:1", "role_switch:1",
                  "optimizer_step:1", "checkpoint:1:0.01", "role_switch:1"]  # fmt: skip


@dataclass
class Kill:
    """One kill: ``point`` ("name:n[:delay]", the process kills itself there) or ``after_s`` (sent by us)."""

    point: str = ""
    after_s: float = 0.0

    def label(self) -> str:
        return self.point.split(":")[0] if self.point else "random_delay"


@dataclass
class Campaign:
    name: str
    workdir: Path
    args: list[str]
    kills: list[Kill]
    attempts: int = 0
    landed: dict[str, int] = field(default_factory=dict)  # kill label -> kills that landed
    missed: int = 0  # kills whose point was never reached (the attempt ran on)
    seconds: float = 0.0
    last_output: str = ""


def trainer_env(cache_dir: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the entry point makes its own virtual devices
    env.pop("GYRE_KILL_AT", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if cache_dir and "JAX_COMPILATION_CACHE_DIR" not in env:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        # unbounded, as tests/conftest.py says why (a bound makes every write rescan the directory)
    return env


def attempt(args: list[str], env: dict[str, str], kill: Kill | None, timeout_s: float) -> tuple[int, str]:
    """One ``python -m gyre_jax.train`` attempt, killed as ``kill`` says. Returns (returncode, output tail)."""
    env = dict(env)
    if kill is not None and kill.point:
        env["GYRE_KILL_AT"] = kill.point
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([PY, "-m", "gyre_jax.train", *args], cwd=REPO, env=env, stdout=out, stderr=out,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=kill.after_s if kill is not None and kill.after_s > 0 else timeout_s)
        except subprocess.TimeoutExpired:
            if kill is None or kill.after_s <= 0:
                _kill_group(proc)
                raise RuntimeError(f"attempt ran past {timeout_s}s: {' '.join(args)}") from None
            proc.send_signal(signal.SIGKILL)  # the trainer only: its harnesses are left as a real kill leaves them
            proc.wait()
        out.seek(0)
        return proc.returncode, out.read()[-4000:]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_campaign(c: Campaign, env: dict[str, str], timeout_s: float) -> None:
    """Applies ``c.kills`` to successive attempts until one completes the run (``done:``): kills left over then
    are not injected (``missed`` counts a kill whose point that attempt never reached)."""
    t0 = time.monotonic()
    queue = list(c.kills)
    while True:
        kill = queue.pop(0) if queue else None
        rc, out = attempt(c.args, env, kill, timeout_s)
        c.attempts += 1
        c.last_output = out
        if rc == -signal.SIGKILL and kill is not None:
            c.landed[kill.label()] = c.landed.get(kill.label(), 0) + 1
            continue
        if rc != 0 or "done:" not in out:
            raise RuntimeError(f"{c.name}: attempt {c.attempts} exited {rc} (kill {kill}):\n{out}")
        c.missed += kill is not None
        break
    c.seconds = time.monotonic() - t0


def audit_json(workdir: Path, env: dict[str, str]) -> dict:
    proc = subprocess.run([PY, "-m", "gyre_jax.audit", str(workdir), "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"audit of {workdir} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def final_params(workdir: Path, env: dict[str, str]) -> dict[str, list]:
    """The last checkpoint's train state (params, optimizer state, step), flattened (name -> nested lists), read in a subprocess (no JAX here)."""
    code = (
        "import json,sys,numpy as np;from gyre_jax.checkpoint import Checkpointer;"
        "c=Checkpointer(sys.argv[1]);s,_=c.restore_as_saved(c.latest_step());import jax;"
        "print(json.dumps({jax.tree_util.keystr(k):np.asarray(v).tolist() for k,v in "
        "jax.tree_util.tree_leaves_with_path(s)}))"
    )
    proc = subprocess.run([PY, "-c", code, str(workdir / "checkpoints")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, check=True)  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _flat_params(tree, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted path, leaf) pairs of a nested dict/list tree (a restored checkpoint's params)."""
    if isinstance(tree, dict):
        return [kv for k, sub in sorted(tree.items()) for kv in _flat_params(sub, f"{prefix}{k}.")]
    if isinstance(tree, (list, tuple)):
        return [kv for i, sub in enumerate(tree) for kv in _flat_params(sub, f"{prefix}{i}.")]
    return [(prefix.rstrip("."), tree)]


def params_diff(a: dict[str, list], b: dict[str, list]) -> float:
    """Max absolute difference over every param (inf if the trees differ)."""
    import numpy as np

    if a.keys() != b.keys():
        return float("inf")
    return max(float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])))) if a[k] else 0.0 for k in a)


# A step's kill points in run order, and the visits of each that an attempt with that step left still reaches
# at this size (2 executions of >= 1 call each). A kill at a later visit may never come: the attempt completes.
STEP_ORDER = ["rollout", "record_torn", "record_write", "queue_torn", "pipeline", "micro_step", "optimizer_step"]
STEP_VISITS = {"rollout": 2, "record_torn": 2, "record_write": 2}


def seeded_points(rng: random.Random, steps: int = 2) -> list[str]:
    """A later round's kill list: a warm-start kill, then per step of the run a seeded subset of the step's points
    in run order at seeded visits, closed by a kill between results and checkpoint or inside the checkpoint."""
    out = [f"warm_start:{rng.randint(1, 2)}"]
    for _ in range(steps):
        names = sorted(rng.sample(STEP_ORDER, k=rng.randint(3, len(STEP_ORDER))), key=STEP_ORDER.index)
        out += [f"{n}:{rng.randint(1, STEP_VISITS.get(n, 1))}" for n in names]
        out.append(rng.choice(["results_written:1", "checkpoint:1", f"checkpoint:1:{rng.uniform(0.005, 0.08):.3f}"]))
    return out


def campaigns(quick: bool, seed: int, root: Path, ref_s: float) -> Iterator[Campaign]:
    """The seeded campaigns: quick (CI) one round (>= 30 kills, mostly at points reached early); long, rounds
    until the caller has its kills (at most ``MAX_ROUNDS``). Round 0 is the fixed point list; later rounds draw
    theirs (``seeded_points``) and their random delays."""
    rng = random.Random(seed)
    n = 0

    def make(name: str, args: list[str], kills: list[Kill]) -> Campaign:
        nonlocal n
        wd, n = root / f"{name}-{n}", n + 1
        return Campaign(name, wd, [*args, f"--config.workdir={wd}"], kills)

    for r in range(1 if quick else MAX_ROUNDS):
        points = EARLY_POINTS + LATE_POINTS if r == 0 else seeded_points(rng)
        yield make("colocated-points", COLOCATED, [Kill(point=p) for p in points])
        # a resumed attempt is shorter than a whole run: delays within 60% of a whole warm run mostly land
        delays = [Kill(after_s=rng.uniform(1.0, max(2.0, 0.6 * ref_s))) for _ in range(5 if quick else 12)]
        yield make("colocated-random", COLOCATED, delays)
        yield make("elastic-points", ELASTIC_RUN, [Kill(point=p) for p in ELASTIC_POINTS])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_process(root: Path, env: dict[str, str], rng: random.Random, kills: int, timeout_s: float) -> dict:
    """SIGKILL of one process of a 2-process run (at a seeded moment), then both rerun until done; audited."""
    wd = root / "two-process"
    landed, attempts, t0, history = 0, 0, time.monotonic(), []
    while True:
        port = free_port()
        base = [*SMALL, "--config.total_steps=2", f"--config.workdir={wd}", "--config.distributed.enabled=true",
                f"--config.distributed.coordinator_address=127.0.0.1:{port}", "--config.distributed.num_processes=2",
                "--config.distributed.heartbeat_timeout_s=5"]  # fmt: skip
        procs = [subprocess.Popen([PY, "-m", "gyre_jax.train", *base, f"--config.distributed.process_id={p}"],
                                  cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True) for p in (0, 1)]  # fmt: skip
        attempts += 1
        victim = rng.randrange(2) if landed < kills else None
        try:
            if victim is not None:
                try:
                    procs[victim].wait(timeout=rng.uniform(5.0, 25.0))
                except subprocess.TimeoutExpired:
                    procs[victim].send_signal(signal.SIGKILL)
                    landed += 1
            codes = [p.wait(timeout=timeout_s) for p in procs]
            history.append(codes)  # a killed process reads -9; the survivor exits 75 (docs/multihost.md)
        finally:
            for p in procs:
                if p.poll() is None:
                    _kill_group(p)
        if codes == [0, 0]:  # the run completed (a kill drawn for this attempt came after its end: missed)
            break
        if attempts > kills + 4:
            raise RuntimeError(f"2-process run did not complete after {attempts} attempts (last codes {codes})")
    return {"workdir": str(wd), "kills": landed, "attempts": attempts, "exit_codes": history,
            "seconds": round(time.monotonic() - t0, 1),
            "audit": audit_json(wd, env)}  # fmt: skip


# One cell over both processes of a 2-process run (runtime.lockstep): process 0 drives it, process 1 replays its
# device calls; 4 RL steps so that most seeded kills land before the run ends.
LOCKSTEP_CELL = [*SMALL, "--config.total_steps=4", "--config.cells.num_cells=1", "--config.cells.data=2"]
LOCKSTEP_HEARTBEAT_S = 5.0
# the lines a survivor stops with (docs/multihost.md "Failures"): the watchdog's, or JAX's own client's when the
# coordination service (process 0) went first
STOP_LINES = ("is stopping: process", "is stopping: lost the coordination service",
              "Terminating process because the JAX distributed service detected fatal errors")  # fmt: skip


def _joined(logs: list[Path], procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """Waits until every process has joined the run (its ``distributed: process i of n`` line; before that a
    survivor waits for the missing process up to ``distributed.initialization_timeout_s``, not the heartbeat);
    False if one exited first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        if all("distributed: process" in log.read_text(errors="replace") for log in logs):
            return True
        time.sleep(0.1)
    return False


def lockstep_cell(root: Path, env: dict[str, str], rng: random.Random, kills: int, timeout_s: float) -> dict:
    """SIGKILL of one process (seeded: which, and when, 0.5-15 s after both processes joined the run) of a cell
    spanning 2 processes; every survivor must exit within the heartbeat bound (``heartbeat_timeout_s`` + 2 watchdog
    intervals + 10 s for its failure hooks) printing a stop line, then both processes are rerun (resuming from the
    last checkpoint) until the run completes; a completed run is audited, and a new run directory takes the next
    kills until ``kills`` have landed."""
    bound_s = LOCKSTEP_HEARTBEAT_S + 2 * min(max(LOCKSTEP_HEARTBEAT_S / 10, 0.1), 2.0) + 10.0
    landed, attempts, t0, runs, killed = 0, 0, time.monotonic(), [], []
    while landed < kills:
        wd = root / f"lockstep-cell-{len(runs)}"
        shutil.rmtree(wd, ignore_errors=True)
        wd.mkdir(parents=True)
        history = []
        while True:
            port = free_port()
            base = [*LOCKSTEP_CELL, f"--config.workdir={wd}", "--config.distributed.enabled=true",
                    f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                    "--config.distributed.num_processes=2",
                    f"--config.distributed.heartbeat_timeout_s={LOCKSTEP_HEARTBEAT_S}"]  # fmt: skip
            logs = [wd.parent / f"{wd.name}-attempt{attempts}-p{p}.log" for p in (0, 1)]
            procs = [subprocess.Popen([PY, "-m", "gyre_jax.train", *base, f"--config.distributed.process_id={p}"],
                                      cwd=REPO, env=env, stdout=open(logs[p], "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True) for p in (0, 1)]  # fmt: skip
            attempts += 1
            victim = rng.randrange(2) if landed < kills else None
            delay = rng.uniform(0.5, 15.0)  # after both joined; a whole run here takes ~20 s
            try:
                kill = None
                if victim is not None and _joined(logs, procs, timeout_s):
                    try:
                        procs[victim].wait(timeout=delay)
                    except subprocess.TimeoutExpired:
                        if procs[1 - victim].poll() is None:  # both alive: the kill lands
                            procs[victim].send_signal(signal.SIGKILL)
                            kill = time.monotonic()
                            landed += 1
                survivor = procs[1 - victim] if kill is not None else None
                if survivor is not None:
                    try:
                        survivor.wait(timeout=timeout_s)
                    finally:
                        stop_s = time.monotonic() - kill
                codes = [p.wait(timeout=timeout_s) for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        _kill_group(p)
            history.append(codes)
            if kill is not None:
                text = logs[1 - victim].read_text(errors="replace")
                line = next((ln.strip() for ln in text.splitlines() if any(m in ln for m in STOP_LINES)), "")
                killed.append({"run": wd.name, "victim": victim, "after_s": round(delay, 2),
                               "survivor_exit": codes[1 - victim], "stop_s": round(stop_s, 2),
                               "within_bound": stop_s <= bound_s, "line": line[:300],
                               "done_printed": "done:" in text})  # fmt: skip
                continue
            if codes == [0, 0]:  # the run completed (a kill drawn for this attempt came after its end: missed)
                break
            raise RuntimeError(f"{wd.name}: attempt {attempts} with no kill exited {codes}; see {logs[0]}, {logs[1]}")
        runs.append({"workdir": str(wd), "exit_codes": history, "audit": audit_json(wd, env)})
    bad = [k for k in killed if not k["within_bound"] or not k["line"] or k["survivor_exit"] == 0 or k["done_printed"]]
    audit = {"ok": all(r["audit"]["ok"] for r in runs) and not bad,
             "lost": sum(r["audit"]["lost"] for r in runs),
             "double_counted": sum(r["audit"]["double_counted"] for r in runs),
             "violations": [v for r in runs for v in r["audit"]["violations"]]
             + [f"{k['run']}: survivor of a kill of process {k['victim']} exited {k['survivor_exit']} after "
                f"{k['stop_s']} s (bound {bound_s} s) with line {k['line']!r}" for k in bad]}  # fmt: skip
    stops = [k["stop_s"] for k in killed]
    return {"kills": landed, "attempts": attempts, "runs": runs, "killed": killed, "bound_s": bound_s,
            "heartbeat_timeout_s": LOCKSTEP_HEARTBEAT_S, "stop_s_max": max(stops, default=None),
            "stop_s_median": sorted(stops)[len(stops) // 2] if stops else None,
            "seconds": round(time.monotonic() - t0, 1), "audit": audit}  # fmt: skip


def reference_run(args: list[str], workdir: Path, env: dict[str, str], timeout_s: float) -> tuple[float, dict]:
    """The unkilled run of ``args`` in ``workdir``: (seconds, final train state)."""
    t0 = time.monotonic()
    shutil.rmtree(workdir, ignore_errors=True)
    rc, out = attempt([*args, f"--config.workdir={workdir}"], env, None, timeout_s)
    if rc != 0:
        raise RuntimeError(f"the unkilled reference run exited {rc}:\n{out}")
    return time.monotonic() - t0, final_params(workdir, env)


def run(quick: bool, seed: int, workdir: Path) -> dict:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    env = trainer_env(str(workdir / "xla-cache"))
    timeout_s = 600.0
    t0 = time.monotonic()
    _, ref = reference_run(COLOCATED, workdir / "reference", env, timeout_s)  # compiles into the cache
    ref_s, again = reference_run(COLOCATED, workdir / "reference-again", env, timeout_s)  # a warm attempt's time
    _, ref_elastic = reference_run(ELASTIC_RUN, workdir / "reference-elastic", env, timeout_s)
    result_campaigns = []
    landed = 0
    for c in campaigns(quick, seed, workdir, ref_s):
        if not quick and landed >= LONG_KILLS and c.name == "colocated-points":  # whole rounds only
            break
        shutil.rmtree(c.workdir, ignore_errors=True)
        run_campaign(c, env, timeout_s)
        landed += sum(c.landed.values())
        report = audit_json(c.workdir, env)
        elastic = c.name.startswith("elastic")
        diff = params_diff(ref_elastic if elastic else ref, final_params(c.workdir, env))
        result_campaigns.append({"name": c.name, "workdir": str(c.workdir), "attempts": c.attempts,
                                 "landed": c.landed, "missed": c.missed, "seconds": round(c.seconds, 1),
                                 "audit": report, "params_max_abs_diff": diff,
                                 "params_must_match": not elastic})  # fmt: skip
    extra: dict = {"reference_s": round(ref_s, 1), "campaigns": result_campaigns,
                   "unkilled_runs_max_abs_diff": params_diff(ref, again)}  # fmt: skip
    if not quick:  # a failure here is its own failing row: the campaigns above keep their results
        extra["two_process"] = _guarded(lambda: two_process(workdir, env, random.Random(seed), kills=4,
                                                            timeout_s=timeout_s), "the 2-process driver")  # fmt: skip
        extra["lockstep_cell"] = _guarded(lambda: lockstep_cell(workdir, env, random.Random(seed), LOCKSTEP_KILLS,
                                                                 timeout_s), "the lockstep-cell driver")  # fmt: skip
    extra["total_s"] = round(time.monotonic() - t0, 1)
    return {"rows": rows(result_campaigns, extra.get("two_process"), quick, extra.get("lockstep_cell")), "extra": extra}


LOCKSTEP_KILLS = 10


def _guarded(fn, what: str) -> dict:
    """``fn()``, or a failed result of the same shape saying what went wrong (a failing row; other rows stand)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return {"kills": 0, "error": f"{type(exc).__name__}: {exc}"[:500],
                "audit": {"ok": False, "lost": 0, "double_counted": 0,
                          "violations": [f"{what} failed: {exc}"[:300]]}}  # fmt: skip


def rows(results: list[dict], two: dict | None, quick: bool, lockstep: dict | None = None) -> list[dict]:
    """One row per kill kind (named point or random delay), summed over campaigns, + the 2-process rows."""
    cmd = "python benchmarks/bench_faults.py --case kill" + (" --quick" if quick else "")
    by: dict[str, dict] = {}
    for r in results:
        for label, n in r["landed"].items():
            row = by.setdefault(label, {"injected": 0, "bad": [], "lost": 0, "double_counted": 0, "diffs": []})
            row["injected"] += n
            row["lost"] += r["audit"]["lost"]
            row["double_counted"] += r["audit"]["double_counted"]
            row["bad"] += r["audit"]["violations"]
            row["diffs"].append(r["params_max_abs_diff"])
            if r["params_must_match"] and r["params_max_abs_diff"] != 0.0:
                row["bad"].append(f"{r['name']}: final train state differs from the unkilled run's")
    out = []
    for label, row in sorted(by.items()):
        diff = max(row["diffs"]) if row["diffs"] else None
        printed = "audit ok" if not row["bad"] else f"audit: {row['bad'][0]}"
        if diff is not None:
            printed += f"; final train state max |diff| vs the unkilled run of the same command {diff:.3g}"
        out.append({"fault": f"sigkill@{label}", "injected": row["injected"], "lost": row["lost"],
                    "double_counted": row["double_counted"], "outcome": "ok" if not row["bad"] else "fails",
                    "printed": printed, "command": cmd, "needs": ""})  # fmt: skip
    if two is not None:
        a = two["audit"]
        out.append({"fault": "sigkill one of 2 processes", "injected": two["kills"], "lost": a["lost"],
                    "double_counted": a["double_counted"], "outcome": "ok" if a["ok"] else "fails",
                    "printed": "audit ok" if a["ok"] else a["violations"][0], "command": cmd, "needs": ""})  # fmt: skip
    if lockstep is not None:
        a = lockstep["audit"]
        printed = a["violations"][0] if not a["ok"] else (
            f"every survivor stopped with the line within {lockstep['stop_s_max']} s (bound {lockstep['bound_s']} s, "
            f"heartbeat {lockstep['heartbeat_timeout_s']} s); reruns completed, audit ok")  # fmt: skip
        out.append({"fault": "sigkill one process of a cell over 2 processes", "injected": lockstep["kills"],
                    "lost": a["lost"], "double_counted": a["double_counted"], "outcome": "ok" if a["ok"] else "fails",
                    "printed": printed, "command": cmd.replace(" --quick", "") + " (or kill.py --lockstep-cell N)",
                    "needs": ""})  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--long", action="store_true", help="the long version (>= 200 kills)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "gyre-faults-kill")
    parser.add_argument(
        "--lockstep-cell",
        type=int,
        default=0,
        metavar="N",
        help="only the cell-over-2-processes campaign, with N kills; writes --out",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "faults_kill_lockstep.json")
    a = parser.parse_args()
    if a.lockstep_cell:
        a.workdir.mkdir(parents=True, exist_ok=True)
        env = trainer_env(str(a.workdir / "xla-cache"))
        t0 = time.monotonic()
        lock = lockstep_cell(a.workdir, env, random.Random(a.seed), a.lockstep_cell, timeout_s=600.0)
        result = {
            "rows": rows([], None, False, lock),
            "extra": {"lockstep_cell": lock, "total_s": round(time.monotonic() - t0, 1)},
        }
        print("| victim | after (s) | survivor exit | stop (s) | line |\n|---|---|---|---|---|")
        for k in lock["killed"]:
            print(f"| {k['victim']} | {k['after_s']} | {k['survivor_exit']} | {k['stop_s']} | {k['line'][:90]} |")
        print(json.dumps(result["rows"], indent=1))
        a.out.write_text(json.dumps(result, indent=1))
        return 0 if all(r["outcome"] == "ok" for r in result["rows"]) else 1
    result = run(not a.long, a.seed, a.workdir)
    print(json.dumps(result, indent=2))
    return 0 if all(r["outcome"] == "ok" for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
