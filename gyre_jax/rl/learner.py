"""The learner: jitted gradient micro-steps and optimizer steps on a training mesh.

An optimizer step is the sum of gradients of its micro-batches (each micro-batch's loss already
carries the step's global normalization), then one AdamW update. Weights stay fixed while the
micro-steps of a step are computed, so their order does not change the result. A step whose
gradients are not finite is skipped (parameters and optimizer state unchanged) and reported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.model.sharding import Rules, abstract_model, logical_sharding, param_shardings
from gyre_jax.rl import losses
from gyre_jax.trajectory.batch import MicroBatch, attention_mask


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array  # [] int32: optimizer updates applied = the policy version these params define


@dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float
    warmup_steps: int = 0
    b1: float = 0.9
    b2: float = 0.99
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0

    @classmethod
    def from_config_dict(cls, c) -> "OptimizerConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(c).items() if k in names})


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    if cfg.warmup_steps > 0:
        lr = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
    else:
        lr = cfg.learning_rate
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip_norm),
        optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


def token_logprobs(graphdef: nnx.GraphDef, params: nnx.State, mb: MicroBatch) -> jax.Array:
    """log pi(targets | prefix) under temperature-scaled logits: [B, T] float32."""
    model = nnx.merge(graphdef, params)
    logits, _ = model(mb.tokens, mb.positions, attention_mask(mb.segment_ids, mb.subtree_end))
    logits = logits / mb.temperature[..., None]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, mb.targets[..., None], axis=-1)[..., 0]


class Learner:
    """Owns the optimizer and the jitted micro-step / apply functions for one training mesh."""

    def __init__(self, model_cfg, graphdef: nnx.GraphDef, mesh: Mesh, rules: Rules, opt_cfg: OptimizerConfig,
                 clip_low: float = 3e-4, clip_high: float = 4e-4):
        self.model_cfg = model_cfg
        self.graphdef = graphdef
        self.mesh = mesh
        self.rules = rules
        self.tx = make_optimizer(opt_cfg)
        self.clip_low, self.clip_high = clip_low, clip_high
        _, abstract_params = abstract_model(model_cfg)
        self.param_shardings = param_shardings(abstract_params, rules, mesh)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._abstract_params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                             abstract_params, self.param_shardings)
        self.opt_shardings = optax.tree_map_params(
            self.tx, lambda _, sh: sh, jax.eval_shape(self.tx.init, self._abstract_params), self.param_shardings,
            transform_non_params=lambda _: self._replicated)
        self._init_opt = jax.jit(self.tx.init, out_shardings=self.opt_shardings)
        self._rl_grads = jax.jit(self._rl_grads_impl, out_shardings=(self.param_shardings, self._replicated))
        self._sft_grads = jax.jit(self._sft_grads_impl, out_shardings=(self.param_shardings, self._replicated))
        self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=(0,), out_shardings=self.param_shardings)
        self._apply = jax.jit(self._apply_impl, donate_argnums=(0, 1))

    # -- state ------------------------------------------------------------------------------------
    def init_state(self, params: nnx.State, step: int = 0) -> TrainState:
        params = jax.device_put(params, self.param_shardings)
        opt_state = self._init_opt(params)
        return TrainState(params=params, opt_state=opt_state,
                          step=jax.device_put(jnp.asarray(step, jnp.int32), self._replicated))

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of a TrainState (the restore target for checkpoints)."""
        shapes = jax.eval_shape(lambda p: self.init_state(p), self._abstract_params)
        shardings = TrainState(params=self.param_shardings, opt_state=self.opt_shardings, step=self._replicated)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)

    def batch_shardings(self, mb: MicroBatch) -> MicroBatch:
        def one(x):
            axes = ("batch",) + (None,) * (x.ndim - 1)
            return logical_sharding(axes, self.rules, self.mesh, x.shape)

        return jax.tree.map(one, mb)

    def put_batch(self, mb: MicroBatch) -> MicroBatch:
        return jax.device_put(mb, self.batch_shardings(mb))

    # -- jitted bodies ----------------------------------------------------------------------------
    def _rl_grads_impl(self, params, mb: MicroBatch):
        def loss_fn(p):
            logp = token_logprobs(self.graphdef, p, mb)
            loss, aux = losses.gspo_loss(logp, mb.old_logprobs, mb.loss_mask, mb.seq_index, mb.advantages,
                                         mb.seq_weights, self.clip_low, self.clip_high)
            gap = jnp.sum(jnp.abs(jax.lax.stop_gradient(logp) - mb.old_logprobs) * mb.loss_mask)
            aux = dict(aux, logprob_gap_sum=gap, target_tokens=jnp.sum(mb.loss_mask), loss=loss)
            return loss, aux

        grads, aux = jax.grad(loss_fn, has_aux=True)(params)
        return grads, aux

    def _sft_grads_impl(self, params, mb: MicroBatch):
        def loss_fn(p):
            loss = losses.token_nll_loss(token_logprobs(self.graphdef, p, mb), mb.loss_mask)
            return loss, {"loss": loss}

        grads, aux = jax.grad(loss_fn, has_aux=True)(params)
        return grads, aux

    def _apply_impl(self, state: TrainState, grads):
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
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
    def micro_step(self, params: nnx.State, mb: MicroBatch, kind: str = "rl"):
        """Gradients of one micro-batch's share of the step loss (params are not changed)."""
        fn = self._rl_grads if kind == "rl" else self._sft_grads
        return fn(params, self.put_batch(mb))

    def step(self, state: TrainState, micro_batches: list[MicroBatch], kind: str = "rl") -> tuple[TrainState, dict]:
        """One optimizer step over ``micro_batches`` (summed gradients). Returns the new state and metrics."""
        if not micro_batches:
            raise ValueError("an optimizer step needs at least one micro-batch")
        total = None
        aux_sum: dict[str, float] = {}
        for mb in micro_batches:
            grads, aux = self.micro_step(state.params, mb, kind)
            total = grads if total is None else self._add(total, grads)
            for k, v in jax.device_get(aux).items():
                aux_sum[k] = aux_sum.get(k, 0.0) + float(v)
        state, apply_metrics = self._apply(state, total)
        metrics = dict(aux_sum)
        metrics.update({k: float(v) for k, v in jax.device_get(apply_metrics).items()})
        if kind == "rl":
            n = max(metrics.pop("target_tokens", 0.0), 1.0)
            metrics["logprob_gap"] = metrics.pop("logprob_gap_sum", 0.0) / n
            w = max(metrics.pop("weight_sum", 0.0), 1e-12)
            metrics["clip_fraction"] = metrics.get("clip_fraction", 0.0) / w
            metrics["ratio_mean"] = metrics.get("ratio_mean", 0.0) / w
        return state, metrics


def count_tokens(micro_batches: list[MicroBatch]) -> tuple[int, int]:
    """(tokens computed, trainable target tokens) over micro-batches."""
    return (sum(mb.num_tokens for mb in micro_batches), sum(int(np.sum(mb.loss_mask > 0)) for mb in micro_batches))
