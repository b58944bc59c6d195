"""Entry point: ``python -m gyre_jax.train [--config configs/<name>.py] [--config.a.b=value ...]``.

Loads and validates the config and loads its task suite before any work starts (a bad config or suite exits
with status 2 and one line saying what is wrong), starts this process (``runtime.initialize``: platform, devices, and
``jax.distributed`` for a multi-process run), then process 0 builds the run (``build_run``) and trains;
every other process follows (``follower.follow``). Running again with the same ``workdir`` resumes from
the last checkpoint; SIGINT/SIGTERM save and exit.

Multi-process (one process per host, ``config.distributed``; docs/multihost.md): run the same command on
every host. Process 0 leads (it prints the step lines); the others run their cells and exit with it. A
lost or failed process stops all of them (exit code 75 on the survivors): rerun all to resume.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Sequence

import jax

from gyre_jax import build, runtime
from gyre_jax import config as config_lib
from gyre_jax.disk import DiskFull, is_disk_full, write_whole
from gyre_jax.elastic.controller import Controller
from gyre_jax.elastic.ledger import RolloutLedger
from gyre_jax.elastic.live import LiveState
from gyre_jax.elastic.policies import make_policy
from gyre_jax.elastic.timeline import TimelineWriter
from gyre_jax.elastic.training import CellTraining
from gyre_jax.metrics import MetricsWriter
from gyre_jax.model import layer_stack
from gyre_jax.model.config import ModelInputError
from gyre_jax.proxy.live import LiveRoutes
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.router import Router
from gyre_jax.proxy.server import is_loopback
from gyre_jax.rl.learner import Learner, TrainState
from gyre_jax.rollout.suites import TaskSuite
from gyre_jax.run import EXIT_UNTRAINED, ExecutionPlan, Rollouts, Run, RunDir, RunStop
from gyre_jax.runtime.local import LocalCell
from gyre_jax.runtime.remote import Cells, open_cells
from gyre_jax.trajectory.pipeline import TrajectoryConfig, TrajectoryPipeline

log = logging.getLogger("gyre_jax")


def build_run(config, suite: TaskSuite | None = None) -> Run:
    """Process 0's run from ``config``, top to bottom: its parts are built whole, then ``Run.run`` trains.

    setup -> core learner and train state -> data -> cells -> proxy and executor -> controller. ``suite``: the
    config's task suite if ``main`` already loaded it (``build.make_suite``, before any work)."""
    config_lib.validate(config)
    suite = build.make_suite(config) if suite is None else suite
    [log.warning("%s", w) for w in build.preflight(config)]  # sandbox works, harness installed: before any work
    workdir = config_lib.resolve_workdir(config)
    workdir.mkdir(parents=True, exist_ok=True)
    write_whole(workdir / "config.json", json.dumps(config.to_dict(), indent=2, default=str))  # a full disk: now
    stop = RunStop()
    s = build.setup(config)  # devices, training mesh, cells, model, tokenizer
    learner = build.core_learner(s, config.optimizer, config.loss_config())
    checkpointer = build.checkpointer(s, workdir / "checkpoints", config.keep_checkpoints, at_start=True)
    metrics = MetricsWriter(workdir, tensorboard=config.metrics.tensorboard)
    state, start_step, pipeline_state = _initial_state(s, learner, checkpointer, suite, metrics, stop.event)
    ref_params = _reference_policy(s, learner, state, workdir)

    records = RecordStore(workdir / "records")
    pipeline = TrajectoryPipeline(
        workdir / "records", workdir / "trajectory", _trajectory_config(config, s), state=pipeline_state
    )
    plan = ExecutionPlan(config, suite, records, workdir / "executions", workdir, _set_aside_recorder(metrics))

    cells = _cells(s, learner, state, stop)
    router = Router({h.name: h for h in cells.handles})
    names = [h.name for h in cells.handles]
    trace = workdir / "timeline" / f"step{start_step:06d}.json"
    live = LiveState(names, total_steps=config.total_steps, policy=config.schedule.policy, trace_path=trace,
                     tensorboard_dir=workdir / "tensorboard" if config.metrics.tensorboard else None)  # fmt: skip
    live_view = LiveRoutes(live.snapshot, _live_key(config, workdir))
    proxy = build.make_proxy(config, router, s.tokenizer, records, routes=[live_view]).start()
    executor = build.make_executor(config, proxy, workdir, suite, s.multi_process)

    timeline = TimelineWriter(trace, names, source="run", t0=time.time(), listener=live.timeline_event)
    for h in cells.handles:
        timeline.role(time.time(), h.index, "serving", reason="start")
    training = CellTraining(learner, state, cells.handles, ref_params=ref_params)
    training.publish([h for h in cells.handles if h.policy_version != training.version])  # follower cells start serving
    controller = Controller(
        config.controller_config(),
        training=training,
        ledger=_ledger(config, executor, records, pipeline, plan.step, timeline),
        policy=make_policy(config.schedule.policy, len(cells.handles), **config_lib.policy_options(config)),
        router=router,
        timeline=timeline,
        stop=stop.event,
        decisions_path=workdir / "decisions.jsonl",
        on_decision=live.decision,
    )
    run = Run(
        config,
        start_step,
        rundir=RunDir(workdir, checkpointer, metrics, timeline),
        rollouts=Rollouts(plan, executor, proxy),
        cells=cells,
        controller=controller,
        stop=stop,
        pipeline_state=pipeline.get_state(),
        live=live,
    )
    if start_step == 0 and checkpointer.latest_step() is None:
        run.save_checkpoint(0)
    log.info(
        "proxy serving on %s; %s policy; %d cells x %d devices (cell0 = core); model %.2fM params",
        proxy.base_url, config.schedule.policy, len(names), len(s.cells[0].devices), s.model_cfg.num_params / 1e6,
    )  # fmt: skip
    log.info("live view of the cells: %s/live%s", proxy.anthropic_base_url, "" if live_view.key is None else
             f"?key=<{workdir / 'live_key'}>")  # fmt: skip
    return run


