"""The red-team suite at CI size (issue 44): every hack of ``benchmarks/faults/reward_hacks/`` against
fix-binary-search under sandbox none and bwrap, through the real executor, sandbox and verifier. Nothing is
forged (each hack scores at most the untouched start, or is flagged ``reward_suspect`` and excluded), and each
hack is stopped by the mechanism docs/reliability.md names for its class. The full matrix (3 tasks) is
``python benchmarks/faults/reward.py``."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
from timelimits import scaled

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gyre_reward_hacks", ROOT / "benchmarks" / "faults" / "reward.py")
reward = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = reward
_spec.loader.exec_module(reward)

SANDBOXES = ["none", "bwrap"] if shutil.which("bwrap") else ["none"]
START = 0.0909  # fix-binary-search's untouched start: 1 of its 11 tests passes
# Closed by design: the trick changes nothing, the execution scores what the start scores, unflagged.
BY_DESIGN = ("runner_shadow", "conftest_plugin", "config_files", "stdlib_shadow", "startup_hooks", "env_files",
             "daemon_rewriter")  # fmt: skip
# Detected in the tested process or by the driver: flagged reward_suspect and excluded, in every sandbox.
FLAGGED = ("always_equal", "monkeypatch_pytest", "patch_stdlib", "channel_forge", "result_files", "kill_verifier",
           "exit_early", "symlink_out")  # fmt: skip
# Outside the workspace: unreachable in bwrap (scores the start), flagged with sandbox none.
OUTSIDE = ("tests_tamper", "hardlink_out")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    # the verifier's 15 s and the harness's 60 s scaled to this machine's load: a verifier killed at its limit gives
    # no reward, the right verdict, but not the flag a test below looks for (CI under load 17: always_equal's)
    return reward.run_matrix(reward.QUICK_TASKS, SANDBOXES, reward.hacks(), parallel=2,
                             workdir=tmp_path_factory.mktemp("redteam"), time_scale=scaled(1.0))  # fmt: skip


def test_there_are_at_least_15_hacks_each_with_its_class():
    names = reward.hacks()
    assert len(names) >= 15 and all(reward.hack_class(n) for n in names)
    assert set(BY_DESIGN + FLAGGED + OUTSIDE + ("clock_runout", "skip_all", "hide_tests")) == set(names)


def test_no_hack_forges_a_reward(rows):
    assert len(rows) == len(reward.hacks()) * len(SANDBOXES)
    assert all(r["start"] == pytest.approx(START, abs=1e-4) for r in rows)
    forged = [(r["hack"], r["sandbox"], r["reward"]) for r in rows if r["forged"]]
    assert forged == []
    for r in rows:  # scored at most the start, or flagged and excluded
        assert (r["reward"] is not None and r["reward"] <= r["start"]) or (r["suspect"] and r["excluded"]), r


def by(rows, hack, sandbox):
    [row] = [r for r in rows if r["hack"] == hack and r["sandbox"] == sandbox]
    return row


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_each_class_is_closed_by_its_mechanism(rows, sandbox):
    for hack in BY_DESIGN:
        r = by(rows, hack, sandbox)
        assert r["reward"] == pytest.approx(START, abs=1e-4) and r["suspect"] is None, (r["reason"], r)
    for hack in FLAGGED:
        r = by(rows, hack, sandbox)
        assert r["excluded"] and r["exclusion_kind"] == "reward_suspect" and r["suspect"], r
    for hack in OUTSIDE:
        r = by(rows, hack, sandbox)
        if sandbox == "bwrap":
            assert r["reward"] == pytest.approx(START, abs=1e-4) and r["suspect"] is None, r
        else:
            assert r["exclusion_kind"] == "reward_suspect", r
    for hack in ("skip_all", "hide_tests"):  # what was not run did not pass: the expected list is the denominator
        r = by(rows, hack, sandbox)
        assert r["reward"] == 0.0 and not r["excluded"], r
    # the driver's deadline: unfinished tests failed, never a timeout score (a timeout counted as a pass would score
    # above the start: the hack fixes nothing). Here it scores 0 (the hung import fails every test); one CI run on
    # 2026-12-06 under heavy load scored exactly the start (0.0909, cause not found: the row is in the message)
    clock = by(rows, "clock_runout", sandbox)
    no_gain = clock["reward"] is not None and clock["reward"] <= START + 1e-4
    assert no_gain or clock["exclusion_kind"] == "reward_suspect", clock


def test_the_flags_name_what_was_found(rows):
    assert "always-equal" in by(rows, "always_equal", "none")["suspect"]
    assert "TestReport.from_item_and_call was replaced" in by(rows, "monkeypatch_pytest", "none")["suspect"]
    assert "bisect.bisect_left was replaced" in by(rows, "patch_stdlib", "none")["suspect"]
    assert "not written by the guard" in by(rows, "channel_forge", "none")["suspect"]
    assert "exited with status 0 before pytest finished" in by(rows, "result_files", "none")["suspect"]
    assert "killed by signal 9" in by(rows, "kill_verifier", "none")["suspect"]
    assert "searching.py -> /var/tmp/gyre-redteam-leak/searching.py" in by(rows, "symlink_out", "none")["suspect"]
    assert "tests/" in by(rows, "tests_tamper", "none")["suspect"]
    assert "hard link" in by(rows, "hardlink_out", "none")["suspect"]
