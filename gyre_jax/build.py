"""What every process of a run builds the same way from the config, leader and followers alike.

``setup(config)``: the devices, the training mesh and the cells, the model (random init or a Hugging Face
checkpoint; a collective program over every process's devices) and the tokenizer. ``CellFactory``: a
cell's layout, serving engine and loop, and gradient worker. ``warm_start``: the optional supervised warm
start on the suite's demonstrations (collective too). ``make_suite``: the task suite the config names, loaded
and checked (the config itself reads no file). ``core_params``: the params from the training mesh
onto the core cell (across processes, one program every process runs: ``publish_to_cells``).
"""

from __future__ import annotations

import collections
import logging
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from gyre_jax import runtime
from gyre_jax.checkpoint import Checkpointer
from gyre_jax.config.base import ConfigError
from gyre_jax.config.run import check_routing_replay
from gyre_jax.faultpoints import kill_point
from gyre_jax.model.checkpoints import resolve_checkpoint
from gyre_jax.model.config import ModelConfig, ModelInputError
from gyre_jax.model.sharding import Rules, abstract_model, init_params
from gyre_jax.model.tokenizer import load_tokenizer
from gyre_jax.progress import Progress
from gyre_jax.proxy import chat_format
from gyre_jax.proxy.sampling import SamplingPolicy
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.proxy.tito import render_demonstration
from gyre_jax.rl.learner import Learner
from gyre_jax.rl.losses import LossConfig
from gyre_jax.rl.micro_step import GradWorker
from gyre_jax.rollout import suites
from gyre_jax.rollout.executor import Executor
from gyre_jax.rollout.sandbox import make_sandbox
from gyre_jax.rollout.suites import HarborSuite, TaskSuite
from gyre_jax.rollout.tasks import BuiltinSuite, LongTaskParams
from gyre_jax.runtime import lockstep
from gyre_jax.runtime.cells import Cell, CellLayout
from gyre_jax.runtime.local import LocalCell
from gyre_jax.runtime.transfer import transfer
from gyre_jax.serving.engine import Engine
from gyre_jax.serving.loop import ServingLoop
from gyre_jax.serving.paged import PagedEngine
from gyre_jax.trajectory.batch import row_length, supervised_micro_batch

log = logging.getLogger("gyre_jax")


@dataclass
class Setup:
    """A process's view of the run: its devices, meshes and cells, the model and the tokenizer."""

    config: Any
    tokenizer: Any
    rules: Rules
    train_mesh: jax.sharding.Mesh
    cells: list[Cell]
    model_cfg: ModelConfig
    graphdef: nnx.GraphDef
    params: Any  # on the training mesh (dropped once published to the cells)

    @property
    def process(self) -> int:
        return jax.process_index()

    @property
    def multi_process(self) -> bool:
        return jax.process_count() > 1


def setup(config) -> Setup:
    """Devices -> training mesh and cells -> model and tokenizer (see the module docstring). A checkpoint's
    config.json, weights and tokenizer are checked against each other before any tensor is read (a mismatch
    raises ``ModelInputError``: one line naming the file)."""
    ckpt_dir = str(resolve_checkpoint(config.model.checkpoint_dir)) if config.model.checkpoint_dir else None  # pkg: too
    tokenizer = load_tokenizer(config.tokenizer.kind, config.tokenizer.path or ckpt_dir, config.tokenizer.gguf_pre)
    rules = config.sharding_rules
    devices = _run_devices(config)
    cp = config.model.context_parallel  # a `context` axis carved out of `data` when > 1
    train_mesh = runtime.make_train_mesh(config.mesh.shape(cp), devices)
    cells = runtime.make_cells(devices, config.cells.num_cells, config.cells.shape(cp))
    if jax.process_count() > 1:
        _lockstep(cells)
    if ckpt_dir is not None:  # a checkpoint (HF directory or GGUF file): it defines the architecture
        from gyre_jax.model.checkpoints import Checkpoint
        from gyre_jax.model.config import COMPUTE_FIELDS
        from gyre_jax.model.hf_tokenizer import HFTokenizer, check_fits_model

        compute = {name: getattr(config.model, name) for name in COMPUTE_FIELDS}  # remat, dtypes, kernels
        with Checkpoint(ckpt_dir) as ckpt:
            model_cfg = ckpt.model_config(num_layers=config.model.checkpoint_layers, **compute)
            check_routing_replay(config.rl.routing_replay, model_cfg.num_experts)  # before any tensor is read
            if isinstance(tokenizer, HFTokenizer):  # before any tensor is read
                check_fits_model(tokenizer, model_cfg.vocab_size, ckpt.config_source)
            graphdef, params = ckpt.load_params(model_cfg, train_mesh, rules, seed=config.seed)  # LoRA: a new adapter
        log.info("loaded %s (%.1fM params)", ckpt_dir, model_cfg.num_params / 1e6)
    else:
        model_cfg = config.model_config()
        graphdef, params = init_params(model_cfg, train_mesh, rules, config.seed)
    return Setup(config, tokenizer, rules, train_mesh, cells, model_cfg, graphdef, params)


