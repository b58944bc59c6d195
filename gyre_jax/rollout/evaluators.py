"""Evaluators: what turns a preserved workspace into a reward in [0, 1].

An evaluator is any callable ``(task, workspace) -> float``; it raises ``EvaluatorUnavailable`` when it cannot
run at all and ``RewardSuspect`` when the workspace tampered with its own reward. ``CommandEvaluator`` runs a
command in (or over) the workspace, for suites whose scoring is a script or a test run: the command prints a
score in [0, 1] as the last non-empty line of its stdout (``pass``/``fail`` and ``true``/``false``
count as 1/0); a non-zero exit, a missing or out-of-range score (``BadScore``: kind "evaluator_bad_value")
or a timeout raises, and the executor then *excludes* the execution (it is not scored 0). A command that is not
installed is refused when the executor is built (``check``); one that cannot start, or exits 126 / 127 (a
shell's "cannot execute" / "not found"), is ``EvaluatorUnavailable``. Python in it runs with
``PYTHONSAFEPATH=1`` and ``PYTHONNOUSERSITE=1`` (``HARDENED_ENV``): a ``json.py`` or ``pytest.py`` in the
workspace, its current directory, shadows nothing. The command
runs in its own process group, which is killed on timeout, then whatever it left running (its group, and
processes that left it: ``process_group.sweep``), with the workspace as its cwd and placeholders
``{workspace}`` and ``{task.FIELD}`` (strings verbatim, other fields as JSON) filled in. Only the last
``OUTPUT_TAIL_BYTES`` of its output are read: endless or binary output cannot hurt the trainer.

``run_evaluator`` runs any evaluator the way the executor does: in a daemon thread under a timeout, with a
failure, a timeout or an out-of-range value turned into the reason the execution is excluded.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from gyre_jax.rollout.process_group import MARK_ENV, kill_group, sweep
from gyre_jax.rollout.tasks import Task
from gyre_jax.rollout.templates import fill, task_values

OUTPUT_TAIL_BYTES = 64 * 1024  # what is read of an evaluator command's stdout and stderr (the end)
HARDENED_ENV = {"PYTHONSAFEPATH": "1", "PYTHONNOUSERSITE": "1"}  # (a command's own env may override them)
_NOT_RUNNABLE = {126: "cannot execute", 127: "command not found"}
_WORDS = {"pass": 1.0, "passed": 1.0, "true": 1.0, "fail": 0.0, "failed": 0.0, "false": 0.0}


class CommandEvaluator:
    """Scores a workspace with a command (see the module docstring); raises on any evaluator failure."""

    def __init__(
        self, cmd: Sequence[str], timeout_s: float = 60.0, env: dict[str, str] | None = None, kill_grace_s: float = 1.0
    ) -> None:
        if not cmd or not all(isinstance(a, str) for a in cmd):
            raise ValueError(f"evaluator command {cmd!r} must be a non-empty list of strings")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        self.cmd = list(cmd)
        self.timeout_s = float(timeout_s)
        self.env = dict(env) if env is not None else None
        self.kill_grace_s = kill_grace_s

    def check(self) -> None:
        """Raises ``EvaluatorUnavailable`` when the command's program is not installed (a templated one is not
        checked): before any work, with the program named."""
        program = self.cmd[0]
        if "{" in program:
            return
        path = (self.env or {}).get("PATH", os.environ.get("PATH", ""))
        found = os.access(program, os.X_OK) if os.sep in program else shutil.which(program, path=path) is not None
        if not found:
            raise EvaluatorUnavailable(
                f"evaluator command {program!r} is not installed or not executable (PATH={path}); install it or "
                "give its full path"
            )

    def command(self, task: Task, workspace: Path) -> list[str]:
        values = {"{workspace}": str(workspace), **task_values(task)}
        return [fill(arg, values) for arg in self.cmd]

    def __call__(self, task: Task, workspace: Path) -> float:
        workspace = Path(workspace)
        if not workspace.is_dir():
            raise FileNotFoundError(f"workspace {workspace} of task {task.task_id} does not exist; cannot evaluate")
        cmd = self.command(task, workspace)
        mark = secrets.token_hex(12)  # finds what the command leaves behind outside its group (process_group)
        env = {**os.environ, **HARDENED_ENV, **(self.env or {}), MARK_ENV: mark}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:  # bounded reads: see _tail
            try:
                proc = subprocess.Popen(cmd, cwd=workspace, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, start_new_session=True)  # fmt: skip
            except OSError as exc:
                raise EvaluatorUnavailable(f"evaluator command {cmd[0]!r} cannot start: {exc}") from None
            try:
                proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"evaluator command {cmd[0]!r} exceeded {self.timeout_s} s and was killed") from None
            finally:  # the command on timeout, else what it left running; then what left its group
                kill_group(proc.pid, self.kill_grace_s, proc)
                proc.wait()
                sweep(mark, self.kill_grace_s, exclude=proc.pid)
            stdout, stderr = _tail(out), _tail(err)
        if proc.returncode != 0:
            tail = (stderr.strip() or stdout.strip())[-400:]
            if proc.returncode in _NOT_RUNNABLE:
                raise EvaluatorUnavailable(
                    f"evaluator command {cmd[0]!r} exited with status {proc.returncode} "
                    f"({_NOT_RUNNABLE[proc.returncode]}): {tail}"
                )
            raise RuntimeError(f"evaluator command {cmd[0]!r} exited with status {proc.returncode}: {tail}")
        return parse_score(stdout, cmd[0])


class BadScore(ValueError):
    """The evaluator's score is not a number in [0, 1] (NaN, out of range, not a number, none at all)."""


