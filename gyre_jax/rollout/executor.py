"""The executor: runs black-box harness subprocesses on task workspaces and scores what they leave.

It owns the life of one execution: workspace setup, opening/closing the execution at the proxy
(the ``registry``), spawning the harness in its sandbox (``sandbox/``; "none" by default) and its own
process group, the wall-clock timeout (the task's ``agent_timeout_s`` or ``timeout_s``; the whole group is
killed), evaluation under its own timeout (a task with a Harbor ``source`` is scored by its ``tests/test.sh``
in a fresh sandbox, ``verifier.py``; others by ``evaluator``), and the ``ExecutionResult`` record. It does
not know the model or the proxy's internals: a harness only gets ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` and
``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY`` (the same per-execution key), and ``GYRE_EXECUTION_MARK``, the token by
which what it leaves running is found and killed when it ends (``process_group``).

Layout on disk, per execution, under ``root/<execution_id>/`` (docs/tasks.md)::

    task.json        the task (tasks.Task JSON): the record, outside the harness's view
    harness/         the harness's own directory, {exec_dir} (/gyre in a sandbox): task.json without the
                     expected answers, instruction.md, home/, the preset's files, what the harness writes
    workspace/       the harness's current directory (/app in a sandbox), seeded with the task's Harbor
                     environment/ (minus Docker files) and task.files; evaluated afterwards
    harness.stdout   harness output (and executor notes on a failed start, in harness.stderr)
    harness.stderr
    verifier/        a Harbor verifier's logs/verifier/reward.txt|json, test.stdout, test.stderr
    result.json      ExecutionResult.to_dict(), written atomically when the execution is done

Serialized form of an ``ExecutionResult`` (``to_dict``)::

    {"execution_id": str, "task_id": str, "group_id": str,
     "status": "finished" | "timeout" | "crashed", "reward": float | null, "excluded": bool,
     "exclusion_reason": str | null, "returncode": int | null, "duration_s": float, "workspace": str,
     "exclusion_kind": null | "evaluator_error" | "evaluator_timeout" | "evaluator_bad_value"
                       | "evaluator_unavailable" | "reward_suspect" | "setup_failed" | "executor_error" | "cancelled",
     "reward_suspect": null | str,
     "sandbox": null | {"backend", "network", "cpus", "memory_mb", "allow_internet", "limits", "not_applied", ...},
     "killed_reason": null | "timeout" | "workspace_full",
     "model_calls": null | int,       (calls the proxy recorded for it; null: the harness never started)
     "refused_calls": null | {"context": int, "admission": int, "bad_request": int}}
                                      (its model calls the proxy refused, by why: docs/proxy.md, "Errors")

Harness command lines, ``extra_env`` values and ``harness_files`` contents are templates (``PLACEHOLDERS``,
filled with the paths the harness sees): ``{task}`` (its task.json), ``{instruction_file}``,
``{task.FIELD}`` (any field of the task: strings verbatim, others as JSON), ``{model}``, ``{temperature}``,
``{max_tokens}``, ``{max_turns}``, ``{seed}``, ``{timeout_s}``, ``{workspace}``, ``{exec_dir}``,
``{execution_id}``, ``{base_url}`` (OpenAI style, ends in /v1), ``{anthropic_base_url}`` and ``{api_key}``.
Other braces are left alone.

Its parts: ``templates`` (command line and environment of a harness), ``harnesses`` (the named presets),
``sandbox`` (isolation), ``process_group`` (spawning a harness in its own process group, timeout and kill,
cancel), ``evaluators.run_evaluator`` (scoring under a timeout, exclusions), ``verifier`` (Harbor tests).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from gyre_jax.disk import write_whole
from gyre_jax.faultpoints import kill_point
from gyre_jax.rollout import environments, templates
from gyre_jax.rollout.evaluators import CommandEvaluator, run_evaluator
from gyre_jax.rollout.harnesses import DEFAULT_HARNESS_CMD, write_files
from gyre_jax.rollout.process_group import Ended, ProcessGroups
from gyre_jax.rollout.sandbox import Launch, Mount, NoneSandbox, Sandbox, make_sandbox
from gyre_jax.rollout.tasks import Task, evaluate
from gyre_jax.rollout.verifier import SOLUTION_INSIDE, HarborVerifier, image_context, task_limits, workdir_of

logger = logging.getLogger(__name__)
PRIVATE_DIR_MODE = 0o700  # an execution directory: its owner only (the harness runs as the same user)
HARNESS_DIR = "harness"  # <execution dir>/harness: the harness's own directory ({exec_dir})
EXEC_DIR_INSIDE = "/gyre"  # where a sandboxed harness sees it

STATUSES = ("finished", "timeout", "crashed")
EXCLUSION_KINDS = (
    "evaluator_error",
    "evaluator_timeout",
    "evaluator_bad_value",
    "evaluator_unavailable",
    "reward_suspect",
    "setup_failed",
    "executor_error",
    "cancelled",
)
PLACEHOLDERS = ("task", "instruction_file", "model", "temperature", "max_tokens", "max_turns", "seed", "timeout_s",
                "workspace", "exec_dir", "execution_id", "base_url", "anthropic_base_url", "api_key")  # fmt: skip


class ExecutionRegistry(Protocol):
    """What the executor needs from the proxy: a per-execution API key, and a close when it ends.

    A registry that also has ``execution_calls(execution_id) -> int`` and ``execution_refusals(execution_id) ->
    {kind: count}`` (the ``ProxyServer`` has both) is asked for them once the execution is closed, and the result
    records them (``model_calls``, ``refused_calls``): a harness whose every call was refused is then visible."""

    def open_execution(self, execution_id: str) -> str: ...

    def close_execution(self, execution_id: str) -> None: ...


Evaluator = Callable[[Task, Path], float]


@dataclass
class ExecutionSpec:
    """One execution to run: a task, the GRPO/GSPO group it belongs to, and the harness seed."""

    execution_id: str
    task: Task
    group_id: str  # executions of the same task share it (the task id)
    seed: int


@dataclass
class ExecutionResult:
    """How one execution ended and what it scored. ``reward`` is None exactly when ``excluded``."""

    execution_id: str
    task_id: str
    group_id: str
    status: (
        str  # "finished" (harness exited 0) | "timeout" (killed at the limit) | "crashed" (non-zero exit or no start)
    )
    reward: float | None
    excluded: bool  # True: do not train on it (evaluator failed or timed out, setup failed, cancelled)
    exclusion_reason: str | None
    returncode: int | None  # None when the harness never started
    duration_s: float  # harness wall time, spawn to exit or kill (evaluation not included)
    workspace: str
    exclusion_kind: str | None = None  # why it is excluded, as one of EXCLUSION_KINDS (None when scored)
    sandbox: dict[str, Any] | None = None  # how the harness was isolated and limited (Prepared.applied)
    # why the executor killed the harness before it exited: None | "timeout" | "workspace_full" (process_group)
    killed_reason: str | None = None
    # signs that the execution tampered with its own reward (evaluators.RewardSuspect), scored or excluded
    reward_suspect: str | None = None
    model_calls: int | None = None  # model calls the proxy recorded for it (None: not known)
    refused_calls: dict[str, int] | None = None  # its model calls the proxy refused, by kind (errors.REFUSAL_KINDS)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"execution {self.execution_id}: status {self.status!r} must be one of {STATUSES}")
        if self.excluded != (self.reward is None):
            raise ValueError(
                f"execution {self.execution_id}: reward must be None exactly when excluded (reward={self.reward}, excluded={self.excluded})"
            )
        if self.excluded != (self.exclusion_reason is not None):
            raise ValueError(f"execution {self.execution_id}: exclusion_reason must be set exactly when excluded")
        if self.exclusion_kind is not None and (not self.excluded or self.exclusion_kind not in EXCLUSION_KINDS):
            raise ValueError(
                f"execution {self.execution_id}: exclusion_kind {self.exclusion_kind!r} must be one of "
                f"{EXCLUSION_KINDS}, and only on an excluded execution"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExecutionResult:
        names = [f.name for f in fields(cls)]
        required = [f.name for f in fields(cls) if f.default is dataclasses.MISSING]
        missing = [n for n in required if n not in data]
        if missing:
            raise ValueError(f"execution result is missing keys {missing}; expected {names}")
        return cls(**{n: data[n] for n in names if n in data})


REFUSED_KEYS = {"context": "refused_context", "admission": "refused_admission", "bad_request": "refused_bad_request"}


def summarize(results: Sequence[ExecutionResult]) -> dict[str, float]:
    """Counts for metrics: executions, finished / timeout / crashed, excluded, evaluator failures (crash, timeout,
    a bad value or an evaluator that could not run: excluded, not scored 0), the evaluators that could not run,
    the executions suspected of tampering with their reward (excluded or not), the executions whose harness ran
    and made no recorded model call (``no_model_calls``), the model calls the proxy refused by why
    (``refused_context``, ``refused_admission``, ``refused_bad_request``), and the mean reward of the scored ones."""
    scored = [r.reward for r in results if r.reward is not None]
    kinds = Counter(r.exclusion_kind for r in results if r.excluded)
    refused: Counter[str] = Counter()
    for r in results:
        refused.update(r.refused_calls or {})
    return {
        "executions": len(results),
        "finished": sum(r.status == "finished" for r in results),
        "timeouts": sum(r.status == "timeout" for r in results),
        "crashed": sum(r.status == "crashed" for r in results),
        "excluded": sum(r.excluded for r in results),
        "evaluator_failures": sum(
            kinds[k] for k in ("evaluator_error", "evaluator_timeout", "evaluator_bad_value", "evaluator_unavailable")
        ),
        "evaluator_timeouts": kinds["evaluator_timeout"],
        "evaluator_unavailable": kinds["evaluator_unavailable"],
        "reward_suspect": sum(r.reward_suspect is not None for r in results),
        "no_model_calls": sum(r.model_calls == 0 for r in results),
        **{key: refused[kind] for kind, key in REFUSED_KEYS.items()},
        "reward_mean": sum(scored) / len(scored) if scored else float("nan"),
    }


class Executor:
    """Runs executions, up to ``max_parallel`` at once, each harness in its own process group.

    ``run(specs)`` returns one ``ExecutionResult`` per spec, in spec order. ``cancel()`` (e.g. from a
    SIGINT handler) kills the running harnesses and makes ``run`` return promptly; it is sticky: a
    cancelled executor starts nothing more.

    ``harness_cmd`` is an argv list of templates (placeholders in the module docstring: ``{task}``,
    ``{task.instruction}``, ``{model}``, ``{workspace}`` ...), filled per execution (default
    ``DEFAULT_HARNESS_CMD``: the reference harness). The harness runs with the workspace as
    its cwd and an environment holding only a few basics (PATH, HOME, locale, ...), PYTHONPATH to
    this checkout, ``extra_env`` (values templated like the command), ``OPENAI_BASE_URL``/``OPENAI_API_KEY``
    and ``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY``. ``evaluator`` is a command (list of str, see
    ``evaluators.CommandEvaluator``) or a callable ``evaluator(task, workspace) -> float in [0, 1]``;
    it runs in a daemon thread under ``evaluator_timeout_s``; a raise,
    a timeout or an out-of-range value excludes the execution (a hung evaluator thread is abandoned,
    since Python threads cannot be killed). An execution whose evaluator finds signs of tampering with the
    reward (``evaluators.RewardSuspect``) is flagged ``reward_suspect`` and excluded unless
    ``exclude_suspect`` is False (then it keeps the reward it scored, still flagged).
    """

    def __init__(
        self,
        registry: ExecutionRegistry,
        base_url: str,
        root: Path,
        model_name: str,
        timeout_s: float,
        max_parallel: int,
        temperature: float,
        max_tokens: int,
        evaluator_timeout_s: float = 30.0,
        harness_cmd: Sequence[str] | None = None,
        evaluator: Evaluator | Sequence[str] | None = None,
        kill_grace_s: float = 2.0,
        extra_env: dict[str, str] | None = None,
        harness_files: dict[str, str] | None = None,
        sandbox: Sandbox | None = None,
        mount_solution: bool = False,
        network: str = "proxy",
        max_workspace_bytes: int | None = None,
        exclude_suspect: bool = True,
    ) -> None:
        _check_arguments(timeout_s, evaluator_timeout_s, kill_grace_s, max_parallel, harness_cmd, network)
        self.registry = registry
        self.base_url = base_url
        self.root = Path(root)
        self.model_name = model_name
        self.timeout_s = float(timeout_s)
        self.max_parallel = max_parallel
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.evaluator_timeout_s = float(evaluator_timeout_s)
        self.harness_cmd = list(harness_cmd) if harness_cmd is not None else list(DEFAULT_HARNESS_CMD)
        if isinstance(evaluator, (list, tuple)):  # a command: runs in the workspace, prints a score in [0, 1]
            evaluator = CommandEvaluator(evaluator, self.evaluator_timeout_s, kill_grace_s=min(kill_grace_s, 1.0))
            evaluator.check()  # a command that is not there fails now, not as one exclusion per execution
        if evaluator is not None and not callable(evaluator):
            raise ValueError(
                f"evaluator={evaluator!r} must be a callable (task, workspace) -> float or a command (list of str)"
            )
        self.sandbox = sandbox if sandbox is not None else make_sandbox("none", proxy_address=None, state_dir=self.root)
        self.evaluator = evaluator
        self.verifier = HarborVerifier(
            self.sandbox, self.evaluator_timeout_s, kill_grace_s=min(float(kill_grace_s), 1.0)
        )
        self.kill_grace_s = float(kill_grace_s)
        self.extra_env = dict(extra_env or {})
        self.harness_files = dict(harness_files or {})
        self.mount_solution = mount_solution
        self.network = network
        if max_workspace_bytes is not None and (isinstance(max_workspace_bytes, bool) or max_workspace_bytes < 1):
            raise ValueError(f"max_workspace_bytes={max_workspace_bytes!r} must be a positive number of bytes or None")
        self.max_workspace_bytes = max_workspace_bytes
        self.exclude_suspect = bool(exclude_suspect)
        for rel in self.harness_files:
            _check_relative(rel)
        templates.check_task_fields([*self.harness_cmd, *self.extra_env.values(), *self.harness_files.values()])
        self._callback_lock = threading.Lock()
        self._procs = ProcessGroups(self.kill_grace_s, subreaper=isinstance(self.sandbox, NoneSandbox))

    # -- public ---------------------------------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        return self._procs.cancelled

    def cancel(self) -> None:
        """Kills every running harness (SIGTERM now, SIGKILL after the grace) and starts nothing more."""
        self._procs.cancel()

    def run(
        self, specs: Sequence[ExecutionSpec], on_done: Callable[[ExecutionResult], None] | None = None
    ) -> list[ExecutionResult]:
        """Runs ``specs`` and returns their results in the same order.

        ``on_done(result)`` is called once per execution as it completes, from worker threads but never
        concurrently. If it raises, the remaining executions still run and ``run`` then raises.
        """
        counts = Counter(s.execution_id for s in specs)
        duplicates = sorted(i for i, c in counts.items() if c > 1)
        if duplicates:
            raise ValueError(f"execution ids must be unique within a run; repeated: {duplicates}")
        for spec in specs:
            _check_execution_id(spec.execution_id)
        self.root.mkdir(parents=True, exist_ok=True)
        self.verifier.pin(spec.task for spec in specs)  # before any harness runs: tests/ as they are now
        callback_errors: list[tuple[str, BaseException]] = []

        def work(spec: ExecutionSpec) -> ExecutionResult:
            result = self._run_one(spec)
            if on_done is not None:
                with self._callback_lock:
                    try:
                        on_done(result)
                    except Exception as exc:  # noqa: BLE001 - re-raised from run() below
                        logger.exception("on_done failed for execution %s", spec.execution_id)
                        callback_errors.append((spec.execution_id, exc))
            return result

        if not specs:
            return []
        pool = ThreadPoolExecutor(max_workers=min(self.max_parallel, len(specs)), thread_name_prefix="gyre-exec")
        try:
            futures = [pool.submit(work, spec) for spec in specs]
            results = [future.result() for future in futures]
        except BaseException:  # e.g. KeyboardInterrupt in the waiting thread: stop the harnesses first
            self.cancel()
            raise
        finally:
            pool.shutdown(wait=True)
        if callback_errors:
            execution_id, exc = callback_errors[0]
            raise RuntimeError(
                f"on_done raised for {len(callback_errors)} execution(s), first for {execution_id}: {type(exc).__name__}: {exc}"
            ) from exc
        return results

    def submit(self, spec: ExecutionSpec, on_done: Callable[[ExecutionResult], None]) -> threading.Thread:
        """Starts one execution in its own thread and returns at once; ``on_done(result)`` is called from that
        thread when it ends (finished, timed out, crashed or cancelled). The caller bounds concurrency (the
        elastic controller starts an execution only when a serving slot is free)."""
        _check_execution_id(spec.execution_id)
        self.root.mkdir(parents=True, exist_ok=True)
        self.verifier.pin([spec.task])

        def work() -> None:
            try:
                result = self._run_one(spec)
            except Exception as exc:  # noqa: BLE001 - recorded as a crashed execution; the run goes on
                logger.exception("execution %s failed in the executor", spec.execution_id)
                reason = f"executor error: {type(exc).__name__}: {exc}"
                workspace = self.root / spec.execution_id / "workspace"
                result = _result(spec, workspace, "crashed", None, reason, None, 0.0, "executor_error")
            on_done(result)

        thread = threading.Thread(target=work, name=f"gyre-exec-{spec.execution_id}", daemon=True)
        thread.start()
        return thread

    # -- one execution --------------------------------------------------------------------------

    def _run_one(self, spec: ExecutionSpec) -> ExecutionResult:
        exec_dir = self.root / spec.execution_id
        workspace = exec_dir / "workspace"

        applied: dict[str, Any] = {}  # what the sandbox applied, once the harness started
        killed: list[str | None] = [None]
        calls: dict[str, Any] = {}  # the proxy's counts of the execution's calls, once it is closed

        def result(status, reward, reason, returncode, duration, kind=None, suspect=None) -> ExecutionResult:
            r = _result(spec, workspace, status, reward, reason, returncode, duration, kind)
            r.sandbox, r.killed_reason, r.reward_suspect = applied or None, killed[0], suspect
            r.model_calls, r.refused_calls = calls.get("model_calls"), calls.get("refused_calls")
            _write_result(exec_dir, r)
            return r

        if self._procs.cancelled:
            return result("crashed", None, "cancelled", None, 0.0, "cancelled")
        try:
            self._prepare(spec, exec_dir, workspace)
        except Exception as exc:  # noqa: BLE001 - infrastructure failure: exclude, never score
            logger.exception("workspace setup failed for execution %s", spec.execution_id)
            return result(
                "crashed", None, f"workspace setup failed: {type(exc).__name__}: {exc}", None, 0.0, "setup_failed"
            )
        kill_point("rollout")
        try:
            api_key = self.registry.open_execution(spec.execution_id)
        except Exception as exc:  # noqa: BLE001
            logger.exception("open_execution failed for execution %s", spec.execution_id)
            return result(
                "crashed", None, f"open_execution failed: {type(exc).__name__}: {exc}", None, 0.0, "setup_failed"
            )
        try:
            status, returncode, duration, cancelled, killed[0] = self._spawn_and_wait(
                spec, exec_dir, workspace, api_key, applied
            )
        except Exception as exc:  # noqa: BLE001 - an executor fault (not the harness's): exclude
            logger.exception("running the harness of execution %s failed", spec.execution_id)
            return result("crashed", None, f"executor error: {type(exc).__name__}: {exc}", None, 0.0, "executor_error")
        finally:
            try:
                self.registry.close_execution(spec.execution_id)
            except Exception:  # noqa: BLE001 - the harness is done; a failed close must not lose the result
                logger.exception("close_execution failed for execution %s", spec.execution_id)
            calls.update(_call_counts(self.registry, spec.execution_id))
        if cancelled:
            return result("crashed", None, "cancelled", returncode, duration, "cancelled")
        evaluator, timeout_s = self._evaluator_for(spec.task)
        ev = run_evaluator(evaluator, spec.task, workspace, timeout_s, lambda: self._procs.cancelled,
                           exclude_suspect=self.exclude_suspect)  # fmt: skip
        return result(status, ev.reward, ev.reason, returncode, duration, ev.kind, ev.suspect)

    def _evaluator_for(self, task: Task) -> tuple[Evaluator, float]:
        """The evaluator of ``task`` and its time limit: the executor's own if given, else the Harbor verifier
        for a task with a source directory and the expected-files check otherwise. The verifier's own limit
        (its test.sh is killed then) is ``task.verifier_timeout_s`` or the executor's; the thread gets 5 s more."""
        if self.evaluator is not None:
            return self.evaluator, self.evaluator_timeout_s
        if task.source:
            return self.verifier, (task.verifier_timeout_s or self.evaluator_timeout_s) + 5.0
        return evaluate, self.evaluator_timeout_s

    def _prepare(self, spec: ExecutionSpec, exec_dir: Path, workspace: Path) -> None:
        """A fresh execution directory: the workspace (the task's Harbor environment/ minus its Docker files,
        then ``task.files``), ``task.json`` (the record) and ``harness/`` (the harness's own directory:
        ``task.json`` without the expected answers, ``instruction.md``, ``home/``)."""
        if exec_dir.exists():  # a re-run of the same execution starts from a fresh workspace
            shutil.rmtree(exec_dir)
        exec_dir.mkdir(parents=True, mode=PRIVATE_DIR_MODE)
        exec_dir.chmod(PRIVATE_DIR_MODE)  # whatever the umask: other users never read a workspace (sandbox none too)
        harness_dir = exec_dir / HARNESS_DIR  # what the harness sees of its execution: no answers, no logs
        (harness_dir / "home").mkdir(parents=True)
        if spec.task.source:  # its built environment's WORKDIR, or environment/ minus Docker files
            environments.seed(spec.task, self.sandbox, exec_dir)
        workspace.mkdir(parents=True, exist_ok=True)
        for rel, text in spec.task.files.items():
            path = workspace / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        (exec_dir / templates.TASK_FILE).write_text(spec.task.to_json(), encoding="utf-8")  # the record
        seen = {**spec.task.to_dict(), "expected": {}}
        (harness_dir / templates.TASK_FILE).write_text(json.dumps(seen, ensure_ascii=False), encoding="utf-8")
        (harness_dir / templates.INSTRUCTION_FILE).write_text(spec.task.instruction, encoding="utf-8")

    @property
    def anthropic_base_url(self) -> str:
        """``base_url`` without its ``/v1``: the Anthropic SDK appends ``/v1/messages`` itself."""
        return templates.anthropic_base_url(self.base_url)

    def _spawn_and_wait(
        self, spec: ExecutionSpec, exec_dir: Path, workspace: Path, api_key: str, applied: dict[str, Any]
    ) -> Ended:
        """Runs the harness to its end in the sandbox (``process_group.Ended``); fills ``applied`` with what the
        sandbox applied."""
        timeout_s = spec.task.agent_timeout or self.timeout_s
        harness_dir = exec_dir / HARNESS_DIR
        mounts = [Mount(harness_dir, EXEC_DIR_INSIDE, writable=True),
                  Mount(workspace, workdir_of(spec.task), writable=True)]  # fmt: skip
        if self.mount_solution and spec.task.source:
            mounts.append(Mount(Path(spec.task.source) / "solution", SOLUTION_INSIDE))
        exec_in, ws_in = self.sandbox.path(mounts[0]), self.sandbox.path(mounts[1])
        values = templates.template_values(
            spec, exec_in, ws_in, model_name=self.model_name, temperature=self.temperature,
            max_tokens=self.max_tokens, base_url=self.base_url, api_key=api_key, timeout_s=timeout_s,
        )  # fmt: skip
        if self.mount_solution:
            values["{solution}"] = self.sandbox.path(mounts[-1]) if spec.task.source else ""
        write_files({rel: templates.fill(text, values) for rel, text in self.harness_files.items()}, harness_dir)
        launch = Launch(
            argv=[templates.fill(arg, values) for arg in self.harness_cmd],
            cwd=ws_in,
            env=templates.harness_env(api_key, self.base_url, self.extra_env, values),
            mounts=tuple(mounts),
            network=self.network,
            limits=task_limits(spec.task),
            image_context=image_context(spec.task),
            environment=environments.env_launch(
                spec.task, self.sandbox, exec_dir, solution=self.mount_solution, end=False
            ),
        )
        prepared = self.sandbox.prepare(launch)
        applied.update(prepared.applied)
        try:
            return self._procs.run(spec.execution_id, prepared.argv, prepared.cwd, prepared.env, exec_dir, timeout_s,
                                   workspace=workspace, max_workspace_bytes=self.max_workspace_bytes,
                                   keep_daemons=prepared.keeps_daemons)  # fmt: skip
        finally:
            prepared.cleanup()


