"""``Run``: one run directory's RL steps, evaluations and checkpoints, on the parts ``train.build_run`` built.

A run is a few parts, each built whole before the loop starts (nothing is wired into them afterwards):

- ``RunDir``: what the run writes in its directory (results, metrics, checkpoints, the timeline, measured costs);
- ``Rollouts``: which executions each step and evaluation runs, the executor that runs their harnesses and the
  proxy those call;
- ``runtime.Cells``: a handle per cell and the links to the follower processes;
- the ``Controller`` (``elastic/controller.py``), which runs the RL steps between evaluations as one segment
  (executions of later steps may start early within a segment under the async and elastic policies, never across
  an evaluation); evaluation runs between segments with every cell serving. The train state has one owner,
  ``controller.training`` (``Run.state`` reads it);
- ``RunStop``: why the run stops early (a signal, a follower's request or failure, steps that trained nothing).

Run directory layout (see docs/records.md):
    checkpoints/<step>/      orbax: train state + JSON meta (policy version, data cursor; LoRA: the adapter and its
                             optimizer state, the base by reference in meta["lora_base"])
    reference/0/             the reference policy of a KL term (the params RL started from)
    records/<exec>.jsonl     TITO records, one per model call (fsynced before the call returns)
    executions/<exec>/       workspace, task.json, harness stdout/stderr, result.json
    results/step_<k>.jsonl   the step's execution results (fsynced before training on them)
    trajectory/queue.jsonl   the execution queue the trajectory pipeline reads (docs/trajectory.md)
    timeline/step<k>.json    Chrome-trace timeline of the run attempt that started at step k
    decisions.jsonl          every scheduling decision with its event and cluster state
    cost_measurements.json   measured serving/training/switch costs (the simulator's calibration input)
    metrics.jsonl, tensorboard/, config.json
    aborted/<time>-<pid>/    records/executions of an interrupted step, set aside on resume (they run again)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gyre_jax.build import lora_base
from gyre_jax.checkpoint import Checkpointer
from gyre_jax.disk import write_whole
from gyre_jax.elastic.controller import Controller
from gyre_jax.elastic.live import LiveState
from gyre_jax.elastic.timeline import TimelineWriter
from gyre_jax.evaluation import Evaluation, run_evaluation
from gyre_jax.faultpoints import kill_point
from gyre_jax.metrics import MetricsWriter, format_step_line
from gyre_jax.progress import Progress
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.rl.learner import TrainState
from gyre_jax.rollout.executor import REFUSED_KEYS, ExecutionResult, ExecutionSpec, Executor, summarize
from gyre_jax.rollout.process_group import kill_leftover_group
from gyre_jax.rollout.suites import TaskSuite
from gyre_jax.runtime.remote import Cells
from gyre_jax.sim.calibrate import MEASUREMENTS_FILE, write_measurements

log = logging.getLogger("gyre_jax")


SEGMENT_LINE_S = 10.0  # without a terminal: a progress line about the RL steps at most (and at least) this often
EXIT_UNTRAINED = 3  # the exit status of a run stopped by ``UntrainedSteps`` (config.rl.max_untrained_steps)


def failed(result: ExecutionResult) -> bool:
    """Whether an execution failed to give anything to train on: excluded, its harness crashed, or it made no
    recorded model call (its harness never called the model, or every call was refused)."""
    return result.excluded or result.status == "crashed" or result.model_calls == 0


def refused_text(refused: dict[str, int]) -> str:
    """``"context 3, bad request 1"`` of ``{kind: count}`` (the nonzero ones, ``errors.REFUSAL_KINDS``)."""
    return ", ".join(f"{kind.replace('_', ' ')} {n}" for kind, n in refused.items() if n)


def untrained_reason(results: list[ExecutionResult], learner_metrics: dict) -> str | None:
    """Why a step trained nothing from a fault, or None: every execution excluded (the exclusion kinds counted);
    no execution trained and every one failed (``failed``: excluded, crashed or no recorded model call, with the
    refused calls counted by why); no execution trained and the pipeline left out every one it was given for a
    reason of its own (no records, does not fit ...), none for want of signal; or the optimizer step skipped for a
    non-finite loss / gradients. A step with no signal (all groups' rewards equal) or only stale executions is not a
    fault: None."""
    if results and all(r.excluded for r in results):
        kinds = Counter(r.exclusion_kind or "other" for r in results)
        counted = ", ".join(f"{k} {n}" for k, n in kinds.most_common())
        return f"every execution excluded ({len(results)}: {counted})"
    trained = learner_metrics.get("executions_trained")
    if results and trained == 0 and all(failed(r) for r in results):
        counts = summarize(results)
        parts = [f"{what} {counts[key]}" for what, key in (("crashed", "crashed"), ("excluded", "excluded"),
                 ("no recorded model call", "no_model_calls")) if counts[key]]  # fmt: skip
        refused = refused_text({k: counts[key] for k, key in REFUSED_KEYS.items()})
        return f"every execution failed ({len(results)}: {', '.join(parts)}" + (
            f"; model calls refused: {refused})" if refused else ")"
        )
    left_out = {k.removeprefix("left_out/"): n for k, n in learner_metrics.items() if k.startswith("left_out/") and n}
    if results and trained == 0 and left_out and "weight_0" not in left_out:
        counted = ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in left_out.items())
        return f"the trajectory pipeline left every execution out ({counted})"
    if learner_metrics.get("skipped"):
        loss, gnorm = learner_metrics.get("loss", float("nan")), learner_metrics.get("grad_norm", float("nan"))
        what = "loss" if not np.isfinite(loss) else "gradients"
        return f"optimizer step skipped for a non-finite {what} (loss {loss}, grad norm {gnorm})"
    return None


@dataclass
class UntrainedSteps:
    """Counts consecutive steps that trained nothing from a fault (``untrained_reason``); ``observe`` returns the
    one line to stop the run with once there are ``limit`` of them (0: never)."""

    limit: int
    steps: list[tuple[int, str]] = field(default_factory=list)
    example: str | None = None  # the latest exclusion reason of such a step, quoted in the line

    def observe(self, step: int, results: list[ExecutionResult], learner_metrics: dict) -> str | None:
        reason = untrained_reason(results, learner_metrics)
        if reason is None:
            self.steps.clear()
            return None
        self.steps.append((step, reason))
        self.example = _example(results) or self.example
        if not self.limit or len(self.steps) < self.limit:
            return None
        first, last = self.steps[0][0], self.steps[-1][0]
        return self._line("stopping", first, last)

    def at_end(self, steps_run: int) -> str | None:
        """At the end of a run that ran ``steps_run`` steps (< ``limit``): the line to exit with when none of
        them trained (from a fault), else None."""
        if not self.limit or not steps_run or len(self.steps) < steps_run:
            return None
        return self._line("the run ended, but", self.steps[0][0], self.steps[-1][0])

    def _line(self, what: str, first: int, last: int) -> str:
        reasons = "; ".join(dict.fromkeys(r for _, r in self.steps))
        if self.example:
            reasons += f" (e.g. {self.example if len(self.example) <= 160 else self.example[:157] + '...'})"
        return (
            f"{what}: {len(self.steps)} consecutive RL steps ({first + 1}..{last + 1}) trained nothing: {reasons}. "
            f"See results/step_*.jsonl (exclusion_reason) and the log; config.rl.max_untrained_steps="
            f"{self.limit} (0 turns this check off). Exit code {EXIT_UNTRAINED}."
        )


def _example(results: list[ExecutionResult]) -> str | None:
    """One failed execution, for the stop line: an exclusion reason, else a crashed harness's exit and where its
    output is, else an execution whose calls were all refused."""
    excluded = next((r.exclusion_reason for r in results if r.excluded), None)
    if excluded:
        return excluded
    for r in results:
        if r.status == "crashed":
            refused = refused_text(r.refused_calls or {})
            more = f", model calls refused: {refused}" if refused else ""
            return (
                f"{r.execution_id}: harness exited {r.returncode}{more}; see executions/{r.execution_id}/harness.stderr"
            )
        if r.model_calls == 0 and any((r.refused_calls or {}).values()):
            return f"{r.execution_id}: every model call refused ({refused_text(r.refused_calls or {})})"
    return None


def plan_specs(seed: int, prefix: str, tasks, samples: int, salt: int) -> list[ExecutionSpec]:
    """The executions of ``tasks`` (``samples`` each), in task order: ids ``<prefix><task_id>-g<j:02d>``, groups
    ``<prefix><task_id>``, seeds from ``seed``, ``salt`` (the step) and the position. Pure: the run and the
    audit (``gyre_jax.audit``) both use it."""
    return [
        ExecutionSpec(
            execution_id=f"{prefix}{task.task_id}-g{j:02d}",
            task=task,
            group_id=f"{prefix}{task.task_id}",
            seed=(seed * 1_000_003 + salt * 1009 + i * 31 + j) % (2**31),
        )
        for i, task in enumerate(tasks)
        for j in range(samples)
    ]


def step_specs(config: Any, suite: TaskSuite, step: int) -> list[ExecutionSpec]:
    """RL step ``step``'s executions in task order: G (``rl.group_size``) per task."""
    tasks = suite.tasks_for_step(step, config.rollout.tasks_per_step)
    return plan_specs(config.seed, "", tasks, config.rl.group_size, step)


@dataclass
class ExecutionPlan:
    """Which executions each RL step and each evaluation runs (ids, groups, seeds); leftovers of an interrupted
    attempt at them are set aside first (never trained on; the same ids then run again with the same seeds).

    ``on_set_aside(what, execution_ids, directory)``: told of each set-aside (the run records it in
    ``metrics.jsonl``)."""

    config: Any
    suite: TaskSuite
    records: RecordStore
    executions_dir: Path  # the executor's root: one directory per execution
    workdir: Path
    on_set_aside: Callable[[str, list[str], Path], None] | None = None

    def step(self, step: int) -> list[ExecutionSpec]:
        """Step ``step``'s executions in task order: G per task."""
        specs = step_specs(self.config, self.suite, step)
        self._set_aside_stale(specs, f"step {step}")
        return specs

    def evaluation(self, step: int) -> dict[str, list[ExecutionSpec]]:
        """The evaluation after ``step`` RL steps, per split (``config.eval_splits()``): "train" = the training
        pool, "heldout" = the suite's held-out tasks. Ids ``eval<step>-<task id>-g<j>`` (the splits' task ids
        are disjoint); a split's seeds have their own salt, so the splits' samples are independent."""
        e = self.config.eval
        out = {}
        for k, split in enumerate(self.config.eval_splits()):
            tasks = self.suite.pool() if split == "train" else self.suite.heldout_tasks(e.num_tasks)
            salt = (1 + 2 * k) * 10**6 + step
            out[split] = plan_specs(self.config.seed, f"eval{step:06d}-", tasks, e.samples_per_task, salt)
        self._set_aside_stale([s for specs in out.values() for s in specs], f"eval {step}")
        return out

    def _set_aside_stale(self, specs: list[ExecutionSpec], what: str) -> None:
        """Records/workspaces left by an interrupted attempt are moved to aborted/<time>-<pid>/ (never trained on)."""
        sources = {
            s.execution_id: (self.records.path(s.execution_id), self.executions_dir / s.execution_id) for s in specs
        }
        stale = [eid for eid, paths in sources.items() if any(p.exists() for p in paths)]
        if not stale:
            return
        dest = self.workdir / "aborted" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        for eid in stale:
            if kill_leftover_group(sources[eid][1]):
                log.warning("%s: killed the harness left running by an interrupted attempt", eid)
            for src in sources[eid]:
                if src.exists():
                    target = dest / src.parent.name / src.name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.move(str(src), str(target))
        log.warning(
            "%s: set aside %d executions of an interrupted attempt in %s (they run again)", what, len(stale), dest
        )
        if self.on_set_aside is not None:
            self.on_set_aside(what, stale, dest)


@dataclass
class RunDir:
    """What the run writes in its directory besides the records and the execution queue (the proxy's and the
    pipeline's): step and evaluation results, metrics, checkpoints, the cell timeline and the measured costs."""

    path: Path
    checkpointer: Checkpointer
    metrics: MetricsWriter
    timeline: TimelineWriter

    def results_file(self, name: str) -> Path:
        """``results/<name>.jsonl``: ``step_<k>`` or ``eval_<k>``."""
        return self.path / "results" / f"{name}.jsonl"

    def write_results(self, name: str, lines: str) -> None:
        """Whole and durable before it returns (``disk.write_whole``; ``DiskFull`` on a full disk)."""
        write_whole(self.results_file(name), lines)

    def write_costs(self, costs: Any, step_logs: list) -> None:
        """The measured costs (``cost_measurements.json``, the simulator's calibration input); a failure is logged,
        never raised (it must not hide the error that ended a segment, e.g. the full disk that stopped it)."""
        try:
            write_measurements(self.path / MEASUREMENTS_FILE, costs, step_logs)
        except OSError as exc:
            log.warning("measured costs not written: %s", exc)


@dataclass
class Rollouts:
    """The harness side of the run: which executions each step and evaluation runs (``plan``), the executor that
    runs them and the proxy their harnesses call."""

    plan: ExecutionPlan
    executor: Executor
    proxy: ProxyServer

    def evaluation(self, step: int, progress_mode: str | None = None) -> Evaluation:
        """Runs the evaluation after ``step`` RL steps, all splits at once (``evaluation.run_evaluation``, the code
        ``python -m gyre_jax.evaluate`` runs); each split's results in the plan's order (``ExecutionPlan.evaluation``)."""
        title = f"evaluation after {step} RL steps"
        return run_evaluation(self.plan.evaluation(step), self.executor, title, progress_mode)


STOP_REQUESTED = "stop requested: finishing up and saving a checkpoint (send again to force)"


class RunStop:
    """Why the run stops before ``total_steps``, set from any thread.

    A stop request (SIGINT/SIGTERM to this process, one a follower relays, steps that trained nothing) ends the
    run at the next step boundary with a checkpoint; a failure (a follower process failed) ends it without one
    (``Run.run`` raises it). ``event`` is what the controller checks; ``cancelling`` kills the running harnesses
    as soon as either happens."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.failure: str | None = None
        self.signalled = False  # this process got SIGINT/SIGTERM (a second one exits at once)
        self._changed = threading.Condition()

    def is_set(self) -> bool:
        return self.event.is_set()

    def _set(self) -> None:
        with self._changed:
            self.event.set()
            self._changed.notify_all()

    def request(self, why: str = "") -> None:
        """Stops the run at the next step boundary, keeping a checkpoint; ``why`` is logged."""
        if why:
            log.warning("%s", why)
        self._set()

    def signal(self, *_: Any) -> None:
        """SIGINT/SIGTERM to this process. A second one exits at once (status 130) without saving. A stop already
        under way for another reason (a follower relayed the same preemption notice first, or the run stopped
        itself) does not make this signal the second one."""
        if self.signalled:
            log.error("second stop request: exiting now without saving")
            os._exit(130)
        self.signalled = True
        if self.is_set():
            log.warning(
                "stop requested here too (a stop is already under way): saving a checkpoint (send again to force)"
            )
            return
        self.request("stop requested")

    def follower_asks(self) -> None:
        """A follower got SIGINT/SIGTERM (e.g. every process got Slurm's): stop and save, once, whether this process
        got the signal before, after, or not at all; never a forcing request."""
        if not self.is_set():
            self.request(STOP_REQUESTED)

    def fail(self, message: str) -> None:
        """A part of the run failed where no exception reaches the loop (a follower process): the run ends without
        a checkpoint, raising ``message``."""
        log.error("%s", message)
        if self.failure is None:
            self.failure = message
        self._set()

    @contextmanager
    def cancelling(self, cancel: Callable[[], None]) -> Iterator[None]:
        """Within the block, ``cancel()`` (the executor's: kill every running harness) runs once, as soon as the run
        is asked to stop or fails; it has run when the block exits."""
        released = False

        def watch() -> None:
            with self._changed:
                self._changed.wait_for(lambda: self.event.is_set() or released)
            if self.event.is_set():
                cancel()

        watcher = threading.Thread(target=watch, name="run-stop", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            with self._changed:
                released = True
                self._changed.notify_all()
            watcher.join()


@dataclass
class Run:
    """The leader's run (see the module docstring): its parts, then ``run()`` trains until ``total_steps`` or a
    stop."""

    config: Any
    start_step: int
    rundir: RunDir
    rollouts: Rollouts
    cells: Cells
    controller: Controller
    stop: RunStop
    pipeline_state: dict | None  # the pipeline's state at the last step boundary (checkpointed)
    untrained: UntrainedSteps = field(init=False)  # from config.rl.max_untrained_steps
    untrained_error: str | None = field(default=None, init=False)  # why the run stopped for untrained steps (exit 3)
    _saved_step: int = field(init=False)  # the step of the last checkpoint
    live: LiveState | None = None  # the published live view (elastic/live.py): the proxy's /live page reads it
    _bar: Progress | None = field(default=None, init=False)  # the segment's progress, while one runs

    def __post_init__(self) -> None:
        self.untrained = UntrainedSteps(self.config.rl.max_untrained_steps)
        self._saved_step = self.start_step

    @property
    def state(self) -> TrainState:
        return self.controller.training.state

    # -- the run --------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Runs RL steps from the checkpointed cursor to ``total_steps``. Returns the next step index."""
        c = self.config
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                handlers[sig] = signal.signal(sig, self.stop.signal)
        step, ended = self.start_step, False
        try:
            with self.stop.cancelling(self.rollouts.executor.cancel):
                while step < c.total_steps and not self.stop.is_set():
                    if self._eval_due(step) and self.evaluate(step) is None and self.stop.is_set():
                        break
                    step = self._segment(step, self._next_eval_step(step))
                if step == c.total_steps and not self.stop.is_set() and self._eval_due(step):
                    self.evaluate(step)
            if self.stop.failure is not None:
                raise RuntimeError(self.stop.failure)
            ended = True
            if self.live is not None:
                self.live.phase("done" if step == c.total_steps else "stopped", step)
        finally:
            # After an error (a full disk, a failed micro-step or follower) the state may be past ``step``,
            # mid-segment: only the last checkpoint, saved at a step boundary, is consistent; the next run resumes
            # there.
            if ended and self._saved_step != step:
                self.save_checkpoint(step)
            elif not ended:
                log.error(
                    "the run failed; no checkpoint saved now: the next run resumes from step %d", self._saved_step
                )
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if self.untrained_error is None and step == c.total_steps:
            self.untrained_error = self.untrained.at_end(step - self.start_step)
        if self.untrained_error is not None:
            log.error("%s", self.untrained_error)
        elif self.stop.is_set() and step < c.total_steps:
            log.warning(
                "stopped at step %d/%d; checkpoint saved. Run the same command again to resume.", step, c.total_steps
            )
        return step

    def _segment(self, step: int, end: int) -> int:
        """Steps ``step .. end - 1`` on the controller, with progress (steps done, rate, time left, and the current
        step's rollouts and micro-steps from the live view); the measured costs are written after it."""
        if self.live is not None:
            self.live.phase("rl", step)
        mode = None if self.config.metrics.progress_bar else "lines"
        desc = f"RL steps {step + 1}-{end} ({self.config.schedule.policy})"
        self._bar = Progress(desc, total=end - step, unit="steps", mode=mode, interval_s=SEGMENT_LINE_S,
                             detail_fn=self._step_detail)  # fmt: skip
        try:
            return self.controller.run(step, end, self._on_step)
        finally:
            self._bar.close()
            self._bar = None
            self.rundir.write_costs(self.controller.costs, self.cells.step_logs())

    def _step_detail(self) -> str:
        """The step being trained: its executions finished of its batch and the micro-steps queued (live view)."""
        state = self.live.latest_state() if self.live is not None else None
        if not state:
            return ""
        return (
            f"step {state['version'] + 1}: rollouts {state['step_finished']}/{state['batch_size']} finished, "
            f"{state['step_dispatched'] - state['step_finished']} running; micro-steps {state['ready']} ready, "
            f"{state['in_flight']} computing"
        )

    def _next_eval_step(self, step: int) -> int:
        """The end of the segment starting at ``step``: the next step with an evaluation, or the last."""
        e, total = self.config.eval, self.config.total_steps
        if e.samples_per_task == 0 or e.every_steps <= 0:
            return total
        return min(total, (step // e.every_steps + 1) * e.every_steps)

    def _on_step(self, step: int, learner_metrics: dict, results: list[ExecutionResult], pipeline_state: dict) -> None:
        """Right after step ``step``'s optimizer update: results, metrics, checkpoint."""
        c = self.config
        self.pipeline_state = pipeline_state
        self.rundir.write_results(f"step_{step:06d}", _jsonl(results))
        kill_point("results_written")
        counts = summarize(results)
        valid = [r.reward for r in results if not r.excluded]
        metrics = {
            "phase": "train",
            "policy": c.schedule.policy,
            "pass_rate": float(np.mean([v >= 1.0 for v in valid])) if valid else float("nan"),
            "policy_version": int(self.state.step),
            **{k: counts[k] for k in ("reward_mean", "excluded", "timeouts", "crashed", "executions")},
            **{
                k: counts[k]
                for k in ("evaluator_failures", "evaluator_timeouts", "evaluator_unavailable", "reward_suspect")
            },
            **{k: counts[k] for k in ("no_model_calls", *REFUSED_KEYS.values())},  # nothing refused in silence
            **learner_metrics,
        }
        self.rundir.metrics.write(step, metrics)
        if self.live is not None:
            self.live.step_done(step, metrics)
        if self._bar is not None:
            self._bar.update(1)
        print(format_step_line(step + 1, c.total_steps, metrics), flush=True)
        if (step + 1) % c.checkpoint_every == 0 or step + 1 == c.total_steps:
            self.save_checkpoint(step + 1)
        error = self.untrained.observe(step, results, learner_metrics)
        if error is not None and self.untrained_error is None:
            self.untrained_error = error
            self.stop.request()  # the segment ends, running harnesses are killed, a checkpoint kept

    # -- evaluation -----------------------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, dict[str, Any]] | None:
        """Scores the policy after ``step`` RL steps on each evaluation split (``config.eval_splits()``): one
        metrics line per split; all splits' results in ``results/eval_<step>.jsonl``, each with its
        ``eval_split``. Returns split -> metrics, None if interrupted."""
        if self.config.eval.samples_per_task == 0:
            return None
        if self.live is not None:
            self.live.phase(f"evaluation after {step} RL steps", step)
        evaluation = self.rollouts.evaluation(step, None if self.config.metrics.progress_bar else "lines")
        if self.stop.is_set():
            return None
        self.rundir.write_results(f"eval_{step:06d}", evaluation.results_jsonl())
        out = {}
        for split in evaluation.results:
            out[split] = metrics = evaluation.metrics(split)
            metrics["policy_version"] = int(self.state.step)
            self.rundir.metrics.write(step, metrics)
            print(eval_line(step, metrics), flush=True)
        return out

    def _eval_due(self, step: int) -> bool:
        e = self.config.eval
        if e.samples_per_task == 0 or self.rundir.results_file(f"eval_{step:06d}").exists():
            return False
        return step == 0 or step == self.config.total_steps or (e.every_steps > 0 and step % e.every_steps == 0)

    # -- checkpoints, shutdown ------------------------------------------------------------------------------
    def save_checkpoint(self, next_step: int) -> None:
        """Train state + meta (the pipeline state at the last step boundary: a resumed run neither drops nor
        repeats an execution)."""
        state = self.state
        meta = {
            "next_step": next_step,
            "policy_version": int(state.step),
            "seed": self.config.seed,
            "warm_start_done": True,
            "time": time.time(),
            "pipeline": self.pipeline_state,
        }
        if self.config.model.lora.enabled:  # the state holds the adapter; its base by reference
            meta["lora_base"] = lora_base(self.config)
        self.rundir.checkpointer.save(next_step, state, meta)
        self._saved_step = next_step

    def close(self) -> None:
        """Stops every part, best effort (the first errors are logged): the proxy, the cells and the followers, the
        controller, then the run directory's writers."""
        closers = (
            self.rollouts.proxy.stop,
            *[h.close for h in self.cells.handles],
            *[link.close for link in self.cells.links],
            self.controller.close,
            lambda: self.rundir.timeline.close(time.time()),
            self.rundir.metrics.close,
            self.rundir.checkpointer.close,
        )
        for closer in closers:
            try:
                closer()
            except Exception:  # noqa: BLE001 - best effort on shutdown; the first error is logged
                log.exception("error while shutting down")


def eval_line(step: int, m: dict[str, Any]) -> str:
    """The console line of one evaluation split's metrics (``Evaluation.metrics``)."""
    ci = m.get("eval_pass_rate_ci")
    interval = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
    return (
        f"eval after {step} RL steps ({m['eval_split']} tasks, {m['eval_executions']} executions): reward "
        f"{m['eval_reward_mean']:.3f}  pass {m['eval_pass_rate']:.2f}{interval}  excluded {m['eval_excluded']}  "
        f"({m['eval_s']:.1f}s)"
    )


def _jsonl(results: list[ExecutionResult]) -> str:
    return "".join(json.dumps(r.to_dict()) + "\n" for r in results)
