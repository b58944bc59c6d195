"""Gradient micro-steps on one mesh: the unit of work a training cell (core or satellite) performs.

A ``GradWorker`` owns the jitted ``params, micro-batch -> (grads, metrics)`` function for one mesh, with
explicit shardings: params in and grads out on the mesh's parameter shardings (from the logical-axis
rules), the micro-batch split over ``batch`` rows, metrics replicated. It holds no optimizer state:
the core cell's ``Learner`` owns that, and a satellite cell is just another ``GradWorker`` on its own
submesh that pulls a weight snapshot (``snapshot``: device-to-device ``jax.device_put``) at step start.

With a LoRA adapter (``model_cfg.lora``) the trained params are the adapter only (``model.lora.split``): the
worker holds the frozen base once (``set_base``; ``snapshot`` of a whole model state keeps its base part) and
differentiates the adapter alone, so gradients, their transfers and the accumulator are adapter-sized.

``run_micro_steps`` is the claim loop every training cell runs (the core and satellites in
``Learner.stream_step``, and each training cell of the elastic controller, wherever it lives): claim a
micro-step from the step's ``MicroStepQueue``, compute its gradients, add them to the accumulator,
complete it; a failure gives the claim back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.faultpoints import kill_point
from gyre_jax.model import lora
from gyre_jax.model.attention import tree_mask
from gyre_jax.model.logprobs import target_logprobs
from gyre_jax.model.ring import CONTEXT_AXIS, from_zigzag, spec_to_zigzag, to_zigzag, zigzag_permutation
from gyre_jax.model.sharding import Rules, abstract_model, logical_sharding, param_shardings
from gyre_jax.rl import losses
from gyre_jax.rl.accumulator import GradAccumulator
from gyre_jax.rl.microstep_queue import Claim, MicroStepQueue, QueueAborted
from gyre_jax.trajectory.batch import MicroBatch

KINDS = ("rl", "sft")


def _logprobs_and_aux(graphdef: nnx.GraphDef, params: nnx.State, mb: MicroBatch, with_aux: bool):
    """([B, T] log-probs of the targets, [] MoE load-balancing loss or None). A micro-batch with ``expert_ids``
    replays them in the MoE layers (routing replay, ``rl.routing_replay``).

    With ``context_parallel = n > 1`` the forward runs on the zigzag layout of each row (``ring.py``: tokens,
    positions, replayed experts and mask descriptors permuted, T split over the mesh's ``context`` axis, which
    must be set with ``jax.set_mesh``) and the log-probs are permuted back: the result is the single-device one."""
    model = nnx.merge(graphdef, params)
    n = model.cfg.context_parallel
    mask = tree_mask(model.cfg, mb.segment_ids, mb.subtree_end)  # [B, T, T] bool, or a MaskSpec (blockwise)
    replay = getattr(mb, "expert_ids", None)  # [B, T, L_moe, K] or None
    tokens, positions, targets, temperature = mb.tokens, mb.positions, mb.targets, mb.temperature
    if n > 1:
        perm = zigzag_permutation(tokens.shape[1], n)
        tokens, positions, targets, temperature = (
            _context_split(to_zigzag(a, perm)) for a in (tokens, positions, targets, temperature)
        )
        mask = spec_to_zigzag(mask, perm)
        replay = None if replay is None else to_zigzag(replay, perm)
    if with_aux:
        hidden, _, aux = model(tokens, positions, mask, return_aux=True, expert_ids=replay, head=False)
        lb = aux.load_balancing_loss
    else:
        (hidden, _), lb = model(tokens, positions, mask, expert_ids=replay, head=False), None
    logp = target_logprobs(model.linear_head(), hidden, targets, temperature, model.cfg.logits_chunk)
    return (from_zigzag(logp, perm) if n > 1 else logp), lb


def _context_split(x: jax.Array) -> jax.Array:
    """x: [B, T] -> the same, constrained to T over the current mesh's ``context`` axis (rows as they are),
    so every activation of the forward is split over the context shards, not only attention."""
    return jax.lax.with_sharding_constraint(x, PartitionSpec(PartitionSpec.UNCONSTRAINED, CONTEXT_AXIS))


def token_logprobs(graphdef: nnx.GraphDef, params: nnx.State, mb: MicroBatch) -> jax.Array:
    """log pi(targets | prefix) under temperature-scaled logits: [B, T] float32."""
    return _logprobs_and_aux(graphdef, params, mb, with_aux=False)[0]


class GradWorker:
    """Jitted gradient micro-steps for one mesh. ``micro_step`` never changes the params it is given."""

    def __init__(
        self,
        model_cfg,
        graphdef: nnx.GraphDef,
        mesh: Mesh,
        rules: Rules,
        loss_cfg: losses.LossConfig | None = None,
        name: str = "core",
    ):
        self.model_cfg = model_cfg
        self.graphdef = graphdef
        self.mesh = mesh
        self.rules = rules
        self.loss_cfg = loss_cfg or losses.LossConfig()
        self.name = name
        # MoE models add router_aux_loss_coef x the load-balancing loss, weighted by each micro-batch's share
        # of the step's loss weight (so micro-steps still sum to the step's objective).
        self.moe_coef = float(model_cfg.router_aux_loss_coef) if getattr(model_cfg, "is_moe", False) else 0.0
        cp = int(getattr(model_cfg, "context_parallel", 1))
        if cp > 1 and dict(mesh.shape).get(CONTEXT_AXIS, 1) != cp:
            raise ValueError(
                f"model.context_parallel={cp} needs the cell's mesh to have a {CONTEXT_AXIS!r} axis of {cp} devices; "
                f"mesh {name!r} has axes {dict(mesh.shape)} (sharding.make_mesh(devices, {{..., 'context': {cp}}}))"
            )
        _, abstract_params = abstract_model(model_cfg)
        shardings = param_shardings(abstract_params, rules, mesh)
        # The trained params' shardings (the whole model, or a LoRA adapter) and the frozen base's (LoRA only).
        self.lora = lora.enabled(model_cfg)
        self.param_shardings, self.base_shardings = lora.split(shardings) if self.lora else (shardings, None)
        self.abstract_params = lora.split(abstract_params)[0] if self.lora else abstract_params
        self.base: nnx.State | None = None  # LoRA: the frozen base weights on this mesh (``set_base``)
        self._trained_def = jax.tree.structure(self.param_shardings)  # what an adapter alone looks like
        self._trained_targets = jax.tree.leaves(self.param_shardings)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        # Batch shardings are stated by ``put_batch`` (their shapes vary per micro-batch); params are fixed.
        grads_out = (self.param_shardings, self.replicated)
        p, b = self.param_shardings, self.base_shardings
        self._rl_grads = jax.jit(self._rl_grads_impl, in_shardings=(p, b, None, None), out_shardings=grads_out)
        self._sft_grads = jax.jit(self._sft_grads_impl, in_shardings=(p, b, None), out_shardings=grads_out)
        # LoRA: a snapshot is the adapter packed as one array (``lora.Packed``: a satellite's switch moves one array);
        # these unpack it inside the program, and the gradients come out on the adapter's shardings as above.
        self._rl_grads_packed = jax.jit(
            self._rl_grads_impl, in_shardings=(None, b, None, None), out_shardings=grads_out
        )
        self._sft_grads_packed = jax.jit(self._sft_grads_impl, in_shardings=(None, b, None), out_shardings=grads_out)

    # -- placement ------------------------------------------------------------------------------
    def snapshot(self, params: nnx.State, slot: str = "params") -> nnx.State:
        """``params`` (from any mesh) on this worker's parameter shardings: a device-to-device copy, or the
        same arrays when they already live there. ``slot`` names what they are (``"params"``, ``"ref"``): a
        worker whose weights stay on another process keeps one of each. With a LoRA adapter ``params`` is the
        adapter (what moves), or a whole model state whose base this worker then keeps (``set_base``); the snapshot
        is then the adapter packed as one array (``lora.Packed``), which ``micro_step`` unpacks inside its program;
        an adapter already packed (``lora.publication``) only moves."""
        if not self.lora:
            return jax.device_put(lora.source_of(params), self.param_shardings)
        if isinstance(params, lora.Packed) and params.layout.treedef == self._trained_def:
            return params.to(self.replicated)  # packed once by the trainer for every receiver: one array moves
        leaves, treedef = jax.tree.flatten(lora.source_of(params))
        if treedef != self._trained_def:  # a whole model state: its base becomes this worker's
            leaves, treedef = jax.tree.flatten(self.trainable(params))
        packed = lora.pack_leaves(leaves, treedef)
        if packed is None:  # mixed dtypes or meshes: leaf by leaf
            return jax.tree.unflatten(treedef, lora.put_leaves(leaves, self._trained_targets))
        return packed.to(self.replicated)

    def trainable(self, params: nnx.State) -> nnx.State:
        """The part of ``params`` this worker trains: all of it, or (LoRA) the adapter, keeping the base part of a
        whole model state as this worker's frozen base (``set_base``)."""
        if not self.lora or jax.tree.structure(params) == self._trained_def:
            return params  # the whole model, or an adapter alone (the usual case)
        adapter, base = lora.split(params)
        if lora.num_leaves(base):
            self.set_base(base)
        return adapter

    def set_base(self, base: nnx.State) -> None:
        """LoRA: the frozen base weights (a model state's non-adapter part, or a whole state) onto this mesh, held
        once: arrays already on these shardings (the cell's serving weights) are shared, not copied."""
        base = lora.split(base)[1]
        self.base = jax.device_put(base, self.base_shardings, may_alias=True)

    def full_params(self, params: nnx.State) -> nnx.State:
        """The whole model state of trained ``params`` (LoRA: with this worker's base; no copy)."""
        return lora.combine(self._base(), params) if self.lora else params

    def _base(self) -> nnx.State:
        if self.base is None:
            raise RuntimeError(
                f"{self.name}: this worker trains a LoRA adapter but holds no base weights yet; give it a whole model "
                "state first (snapshot / set_base)"
            )
        return self.base

    def batch_shardings(self, mb: MicroBatch) -> MicroBatch:
        """Rows (dimension 0 of every array, ``[S]`` per-sequence arrays too) over the ``batch`` rule's axes."""

        def one(x):
            axes = ("batch",) + (None,) * (x.ndim - 1)
            return logical_sharding(axes, self.rules, self.mesh, x.shape)

        return jax.tree.map(one, mb)

    def put_batch(self, mb: MicroBatch) -> MicroBatch:
        """The micro-batch on this mesh. Fields the objective does not read (``versions``: staleness
        bookkeeping) stay on the host, so they neither travel nor change the jitted signature."""
        if getattr(mb, "versions", None) is not None:
            mb = dataclasses.replace(mb, versions=None)
        return jax.device_put(mb, self.batch_shardings(mb))

    # -- jitted bodies ----------------------------------------------------------------------------
    @staticmethod
    def _whole(params, base):
        """Inside the jitted bodies: the model state of the differentiated ``params`` (LoRA: with ``base``)."""
        return params if base is None else lora.combine(base, params)

    def _rl_grads_impl(self, params, base, mb: MicroBatch, ref_params):
        params, ref_params = lora.unpacked(params), lora.unpacked(ref_params)
        ref_logp = None
        if ref_params is not None:
            ref_logp = jax.lax.stop_gradient(token_logprobs(self.graphdef, self._whole(ref_params, base), mb))

        def loss_fn(p):
            logp, lb = _logprobs_and_aux(self.graphdef, self._whole(p, base), mb, with_aux=self.moe_coef > 0)
            x = losses.LossInputs.of(mb, logp, ref_logp)
            loss, aux = losses.rl_objective(x, self.loss_cfg)
            if lb is not None:
                share = jnp.sum(losses.token_weights(x)[1])
                loss, aux = self._add_load_balancing(loss, aux, lb, share)
            return loss, aux

        grads, aux = jax.grad(loss_fn, has_aux=True)(params)
        return grads, aux

    def _add_load_balancing(self, loss, aux, lb, share):
        term = self.moe_coef * lb * share
        return loss + term, dict(aux, loss=aux["loss"] + term, load_balancing_loss=lb * share)

    def _sft_grads_impl(self, params, base, mb: MicroBatch):
        params = lora.unpacked(params)

        def loss_fn(p):
            logp, lb = _logprobs_and_aux(self.graphdef, self._whole(p, base), mb, with_aux=self.moe_coef > 0)
            loss = losses.token_nll_loss(logp, mb.loss_mask)
            aux = {"loss": loss}
            if lb is not None:  # loss_mask holds the step-normalized token weights: their sum is this share
                loss, aux = self._add_load_balancing(loss, aux, lb, jnp.sum(mb.loss_mask))
            return loss, aux

        grads, aux = jax.grad(loss_fn, has_aux=True)(params)
        return grads, aux

    # -- the micro-step -------------------------------------------------------------------------
    def micro_step(self, params: nnx.State, mb: MicroBatch, kind: str = "rl", ref_params: nnx.State | None = None):
        """(grads on this mesh's param shardings, metrics dict of [] arrays) of one micro-batch's share of
        the step loss. ``params`` (and ``ref_params``) must already be on this mesh (see ``snapshot``); with a LoRA
        adapter they are adapters, and the gradients are the adapter's."""
        if kind not in KINDS:
            raise ValueError(f"micro-step kind {kind!r} must be one of {KINDS}")
        kill_point("micro_step")
        batch = self.put_batch(mb)
        cp = getattr(self.model_cfg, "context_parallel", 1) > 1
        with jax.set_mesh(self.mesh) if cp else contextlib.nullcontext():  # ring attention reads the mesh from it
            return self._grads(params, batch, kind, ref_params)

    def _grads(self, params: nnx.State, batch: MicroBatch, kind: str, ref_params: nnx.State | None):
        base = self._base() if self.lora else None
        packed = isinstance(params, lora.Packed)
        if kind == "sft":
            return (self._sft_grads_packed if packed else self._sft_grads)(params, base, batch)
        if self.loss_cfg.kl_coef > 0.0 and ref_params is None:
            raise ValueError(
                f"loss kl_coef={self.loss_cfg.kl_coef} > 0 needs ref_params (the reference policy's "
                "params on this mesh); pass ref_params= or set kl_coef=0"
            )
        if self.loss_cfg.kl_coef == 0.0:
            ref_params = None  # no reference forward pass when the KL term is off
        return (self._rl_grads_packed if packed else self._rl_grads)(params, base, batch, ref_params)


