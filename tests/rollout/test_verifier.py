"""The verifier's guarantees (gyre_jax/rollout/verifier.py, verifier_kit/): a verifier that cannot run never
yields a reward (it is refused before any work, or the execution is excluded as ``evaluator_unavailable``), and
what the agent controls cannot change a reward without the execution being flagged ``reward_suspect``. The
red-team suite (tests/faults/test_reward_hacks.py) runs whole hack solutions; these are the mechanisms one by one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from timelimits import scaled

from gyre_jax.rollout.check_suite import KeysOnly
from gyre_jax.rollout.evaluators import CommandEvaluator, EvaluatorUnavailable
from gyre_jax.rollout.executor import ExecutionSpec, Executor, summarize
from gyre_jax.rollout.process_group import become_subreaper, kill_strays
from gyre_jax.rollout.sandbox import make_sandbox
from gyre_jax.rollout.suites import load_harbor_task
from gyre_jax.rollout.tasks import evaluate
from gyre_jax.rollout.verifier import KIT_DIR, VerifierNeeds, check_needs, verifier_problem, workspace_links

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_suites import write_upstream_task  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PYREPO = REPO / "suites" / "pyrepo"
HAS_BWRAP = shutil.which("bwrap") is not None
SANDBOXES = ["none", "bwrap"] if HAS_BWRAP else ["none"]
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's: no pytest in it (checked where used)


def run(tmp_path: Path, task, cmd: list[str], sandbox: str = "none", **kwargs):
    root = tmp_path / "run"
    box = make_sandbox(sandbox, proxy_address=None, hide=[root, Path(task.source).parent], state_dir=tmp_path / "st")
    executor = Executor(KeysOnly(), "http://127.0.0.1:9/v1", root / "executions", model_name="m", timeout_s=scaled(30),
                        max_parallel=1, temperature=1.0, max_tokens=8, harness_cmd=cmd, sandbox=box, network="none",
                        evaluator_timeout_s=scaled(30), **kwargs)  # fmt: skip
    try:
        [result] = executor.run([ExecutionSpec("e0", task, task.task_id, seed=0)])
    finally:
        box.close()
    return result, root / "executions" / "e0"


def with_test_sh(tmp_path: Path, script: str, requires: str = "") -> Path:
    task_dir = write_upstream_task(tmp_path / "suite")
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\n" + script + "\n")
    if requires:
        toml = (task_dir / "task.toml").read_text().replace("[agent]", requires + "\n[agent]")
        (task_dir / "task.toml").write_text(toml)
    return task_dir


def no_pytest_python() -> str:
    if not Path(SYSTEM_PYTHON).exists() or subprocess.run([SYSTEM_PYTHON, "-c", "import pytest"]).returncode == 0:
        pytest.skip(f"needs a python3 without pytest at {SYSTEM_PYTHON}")
    return SYSTEM_PYTHON


# -- 1. a verifier that cannot run never yields a reward ----------------------------------------------------------
def test_needs_are_read_from_task_toml_and_checked_with_the_install_line(tmp_path):
    python = no_pytest_python()
    needs = '[verifier.requires]\ncommands = ["bash"]\npython_modules = ["pytest"]\ninstall = "pip install pytest"\n'
    task = load_harbor_task(with_test_sh(tmp_path, "true", needs))
    assert VerifierNeeds.of(task) == VerifierNeeds(("bash",), ("pytest",), "pip install pytest")
    assert VerifierNeeds(("bash",), ("pytest",)).missing(os.environ["PATH"]) == []  # this venv has pytest
    missing = VerifierNeeds(("no-such-cmd-gyre",), ("pytest",)).missing(str(Path(python).parent))
    assert missing[0] == "the command 'no-such-cmd-gyre'" and "the Python module 'pytest'" in missing[1]
    check_needs([task], "none")  # this machine's verifier python has it
    bad = load_harbor_task(with_test_sh(tmp_path / "b", "true", needs.replace('"pytest"]', '"gyre_no_such_mod"]')))
    with pytest.raises(EvaluatorUnavailable, match=r"needs the Python module 'gyre_no_such_mod'.*pip install pytest"):
        check_needs([bad], "none")
    check_needs([bad], "docker")  # an image provides its own (not checked here)
    assert "gyre_no_such_mod" in verifier_problem(f"harbor:{bad.source}", "none")
    assert verifier_problem("builtin", "none") is None
    broken = with_test_sh(tmp_path / "c", "true", '[verifier.requires]\ncommands = "bash"\n')
    with pytest.raises(ValueError, match=r"\[verifier.requires\] commands must be a list"):
        VerifierNeeds.of(load_harbor_task(broken))


def test_check_suite_refuses_at_start_naming_what_to_install(tmp_path):
    needs = '[verifier.requires]\npython_modules = ["gyre_no_such_mod"]\ninstall = "pip install gyre-no-such"\n'
    with_test_sh(tmp_path, "echo 1 > /logs/verifier/reward.txt", needs)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gyre_jax.rollout.check_suite", str(tmp_path / "suite"),
                           "--sandbox", "none"], cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: the verifier of task hello-world needs the Python module 'gyre_no_such_mod'")
    assert "pip install gyre-no-such" in done.stderr and done.stdout == ""
    assert time.monotonic() - t0 < scaled(120)  # refused before any execution ran


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_the_kit_driver_without_pytest_excludes_the_execution_never_scores_it(tmp_path, sandbox):
    python = no_pytest_python()
    script = f'cd "$GYRE_WORKSPACE"; exec {python} -I "$GYRE_VERIFIER/run_pytest.py" --tests "$GYRE_TESTS" ' \
             '--workspace "$PWD" --logs "$GYRE_LOGS/verifier"'  # fmt: skip
    task_dir = with_test_sh(tmp_path, script)
    (task_dir / "tests" / "test_x.py").write_text("def test_x():\n    assert True\n")
    result, exec_dir = run(tmp_path, load_harbor_task(task_dir), ["true"], sandbox)
    assert result.excluded and result.reward is None and result.exclusion_kind == "evaluator_unavailable", result
    assert "pytest did not start" in result.exclusion_reason and "No module named pytest" in result.exclusion_reason
    assert not (exec_dir / "verifier" / "logs" / "verifier" / "reward.txt").exists()
    counts = summarize([result])
    assert counts["evaluator_unavailable"] == 1 and counts["evaluator_failures"] == 1


def test_a_command_evaluator_that_cannot_run_is_refused_or_excluded(tmp_path):
    with pytest.raises(EvaluatorUnavailable, match="'gyre-no-such-evaluator' is not installed"):
        Executor(KeysOnly(), "http://127.0.0.1:9/v1", tmp_path, model_name="m", timeout_s=5, max_parallel=1,
                 temperature=1.0, max_tokens=8, evaluator=["gyre-no-such-evaluator", "{workspace}"])  # fmt: skip
    task = load_harbor_task(with_test_sh(tmp_path, "true"))
    result, _ = run(tmp_path / "a", task, ["true"], evaluator=["sh", "-c", "gyre-no-such-runner"])
    assert result.exclusion_kind == "evaluator_unavailable" and "127" in result.exclusion_reason, result


def test_the_evaluator_command_does_not_import_from_the_workspace(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "json.py").write_text("raise SystemExit('shadowed')\n")
    (ws / "answer.txt").write_text("x")
    task = load_harbor_task(with_test_sh(tmp_path, "true"))
    score = CommandEvaluator([sys.executable, "-c", "import json; print(json.dumps(1.0))"])(task, ws)
    assert score == 1.0


# -- 2. what the agent controls cannot change the reward unflagged ----------------------------------------------
@pytest.mark.parametrize("sandbox", SANDBOXES)
@pytest.mark.parametrize(
    ("script", "harness", "why"),
    [
        # the tested code made the reward file a symlink before test.sh wrote through it
        ("ln -sf /app/forged /logs/verifier/reward.txt; echo 1 > /logs/verifier/reward.txt", "true", "symlink"),
        # the tested code killed its verifier after writing the reward
        ("echo 1 > /logs/verifier/reward.txt; kill -9 $$", "true", "killed by signal 9"),
        # a verifier may flag its own run
        (
            "echo 0.5 > /logs/verifier/reward.txt; echo 'the tests were patched' > /logs/verifier/suspect.txt",
            "true",
            "the tests were patched",
        ),
        # the workspace links out of itself
        ("echo 1 > /logs/verifier/reward.txt", "ln -s /var/tmp/elsewhere.py mod.py", "links out of itself: mod.py"),
    ],
)
def test_tampering_is_flagged_and_excluded(tmp_path, sandbox, script, harness, why):
    task = load_harbor_task(with_test_sh(tmp_path, script.replace("/app", "$GYRE_WORKSPACE")
                                         .replace("/logs", "$GYRE_LOGS")))  # fmt: skip
    result, _ = run(tmp_path, task, ["sh", "-c", harness], sandbox)
    assert result.excluded and result.exclusion_kind == "reward_suspect", result
    assert why in result.reward_suspect and why in result.exclusion_reason
    assert summarize([result])["reward_suspect"] == 1


def test_a_suspect_reward_is_kept_flagged_when_exclusion_is_off(tmp_path):
    script = 'echo 0.5 > "$GYRE_LOGS/verifier/reward.txt"; echo patched > "$GYRE_LOGS/verifier/suspect.txt"'
    result, _ = run(tmp_path, load_harbor_task(with_test_sh(tmp_path, script)), ["true"], exclude_suspect=False)
    assert (result.reward, result.excluded, result.reward_suspect) == (0.5, False, "patched")


def test_tests_changed_after_the_run_started_give_no_reward(tmp_path):
    task_dir = with_test_sh(tmp_path, 'echo 1 > "$GYRE_LOGS/verifier/reward.txt"')
    harness = f"echo 'echo 1 > $GYRE_LOGS/verifier/reward.txt' >> {task_dir / 'tests' / 'test.sh'}"
    result, _ = run(tmp_path, load_harbor_task(task_dir), ["sh", "-c", harness])
    assert result.exclusion_kind == "reward_suspect" and "tests/" in result.reward_suspect and result.reward is None


def test_the_verifier_environment_is_hardened_and_the_workspace_is_last_on_sys_path(tmp_path):
    probe = ('python3 -c "import sys, os, json; print(json.dumps([sys.path, dict(os.environ)]))" '
             '> "$GYRE_LOGS/verifier/probe.json"; echo 0 > "$GYRE_LOGS/verifier/reward.txt"')  # fmt: skip
    task_dir = with_test_sh(tmp_path, probe)
    harness = "printf 'raise SystemExit(9)\\n' > json.py; printf 'raise SystemExit(9)\\n' > sitecustomize.py"
    result, exec_dir = run(tmp_path, load_harbor_task(task_dir), ["sh", "-c", harness])
    assert result.reward == 0.0, result  # neither the workspace's json.py nor its sitecustomize ran
    import json

    path, env = json.loads((exec_dir / "verifier" / "logs" / "verifier" / "probe.json").read_text())
    assert path[-1] == str(exec_dir / "workspace") and path[0] == str(KIT_DIR)
    assert env["PYTHONSAFEPATH"] == "1" and env["PYTHONNOUSERSITE"] == "1" and env["GYRE_VERIFIER"] == str(KIT_DIR)
    assert env["HOME"] != "/tmp" and "run-" in env["HOME"]  # a fresh home, not the host's /tmp (sandbox none)


def test_workspace_links_allow_the_system_and_inside_links_only(tmp_path):
    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "a.py").write_text("x")
    os.symlink("a.py", ws / "b.py")
    os.symlink("../a.py", ws / "pkg" / "c.py")
    os.symlink("/usr/bin/python3", ws / "python")
    assert workspace_links(ws, "/app") == []
    os.symlink("../../etc_secrets", ws / "pkg" / "up.py")
    outside = tmp_path / "outside.txt"
    outside.write_text("y")
    os.link(outside, ws / "hard.txt")
    os.link(ws / "a.py", ws / "a2.py")  # both names inside: fine
    [line] = workspace_links(ws, "/app")
    assert "pkg/up.py -> ../../etc_secrets" in line and "hard.txt is a hard link" in line and "a2.py" not in line


def test_the_builtin_evaluator_reads_no_link_fifo_or_foreign_file(tmp_path):
    from gyre_jax.rollout.tasks import ANSWER_FILE, BuiltinSuite

    task = BuiltinSuite(seed=0, max_turns=4).tasks_for_step(0, 1)[0]
    want = next(iter(task.expected.values()))
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text(want)
    for make in (lambda p: os.symlink(elsewhere, p), lambda p: os.link(elsewhere, p), os.mkfifo):
        ws = tmp_path / f"ws{time.monotonic_ns()}"
        ws.mkdir()
        make(ws / ANSWER_FILE)
        assert evaluate(task, ws) == 0.0
    ws = tmp_path / "honest"
    ws.mkdir()
    (ws / ANSWER_FILE).write_text(want)
    assert evaluate(task, ws) == 1.0


def test_strays_that_cleared_their_environment_are_killed(tmp_path):
    assert become_subreaper()
    script = ("import os, sys, time\n"
              "if os.fork() == 0:\n"
              "    os.setsid()\n"
              "    if os.fork() == 0:\n"
              "        os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(3600)'], {})\n"
              "    os._exit(0)\n")  # fmt: skip
    subprocess.run([sys.executable, "-c", script], env={**os.environ, "GYRE_EXECUTION_MARK": "x"}, check=True)
    deadline = time.monotonic() + scaled(10)
    while not (killed := kill_strays()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(killed) == 1
    assert not Path(f"/proc/{killed[0]}").exists() or b"Z" in Path(f"/proc/{killed[0]}/stat").read_bytes()[:60]


def test_pyrepo_declares_its_needs_and_expected_tests():
    for task_dir in sorted(p for p in PYREPO.iterdir() if (p / "task.toml").is_file()):
        task = load_harbor_task(task_dir)
        assert VerifierNeeds.of(task).python_modules == ("pytest",), task_dir
        ids = [x for x in (task_dir / "tests" / "expected_tests.txt").read_text().splitlines() if x[:1] != "#"]
        assert len(ids) >= 9 and all("::test_" in i for i in ids), task_dir
