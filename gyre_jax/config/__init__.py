"""Run configuration: everything a run does is in its config (MaxText style).

Config files are ml_collections ``get_config()`` files (``configs/tiny_cpu.py``, the default: every key's default
but ``serving.warmup``; the presets start from it or from ``default_config()``); ``--config.a.b=value`` overrides
take the type of the field they replace.
``load_config`` turns the result into a ``RunConfig``: a tree of typed, frozen sections whose attribute
paths are the config keys (``cfg.rl.group_size``). Every value is checked once, when its section is
built, and the rules across sections by ``validate``; any problem is a ``ConfigError`` whose one-line
message names the key and what is allowed. A config is data: building it reads no file (the run's builder loads
the task suite, the checkpoint and the tokenizer it names).

Modules: ``base`` (``ConfigError``, the ``Section`` mixin), ``cluster`` (devices, mesh, cells,
distributed), ``rollout`` (model, tokenizer, serving, proxy, rollout), ``training`` (rl, trajectory,
optimizer, warm_start, eval, schedule, metrics), ``run`` (``RunConfig``, cross-section rules, the
derived component configs), ``files`` (config files, overrides, ``load_config``).
"""

from gyre_jax.config.base import ConfigError, Section
from gyre_jax.config.cluster import (
    MESH_AXES,
    OPTIONAL_MESH_AXES,
    PLATFORMS,
    CellsSection,
    DevicesSection,
    DistributedSection,
    MeshSection,
)
from gyre_jax.config.files import (
    DEFAULT_CONFIG,
    REPO_ROOT,
    apply_override,
    base_config,
    config_from_dict,
    load_config,
    parse_args,
    use_model,
)
from gyre_jax.config.rollout import (
    DTYPES,
    TASK_KINDS,
    ModelSection,
    ProxySection,
    RolloutSection,
    ServingSection,
    TokenizerSection,
)
from gyre_jax.config.run import (
    RENAMED_KEYS,
    RETIRED_KEYS,
    SHARDING_RULES,
    RunConfig,
    default_config,
    device_count,
    policy_options,
    resolve_workdir,
    validate,
)
from gyre_jax.config.training import (
    LEAVE_RULES,
    LOSSES,
    POLICIES,
    STREAM_ORDERS,
    EvalSection,
    MetricsSection,
    OptimizerSection,
    RLSection,
    ScheduleSection,
    TrajectorySection,
    WarmStartSection,
)

__all__ = [
    "DEFAULT_CONFIG",
    "DTYPES",
    "LEAVE_RULES",
    "LOSSES",
    "MESH_AXES",
    "OPTIONAL_MESH_AXES",
    "PLATFORMS",
    "POLICIES",
    "RENAMED_KEYS",
    "RETIRED_KEYS",
    "REPO_ROOT",
    "SHARDING_RULES",
    "STREAM_ORDERS",
    "TASK_KINDS",
    "CellsSection",
    "ConfigError",
    "DevicesSection",
    "DistributedSection",
    "EvalSection",
    "MeshSection",
    "MetricsSection",
    "ModelSection",
    "OptimizerSection",
    "ProxySection",
    "RLSection",
    "RolloutSection",
    "RunConfig",
    "ScheduleSection",
    "Section",
    "ServingSection",
    "TokenizerSection",
    "TrajectorySection",
    "WarmStartSection",
    "apply_override",
    "base_config",
    "config_from_dict",
    "default_config",
    "device_count",
    "load_config",
    "parse_args",
    "policy_options",
    "resolve_workdir",
    "use_model",
    "validate",
]