def _lockstep(cells: list[Cell]) -> None:
    """When this process is the first of a cell over several processes, it drives that cell (``runtime.lockstep``:
    every device call on it runs on all of its processes); its other processes replay (``follower.follow``)."""
    me = jax.process_index()
    for cell in cells:
        if len(cell.processes) > 1 and cell.processes[0] == me:
            lockstep.drive(runtime.runtime().client, cell, {c.name: c for c in cells})


def _run_devices(config) -> list[jax.Device]:
    """The devices the config asks for (every device of every process in a multi-process run)."""
    from gyre_jax.config import device_count

    n, devices = device_count(config), jax.devices()
    if len(devices) < n:
        raise RuntimeError(
            f"the config needs {n} devices but JAX sees {len(devices)} ({devices[0].platform}); "
            f"on CPU set config.devices.num_cpu_devices before JAX starts (python -m gyre_jax.train does this)"
        )
    if jax.process_count() > 1 and n != len(devices):
        raise RuntimeError(
            f"a multi-process run uses every device of every process: the config asks for {n} "
            f"but the processes hold {len(devices)}"
        )
    return list(runtime.cells.host_ordered(devices[:n] if jax.process_count() == 1 else devices))


class CellFactory:
    """A cell's parts from the config: its layout, serving engine and started loop, gradient worker."""

    def __init__(self, s: Setup, loss_cfg: LossConfig | None = None):
        self.s = s
        self.loss_cfg = loss_cfg
        group = lockstep.driving(*s.cells)
        if group is not None:  # the cell's other processes hold theirs under this name
            group.register("factory", self)

    def layout(self, cell: Cell) -> CellLayout:
        return CellLayout.of(cell, self.s.model_cfg, self.s.rules, self.s.config.serving.page_size)

    def engine(self, cell: Cell) -> Engine | PagedEngine:
        """``cell``'s serving engine; on a cell over several processes, built and run on all of them (its driver's
        ``LockstepEngine``, bound as ``engine/<cell>`` on every process)."""
        group = lockstep.driving(cell)
        if group is None:
            return self.make_engine(cell)
        name = f"engine/{cell.name}"
        return lockstep.LockstepEngine(group, group.call("factory", "make_engine", cell, bind=name), name)

    def make_engine(self, cell: Cell) -> Engine | PagedEngine:
        """``cell``'s serving engine, built here (this process's part of it)."""
        sv = self.s.config.serving
        if sv.kv_layout == "paged":  # one pool of kv_pages pages for slots and cached sessions
            return PagedEngine(
                self.s.model_cfg,
                self.s.graphdef,
                cell.mesh,
                self.s.rules,
                max_concurrent_decodes=sv.max_concurrent_decodes,
                num_pages=sv.kv_pages,
                page_size=sv.page_size,
                max_prefill_length=sv.max_prefill_length,
                prefill_buckets=tuple(sv.prefill_buckets),
                max_pages_per_slot=sv.max_seq_len // sv.page_size,
                decode_steps=sv.decode_steps,
            )
        return Engine(
            self.s.model_cfg,
            self.s.graphdef,
            cell.mesh,
            self.s.rules,
            max_concurrent_decodes=sv.max_concurrent_decodes,
            max_seq_len=sv.max_seq_len,
            max_prefill_length=sv.max_prefill_length,
            prefill_buckets=tuple(sv.prefill_buckets),
            page_size=sv.page_size,
            num_pages=sv.kv_pages,  # the session cache's pool, beside the slots
            record_experts=self.s.config.rl.routing_replay == "replay",
            decode_steps=sv.decode_steps,
        )

    def loop(self, cell: Cell, params: Any, version: int, warm: bool | None = None) -> ServingLoop:
        """A started serving loop on ``cell`` with ``params`` (on its serving layout) at policy ``version``; its
        programs compiled first when ``warm`` (None: ``serving.warmup``)."""
        sv, c = self.s.config.serving, self.s.config
        engine = self.engine(cell)  # a new engine per loop, and a cell builds its loop once (not per role switch)
        if sv.warmup if warm is None else warm:
            self.warm(cell, engine, params)
        return ServingLoop(
            engine,
            params,
            policy_version=version,
            name=cell.name,
            seed=c.seed + 7919 * cell.index,
            kv_pages=None if sv.kv_layout == "paged" else sv.kv_pages,  # paged: the cache shares the engine's pool
            on_update=sv.on_weight_update,
            reuse_stale_kv=sv.reuse_stale_kv,
            lookahead=sv.decode_lookahead,
            detokenize=self.s.tokenizer.decode,
        ).start()

    def warm(self, cell: Cell, engine: Engine | PagedEngine, params: Any) -> int:
        """Compiles every program shape ``engine``'s serving loop can dispatch (``serving.warmup``), ahead of time
        (nothing runs); logs the count and the seconds; returns the count."""
        t0 = time.perf_counter()
        count = engine.warmup(params)  # the session cache's pool too (the engine's kv_pages pages)
        log.info("%s: serving warm-up compiled %d program shapes in %.1fs", cell.name, count, time.perf_counter() - t0)
        return count

    def worker(self, cell: Cell) -> GradWorker:
        """``cell``'s gradient worker (a cell over several processes: its driver's runs in lockstep with the
        workers its other processes hold as ``worker/<cell>``)."""
        worker = GradWorker(self.s.model_cfg, self.s.graphdef, cell.mesh, self.s.rules, self.loss_cfg, name=cell.name)
        group = lockstep.driving(cell)
        return worker if group is None else lockstep.LockstepWorker(group, worker, f"worker/{cell.name}")


