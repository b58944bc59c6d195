"""Tests for gyre_jax/rollout/executor.py with real subprocess harnesses (small python scripts)."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path

import pytest
from timelimits import scaled, slow_factor

from gyre_jax.rollout.executor import ExecutionResult, ExecutionSpec, Executor
from gyre_jax.rollout.tasks import ANSWER_FILE, INPUT_FILE, Task, evaluate

# A stand-in harness. Its behaviour is the task's instruction ("mode"); it writes what it saw to
# seen.json in its working directory (the workspace).
HARNESS = r"""
import json, os, signal, subprocess, sys, time
task = json.load(open(sys.argv[1]))
mode = task["instruction"]
assert task["expected"] == {}, "the harness's task.json must not hold the answers"
answer = open("input.txt").read().upper()  # the task kind is "upper"
with open("seen.json", "w") as f:
    json.dump({"env": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv[1:]}, f)

def sleeper():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open("child.pid", "w") as f:
        f.write(str(child.pid))

if mode == "ok":
    open("answer.txt", "w").write(answer)
elif mode == "crash":
    open("answer.txt", "w").write(answer[:2])
    sys.exit(3)
elif mode == "hang":
    open("answer.txt", "w").write(answer[:3])
    sleeper()
    time.sleep(3600)
elif mode == "ignore_term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open("answer.txt", "w").write(answer[:1])
    time.sleep(3600)
elif mode == "leave_child":
    open("answer.txt", "w").write(answer)
    sleeper()
elif mode.startswith("sleep"):
    time.sleep(float(mode[5:]))
    open("answer.txt", "w").write(answer)
else:
    sys.exit("unknown mode " + mode)
