"""Config files and command-line overrides: ``get_config()`` files, ``--config.a.b=value``, ``load_config``.

A config file returns an ml_collections ConfigDict (``configs/tiny_cpu.py``: the defaults but
``serving.warmup``; CPU presets start from it with ``base_config``, accelerator presets from ``default_config``). ``load_config`` fills in the defaults of keys the file leaves out, applies
the overrides with the type of the field they replace, and builds the typed, validated ``RunConfig``;
every problem is a ``ConfigError`` with a one-line message naming the key and what is allowed.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ml_collections import config_dict

from gyre_jax.config.base import ConfigError, unknown_key
from gyre_jax.config.run import RETIRED_KEYS, RunConfig, default_config

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny_cpu.py"


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
    attention_impl: str = "auto",
) -> None:
    """Sets ``config.model`` to a ``ModelConfig`` preset's shapes (random init unless ``checkpoint_dir`` is set),
    with bf16 compute on fp32 master weights and full remat by default. The attention kernel is the run's choice,
    not the preset's: "auto" (derived from the rows' length, ``RunConfig.derive_context``) unless given."""
    for field in dataclasses.fields(model):
        value = getattr(model, field.name)
        if dataclasses.is_dataclass(value):  # a nested section (model.lora): its keys, one by one
            for key, item in dataclasses.asdict(value).items():
                config.model[field.name][key] = item
        else:
            config.model[field.name] = value
    config.model.dtype, config.model.param_dtype, config.model.remat_policy = dtype, param_dtype, remat_policy
    config.model.attention_impl = attention_impl


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


def apply_override(
    config: config_dict.ConfigDict, key: str, text: str, retired: Mapping[str, str] | None = None
) -> None:
    """Sets ``config.<key>`` from its command-line text, with the type of the field it replaces.

    ``retired``: ``{old key: message}`` (``RETIRED_KEYS``); a renamed or removed key is refused with its
    message (the new name, or what sets it now).
    """
    parts = key.split(".")
    node = config
    for depth, part in enumerate(parts):
        if not isinstance(node, config_dict.ConfigDict) or part not in node:
            so_far = ".".join(parts[: depth + 1])
            if retired and so_far in retired:
                raise ConfigError(retired[so_far])
            parent = ".".join(parts[:depth]) or "config"
            if not isinstance(node, config_dict.ConfigDict):
                raise ConfigError(f"unknown config key {key!r}: {parent!r} has no field {part!r} (not a section)")
            raise unknown_key(key, parent, part, node.keys())
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


def _with_defaults(values: dict, defaults: dict) -> dict:
    """``values`` with the keys it leaves out taken from ``defaults`` (its own keys, known or not, kept)."""
    out = dict(defaults)
    for key, value in values.items():
        both = isinstance(value, dict) and isinstance(defaults.get(key), dict)
        out[key] = _with_defaults(value, defaults[key]) if both else value
    return out


def _complete(config: config_dict.ConfigDict) -> config_dict.ConfigDict:
    """A copy of ``config`` with every key it leaves out set to its default (so overrides can set it)."""
    return config_dict.ConfigDict(_with_defaults(config.to_dict(), default_config().to_dict()))


def _override_text(value: Any) -> str:
    return value if isinstance(value, str) else repr(value) if isinstance(value, (tuple, list)) else str(value)


def load_config(argv: Sequence[str] = ()) -> RunConfig:
    """The validated ``RunConfig`` that ``argv`` names (the default config file if none, then the overrides)."""
    spec, overrides = parse_args(argv)
    config = _complete(_load_file(spec))
    for key, value in overrides:
        apply_override(config, key, value, RETIRED_KEYS)
    return RunConfig.from_config_dict(config)


def config_from_dict(base: config_dict.ConfigDict | RunConfig, overrides: Mapping[str, Any]) -> RunConfig:
    """``base`` with python-valued ``{"a.b": value}`` overrides, validated (for tests and notebooks).

    Values are given as they would be on the command line (each with the type of the field it replaces).
    """
    config = base.to_config_dict() if isinstance(base, RunConfig) else _complete(base)
    for key, value in overrides.items():
        apply_override(config, key, _override_text(value), RETIRED_KEYS)
    return RunConfig.from_config_dict(config)