def make_suite(config) -> TaskSuite:
    """The suite ``config.rollout.suite`` names (``rollout.suites.make_suite``): the builtin suite, or a harbor/jsonl
    suite read from disk and checked task by task. The config holds only the suite's name; this is where it is
    loaded, before any work: a suite that cannot be read or does not fit the config (a malformed task, a
    held-out split that leaves nothing to train on) raises ``ConfigError`` naming ``config.rollout.suite``."""
    r = config.rollout
    if r.suite != "builtin":
        try:
            return suites.make_suite(
                r.suite,
                seed=config.seed,
                max_turns=r.max_turns,
                heldout_fraction=r.heldout_fraction,
                sandbox=r.sandbox,
            )
        except suites.SuiteError as exc:
            raise ConfigError(f"config.rollout.suite={r.suite!r}: {exc}") from None
    return BuiltinSuite(
        kinds=tuple(r.task_kinds),
        seed=config.seed,
        max_turns=r.max_turns,
        tool_latency_median_s=r.tool_latency_median_s,
        tool_latency_sigma=r.tool_latency_sigma,
        alphabet=r.alphabet,
        min_len=r.input_min_len,
        max_len=r.input_max_len,
        num_tasks=r.num_tasks,
        long=LongTaskParams.from_rollout(r),
    )


class PreflightError(RuntimeError):
    """The machine lacks what the config needs (a sandbox, a harness); the message says what to install."""