def _live_key(config, workdir) -> str | None:
    """The run's key for the live view when the proxy listens beyond loopback (written to ``workdir/live_key``,
    readable by its owner only); None on loopback (the page is served to this machine only)."""
    if is_loopback(config.proxy.host):
        return None
    key = secrets.token_urlsafe(24)
    path = workdir / "live_key"
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(key + "\n")
    return key


def _initial_state(
    s: build.Setup, learner: Learner, checkpointer, suite, metrics, stop
) -> tuple[TrainState, int, dict | None]:
    """The core's train state: the last checkpoint's, or the (warm-started) model's at step 0. Followers learn
    from process 0 whether the (collective) warm start runs."""
    latest = checkpointer.latest_step()
    if s.multi_process:
        runtime.broadcast_decision({"latest": latest})
    if latest is not None:
        if (
            learner.worker.lora
        ):  # the checkpoint holds the adapter; the base is where it came from (checkpoint_dir, seed)
            learner.set_base(build.core_params(s, s.params))
        state, meta = layer_stack.restore(checkpointer, latest, learner.abstract_state())  # either layer layout
        build.check_lora_base(s.config, meta)
        log.info(
            "resumed from %s at step %d (policy version %d)", checkpointer.directory, meta["next_step"], int(state.step)
        )
        resume = {"phase": "resume", "checkpoint": latest, "next_step": int(meta["next_step"])}
        metrics.write(int(meta["next_step"]), {**resume, "policy_version": int(state.step)})
        s.params = None
        return state, int(meta["next_step"]), meta.get("pipeline")
    params = s.params
    if s.config.warm_start.steps > 0:

        def done(steps: int, loss: float) -> None:
            metrics.write(-1, {"phase": "warm_start", "warm_start_steps": steps, "warm_start_loss": loss})

        params = build.warm_start(s, suite, stop, on_done=done)
    s.params = None
    return learner.init_state(build.core_params(s, params)), 0, None


def _set_aside_recorder(metrics: MetricsWriter):
    """``ExecutionPlan.on_set_aside``: one ``set_aside`` entry in metrics.jsonl per set-aside (docs/records.md)."""

    def record(what: str, execution_ids: list[str], directory) -> None:
        entry = {"phase": "set_aside", "what": what, "set_aside": len(execution_ids), "execution_ids": execution_ids}
        metrics.write(-1, {**entry, "directory": str(directory)})

    return record


def _reference_policy(s: build.Setup, learner: Learner, state: TrainState, workdir) -> object | None:
    """The KL term's reference policy: the params RL started from, kept in ``reference/`` (None: no KL)."""
    if learner.loss_cfg.kl_coef <= 0:
        return None
    store = build.checkpointer(s, workdir / "reference", max_to_keep=1)
    try:
        if store.latest_step() is not None:
            return layer_stack.restore(store, 0, learner.abstract_params())[0]
        if int(state.step) > 0:
            log.warning("no reference policy saved in %s: the KL term starts from the resumed params", store.directory)
        ref = build.copy_core(s, state.params)  # a copy: the optimizer step donates the state
        store.save(0, ref, {"what": "the KL term's reference policy", "policy_version": int(state.step)})
        return ref
    finally:
        store.close()


