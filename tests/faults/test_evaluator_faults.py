"""Evaluator and data faults (issue 19 item 7): an evaluator command that crashes, hangs, leaves a daemon behind,
prints garbage (binary, endless), returns NaN or a value outside [0, 1]; a record file torn mid-line by a real
SIGKILL. Each is excluded with its reason and counted, never scored 0, and the step goes on. Real subprocess
harnesses and command evaluators through the real executor; the torn file through the real trajectory pipeline."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from timelimits import scaled

_util = __import__("importlib.util").util
_spec = _util.spec_from_file_location("_disk_util", Path(__file__).with_name("_disk_util.py"))
du = _util.module_from_spec(_spec)
_spec.loader.exec_module(du)

from gyre_jax.proxy.records import RecordStore, TitoRecord  # noqa: E402
from gyre_jax.rollout.executor import ExecutionSpec, summarize  # noqa: E402
from gyre_jax.trajectory.pipeline import TrajectoryConfig, TrajectoryPipeline  # noqa: E402

HARNESS = "import sys; open('answer.txt', 'w').write(open('input.txt').read().upper())"

# The evaluator's behaviour is the task id (``{task.task_id}``).
EVALUATOR = r"""
import os, sys, time
mode = sys.argv[1]
if mode == "good":
    print("running tests"); print(1.0 if open("answer.txt").read() == "QKZMT" else 0.0)
elif mode == "crash":
    sys.stderr.write("Traceback: evaluator blew up\n"); sys.exit(3)
elif mode == "hang":
    time.sleep(3600)
elif mode == "daemon":
    if os.fork() == 0:
        os.setsid()
        open("eval-daemon.pid", "w").write(str(os.getpid())); time.sleep(3600); os._exit(0)
    while not os.path.exists("eval-daemon.pid"): time.sleep(0.01)
    print(1.0)
elif mode == "binary":
    sys.stdout.buffer.write(os.urandom(4096))
elif mode == "flood":  # 30 MB of output, then no score
    chunk = ("x" * 1023 + "\n") * 1024
    for _ in range(30): sys.stdout.write(chunk)
elif mode == "flood_then_score":
    chunk = ("y" * 1023 + "\n") * 1024
    for _ in range(30): sys.stdout.write(chunk)
    print("0.75")
elif mode == "nan":
    print("nan")
elif mode == "inf":
    print("inf")
elif mode == "above":
    print(1.5)
elif mode == "below":
    print(-0.1)
