"""The Harbor verifier: a task's ``tests/test.sh`` run over the final workspace, in a fresh sandbox.

The verifier sees the workspace at the task's workdir (``/app``), the task's ``tests/`` read-only at
``/tests`` (mounted only now: the agent never saw it) and an empty ``/logs``; no network, and an
environment of its own (PATH, a home in /tmp, locale, ``task.toml``'s ``[verifier] env`` and
``GYRE_WORKSPACE`` / ``GYRE_TESTS`` / ``GYRE_LOGS``, the paths it sees): none of the agent's variables,
keys or URLs. It writes the reward to ``/logs/verifier/reward.txt`` (a number) or ``reward.json``
(``{"reward": x}`` or a number). Without a sandbox (``sandbox="none"``) the paths are the host's: a task
whose test.sh hard-codes /app, /tests or /logs needs ``bwrap`` or ``docker``; the bundled suite reads the
``GYRE_*`` variables first.

Outputs per execution, in ``<execution dir>/verifier/``: ``verifier/reward.txt|json`` (what test.sh
wrote), ``test.stdout``, ``test.stderr``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gyre_jax.rollout.process_group import kill_group
from gyre_jax.rollout.sandbox import Launch, Limits, Mount, Sandbox
from gyre_jax.rollout.suites import DEFAULT_WORKDIR
from gyre_jax.rollout.tasks import Task

TESTS_INSIDE = "/tests"
LOGS_INSIDE = "/logs"
SOLUTION_INSIDE = "/solution"


def task_limits(task: Task) -> Limits:
    """The resource limits a task's ``environment`` asks for (task.toml [environment])."""
    env = task.environment
    return Limits(
        cpus=env.get("cpus"), memory_mb=env.get("memory_mb"), allow_internet=bool(env.get("allow_internet", False))
    )


def workdir_of(task: Task) -> str:
    """Where the workspace is mounted inside a sandbox: the Dockerfile's WORKDIR, ``/app`` by default."""
    return task.environment.get("workdir") or DEFAULT_WORKDIR


def image_context(task: Task) -> Path | None:
    """The task's ``environment/`` when it holds a Dockerfile (what the docker sandbox builds)."""
    if not task.source:
        return None
    context = Path(task.source) / "environment"
    return context if (context / "Dockerfile").is_file() else None


def base_env() -> dict[str, str]:
    """A process's environment that carries nothing of the run's: this Python first on PATH, a locale."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")])
    return {"PATH": path, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


def read_reward(logs: Path) -> float:
    """The reward test.sh wrote under ``logs/verifier/`` (reward.txt, else reward.json); ValueError if none."""
    txt, js = logs / "verifier" / "reward.txt", logs / "verifier" / "reward.json"
    if txt.is_file():
        text = txt.read_text(encoding="utf-8", errors="replace").strip()
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"verifier wrote {text[:80]!r} to reward.txt; expected a number in [0, 1]") from None
    if js.is_file():
        try:
            data = json.loads(js.read_text(encoding="utf-8", errors="replace"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"verifier's reward.json is not valid JSON ({exc})") from None
        value = data.get("reward") if isinstance(data, dict) else data
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"verifier's reward.json holds {data!r}; expected {{'reward': <number>}} or a number")
        return float(value)
    raise ValueError("verifier wrote no reward (neither /logs/verifier/reward.txt nor reward.json)")


class HarborVerifier:
    """An evaluator ``(task, workspace) -> reward`` for Harbor tasks (see the module docstring).

    The workspace is ``<execution dir>/workspace``; the verifier's files go to ``<execution dir>/verifier/``,
    recreated empty first (so nothing the agent left there is read as a reward). Raises on a missing or
    unparsable reward and on a timeout (``TimeoutError``): the executor then excludes the execution.
    """

    def __init__(self, sandbox: Sandbox, timeout_s: float, kill_grace_s: float = 1.0) -> None:
        self.sandbox = sandbox
        self.timeout_s = float(timeout_s)
        self.kill_grace_s = kill_grace_s

    def __call__(self, task: Task, workspace: Path) -> float:
        workspace = Path(workspace)
        if not task.source:
            raise ValueError(f"task {task.task_id} has no Harbor source directory to verify it with")
        if not workspace.is_dir():
            raise FileNotFoundError(f"workspace {workspace} of task {task.task_id} does not exist; cannot verify")
        out = workspace.parent / "verifier"  # not in the harness's view: nothing it left is read as a reward
        if out.is_symlink() or out.is_file():
            out.unlink()
        elif out.exists():
            shutil.rmtree(out)
        logs = out / "logs"
        (logs / "verifier").mkdir(parents=True)
        tests = Mount(Path(task.source) / "tests", TESTS_INSIDE)
        mounts = (Mount(workspace, workdir_of(task), writable=True), tests, Mount(logs, LOGS_INSIDE, writable=True))
        ws, tests_in, logs_in = (self.sandbox.path(m) for m in mounts)
        env = {**base_env(), "HOME": "/tmp", **task.verifier_env}
        env.update(GYRE_WORKSPACE=ws, GYRE_TESTS=tests_in, GYRE_LOGS=logs_in)
        launch = Launch(argv=["bash", f"{tests_in}/test.sh"], cwd=ws, env=env, mounts=mounts, network="none",
                        limits=task_limits(task), image_context=image_context(task))  # fmt: skip
        timeout_s = task.verifier_timeout_s or self.timeout_s
        self._run(launch, out, timeout_s)
        return read_reward(logs)

    def _run(self, launch: Launch, out: Path, timeout_s: float) -> None:
        prepared = self.sandbox.prepare(launch)
        try:
            with open(out / "test.stdout", "wb") as so, open(out / "test.stderr", "wb") as se:
                proc = subprocess.Popen(prepared.argv, cwd=prepared.cwd, env=prepared.env, stdin=subprocess.DEVNULL,
                                        stdout=so, stderr=se, start_new_session=True)  # fmt: skip
                deadline = time.monotonic() + timeout_s
                while proc.poll() is None and time.monotonic() < deadline:
                    try:
                        proc.wait(timeout=0.05)
                    except subprocess.TimeoutExpired:
                        pass
                timed_out = proc.poll() is None
                kill_group(proc.pid, self.kill_grace_s, proc)
                proc.wait()
        finally:
            prepared.cleanup()
        if timed_out:
            raise TimeoutError(f"verifier tests/test.sh exceeded {timeout_s} s and was killed")
