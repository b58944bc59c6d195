"""SIGKILL anywhere, then resume (issue 19 item 1): 20 seeded kills of ``python -m gyre_jax.train`` at named
kill points and random moments, each run rerun until it completes, then audited (``gyre_jax.audit``): no
execution lost or trained twice, the checkpoint restores, records and the queue parse, and the final params
equal an unkilled run's. The driver is ``benchmarks/faults/kill.py`` (its long version: >= 200 kills)."""

import importlib.util
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from timelimits import run_time_limits, scaled

from gyre_jax import faultpoints
from gyre_jax.audit import audit
from gyre_jax.checkpoint import Checkpointer
from gyre_jax.proxy.records import RecordStore
from gyre_jax.rollout.process_group import GROUP_FILE, ProcessGroups, group_alive, kill_leftover_group
from gyre_jax.run import ExecutionPlan
from gyre_jax.trajectory.queue import ExecutionQueue

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("faults_kill", REPO / "benchmarks" / "faults" / "kill.py")
kill = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kill)

ARGS = kill.COLOCATED
SEED = 19
# one kill per named point, in run order: the first warm start and its checkpoint, then points of step 0 or 1
POINTS = ["warm_start:2", "checkpoint:1", "rollout:1", "record_torn:1", "record_write:2", "queue_torn:1",
          "pipeline:1", "micro_step:1", "optimizer_step:1", "results_written:1", "checkpoint:1:0.02"]  # fmt: skip


def _state(workdir: Path) -> dict[str, np.ndarray]:
    """The last checkpoint's whole train state (params, optimizer state, step), flattened."""
    ckpt = Checkpointer(workdir / "checkpoints")
    try:
        state, meta = ckpt.restore_as_saved(ckpt.latest_step())
    finally:
        ckpt.close()
    assert meta["next_step"] == 2
    return dict(kill._flat_params(state))


@pytest.fixture(scope="module")
def env():
    return kill.trainer_env()  # tests/conftest.py's JAX_COMPILATION_CACHE_DIR: one cache for every attempt


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env) -> Path:
    """The unkilled run of the same command."""
    workdir = tmp_path_factory.mktemp("kill") / "reference"
    rc, out = kill.attempt([*ARGS, *run_time_limits(), f"--config.workdir={workdir}"], env, None, scaled(600))
    assert rc == 0 and "done: 2 steps" in out, out
    report = audit(workdir)
    assert report.ok and report.steps_completed == 2 and report.executions_run == 4, report
    return workdir


def _campaign(tmp_path: Path, env, args: list[str], kills: list) -> tuple:
    c = kill.Campaign(
        "test", tmp_path / "run", [*args, *run_time_limits(), f"--config.workdir={tmp_path / 'run'}"], kills
    )
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    kill.run_campaign(c, env, scaled(600))
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    print(f"{c.attempts} attempts, kills landed {c.landed}, missed {c.missed}, {c.seconds:.0f}s wall, {cpu:.0f}s CPU")
    report = audit(c.workdir)
    assert report.ok, report.violations
    assert report.lost == 0 and report.double_counted == 0
    assert report.steps_completed == 2 and report.executions_run == 4 and report.records_checked == 4
    return c, report