def _cells(s: build.Setup, learner: Learner, state: TrainState, stop: RunStop) -> Cells:
    """A handle per cell: the core's worker is the learner's; every cell of this process serves the current policy
    (a follower's starts when the first weights are published to it). A follower's failure fails the run, its stop
    request stops it (``RunStop``)."""
    factory = build.CellFactory(s, learner.loss_cfg)
    version = int(state.step)

    def local(cell, layout) -> LocalCell:
        worker = learner.worker if cell.index == 0 else factory.worker(cell)
        handle = LocalCell(cell, layout, None, worker, make_loop=lambda params, v: factory.loop(cell, params, v))
        handle.set_weights(learner.full_params(state.params), version)  # a copy; LoRA: the base once, shared
        return handle

    layouts = [factory.layout(cell) for cell in s.cells]
    max_context = s.config.serving.max_seq_len
    return open_cells(s.cells, layouts, local, learner.param_shardings, max_context, stop.fail, stop.follower_asks)


def _trajectory_config(config, s: build.Setup) -> TrajectoryConfig:
    """The pipeline's config with the model's own vocabulary (a Hugging Face checkpoint's, which ``config.model``
    does not hold). Branch labels follow the proxy's threads (one per agent), so no message end is passed."""
    cfg = config.trajectory_config()
    m = s.model_cfg
    replay = (m.num_moe_layers, m.num_experts_per_tok) if config.rl.routing_replay == "replay" else None
    replay_prompt = config.rl.routing_replay_prompt == "replay"
    return dataclasses.replace(cfg, vocab_size=m.vocab_size, replay_experts=replay, replay_prompt=replay_prompt)


def _ledger(config, executor, records, pipeline, make_specs, timeline) -> RolloutLedger:
    return RolloutLedger(
        batch_size=config.rollout.tasks_per_step * config.rl.group_size,
        drop_staleness=config.drop_bound,
        stream_order=config.trajectory.stream_order,
        executor=executor,
        records=records,
        pipeline=pipeline,
        make_specs=make_specs,
        timeline=timeline,
        admission=config.schedule.admission,
    )


def _stopped_by_full_disk(exc: OSError, workdir) -> int:
    """A full disk ends the run with one line (exit 1); any other OSError is re-raised."""
    if not is_disk_full(exc):
        raise exc
    full = exc if isinstance(exc, DiskFull) else DiskFull(exc.filename or workdir)
    if full is not exc:  # a writer that does not name its file: say which error it was, in one line
        tb, where = exc.__traceback__, ""
        while tb is not None:  # the innermost frame of this package: the writer
            if f"{os.sep}gyre_jax{os.sep}" in tb.tb_frame.f_code.co_filename:
                where = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
            tb = tb.tb_next
        log.error("full disk: %s: %s%s", type(exc).__name__, exc, where)
    print(f"error: {full}", file=sys.stderr, flush=True)
    runtime.shutdown()
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    try:
        config = config_lib.load_config(argv)
        suite = build.make_suite(config)  # a harbor/jsonl suite is read and checked task by task here
    except config_lib.ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # force: importing absl (through orbax) already gave the root logger a handler
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, datefmt="%H:%M:%S", force=True)
    for noisy in ("absl", "jax", "orbax", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        runtime.initialize(config)
    except runtime.DistributedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if jax.process_index() > 0:
        from gyre_jax.follower import follow

        try:
            code = follow(config, suite)
        except ModelInputError as exc:  # every process reads the same checkpoint: each says so in one line
            print(f"error: {exc}", file=sys.stderr)
            code = 2
        runtime.shutdown()
        return code
    try:
        run = build_run(config, suite)
    except (build.PreflightError, ModelInputError) as exc:  # the machine or the model input: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        runtime.shutdown()
        return 2
    except OSError as exc:
        return _stopped_by_full_disk(exc, config_lib.resolve_workdir(config))
    failure = None
    try:
        step = run.run()
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        failure = exc
    finally:
        run.close()
    if failure is not None:  # after the shutdown's own messages: the error is the last line
        return _stopped_by_full_disk(failure, run.rundir.path)
    if run.untrained_error is not None:
        print(f"error: {run.untrained_error}", file=sys.stderr, flush=True)
        runtime.shutdown()
        return EXIT_UNTRAINED
    print(f"done: {step} steps in {run.rundir.path}", flush=True)
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