def micro_batch_flops(model_cfg: Any, mb: MicroBatch) -> float:
    """Model FLOPs (forward + backward) of a packed micro-batch: ``model_cfg.train_flops`` over its tokens and
    the causal pairs within each packed sequence (segment ids ``[B, T]``; a tree row counts as causal)."""
    seg = np.asarray(mb.segment_ids)
    pairs = 0.0
    for row in seg:
        _, counts = np.unique(row[row != 0], return_counts=True)
        pairs += float(np.sum(counts.astype(np.float64) ** 2)) / 2
    return model_cfg.train_flops(float(np.count_nonzero(seg)), pairs)


class MicroStepWorker(Protocol):
    """What the claim loop needs of a training cell: ``GradWorker`` here, or a cell on another process
    (``gyre_jax.runtime``), whose ``snapshot`` returns a handle to weights that stay on that process."""

    name: str

    def snapshot(self, params: Any, slot: str = "params") -> Any: ...

    def micro_step(self, params: Any, mb: MicroBatch, kind: str = "rl", ref_params: Any = None) -> tuple[Any, dict]: ...


def run_micro_steps(
    worker: MicroStepWorker,
    params: Any,
    ref_params: Any,
    queue: MicroStepQueue,
    acc: GradAccumulator,
    kind: str = "rl",
    *,
    timeout: float | None = None,
    active: Callable[[], bool] | None = None,
    on_done: Callable[[Claim, float, float], None] | None = None,
) -> int:
    """Claims, computes and completes ``queue``'s micro-steps with ``worker`` until the step is done; returns
    how many it completed. ``params`` / ``ref_params`` are on the worker's layout (its ``snapshot``).

    ``active``: checked before each claim; the loop returns as soon as it is false (a cell leaving training
    finishes its micro-step in progress, then stops), and a claim then waits at most ``timeout`` seconds
    before checking again. Without it, a claim that waits ``timeout`` seconds raises ``TimeoutError``.
    ``on_done(claim, t_start, t_end)`` (wall-clock seconds) follows each completed micro-step; when given,
    the gradients are waited for, so the times cover the work and not only its dispatch. A micro-step that
    fails is released (another worker takes it) and the error propagates."""
    done = 0
    while active is None or active():
        try:
            claim = queue.claim(worker.name, timeout)
        except TimeoutError:
            if active is None:
                raise
            continue
        if claim is None:
            break
        t_start = time.time()
        try:
            grads, aux = worker.micro_step(params, claim.batch, kind, ref_params)
            if on_done is not None:
                jax.block_until_ready(grads)
            acc.add(claim.index, grads, aux)
        except BaseException:
            try:
                queue.release(claim)
            except (QueueAborted, ValueError):
                pass
            raise
        queue.complete(claim)
        done += 1
        if on_done is not None:
            on_done(claim, t_start, time.time())
    return done