def _assert_same_params(a: Path, b: Path) -> None:
    """The whole train state equals the unkilled run's, exactly."""
    pa, pb = _state(a), _state(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


@pytest.mark.slow
def test_sigkill_at_every_named_point_of_a_colocated_run_then_resume(tmp_path, env, reference):
    """A kill per attempt at each phase's kill point in run order (torn record and queue writes, inside a
    checkpoint write, between results and checkpoint): every execution trained once, params as unkilled. (The
    long version: ``python benchmarks/bench_faults.py --case kill``, >= 200 kills at seeded visits.)"""
    c, report = _campaign(tmp_path, env, ARGS, [kill.Kill(point=p) for p in POINTS])
    assert sum(c.landed.values()) >= len(POINTS) - 1, c.landed  # the in-checkpoint timer may find the write done
    assert {"warm_start", "checkpoint", "rollout", "record_torn", "record_write", "queue_torn", "pipeline",
            "micro_step", "optimizer_step", "results_written"} <= set(c.landed), c.landed  # fmt: skip
    # each attempt after checkpoint 0 resumes; executions in flight at a kill are set aside and run again
    assert report.resumes >= len(POINTS) - 4 and report.set_aside >= 1
    metrics = [json.loads(line) for line in (c.workdir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["phase"] == "resume" for m in metrics) == report.resumes
    assert sum(m["set_aside"] for m in metrics if m["phase"] == "set_aside") >= 1
    _assert_same_params(c.workdir, reference)


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume(tmp_path, env, reference):
    rng = random.Random(SEED)
    # within the first seconds of an attempt (imports, setup, restore) even on a fast machine: a kill that comes
    # after an attempt's end lands nothing and ends the campaign. With the venv's bytecode compiled a resumed
    # attempt of this run took < 6.5 s in CI (1-8 s delays then landed 1 of 2); each phase has its own kill point
    # in the test above, and benchmarks/faults/kill.py draws random moments over whole attempts.
    kills = [kill.Kill(after_s=rng.uniform(0.5, 3.0)) for _ in range(4)]
    c, _ = _campaign(tmp_path, env, ARGS, kills)
    assert sum(c.landed.values()) >= 2, c.landed  # a delay past a (fast) attempt's end lands nothing
    _assert_same_params(c.workdir, reference)


@pytest.mark.slow
def test_sigkill_during_role_switches_of_the_elastic_policy_then_resume(tmp_path, env):
    points = kill.ELASTIC_POINTS[:5]  # role switches, a micro-step and a queue append of the elastic run
    c, _ = _campaign(tmp_path, env, kill.ELASTIC_RUN, [kill.Kill(point=p) for p in points])
    assert c.landed.get("role_switch", 0) >= 2 and sum(c.landed.values()) >= 4, c.landed


def test_the_audit_finds_lost_double_counted_and_torn_data(tmp_path, reference):
    """The audit is not vacuous: each damage below is reported (a torn queue tail is not a violation)."""

    def damaged(name: str) -> Path:
        return Path(shutil.copytree(reference, tmp_path / name))

    torn_queue = damaged("torn-queue")
    with open(torn_queue / "trajectory" / "queue.jsonl", "a") as f:
        f.write('{"index": 4, "execution_id": "s0000')
    r = audit(torn_queue)
    assert r.ok and r.torn_queue_tail, r.violations

    lost = damaged("lost")
    (lost / "results" / "step_000001.jsonl").unlink()
    r = audit(lost)
    assert r.lost == 2 and not r.ok and "step_000001.jsonl: missing" in r.violations[0]

    twice = damaged("twice")
    lines = (twice / "trajectory" / "queue.jsonl").read_text().splitlines(keepends=True)
    entry = json.loads(lines[0]) | {"index": len(lines)}
    (twice / "trajectory" / "queue.jsonl").write_text("".join(lines) + json.dumps(entry) + "\n")
    results = twice / "results" / "step_000001.jsonl"
    results.write_text(
        results.read_text() + (twice / "results" / "step_000000.jsonl").read_text().splitlines()[0] + "\n"
    )
    r = audit(twice)
    assert r.double_counted >= 2 and any("queued more than once" in v for v in r.violations), r.violations

    torn_record = damaged("torn-record")
    rec = sorted((torn_record / "records").glob("s*.jsonl"))[0]
    rec.write_text(rec.read_text() + '{"execution_id": "x", "call')
    r = audit(torn_record)
    assert any("torn last line" in v for v in r.violations), r.violations

    rerun = damaged("rerun-metrics")
    metrics = (rerun / "metrics.jsonl").read_text().splitlines()
    step1 = next(line for line in metrics if '"phase": "train"' in line and '"step": 1,' in line)
    (rerun / "metrics.jsonl").write_text("\n".join([*metrics, step1]) + "\n")
    r = audit(rerun)
    assert any("exactly one train entry" in v for v in r.violations), r.violations
    resume = json.dumps({"step": 1, "phase": "resume", "checkpoint": 1, "next_step": 1})
    (rerun / "metrics.jsonl").write_text("\n".join([*metrics, resume, step1]) + "\n")
    r = audit(rerun)
    assert r.ok and r.superseded_metrics == 1 and r.resumes == 1, r.violations


def test_kill_point_spec_is_checked():
    assert faultpoints.parse("") is None
    assert faultpoints.parse("checkpoint:2:0.05") == ("checkpoint", 2, 0.05)
    for bad in ("checkpoint", "checkpoint:0", "x:1:-1", ":1", "a:b"):
        with pytest.raises(ValueError, match="GYRE_KILL_AT"):
            faultpoints.parse(bad)


def test_a_harness_left_running_by_a_killed_run_is_killed_before_its_execution_reruns(tmp_path):
    """SIGKILL of the trainer leaves its harness process groups running (no sandbox): the set-aside of their
    executions on resume kills them (the group recorded in ``harness.pgid``), children included."""
    exec_dir = tmp_path / "executions" / "s000000-t0-g00"
    exec_dir.mkdir(parents=True)
    procs = ProcessGroups(kill_grace_s=1.0)
    cmd = ["sh", "-c", "sleep 300 & echo $! > child.pid; wait"]
    runner = threading.Thread(target=procs.run, args=("x", cmd, exec_dir, dict(os.environ), exec_dir, 600))
    runner.daemon = True
    runner.start()
    deadline = time.monotonic() + scaled(30)
    while not (exec_dir / "child.pid").exists() or not (exec_dir / "child.pid").read_text().strip():
        assert time.monotonic() < deadline, "the harness did not start"
        time.sleep(0.05)
    pgid = int((exec_dir / GROUP_FILE).read_text().split()[0])
    child = int((exec_dir / "child.pid").read_text())
    assert group_alive(pgid)
    # the executor is gone (as after a SIGKILL); a resumed attempt plans the same execution again
    plan = ExecutionPlan(None, None, RecordStore(tmp_path / "records"), tmp_path / "executions", tmp_path)
    plan._set_aside_stale([SimpleNamespace(execution_id="s000000-t0-g00")], "step 0")
    deadline = time.monotonic() + scaled(10)
    while group_alive(pgid):
        assert time.monotonic() < deadline, "the leftover harness group still runs"
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists() or b"Z" in Path(f"/proc/{child}/stat").read_bytes().split(b") ")[1][:1]
    assert not exec_dir.exists() and len(list((tmp_path / "aborted").glob("*/executions/s000000-t0-g00"))) == 1
    runner.join(timeout=scaled(10))
    assert not kill_leftover_group(next((tmp_path / "aborted").glob("*/executions/s000000-t0-g00")))  # gone: no-op


def test_a_queue_append_killed_halfway_leaves_a_tail_the_reader_skips_and_the_next_append_cuts(tmp_path):
    code = (
        "import sys; from gyre_jax.trajectory.queue import ExecutionQueue as Q; q = Q(sys.argv[1]);"
        "q.append_step(0, [('a-g00', 0.5), ('a-g01', -0.5)]); q.append_step(1, [('b-g00', 1.0), ('b-g01', -1.0), ('b-g02', 0.0)])"
    )
    env = {**kill.trainer_env(), "GYRE_KILL_AT": "queue_torn:2"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, cwd=REPO, timeout=scaled(120))
    assert proc.returncode == -signal.SIGKILL
    data = (tmp_path / "queue.jsonl").read_bytes()
    assert not data.endswith(b"\n") and data.count(b"\n") == 3  # step 0 whole, step 1 torn mid-entry
    q = ExecutionQueue(tmp_path)
    assert q.end()[1] == 3
    first, offset = q.read_at(0)
    second, offset = q.read_at(offset)
    third, offset = q.read_at(offset)
    assert [e.execution_id for e in (first, second, third)] == ["a-g00", "a-g01", "b-g00"]
    assert q.read_at(offset) is None  # the torn entry is never returned
    assert audit_queue_torn(tmp_path)
    q.append_step(2, [("c-g00", 1.0)])
    lines = (tmp_path / "queue.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [0, 1, 2, 3]


def audit_queue_torn(queue_dir: Path) -> bool:
    from gyre_jax.audit import AuditReport, check_queue

    workdir = queue_dir.parent / "w"
    (workdir / "trajectory").mkdir(parents=True)
    shutil.copy(queue_dir / "queue.jsonl", workdir / "trajectory" / "queue.jsonl")
    report = AuditReport(workdir=str(workdir))
    check_queue(workdir, report)
    return report.ok and report.torn_queue_tail


def test_an_armed_torn_write_point_that_is_not_hit_writes_whole_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(faultpoints, "_loaded", True)
    monkeypatch.setattr(faultpoints, "_target", ("queue_torn", 99, 0.0))
    monkeypatch.setattr(faultpoints, "_counts", {})
    q = ExecutionQueue(tmp_path)
    q.append_step(0, [("a-g00", 0.5), ("a-g01", -0.5)])
    q.append_step(1, [("b-g00", 1.0)])
    assert q.end() == ((tmp_path / "queue.jsonl").stat().st_size, 3) == ExecutionQueue(tmp_path).end()
    assert [json.loads(line)["index"] for line in (tmp_path / "queue.jsonl").read_text().splitlines()] == [0, 1, 2]