def preflight(config) -> list[str]:
    """Checks, before any work starts, that the config's sandbox works here and its harness is installed and runs
    inside that sandbox (``harnesses.check_in_sandbox``: every path it needs visible, its version command run
    there); raises ``PreflightError`` naming the command that installs what is missing or the path the sandbox
    does not show; returns warnings (a harness version other than the pinned one)."""
    from gyre_jax.config.run import resolve_workdir
    from gyre_jax.rollout.harnesses import HarnessMissing, check_harness, check_in_sandbox, probe_env
    from gyre_jax.rollout.sandbox import SandboxUnavailable, make_sandbox
    from gyre_jax.rollout.verifier import verifier_problem

    r = config.rollout
    missing = [p for p in r.sandbox_visible_paths if not Path(p).exists()]
    if missing:
        raise PreflightError(
            f"config.rollout.sandbox_visible_paths entry {missing[0]!r} does not exist on this machine"
        )
    sandbox = make_sandbox(r.sandbox, proxy_address=None, state_dir=Path(tempfile.gettempdir()),
                           hide=[resolve_workdir(config)], visible=r.sandbox_visible_paths)  # fmt: skip
    try:
        try:
            sandbox.check()
        except SandboxUnavailable as exc:
            message = (
                str(exc) if "config.rollout.sandbox" in str(exc) else f"config.rollout.sandbox={r.sandbox!r}: {exc}"
            )
            raise PreflightError(message) from None
        problem = verifier_problem(r.suite, r.sandbox)  # the suite's verifiers' runner (task.toml [verifier.requires])
        if problem:
            raise PreflightError(problem)
        spec = r.harness_spec()
        env = probe_env(spec)
        try:
            warning = check_harness(spec, path=env["PATH"])
            check_in_sandbox(spec, sandbox, env)  # the harness's own version command, inside the run's sandbox
        except HarnessMissing as exc:
            raise PreflightError(str(exc)) from None
    finally:
        sandbox.close()
    return [warning] if warning else []


def warm_start(s: Setup, suite: TaskSuite, stop: threading.Event, on_done=None) -> Any:
    """Supervised warm start of ``s.params`` on the suite's demonstrations (``config.warm_start``); returns
    the new params. Every process of a multi-process run runs it (the training mesh spans them all)."""
    c = s.config
    w = c.warm_start
    learner = Learner(s.model_cfg, s.graphdef, s.train_mesh, s.rules, w.optimizer(c.optimizer.grad_clip_norm))
    state = learner.init_state(s.params)
    t0, losses = time.time(), collections.deque(maxlen=25)  # the last steps' losses, kept on the device
    mode = None if c.metrics.progress_bar else "lines"
    progress = Progress("warm start", total=w.steps, unit="steps", mode=mode)
    for i in range(w.steps):
        kill_point("warm_start")
        demos = suite.demonstrations(w.batch_size, seed=c.seed * 100_003 + i)
        convs = [render_demonstration(s.tokenizer, m, suite.tools, c.tokenizer.tools_format) for m in demos]
        seqs = [(conv.ids, conv.trainable) for conv in convs]
        total = sum(sum(t[1:]) for _, t in seqs)
        mb = supervised_micro_batch(seqs, total, row_length(max(len(ids) for ids, _ in seqs) - 1))
        state, m = learner.step(state, [mb], kind="sft")
        losses.append(m["loss"])
        steps = i + 1
        progress.update(1, detail=f"loss {float(m['loss']):.4f}" if i % 5 == 0 else None)  # a sync every 5 steps
        if stop.is_set():
            progress.close("stopped")
            raise KeyboardInterrupt("stopped during warm start (nothing was saved; rerun to start over)")
        if w.target_loss > 0 and len(losses) == losses.maxlen and steps % 5 == 0:
            if sum(float(x) for x in losses) / len(losses) <= w.target_loss:
                log.info("warm start reached warm_start.target_loss=%g at step %d", w.target_loss, steps)
                break
    else:
        steps = w.steps
        if w.target_loss > 0 and w.steps:
            log.warning(
                "warm start: warm_start.target_loss=%g not reached in warm_start.steps=%d (raise either to go on)",
                w.target_loss,
                w.steps,
            )
    progress.close(f"loss {float(losses[-1]):.4f}" if losses else None)
    tail = [float(x) for x in losses]  # each batch is fresh demonstrations: a held-out estimate
    loss = sum(tail) / len(tail) if tail else float("nan")
    log.info("warm start: %d steps in %.1fs, mean loss of the last %d: %.4f", steps, time.time() - t0, len(tail), loss)
    if on_done is not None and steps:
        on_done(steps, loss)
    return learner.full_params(state.params)  # LoRA: the base (unchanged) with the warm-started adapter


