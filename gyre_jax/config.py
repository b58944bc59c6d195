"""Run configuration: ml_collections ``get_config()`` files, ``--config.a.b=value`` overrides, validation.

Everything a run does is in its config (MaxText style). ``load_config`` reads a config file, applies
command-line overrides with the type of the field they replace, and ``validate`` checks every value
before any work starts; both raise ``ConfigError`` with a one-line message naming the key and what is
allowed.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ml_collections import config_dict

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny_cpu.py"

POLICIES = ("colocated", "async", "elastic")
SUPPORTED_POLICIES = POLICIES
LEAVE_RULES = ("waterlevel", "backlog")  # gyre_jax.elastic.policies.ElasticPolicy.LEAVE_RULES
STREAM_ORDERS = ("task", "arrival")  # gyre_jax.elastic.controller.STREAM_ORDERS
LOSSES = ("gspo", "gspo_token", "grpo")  # gyre_jax.rl.losses.POLICY_LOSSES
SCHEDULES = ("constant", "cosine", "linear")  # gyre_jax.rl.learner.SCHEDULES
PLATFORMS = ("cpu", "gpu", "tpu")
DTYPES = ("float32", "bfloat16")
MESH_AXES = ("data", "fsdp", "tensor")
OPTIONAL_MESH_AXES = ("expert",)  # config.mesh.expert (default 1): MoE experts split over it
TASK_KINDS = ("copy", "upper", "reverse")


class ConfigError(ValueError):
    """A config file, override or value is invalid. The message is one line, fit for a terminal."""


def _load_file(spec: str) -> config_dict.ConfigDict:
    path_text, _, arg = spec.partition(":")
    path = Path(path_text)
    if not path.is_file() and not path.is_absolute() and (REPO_ROOT / path).is_file():
        path = REPO_ROOT / path
    if not path.is_file():
        raise ConfigError(
            f"config file {path_text!r} not found (expected a Python file defining get_config(), e.g. configs/tiny_cpu.py)"
        )
    module_spec = importlib.util.spec_from_file_location(f"gyre_config_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as exc:  # a broken config file: say which and why
        raise ConfigError(f"config file {path} failed to load: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} defines no get_config() function")
    try:
        config = module.get_config(arg) if arg else module.get_config()
    except Exception as exc:  # e.g. an argument given to a get_config() that takes none
        raise ConfigError(
            f"config file {path}: get_config({arg!r}) failed: {type(exc).__name__}: {exc}"
            if arg
            else f"config file {path}: get_config() failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(config, config_dict.ConfigDict):
        raise ConfigError(f"{path}: get_config() must return an ml_collections.ConfigDict, got {type(config).__name__}")
    return config


def base_config(path: str | Path) -> config_dict.ConfigDict:
    """The config of another config file (a preset built on ``configs/tiny_cpu.py`` loads it this way)."""
    return _load_file(str(path))


def use_model(
    config: config_dict.ConfigDict,
    model: Any,
    *,
    dtype: str = "bfloat16",
    param_dtype: str = "float32",
    remat_policy: str = "full",
) -> None:
    """Sets ``config.model`` to a ``ModelConfig`` preset's shapes (random init unless ``checkpoint_dir`` is set),
    with bf16 compute on fp32 master weights and full remat by default."""
    for field in dataclasses.fields(model):
        config.model[field.name] = getattr(model, field.name)
    config.model.dtype, config.model.param_dtype, config.model.remat_policy = dtype, param_dtype, remat_policy


def _parse_value(key: str, text: str, current: Any) -> Any:
    def fail(expected: str) -> ConfigError:
        return ConfigError(f"--config.{key}={text}: expected {expected}")

    if isinstance(current, bool):
        lowered = text.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise fail("a boolean (true or false)")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise fail("an integer") from None
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise fail("a number") from None
    if isinstance(current, str):
        return text
    if isinstance(current, (tuple, list)):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = tuple(part.strip() for part in text.split(",") if part.strip())
        if not isinstance(value, (tuple, list)):
            value = (value,)
        if (
            current
            and all(type(x) is type(current[0]) for x in current)
            and isinstance(current[0], (bool, int, float, str))
        ):
            value = [v if type(v) is type(current[0]) else _parse_value(key, str(v), current[0]) for v in value]
        return tuple(value)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_override(config: config_dict.ConfigDict, key: str, text: str) -> None:
    """Sets ``config.<key>`` from its command-line text, with the type of the field it replaces."""
    parts = key.split(".")
    node = config
    for depth, part in enumerate(parts):
        if not isinstance(node, config_dict.ConfigDict) or part not in node:
            parent = ".".join(parts[:depth]) or "config"
            known = ", ".join(sorted(node.keys())) if isinstance(node, config_dict.ConfigDict) else "(not a section)"
            raise ConfigError(f"unknown config key {key!r}: {parent!r} has no field {part!r} (known: {known})")
        if depth < len(parts) - 1:
            node = node[part]
    current = node[parts[-1]]
    if isinstance(current, config_dict.ConfigDict):
        raise ConfigError(
            f"--config.{key} is a section, not a value; set one of its fields: {', '.join(sorted(current.keys()))}"
        )
    value = _parse_value(key, text, current)
    try:
        with node.unlocked():
            node[parts[-1]] = value
    except TypeError as exc:
        raise ConfigError(f"--config.{key}={text}: {exc}") from None


def parse_args(argv: Sequence[str]) -> tuple[str, list[tuple[str, str]]]:
    """Splits ``argv`` into the config file spec and the ordered ``(key, value)`` overrides."""
    config_spec = str(DEFAULT_CONFIG)
    overrides: list[tuple[str, str]] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("--config", "-c") or arg.startswith("--config="):
            if "=" in arg:
                config_spec = arg.split("=", 1)[1]
            else:
                if i + 1 >= len(args):
                    raise ConfigError("--config needs a path, e.g. --config configs/tiny_cpu.py")
                i += 1
                config_spec = args[i]
        elif arg.startswith("--config."):
            body = arg[len("--config.") :]
            if "=" in body:
                key, value = body.split("=", 1)
            else:
                if i + 1 >= len(args) or args[i + 1].startswith("--"):
                    raise ConfigError(f"--config.{body} needs a value: --config.{body}=VALUE")
                i += 1
                key, value = body, args[i]
            overrides.append((key, value))
        else:
            raise ConfigError(f"unrecognized argument {arg!r}: expected --config PATH and --config.KEY=VALUE overrides")
        i += 1
    return config_spec, overrides


def load_config(argv: Sequence[str] = ()) -> config_dict.ConfigDict:
    """Loads and validates the config that ``argv`` names (the default config if none)."""
    spec, overrides = parse_args(argv)
    config = _load_file(spec)
    for key, value in overrides:
        apply_override(config, key, value)
    validate(config)
    return config


def config_from_dict(base: config_dict.ConfigDict, overrides: dict[str, Any]) -> config_dict.ConfigDict:
    """Copy of ``base`` with python-valued ``{"a.b": value}`` overrides, validated (for tests and notebooks)."""
    config = config_dict.ConfigDict(base.to_dict())
    for key, value in overrides.items():
        text = value if isinstance(value, str) else repr(value) if isinstance(value, (tuple, list)) else str(value)
        apply_override(config, key, text)
    validate(config)
    return config


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def device_count(config: config_dict.ConfigDict) -> int:
    return config.mesh.data * config.mesh.fsdp * config.mesh.tensor * config.mesh.get("expert", 1)


def validate(config: config_dict.ConfigDict) -> None:
    """Checks every value a run depends on; raises ConfigError naming the first bad key."""
    c = config
    _require(c.total_steps >= 0, f"config.total_steps={c.total_steps} must be >= 0")
    _require(c.checkpoint_every >= 1, f"config.checkpoint_every={c.checkpoint_every} must be >= 1")
    _require(c.keep_checkpoints >= 1, f"config.keep_checkpoints={c.keep_checkpoints} must be >= 1")
    _require(bool(c.workdir), "config.workdir must be a non-empty path")
    _require(
        c.devices.platform in PLATFORMS, f"config.devices.platform={c.devices.platform!r} must be one of {PLATFORMS}"
    )
    for axis in MESH_AXES:
        _require(c.mesh[axis] >= 1, f"config.mesh.{axis}={c.mesh[axis]} must be >= 1")
        _require(c.cells[axis] >= 1, f"config.cells.{axis}={c.cells[axis]} must be >= 1")
    n = device_count(c)
    if c.devices.platform == "cpu":
        _require(
            n == c.devices.num_cpu_devices,
            f"config.mesh data*fsdp*tensor*expert = {n} must equal config.devices.num_cpu_devices={c.devices.num_cpu_devices}",
        )
    _require(c.cells.num_cells >= 1, f"config.cells.num_cells={c.cells.num_cells} must be >= 1")
    _require(
        n % c.cells.num_cells == 0,
        f"config.cells.num_cells={c.cells.num_cells} must divide the {n} devices of the mesh",
    )
    per_cell = n // c.cells.num_cells
    cell_devices = c.cells.data * c.cells.fsdp * c.cells.tensor * c.cells.get("expert", 1)
    _require(
        cell_devices == per_cell,
        f"config.cells data*fsdp*tensor*expert = {cell_devices} must equal the {per_cell} devices of each of the {c.cells.num_cells} cells",
    )
    m = c.model
    ct, cf = c.cells.tensor, c.cells.fsdp
    if not m.get("checkpoint_dir", ""):
        for key in ("num_heads", "num_kv_heads", "mlp_dim"):
            _require(
                m[key] % ct == 0,
                f"config.model.{key}={m[key]} does not split over config.cells.tensor={ct}: a "
                f"tensor group cannot fit a cell; pick a cells.tensor that divides it",
            )
        _require(
            m.embed_dim % cf == 0, f"config.model.embed_dim={m.embed_dim} does not split over config.cells.fsdp={cf}"
        )
        ne = m.get("num_experts", 0)
        _require(
            not ne or ne % c.cells.get("expert", 1) == 0,
            f"config.model.num_experts={ne} does not split over config.cells.expert={c.cells.get('expert', 1)}",
        )
    rules = c.sharding_rules
    _require(
        isinstance(rules, (tuple, list)) and all(isinstance(r, (tuple, list)) and len(r) == 2 for r in rules),
        "config.sharding_rules must be a sequence of (logical_axis, mesh_axes) pairs",
    )
    for logical, mesh_axes in rules:
        targets = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
        for t in targets:
            _require(
                t in MESH_AXES + OPTIONAL_MESH_AXES,
                f"config.sharding_rules: {logical!r} maps to unknown mesh axis {t!r}; mesh axes are {MESH_AXES + OPTIONAL_MESH_AXES}",
            )
        _require(
            len(set(targets)) == len(targets), f"config.sharding_rules: {logical!r} names a mesh axis twice: {targets}"
        )

    m = c.model
    for key in ("vocab_size", "num_layers", "embed_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
        _require(m[key] >= 1, f"config.model.{key}={m[key]} must be >= 1")
    _require(
        m.num_heads % m.num_kv_heads == 0,
        f"config.model.num_heads={m.num_heads} must be a multiple of num_kv_heads={m.num_kv_heads}",
    )
    _require(m.head_dim % 2 == 0, f"config.model.head_dim={m.head_dim} must be even (rotary embedding)")
    _require(m.dtype in DTYPES, f"config.model.dtype={m.dtype!r} must be one of {DTYPES}")
    _require(m.param_dtype in DTYPES, f"config.model.param_dtype={m.param_dtype!r} must be one of {DTYPES}")
    from gyre_jax.model.config import ModelConfig

    try:  # MoE, RoPE scaling, remat and the other optional model keys
        ModelConfig.from_config_dict(m)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config.model: {exc}") from None
    from gyre_jax.proxy.chat_template import TOOLS_FORMATS

    _require(
        c.tokenizer.tools_format in TOOLS_FORMATS,
        f"config.tokenizer.tools_format={c.tokenizer.tools_format!r} must be one of {TOOLS_FORMATS}",
    )
    _require(c.tokenizer.kind in ("byte", "hf"), f"config.tokenizer.kind={c.tokenizer.kind!r} must be 'byte' or 'hf'")
    from gyre_jax.model.tokenizer import ByteTokenizer

    _require(
        c.tokenizer.kind != "byte" or m.vocab_size >= ByteTokenizer().num_real_tokens,
        f"config.model.vocab_size={m.vocab_size} must be >= {ByteTokenizer().num_real_tokens} for the byte tokenizer",
    )

    s = c.serving
    _require(
        s.max_concurrent_decodes >= 1, f"config.serving.max_concurrent_decodes={s.max_concurrent_decodes} must be >= 1"
    )
    _require(s.max_seq_len >= 16, f"config.serving.max_seq_len={s.max_seq_len} must be >= 16")
    _require(
        1 <= s.max_prefill_length <= s.max_seq_len,
        f"config.serving.max_prefill_length={s.max_prefill_length} must be in [1, serving.max_seq_len={s.max_seq_len}]",
    )
    buckets = tuple(s.prefill_buckets)
    _require(
        len(buckets) > 0 and all(b >= 1 for b in buckets) and list(buckets) == sorted(buckets),
        f"config.serving.prefill_buckets={buckets} must be a non-empty increasing sequence of lengths",
    )
    _require(
        buckets[-1] >= s.max_prefill_length,
        f"config.serving.prefill_buckets={buckets}: the largest bucket must be >= serving.max_prefill_length={s.max_prefill_length}",
    )
    _require(
        s.page_size >= 1 and s.max_seq_len % s.page_size == 0,
        f"config.serving.page_size={s.page_size} must be >= 1 and divide serving.max_seq_len={s.max_seq_len}",
    )
    _require(
        s.kv_pages >= 0, f"config.serving.kv_pages={s.kv_pages} must be >= 0 (0 disables the session prefix cache)"
    )
    _require(
        s.on_weight_update in ("continue", "recompute"),
        f"config.serving.on_weight_update={s.on_weight_update!r} must be 'continue' or 'recompute'",
    )
    _require(
        not (s.on_weight_update == "recompute" and s.reuse_stale_kv),
        "config.serving.reuse_stale_kv=True contradicts on_weight_update='recompute' (which recomputes KV under new weights)",
    )

    p = c.proxy
    _require(0 <= p.port <= 65535, f"config.proxy.port={p.port} must be in [0, 65535] (0 picks a free port)")
    _require(p.max_request_bytes >= 1024, f"config.proxy.max_request_bytes={p.max_request_bytes} must be >= 1024")

    r = c.rollout
    _require(r.suite == "builtin", f"config.rollout.suite={r.suite!r}: only 'builtin' is supported yet")
    kinds = tuple(r.task_kinds)
    _require(
        len(kinds) > 0 and all(k in TASK_KINDS for k in kinds),
        f"config.rollout.task_kinds={kinds} must be a non-empty subset of {TASK_KINDS}",
    )
    from gyre_jax.rollout.tasks import ALPHABETS

    _require(r.alphabet in ALPHABETS, f"config.rollout.alphabet={r.alphabet!r} must be one of {tuple(ALPHABETS)}")
    _require(
        1 <= r.input_min_len <= r.input_max_len,
        f"config.rollout.input_min_len={r.input_min_len}, input_max_len={r.input_max_len} must satisfy 1 <= min <= max",
    )
    _require(r.num_tasks >= 0, f"config.rollout.num_tasks={r.num_tasks} must be >= 0 (0 = fresh tasks every step)")
    _require(r.tasks_per_step >= 1, f"config.rollout.tasks_per_step={r.tasks_per_step} must be >= 1")
    _require(r.timeout_s > 0, f"config.rollout.timeout_s={r.timeout_s} must be > 0")
    _require(r.max_parallel >= 1, f"config.rollout.max_parallel={r.max_parallel} must be >= 1")
    _require(r.max_turns >= 1, f"config.rollout.max_turns={r.max_turns} must be >= 1")
    _require(
        1 <= r.max_tokens_per_call < s.max_seq_len,
        f"config.rollout.max_tokens_per_call={r.max_tokens_per_call} must be in [1, serving.max_seq_len)",
    )
    _require(r.temperature > 0, f"config.rollout.temperature={r.temperature} must be > 0 (RL needs sampling)")
    _require(
        r.tool_latency_median_s >= 0, f"config.rollout.tool_latency_median_s={r.tool_latency_median_s} must be >= 0"
    )
    _require(r.tool_latency_sigma >= 0, f"config.rollout.tool_latency_sigma={r.tool_latency_sigma} must be >= 0")
    _require(r.evaluator_timeout_s > 0, f"config.rollout.evaluator_timeout_s={r.evaluator_timeout_s} must be > 0")

    rl = c.rl
    _require(rl.loss in LOSSES, f"config.rl.loss={rl.loss!r} must be one of {LOSSES}")
    _require(
        rl.group_size >= 2,
        f"config.rl.group_size={rl.group_size} must be >= 2 (advantages are normalized within a group)",
    )
    _require(0 <= rl.clip_low < 1, f"config.rl.clip_low={rl.clip_low} must be in [0, 1)")
    _require(rl.clip_high >= 0, f"config.rl.clip_high={rl.clip_high} must be >= 0")
    _require(rl.max_branches >= 1, f"config.rl.max_branches={rl.max_branches} must be >= 1")
    _require(rl.micro_batch_size >= 1, f"config.rl.micro_batch_size={rl.micro_batch_size} must be >= 1")
    _require(
        rl.get("kl_coef", 0.0) >= 0, f"config.rl.kl_coef={rl.get('kl_coef')} must be >= 0 (0 turns the KL term off)"
    )
    _require(
        rl.get("behaviour_is_cap", 0.0) >= 0,
        f"config.rl.behaviour_is_cap={rl.get('behaviour_is_cap')} must be >= 0 (0 = off)",
    )
    _require(
        rl.get("behaviour_is_cap", 0.0) == 0 or rl.get("recompute_behaviour", False),
        "config.rl.behaviour_is_cap > 0 needs config.rl.recompute_behaviour=True",
    )
    _require(
        rl.get("max_staleness", -1) >= -1,
        f"config.rl.max_staleness={rl.get('max_staleness')} must be >= 0 (or -1: no bound)",
    )
    _require(
        rl.get("micro_steps_per_step", 0) >= 0,
        f"config.rl.micro_steps_per_step={rl.get('micro_steps_per_step')} must be >= 0 (0 = as many as the data needs)",
    )
    if "trajectory" in c:
        t = c.trajectory
        _require(t.packing in ("tree", "plain"), f"config.trajectory.packing={t.packing!r} must be 'tree' or 'plain'")
        _require(
            t.row_length >= s.max_seq_len,
            f"config.trajectory.row_length={t.row_length} must be >= "
            f"serving.max_seq_len={s.max_seq_len} (a branch can be that long and must fit one row)",
        )
        _require(
            t.tokens_per_micro_batch >= t.row_length and t.tokens_per_micro_batch % t.row_length == 0,
            f"config.trajectory.tokens_per_micro_batch={t.tokens_per_micro_batch} must be a positive multiple of "
            f"trajectory.row_length={t.row_length} (micro-batches are rows x row_length tokens)",
        )
        _require(
            t.get("open_micro_batches", 4) >= 1,
            f"config.trajectory.open_micro_batches={t.get('open_micro_batches')} must be >= 1",
        )
        _require(
            t.max_sequences_per_micro_batch >= 1,
            f"config.trajectory.max_sequences_per_micro_batch={t.max_sequences_per_micro_batch} must be >= 1",
        )

    o = c.optimizer
    _require(
        o.learning_rate > 0 and math.isfinite(o.learning_rate),
        f"config.optimizer.learning_rate={o.learning_rate} must be > 0",
    )
    _require(o.warmup_steps >= 0, f"config.optimizer.warmup_steps={o.warmup_steps} must be >= 0")
    _require(0 <= o.b1 < 1 and 0 <= o.b2 < 1, f"config.optimizer.b1={o.b1}, b2={o.b2} must be in [0, 1)")
    _require(o.weight_decay >= 0, f"config.optimizer.weight_decay={o.weight_decay} must be >= 0")
    _require(o.grad_clip_norm > 0, f"config.optimizer.grad_clip_norm={o.grad_clip_norm} must be > 0")
    _require(
        o.get("schedule", "constant") in SCHEDULES,
        f"config.optimizer.schedule={o.get('schedule')!r} must be one of {SCHEDULES}",
    )
    _require(
        o.get("schedule", "constant") == "constant" or o.get("decay_steps", 0) >= 1,
        f"config.optimizer.schedule={o.get('schedule')!r} needs config.optimizer.decay_steps >= 1",
    )
    _require(
        0 <= o.get("min_lr_ratio", 0.0) <= 1, f"config.optimizer.min_lr_ratio={o.get('min_lr_ratio')} must be in [0, 1]"
    )

    w = c.warm_start
    _require(w.steps >= 0, f"config.warm_start.steps={w.steps} must be >= 0")
    _require(w.batch_size >= 1, f"config.warm_start.batch_size={w.batch_size} must be >= 1")
    _require(w.learning_rate > 0, f"config.warm_start.learning_rate={w.learning_rate} must be > 0")
    _require(w.warmup_steps >= 0, f"config.warm_start.warmup_steps={w.warmup_steps} must be >= 0")

    e = c.eval
    _require(e.split in ("train", "heldout"), f"config.eval.split={e.split!r} must be 'train' or 'heldout'")
    _require(
        e.split == "heldout" or r.num_tasks > 0,
        "config.eval.split='train' needs a fixed training set (config.rollout.num_tasks > 0); use eval.split=heldout",
    )
    _require(e.num_tasks >= 1, f"config.eval.num_tasks={e.num_tasks} must be >= 1")
    _require(
        e.samples_per_task >= 0, f"config.eval.samples_per_task={e.samples_per_task} must be >= 0 (0 disables eval)"
    )
    _require(e.every_steps >= 0, f"config.eval.every_steps={e.every_steps} must be >= 0")

    sc = c.schedule
    _require(sc.policy in POLICIES, f"config.schedule.policy={sc.policy!r} must be one of {POLICIES}")
    k = c.cells.num_cells
    _require(
        sc.policy == "colocated" or k >= 2,
        f"config.schedule.policy={sc.policy!r} needs config.cells.num_cells >= 2 (one cell trains while another "
        f"serves); got {k}",
    )
    _require(sc.get("max_staleness", 1) >= 0, f"config.schedule.max_staleness={sc.get('max_staleness')} must be >= 0")
    eta_drop = c.rl.get("max_staleness", -1)
    _require(
        sc.policy == "colocated" or eta_drop < 0 or eta_drop >= sc.get("max_staleness", 1),
        f"config.rl.max_staleness={eta_drop} (the drop bound) must be >= config.schedule.max_staleness="
        f"{sc.get('max_staleness', 1)} (the dispatch bound), or executions would be dropped routinely",
    )
    tc = sc.get("training_cells", 0)
    _require(
        tc == 0 or 1 <= tc <= k - 1,
        f"config.schedule.training_cells={tc} must be 0 (half the cells) or in [1, {k - 1}]",
    )
    _require(
        sc.get("leave_on", "waterlevel") in LEAVE_RULES,
        f"config.schedule.leave_on={sc.get('leave_on')!r} must be one of {LEAVE_RULES}",
    )
    _require(
        sc.get("idle_before_return_s", 0.0) >= 0,
        f"config.schedule.idle_before_return_s={sc.get('idle_before_return_s')} must be >= 0",
    )
    _require(
        c.cells.get("sessions_per_cell", 0) >= 0,
        f"config.cells.sessions_per_cell={c.cells.get('sessions_per_cell')} must be >= 0 (0 = serving.max_concurrent_decodes)",
    )
    if "trajectory" in c:
        _require(
            c.trajectory.get("stream_order", "task") in STREAM_ORDERS,
            f"config.trajectory.stream_order={c.trajectory.get('stream_order')!r} must be one of {STREAM_ORDERS}",
        )
    ckpt = c.model.get("checkpoint_dir", "")
    if ckpt:
        _require(
            Path(ckpt, "config.json").is_file(),
            f"config.model.checkpoint_dir={ckpt!r} has no config.json (a Hugging Face checkpoint directory is expected)",
        )
        _require(
            c.tokenizer.kind == "hf",
            "config.model.checkpoint_dir is set: set config.tokenizer.kind='hf' so the "
            "checkpoint's tokenizer.json is used",
        )
    else:
        _require(
            c.tokenizer.kind == "byte",
            f"config.tokenizer.kind={c.tokenizer.kind!r} needs config.model.checkpoint_dir "
            f"(the directory with tokenizer.json); without one use 'byte'",
        )
    if "distributed" in c:
        from gyre_jax import runtime

        try:
            runtime.process.validate_distributed(c)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def policy_options(config: config_dict.ConfigDict) -> dict:
    """Keyword options for ``make_policy`` from ``config.schedule``."""
    sc = config.schedule
    if sc.policy == "async":
        tc = sc.get("training_cells", 0)
        return {"max_staleness": sc.get("max_staleness", 1), **({"training_cells": tc} if tc else {})}
    if sc.policy == "elastic":
        return {
            "max_staleness": sc.get("max_staleness", 1),
            "leave_on": sc.get("leave_on", "waterlevel"),
            "idle_before_return_s": float(sc.get("idle_before_return_s", 0.0)),
        }
    return {}


def to_json_dict(config: config_dict.ConfigDict) -> dict:
    """Plain, JSON-serializable dict of the config (tuples become lists)."""
    return config.to_dict()


def resolve_workdir(config: config_dict.ConfigDict) -> Path:
    return Path(os.path.expanduser(config.workdir)).resolve()
