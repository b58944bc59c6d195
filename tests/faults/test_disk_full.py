"""A full disk (issue 19 item 3) at every durable writer of a run: TITO records (and the proxy call that writes
one), the execution queue, results (``write_whole``), metrics and checkpoints. Each writer raises ``DiskFull``
("disk full writing <path>: free space and run the same command again to resume") or skips (metrics); nothing
half-written is read as valid afterwards; writing works again once space is freed. On a real small tmpfs where
this machine allows mounting one (root), and through an ENOSPC-injecting ``os.write``/``os.fsync`` elsewhere."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import anthropic
import numpy as np
import openai
import pytest
from timelimits import scaled

_util = __import__("importlib.util").util
_spec = _util.spec_from_file_location("_disk_util", Path(__file__).with_name("_disk_util.py"))
du = _util.module_from_spec(_spec)
_spec.loader.exec_module(du)

from gyre_jax.disk import DiskFull  # noqa: E402
from gyre_jax.metrics import MetricsWriter, read_metrics  # noqa: E402
from gyre_jax.proxy.records import RecordStore, TitoRecord  # noqa: E402
from gyre_jax.trajectory.queue import ExecutionQueue  # noqa: E402
from gyre_jax.trajectory.reader import iter_records  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FULL = "disk full writing {}: free space and run the same command again to resume"


@pytest.fixture(params=["tmpfs", "inject"])
def disk(request, tmp_path, monkeypatch):
    root = tmp_path / "fs"
    if request.param == "inject":
        root.mkdir()
        yield du.InjectedDisk(root, monkeypatch)
        return
    with du.small_fs(root, "2m") as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs is refused here (needs root); the 'inject' case covers the writers")
        yield du.TmpfsDisk(root)


def record(i: int, execution_id: str = "e0", size: int = 3000) -> TitoRecord:
    """A record several pages long, so that appending it needs new blocks."""
    return TitoRecord(execution_id, i, "t0", f"r{i}", list(range(size)), [5, 6], [-0.1, -0.2], [0, 0], "stop", 1.0, 0,
                      0.0, 1.0)  # fmt: skip


def test_record_store_on_a_full_disk_keeps_whole_lines_and_resumes(disk):
    store = RecordStore(disk.root / "records")
    store.append(record(0))
    before = store.path("e0").read_bytes()
    disk.fill()
    with pytest.raises(DiskFull) as err:
        store.append(record(1))
    assert str(err.value) == FULL.format(store.path("e0"))
    assert store.path("e0").read_bytes() == before  # cut back: no torn line
    assert [r.call_index for r in iter_records(store.path("e0"), "e0")] == [0]
    disk.free()
    store.append(record(1))
    assert [r.call_index for r in iter_records(store.path("e0"), "e0")] == [0, 1]


def test_queue_on_a_full_disk_keeps_whole_entries_and_resumes(disk):
    queue = ExecutionQueue(disk.root / "trajectory")
    queue.append_step(0, [("a", 1.0), ("b", -1.0)])
    end = queue.end()
    disk.fill()
    many = [(f"x{i:04d}-" + "y" * 60, 0.5) for i in range(200)]  # ~25 KB: new blocks
    with pytest.raises(DiskFull, match=r"disk full writing .*queue\.jsonl: free space and run the same command"):
        queue.append_step(1, many)
    assert queue.end() == end and ExecutionQueue(disk.root / "trajectory").end() == end
    assert queue.path.stat().st_size == end[0]
    disk.free()
    entries = queue.append_step(1, many[:2])
    assert [e.index for e in entries] == [2, 3]
    offset, seen = 0, []
    while (item := queue.read_at(offset)) is not None:
        seen.append(item[0].execution_id)
        offset = item[1]
    assert seen == ["a", "b", many[0][0], many[1][0]]


def test_results_file_is_replaced_whole_or_not_at_all(disk):
    from gyre_jax.disk import write_whole

    path = disk.root / "results" / "step_000000.jsonl"
    write_whole(path, '{"old": 1}\n')
    disk.fill()
    with pytest.raises(DiskFull) as err:
        write_whole(path, json.dumps({"new": "z" * 50_000}) + "\n")
    assert str(err.value) == FULL.format(path)
    assert path.read_text() == '{"old": 1}\n' and not path.with_suffix(".jsonl.tmp").exists()
    disk.free()
    write_whole(path, '{"new": 2}\n')
    assert path.read_text() == '{"new": 2}\n'


def test_metrics_on_a_full_disk_are_skipped_and_the_writer_goes_on(disk, caplog):
    writer = MetricsWriter(disk.root / "run", tensorboard=False)
    writer.write(0, {"loss": 1.0})
    disk.fill()
    with caplog.at_level(logging.WARNING, logger="gyre_jax.metrics"):
        writer.write(1, {"loss": 0.5, "note": "n" * 50_000})
    assert "metrics of step 1 not written: disk full writing" in caplog.text
    disk.free()
    writer.write(2, {"loss": 0.25})
    assert [m["step"] for m in read_metrics(writer.path)] == [0, 2]
    with open(writer.path, "a") as f:  # a line torn by a kill: skipped, with a warning
        f.write('{"step": 3, "lo')
    with caplog.at_level(logging.WARNING, logger="gyre_jax.metrics"):
        assert [m["step"] for m in read_metrics(writer.path)] == [0, 2]
    assert "skipped a torn last line" in caplog.text


def test_checkpoint_on_a_full_disk_is_never_taken_as_the_latest(disk):
    if disk.kind != "tmpfs":
        pytest.skip("orbax writes through tensorstore (C++), which the injected os.write does not reach")
    from gyre_jax.checkpoint import Checkpointer

    state = {"w": np.arange(60_000, dtype=np.float32)}
    ckpt = Checkpointer(disk.root / "checkpoints")
    ckpt.save(1, state, {"next_step": 1})
    disk.fill()
    with pytest.raises(DiskFull, match=r"disk full writing .*checkpoints/2: free space and run the same command"):
        ckpt.save(2, {"w": state["w"] + 1}, {"next_step": 2})
    ckpt.close()
    disk.free()
    again = Checkpointer(disk.root / "checkpoints")
    assert again.latest_step() == 1
    restored, meta = again.restore(1, {"w": np.zeros(60_000, np.float32)})
    assert meta == {"next_step": 1} and np.array_equal(np.asarray(restored["w"]), state["w"])
    again.save(2, {"w": state["w"] + 1}, {"next_step": 2})
    assert again.latest_step() == 2
    again.close()


def test_proxy_answers_507_on_a_full_disk_and_keeps_serving(disk):
    conftest = du.load_path(REPO / "tests" / "proxy" / "conftest.py")
    backend = conftest.StoppingBackend(lambda request: "hello", max_context=20_000)
    store = RecordStore(disk.root / "records")
    big = "word " * 2000  # a prompt of ~10k byte tokens: its record needs new blocks
    try:
        with conftest.ProxyServer(backend, conftest.BYTES, store, model_name="gyre-tiny") as server:
            key = server.open_execution("e0")
            client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
            claude = anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key=key, max_retries=0)

            def call() -> str:
                messages = [{"role": "user", "content": big}]
                out = client.chat.completions.create(model="gyre-tiny", messages=messages, max_tokens=8)
                return out.choices[0].message.content

            assert call() == "hello"
            disk.fill()
            with pytest.raises(openai.APIStatusError) as err:
                call()
            assert err.value.status_code == 507
            assert "disk full writing" in err.value.message and "not recorded" in err.value.message
            with pytest.raises(anthropic.APIStatusError) as aerr:
                claude.messages.create(model="gyre-tiny", max_tokens=8, messages=[{"role": "user", "content": big}])
            assert aerr.value.status_code == 507 and aerr.value.body["error"]["type"] == "api_error"
            assert [m.id for m in client.models.list().data] == ["gyre-tiny"]  # still serving
            disk.free()
            assert call() == "hello"
            assert [r.call_index for r in iter_records(store.path("e0"), "e0")] == [0, 1]  # no gap, no torn line
    finally:
        backend.shutdown()


def test_train_on_a_full_disk_stops_with_one_line(tmp_path):
    with du.small_fs(tmp_path / "fs", "1m") as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs is refused here (needs root)")
        du.fill(tmp_path / "fs")
        workdir = tmp_path / "fs" / "run"
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        done = subprocess.run(
            [sys.executable, "-m", "gyre_jax.train", "--config", "configs/tiny_cpu.py", f"--config.workdir={workdir}"],
            cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=scaled(120),
        )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: disk full writing " + str(workdir)), done.stderr[-2000:]
    assert last.endswith(": free space and run the same command again to resume")
    assert "Traceback" not in done.stderr


def test_measured_costs_are_replaced_whole_or_not_at_all(disk):
    from gyre_jax.elastic.controller import CostLog
    from gyre_jax.sim.calibrate import write_measurements

    path = disk.root / "cost_measurements.json"
    write_measurements(path, CostLog(cell_accelerators=4, optimizer_steps=[0.5]), [])
    before = path.read_text()
    disk.fill()
    log = [(4, 100 + i, 0, 0.01, 1e9 + i) for i in range(3000)]  # ~60 KB of decode steps (the loop's step-log form)
    with pytest.raises(DiskFull):
        write_measurements(path, CostLog(cell_accelerators=4, optimizer_steps=[0.5] * 2000), [log])
    assert path.read_text() == before and json.loads(before)["optimizer_steps"] == [0.5]