def _call_counts(registry: ExecutionRegistry, execution_id: str) -> dict[str, Any]:
    """``model_calls`` and ``refused_calls`` of a closed execution, from a registry that counts them (the proxy);
    {} from one that does not (see ``ExecutionRegistry``)."""
    out: dict[str, Any] = {}
    try:
        if callable(count := getattr(registry, "execution_calls", None)):
            out["model_calls"] = int(count(execution_id))
        if callable(refusals := getattr(registry, "execution_refusals", None)):
            out["refused_calls"] = {k: int(v) for k, v in refusals(execution_id).items()}
    except Exception:  # noqa: BLE001 - counts are for metrics; the result must not be lost for them
        logger.exception("could not read the call counts of execution %s", execution_id)
    return out


def _result(
    spec: ExecutionSpec,
    workspace: Path,
    status: str,
    reward: float | None,
    reason: str | None,
    returncode: int | None,
    duration: float,
    kind: str | None = None,
) -> ExecutionResult:
    """``spec``'s result: excluded exactly when ``reason`` is given (``kind`` says why, only then)."""
    return ExecutionResult(
        execution_id=spec.execution_id,
        task_id=spec.task.task_id,
        group_id=spec.group_id,
        status=status,
        reward=reward,
        excluded=reason is not None,
        exclusion_reason=reason,
        returncode=returncode,
        duration_s=duration,
        workspace=str(workspace),
        exclusion_kind=kind if reason is not None else None,
    )


