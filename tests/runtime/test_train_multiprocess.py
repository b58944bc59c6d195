"""``python -m gyre_jax.train`` as 2 processes x 4 virtual CPU devices (jax.distributed on loopback, gloo).

Process 0 leads (proxy, executor, records, pipeline, controller, core cell 0); process 1 follows and runs
cell 1 (serving and gradient micro-steps) as process 0's controller directs. The reference is the same
config in one process with 8 devices.

Both runs start their RL steps from one warm-started checkpoint (the reference's step 0, which the
2-process run restores: a checkpoint of one process count restored at another). The warm start itself
runs collectively in the kill test below; its result differs from the one-process warm start in the last
bits (gloo sums across processes in another order than XLA's in-process all-reduce, and 60 Adam steps
amplify that), so equality is asserted where both runs compute the same programs on the same inputs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from layouts import EIGHT_DEVICES
from timelimits import run_time_limits, scaled

pytestmark = pytest.mark.slow  # every test runs 2 processes

REPO = Path(__file__).resolve().parents[2]

RUN = [
    "--config",
    "configs/tiny_cpu.py",
    *EIGHT_DEVICES,  # 4 devices per process
    "--config.warm_start.steps=60",  # enough for some executions to earn a reward: non-zero gradients
    "--config.rollout.tasks_per_step=2",
    "--config.rl.group_size=4",
    "--config.rollout.num_tasks=2",
    "--config.eval.samples_per_task=0",
    "--config.metrics.progress_bar=false",
    "--config.metrics.tensorboard=false",
    "--config.total_steps=2",
]

SMALL_MODEL = ["--config.model.num_layers=1", "--config.model.embed_dim=32", "--config.model.mlp_dim=64",
               "--config.model.head_dim=8"]  # fmt: skip


def _env(shared_cache: bool = False) -> dict:
    """The environment of a training process. ``shared_cache``: keep the session's compilation cache
    (tests/conftest.py), only for a one-process run: the same config's later runs in tests/test_train.py then load
    what it compiled. A 2-process run goes without it: only process 0 writes it, so process 1 would fall further
    behind process 0 at start-up, against gloo's 30 s rendezvous deadline."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the config decides the devices
    if not shared_cache:
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(workdir: Path, pid: int, port: int, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "gyre_jax.train",
        *RUN,
        *run_time_limits(),
        f"--config.distributed.heartbeat_timeout_s={scaled(30):.0f}",  # a peer is silent that long only if dead
        f"--config.workdir={workdir}",
        "--config.distributed.enabled=true",
        f"--config.distributed.coordinator_address=127.0.0.1:{port}",
        "--config.distributed.num_processes=2",
        f"--config.distributed.process_id={pid}",
        *extra,
    ]
    log = open(workdir.parent / f"process{pid}.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT, text=True)


def _log(workdir: Path, pid: int) -> str:
    return (workdir.parent / f"process{pid}.log").read_text()


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.time() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a process was still running after {timeout} s (a hang)")
    return codes


def _restore(path: Path) -> dict[str, np.ndarray]:
    """A checkpoint's train state as flat host arrays (in a subprocess: this one's JAX has other devices)."""
    out = path.parent.parent.parent / f"state_{path.parent.name}.npz"
    code = f"""
import jax
jax.config.update("jax_platforms", "cpu")
import numpy as np, orbax.checkpoint as ocp
ck = ocp.StandardCheckpointer()
tree = ck.metadata({str(path)!r}).item_metadata.tree
dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
state = ck.restore({str(path)!r}, jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), tree))
flat = {{jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(state)}}
np.savez({str(out)!r}, **flat)
"""
    subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=_env(), check=True, capture_output=True, timeout=scaled(300)
    )
    with np.load(out) as f:
        return dict(f)


def _metrics(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The one-process run on 8 devices: warm start, checkpoint 0, 2 RL steps, checkpoint 2."""
    workdir = tmp_path_factory.mktemp("one_process") / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gyre_jax.train", *RUN, *run_time_limits(), f"--config.workdir={workdir}"],
        cwd=REPO,
        env=_env(shared_cache=True),
        capture_output=True,
        text=True,
        timeout=scaled(900),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return workdir


@pytest.fixture(scope="module")
def two_processes(reference, tmp_path_factory) -> Path:
    """The same config as 2 processes x 4 devices, resuming from the reference's warm-started checkpoint 0."""
    workdir = tmp_path_factory.mktemp("two_processes") / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "0", workdir / "checkpoints" / "0")
    port = _free_port()
    procs = [_start(workdir, pid, port) for pid in (0, 1)]
    codes = _wait(procs, timeout=scaled(600))
    assert codes == [0, 0], (
        f"exit codes {codes}\n--- process 0\n{_log(workdir, 0)[-4000:]}\n--- process 1\n{_log(workdir, 1)[-4000:]}"
    )
    return workdir