"""
HARNESS_CMD = [sys.executable, "-c", HARNESS, "{task}", "--model", "{model}", "--seed", "{seed}"]
BASE_URL = "http://127.0.0.1:1/v1"


class FakeRegistry:
    """Hands out a key per execution and records opens/closes and the peak number of open executions."""

    def __init__(self, fail_open: bool = False) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, str]] = []
        self.active = 0
        self.peak = 0
        self.fail_open = fail_open

    def open_execution(self, execution_id: str) -> str:
        if self.fail_open:
            raise RuntimeError("proxy is down")
        with self.lock:
            self.events.append(("open", execution_id))
            self.active += 1
            self.peak = max(self.peak, self.active)
        return f"key-{execution_id}"

    def close_execution(self, execution_id: str) -> None:
        with self.lock:
            self.events.append(("close", execution_id))
            self.active -= 1

    def ids(self, kind: str) -> list[str]:
        return [i for k, i in self.events if k == kind]


def make_task(mode: str, task_id: str = "t0", text: str = "qkzmt") -> Task:
    return Task(
        task_id=task_id, kind="upper", system="", instruction=mode, files={INPUT_FILE: text},
        expected={ANSWER_FILE: text.upper()}, tools=[], max_turns=1, tool_latency_median_s=0.0, tool_latency_sigma=0.0,
    )  # fmt: skip


def make_executor(tmp_path: Path, registry: FakeRegistry, **kw) -> Executor:
    args = dict(model_name="tiny", timeout_s=scaled(10.0), max_parallel=4, temperature=1.0, max_tokens=64,
                harness_cmd=HARNESS_CMD, kill_grace_s=0.5, evaluator_timeout_s=scaled(5.0))  # fmt: skip
    args.update(kw)
    return Executor(registry, BASE_URL, tmp_path / "runs", **args)


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped by its new parent, counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_dead(pid: int, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + scaled(within_s)
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_finished_harness_is_scored_and_sees_only_its_key_and_workspace(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_TEST_SECRET", "do-not-leak")
    registry = FakeRegistry()
    executor = make_executor(tmp_path, registry)
    task = make_task("ok")
    [result] = executor.run([ExecutionSpec("e0", task, task.task_id, seed=7)])
    exec_dir = tmp_path / "runs" / "e0"
    assert result == ExecutionResult(
        execution_id="e0", task_id="t0", group_id="t0", status="finished", reward=1.0, excluded=False,
        exclusion_reason=None, returncode=0, duration_s=result.duration_s, workspace=str(exec_dir / "workspace"),
        sandbox=result.sandbox,
    )  # fmt: skip
    assert result.sandbox["backend"] == "none" and result.sandbox["network"] == "host"  # recorded as not isolated
    assert 0 < result.duration_s < scaled(5)
    seen = json.loads((exec_dir / "workspace" / "seen.json").read_text())
    assert seen["env"]["OPENAI_API_KEY"] == "key-e0" and seen["env"]["OPENAI_BASE_URL"] == BASE_URL
    assert "GYRE_TEST_SECRET" not in seen["env"]
    assert Path(seen["cwd"]).resolve() == (exec_dir / "workspace").resolve()
    assert seen["argv"] == [str(exec_dir / "harness" / "task.json"), "--model", "tiny", "--seed", "7"]
    assert Task.from_json((exec_dir / "task.json").read_text()) == task  # the record sits outside the workspace
    seen_task = json.loads((exec_dir / "harness" / "task.json").read_text())  # the harness's copy: no answers
    assert seen_task == {**task.to_dict(), "expected": {}}
    assert (exec_dir / "harness" / "instruction.md").read_text() == task.instruction
    assert (exec_dir / "workspace" / INPUT_FILE).read_text() == "qkzmt"
    assert json.loads((exec_dir / "result.json").read_text()) == result.to_dict()
    assert ExecutionResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    assert registry.events == [("open", "e0"), ("close", "e0")]


def test_crashing_harness_is_recorded_and_still_evaluated(tmp_path):
    registry = FakeRegistry()
    [result] = make_executor(tmp_path, registry).run([ExecutionSpec("e0", make_task("crash"), "t0", seed=0)])
    assert (result.status, result.returncode, result.excluded) == ("crashed", 3, False)
    assert result.reward == pytest.approx(2 / 5)  # "QK" of "QKZMT"
    assert registry.ids("close") == ["e0"]


def test_harness_that_cannot_start_is_crashed_and_evaluated(tmp_path):
    registry = FakeRegistry()
    executor = make_executor(tmp_path, registry, harness_cmd=[str(tmp_path / "no-such-harness"), "{task}"])
    [result] = executor.run([ExecutionSpec("e0", make_task("ok"), "t0", seed=0)])
    assert (result.status, result.returncode, result.reward, result.excluded) == ("crashed", None, 0.0, False)
    assert "failed to start harness" in (tmp_path / "runs" / "e0" / "harness.stderr").read_text()
    assert registry.events == [("open", "e0"), ("close", "e0")]


def test_timeout_kills_the_process_group_and_scores_the_partial_workspace(tmp_path):
    registry = FakeRegistry()
    timeout_s = scaled(1.0)  # long enough for the harness to reach its hang (write, start its child) under load
    executor = make_executor(tmp_path, registry, timeout_s=timeout_s)
    t0 = time.monotonic()
    [result] = executor.run([ExecutionSpec("e0", make_task("hang"), "t0", seed=0)])
    assert time.monotonic() - t0 < timeout_s + scaled(3.0)
    assert result.status == "timeout" and not result.excluded
    assert result.reward == pytest.approx(3 / 5)  # it had written "QKZ"
    assert timeout_s <= result.duration_s < timeout_s + scaled(2.0)
    child = int((Path(result.workspace) / "child.pid").read_text())
    assert wait_dead(child), "the harness's child survived the timeout"
    assert f"killed after timeout_s={timeout_s}" in (tmp_path / "runs" / "e0" / "harness.stderr").read_text()
    assert registry.events == [("open", "e0"), ("close", "e0")]


def test_timeout_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path):
    timeout_s = scaled(0.5)  # the harness has set SIGTERM aside and written its answer by then, loaded or not
    executor = make_executor(tmp_path, FakeRegistry(), timeout_s=timeout_s, kill_grace_s=0.3)
    [result] = executor.run([ExecutionSpec("e0", make_task("ignore_term"), "t0", seed=0)])
    assert (result.status, result.returncode) == ("timeout", -9)
    assert result.reward == pytest.approx(1 / 5)
    assert result.duration_s < timeout_s + 0.3 + scaled(2.2)


def test_children_left_after_a_normal_exit_are_killed(tmp_path):
    [result] = make_executor(tmp_path, FakeRegistry()).run(
        [ExecutionSpec("e0", make_task("leave_child"), "t0", seed=0)]
    )
    assert (result.status, result.reward) == ("finished", 1.0)
    assert wait_dead(int((Path(result.workspace) / "child.pid").read_text()))


def test_evaluator_that_raises_excludes_the_execution(tmp_path):
    def broken(task: Task, workspace: Path) -> float:
        raise RuntimeError("test runner missing")

    [result] = make_executor(tmp_path, FakeRegistry(), evaluator=broken).run(
        [ExecutionSpec("e0", make_task("ok"), "t0", seed=0)]
    )
    assert (result.status, result.reward, result.excluded) == ("finished", None, True)
    assert result.exclusion_reason == "evaluator raised RuntimeError: test runner missing"


def test_evaluator_that_hangs_is_excluded_after_its_timeout(tmp_path):
    release = threading.Event()

    def hanging(task: Task, workspace: Path) -> float:
        release.wait(20)
        return 1.0

    executor = make_executor(tmp_path, FakeRegistry(), evaluator=hanging, evaluator_timeout_s=0.5)
    t0 = time.monotonic()
    try:
        [result] = executor.run([ExecutionSpec("e0", make_task("ok"), "t0", seed=0)])
    finally:
        release.set()
    assert time.monotonic() - t0 < scaled(3.0)
    assert (result.reward, result.excluded) == (None, True)
    assert result.exclusion_reason == "evaluator exceeded evaluator_timeout_s=0.5"


@pytest.mark.parametrize("bad", [1.5, -0.1, math.nan, "1.0", None])
def test_evaluator_returning_a_non_reward_is_excluded(tmp_path, bad):
    executor = make_executor(tmp_path, FakeRegistry(), evaluator=lambda task, ws: bad)
    [result] = executor.run([ExecutionSpec("e0", make_task("ok"), "t0", seed=0)])
    assert result.excluded and result.reward is None and "expected a float in [0, 1]" in result.exclusion_reason


def test_missing_workspace_makes_the_default_evaluator_exclude(tmp_path):
    """The default evaluator raises on an unusable workspace, so the execution is excluded, not scored 0."""

    def remove_workspace_then_evaluate(task: Task, workspace: Path) -> float:
        import shutil

        shutil.rmtree(workspace)
        return evaluate(task, workspace)

    executor = make_executor(tmp_path, FakeRegistry(), evaluator=remove_workspace_then_evaluate)
    [result] = executor.run([ExecutionSpec("e0", make_task("ok"), "t0", seed=0)])
    assert result.excluded and result.exclusion_reason.startswith("evaluator raised FileNotFoundError")


def test_results_keep_spec_order_and_parallelism_is_bounded(tmp_path):
    registry = FakeRegistry()
    executor = make_executor(tmp_path, registry, max_parallel=3)
    f = slow_factor()  # sleeps far apart next to the harnesses' start-up times, loaded or not: finishing out of order
    sleeps = [round(s * f, 2) for s in (0.8, 0.6, 0.4, 0.3, 0.2, 0.1)]
    specs = [
        ExecutionSpec(f"e{i}", make_task(f"sleep{s}", task_id=f"t{i // 2}"), f"t{i // 2}", seed=i)
        for i, s in enumerate(sleeps)
    ]
    done: list[str] = []
    results = executor.run(specs, on_done=lambda r: done.append(r.execution_id))
    assert [r.execution_id for r in results] == [s.execution_id for s in specs]
    assert [r.group_id for r in results] == ["t0", "t0", "t1", "t1", "t2", "t2"]
    assert all(r.status == "finished" and r.reward == 1.0 for r in results)
    assert sorted(done) == sorted(s.execution_id for s in specs) and done != [s.execution_id for s in specs]
    assert registry.peak == 3
    assert sorted(registry.ids("close")) == sorted(registry.ids("open")) == sorted(s.execution_id for s in specs)
    for spec in specs:  # each execution is closed after it is opened
        assert registry.events.index(("open", spec.execution_id)) < registry.events.index(("close", spec.execution_id))


def test_cancel_kills_running_harnesses_and_returns_promptly(tmp_path):
    registry = FakeRegistry()
    executor = make_executor(tmp_path, registry, timeout_s=scaled(30.0), max_parallel=2)
    specs = [ExecutionSpec(f"e{i}", make_task("hang"), "t0", seed=i) for i in range(4)]
    cancelled_at = []

    def cancel_once_both_hang() -> None:  # an event, not a delay: both harnesses have started their children
        pids = [tmp_path / "runs" / f"e{i}" / "workspace" / "child.pid" for i in (0, 1)]
        deadline = time.monotonic() + scaled(20)
        while not all(p.is_file() and p.read_text() for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        cancelled_at.append(time.monotonic())
        executor.cancel()

    canceller = threading.Thread(target=cancel_once_both_hang)
    canceller.start()
    results = executor.run(specs)
    returned_at = time.monotonic()
    canceller.join()
    assert returned_at - cancelled_at[0] < scaled(3.2)
    assert all(
        (r.status, r.excluded, r.reward, r.exclusion_reason) == ("crashed", True, None, "cancelled") for r in results
    )
    started = registry.ids("open")
    assert sorted(started) == ["e0", "e1"] and sorted(registry.ids("close")) == ["e0", "e1"]
    for execution_id in started:
        assert wait_dead(int((tmp_path / "runs" / execution_id / "workspace" / "child.pid").read_text()))
    assert executor.cancelled
    assert executor.run([ExecutionSpec("late", make_task("ok"), "t0", seed=0)])[0].exclusion_reason == "cancelled"


def test_registry_failure_excludes_without_running(tmp_path):
    [result] = make_executor(tmp_path, FakeRegistry(fail_open=True)).run(
        [ExecutionSpec("e0", make_task("ok"), "t0", seed=0)]
    )
    assert result.excluded and result.exclusion_reason == "open_execution failed: RuntimeError: proxy is down"
    assert not (Path(result.workspace) / "seen.json").exists()


def test_on_done_errors_are_raised_after_all_executions_ran(tmp_path):
    registry = FakeRegistry()
    specs = [ExecutionSpec(f"e{i}", make_task("ok"), "t0", seed=i) for i in range(3)]

    def fail(result: ExecutionResult) -> None:
        raise KeyError(result.execution_id)

    with pytest.raises(RuntimeError, match="on_done raised for 3 execution"):
        make_executor(tmp_path, registry).run(specs, on_done=fail)
    assert sorted(registry.ids("close")) == ["e0", "e1", "e2"]


def test_bad_specs_and_arguments_are_rejected(tmp_path):
    executor = make_executor(tmp_path, FakeRegistry())
    task = make_task("ok")
    with pytest.raises(ValueError, match="repeated: \\['e0'\\]"):
        executor.run([ExecutionSpec("e0", task, "t0", 0), ExecutionSpec("e0", task, "t0", 1)])
    with pytest.raises(ValueError, match="usable as a directory"):
        executor.run([ExecutionSpec("../e0", task, "t0", 0)])
    with pytest.raises(ValueError, match="max_parallel"):
        make_executor(tmp_path, FakeRegistry(), max_parallel=0)
    with pytest.raises(ValueError, match="timeout_s"):
        make_executor(tmp_path, FakeRegistry(), timeout_s=0)
    assert executor.run([]) == []


def test_rerun_of_an_execution_starts_from_a_fresh_workspace(tmp_path):
    executor = make_executor(tmp_path, FakeRegistry())
    executor.run([ExecutionSpec("e0", make_task("ok"), "t0", seed=0)])
    [again] = executor.run([ExecutionSpec("e0", make_task("crash"), "t0", seed=0)])
    assert (Path(again.workspace) / ANSWER_FILE).read_text() == "QK"
    assert again.status == "crashed"


def test_execution_result_invariants():
    common = dict(execution_id="e", task_id="t", group_id="t", returncode=0, duration_s=1.0, workspace="/w")
    with pytest.raises(ValueError, match="reward must be None exactly when excluded"):
        ExecutionResult(status="finished", reward=None, excluded=False, exclusion_reason=None, **common)
    with pytest.raises(ValueError, match="status"):
        ExecutionResult(status="done", reward=1.0, excluded=False, exclusion_reason=None, **common)
    with pytest.raises(ValueError, match="missing keys"):
        ExecutionResult.from_dict({"execution_id": "e"})


def test_anthropic_env_and_templated_command_and_env(tmp_path):
    """Both SDKs' variables carry the execution's key; {task.FIELD} and the other placeholders fill argv and env."""
    registry = FakeRegistry()
    cmd = [*HARNESS_CMD, "--instruction={task.instruction}", "{task.files}", "{execution_id}", "{anthropic_base_url}",
           "{not_a_placeholder}", "{task.kind}{model}"]  # fmt: skip
    executor = make_executor(
        tmp_path, registry, harness_cmd=cmd, extra_env={"HOME": "{exec_dir}/home", "PLAIN": "x{y}"}
    )
    task = make_task("ok")
    [result] = executor.run([ExecutionSpec("e0", task, task.task_id, seed=7)])
    assert result.status == "finished" and result.reward == 1.0 and result.exclusion_kind is None
    exec_dir = tmp_path / "runs" / "e0"
    seen = json.loads((exec_dir / "workspace" / "seen.json").read_text())
    assert seen["env"]["ANTHROPIC_API_KEY"] == seen["env"]["OPENAI_API_KEY"] == "key-e0"
    assert seen["env"]["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:1" and seen["env"]["OPENAI_BASE_URL"] == BASE_URL
    assert seen["env"]["HOME"] == f"{exec_dir}/harness/home" and seen["env"]["PLAIN"] == "x{y}"
    assert seen["argv"][5:] == ["--instruction=ok", json.dumps({INPUT_FILE: "qkzmt"}), "e0", "http://127.0.0.1:1",
                                "{not_a_placeholder}", "uppertiny"]  # fmt: skip
    with pytest.raises(ValueError, match=r"\{task.nope\}.*names no task field"):
        make_executor(tmp_path, registry, harness_cmd=["x", "{task.nope}"])


def test_command_evaluator_scores_or_excludes_and_failures_are_counted(tmp_path):
    from gyre_jax.rollout.executor import summarize

    script = ("import sys, pathlib; a = pathlib.Path('answer.txt'); mode = sys.argv[1]\n"
              "if mode == 'score': print('checking'); print(1.0 if a.read_text() == sys.argv[2] else 0.25)\n"
              "elif mode == 'crash': sys.exit('boom')\n"
              "elif mode == 'hang': import time; time.sleep(3600)\n"
              "elif mode == 'words': print('pass')\n"
              "else: print(mode)\n")  # fmt: skip
    registry = FakeRegistry()
    results = {}
    for mode in ["score", "crash", "hang", "words", "7", "nan-text"]:
        executor = make_executor(tmp_path, registry, evaluator=[sys.executable, "-c", script, mode, "{task.expected}"],
                                 evaluator_timeout_s=scaled(1.5))  # fmt: skip
        [results[mode]] = executor.run([ExecutionSpec(f"e-{mode}", make_task("ok"), "t0", seed=0)])
    assert results["score"].reward == 0.25  # argv got the expected mapping as JSON, not the answer text
    assert results["words"].reward == 1.0
    assert (results["crash"].excluded, results["crash"].exclusion_kind) == (True, "evaluator_error")
    assert "boom" in results["crash"].exclusion_reason
    assert results["hang"].exclusion_kind == "evaluator_timeout"
    assert results["7"].exclusion_kind == "evaluator_bad_value" and "[0, 1]" in results["7"].exclusion_reason
    assert results["nan-text"].exclusion_kind == "evaluator_bad_value"
    counts = summarize(list(results.values()))
    assert counts["evaluator_failures"] == 4 and counts["evaluator_timeouts"] == 1 and counts["excluded"] == 4
    assert counts["reward_mean"] == pytest.approx((0.25 + 1.0) / 2) and counts["finished"] == 6


def test_command_evaluator_kills_its_process_group_on_timeout(tmp_path):
    from gyre_jax.rollout.evaluators import CommandEvaluator

    workspace = tmp_path / "ws"
    workspace.mkdir()
    script = ("import subprocess, sys, time\n"
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
              "open('child.pid', 'w').write(str(c.pid)); time.sleep(3600)\n")  # fmt: skip
    with pytest.raises(TimeoutError, match="exceeded"):  # the limit leaves time to write child.pid, loaded or not
        CommandEvaluator([sys.executable, "-c", script], timeout_s=scaled(1.0))(make_task("ok"), workspace)
    assert wait_dead(int((workspace / "child.pid").read_text()))
    with pytest.raises(FileNotFoundError):
        CommandEvaluator(["true"])(make_task("ok"), tmp_path / "missing")
    with pytest.raises(ValueError, match="non-empty"):
        CommandEvaluator([])
    assert (
        ExecutionResult.from_dict(
            {
                k: v
                for k, v in json.loads(
                    json.dumps(ExecutionResult("e", "t", "g", "finished", 0.5, False, None, 0, 1.0, "/w").to_dict())
                ).items()
                if k != "exclusion_kind"
            }
        ).reward
        == 0.5
    )