def lora_base(config) -> dict | None:
    """A LoRA run's base, by reference (its checkpoints hold only the adapter): the checkpoint it was read from, or
    the seed it was drawn from; None without an adapter. Kept in every checkpoint's meta (``lora_base``)."""
    if not config.model.lora.enabled:
        return None
    m = config.model
    if m.checkpoint_dir:
        return {"checkpoint_dir": m.checkpoint_dir, "checkpoint_layers": m.checkpoint_layers}
    return {"init_seed": config.seed}


def check_lora_base(config, meta: dict) -> None:
    """Raises ``ModelInputError`` (one line) when a LoRA checkpoint's adapter was trained on another base than the
    one this run builds (or one has an adapter and the other not): a resumed adapter over a different base is
    another model."""
    saved, now = meta.get("lora_base"), lora_base(config)
    if saved != now:
        raise ModelInputError(
            f"the checkpoint in {config.workdir} was saved with LoRA base {saved} but this config builds {now}: resume "
            "with the config that wrote it (config.model.checkpoint_dir / seed / model.lora.rank), or use a new workdir"
        )


def core_params(s: Setup, params: Any) -> Any:
    """``params`` from the training mesh onto the core cell. Across processes, one collective program
    (``publish_to_cells``: every process calls it; process 0 keeps cell 0's copy)."""
    if not s.multi_process:
        return params
    layouts = [CellLayout.of(cell, s.model_cfg, s.rules, s.config.serving.page_size) for cell in s.cells]
    core = runtime.publish_to_cells(params, [layout.param_shardings for layout in layouts])[0]
    group = lockstep.driving(s.cells[0])
    return core if group is None else group.adopt("core", core)  # its other processes adopt theirs (follower)


def core_learner(s: Setup, optimizer: Any, loss_cfg: LossConfig | None) -> Learner:
    """The core cell's learner (the optimizer state's owner). On a core over several processes its driver's is a
    ``runtime.lockstep.LockstepLearner`` (every device call on all of them); the others hold ``Learner``s built
    the same way (``follower.follow``)."""
    args = (s.model_cfg, s.graphdef, s.cells[0].mesh, s.rules, optimizer)
    group = lockstep.driving(s.cells[0])
    if group is None:
        return Learner(*args, loss_cfg=loss_cfg)
    return lockstep.LockstepLearner(group, *args, loss_cfg=loss_cfg)


def checkpointer(s: Setup, directory: Path, max_to_keep: int, at_start: bool = False) -> Checkpointer:
    """The checkpoints of the core's state under ``directory``: in a multi-process run the core's processes write
    them (process 0 alone when the core is its own; every process of a core over several, each its shards, its
    driver's a ``runtime.lockstep.LockstepCheckpointer``). ``at_start``: made before the collective start, where
    the core's other processes make theirs too (``core_checkpointer``); else by a lockstep call."""
    group = lockstep.driving(s.cells[0])
    if group is None:
        return Checkpointer(directory, max_to_keep, primary_only=s.multi_process)
    name = f"checkpointer/{Path(directory).name}"
    if not at_start:
        return lockstep.checkpointer(group, name, directory, max_to_keep, s.cells[0].processes)
    inner = core_checkpointer(s, directory, max_to_keep)
    group.register(name, inner)
    return lockstep.LockstepCheckpointer(group, inner, name)


def core_checkpointer(s: Setup, directory: Path, max_to_keep: int) -> Checkpointer:
    """This process's part of the checkpoints of a core over several processes (every one of them makes it at the
    same point of the start: orbax coordinates them)."""
    return Checkpointer(directory, max_to_keep, processes=s.cells[0].processes)


