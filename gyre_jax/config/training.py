"""Config sections of how a run learns: the ``rl`` objective, the ``trajectory`` pipeline, the ``optimizer``,
the supervised ``warm_start``, ``eval``, the cells' ``schedule`` and the ``metrics`` it writes.

Two bounds on staleness, in two sections: ``rl.drop_staleness`` (executions more policy versions behind
when their step trains are dropped) and ``schedule.dispatch_staleness`` (eta: executions start at most
this many versions ahead). Both were called ``max_staleness`` before; the old keys are refused with the
new name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gyre_jax.config.base import ConfigError, Section, coerce, require
from gyre_jax.rl.loss_config import HYPERPARAMETERS, LossConfig, LossConfigError, hyperparameters
from gyre_jax.rl.loss_config import LOSSES as LOSSES  # the losses' names, for gyre_jax.config (stated there once)
from gyre_jax.rl.optimizer_config import SCHEDULES, OptimizerConfig

PACKINGS = ("tree", "plain")  # gyre_jax.trajectory.pipeline.PACKING
STREAM_ORDERS = ("task", "arrival")  # gyre_jax.elastic.ledger.STREAM_ORDERS
AUXILIARY_POLICIES = ("lowest", "exclude")  # gyre_jax.trajectory.select.AUXILIARY_POLICIES
POLICIES = ("colocated", "async", "elastic")  # gyre_jax.elastic.policies.make_policy
LEAVE_RULES = ("waterlevel", "backlog")  # gyre_jax.elastic.policies.ElasticPolicy.LEAVE_RULES
ADMISSION_ORDERS = ("task", "longest_first")  # gyre_jax.elastic.policies.ADMISSION_ORDERS
EVAL_SPLITS = ("train", "heldout", "both")
ROUTING_REPLAY = ("off", "replay")  # rl.routing_replay
ROUTING_REPLAY_PROMPT = ("recompute", "replay")  # rl.routing_replay_prompt

DROP_BOUND = "the drop bound: executions more policy versions behind are dropped"
DISPATCH_BOUND = "the dispatch bound eta: executions may start at most this many policy versions ahead"


@dataclass(frozen=True)
class RLSection(Section):
    """The RL objective (docs/learner.md): GSPO by default. The loss's hyperparameters (``clip_low``,
    ``clip_high``) are None unless set: None is the chosen loss's own default (``gyre_jax.rl.loss_config``,
    docs/learner.md's loss table), so ``rl.loss=grpo`` trains with GRPO's clip range, not GSPO's. The loss
    settings are checked by ``LossConfig`` (one place), their errors named ``config.rl.<key>``."""

    _path = "rl"
    _renamed = {"max_staleness": ("drop_staleness", DROP_BOUND)}
    _removed = {
        "micro_batch_size": "micro-batches are config.trajectory.tokens_per_micro_batch tokens (it did nothing)"
    }
    # The loss settings' defaults are LossConfig's (gyre_jax/rl/loss_config.py), stated there once.
    loss: str = LossConfig.loss  # one of LOSSES: gspo | gspo_token | grpo
    group_size: int = 8  # G executions per task
    clip_low: float | None = None  # None: the chosen loss's default (docs/learner.md's loss table)
    clip_high: float | None = None  # None: the chosen loss's default
    max_branches: int = 5  # J_max
    kl_coef: float = (
        LossConfig.kl_coef
    )  # k3 KL to the reference (warm-start) policy; 0 = off, no reference forward pass
    recompute_behaviour: bool = (
        LossConfig.recompute_behaviour
    )  # False: pi_old = behaviour log-probs recorded by the proxy
    behaviour_is_cap: float = (
        LossConfig.behaviour_is_cap
    )  # with recompute_behaviour: truncated behaviour importance weight (0 = off)
    # train/serve mismatch masks on r_t = pi_train / mu (docs/learner.md), 0 = off, else a cap c > 1:
    is_token_mask: float = LossConfig.is_token_mask  # IcePop: drop trainable tokens with r_t outside [1/c, c]
    is_sequence_mask: float = (
        LossConfig.is_sequence_mask
    )  # MIS: drop sequences whose geometric-mean r_t is outside [1/c, c]
    drop_staleness: int = 4  # executions more policy versions behind when their step trains are dropped (-1: no bound)
    micro_steps_per_step: int = 0  # fixed micro-steps per optimizer step; 0 = as many as the step's data needs
    # MoE routing replay (R3, docs/learner.md): "replay" = serving records each generated token's experts per MoE
    # layer and the learner's forward uses them instead of its own top-k (gates recomputed from its router
    # logits); "off" = the learner routes every token itself. "replay" needs a MoE model.
    routing_replay: str = "off"
    # prompt tokens under routing_replay="replay": "recompute" (the learner routes them) | "replay" (the experts
    # serving's prefill selected; tokens whose KV serving reused from its session cache are still recomputed)
    routing_replay_prompt: str = "recompute"
    # stop the run (exit 3) after this many consecutive steps that train nothing because every execution was
    # excluded or the loss/gradients were not finite; 0 = never stop for it
    max_untrained_steps: int = 3

    def __post_init__(self):
        self.check_types()
        for name, hint in HYPERPARAMETERS.items():  # float | None: the type check of a value that is set
            if (value := getattr(self, name)) is not None:
                try:
                    object.__setattr__(self, name, coerce(self.key(name), value, hint))
                except ConfigError as e:
                    raise ConfigError(f"{e}, or unset (None: the loss's default)") from None
        self.loss_config()  # the loss settings' checks (LossConfig's), before any work
        r = self
        require(
            r.group_size >= 2,
            f"config.rl.group_size={r.group_size} must be >= 2 (advantages are normalized within a group)",
        )
        require(r.max_branches >= 1, f"config.rl.max_branches={r.max_branches} must be >= 1")
        require(
            r.routing_replay in ROUTING_REPLAY,
            f"config.rl.routing_replay={r.routing_replay!r} must be one of {ROUTING_REPLAY}",
        )
        require(
            r.routing_replay_prompt in ROUTING_REPLAY_PROMPT,
            f"config.rl.routing_replay_prompt={r.routing_replay_prompt!r} must be one of {ROUTING_REPLAY_PROMPT}",
        )
        require(
            r.drop_staleness >= -1,
            f"config.rl.drop_staleness={r.drop_staleness} must be >= 0 (or -1: no bound)",
        )
        require(
            r.max_untrained_steps >= 0,
            f"config.rl.max_untrained_steps={r.max_untrained_steps} must be >= 0 (0 turns the check off)",
        )
        require(
            r.micro_steps_per_step >= 0,
            f"config.rl.micro_steps_per_step={r.micro_steps_per_step} must be >= 0 (0 = as many as the data needs)",
        )

    def loss_config(self) -> LossConfig:
        """What a micro-step optimizes (``gyre_jax.rl.loss_config.LossConfig``): the loss with its defaults for
        the hyperparameters left unset; a bad setting is a one-line ``ConfigError`` naming ``config.rl.<key>``."""
        try:
            return LossConfig(
                loss=self.loss,
                params=hyperparameters(self.loss, **{name: getattr(self, name) for name in HYPERPARAMETERS}),
                kl_coef=self.kl_coef,
                recompute_behaviour=self.recompute_behaviour,
                behaviour_is_cap=self.behaviour_is_cap,
                is_token_mask=self.is_token_mask,
                is_sequence_mask=self.is_sequence_mask,
            )
        except LossConfigError as e:
            raise ConfigError(e.message(prefix=f"config.{self._path}.")) from None


@dataclass(frozen=True)
class TrajectorySection(Section):
    """The trajectory processor (docs/trajectory.md): records -> trees -> J_max branches -> packed rows."""

    _path = "trajectory"
    packing: str = "tree"  # tree: shared prefixes computed once (ancestor-only attention) | plain: a branch per row
    row_length: int = 0  # tokens per packed row; >= serving.max_seq_len so every branch fits a row (split
    # over model.context_parallel devices: each holds row_length / context_parallel of a row's tokens); 0: derived
    # from serving.max_seq_len (which derives from model.max_context)
    # rows per micro-batch = this / row_length (fixed shape: one compile); 0: derived, whole rows of >= 2048 tokens
    tokens_per_micro_batch: int = 0
    max_sequences_per_micro_batch: int = 64  # sequence slots per micro-batch (GSPO ratios, advantages, weights)
    open_micro_batches: int = 4  # micro-batches filled at once: more packs tighter, 1 streams each as soon as full
    stream_order: str = "task"  # groups enter the pipeline in task order (deterministic) | arrival (sooner)
    auxiliary: str = "lowest"  # harness utility calls (titles ...): lowest J_max priority | exclude: never trained

    def __post_init__(self):
        self.check_types()
        t = self
        require(t.packing in PACKINGS, f"config.trajectory.packing={t.packing!r} must be 'tree' or 'plain'")
        require(t.row_length >= 0, f"config.trajectory.row_length={t.row_length} must be >= 1 (or 0: derived)")
        require(
            t.tokens_per_micro_batch == 0
            or t.row_length == 0  # a derived row length: checked once it is set
            or (t.tokens_per_micro_batch >= t.row_length and t.tokens_per_micro_batch % t.row_length == 0),
            f"config.trajectory.tokens_per_micro_batch={t.tokens_per_micro_batch} must be a positive multiple of "
            f"trajectory.row_length={t.row_length} (micro-batches are rows x row_length tokens)",
        )
        for key in ("max_sequences_per_micro_batch", "open_micro_batches"):
            require(getattr(t, key) >= 1, f"config.trajectory.{key}={getattr(t, key)} must be >= 1")
        require(
            t.stream_order in STREAM_ORDERS,
            f"config.trajectory.stream_order={t.stream_order!r} must be one of {STREAM_ORDERS}",
        )
        require(
            t.auxiliary in AUXILIARY_POLICIES,
            f"config.trajectory.auxiliary={t.auxiliary!r} must be one of {AUXILIARY_POLICIES} (how J_max selection "
            "treats branches of harness-side utility calls)",
        )


@dataclass(frozen=True)
class OptimizerSection(OptimizerConfig, Section):
    """AdamW for RL: an ``OptimizerConfig`` (its other fields keep that class's defaults)."""

    _path = "optimizer"
    learning_rate: float = 3e-4
    warmup_steps: int = 10

    def __post_init__(self):
        self.check_types()
        o = self
        require(
            o.learning_rate > 0 and math.isfinite(o.learning_rate),
            f"config.optimizer.learning_rate={o.learning_rate} must be > 0",
        )
        require(o.warmup_steps >= 0, f"config.optimizer.warmup_steps={o.warmup_steps} must be >= 0")
        require(0 <= o.b1 < 1 and 0 <= o.b2 < 1, f"config.optimizer.b1={o.b1}, b2={o.b2} must be in [0, 1)")
        require(o.weight_decay >= 0, f"config.optimizer.weight_decay={o.weight_decay} must be >= 0")
        require(o.grad_clip_norm > 0, f"config.optimizer.grad_clip_norm={o.grad_clip_norm} must be > 0")
        require(o.schedule in SCHEDULES, f"config.optimizer.schedule={o.schedule!r} must be one of {SCHEDULES}")
        require(
            o.schedule == "constant" or o.decay_steps >= 1,
            f"config.optimizer.schedule={o.schedule!r} needs config.optimizer.decay_steps >= 1",
        )
        require(0 <= o.min_lr_ratio <= 1, f"config.optimizer.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
        OptimizerConfig.__post_init__(self)


@dataclass(frozen=True)
class WarmStartSection(Section):
    """Supervised warm start on the suite's built-in demonstrations, before RL step 0.

    Learning rate: linear warmup over ``warmup_steps``, then ``schedule`` (``constant``, or ``cosine`` /
    ``linear`` decay to ``learning_rate * min_lr_ratio`` at the last step): a decaying schedule makes the
    policy RL starts from less dependent on where the last steps happened to land.

    ``target_loss`` > 0 stops the warm start once the mean loss of its last 25 steps (fresh demonstrations
    each step: a held-out estimate) is at or below it, checked every 5 steps; ``steps`` is then the most it
    runs. Seeds reach the same loss after different numbers of steps (the tiny model's loss sits on a plateau
    near 0.03 until it learns to copy, after 330-500 steps depending on the seed), so a target makes every seed's
    RL start from a policy of the same quality."""

    _path = "warm_start"
    steps: int = 600  # with the target below, the cap (the tiny model's seeds reach it after 390-455 steps)
    batch_size: int = 8
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    target_loss: float = 0.015  # > 0: stop at this mean loss of the last 25 steps (steps is then the cap); 0: off

    def __post_init__(self):
        self.check_types()
        for key in ("steps", "warmup_steps"):
            require(getattr(self, key) >= 0, f"config.warm_start.{key}={getattr(self, key)} must be >= 0")
        require(self.batch_size >= 1, f"config.warm_start.batch_size={self.batch_size} must be >= 1")
        require(self.learning_rate > 0, f"config.warm_start.learning_rate={self.learning_rate} must be > 0")
        require(self.schedule in SCHEDULES, f"config.warm_start.schedule={self.schedule!r} must be one of {SCHEDULES}")
        require(0 <= self.min_lr_ratio <= 1, f"config.warm_start.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        require(
            self.target_loss >= 0 and math.isfinite(self.target_loss),
            f"config.warm_start.target_loss={self.target_loss} must be >= 0 (0: run all warm_start.steps)",
        )

    def optimizer(self, grad_clip_norm: float) -> OptimizerConfig:
        """The warm start's AdamW: the decay (if any) spans the steps after the warmup."""
        return OptimizerConfig(
            learning_rate=self.learning_rate,
            warmup_steps=self.warmup_steps,
            grad_clip_norm=grad_clip_norm,
            schedule=self.schedule,
            decay_steps=max(1, self.steps - self.warmup_steps),
            min_lr_ratio=self.min_lr_ratio,
        )


@dataclass(frozen=True)
class EvalSection(Section):
    """Evaluation before the first RL step, after the last, and every ``every_steps`` (0: only those two).

    Tasks (``split``): the training set, with rollout.num_tasks > 0 ("train"); held-out tasks, never trained on
    ("heldout": the builtin suite's own stream, or a harbor/jsonl suite's rollout.heldout_fraction); or both
    ("both", the default: one metrics line per split; a harbor/jsonl suite without a held-out split evaluates
    its training set only). ``RunConfig.eval_splits`` says which a config runs.
    """

    _path = "eval"
    split: str = "both"
    num_tasks: int = 256  # for the held-out split (x samples_per_task: 512 executions; docs/results.md says why)
    samples_per_task: int = 2  # 0 disables eval
    every_steps: int = 0

    def __post_init__(self):
        self.check_types()
        e = self
        require(e.split in EVAL_SPLITS, f"config.eval.split={e.split!r} must be one of {EVAL_SPLITS}")
        require(e.num_tasks >= 1, f"config.eval.num_tasks={e.num_tasks} must be >= 1")
        require(
            e.samples_per_task >= 0,
            f"config.eval.samples_per_task={e.samples_per_task} must be >= 0 (0 disables eval)",
        )
        require(e.every_steps >= 0, f"config.eval.every_steps={e.every_steps} must be >= 0")


@dataclass(frozen=True)
class ScheduleSection(Section):
    """Scheduling (docs/elastic.md): colocated (all cells serve, then all train) | async (a fixed split; cells
    0 .. training_cells-1 train) | elastic (cells leave serving as the rollout waterlevel falls, core first)."""

    _path = "schedule"
    _renamed = {"max_staleness": ("dispatch_staleness", DISPATCH_BOUND)}
    policy: str = "colocated"
    dispatch_staleness: int = 1  # async/elastic: executions start at most this many policy versions early (eta)
    training_cells: int = 0  # async: cells that train (0 = half)
    leave_on: str = "waterlevel"  # elastic: waterlevel (the published rule) | backlog (only with micro-steps waiting)
    idle_before_return_s: float = 0.0  # elastic: a training cell idle this long may return for ahead executions
    # partial rollouts (a step trains the first groups to complete; the others carry on across the weight update):
    # the simulator has them (docs/simulator.md); real runs: not supported yet, must stay False
    partial_rollouts: bool = False
    # the order a step's executions are dispatched in: task | longest_first (tasks predicted longest by their
    # duration history first, policies.DurationHistory: the controller's ledger and the simulator)
    admission: str = "task"
    # a group trains once this many of its members ended, the others aborted (0: the whole group): the simulator
    # has it (docs/simulator.md); real runs: not supported yet, must stay 0
    group_quorum: int = 0

    def __post_init__(self):
        self.check_types()
        s = self
        require(s.policy in POLICIES, f"config.schedule.policy={s.policy!r} must be one of {POLICIES}")
        require(
            s.dispatch_staleness >= 0,
            f"config.schedule.dispatch_staleness={s.dispatch_staleness} must be >= 0",
        )
        require(s.leave_on in LEAVE_RULES, f"config.schedule.leave_on={s.leave_on!r} must be one of {LEAVE_RULES}")
        require(
            s.idle_before_return_s >= 0,
            f"config.schedule.idle_before_return_s={s.idle_before_return_s} must be >= 0",
        )
        require(
            s.admission in ADMISSION_ORDERS,
            f"config.schedule.admission={s.admission!r} must be one of {ADMISSION_ORDERS}",
        )
        require(
            not s.partial_rollouts,
            "config.schedule.partial_rollouts=True: not supported yet in real runs (the controller's ledger trains "
            "each step's own batch); the simulator has them: python -m gyre_jax.sim --config.schedule.partial_rollouts=True",
        )
        require(
            s.group_quorum == 0,
            f"config.schedule.group_quorum={s.group_quorum}: not supported yet in real runs (the controller's ledger "
            "trains a group once all its executions ended); the simulator has it: "
            "python -m gyre_jax.sim --config.schedule.group_quorum=15",
        )

    def policy_options(self) -> dict:
        """Keyword options of ``gyre_jax.elastic.policies.make_policy`` for this policy."""
        if self.policy == "async":
            cells = {"training_cells": self.training_cells} if self.training_cells else {}
            return {"dispatch_staleness": self.dispatch_staleness, **cells}
        if self.policy == "elastic":
            return {
                "dispatch_staleness": self.dispatch_staleness,
                "leave_on": self.leave_on,
                "idle_before_return_s": self.idle_before_return_s,
            }
        return {}


@dataclass(frozen=True)
class MetricsSection(Section):
    _path = "metrics"
    tensorboard: bool = True
    progress_bar: bool = True

    def __post_init__(self):
        self.check_types()
