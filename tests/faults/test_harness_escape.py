"""Harnesses that try to outlive their execution under ``rollout.sandbox=none`` (issue 19 item 2): one that
``setsid``s and double-forks a long-lived child, one whose escaped child ignores SIGTERM, one that closes its
stdout and keeps running, one that fills its workspace. After each, nothing of it runs and the next execution
runs normally. Real subprocess harnesses through the real executor."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from timelimits import scaled

_util = __import__("importlib.util").util
_spec = _util.spec_from_file_location("_disk_util", Path(__file__).with_name("_disk_util.py"))
du = _util.module_from_spec(_spec)
_spec.loader.exec_module(du)

from gyre_jax.rollout.executor import ExecutionSpec  # noqa: E402
from gyre_jax.rollout.process_group import become_subreaper, disk_usage  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and prctl (Linux)")

HARNESS = r"""
import json, os, signal, sys, time
mode = json.load(open(sys.argv[1]))["instruction"]
answer = open("input.txt").read().upper()

def escape(ignore_term):
    # the classic daemon: fork, setsid (a new session and process group), fork again, parent exits
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            if ignore_term:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open("daemon.pid", "w") as f:
                f.write(str(os.getpid()))
            while True:
                time.sleep(1)
        os._exit(0)
    os.wait()
    while not os.path.exists("daemon.pid"):
        time.sleep(0.01)

if mode == "ok":
    open("answer.txt", "w").write(answer)
elif mode in ("escape", "escape_ignore_term"):
    escape(mode == "escape_ignore_term")
    open("answer.txt", "w").write(answer)
elif mode == "escape_then_hang":
    escape(True)
    open("answer.txt", "w").write(answer[:2])
    time.sleep(3600)
elif mode == "close_stdout":
    open("answer.txt", "w").write(answer[:3])
    print("before close", flush=True)
    os.close(1); os.close(2)
    time.sleep(3600)
elif mode == "fill":
    open("answer.txt", "w").write(answer[:1])
    with open("junk.bin", "wb") as f:
        while True:
            f.write(os.urandom(1 << 16)); f.flush()
            time.sleep(0.01)
"""


def run_modes(tmp_path: Path, modes: list[str], **kw):
    tag = du.new_tag()
    executor = du.make_executor(tmp_path / "runs", HARNESS, tag, **kw)
    specs = [ExecutionSpec(f"e{i}-{m}", du.make_task(m, task_id=f"t{i}"), f"t{i}", seed=i) for i, m in enumerate(modes)]
    return tag, executor.run(specs)


def test_setsid_double_fork_daemons_are_killed_and_reaped_after_a_normal_exit(tmp_path):
    assert become_subreaper()
    tag, results = run_modes(tmp_path, ["escape", "escape_ignore_term", "ok"], kill_grace_s=0.3)
    assert [(r.status, r.reward, r.excluded) for r in results] == [("finished", 1.0, False)] * 3
    daemons = [int((Path(r.workspace) / "daemon.pid").read_text()) for r in results[:2]]
    assert du.tagged_alive(tag) == []  # nothing of any harness runs, the SIGTERM-ignoring daemon included
    assert du.wait_for(lambda: not any(du.exists(p) for p in daemons), 3.0), "a daemon is left as a zombie"
    stderr = (tmp_path / "runs" / results[0].execution_id / "harness.stderr").read_text()
    assert "left the harness's process group" in stderr


def test_escaped_child_of_a_hanging_harness_dies_at_its_timeout(tmp_path):
    timeout_s = scaled(4.0)  # time to escape and write before the limit, loaded or not
    tag, [result, after] = run_modes(tmp_path, ["escape_then_hang", "ok"], timeout_s=timeout_s, max_parallel=1)
    assert (result.status, result.killed_reason, result.reward) == ("timeout", "timeout", pytest.approx(2 / 5))
    assert result.duration_s < timeout_s + scaled(6.0)
    assert du.tagged_alive(tag) == []
    assert not du.alive(int((Path(result.workspace) / "daemon.pid").read_text()))
    assert (after.status, after.reward) == ("finished", 1.0)  # the run goes on


def test_harness_that_closes_its_stdout_and_keeps_running_is_killed_at_its_timeout(tmp_path):
    tag, [result] = run_modes(tmp_path, ["close_stdout"], timeout_s=scaled(3.0))
    assert (result.status, result.returncode, result.reward) == ("timeout", -15, pytest.approx(3 / 5))
    assert du.tagged_alive(tag) == []
    assert (tmp_path / "runs" / result.execution_id / "harness.stdout").read_text() == "before close\n"


def test_harness_filling_its_workspace_is_killed_at_the_cap_and_recorded(tmp_path):
    cap = 2 << 20
    timeout_s = scaled(20.0)  # the cap, not the timeout, must stop it
    tag, [result, after] = run_modes(
        tmp_path, ["fill", "ok"], timeout_s=timeout_s, max_workspace_bytes=cap, max_parallel=1
    )
    assert (result.status, result.killed_reason, result.excluded) == ("crashed", "workspace_full", False)
    assert result.reward == pytest.approx(1 / 5)  # scored on what it left, as a timeout is
    assert result.duration_s < scaled(15.0)
    used = disk_usage(Path(result.workspace))
    assert cap < used < cap + (16 << 20), used  # bounded: at most one check interval of writing past the cap
    assert (
        "workspace grew over 2097152 bytes" in (tmp_path / "runs" / result.execution_id / "harness.stderr").read_text()
    )
    assert du.tagged_alive(tag) == []
    assert (after.status, after.reward, after.killed_reason) == ("finished", 1.0, None)


def test_a_bad_workspace_cap_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_workspace_bytes=0 must be a positive number of bytes"):
        du.make_executor(tmp_path, HARNESS, "x", max_workspace_bytes=0)
    assert os.getpid() > 0


def test_orphans_that_die_after_their_harness_are_reaped_not_left_as_zombies(tmp_path):
    assert become_subreaper()
    harness = (
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(0.2); os._exit(0)\n"
        "open('orphan.pid', 'w').write(str(pid))\n"
    )
    tag, [result] = run_modes_with(tmp_path, harness, kill_grace_s=1.0)
    orphan = int((Path(result.workspace) / "orphan.pid").read_text())
    assert result.status == "finished"
    assert du.wait_for(lambda: not du.exists(orphan), 3.0), "the orphan is left as a zombie of the trainer"


def run_modes_with(tmp_path: Path, harness: str, **kw):
    tag = du.new_tag()
    executor = du.make_executor(tmp_path / "runs", harness, tag, **kw)
    return tag, executor.run([ExecutionSpec("e0", du.make_task("ok"), "t0", seed=0)])
