"""The training run: warm start, then RL steps of rollouts through the proxy and GSPO updates.

``Trainer`` wires the parts together for one run directory: the model (random init, or a Hugging Face
checkpoint), the cells (each a submesh with a serving engine + loop and a gradient worker; cell 0 is
the core with the learner's params and optimizer state), the router and the OpenAI/Anthropic-compatible
proxy, the executor that runs black-box harness processes, the trajectory pipeline, checkpoints and
metrics. The ``Controller`` (``gyre_jax/elastic/controller.py``) runs the RL steps under the configured
scheduling policy (colocated, async or elastic); evaluation runs between controller segments, with
every cell serving.

Run directory layout (see docs/records.md):
    checkpoints/<step>/      orbax: train state + JSON meta (policy version, data cursor)
    records/<exec>.jsonl     TITO records, one per model call (fsynced before the call returns)
    executions/<exec>/       workspace, task.json, harness stdout/stderr, result.json
    results/step_<k>.jsonl   the step's execution results (fsynced before training on them)
    trajectory/queue.jsonl   the execution queue the trajectory pipeline reads (docs/trajectory.md)
    timeline/step<k>.json    Chrome-trace timeline of the run attempt that started at step k
    decisions.jsonl          every scheduling decision with its event and cluster state
    cost_measurements.json   measured serving/training/switch costs (the simulator's calibration input)
    metrics.jsonl, tensorboard/, config.json
    aborted/<time>/          records/executions of an interrupted step, set aside on resume
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from gyre_jax import config as config_lib
from gyre_jax import distributed
from gyre_jax.checkpoint import Checkpointer
from gyre_jax.elastic.cells import make_cells
from gyre_jax.elastic.controller import CellRuntime, Controller
from gyre_jax.elastic.policies import make_policy
from gyre_jax.elastic.remote import Follower, FollowerCell, RemoteLoop, RemoteProcess, RemoteWorker
from gyre_jax.elastic.timeline import TimelineWriter
from gyre_jax.metrics import MetricsWriter, format_step_line
from gyre_jax.model.sharding import abstract_model, init_params, make_mesh
from gyre_jax.model.tokenizer import load_tokenizer
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.router import Router
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.proxy.tito import render_demonstration
from gyre_jax.rl.learner import Learner, OptimizerConfig, TrainState
from gyre_jax.rl.micro_step import GradWorker
from gyre_jax.rollout.executor import ExecutionResult, ExecutionSpec, Executor, summarize
from gyre_jax.rollout.tasks import BuiltinSuite
from gyre_jax.serving.engine import Engine
from gyre_jax.serving.loop import ServingLoop
from gyre_jax.trajectory.batch import row_length, supervised_micro_batch
from gyre_jax.trajectory.pipeline import TrajectoryPipeline

log = logging.getLogger("gyre_jax")


def _fsync_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Trainer:
    """One run: build everything from ``config``, then ``run()`` until ``total_steps`` or a signal."""

    def __init__(self, config: config_lib.RunConfig):
        config_lib.validate(config)
        self.config = config
        self.workdir = config_lib.resolve_workdir(config)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        ckpt_dir = config.model.checkpoint_dir or None
        self.tokenizer = load_tokenizer(config.tokenizer.kind, ckpt_dir)
        self.rules = tuple((k, v) for k, v in config.sharding_rules)
        n = config_lib.device_count(config)
        devices = jax.devices()
        if len(devices) < n:
            raise RuntimeError(
                f"the config needs {n} devices but JAX sees {len(devices)} ({devices[0].platform}); "
                f"on CPU set config.devices.num_cpu_devices before JAX starts (python -m gyre_jax.train does this)"
            )
        cell_shape = config.cells.shape()
        # Multi-process (docs/multihost.md): process 0 leads (proxy, executor, records, pipeline, controller,
        # core cell); every other process follows, running the cells on its own devices.
        self.process_id = jax.process_index()
        self.multi_process = jax.process_count() > 1
        self.is_leader = self.process_id == 0
        if self.multi_process:
            if n != len(devices):
                raise RuntimeError(
                    f"a multi-process run uses every device of every process: the config asks for {n} "
                    f"but the processes hold {len(devices)}"
                )
            self.devices = list(distributed.host_ordered(devices))
            self.train_mesh = distributed.make_global_mesh(config.mesh.shape(), self.devices)
            self.cells = distributed.make_global_cells(self.devices, config.cells.num_cells, cell_shape)
            for cell in self.cells:
                procs = distributed.cell_processes(cell)
                if len(procs) > 1:
                    raise distributed.DistributedError(
                        f"not supported yet: {cell.name} spans processes {list(procs)} (a cell over several hosts needs "
                        f"its serving steps in lockstep on all of them); use cells of one host or less: "
                        f"config.cells.num_cells >= the number of processes"
                    )
        else:
            self.devices = devices[:n]
            self.train_mesh = make_mesh(self.devices, config.mesh.shape())
            self.cells = make_cells(self.devices, config.cells.num_cells, cell_shape)
        if ckpt_dir is not None:  # a Hugging Face checkpoint: its config.json defines the architecture
            from gyre_jax.model.hf_checkpoint import load_hf_checkpoint

            self.model_cfg, self.graphdef, params = load_hf_checkpoint(
                ckpt_dir, self.train_mesh, self.rules, dtype=config.model.dtype, param_dtype=config.model.param_dtype
            )
            log.info("loaded %s (%.1fM params)", ckpt_dir, self.model_cfg.num_params / 1e6)
        else:
            self.model_cfg = config.model_config()
            self.graphdef, params = init_params(self.model_cfg, self.train_mesh, self.rules, config.seed)
        self.suite = BuiltinSuite(
            kinds=tuple(config.rollout.task_kinds),
            seed=config.seed,
            max_turns=config.rollout.max_turns,
            tool_latency_median_s=config.rollout.tool_latency_median_s,
            tool_latency_sigma=config.rollout.tool_latency_sigma,
            alphabet=config.rollout.alphabet,
            min_len=config.rollout.input_min_len,
            max_len=config.rollout.input_max_len,
            num_tasks=config.rollout.num_tasks,
        )
        if not self.is_leader:
            self._init_follower(config, params)
            return
        # The core cell (cell 0) holds the authoritative params and the only optimizer state.
        self.learner = self._make_learner()
        # Multi-process: the core lives on process 0 alone, which saves and restores it (orbax, primary host).
        self.checkpointer = Checkpointer(
            self.workdir / "checkpoints", max_to_keep=config.keep_checkpoints, primary_only=self.multi_process
        )
        self.metrics = MetricsWriter(self.workdir, tensorboard=config.metrics.tensorboard)
        _fsync_write(self.workdir / "config.json", json.dumps(config.to_dict(), indent=2, default=str))

        message_end = self.tokenizer.token_id("<|im_end|>") if hasattr(self.tokenizer, "token_id") else None
        self.trajectory_cfg = dataclasses.replace(
            config.trajectory_config(message_end_id=message_end), vocab_size=self.model_cfg.vocab_size
        )
        latest = self.checkpointer.latest_step()
        if self.multi_process:  # every process must agree on whether the (collective) warm start runs
            distributed.broadcast_decision({"latest": latest})
        if latest is not None:
            self.state, meta = self.checkpointer.restore(latest, self.learner.abstract_state())
            self.start_step = int(meta["next_step"])
            pipeline_state = meta.get("pipeline")
            log.info(
                "resumed from %s at step %d (policy version %d)",
                self.workdir / "checkpoints",
                self.start_step,
                int(self.state.step),
            )
        else:
            self.start_step = 0
            pipeline_state = None
            if config.warm_start.steps > 0:
                params = self.warm_start(params)
            self.state = self.learner.init_state(self._core_params(params))
        del params
        self.records = RecordStore(self.workdir / "records")
        self.pipeline = TrajectoryPipeline(
            self.workdir / "records", self.workdir / "trajectory", self.trajectory_cfg, state=pipeline_state
        )
        self._pipeline_state = self.pipeline.get_state()
        if latest is None:
            self.save_checkpoint(0)

        self.engines: list[Engine] = []
        self.loops: list[ServingLoop] = []
        runtimes: list[CellRuntime] = []
        version = int(self.state.step)
        abstract_params = abstract_model(self.model_cfg)[1]
        self.remotes: dict[int, RemoteProcess] = {}
        for cell in self.cells:
            engine = self._make_engine(cell)
            shardings = engine.param_shardings(abstract_params)
            owner = cell.devices[0].process_index
            if owner != self.process_id:  # a follower's cell: stand-ins that drive it from here
                proc = self.remotes.get(owner)
                if proc is None:
                    proc = self.remotes[owner] = RemoteProcess(
                        distributed.runtime().client,
                        owner,
                        on_error=self._remote_failed,
                        on_stop=self._follower_asks_stop,
                    )
                loop = RemoteLoop(proc, cell.index, cell.name, engine.max_seq_len, shardings, engine=engine)
                loop.update_params(self.state.params, version)
                sat = self.learner.make_satellite(cell.mesh, cell.name)  # shardings only: it runs nothing here
                worker = RemoteWorker(proc, cell.index, cell.name, sat.param_shardings, self.learner.param_shardings)
            else:
                loop = self._make_loop(
                    engine, cell, jax.device_put(self.state.params, shardings, may_alias=False), version
                )
                worker = self.learner.worker if cell.index == 0 else self.learner.make_satellite(cell.mesh, cell.name)
            self.engines.append(engine)
            self.loops.append(loop)
            runtimes.append(CellRuntime(cell=cell, loop=loop, serving_shardings=shardings, worker=worker))
        self.router = Router({loop.name: loop for loop in self.loops})
        self.proxy = ProxyServer(
            self.router,
            self.tokenizer,
            self.records,
            model_name=config.proxy.model_name,
            host=config.proxy.host,
            port=config.proxy.port,
            max_request_bytes=config.proxy.max_request_bytes,
            seed=config.seed,
            default_max_tokens=config.rollout.max_tokens_per_call,
            max_tokens_cap=config.rollout.max_tokens_per_call,
            tools_format=config.tokenizer.tools_format,
        ).start()
        self.executor = Executor(
            self.proxy,
            self.proxy.base_url,
            self.workdir / "executions",
            model_name=config.proxy.model_name,
            timeout_s=config.rollout.timeout_s,
            max_parallel=config.rollout.max_parallel,
            temperature=config.rollout.temperature,
            max_tokens=config.rollout.max_tokens_per_call,
            evaluator_timeout_s=config.rollout.evaluator_timeout_s,
        )
        if self.multi_process:  # a lost peer ends the run: kill the harnesses before this process exits
            distributed.add_failure_hook(self.executor.cancel)
        sched = config.schedule
        self.policy = make_policy(sched.policy, len(self.cells), **config_lib.policy_options(config))
        self.timeline = TimelineWriter(
            self.workdir / "timeline" / f"step{self.start_step:06d}.json",
            [c.name for c in self.cells],
            source="run",
            t0=time.time(),
        )
        for c in range(len(self.cells)):
            self.timeline.role(time.time(), c, "serving", reason="start")
        self.controller = Controller(
            cfg=config.controller_config(),
            cells=runtimes,
            learner=self.learner,
            state=self.state,
            policy=self.policy,
            router=self.router,
            executor=self.executor,
            records=self.records,
            pipeline=self.pipeline,
            make_specs=self._step_specs,
            on_step=self._on_step,
            timeline=self.timeline,
            stop=self._stop,
            decisions_path=self.workdir / "decisions.jsonl",
            measurements_path=self.workdir / "cost_measurements.json",
        )
        log.info(
            "proxy serving on %s; %s policy; %d cells x %d devices (cell0 = core); model %.2fM params",
            self.proxy.base_url,
            sched.policy,
            len(self.cells),
            len(self.cells[0].devices),
            self.model_cfg.num_params / 1e6,
        )

    # -- building blocks shared by the leader and the followers ----------------------------------------------
    def _make_learner(self) -> Learner:
        c = self.config
        return Learner(
            self.model_cfg, self.graphdef, self.cells[0].mesh, self.rules, c.optimizer, loss_cfg=c.loss_config()
        )

    def _make_engine(self, cell) -> Engine:
        s = self.config.serving
        return Engine(
            self.model_cfg,
            self.graphdef,
            cell.mesh,
            self.rules,
            max_concurrent_decodes=s.max_concurrent_decodes,
            max_seq_len=s.max_seq_len,
            max_prefill_length=s.max_prefill_length,
            prefill_buckets=tuple(s.prefill_buckets),
            page_size=s.page_size,
        )

    def _make_loop(self, engine: Engine, cell, params, version: int) -> ServingLoop:
        s, c = self.config.serving, self.config
        return ServingLoop(
            engine,
            params,
            policy_version=version,
            name=cell.name,
            seed=c.seed + 7919 * cell.index,
            kv_pages=s.kv_pages,
            on_update=s.on_weight_update,
            reuse_stale_kv=s.reuse_stale_kv,
            detokenize=self.tokenizer.decode,
        ).start()

    def _core_params(self, params):
        """Params from the training mesh onto the core cell. Across processes that is one collective program
        (``publish_to_cells``: every process calls it; process 0 keeps cell 0's copy)."""
        if not self.multi_process:
            return params
        workers = [GradWorker(self.model_cfg, self.graphdef, cell.mesh, self.rules) for cell in self.cells]
        return distributed.publish_to_cells(params, [w.param_shardings for w in workers])[0]

    def _init_follower(self, config, params) -> None:
        """A follower process: takes part in the collective start (warm start, publishing the params), then
        ``run`` serves its own cells as process 0's controller directs (``gyre_jax.elastic.remote``)."""
        latest = distributed.broadcast_decision(None)["latest"]
        if latest is None:
            if config.warm_start.steps > 0:
                params = self.warm_start(params)
            self._core_params(params)
        del params
        abstract_params = abstract_model(self.model_cfg)[1]
        learner = self._make_learner()
        mine, engines = [], {}
        for cell in self.cells:
            engine = engines[cell.index] = self._make_engine(cell)  # other processes' cells: their layouts only
            if cell.devices[0].process_index != self.process_id:
                continue
            mine.append(
                FollowerCell(
                    index=cell.index,
                    name=cell.name,
                    serving_shardings=engine.param_shardings(abstract_params),
                    make_loop=lambda p, v, e=engine, c=cell: self._make_loop(e, c, p, v),
                    worker=learner.make_satellite(cell.mesh, cell.name),
                )
            )
        self.follower = Follower(
            distributed.runtime().client, self.process_id, mine, learner.param_shardings, engines=engines
        )
        self._abstract_params = abstract_params
        log.info("process %d follows process 0 with %s", self.process_id, ", ".join(c.name for c in mine))

    def _follower_asks_stop(self) -> None:
        """A follower got SIGINT/SIGTERM (e.g. every process got Slurm's): stop and save, once."""
        if not self._stop.is_set():
            self.request_stop()

    def _remote_failed(self, message: str) -> None:
        if hasattr(self, "controller"):
            self.controller._post("error", message=message)

    # -- helpers ----------------------------------------------------------------------------------
    def save_checkpoint(self, next_step: int) -> None:
        """Train state + meta (the pipeline state at the last step boundary: a resumed run neither drops nor
        repeats an execution)."""
        state = self.controller.state if hasattr(self, "controller") else self.state
        meta = {
            "next_step": next_step,
            "policy_version": int(state.step),
            "seed": self.config.seed,
            "warm_start_done": True,
            "time": time.time(),
            "pipeline": self._pipeline_state,
        }
        self.checkpointer.save(next_step, state, meta)
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
        learner = Learner(
            self.model_cfg,
            self.graphdef,
            self.train_mesh,
            self.rules,
            OptimizerConfig(
                learning_rate=w.learning_rate,
                warmup_steps=w.warmup_steps,
                grad_clip_norm=self.config.optimizer.grad_clip_norm,
            ),
        )
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
            if i == w.steps - 1 and self.is_leader:
                self.metrics.write(
                    -1, {"phase": "warm_start", "warm_start_steps": w.steps, "warm_start_loss": m["loss"]}
                )
            if self._stop.is_set():
                raise KeyboardInterrupt("stopped during warm start (nothing was saved; rerun to start over)")
        log.info("warm start: %d steps in %.1fs", w.steps, time.time() - t0)
        return state.params

    # -- one RL step ------------------------------------------------------------------------------
    def _set_aside_stale(self, specs: list[ExecutionSpec]) -> None:
        """Records/workspaces left by an interrupted attempt at this step are moved to aborted/ (never trained on)."""
        stale = [
            s.execution_id
            for s in specs
            if self.records.path(s.execution_id).exists() or (self.executor.root / s.execution_id).exists()
        ]
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
        return [
            ExecutionSpec(
                execution_id=f"{prefix}{task.task_id}-g{j:02d}",
                task=task,
                group_id=f"{prefix}{task.task_id}",
                seed=(c.seed * 1_000_003 + salt * 1009 + i * 31 + j) % (2**31),
            )
            for i, task in enumerate(tasks)
            for j in range(samples)
        ]

    def _step_specs(self, step: int) -> list[ExecutionSpec]:
        """Step ``step``'s executions in task order (leftovers of an interrupted attempt are set aside first)."""
        c = self.config
        specs = self._specs("", self.suite.tasks_for_step(step, c.rollout.tasks_per_step), c.rl.group_size, step)
        self._set_aside_stale(specs)
        return specs

    def _on_step(
        self,
        step: int,
        state: TrainState,
        learner_metrics: dict[str, Any],
        results: list[ExecutionResult],
        pipeline_state: dict[str, Any],
    ) -> None:
        """Called by the controller right after step ``step``'s optimizer update: results, metrics, checkpoint."""
        c = self.config
        self.state = state
        self._pipeline_state = pipeline_state
        _fsync_write(
            self.workdir / "results" / f"step_{step:06d}.jsonl",
            "".join(json.dumps(r.to_dict()) + "\n" for r in results),
        )
        valid = [r.reward for r in results if not r.excluded]
        counts = summarize(results)
        metrics = {
            "phase": "train",
            "policy": c.schedule.policy,
            "reward_mean": counts["reward_mean"],
            "pass_rate": float(np.mean([v >= 1.0 for v in valid])) if valid else float("nan"),
            "excluded": counts["excluded"],
            "timeouts": counts["timeouts"],
            "crashed": counts["crashed"],
            "evaluator_failures": counts["evaluator_failures"],
            "evaluator_timeouts": counts["evaluator_timeouts"],
            "executions": counts["executions"],
            "policy_version": int(state.step),
            **learner_metrics,
        }
        self.metrics.write(step, metrics)
        if self._bar is not None:
            self._bar.update(1)
        print(format_step_line(step + 1, c.total_steps, metrics), flush=True)
        if (step + 1) % c.checkpoint_every == 0 or step + 1 == c.total_steps:
            self.save_checkpoint(step + 1)

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> int:
        """Runs RL steps from the checkpointed cursor to ``total_steps``. Returns the next step index.

        The controller runs the steps between evaluations as one segment (executions of later steps may
        start early within a segment under the async and elastic policies, never across an evaluation)."""
        c = self.config
        if not self.is_leader:
            self.follower.serve(self._abstract_params)
            return c.total_steps
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                handlers[sig] = signal.signal(sig, self.request_stop)
        step = self.start_step
        self._saved_step = getattr(self, "_saved_step", self.start_step)
        self._bar = None
        try:
            while step < c.total_steps and not self._stop.is_set():
                if self._eval_due(step) and self.evaluate(step) is None and self._stop.is_set():
                    break
                end = self._next_eval_step(step)
                if c.metrics.progress_bar:
                    from tqdm import tqdm

                    self._bar = tqdm(
                        total=end - step,
                        desc=f"steps {step}-{end - 1} ({c.schedule.policy})",
                        leave=False,
                        unit="step",
                        dynamic_ncols=True,
                        disable=None,
                    )  # no bar when stderr is not a terminal
                try:
                    step = self.controller.run(step, end)
                finally:
                    if self._bar is not None:
                        self._bar.close()
                        self._bar = None
            if step == c.total_steps and not self._stop.is_set() and self._eval_due(step):
                self.evaluate(step)
        finally:
            if self._saved_step != step:
                self.save_checkpoint(step)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if self._stop.is_set() and step < c.total_steps:
            log.warning(
                "stopped at step %d/%d; checkpoint saved. Run the same command again to resume.", step, c.total_steps
            )
        return step

    def _next_eval_step(self, step: int) -> int:
        """The end of the controller segment starting at ``step``: the next step with an evaluation, or the last."""
        e, total = self.config.eval, self.config.total_steps
        if e.samples_per_task == 0 or e.every_steps <= 0:
            return total
        return min(total, (step // e.every_steps + 1) * e.every_steps)

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
        _fsync_write(
            self.workdir / "results" / f"eval_{step:06d}.jsonl",
            "".join(json.dumps(r.to_dict()) + "\n" for r in results),
        )
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
        print(
            f"eval after {step} RL steps ({e.split} tasks, {len(results)} executions): reward {metrics['eval_reward_mean']:.3f}  "
            f"pass {metrics['eval_pass_rate']:.2f}  excluded {metrics['eval_excluded']}  ({metrics['eval_s']:.1f}s)",
            flush=True,
        )
        return metrics

    def _eval_due(self, step: int) -> bool:
        e = self.config.eval
        if e.samples_per_task == 0 or (self.workdir / "results" / f"eval_{step:06d}.jsonl").exists():
            return False
        return step == 0 or step == self.config.total_steps or (e.every_steps > 0 and step % e.every_steps == 0)

    def close(self) -> None:
        if not self.is_leader:
            return
        closers = (
            self.proxy.stop,
            *[loop.stop for loop in self.loops],
            *[p.close for p in self.remotes.values()],
            self.controller.close,
            lambda: self.timeline.close(time.time()),
            self.metrics.close,
            self.checkpointer.close,
        )
        for closer in closers:
            try:
                closer()
            except Exception:  # noqa: BLE001 - best effort on shutdown; the first error is logged
                log.exception("error while shutting down")