"""
MODES = ["good", "crash", "hang", "daemon", "binary", "flood", "flood_then_score", "nan", "inf", "above", "below"]
EXPECT = {  # mode -> (reward or None, exclusion kind, words of the reason)
    "good": (1.0, None, None),
    "crash": (None, "evaluator_error", "exited with status 3: Traceback: evaluator blew up"),
    "hang": (None, "evaluator_timeout", "exceeded"),  # the thread's limit or the command's own, whichever first
    "daemon": (1.0, None, None),
    "binary": (None, "evaluator_bad_value", "expected a number in [0, 1]"),
    "flood": (None, "evaluator_bad_value", "printed 'xxxxxxxx"),
    "flood_then_score": (0.75, None, None),
    "nan": (None, "evaluator_bad_value", "printed the score nan"),
    "inf": (None, "evaluator_bad_value", "printed the score inf"),
    "above": (None, "evaluator_bad_value", "printed the score 1.5"),
    "below": (None, "evaluator_bad_value", "printed the score -0.1"),
}


def test_every_evaluator_fault_is_excluded_with_its_reason_and_counted_never_scored_zero(tmp_path):
    tag = du.new_tag()
    executor = du.make_executor(
        tmp_path / "runs", HARNESS, tag, max_parallel=4, evaluator_timeout_s=scaled(4.0),  # only "hang" reaches it
        evaluator=[sys.executable, "-c", EVALUATOR, "{task.task_id}"],
    )  # fmt: skip
    specs = [ExecutionSpec(f"e-{m}", du.make_task("ok", task_id=m), m, seed=0) for m in MODES]
    results = executor.run(specs)  # one step's executions: none of them stops it
    got = {r.task_id: r for r in results}
    for mode, (reward, kind, words) in EXPECT.items():
        r = got[mode]
        assert (r.status, r.reward, r.exclusion_kind) == ("finished", reward, kind), (mode, r)
        assert (words is None) == (r.exclusion_reason is None) and (words is None or words in r.exclusion_reason), (
            mode,
            r.exclusion_reason,
        )
    counts = summarize(results)
    assert (counts["excluded"], counts["evaluator_failures"], counts["evaluator_timeouts"]) == (8, 8, 1)
    assert counts["reward_mean"] == pytest.approx((1.0 + 1.0 + 0.75) / 3)  # the excluded count as nothing, not 0
    daemon = int((Path(got["daemon"].workspace) / "eval-daemon.pid").read_text())
    assert du.wait_for(lambda: not du.alive(daemon), 3.0), "the evaluator's escaped daemon survived"


def test_a_callable_evaluator_returning_nan_or_raising_is_excluded(tmp_path):
    def evaluator(task, workspace):
        return {"nan": float("nan"), "big": 2.0, "str": "1.0"}.get(task.task_id) or 1 / 0

    executor = du.make_executor(tmp_path / "runs", HARNESS, du.new_tag(), evaluator=evaluator)
    results = executor.run(
        [ExecutionSpec(f"e-{m}", du.make_task("ok", task_id=m), m, 0) for m in ["nan", "big", "str", "div"]]
    )
    assert [(r.reward, r.exclusion_kind) for r in results] == [(None, "evaluator_bad_value")] * 3 + [
        (None, "evaluator_error")
    ]
    assert "ZeroDivisionError" in results[3].exclusion_reason


WRITER = r"""
import os, sys
from gyre_jax.proxy.records import RecordStore, TitoRecord
store = RecordStore(sys.argv[1])
def rec(i):
    return TitoRecord("torn", i, "main", f"r{i}", [1, 2, 3] + [4] * 50, [5, 6], [-0.1, -0.2], [0, 0], "stop", 1.0, 0, 0.0, 1.0)
store.append(rec(0))
line = (rec(1).to_json() + "\n").encode()
fd = os.open(store.path("torn"), os.O_WRONLY | os.O_APPEND)
os.write(fd, line[: len(line) // 2])  # the kill lands here, mid-line
print("half", flush=True)
sys.stdin.read()
"""


def test_a_record_file_torn_by_a_kill_is_excluded_with_its_reason_and_counted(tmp_path, caplog):
    store = RecordStore(tmp_path / "records")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(store.root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()}, text=True)  # fmt: skip
    assert writer.stdout.readline() == "half\n"
    writer.send_signal(signal.SIGKILL)
    assert writer.wait() == -9
    assert not store.path("torn").read_bytes().endswith(b"\n")
    with caplog.at_level(logging.WARNING, logger="gyre_jax.proxy.records"):
        assert [r.call_index for r in store.read("torn")] == [0]  # other readers: the torn line is skipped...
    assert "skipped a torn last line" in caplog.text  # ...and said so
    good = TitoRecord("good", 0, "main", "g0", [1, 2, 3], [5, 6], [-0.1, -0.2], [0, 0], "stop", 1.0, 0, 0.0, 1.0)
    store.append(good)
    config = TrajectoryConfig(max_branches=3, row_length=64, rows=2, max_sequences=8, vocab_size=64)
    pipe = TrajectoryPipeline(store.root, tmp_path / "trajectory", config)
    pipe.enqueue(0, [("torn", 0.5), ("good", -0.5)])
    step = pipe.next_step()  # the trainer: excludes the torn execution, trains the other
    reasons = dict(step.excluded)
    assert sorted(step.executions) == ["good"]
    assert "torn.jsonl:2: truncated file: the last line has no newline" in reasons["torn"]
    assert step.stats["excluded"] == 1
