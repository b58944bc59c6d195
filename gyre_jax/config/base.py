"""What every typed config section shares: ``ConfigError``, one-line errors, field types checked once.

A section is a frozen dataclass that mixes in ``Section``: its ``__post_init__`` calls ``check_types()``
(each value must have its field's type; ints become floats where a float is asked for, lists become
tuples) and then checks its own values. ``from_dict`` builds a section from plain values and refuses
unknown keys (listing the known ones) and renamed keys (naming the new one).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A config file, override or value is invalid. The message is one line, fit for a terminal."""


def require(cond: bool, message: str) -> None:
    """Raises ``ConfigError(message)`` unless ``cond``."""
    if not cond:
        raise ConfigError(message)


def unknown_key(key: str, parent: str, name: str, known: typing.Iterable[str]) -> ConfigError:
    """The error for ``config.<key>`` whose last part ``name`` is not a field of ``parent``."""
    return ConfigError(
        f"unknown config key {key!r}: {parent!r} has no field {name!r} (known: {', '.join(sorted(known))})"
    )


def renamed_key(old: str, new: str, meaning: str) -> ConfigError:
    """The error for a key that was renamed: it says which key to use instead and what it means."""
    return ConfigError(f"config.{old} was renamed: use config.{new} ({meaning})")


_SCALARS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def _scalar_ok(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def coerce(key: str, value: Any, hint: Any) -> Any:
    """``value`` as the type ``hint`` of field ``config.<key>``; raises ConfigError naming the key if it is not.

    Scalars (bool, int, float, str) and ``tuple[scalar, ...]`` are checked here; a nested section is built
    from a mapping; any other type (e.g. ``sharding_rules``) is left to the owner's own check.
    """
    if hint in _SCALARS:
        require(_scalar_ok(value, hint), f"config.{key}={value!r} must be {_SCALARS[hint]}")
        return float(value) if hint is float else value
    if isinstance(hint, type) and issubclass(hint, Section):
        if isinstance(value, hint):
            return value
        require(
            isinstance(value, Mapping),
            f"config.{key} is a section, not a value; set one of its fields: {', '.join(hint.field_names())}",
        )
        return hint.from_dict(value)
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in _SCALARS:
        kind = args[0]
        require(
            isinstance(value, (tuple, list)) and all(_scalar_ok(v, kind) for v in value),
            f"config.{key}={value!r} must be a sequence of {_PLURALS[kind]}",
        )
        return tuple(float(v) if kind is float else v for v in value)
    return value


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


class Section:
    """Mixin of a frozen config dataclass: its key path, renamed keys, type checks and the dict round trip."""

    _path = ""  # the section's key in the run config ("rl"); "" for the run config itself
    _renamed: Mapping[str, tuple[str, str]] = {}  # old field name -> (new field name, what it means)
    _removed: Mapping[str, str] = {}  # old field name -> what sets that now

    @classmethod
    def key(cls, name: str) -> str:
        """The dotted config key of field ``name`` (``rl.group_size``)."""
        return f"{cls._path}.{name}" if cls._path else name

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def check_key(cls, name: str) -> None:
        """Raises ConfigError if ``name`` is not a field of this section (renamed or unknown)."""
        if name in cls._renamed:
            new, meaning = cls._renamed[name]
            raise renamed_key(cls.key(name), cls.key(new), meaning)
        if name in cls._removed:
            raise ConfigError(f"config.{cls.key(name)} was removed: {cls._removed[name]}")
        if name not in cls.field_names():
            raise unknown_key(cls.key(name), cls._path or "config", name, cls.field_names())

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]):
        """The section from ``{field: value}``; missing fields take their defaults."""
        for name in values:
            cls.check_key(name)
        return cls(**values)

    def check_types(self) -> None:
        """Checks (and normalizes: int -> float, list -> tuple) every field against its annotation."""
        for name, hint in _field_types(type(self)).items():
            object.__setattr__(self, name, coerce(self.key(name), getattr(self, name), hint))

    def as_tree(self) -> dict[str, Any]:
        """``{field: value}`` with nested sections as dicts (tuples kept: the form a ConfigDict holds)."""
        return {
            f.name: v.as_tree() if isinstance(v := getattr(self, f.name), Section) else v
            for f in dataclasses.fields(self)
        }

    @classmethod
    def retired_keys(cls) -> dict[str, str]:
        """Every renamed or removed key of this section and the sections below it, with the one-line error
        that refuses it: ``{old key: message}``."""
        out = {old: str(renamed_key(old, new, meaning)) for old, (new, meaning) in cls.renamed_keys().items()}
        out.update({cls.key(old): f"config.{cls.key(old)} was removed: {what}" for old, what in cls._removed.items()})
        for hint in _field_types(cls).values():
            if isinstance(hint, type) and issubclass(hint, Section):
                out.update({k: v for k, v in hint.retired_keys().items() if k not in out})
        return out

    @classmethod
    def renamed_keys(cls) -> dict[str, tuple[str, str]]:
        """Every renamed key of this section and the sections below it: ``{old key: (new key, meaning)}``."""
        out = {cls.key(old): (cls.key(new), meaning) for old, (new, meaning) in cls._renamed.items()}
        for hint in _field_types(cls).values():
            if isinstance(hint, type) and issubclass(hint, Section):
                out.update(hint.renamed_keys())
        return out
