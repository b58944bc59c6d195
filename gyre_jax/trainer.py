"""The training run: warm start, then RL steps of rollouts through the proxy and GSPO updates.

``Trainer`` wires the parts together for one run directory: the model on a training mesh, one
serving engine + loop per cell, the router and the OpenAI-compatible proxy, the executor that runs
black-box harness processes, the learner, checkpoints and metrics. The scheduling policy decides
when cells serve and when they train (the colocated policy: all serve, then all train).

Run directory layout (see docs/records.md):
    checkpoints/<step>/      orbax: train state + JSON meta (policy version, data cursor)
    records/<exec>.jsonl     TITO records, one per model call (fsynced before the call returns)
    executions/<exec>/       workspace, task.json, harness stdout/stderr, result.json
    results/step_<k>.jsonl   the step's execution results (fsynced before training on them)
    metrics.jsonl, tensorboard/, timeline.jsonl, config.json
    aborted/<time>/          records/executions of an interrupted step, set aside on resume
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from ml_collections import config_dict

from gyre_jax import config as config_lib
from gyre_jax.checkpoint import Checkpointer
from gyre_jax.elastic.cells import make_cells
from gyre_jax.elastic.policies import Event, Role, Waterlevel, make_policy
from gyre_jax.metrics import MetricsWriter, format_step_line
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import abstract_model, init_params, make_mesh, reshard
from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.router import Router
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.proxy.tito import render_demonstration
from gyre_jax.rl.advantages import group_advantages
from gyre_jax.rl.learner import Learner, OptimizerConfig, TrainState, count_tokens
from gyre_jax.rollout.executor import ExecutionResult, ExecutionSpec, Executor, summarize
from gyre_jax.rollout.tasks import BuiltinSuite
from gyre_jax.serving.engine import Engine
from gyre_jax.serving.loop import ServingLoop
from gyre_jax.trajectory.batch import make_micro_batches, row_length, supervised_micro_batch
from gyre_jax.trajectory.branches import build_branches, select_branches

log = logging.getLogger("gyre_jax")


def _fsync_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class StepOutcome:
    metrics: dict[str, Any]
    results: list[ExecutionResult]


class Trainer:
    """One run: build everything from ``config``, then ``run()`` until ``total_steps`` or a signal."""

    def __init__(self, config: config_dict.ConfigDict):
        config_lib.validate(config)
        self.config = config
        self.workdir = config_lib.resolve_workdir(config)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        self.tokenizer = ByteTokenizer()
        self.model_cfg = ModelConfig.from_config_dict(config.model)
        self.rules = tuple((k, v) for k, v in config.sharding_rules)
        n = config_lib.device_count(config)
        devices = jax.devices()
        if len(devices) < n:
            raise RuntimeError(
                f"the config needs {n} devices but JAX sees {len(devices)} ({devices[0].platform}); "
                f"on CPU set config.devices.num_cpu_devices before JAX starts (python -m gyre_jax.train does this)"
            )
        self.devices = devices[:n]
        self.train_mesh = make_mesh(self.devices, dict(config.mesh))
        self.cells = make_cells(self.devices, config.cells.num_cells,
                                dict(data=config.cells.data, fsdp=config.cells.fsdp, tensor=config.cells.tensor))
        self.graphdef, params = init_params(self.model_cfg, self.train_mesh, self.rules, config.seed)
        self.learner = Learner(self.model_cfg, self.graphdef, self.train_mesh, self.rules,
                               OptimizerConfig.from_config_dict(config.optimizer),
                               clip_low=config.rl.clip_low, clip_high=config.rl.clip_high)
        self.checkpointer = Checkpointer(self.workdir / "checkpoints", max_to_keep=config.keep_checkpoints)
        self.suite = BuiltinSuite(kinds=tuple(config.rollout.task_kinds), seed=config.seed, max_turns=config.rollout.max_turns,
                                  tool_latency_median_s=config.rollout.tool_latency_median_s,
                                  tool_latency_sigma=config.rollout.tool_latency_sigma, alphabet=config.rollout.alphabet,
                                  min_len=config.rollout.input_min_len, max_len=config.rollout.input_max_len,
                                  num_tasks=config.rollout.num_tasks)
        self.metrics = MetricsWriter(self.workdir, tensorboard=config.metrics.tensorboard)
        self.policy = make_policy(config.schedule.policy, len(self.cells))
        self.roles = self.policy.initial_roles()
        self.waterlevel = Waterlevel()
        self._timeline_path = self.workdir / "timeline.jsonl"
        _fsync_write(self.workdir / "config.json", json.dumps(config.to_dict(), indent=2, default=str))

        latest = self.checkpointer.latest_step()
        if latest is not None:
            self.state, meta = self.checkpointer.restore(latest, self.learner.abstract_state())
            self.start_step = int(meta["next_step"])
            log.info("resumed from %s at step %d (policy version %d)", self.workdir / "checkpoints", self.start_step,
                     int(self.state.step))
        else:
            self.start_step = 0
            if config.warm_start.steps > 0:
                params = self.warm_start(params)
            self.state = self.learner.init_state(params)
            self.save_checkpoint(0)

        self.engines: list[Engine] = []
        self.loops: list[ServingLoop] = []
        for cell in self.cells:
            engine = Engine(self.model_cfg, self.graphdef, cell.mesh, self.rules,
                            max_concurrent_decodes=config.serving.max_concurrent_decodes,
                            max_seq_len=config.serving.max_seq_len, max_prefill_length=config.serving.max_prefill_length,
                            prefill_buckets=tuple(config.serving.prefill_buckets))
            self.engines.append(engine)
        self._serving_shardings = [self._cell_param_shardings(e) for e in self.engines]
        version = int(self.state.step)
        for cell, engine, shardings in zip(self.cells, self.engines, self._serving_shardings):
            loop = ServingLoop(engine, reshard(self.state.params, shardings), policy_version=version, name=cell.name,
                               seed=config.seed + 7919 * cell.index)
            self.loops.append(loop.start())
        self.router = Router({loop.name: loop for loop in self.loops})
        self.records = RecordStore(self.workdir / "records")
        self.proxy = ProxyServer(self.router, self.tokenizer, self.records, model_name=config.proxy.model_name,
                                 host=config.proxy.host, port=config.proxy.port,
                                 max_request_bytes=config.proxy.max_request_bytes, seed=config.seed,
                                 default_max_tokens=config.rollout.max_tokens_per_call,
                                 max_tokens_cap=config.rollout.max_tokens_per_call,
                                 tools_format=config.tokenizer.tools_format).start()
        self.executor = Executor(self.proxy, self.proxy.base_url, self.workdir / "executions",
                                 model_name=config.proxy.model_name, timeout_s=config.rollout.timeout_s,
                                 max_parallel=config.rollout.max_parallel, temperature=config.rollout.temperature,
                                 max_tokens=config.rollout.max_tokens_per_call,
                                 evaluator_timeout_s=config.rollout.evaluator_timeout_s)
        log.info("proxy serving on %s; %d cells x %d devices; model %.2fM params", self.proxy.base_url, len(self.cells),
                 len(self.cells[0].devices), self.model_cfg.num_params / 1e6)

    # -- helpers ----------------------------------------------------------------------------------
    def _cell_param_shardings(self, engine: Engine):
        return engine.param_shardings(abstract_model(self.model_cfg)[1])

    def _set_roles(self, roles: list[Role], reason: str) -> None:
        if roles == self.roles:
            return
        self.roles = list(roles)
        with open(self._timeline_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), "reason": reason, "roles": {c.name: r.value for c, r in zip(self.cells, roles)}}) + "\n")

    def _event(self, kind: str, step: int, **kw) -> None:
        event = Event(kind=kind, step=step, time=time.time(), **kw)
        self._set_roles(self.policy.decide(event, self.waterlevel, self.roles), kind)

    def save_checkpoint(self, next_step: int) -> None:
        meta = {"next_step": next_step, "policy_version": int(self.state.step), "seed": self.config.seed,
                "warm_start_done": True, "time": time.time()}
        self.checkpointer.save(next_step, self.state, meta)
        self._saved_step = next_step

    def request_stop(self, *_: Any) -> None:
        """Stops the run at the next safe point: running harnesses are killed, a checkpoint is kept.

        A second request exits at once (status 130) without saving.
        """
        if self._stop.is_set():
            log.error("second stop request: exiting now without saving")
            os._exit(130)
        log.warning("stop requested: finishing up and saving a checkpoint (send again to force)")
        self._stop.set()
        if hasattr(self, "executor"):
            self.executor.cancel()

    # -- warm start -------------------------------------------------------------------------------
    def warm_start(self, params):
        """Supervised warm start on the suite's demonstrations (a config option, logged as such)."""
        w = self.config.warm_start
        learner = Learner(self.model_cfg, self.graphdef, self.train_mesh, self.rules,
                          OptimizerConfig(learning_rate=w.learning_rate, warmup_steps=w.warmup_steps,
                                          grad_clip_norm=self.config.optimizer.grad_clip_norm))
        state = learner.init_state(params)
        tools = self.suite.tools
        t0 = time.time()
        for i in range(w.steps):
            demos = self.suite.demonstrations(w.batch_size, seed=self.config.seed * 100_003 + i)
            convs = [render_demonstration(self.tokenizer, m, tools, self.config.tokenizer.tools_format) for m in demos]
            seqs = [(c.ids, c.trainable) for c in convs]
            total = sum(sum(t[1:]) for _, t in seqs)
            mb = supervised_micro_batch(seqs, total, row_length(max(len(s) for s, _ in seqs) - 1))
            state, m = learner.step(state, [mb], kind="sft")
            if i % 25 == 0 or i == w.steps - 1:
                log.info("warm start %d/%d  loss %.4f", i + 1, w.steps, m["loss"])
            if i == w.steps - 1:
                self.metrics.write(-1, {"phase": "warm_start", "warm_start_steps": w.steps, "warm_start_loss": m["loss"]})
            if self._stop.is_set():
                raise KeyboardInterrupt("stopped during warm start (nothing was saved; rerun to start over)")
        log.info("warm start: %d steps in %.1fs", w.steps, time.time() - t0)
        return state.params

    # -- one RL step ------------------------------------------------------------------------------
    def _set_aside_stale(self, specs: list[ExecutionSpec]) -> None:
        """Records/workspaces left by an interrupted attempt at this step are moved to aborted/ (never trained on)."""
        stale = [s.execution_id for s in specs
                 if self.records.path(s.execution_id).exists() or (self.executor.root / s.execution_id).exists()]
        if not stale:
            return
        dest = self.workdir / "aborted" / time.strftime("%Y%m%d-%H%M%S")
        for eid in stale:
            for src in (self.records.path(eid), self.executor.root / eid):
                if src.exists():
                    target = dest / src.parent.name / src.name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.move(str(src), str(target))
        log.warning("set aside %d executions of an interrupted attempt in %s", len(stale), dest)

    def _specs(self, prefix: str, tasks, samples: int, salt: int) -> list[ExecutionSpec]:
        c = self.config
        return [ExecutionSpec(execution_id=f"{prefix}{task.task_id}-g{j:02d}", task=task, group_id=f"{prefix}{task.task_id}",
                              seed=(c.seed * 1_000_003 + salt * 1009 + i * 31 + j) % (2**31))
                for i, task in enumerate(tasks) for j in range(samples)]

    def rollout(self, step: int, progress=None) -> list[ExecutionResult]:
        c = self.config
        tasks = self.suite.tasks_for_step(step, c.rollout.tasks_per_step)
        specs = self._specs("", tasks, c.rl.group_size, step)
        self._set_aside_stale(specs)
        self._event("step_began", step, executions_in_step=len(specs))
        self.waterlevel.dispatched += len(specs)

        def on_done(result: ExecutionResult) -> None:
            self.waterlevel.finished += 1
            self._event("finished", step, execution_id=result.execution_id)
            if progress is not None:
                progress(result)

        return self.executor.run(specs, on_done=on_done)

    def train_on(self, step: int, results: list[ExecutionResult]) -> dict[str, Any]:
        c = self.config
        rewards = {r.execution_id: (None if r.excluded else r.reward) for r in results}
        groups = {r.execution_id: r.group_id for r in results}
        adv = group_advantages(rewards, groups)
        branches, advantages, per_exec = [], [], []
        for r in results:
            if r.execution_id not in adv.advantages:
                continue
            chosen = select_branches(build_branches(self.records.read(r.execution_id)), c.rl.max_branches)
            if chosen:
                per_exec.append((r.execution_id, chosen))
        num_exec = len(per_exec)
        seq_weights = []
        for eid, chosen in per_exec:
            for b in chosen:
                branches.append(b)
                advantages.append(adv.advantages[eid])
                seq_weights.append(1.0 / (num_exec * len(chosen)))
        metrics: dict[str, Any] = {"skipped_groups": adv.skipped_groups, "executions_trained": num_exec,
                                   "sequences": len(branches)}
        if not branches:
            log.warning("step %d: no trainable executions (all excluded, skipped or empty); no optimizer step", step)
            metrics.update(tokens_trained=0, tokens_computed=0, optimizer_skipped=1)
            return metrics
        mbs = make_micro_batches(branches, advantages, seq_weights, c.rl.micro_batch_size)
        computed, trained = count_tokens(mbs)
        self.state, m = self.learner.step(self.state, mbs, kind="rl")
        if m.get("skipped"):
            log.error("step %d: non-finite gradients (grad norm %s); update skipped, weights unchanged", step, m["grad_norm"])
        metrics.update(m)
        metrics.update(tokens_trained=trained, tokens_computed=computed, micro_batches=len(mbs))
        return metrics

    def publish_weights(self) -> None:
        """Serving cells get the new policy (device-to-device reshard onto each cell's mesh)."""
        version = int(self.state.step)
        for loop, shardings in zip(self.loops, self._serving_shardings):
            loop.update_params(reshard(self.state.params, shardings), version)

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> int:
        """Runs RL steps from the checkpointed cursor to ``total_steps``. Returns the next step index."""
        c = self.config
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                handlers[sig] = signal.signal(sig, self.request_stop)
        step = self.start_step
        self._saved_step = getattr(self, "_saved_step", self.start_step)
        try:
            while step < c.total_steps and not self._stop.is_set():
                if self._eval_due(step) and self.evaluate(step) is None and self._stop.is_set():
                    break
                outcome = self.run_step(step)
                if outcome is None:  # interrupted mid-rollout: nothing of this step is trained on
                    break
                step += 1
                if step % c.checkpoint_every == 0 or step == c.total_steps:
                    self.save_checkpoint(step)
            if step == c.total_steps and not self._stop.is_set() and self._eval_due(step):
                self.evaluate(step)
        finally:
            if self._saved_step != step:
                self.save_checkpoint(step)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if self._stop.is_set() and step < c.total_steps:
            log.warning("stopped at step %d/%d; checkpoint saved. Run the same command again to resume.", step, c.total_steps)
        return step

    # -- evaluation -------------------------------------------------------------------------------
    def eval_tasks(self):
        e = self.config.eval
        return self.suite.pool() if e.split == "train" else self.suite.heldout_tasks(e.num_tasks)

    def evaluate(self, step: int) -> dict[str, Any] | None:
        """Scores the policy after ``step`` RL steps on the eval tasks (never trained on). None if interrupted."""
        e = self.config.eval
        if e.samples_per_task == 0:
            return None
        t0 = time.time()
        specs = self._specs(f"eval{step:06d}-", self.eval_tasks(), e.samples_per_task, 10**6 + step)
        self._set_aside_stale(specs)
        results = self.executor.run(specs)
        if self._stop.is_set():
            return None
        _fsync_write(self.workdir / "results" / f"eval_{step:06d}.jsonl", "".join(json.dumps(r.to_dict()) + "\n" for r in results))
        valid = [r.reward for r in results if not r.excluded]
        metrics = {
            "phase": "eval",
            "eval_split": e.split,
            "eval_reward_mean": float(np.mean(valid)) if valid else float("nan"),
            "eval_pass_rate": float(np.mean([v >= 1.0 for v in valid])) if valid else float("nan"),
            "eval_executions": len(results),
            "eval_excluded": sum(r.excluded for r in results),
            "eval_timeouts": sum(r.status == "timeout" for r in results),
            "eval_s": time.time() - t0,
            "policy_version": int(self.state.step),
        }
        self.metrics.write(step, metrics)
        print(f"eval after {step} RL steps ({e.split} tasks, {len(results)} executions): reward {metrics['eval_reward_mean']:.3f}  "
              f"pass {metrics['eval_pass_rate']:.2f}  excluded {metrics['eval_excluded']}  ({metrics['eval_s']:.1f}s)", flush=True)
        return metrics

    def _eval_due(self, step: int) -> bool:
        e = self.config.eval
        if e.samples_per_task == 0 or (self.workdir / "results" / f"eval_{step:06d}.jsonl").exists():
            return False
        return step == 0 or step == self.config.total_steps or (e.every_steps > 0 and step % e.every_steps == 0)

    def run_step(self, step: int) -> StepOutcome | None:
        c = self.config
        t0 = time.time()
        bar = None
        if c.metrics.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=c.rollout.tasks_per_step * c.rl.group_size, desc=f"step {step} rollouts", leave=False,
                       unit="exec", dynamic_ncols=True, disable=None)  # no bar when stderr is not a terminal
        try:
            results = self.rollout(step, progress=(lambda _: bar.update(1)) if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        if self._stop.is_set():
            return None
        t_rollout = time.time() - t0
        _fsync_write(self.workdir / "results" / f"step_{step:06d}.jsonl",
                     "".join(json.dumps(r.to_dict()) + "\n" for r in results))
        t1 = time.time()
        train_metrics = self.train_on(step, results)
        self.publish_weights()
        self._event("step_trained", step)
        t_train = time.time() - t1
        valid = [r.reward for r in results if not r.excluded]
        calls = [len(self.records.read(r.execution_id)) for r in results]
        counts = summarize(results)
        metrics = {
            "phase": "train",
            "reward_mean": counts["reward_mean"],
            "pass_rate": float(np.mean([v >= 1.0 for v in valid])) if valid else float("nan"),
            "excluded": counts["excluded"],
            "timeouts": counts["timeouts"],
            "crashed": counts["crashed"],
            "evaluator_failures": counts["evaluator_failures"],
            "evaluator_timeouts": counts["evaluator_timeouts"],
            "executions": counts["executions"],
            "calls_per_execution": float(np.mean(calls)) if calls else 0.0,
            "rollout_s": t_rollout,
            "train_s": t_train,
            "step_s": time.time() - t0,
            "policy_version": int(self.state.step),
            **train_metrics,
        }
        self.metrics.write(step, metrics)
        print(format_step_line(step + 1, c.total_steps, metrics), flush=True)
        return StepOutcome(metrics=metrics, results=results)

    def close(self) -> None:
        for closer in (self.proxy.stop, *[loop.stop for loop in self.loops], self.metrics.close, self.checkpointer.close):
            try:
                closer()
            except Exception:  # noqa: BLE001 - best effort on shutdown; the first error is logged
                log.exception("error while shutting down")