def test_two_processes_train_the_same_params_as_one_process(reference, two_processes):
    ref = _restore(reference / "checkpoints" / "2" / "state")
    got = _restore(two_processes / "checkpoints" / "2" / "state")
    start = _restore(reference / "checkpoints" / "0" / "state")
    assert got.keys() == ref.keys() and len(ref) > 20
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-6, atol=1e-7, err_msg=k)
    print(f"max abs diff, 2 processes vs 1: {max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref)}")
    # the RL steps did change the params (a comparison of untouched params would prove nothing)
    params = [k for k in ref if "params" in k and "opt_state" not in k]
    assert params and max(float(np.max(np.abs(ref[k] - start[k]))) for k in params) > 1e-6
    steps = _metrics(two_processes)
    train = [m for m in steps if m.get("phase") == "train"]
    assert [m["step"] for m in train] == [0, 1]
    assert any(m["grad_norm"] > 0 for m in train)
    ref_train = [m for m in _metrics(reference) if m.get("phase") == "train"]
    for a, b in zip(train, ref_train):
        assert a["tokens_trained"] == b["tokens_trained"] and a["reward_mean"] == b["reward_mean"]
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-6)


def test_the_cell_on_process_1_served_and_trained(two_processes):
    train = [m for m in _metrics(two_processes) if m.get("phase") == "train"]
    assert all(m["micro_steps/cell1"] >= 1 for m in train)  # process 1's gradients reached the core
    cells = {}
    for f in (two_processes / "records").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            cell = json.loads(line)["cell"]
            cells[cell] = cells.get(cell, 0) + 1
    assert cells.get("cell1", 0) > 0 and cells.get("cell0", 0) > 0, cells  # model calls served on both processes
    log0, log1 = _log(two_processes, 0), _log(two_processes, 1)
    assert "done: 2 steps" in log0 and "follows process 0 with cell1" in log1
    assert not (two_processes / "checkpoints" / "2" / "state").is_symlink()


def test_killing_the_follower_mid_run_stops_process_0_fast(tmp_path):
    """A from-scratch 2-process run (collective warm start), the follower killed during RL step 0. The heartbeat
    bound and the time the survivor may take to stop are scaled to the machine's load (a live peer is never
    declared dead for being slow). The coordinator killed: tests/runtime/test_multiprocess.py (the follower blocked
    waiting for a decision) and benchmarks/faults/kill.py --lockstep-cell (a cell over processes, 10 kills)."""
    heartbeat_s = round(scaled(5))
    workdir = tmp_path / "run"
    workdir.mkdir()
    port = _free_port()
    procs = [
        _start(
            workdir,
            pid,
            port,
            "--config.warm_start.steps=2",
            "--config.total_steps=50",
            f"--config.distributed.heartbeat_timeout_s={heartbeat_s}",
            *SMALL_MODEL,  # compiled from scratch by both processes (no shared cache): the least to compile
        )
        for pid in (0, 1)
    ]
    deadline = time.time() + scaled(300)
    while not list((workdir / "records").glob("*.jsonl")):  # RL rollouts have begun on the 2 processes
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            pytest.fail(f"the run did not reach its rollouts\n{_log(workdir, 0)[-3000:]}\n{_log(workdir, 1)[-3000:]}")
        time.sleep(0.5)
    time.sleep(2.0)
    procs[1].send_signal(signal.SIGKILL)
    t_kill = time.time()
    code = _wait([procs[0]], timeout=scaled(90))[0]
    elapsed = time.time() - t_kill
    procs[1].wait()
    log = _log(workdir, 0)
    print(f"process 0 stopped (exit {code}) {elapsed:.1f} s after process 1 was killed")
    assert elapsed < heartbeat_s + scaled(55), f"took {elapsed:.0f} s to stop (heartbeat {heartbeat_s} s)"
    # the leader survives: its watchdog reports the silent follower (and kills the harnesses)
    assert code == 75, log[-3000:]  # PEER_LOST_EXIT_CODE: restart all processes to resume
    assert "gyre-jax process 0 of 2 is stopping: process 1 stopped responding" in log, log[-3000:]
    assert "restart all processes to resume from the last checkpoint" in log
    assert "done:" not in log


ONE_CELL = ["--config.cells.num_cells=1", "--config.cells.data=4", "--config.cells.fsdp=2"]


@pytest.fixture(scope="module")
def one_cell(reference, tmp_path_factory) -> dict[str, Path]:
    """One cell of 8 devices, the core: in one process, and over 2 processes x 4 devices (its serving steps, micro-
    steps, optimizer steps and checkpoints in lockstep on both, driven by process 0). Both resume from the
    reference's warm-started checkpoint 0 and train 2 RL steps (a long rollout timeout: a loaded machine must not
    time an execution out in one run and not the other)."""
    runs = {}
    for name, processes in (("one_process", 1), ("two_processes", 2)):
        workdir = tmp_path_factory.mktemp(f"one_cell_{name}") / "run"
        (workdir / "checkpoints").mkdir(parents=True)
        shutil.copytree(reference / "checkpoints" / "0", workdir / "checkpoints" / "0")
        extra = (*ONE_CELL, "--config.rollout.timeout_s=600")
        if processes == 1:
            cmd = [sys.executable, "-m", "gyre_jax.train", *RUN, f"--config.workdir={workdir}", *extra]
            proc = subprocess.run(
                cmd, cwd=REPO, env=_env(shared_cache=True), capture_output=True, text=True, timeout=900
            )
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        else:
            port = _free_port()
            procs = [_start(workdir, pid, port, *extra) for pid in (0, 1)]
            codes = _wait(procs, timeout=900)
            assert codes == [0, 0], f"exit codes {codes}\n{_log(workdir, 0)[-4000:]}\n{_log(workdir, 1)[-4000:]}"
        runs[name] = workdir
    return runs


