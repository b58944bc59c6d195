"""Cells over several processes (``runtime.lockstep``): 4 processes x 2 virtual CPU devices, two cells of 2
processes each, every device call of a cell run on both of its processes, driven by the first.

``tests/runtime/lockstep_worker.py`` serves on both cells and moves sessions between them mid-generation, KV
included: the completions equal unmoved ones (greedy and seeded sampling), a cancel follows a moved request, and a
moved idle session's KV is reused on the other cell.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # 4 processes

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(script: Path, count: int, out: Path, timeout: float) -> list[int]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # every process compiles its own (see test_train_multiprocess)
    port = _free_port()
    logs = [open(out / f"p{pid}.log", "w") for pid in range(count)]
    procs = [
        subprocess.Popen([sys.executable, str(script), str(pid), str(port), str(out)], cwd=REPO, env=env,
                         stdout=log, stderr=subprocess.STDOUT)
        for pid, log in enumerate(logs)
    ]  # fmt: skip
    deadline, codes = time.time() + timeout, []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a process was still running after {timeout} s (a hang)\n" + _logs(out, count))
    return codes


def _logs(out: Path, count: int) -> str:
    return "\n".join(f"--- process {i}\n{(out / f'p{i}.log').read_text()[-2500:]}" for i in range(count))


def test_sessions_move_between_cells_over_several_processes(tmp_path):
    codes = _run_workers(REPO / "tests" / "runtime" / "lockstep_worker.py", 4, tmp_path, timeout=900)
    assert codes == [0, 0, 0, 0], _logs(tmp_path, 4)
    r = json.loads((tmp_path / "lockstep.json").read_text())
    ref = r["unmoved"]
    assert [got[0] for got in r["unmoved_on_cell1"]] == [want[0] for want in ref]  # the two cells compute alike
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
    assert r["lockstep_calls_cell0"] > 50  # cell 0's programs ran on both of its processes
    for pid in (1, 3):  # the replaying processes ran their driver's calls and stopped when it did
        assert (tmp_path / f"p{pid}.log").read_text().count("Traceback") == 0
    assert "process 2 sent" in (tmp_path / "p2.log").read_text()


SMALL = [
    "--config", "configs/tiny_cpu.py", "--config.warm_start.steps=2", "--config.rollout.tasks_per_step=2",
    "--config.rl.group_size=4", "--config.rollout.num_tasks=2", "--config.eval.samples_per_task=0",
    "--config.metrics.progress_bar=false", "--config.metrics.tensorboard=false", "--config.rollout.timeout_s=600",
    "--config.distributed.enabled=true", "--config.model.num_layers=1", "--config.model.embed_dim=32",
    "--config.model.mlp_dim=64",
    "--config.model.head_dim=8",  # the least to compile: what is tested is the processes' choreography
]  # fmt: skip
TRAIN = [  # 4 processes x 2 devices, 2 cells of 2 processes each
    *SMALL, "--config.devices.num_cpu_devices=8", "--config.mesh.data=4", "--config.mesh.fsdp=2",
    "--config.cells.num_cells=2", "--config.cells.data=2", "--config.cells.fsdp=2", "--config.schedule.policy=elastic",
    "--config.distributed.num_processes=4",
]  # fmt: skip


def _train(workdir: Path, steps: int, args: list[str] = TRAIN, processes: int = 4, timeout: float = 1500) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    port = _free_port()
    args = [*args, f"--config.workdir={workdir}", f"--config.total_steps={steps}",
            f"--config.distributed.coordinator_address=127.0.0.1:{port}"]  # fmt: skip
    out = workdir.parent
    logs = [open(out / f"p{pid}.log", "w") for pid in range(processes)]
    procs = [
        subprocess.Popen([sys.executable, "-m", "gyre_jax.train", *args, f"--config.distributed.process_id={pid}"],
                         cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        for pid, log in enumerate(logs)
    ]  # fmt: skip
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a process was still running after {timeout} s\n" + _logs(out, processes))
    assert [p.returncode for p in procs] == [0] * processes, _logs(out, processes)


def _switches(workdir: Path) -> list[tuple[int, str, str]]:
    """(cell, from, to) of every completed role change in decisions.jsonl, in order (a cell passes through
    "switching" on the way)."""
    out, last = [], {}
    for line in (workdir / "decisions.jsonl").read_text().splitlines():
        for i, role in enumerate(json.loads(line)["state"]["roles"]):
            if role != "switching":
                if last.get(i, role) != role:
                    out.append((i, last[i], role))
                last[i] = role
    return out


def test_elastic_training_over_two_cells_of_two_processes_checkpoints_and_resumes(tmp_path):
    """4 processes x 2 devices, cells {0, 1} (the core) and {2, 3}, elastic policy: both cells switch roles both
    ways, both claim micro-steps, every process of the core writes its shards of the checkpoint, and a rerun of the
    same command resumes from it with a clean audit."""
    workdir = tmp_path / "run"
    _train(workdir, steps=3)
    switches = _switches(workdir)
    assert ("serving", "training") in {(a, b) for _, a, b in switches}, switches
    assert ("training", "serving") in {(a, b) for _, a, b in switches}, switches
    train = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in train if m.get("phase") == "train"]
    assert (
        sum(m.get("micro_steps/cell0", 0) for m in train) >= 1
        and sum(m.get("micro_steps/cell1", 0) for m in train) >= 1
    )
    state = workdir / "checkpoints" / "3" / "state"
    assert (state / "ocdbt.process_0").is_dir() and (state / "ocdbt.process_1").is_dir()
    logs = [(tmp_path / f"p{pid}.log").read_text() for pid in range(4)]
    assert "runs cell0 in lockstep with process 0" in logs[1] and "runs cell1 in lockstep with process 2" in logs[3]
    assert "follows process 0 with cell1" in logs[2] and "done: 3 steps" in logs[0]
    _train(workdir, steps=4)
    log0 = (tmp_path / "p0.log").read_text()
    assert "resumed from" in log0 and "at step 3" in log0 and "done: 4 steps" in log0
    audit = subprocess.run([sys.executable, "-m", "gyre_jax.audit", str(workdir)], cwd=REPO, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert audit.returncode == 0 and "lost 0, double counted 0" in audit.stdout, audit.stdout + audit.stderr


def test_a_cell_over_processes_of_one_device_each_trains_and_checkpoints(tmp_path):
    """One process per accelerator (the usual GPU launch): one cell over 2 processes of 1 device each. The train
    state's step counter, put from a host value onto the cell, used to come out as an array whose one local buffer
    spanned both processes, and the first checkpoint failed in orbax."""
    workdir = tmp_path / "run"
    one_device_each = [*SMALL, "--config.devices.num_cpu_devices=2", "--config.mesh.data=2", "--config.mesh.fsdp=1",
                       "--config.cells.num_cells=1", "--config.cells.data=2", "--config.distributed.num_processes=2"]  # fmt: skip
    _train(workdir, 2, one_device_each, processes=2)  # resuming such a core: the elastic test above
    assert "done: 2 steps" in (tmp_path / "p0.log").read_text()
    state = workdir / "checkpoints" / "2" / "state"
    assert (state / "ocdbt.process_0").is_dir() and (state / "ocdbt.process_1").is_dir()
    audit = subprocess.run([sys.executable, "-m", "gyre_jax.audit", str(workdir)], cwd=REPO, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert audit.returncode == 0 and "lost 0, double counted 0" in audit.stdout, audit.stdout + audit.stderr
