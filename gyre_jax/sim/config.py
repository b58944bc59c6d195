"""From a simulator preset (an ml_collections ConfigDict, ``presets.py`` / ``configs/sim_*.py``) to a typed
``SimConfig``, with ``--config.a.b=value`` overrides typed by the field they replace.

``load_sim_config("deepswe", {"schedule.policy": "async"})`` takes a preset name or a config file path.
The cost model is derived from the preset's model and hardware specs (``roofline_cost_model``) unless
``cost_model_file`` names a cost model JSON (for example one measured by a real run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ml_collections import config_dict

from gyre_jax.config import RETIRED_KEYS, ConfigError, apply_override, base_config
from gyre_jax.sim.cost_model import (
    CostModel,
    CostModelError,
    HardwareSpec,
    Interconnect,
    ModelSpec,
    PipelineCost,
    SwitchCost,
    interhost_costs,
    lora_params,
    roofline_cost_model,
    with_lora,
)
from gyre_jax.sim.presets import PRESETS
from gyre_jax.sim.simulator import SimConfig, SimConfigError
from gyre_jax.sim.workload import Dist, WorkloadSpec

_DISTS = ("turns", "gen_tokens", "obs_tokens", "tool_s", "setup_s", "eval_s")


def preset(name_or_path: str) -> config_dict.ConfigDict:
    """The ConfigDict of a preset name (``deepswe``, ``terminal``, ``nl2repo``, ``flagship``, ``tiny``) or
    of a config file defining ``get_config()``."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]()
    if name_or_path.endswith(".py") or Path(name_or_path).exists():
        return base_config(name_or_path)
    raise ConfigError(
        f"unknown simulator preset {name_or_path!r} (presets: {', '.join(PRESETS)}; or a configs/sim_*.py file)"
    )


def apply_overrides(config: config_dict.ConfigDict, overrides: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> None:
    """``{"a.b": value}`` onto a preset, each typed by the field it replaces; a key the run config renamed
    (``schedule.max_staleness`` -> ``schedule.dispatch_staleness``) is refused here too, with the new name."""
    items = overrides.items() if isinstance(overrides, Mapping) else overrides
    retired = {k: v for k, v in RETIRED_KEYS.items() if k.startswith("schedule.")}
    for key, value in items:
        text = value if isinstance(value, str) else repr(value) if isinstance(value, (tuple, list)) else str(value)
        apply_override(config, key, text, retired)


def cost_model(c: config_dict.ConfigDict) -> CostModel:
    if c.get("cost_model_file"):
        return CostModel.load(c.cost_model_file)
    k = c.cost
    cm = _roofline(c)
    if k.get("lora_rank", 0) > 0:  # a LoRA adapter: switches move it, not the weights (cost_model.with_lora)
        model = ModelSpec(**c.model.to_dict())
        targets = tuple(t.strip() for t in k.lora_targets.split(",") if t.strip())
        try:
            fraction = lora_params(model, k.lora_rank, targets) / model.total_params
        except CostModelError as exc:
            raise ConfigError(f"config.cost.lora_targets={k.lora_targets!r}: {exc}") from None
        cm = with_lora(cm, fraction, k.switch_weight_share)
    return cm


def _roofline(c: config_dict.ConfigDict) -> CostModel:
    """The roofline cost model of the preset. With ``cluster.host_bandwidth`` > 0 the cell-to-cell moves are derived
    from the bytes moved over the hosts a cell spans (``interhost_costs``): a weight sync is ``cost.weight_sync_s``
    (its fixed part) plus the transfer, each satellite's gradients add their transfer to the optimizer step, and
    ``cost.kv_migration_s_per_token`` is replaced; with 0 those keys are used as given."""
    k, n = c.cost, c.cluster
    model = ModelSpec(**c.model.to_dict())
    sync, grad_receive, kv = k.weight_sync_s, 0.0, k.kv_migration_s_per_token
    if n.get("host_bandwidth", 0.0) > 0:
        link = Interconnect(n.accelerators_per_host, n.host_bandwidth, n.link_efficiency)
        try:
            moves = interhost_costs(model, link, n.cell_accelerators, n.accelerators // n.cell_accelerators)
        except CostModelError as exc:
            raise ConfigError(f"config.cluster: {exc}") from None
        sync += moves["weight_sync_s"]
        grad_receive, kv = moves["grad_receive_s"], moves["kv_migration_s_per_token"]
    cm = roofline_cost_model(
        model,
        HardwareSpec(**c.hardware.to_dict()),
        replica_accelerators=k.replica_accelerators,
        slots_per_replica=k.slots_per_replica,
        reference_cell_accelerators=k.reference_cell_accelerators,
        min_cell_accelerators=k.min_cell_accelerators,
        train_mfu=k.train_mfu,
        decode_mbu=k.decode_mbu,
        prefill_mfu=k.prefill_mfu,
        decode_overhead_s=k.decode_overhead_s,
        scaling_exponent=k.scaling_exponent,
        micro_step_tokens=k.micro_step_tokens,
        micro_step_overhead_s=k.micro_step_overhead_s,
        optimizer_step_s=k.optimizer_step_s,
        grad_reduce_s=k.grad_reduce_s,
        switch=SwitchCost(
            serving_to_training_s=k.serving_to_training_s,
            training_to_serving_s=k.training_to_serving_s,
            weight_sync_s=sync,
            kv_migration_s_per_token=kv,
        ),
        pipeline=PipelineCost(processing_s_per_token=k.processing_s_per_token, workers=k.pipeline_workers),
        source=f"roofline: {c.hardware.name}, {c.model.total_params / 1e9:.0f}B params ({c.name} preset)",
    )
    return cm.replace(training={"grad_receive_s": grad_receive}) if grad_receive else cm


def workload(c: config_dict.ConfigDict) -> WorkloadSpec:
    w = c.workload.to_dict()
    for key in _DISTS:
        w[key] = Dist(**{k: float(v) for k, v in w[key].items()})
    return WorkloadSpec(name=c.name, **w)


def sim_config(c: config_dict.ConfigDict) -> SimConfig:
    """A validated ``SimConfig`` from a preset ConfigDict. Raises ``ConfigError`` naming the bad field."""
    try:
        s = c.schedule
        options: dict[str, Any] = {}
        if s.policy == "async":
            cells = c.cluster.accelerators // c.cluster.cell_accelerators
            options = {
                "training_cells": s.training_cells or max(1, cells // 2),
                "dispatch_staleness": s.dispatch_staleness,
            }
        elif s.policy == "elastic":
            options = {"dispatch_staleness": s.dispatch_staleness}
        return SimConfig(
            workload=workload(c),
            cost=cost_model(c),
            accelerators=c.cluster.accelerators,
            cell_accelerators=c.cluster.cell_accelerators,
            policy=s.policy,
            policy_options=tuple(sorted(options.items())),
            steps=c.steps,
            tasks_per_step=c.tasks_per_step,
            group_size=c.group_size,
            seed=c.seed,
            max_branches=c.max_branches or None,
            streaming=s.streaming,
            stream_unit=s.stream_unit,
            partial_rollouts=s.partial_rollouts,
            drop_staleness=s.drop_staleness,
            admission=s.admission,
            group_quorum=s.group_quorum,
            segments=c.segments,
            name=c.name,
        )
    except (SimConfigError, ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"simulator config {c.get('name', '?')}: {exc}") from None


def load_sim_config(name_or_path: str, overrides: Mapping[str, Any] | Sequence[tuple[str, Any]] = ()) -> SimConfig:
    c = preset(name_or_path)
    apply_overrides(c, overrides)
    return sim_config(c)