def test_a_cell_over_two_processes_trains_the_same_params_as_one_process(one_cell):
    ref = _restore(one_cell["one_process"] / "checkpoints" / "2" / "state")
    got = _restore(one_cell["two_processes"] / "checkpoints" / "2" / "state")
    start = _restore(one_cell["one_process"] / "checkpoints" / "0" / "state")
    assert got.keys() == ref.keys() and len(ref) > 20
    diff = max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref)
    print(f"max abs diff, one cell over 2 processes vs one process: {diff}")
    assert diff <= 1e-6
    params = [k for k in ref if "params" in k and "opt_state" not in k]
    assert params and max(float(np.max(np.abs(ref[k] - start[k]))) for k in params) > 1e-6  # the steps trained
    state = one_cell["two_processes"] / "checkpoints" / "2" / "state"
    assert (state / "ocdbt.process_0").is_dir() and (state / "ocdbt.process_1").is_dir()  # both wrote their shards
    log0, log1 = _log(one_cell["two_processes"], 0), _log(one_cell["two_processes"], 1)
    assert "done: 2 steps" in log0 and "1 cells x 8 devices" in log0
    assert "process 1 runs cell0 in lockstep with process 0" in log1 and "not supported yet" not in log0 + log1
    train = [m for m in _metrics(one_cell["two_processes"]) if m.get("phase") == "train"]
    ref_train = [m for m in _metrics(one_cell["one_process"]) if m.get("phase") == "train"]
    assert [m["step"] for m in train] == [0, 1] and any(m["grad_norm"] > 0 for m in train)
    for a, b in zip(train, ref_train):
        assert a["tokens_trained"] == b["tokens_trained"] and a["reward_mean"] == b["reward_mean"]


def test_sessions_move_between_processes_with_their_kv(tmp_path):
    """``CellHandle.move_sessions_to`` between a cell on process 0 and one on process 1, both directions, mid-generation
    (``tests/runtime/migrate_worker.py``): requests continue token for token (greedy and seeded
    sampling), cached sessions stay warm, a cancel follows a moved request."""
    port = _free_port()
    worker = REPO / "tests" / "runtime" / "migrate_worker.py"
    logs = [open(tmp_path / f"p{pid}.log", "w") for pid in (0, 1)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(pid), str(port), str(tmp_path)],
            cwd=REPO,
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for pid, log in zip((0, 1), logs)
    ]
    codes = _wait(procs, timeout=scaled(600))
    assert codes == [0, 0], (tmp_path / "p0.log").read_text()[-3000:] + (tmp_path / "p1.log").read_text()[-3000:]
    r = json.loads((tmp_path / "migrate.json").read_text())
    ref = r["unmoved"]
    for key, cell, states in (
        ("moved_1_to_0", "cell0", "moved_1_to_0_states"),
        ("moved_0_to_1", "cell1", "moved_0_to_1_states"),
    ):
        for got, want in zip(r[key], ref):
            assert got[0] == want[0] and got[2] == "length" and got[1] == cell, key  # same tokens, finished there
            np.testing.assert_allclose(got[3], want[3], atol=1e-4)
        in_flight = [n for busy, n in r[states] if busy]
        assert len(in_flight) == 3 and all(0 < n < 40 for n in in_flight), r[states]  # moved mid-generation
    assert sum(not busy for busy, _ in r["moved_0_to_1_states"]) >= 3  # idle cached sessions moved too
    assert r["cancelled"] == ["cancelled"]
    assert r["warm_cached_tokens"] >= r["warm_prompt_len"] - 16  # the moved prefix was reused (page granularity)


def test_sigterm_to_every_process_saves_a_checkpoint_and_all_exit_cleanly(reference, tmp_path):
    """Slurm's preemption notice: SIGTERM to both processes. Process 0 stops at the next safe point and saves;
    the follower's own request to stop is absorbed (not taken as a second, forcing, signal)."""
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "0", workdir / "checkpoints" / "0")
    port = _free_port()
    procs = [_start(workdir, pid, port, "--config.total_steps=50") for pid in (0, 1)]
    deadline = time.time() + scaled(300)
    while "step 1/50" not in _log(workdir, 0):
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            pytest.fail(f"no RL step finished\n{_log(workdir, 0)[-3000:]}\n{_log(workdir, 1)[-3000:]}")
        time.sleep(0.5)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    assert _wait(procs, timeout=scaled(120)) == [0, 0], _log(workdir, 0)[-3000:] + _log(workdir, 1)[-3000:]
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] >= 1
    assert "checkpoint saved. Run the same command again to resume" in _log(workdir, 0)