class EvaluatorUnavailable(RuntimeError):
    """The evaluator could not run at all (its interpreter, runner or command is missing, or it crashed before
    judging anything): an infrastructure failure, never a score. The message says what to install."""


class RewardSuspect(Exception):
    """The evaluator ran, but the execution shows signs of tampering with its own reward (``reasons``, one line
    each); ``reward`` is what it scored (None when it could not score). The executor flags the execution
    ``reward_suspect`` and, by default, excludes it."""

    def __init__(self, reasons: list[str], reward: float | None = None) -> None:
        self.reasons = [r for r in reasons if r] or ["(no reason given)"]
        self.reward = reward
        super().__init__("; ".join(self.reasons))


def parse_score(stdout: str, name: str) -> float:
    """The score an evaluator command printed last (a number or pass/fail word), or ``BadScore``."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise BadScore(f"evaluator command {name!r} printed no score; print a number in [0, 1] last")
    last = lines[-1]
    score = _WORDS.get(last.lower())
    if score is None:
        try:
            score = float(last)
        except ValueError:
            raise BadScore(
                f"evaluator command {name!r} printed {last[:80]!r} last; expected a number in [0, 1]"
            ) from None
    if not (math.isfinite(score) and 0.0 <= score <= 1.0):
        raise BadScore(f"evaluator command {name!r} printed the score {score}; expected a number in [0, 1]")
    return score


def _tail(f, limit: int = OUTPUT_TAIL_BYTES) -> str:
    """The last ``limit`` bytes an evaluator wrote to the file ``f``, as text (undecodable bytes replaced): an
    evaluator that prints without end cannot fill the trainer's memory."""
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - limit))
    return f.read().decode("utf-8", "replace")


class Evaluation(NamedTuple):
    """What ``run_evaluator`` made of one evaluation: a reward, or why the execution is excluded (``reason`` and
    its ``kind``); ``suspect`` holds the signs of reward tampering when there were any (scored or not)."""

    reward: float | None
    reason: str | None
    kind: str | None
    suspect: str | None = None


def run_evaluator(
    evaluator: Callable[[Task, Path], float],
    task: Task,
    workspace: Path,
    timeout_s: float,
    cancelled: Callable[[], bool],
    poll_s: float = 0.05,
    exclude_suspect: bool = True,
) -> Evaluation:
    """The evaluator's reward, or why the execution is excluded and its kind. The evaluator runs in a daemon
    thread; ``cancelled()`` true while it runs stops the wait (kind "cancelled"). ``EvaluatorUnavailable``
    excludes with kind "evaluator_unavailable"; ``RewardSuspect`` flags the execution and excludes it (kind
    "reward_suspect") unless ``exclude_suspect`` is False and it scored."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["reward"] = evaluator(task, workspace)
        except BaseException as exc:  # noqa: BLE001 - reported as an exclusion
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"gyre-eval-{task.task_id}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline and not cancelled():
        thread.join(timeout=min(poll_s, max(0.0, deadline - time.monotonic())))
    if thread.is_alive():
        if cancelled():
            return Evaluation(None, "cancelled during evaluation", "cancelled")
        # A Python thread cannot be killed: it is left to finish in the background (daemon). A command
        # evaluator kills its own process group at the same limit.
        return Evaluation(None, f"evaluator exceeded evaluator_timeout_s={timeout_s}", "evaluator_timeout")
    suspect = None
    if isinstance(box.get("error"), RewardSuspect):
        exc = box.pop("error")
        suspect = str(exc)
        if exc.reward is None or exclude_suspect:
            scored = "" if exc.reward is None else f" (it scored {exc.reward})"
            return Evaluation(None, f"reward suspected of tampering{scored}: {suspect}", "reward_suspect", suspect)
        box["reward"] = exc.reward
    if "error" in box:
        exc = box["error"]
        kinds = {TimeoutError: "evaluator_timeout", BadScore: "evaluator_bad_value",
                 EvaluatorUnavailable: "evaluator_unavailable"}  # fmt: skip
        kind = kinds.get(type(exc), "evaluator_error")
        return Evaluation(None, f"evaluator raised {type(exc).__name__}: {exc}", kind)
    reward = box.get("reward")
    if (
        isinstance(reward, bool)
        or not isinstance(reward, (int, float))
        or not math.isfinite(reward)
        or not 0.0 <= reward <= 1.0
    ):
        return Evaluation(
            None, f"evaluator returned {reward!r}; expected a float in [0, 1]", "evaluator_bad_value", suspect
        )
    return Evaluation(float(reward), None, None, suspect)