def copy_core(s: Setup, tree: Any) -> Any:
    """A copy of ``tree`` (on the core cell): on a core over several processes, on all of them."""
    group = lockstep.driving(s.cells[0])
    if group is None:
        return lockstep.copy_tree(tree)
    return group.call(None, "gyre_jax.runtime.lockstep:copy_tree", tree)


def abstract_params(s: Setup, shardings: Any) -> Any:
    """The model's params as ``ShapeDtypeStruct``s on ``shardings``."""
    shapes = abstract_model(s.model_cfg)[1]
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes, shardings)


def make_proxy(config, router, tokenizer, records, sampling: SamplingPolicy | None = None, routes=()) -> ProxyServer:
    """The proxy the config describes over ``router`` (not started): its address, limits, chat format and sampling
    (``sampling``: the config's ``proxy.sampling`` unless given; ``python -m gyre_jax.serve`` serves the client's);
    ``routes``: more routes on its server (the live view)."""
    p, r, t = config.proxy, config.rollout, config.tokenizer
    max_active_calls, max_queued_calls = p.admission_limits(r.max_parallel)
    return ProxyServer(
        router, tokenizer, records, model_name=p.model_name, host=p.host, port=p.port,
        allow_remote_bind=p.allow_remote_bind, max_request_bytes=p.max_request_bytes, seed=config.seed,
        default_max_tokens=r.max_tokens_per_call,
        max_tokens_cap=r.max_tokens_per_call, tools_format=chat_format.for_settings(tokenizer, t.chat_template, t.tools_format, t.tool_format),
        sampling=sampling or (SamplingPolicy.policy(r.temperature) if p.sampling == "policy" else SamplingPolicy.client()),
        max_active_calls=max_active_calls, max_queued_calls=max_queued_calls, routes=routes,
    )  # fmt: skip


def make_executor(config, proxy: ProxyServer, workdir, suite, multi_process: bool = False) -> Executor:
    """The executor (its executions under ``workdir/executions``): the config's harness preset, run in its sandbox, which hides the run directory (records,
    other executions) and the suite's directory (hidden tests, oracle solutions) from every harness. In a
    multi-process run a lost peer ends the process: the watchdog kills the harnesses first (its failure hook)."""
    r = config.rollout
    harness = r.harness_spec()
    hide = [workdir, *([suite.root] if isinstance(suite, HarborSuite) else [])]
    sandbox = make_sandbox(r.sandbox, proxy_address=(proxy.host, proxy.port), hide=hide, state_dir=workdir / "sandbox",
                           visible=r.sandbox_visible_paths)  # fmt: skip
    executor = Executor(
        proxy, proxy.base_url, workdir / "executions", model_name=config.proxy.model_name, timeout_s=r.timeout_s,
        max_parallel=r.max_parallel, temperature=r.temperature, max_tokens=r.max_tokens_per_call,
        evaluator_timeout_s=r.evaluator_timeout_s, harness_cmd=harness.cmd, extra_env=harness.env,
        harness_files=harness.files, sandbox=sandbox, max_workspace_bytes=(r.max_workspace_mb << 20) or None,
        exclude_suspect=r.exclude_suspect_rewards,
    )  # fmt: skip
    if multi_process:
        runtime.add_failure_hook(executor.cancel)
    return executor


def serving_cells(s: Setup, params: Any, version: int, warm: bool | None = None, on_cell=None) -> list[LocalCell]:
    """Every cell of this (single) process serving ``params`` at policy ``version``, with no training worker: the
    cells ``python -m gyre_jax.evaluate`` and ``serve`` route to (the run's own ``CellFactory`` loops; ``warm``: as
    ``CellFactory.loop``). ``on_cell(cell)`` is called as each one starts."""
    factory = CellFactory(s)
    cells = []
    for cell in s.cells:
        layout = factory.layout(cell)
        cell_params = transfer(params, layout.param_shardings, may_alias=False)
        cells.append(LocalCell(cell, layout, factory.loop(cell, cell_params, version, warm), None))
        if on_cell is not None:
            on_cell(cells[-1])
    return cells
