"""The learner: the core training cell's optimizer and its streaming optimizer step.

An optimizer step is the sum of the gradients of its micro-steps, then one AdamW update (with global
norm clipping and a learning-rate schedule). Micro-steps are claimed from a ``MicroStepQueue`` as their
packed micro-batches become ready, by the core cell and by any satellite cells (``GradWorker``-s on
other submeshes that pull a weight snapshot); their gradients are summed on the core's shardings by a
``GradAccumulator``. Weights stay fixed while a step's micro-steps are computed, and the ordered
accumulator adds gradients in slot order, so neither claim order nor who computed what changes the
result. Each micro-batch's loss already carries the step's normalization (``seq_weights``); a step
may also be given one more scalar (``grad_scale``, e.g. 1 / executions when that count is only known
at the end of a streamed step).

With a LoRA adapter (``model_cfg.lora``) the train state's params are the adapter alone and the optimizer state is
the adapter's; the frozen base is the core worker's (``Learner.base``), loaded once and never in the train state.

A step whose loss or gradients are not finite is skipped: parameters, optimizer state and the step
counter are left exactly as they were (a checkpoint saved after it is the previous one's state), a
log line says so, and ``Learner.skipped_steps`` counts it.

jit boundaries: ``GradWorker`` micro-steps (params/grads on param shardings, batch over ``batch`` rows);
``_apply`` (state and grads in with their shardings, state donated, out on the same shardings);
the accumulator's add (donated running sum).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.model.sharding import Rules
from gyre_jax.rl import losses
from gyre_jax.rl.accumulator import GradAccumulator
from gyre_jax.rl.micro_step import GradWorker, run_micro_steps, token_logprobs
from gyre_jax.rl.microstep_queue import MicroStepQueue, QueueAborted
from gyre_jax.rl.optimizer_config import SCHEDULES, OptimizerConfig
from gyre_jax.trajectory.batch import MicroBatch

__all__ = ["Learner", "OptimizerConfig", "TrainState", "make_optimizer", "token_logprobs", "count_tokens", "SCHEDULES"]

log = logging.getLogger("gyre_jax.learner")


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    params: nnx.State  # the trained params: the whole model, or (LoRA) the adapter
    opt_state: optax.OptState
    step: jax.Array  # [] int32: optimizer updates applied = the policy version these params define


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, cfg.decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(peak, end, cfg.decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if cfg.warmup_steps == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, cfg.warmup_steps), decay], [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    lr = learning_rate_schedule(cfg) if (cfg.warmup_steps > 0 or cfg.schedule != "constant") else cfg.learning_rate
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip_norm),
        optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


class Learner:
    """The core training cell: params + the only optimizer state, its own ``GradWorker``, and the step.

    ``loss_cfg`` is the objective (``losses.LossConfig``: a run config's ``loss_config()``; None = GSPO with
    its defaults). ``ordered_accumulation`` (default True) makes the summed gradients bit-identical for every
    claim order.
    """

    def __init__(
        self,
        model_cfg,
        graphdef: nnx.GraphDef,
        mesh: Mesh,
        rules: Rules,
        opt_cfg: OptimizerConfig,
        loss_cfg: losses.LossConfig | None = None,
        *,
        ordered_accumulation: bool = True,
        name: str = "core",
    ):
        self.worker = GradWorker(model_cfg, graphdef, mesh, rules, loss_cfg, name=name)  # the core's micro-steps
        self.model_cfg, self.graphdef, self.mesh, self.rules = model_cfg, graphdef, mesh, rules
        self.loss_cfg = self.worker.loss_cfg  # satellites (make_satellite) compute the same objective
        log.info("objective: %s", self.loss_cfg.describe())
        self.ordered_accumulation = ordered_accumulation
        self.tx = make_optimizer(opt_cfg)
        self.param_shardings = self.worker.param_shardings
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._build_jits()
        self.skipped_steps = 0  # optimizer steps skipped for non-finite loss/gradients, over this learner's life

    def _build_jits(self) -> None:
        """The train state's shardings and the jitted optimizer init and apply (state donated)."""
        self._abstract_params = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            self.worker.abstract_params,
            self.param_shardings,
        )
        self.opt_shardings = optax.tree_map_params(
            self.tx,
            lambda _, sh: sh,
            jax.eval_shape(self.tx.init, self._abstract_params),
            self.param_shardings,
            transform_non_params=lambda _: self._replicated,
        )
        self.state_shardings = TrainState(
            params=self.param_shardings, opt_state=self.opt_shardings, step=self._replicated
        )
        self._init_opt = jax.jit(self.tx.init, in_shardings=(self.param_shardings,), out_shardings=self.opt_shardings)
        r = self._replicated
        self._apply = jax.jit(
            self._apply_impl,
            donate_argnums=(0,),
            in_shardings=(self.state_shardings, self.param_shardings, r, r),
            out_shardings=(self.state_shardings, r),
        )

    # -- state ------------------------------------------------------------------------------------
    def init_state(self, params: nnx.State, step: int = 0) -> TrainState:
        """The train state at ``step`` from ``params``: a whole model state (LoRA: its base becomes this learner's
        frozen base, its adapter the trained params), or (LoRA, the base already set) an adapter."""
        params = jax.device_put(self.worker.trainable(params), self.param_shardings)
        opt_state = self._init_opt(params)
        # a host value, the same on every process: a device array of this process put onto a sharding spanning
        # processes gives an array whose one local buffer spans them all (orbax then fails to save it)
        return TrainState(params=params, opt_state=opt_state, step=jax.device_put(np.int32(step), self._replicated))

    @property
    def base(self) -> nnx.State | None:
        """LoRA: the frozen base weights on the core's mesh (None for full fine-tuning, or before they are set)."""
        return self.worker.base

    def set_base(self, params: nnx.State) -> None:
        """LoRA: the frozen base from a whole model state (its adapter part is ignored): e.g. on resume, where the
        checkpoint holds only the adapter and the base comes from where it came from before."""
        self.worker.set_base(params)

    def full_params(self, params: nnx.State) -> nnx.State:
        """The whole model state of trained ``params`` (LoRA: base + adapter, no copy; else ``params``)."""
        return self.worker.full_params(params)

    def abstract_params(self) -> nnx.State:
        """Shapes, dtypes and shardings of the trained params (the whole model, or the LoRA adapter)."""
        return self._abstract_params

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of a TrainState (the restore target for checkpoints)."""
        shapes = jax.eval_shape(lambda p: self.init_state(p), self._abstract_params)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

    def batch_shardings(self, mb: MicroBatch) -> MicroBatch:
        return self.worker.batch_shardings(mb)

    def put_batch(self, mb: MicroBatch) -> MicroBatch:
        return self.worker.put_batch(mb)

    def new_accumulator(self, num_slots: int) -> GradAccumulator:
        """A step's gradient sum of ``num_slots`` micro-steps on the core's shardings."""
        return GradAccumulator(self.param_shardings, num_slots, ordered=self.ordered_accumulation)

    def make_satellite(self, mesh: Mesh, name: str) -> GradWorker:
        """A ``GradWorker`` with this learner's objective on another (disjoint) mesh: a satellite cell (LoRA: its
        base is taken from the first whole model state it snapshots, or ``set_base``)."""
        return GradWorker(self.model_cfg, self.graphdef, mesh, self.rules, self.loss_cfg, name=name)

    # -- jitted apply -----------------------------------------------------------------------------
    def _apply_impl(self, state: TrainState, grads, loss, grad_scale):
        grads = jax.tree.map(lambda g: g * grad_scale, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss * grad_scale)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        new_state = TrainState(
            params=jax.tree.map(keep, params, state.params),
            opt_state=jax.tree.map(keep, opt_state, state.opt_state),
            step=state.step + finite.astype(jnp.int32),
        )
        return new_state, {"grad_norm": grad_norm, "skipped": 1 - finite.astype(jnp.int32)}

    # -- steps ------------------------------------------------------------------------------------
    def micro_step(self, params: nnx.State, mb: MicroBatch, kind: str = "rl", ref_params: nnx.State | None = None):
        """Gradients of one micro-batch's share of the step loss on the core mesh (params are not changed)."""
        return self.worker.micro_step(params, mb, kind, ref_params)

    def step(
        self,
        state: TrainState,
        micro_batches: list[MicroBatch],
        kind: str = "rl",
        *,
        ref_params: nnx.State | None = None,
        satellites: Sequence[GradWorker] = (),
        grad_scale: float = 1.0,
    ) -> tuple[TrainState, dict]:
        """One optimizer step over ``micro_batches`` (all known up front). Returns the new state and metrics.

        ``state`` is donated: use the returned one."""
        if not micro_batches:
            raise ValueError("an optimizer step needs at least one micro-batch")
        queue = MicroStepQueue(len(micro_batches))
        for mb in micro_batches:
            queue.put(mb)
        queue.close()
        return self.stream_step(state, queue, kind, ref_params=ref_params, satellites=satellites, grad_scale=grad_scale)

    def stream_step(
        self,
        state: TrainState,
        queue: MicroStepQueue,
        kind: str = "rl",
        *,
        ref_params: nnx.State | None = None,
        satellites: Sequence[GradWorker] = (),
        grad_scale: float = 1.0,
        timeout: float | None = None,
    ) -> tuple[TrainState, dict]:
        """One optimizer step whose micro-batches arrive in ``queue`` while it runs.

        The core claims micro-steps in this thread; each satellite in its own thread first pulls a snapshot
        of ``state.params`` (and ``ref_params``) onto its mesh, then claims. A satellite that fails gives its
        claim back and stops (logged, counted in ``worker_errors``); a failure on the core aborts the step
        and raises, leaving ``state`` untouched. ``timeout``: seconds any worker may wait for a micro-batch.
        """
        t0 = time.perf_counter()
        acc = self.new_accumulator(queue.num_micro_steps)
        errors: list[tuple[str, BaseException]] = []
        threads = []
        for sat in satellites:
            th = threading.Thread(
                target=self._satellite_loop,
                name=f"microsteps-{sat.name}",
                daemon=True,
                args=(sat, state.params, ref_params, queue, acc, kind, timeout, errors),
            )
            th.start()
            threads.append(th)
        try:
            run_micro_steps(self.worker, state.params, ref_params, queue, acc, kind, timeout=timeout)
            queue.wait()
        except BaseException as e:
            queue.abort(e)
            raise
        finally:
            for th in threads:
                th.join()
        return self.finish_step(
            state, queue, acc, kind, grad_scale=grad_scale, t0=t0, extra={"worker_errors": len(errors)}
        )

    def finish_step(
        self,
        state: TrainState,
        queue: MicroStepQueue,
        acc: GradAccumulator,
        kind: str = "rl",
        *,
        grad_scale: float = 1.0,
        t0: float | None = None,
        extra: dict | None = None,
    ) -> tuple[TrainState, dict]:
        """The optimizer step once ``queue`` is done: sums the accumulated gradients (empty slots marked),
        applies AdamW (or skips a non-finite step) and returns the new state and the step's metrics.

        Used by ``stream_step`` and by the elastic controller, whose training cells claim micro-steps
        themselves. ``state`` is donated: use the returned one."""
        t0 = time.perf_counter() if t0 is None else t0
        for i in queue.empty_slots():
            acc.mark_empty(i)
        grads, aux, num_micro = acc.result()
        t_grads = time.perf_counter() - t0
        loss = aux.get("loss", 0.0)
        state, applied = self._apply(state, grads, jnp.asarray(loss, jnp.float32), jnp.asarray(grad_scale, jnp.float32))
        applied = {k: float(v) for k, v in jax.device_get(applied).items()}
        metrics = self._finish_metrics(aux, kind, grad_scale)
        metrics.update(applied)
        metrics.update(
            micro_steps=num_micro,
            micro_steps_core=queue.completed_by.get(self.worker.name, 0),
            micro_steps_released=queue.released,
            grads_s=t_grads,
            learner_s=time.perf_counter() - t0,
            **(extra or {}),
        )
        if metrics["skipped"]:
            self.skipped_steps += 1
            what = "loss" if not math.isfinite(metrics["loss"]) else "gradients"
            log.error(
                "optimizer step skipped: non-finite %s (loss %s, grad norm %s); params, optimizer state and "
                "policy version %d unchanged (%d skipped so far)",
                what,
                metrics["loss"],
                metrics["grad_norm"],
                int(state.step),
                self.skipped_steps,
            )
        metrics["skipped_total"] = self.skipped_steps
        return state, metrics

    # -- internals --------------------------------------------------------------------------------
    def _satellite_loop(
        self,
        sat: GradWorker,
        core_params,
        ref_params,
        queue: MicroStepQueue,
        acc: GradAccumulator,
        kind: str,
        timeout: float | None,
        errors: list,
    ) -> None:
        try:
            if getattr(sat, "lora", False) and sat.base is None:
                sat.set_base(self.base)  # LoRA: the frozen base moves once per satellite, then only adapters
            params = sat.snapshot(core_params)
            ref = sat.snapshot(ref_params, slot="ref") if ref_params is not None and self.loss_cfg.kl_coef > 0 else None
            run_micro_steps(sat, params, ref, queue, acc, kind, timeout=timeout)
        except QueueAborted:
            pass  # the core failed and already raises
        except BaseException as e:  # noqa: BLE001 - a satellite failure must not take the step down
            errors.append((sat.name, e))
            log.error("satellite %s failed during a step (its micro-step goes back to the queue): %r", sat.name, e)

    @staticmethod
    def _finish_metrics(aux: dict[str, float], kind: str, grad_scale: float) -> dict:
        metrics = dict(aux)
        metrics["loss"] = metrics.get("loss", 0.0) * grad_scale
        if kind == "rl":
            metrics["policy_loss"] = metrics.get("policy_loss", 0.0) * grad_scale
            targets = metrics.pop("target_tokens", 0.0)
            masked = metrics.pop("masked_tokens", None)
            # the gap is summed over the trainable tokens the token mask keeps
            n = max(targets - (masked or 0.0), 1.0)
            metrics["logprob_gap"] = metrics.pop("logprob_gap_sum", 0.0) / n
            if masked is not None:  # the off-policy corrections are on (losses.rl_objective)
                metrics["is_masked_token_fraction"] = masked / max(targets, 1.0)
                metrics["is_masked_sequences"] = metrics.pop("masked_sequences", 0.0)
            w = max(metrics.pop("weight_sum", 0.0), 1e-12)
            metrics["clip_fraction"] = metrics.get("clip_fraction", 0.0) / w
            metrics["ratio_mean"] = metrics.get("ratio_mean", 0.0) / w
            if "kl" in metrics:
                metrics["kl"] = metrics["kl"] / w
        return metrics


def count_tokens(micro_batches: list[MicroBatch]) -> tuple[int, int]:
    """(tokens computed, trainable target tokens) over micro-batches."""
    return (sum(mb.num_tokens for mb in micro_batches), sum(int(np.sum(mb.loss_mask > 0)) for mb in micro_batches))
