"""``RunConfig``: everything a run does, as a tree of frozen sections built once from the ConfigDict.

Attribute paths are the config keys (``cfg.rl.group_size``, ``cfg.serving.max_seq_len``). Field defaults
are the defaults of every config (``default_config()``; ``configs/tiny_cpu.py`` is them but ``serving.warmup``);
each section checks its own values when it is built, and ``validate`` checks how the sections fit together.
Building a config reads no file and starts nothing: the run's builder loads what it names (``build.make_suite``). The configs of the run's
components (``ModelConfig``, ``LossConfig``, ``TrajectoryConfig``, ``ControllerConfig``) are derived
here, each by one method.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ml_collections import config_dict

from gyre_jax.config.base import ConfigError, Section, require
from gyre_jax.config.cluster import AXES, CellsSection, DevicesSection, DistributedSection, MeshSection
from gyre_jax.config.rollout import ModelSection, ProxySection, RolloutSection, ServingSection, TokenizerSection
from gyre_jax.config.training import (
    EvalSection,
    MetricsSection,
    OptimizerSection,
    RLSection,
    ScheduleSection,
    TrajectorySection,
    WarmStartSection,
)
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.rules import RULES_FSDP_TENSOR

if TYPE_CHECKING:  # the components' modules import JAX: the derivations import them when called
    from gyre_jax.elastic.controller import ControllerConfig
    from gyre_jax.rl.loss_config import LossConfig
    from gyre_jax.trajectory.pipeline import TrajectoryConfig

MIN_MICRO_BATCH_TOKENS = 2048  # a derived trajectory.tokens_per_micro_batch: whole rows, at least this many tokens
# Logical axis -> mesh axes (MaxText style). Changing parallelism never touches model code.
SHARDING_RULES = RULES_FSDP_TENSOR


def _sharding_rules(rules: Any) -> tuple:
    """``rules`` as a tuple of ``(logical_axis, None | mesh_axis | (mesh_axes ...))`` pairs, checked."""
    require(
        isinstance(rules, (tuple, list)) and all(isinstance(r, (tuple, list)) and len(r) == 2 for r in rules),
        "config.sharding_rules must be a sequence of (logical_axis, mesh_axes) pairs",
    )
    out = []
    for logical, mesh_axes in rules:
        targets = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
        for t in targets:
            require(
                t in AXES, f"config.sharding_rules: {logical!r} maps to unknown mesh axis {t!r}; mesh axes are {AXES}"
            )
        require(
            len(set(targets)) == len(targets), f"config.sharding_rules: {logical!r} names a mesh axis twice: {targets}"
        )
        out.append((logical, mesh_axes if mesh_axes is None or isinstance(mesh_axes, str) else targets))
    return tuple(out)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


@dataclass(frozen=True)
class RunConfig(Section):
    """One run: its seed, run directory and length, then one section per part of the system."""

    seed: int = 0
    workdir: str = "runs/tiny_cpu"
    total_steps: int = 40
    checkpoint_every: int = 5  # steps; the last step and an interrupted run always save
    keep_checkpoints: int = 2
    devices: DevicesSection = field(default_factory=DevicesSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    cells: CellsSection = field(default_factory=CellsSection)
    sharding_rules: tuple = SHARDING_RULES  # (logical axis, mesh axes) pairs, MaxText style
    model: ModelSection = field(default_factory=ModelSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    serving: ServingSection = field(default_factory=ServingSection)
    proxy: ProxySection = field(default_factory=ProxySection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    rl: RLSection = field(default_factory=RLSection)
    trajectory: TrajectorySection = field(default_factory=TrajectorySection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    warm_start: WarmStartSection = field(default_factory=WarmStartSection)
    eval: EvalSection = field(default_factory=EvalSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)

    def __post_init__(self):
        self.check_types()
        object.__setattr__(self, "sharding_rules", _sharding_rules(self.sharding_rules))
        object.__setattr__(self, "_as_written", self.as_tree())  # before derive_context: what to_config_dict gives
        self.derive_context()
        require(self.total_steps >= 0, f"config.total_steps={self.total_steps} must be >= 0")
        require(self.checkpoint_every >= 1, f"config.checkpoint_every={self.checkpoint_every} must be >= 1")
        require(self.keep_checkpoints >= 1, f"config.keep_checkpoints={self.keep_checkpoints} must be >= 1")
        require(bool(self.workdir), "config.workdir must be a non-empty path")
        validate(self)

    def derive_context(self) -> None:
        """Fills the keys left to derive (0, or "auto") from ``model.max_context``, once, at construction:
        ``serving.max_seq_len`` = ``model.max_context``; ``trajectory.row_length`` = ``serving.max_seq_len`` (a
        branch fills a row); ``trajectory.tokens_per_micro_batch`` = whole rows of at least ``MIN_MICRO_BATCH_TOKENS``
        tokens; ``model.attention_impl`` = "blockwise" when the rows are longer than ``DENSE_ATTENTION_MAX`` tokens (or
        with context parallelism), else "xla". A key set in the config keeps its value (and is checked against the
        others by ``validate``)."""
        m, sv, t = self.model, self.serving, self.trajectory
        seq = sv.max_seq_len or m.max_context
        row = t.row_length or seq
        tokens = t.tokens_per_micro_batch or row * max(1, -(-MIN_MICRO_BATCH_TOKENS // row))
        try:
            serving = dataclasses.replace(sv, max_seq_len=seq) if seq != sv.max_seq_len else sv
        except ConfigError as exc:
            raise ConfigError(
                f"config.model.max_context={m.max_context} (serving.max_seq_len derives from it): {exc}"
            ) from None
        trajectory = t
        if (row, tokens) != (t.row_length, t.tokens_per_micro_batch):
            trajectory = dataclasses.replace(t, row_length=row, tokens_per_micro_batch=tokens)
        model = dataclasses.replace(m, attention_impl=m.derived_attention(row)) if m.attention_impl == "auto" else m
        object.__setattr__(self, "serving", serving)
        object.__setattr__(self, "trajectory", trajectory)
        object.__setattr__(self, "model", model)

    # -- conversions ---------------------------------------------------------------------------------------
    @classmethod
    def from_config_dict(cls, config: config_dict.ConfigDict | Mapping[str, Any]) -> RunConfig:
        """The typed config of a ConfigDict (or a nested dict, e.g. a run's config.json); validated."""
        values = config.to_dict() if isinstance(config, config_dict.ConfigDict) else dict(config)
        return cls.from_dict(values)

    def to_config_dict(self) -> config_dict.ConfigDict:
        """The ConfigDict of this config as written, derived keys still to derive (0 / "auto"): the form config files
        and ``--config.a.b=value`` overrides edit, so a new ``model.max_context`` reaches the keys it derives."""
        return config_dict.ConfigDict(copy.deepcopy(self.__dict__["_as_written"]))

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-serializable dict (tuples become lists) with every derived key's value: the run's
        ``config.json`` (read back, it is the same config)."""
        return _jsonable(self.as_tree())

    # -- what the components get ---------------------------------------------------------------------------
    def model_config(self) -> ModelConfig:
        """The architecture (``ModelConfig``): ``config.model`` without ``checkpoint_dir``."""
        return ModelConfig(**{name: getattr(self.model, name) for name in ModelConfig.__dataclass_fields__})

    def loss_config(self) -> LossConfig:
        """What a micro-step optimizes (``gyre_jax.rl.loss_config.LossConfig``), from ``config.rl``."""
        return self.rl.loss_config()

    def trajectory_config(self, message_end_id: int | None = None) -> TrajectoryConfig:
        """The pipeline's ``TrajectoryConfig``: ``rl.max_branches``, ``trajectory.*``, ``seed``, ``model.vocab_size``.

        ``message_end_id``: the chat template's ``<|im_end|>`` id, only for records whose threads mix agents
        (``branches.py``); by default None: the proxy names one thread per agent, and labels follow thread ids.
        """
        from gyre_jax.trajectory.pipeline import TrajectoryConfig

        t = self.trajectory
        return TrajectoryConfig(
            max_branches=self.rl.max_branches,
            packing=t.packing,
            row_length=t.row_length,
            rows=t.tokens_per_micro_batch // t.row_length,
            max_sequences=t.max_sequences_per_micro_batch,
            open_micro_batches=t.open_micro_batches,
            seed=self.seed,
            message_end_id=message_end_id,
            vocab_size=self.model.vocab_size,
            auxiliary=t.auxiliary,
        )

    def controller_config(self) -> ControllerConfig:
        """The elastic controller's ``ControllerConfig``: the step's shape, slots per serving cell, micro-step slots."""
        from gyre_jax.elastic.controller import ControllerConfig

        return ControllerConfig(
            tasks_per_step=self.rollout.tasks_per_step,
            group_size=self.rl.group_size,
            sessions_per_cell=self.cells.sessions_per_cell or self.serving.max_concurrent_decodes,
            max_branches=self.rl.max_branches,
            micro_steps_per_step=self.rl.micro_steps_per_step,
        )

    def eval_splits(self) -> tuple[str, ...]:
        """The task sets each evaluation scores, in order: ``eval.split``, with "both" = ("train", "heldout"), or
        ("train",) for a harbor/jsonl suite without a held-out split (rollout.heldout_fraction = 0)."""
        split = self.eval.split
        if split != "both":
            return (split,)
        has_heldout = self.rollout.suite == "builtin" or self.rollout.heldout_fraction > 0
        return ("train", "heldout") if has_heldout else ("train",)

    @property
    def drop_bound(self) -> int | None:
        """``rl.drop_staleness`` as the ledger takes it: None for no bound (-1)."""
        return None if self.rl.drop_staleness < 0 else self.rl.drop_staleness


RENAMED_KEYS = RunConfig.renamed_keys()  # {"rl.max_staleness": ("rl.drop_staleness", meaning), ...}
RETIRED_KEYS = RunConfig.retired_keys()  # renamed and removed keys: {old key: the one-line error refusing it}


def default_config() -> config_dict.ConfigDict:
    """The defaults of every key as a ConfigDict (``configs/tiny_cpu.py`` returns it with ``serving.warmup`` off;
    the accelerator presets start from it)."""
    return RunConfig().to_config_dict()


def device_count(config: RunConfig) -> int:
    return config.mesh.num_devices


def policy_options(config: RunConfig) -> dict:
    """Keyword options for ``make_policy`` from ``config.schedule``."""
    return config.schedule.policy_options()


def resolve_workdir(config: RunConfig) -> Path:
    return Path(os.path.expanduser(config.workdir)).resolve()


# -- how the sections fit together ---------------------------------------------------------------------------
def validate(config: RunConfig) -> None:
    """Checks the rules that span sections (each section checked its own values when it was built)."""
    checks = (_devices_fit, _model_fits_cells, _tokenizer_fits_model, _lengths_fit, _context_fits, _schedule_fits)
    for check in checks + (_processes_fit, _lora_fits):
        check(config)
    _long_fits(config)
    _suite_fits(config)
    if not config.model.checkpoint_dir:  # a checkpoint's architecture is checked when build.setup reads it
        check_routing_replay(config.rl.routing_replay, config.model.num_experts)
    require(
        config.serving.kv_layout == "dense" or config.rl.routing_replay == "off",
        "not supported yet: config.rl.routing_replay='replay' with config.serving.kv_layout='paged' (the paged engine "
        "does not record experts); use serving.kv_layout='dense' for routing replay",
    )


def check_routing_replay(routing_replay: str, num_experts: int) -> None:
    """``rl.routing_replay = "replay"`` needs a MoE model (``num_experts > 0``): a dense model has no routing."""
    require(
        routing_replay == "off" or num_experts > 0,
        f"config.rl.routing_replay={routing_replay!r} needs a MoE model, but the model is dense (num_experts=0): "
        "set config.rl.routing_replay='off' or use a MoE model (config.model.num_experts > 0)",
    )


def _suite_fits(c: RunConfig) -> None:
    """Evaluation splits and warm start against the suite: a loaded suite is its own training set, and has a
    held-out split only with rollout.heldout_fraction > 0; only the builtin suite has demonstrations."""
    builtin = c.rollout.suite == "builtin"
    if builtin:
        require(
            c.eval.split == "heldout" or c.rollout.num_tasks > 0,
            f"config.eval.split={c.eval.split!r} evaluates the training set, which needs a fixed one "
            "(config.rollout.num_tasks > 0); use eval.split=heldout",
        )
        return
    require(
        c.eval.split != "heldout" or c.rollout.heldout_fraction > 0 or c.eval.samples_per_task == 0,
        f"config.eval.split='heldout' with config.rollout.suite={c.rollout.suite!r} needs a held-out split: set "
        "config.rollout.heldout_fraction (e.g. 0.25)",
    )
    require(
        c.warm_start.steps == 0,
        f"not supported yet: warm-start demonstrations exist only for the builtin suite; set "
        f"config.warm_start.steps=0 with config.rollout.suite={c.rollout.suite!r}",
    )


def _devices_fit(c: RunConfig) -> None:
    n = c.mesh.num_devices
    if c.devices.platform == "cpu":
        require(
            n == c.devices.num_cpu_devices,
            f"config.mesh data*fsdp*tensor*expert = {n} must equal config.devices.num_cpu_devices={c.devices.num_cpu_devices}",
        )
    k = c.cells.num_cells
    require(n % k == 0, f"config.cells.num_cells={k} must divide the {n} devices of the mesh")
    require(
        c.cells.num_devices == n // k,
        f"config.cells data*fsdp*tensor*expert = {c.cells.num_devices} must equal the {n // k} devices of each "
        f"of the {k} cells",
    )


def _model_fits_cells(c: RunConfig) -> None:
    """A random-init model's dims must split over a cell's mesh (a checkpoint's are checked when it loads)."""
    m, ct, cf, ce = c.model, c.cells.tensor, c.cells.fsdp, c.cells.expert
    if m.checkpoint_dir:
        return
    for key in ("num_heads", "num_kv_heads", "mlp_dim"):
        require(
            getattr(m, key) % ct == 0,
            f"config.model.{key}={getattr(m, key)} does not split over config.cells.tensor={ct}: a "
            f"tensor group cannot fit a cell; pick a cells.tensor that divides it",
        )
    require(m.embed_dim % cf == 0, f"config.model.embed_dim={m.embed_dim} does not split over config.cells.fsdp={cf}")
    require(
        m.num_experts % ce == 0,
        f"config.model.num_experts={m.num_experts} does not split over config.cells.expert={ce}",
    )


def _tokenizer_fits_model(c: RunConfig) -> None:
    from gyre_jax.model.tokenizer import ByteTokenizer

    real = ByteTokenizer().num_real_tokens
    require(
        c.tokenizer.kind != "byte" or c.model.vocab_size >= real,
        f"config.model.vocab_size={c.model.vocab_size} must be >= {real} for the byte tokenizer",
    )
    if c.model.checkpoint_dir:
        require(
            c.tokenizer.kind in ("hf", "gguf"),
            "config.model.checkpoint_dir is set: set config.tokenizer.kind='hf' (its tokenizer.json) or 'gguf' (a GGUF "
            "file's own tokenizer) so the checkpoint's tokenizer is used",
        )
    else:
        require(
            c.tokenizer.kind == "byte" or bool(c.tokenizer.path),
            f"config.tokenizer.kind={c.tokenizer.kind!r} needs config.model.checkpoint_dir "
            f"(the directory with tokenizer.json) or config.tokenizer.path; without one use 'byte'",
        )


def _lengths_fit(c: RunConfig) -> None:
    n = c.serving.max_seq_len
    require(
        c.rollout.max_tokens_per_call < n,
        f"config.rollout.max_tokens_per_call={c.rollout.max_tokens_per_call} must be in [1, serving.max_seq_len={n})",
    )
    require(
        c.trajectory.row_length >= n,
        f"config.trajectory.row_length={c.trajectory.row_length} must be >= serving.max_seq_len={n} (a branch "
        f"can be that long and must fit one row)",
    )


def _long_fits(c: RunConfig) -> None:
    """A ``longlog`` conversation compacts before ``rollout.long_compact_tokens``: a call up to there plus its
    answer must fit a serving slot, and the kind has no warm-start demonstrations."""
    r = c.rollout
    if "longlog" not in r.task_kinds:
        return
    need = r.long_compact_tokens + 5 * (r.max_tokens_per_call + 128)
    require(
        c.serving.max_seq_len >= need,
        f"config.serving.max_seq_len={c.serving.max_seq_len} must be >= rollout.long_compact_tokens + 5 x "
        f"(rollout.max_tokens_per_call + 128) = {need} (a longlog conversation grows to long_compact_tokens, then "
        "asks for its summary, up to 5 times); raise it (and trajectory.row_length) or lower long_compact_tokens",
    )
    require(
        c.warm_start.steps == 0,
        f"config.warm_start.steps={c.warm_start.steps}: the longlog kind has no demonstrations; set it to 0",
    )


def _context_fits(c: RunConfig) -> None:
    """``model.context_parallel`` shards each training row over a ``context`` axis carved out of ``data``."""
    n = c.model.context_parallel
    if n == 1:
        return
    for section in ("mesh", "cells"):
        data = getattr(c, section).data
        require(
            data % n == 0,
            f"config.model.context_parallel={n} must divide config.{section}.data={data} (the context axis is "
            f"carved out of the data axis: each group of {n} devices trains one row)",
        )
    row = c.trajectory.row_length
    require(
        row % (2 * n) == 0,
        f"config.trajectory.row_length={row} must be a multiple of 2 x model.context_parallel = {2 * n} (each "
        "row is cut into 2 chunks per context shard: the zigzag layout of model/ring.py)",
    )


def _schedule_fits(c: RunConfig) -> None:
    s, k = c.schedule, c.cells.num_cells
    require(
        s.policy == "colocated" or k >= 2,
        f"config.schedule.policy={s.policy!r} needs config.cells.num_cells >= 2 (one cell trains while another "
        f"serves); got {k}",
    )
    drop = c.rl.drop_staleness
    require(
        s.policy == "colocated" or drop < 0 or drop >= s.dispatch_staleness,
        f"config.rl.drop_staleness={drop} (the drop bound) must be >= config.schedule.dispatch_staleness="
        f"{s.dispatch_staleness} (the dispatch bound), or executions would be dropped routinely",
    )
    require(
        s.training_cells == 0 or 1 <= s.training_cells <= k - 1,
        f"config.schedule.training_cells={s.training_cells} must be 0 (half the cells) or in [1, {k - 1}]",
    )


def _lora_fits(c: RunConfig) -> None:
    """A LoRA adapter moves only between cells of one process so far (a follower's cell takes whole states)."""
    require(
        not (c.model.lora.enabled and c.distributed.enabled),
        "not supported yet: config.model.lora with a multi-process run (config.distributed.enabled; a follower's cells "
        "take whole model states); run LoRA in one process, or set model.lora.rank=0",
    )


def _processes_fit(c: RunConfig) -> None:
    """On CPU, a multi-process run splits the config's virtual devices over its processes."""
    d = c.distributed
    if not (d.enabled and c.devices.platform == "cpu"):
        return
    n = c.devices.num_cpu_devices
    require(
        d.num_processes >= 1,
        "config.distributed.num_processes must be set on cpu (the config's devices.num_cpu_devices are split "
        "over the processes; cluster auto-detection is for gpu/tpu)",
    )
    require(
        n % d.num_processes == 0,
        f"config.devices.num_cpu_devices={n} (the run's total) must be a multiple of "
        f"config.distributed.num_processes={d.num_processes}: every process gets the same number of devices",
    )
    require(not d.local_device_ids, "config.distributed.local_device_ids selects GPUs; leave it () on cpu")