def _check_arguments(timeout_s, evaluator_timeout_s, kill_grace_s, max_parallel, harness_cmd, network) -> None:
    """ValueError naming the first bad ``Executor`` argument."""
    for name, value in (("timeout_s", timeout_s), ("evaluator_timeout_s", evaluator_timeout_s)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r} must be a positive number of seconds")
    if not (isinstance(kill_grace_s, (int, float)) and kill_grace_s >= 0):
        raise ValueError(f"kill_grace_s={kill_grace_s!r} must be >= 0 seconds")
    if isinstance(max_parallel, bool) or not isinstance(max_parallel, int) or max_parallel < 1:
        raise ValueError(f"max_parallel={max_parallel!r} must be an integer >= 1")
    if harness_cmd is not None and (not harness_cmd or not all(isinstance(a, str) for a in harness_cmd)):
        raise ValueError(f"harness_cmd={harness_cmd!r} must be a non-empty list of strings")
    if network not in ("proxy", "none"):
        raise ValueError(f"network={network!r} must be 'proxy' (harnesses reach the proxy) or 'none' (no model calls)")


def _check_relative(rel: str) -> None:
    p = Path(rel)
    if not rel or p.is_absolute() or ".." in p.parts:
        raise ValueError(f"harness file path {rel!r} must be relative to the execution directory, without '..'")


def _check_execution_id(execution_id: str) -> None:
    if (
        not isinstance(execution_id, str)
        or not execution_id
        or execution_id in (".", "..")
        or "/" in execution_id
        or "\\" in execution_id
        or "\0" in execution_id
    ):
        raise ValueError(
            f"execution_id {execution_id!r} must be a non-empty name usable as a directory (no '/', not '.' or '..')"
        )


def _write_result(exec_dir: Path, result: ExecutionResult) -> None:
    """Writes result.json whole (``disk.write_whole``); a failure is logged, never raised: it is the execution's own
    copy, and the run's durable record is ``results/step_<k>.jsonl``, whose write stops the run on a full disk."""
    try:
        write_whole(exec_dir / "result.json", json.dumps(result.to_dict()))
    except OSError:
        logger.exception("could not write result.json for execution %s", result.execution_id)
