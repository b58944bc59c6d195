"""Issue 19, part "disk": escaping harnesses, full disks, evaluator and data faults, as rows for
``benchmarks/bench_faults.py`` (``run(quick, seed, workdir)``). The same cases as tests/faults/test_harness_escape.py,
test_disk_full.py and test_evaluator_faults.py, repeated (quick: once each; long: ``LONG_REPEATS`` times, and the
run-level full-disk case). A full disk is a real small tmpfs where this machine allows mounting one (root), else an
ENOSPC-injecting ``os.write``/``os.fsync`` (``extra["disk"]`` says which)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LONG_REPEATS = 8
CMD = "python benchmarks/bench_faults.py --case disk"


def _load(path: Path, name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _row(fault, injected, ok, printed, lost=0, double=0, node="", needs=""):
    printed = "".join(c if c.isprintable() or c == "\n" else "?" for c in printed)
    return {"fault": fault, "injected": injected, "lost": lost, "double_counted": double,
            "outcome": "ok" if ok else "fails", "printed": printed.strip().splitlines()[-1][:300] if printed else "",
            "command": f"{CMD}  (test: {node})" if node else CMD, "needs": "" if ok else needs}  # fmt: skip


class _Patch:
    """A minimal monkeypatch (setattr, undo) for the injected disk outside pytest."""

    def __init__(self) -> None:
        self._undo = []

    def setattr(self, obj, name, value) -> None:
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, value in reversed(self._undo):
            setattr(obj, name, value)
        self._undo.clear()


def _counts(specs, results):
    ids = [r.execution_id for r in results]
    return len({s.execution_id for s in specs} - set(ids)), len(ids) - len(set(ids))


def _harness_rows(du, esc, workdir: Path, n: int) -> list[dict]:
    from gyre_jax.rollout.executor import ExecutionSpec

    cases = [  # fault, mode, executor options, check(result) -> bool
        ("harness setsid double-fork daemon", "escape", {}, lambda r: r.status == "finished"),
        ("harness daemon ignoring SIGTERM", "escape_then_hang", {"timeout_s": 4.0}, lambda r: r.status == "timeout"),
        ("harness closes stdout, keeps running", "close_stdout", {"timeout_s": 3.0}, lambda r: r.status == "timeout"),
        ("harness fills its workspace", "fill", {"timeout_s": 30.0, "max_workspace_bytes": 2 << 20},
         lambda r: r.killed_reason == "workspace_full" and r.reward is not None),
    ]  # fmt: skip
    node = "tests/faults/test_harness_escape.py"
    rows = []
    for fault, mode, opts, check in cases:
        tag = du.new_tag()
        executor = du.make_executor(workdir / f"h-{mode}", esc.HARNESS, tag, max_parallel=2, **opts)
        specs = [ExecutionSpec(f"{mode}-{i}", du.make_task(mode, task_id=f"t{i}"), f"t{i}", seed=i) for i in range(n)]
        specs.append(ExecutionSpec("after", du.make_task("ok", task_id="after"), "after", seed=0))
        results = executor.run(specs)
        survivors = du.tagged_alive(tag)
        for pid in survivors:  # leave nothing behind, even when the case fails
            os.kill(pid, signal.SIGKILL)
        lost, double = _counts(specs, results)
        ok = not survivors and all(check(r) for r in results[:-1]) and results[-1].reward == 1.0
        stderr = (workdir / f"h-{mode}" / specs[0].execution_id / "harness.stderr").read_text()
        printed = stderr + (f"\n{len(survivors)} process(es) survived" if survivors else "")
        rows.append(_row(fault, n, ok, printed, lost, double, node, needs="issue 19 item 2"))
        shutil.rmtree(workdir / f"h-{mode}", ignore_errors=True)
    return rows


def _disk(du, root: Path, use_tmpfs: bool, patch: _Patch):
    if use_tmpfs:
        return du.TmpfsDisk(root)
    root.mkdir(parents=True, exist_ok=True)
    return du.InjectedDisk(root, patch)


def _full_disk_rows(du, workdir: Path, n: int, long: bool) -> tuple[list[dict], str]:
    from gyre_jax.disk import DiskFull, write_whole
    from gyre_jax.metrics import MetricsWriter, read_metrics
    from gyre_jax.proxy.records import RecordStore, TitoRecord
    from gyre_jax.trajectory.queue import ExecutionQueue
    from gyre_jax.trajectory.reader import iter_records

    node = "tests/faults/test_disk_full.py"
    root = workdir / "fs"
    rows, patch = [], _Patch()
    with du.small_fs(root, "2m") as mounted:
        kind = "tmpfs" if mounted else "inject"

        def cycle(fault, write_ok, write_full, check):
            """``n`` times: a write, the disk filled, a write that must fail cleanly, space freed, a write."""
            printed, ok = "", True
            for i in range(n):
                disk = _disk(du, root, mounted, patch)
                try:
                    write_ok(i)
                    disk.fill()
                    try:
                        write_full(i)
                        ok, printed = False, "the write on a full disk did not fail"
                    except DiskFull as exc:
                        printed = str(exc)
                    disk.free()
                    write_ok(i + 1000)
                    ok = ok and check(i)
                except Exception as exc:  # noqa: BLE001 - a row that fails, not a crashed benchmark
                    ok, printed = False, f"{type(exc).__name__}: {exc}"
                    disk.free()
                finally:
                    patch.undo()
                for p in list(root.iterdir()):
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
            rows.append(_row(fault, n, ok, printed, node=node, needs="issue 19 item 3"))

        def rec(i, eid="e0"):
            return TitoRecord(eid, i, "t", f"r{i}", list(range(3000)), [5], [-0.1], [0], "stop", 1.0, 0, 0.0, 1.0)

        store = lambda: RecordStore(root / "records")  # noqa: E731

        def rec_ok(i):
            s = store()
            s.append(rec(s.count("e0")))

        cycle("ENOSPC on a TITO record append", rec_ok, lambda i: store().append(rec(store().count("e0"))),
              lambda i: [r.call_index for r in iter_records(store().path("e0"), "e0")] == [0, 1])  # fmt: skip
        queue = lambda: ExecutionQueue(root / "trajectory")  # noqa: E731
        cycle("ENOSPC on an execution-queue append", lambda i: queue().append_step(i, [(f"a{i}", 1.0)]),
              lambda i: queue().append_step(7, [(f"x{j:04d}" + "y" * 60, 0.5) for j in range(200)]),
              lambda i: queue().end()[1] == 2)  # fmt: skip
        path = root / "results" / "step_000000.jsonl"
        cycle("ENOSPC on a results file (write_whole)", lambda i: write_whole(path, f'{{"i": {i}}}\n'),
              lambda i: write_whole(path, "z" * 60_000), lambda i: json.loads(path.read_text())["i"] >= 1000)  # fmt: skip

        def metrics_full(i):
            try:
                MetricsWriter(root / "m", tensorboard=False).write(1, {"note": "n" * 60_000})
            except DiskFull:
                raise RuntimeError("metrics raised on a full disk instead of skipping the line") from None
            raise DiskFull(root / "m" / "metrics.jsonl")  # skipped, not raised: report the line it logs

        cycle("ENOSPC on metrics (skipped, run goes on)", lambda i: MetricsWriter(root / "m", tensorboard=False).write(
            0, {"loss": 1.0}), metrics_full, lambda i: len(read_metrics(root / "m" / "metrics.jsonl")) == 2)  # fmt: skip
        rows.append(_proxy_row(du, root, mounted, patch, n, node))
        if mounted:
            rows.append(_checkpoint_row(du, root, n, node))
            if long:
                rows.append(_train_row(du, workdir, node))
                rows.append(_train_resume_row(du, workdir, node))
    return rows, kind


def _proxy_row(du, root: Path, mounted: bool, patch: _Patch, n: int, node: str) -> dict:
    import openai

    from gyre_jax.proxy.records import RecordStore
    from gyre_jax.trajectory.reader import iter_records

    conftest = du.load_path(REPO / "tests" / "proxy" / "conftest.py")
    backend = conftest.StoppingBackend(lambda request: "hello", max_context=20_000)
    disk = _disk(du, root, mounted, patch)
    store = RecordStore(root / "records")
    ok, printed, refused = True, "", 0
    try:
        with conftest.ProxyServer(backend, conftest.BYTES, store, model_name="gyre-tiny") as server:
            client = openai.OpenAI(base_url=server.base_url, api_key=server.open_execution("e0"), max_retries=0)

            def call():
                messages = [{"role": "user", "content": "word " * 2000}]
                return client.chat.completions.create(model="gyre-tiny", messages=messages, max_tokens=8)

            for _ in range(n):
                call()
                disk.fill()
                try:
                    call()
                    ok = False
                except openai.APIStatusError as exc:
                    refused += exc.status_code == 507
                    printed = f"HTTP {exc.status_code}: {exc.message}"
                disk.free()
            call()
            ok = ok and refused == n and len(list(iter_records(store.path("e0"), "e0"))) == n + 1
    finally:
        disk.free()
        patch.undo()
        backend.shutdown()
        shutil.rmtree(root / "records", ignore_errors=True)
    return _row("ENOSPC on a proxy call's record (507)", n, ok, printed, node=node, needs="issue 19 item 3")


def _checkpoint_row(du, root: Path, n: int, node: str) -> dict:
    import numpy as np

    from gyre_jax.checkpoint import Checkpointer
    from gyre_jax.disk import DiskFull

    ok, printed = True, ""
    for _ in range(n):
        ckpt = Checkpointer(root / "checkpoints")
        ckpt.save(1, {"w": np.arange(60_000, dtype=np.float32)}, {"next_step": 1})
        disk = du.TmpfsDisk(root)
        disk.fill()
        try:
            ckpt.save(2, {"w": np.zeros(60_000, np.float32)}, {"next_step": 2})
            ok = False
        except DiskFull as exc:
            printed = str(exc)
        ckpt.close()
        disk.free()
        again = Checkpointer(root / "checkpoints")
        ok = ok and again.latest_step() == 1
        again.save(2, {"w": np.zeros(60_000, np.float32)}, {"next_step": 2})
        ok = ok and again.latest_step() == 2
        again.close()
        shutil.rmtree(root / "checkpoints")
    return _row("ENOSPC on a checkpoint save", n, ok, printed, node=node, needs="issue 19 item 3")


def _train_row(du, workdir: Path, node: str) -> dict:
    fs = workdir / "trainfs"
    with du.small_fs(fs, "1m") as mounted:
        if not mounted:
            return _row("ENOSPC at train start (run level)", 0, True, "skipped: no tmpfs", node=node)
        du.fill(fs)
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        done = subprocess.run([sys.executable, "-m", "gyre_jax.train", "--config", "configs/tiny_cpu.py",
                               f"--config.workdir={fs / 'run'}"], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    ok = done.returncode == 1 and last.startswith("error: disk full writing") and "Traceback" not in done.stderr
    return _row("ENOSPC at train start (run level)", 1, ok, last, node=node, needs="issue 19 item 3")


TRAIN_ARGS = ["--config", "configs/tiny_cpu.py", "--config.total_steps=3", "--config.checkpoint_every=1",
              "--config.warm_start.steps=20", "--config.rollout.tasks_per_step=1", "--config.rl.group_size=2",
              "--config.rollout.num_tasks=2", "--config.eval.samples_per_task=0", "--config.metrics.progress_bar=false",
              "--config.metrics.tensorboard=false"]  # fmt: skip


def _train_resume_row(du, workdir: Path, node: str) -> dict:
    """A real run on a tmpfs that fills up after its first RL step: it must stop with the one line (exit 1);
    once space is freed the same command must finish, every step trained once."""
    from gyre_jax.trajectory.queue import ExecutionQueue

    fs = workdir / "resumefs"
    fault = "ENOSPC mid-run, then resume (run level)"
    with du.small_fs(fs, "1g") as mounted:
        if not mounted:
            return _row(fault, 0, True, "skipped: no tmpfs", node=node)
        env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "gyre_jax.train", *TRAIN_ARGS, f"--config.workdir={fs / 'run'}"]
        log = workdir / "resume-first.stderr"  # a file: the run logs much more than a pipe holds
        with open(log, "w") as err_file:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err_file, text=True)
            for line in proc.stdout:
                if line.startswith("step 1/"):
                    break
            disk = du.TmpfsDisk(fs)
            disk.fill()
            proc.communicate(timeout=600)
        first_rc, first_last = proc.returncode, (log.read_text().strip().splitlines() or [""])[-1]
        disk.free()
        again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        run = fs / "run"
        steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
                 if x.strip() and json.loads(x).get("phase") == "train"]  # fmt: skip
        queue, offset, trained = ExecutionQueue(run / "trajectory"), 0, []
        while (item := queue.read_at(offset)) is not None:
            trained += [(item[0].step, item[0].execution_id)] if item[0].weight > 0 else []
            offset = item[1]
        results = sorted(p.name for p in (run / "results").glob("step_*.jsonl"))
    double = len(trained) - len(set(trained)) + len(steps) - len(set(steps))
    lost = 3 * 2 - len({t for t in trained})
    ok = (first_rc == 1 and first_last.startswith("error: disk full writing") and again.returncode == 0
          and sorted(set(steps)) == [0, 1, 2] and len(results) == 3 and double == 0)  # fmt: skip
    printed = f"{first_last} | rerun: exit {again.returncode}, {(again.stdout.strip().splitlines() or [''])[-1]}"
    return _row(fault, 1, ok, printed, max(lost, 0), double, node=node, needs="issue 19 item 3")


def _evaluator_rows(du, ev, workdir: Path, n: int) -> list[dict]:
    from gyre_jax.rollout.executor import ExecutionSpec

    executor = du.make_executor(workdir / "eval", ev.HARNESS, du.new_tag(), max_parallel=4, evaluator_timeout_s=4.0,
                                evaluator=[sys.executable, "-c", ev.EVALUATOR, "{task.task_id}"])  # fmt: skip
    specs = [ExecutionSpec(f"{m}-{i}", du.make_task("ok", task_id=m), m, seed=i) for m in ev.MODES for i in range(n)]
    results = executor.run(specs)
    lost, double = _counts(specs, results)
    rows = []
    for mode, (reward, kind, words) in ev.EXPECT.items():
        got = [r for r in results if r.task_id == mode]
        ok = len(got) == n and all(r.reward == reward and r.exclusion_kind == kind for r in got)
        ok = ok and all(words is None or words in (r.exclusion_reason or "") for r in got)
        bad = [r for r in got if r.reward != reward or r.exclusion_kind != kind] or got
        printed = (bad[0].exclusion_reason or f"scored {bad[0].reward}") if bad else "no result"
        rows.append(_row(f"evaluator {mode}", n, ok, printed, lost if mode == "good" else 0,
                         double if mode == "good" else 0, "tests/faults/test_evaluator_faults.py",
                         needs="issue 19 item 7"))  # fmt: skip
    return rows


def _torn_row(workdir: Path, n: int, ev) -> dict:
    from gyre_jax.proxy.records import RecordStore, TitoRecord
    from gyre_jax.trajectory.pipeline import TrajectoryConfig, TrajectoryPipeline

    ok, printed = True, ""
    for i in range(n):
        root = workdir / f"torn{i}"
        store = RecordStore(root / "records")
        writer = subprocess.Popen([sys.executable, "-c", ev.WRITER, str(store.root)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)}, text=True)  # fmt: skip
        ok = ok and writer.stdout.readline() == "half\n"
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        store.append(TitoRecord("good", 0, "main", "g", [1, 2, 3], [5], [-0.1], [0], "stop", 1.0, 0, 0.0, 1.0))
        config = TrajectoryConfig(max_branches=3, row_length=64, rows=2, max_sequences=8, vocab_size=64)
        pipe = TrajectoryPipeline(store.root, root / "trajectory", config)
        pipe.enqueue(0, [("torn", 0.5), ("good", -0.5)])
        step = pipe.next_step()
        reasons = dict(step.excluded)
        ok = ok and step.executions == ["good"] and "truncated file" in reasons.get("torn", "")
        printed = reasons.get("torn", "not excluded")
        shutil.rmtree(root)
    return _row("record file torn by SIGKILL", n, ok, printed, node="tests/faults/test_evaluator_faults.py",
                needs="issue 19 item 7")  # fmt: skip


def run(quick: bool, seed: int, workdir: Path) -> dict:
    """Rows, one per fault (module docstring); ``extra``: the full-disk kind and seconds per group of cases."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    random.seed(seed)  # the cases are deterministic; the seed is kept for the table's reproduce line
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    faults = REPO / "tests" / "faults"
    du = _load(faults / "_disk_util.py", "_disk_util")
    esc = _load(faults / "test_harness_escape.py", "_disk_bench_escape")
    ev = _load(faults / "test_evaluator_faults.py", "_disk_bench_evaluator")
    from gyre_jax.rollout.process_group import become_subreaper

    subreaper = become_subreaper()
    n = 1 if quick else LONG_REPEATS
    timings, rows = {}, []
    t = time.monotonic()
    rows += _harness_rows(du, esc, workdir, n)
    timings["harness_s"], t = time.monotonic() - t, time.monotonic()
    disk_rows, kind = _full_disk_rows(du, workdir, n, long=not quick)
    rows += disk_rows
    timings["disk_full_s"], t = time.monotonic() - t, time.monotonic()
    rows += _evaluator_rows(du, ev, workdir, n)
    rows.append(_torn_row(workdir, n, ev))
    timings["evaluator_s"] = time.monotonic() - t
    return {"rows": rows, "extra": {"disk": kind, "subreaper": subreaper, "repeats": n, **timings}}


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = run(quick="--long" not in sys.argv, seed=0, workdir=Path(d))
    for row in out["rows"]:
        print(f"{row['fault']:42s} {row['injected']:3d} lost {row['lost']} double {row['double_counted']} "
              f"{row['outcome']:5s} {row['printed'][:110]}")  # fmt: skip
    print(json.dumps(out["extra"]))
