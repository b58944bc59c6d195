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
