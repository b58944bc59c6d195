#!/usr/bin/env bash
set -euo pipefail
cat > deepmerge.py <<'PYEOF'
"""Deep merge of configuration dictionaries."""

import copy

APPEND = "__append__"


class MergeError(ValueError):
    def __init__(self, path, message):
        super().__init__(f"{path}: {message}")
        self.path = path


def _join(path, key):
    return f"{path}.{key}" if path else str(key)


def _marker(value, path):
    """The list of an append marker, or None when `value` is not a marker."""
    if not isinstance(value, dict) or APPEND not in value:
        return None
    if len(value) != 1:
        raise MergeError(path, f"an {APPEND} marker must be the only key of its dict")
    items = value[APPEND]
    if not isinstance(items, list):
        raise MergeError(path, f"{APPEND} needs a list, got {type(items).__name__}")
    return items


def _kind(value):
    return "dict" if isinstance(value, dict) else "list" if isinstance(value, list) else "scalar"


def _fresh(value, path):
    """`value` taken as new: markers and None values resolved, deep-copied."""
    items = _marker(value, path)
    if items is not None:
        return copy.deepcopy(items)
    if isinstance(value, dict):
        return _merge_dicts({}, value, path)
    return copy.deepcopy(value)


def _merge_dicts(base, override, path):
    out = copy.deepcopy(base)
    for key, o in override.items():
        sub = _join(path, key)
        if o is None:
            out.pop(key, None)
            continue
        b = base.get(key)
        items = _marker(o, sub)
        if b is None:
            out[key] = _fresh(o, sub)
        elif items is not None:
            if not isinstance(b, list):
                raise MergeError(sub, f"cannot append to a {_kind(b)}")
            out[key] = copy.deepcopy(b) + copy.deepcopy(items)
        elif isinstance(b, dict) and isinstance(o, dict):
            out[key] = _merge_dicts(b, o, sub)
        elif _kind(b) != _kind(o):
            raise MergeError(sub, f"type conflict: a {_kind(b)} cannot be replaced by a {_kind(o)}")
        else:
            out[key] = copy.deepcopy(o)
    return out


def merge(base, override):
    if not isinstance(base, dict) or not isinstance(override, dict):
        raise TypeError("merge() needs two dicts")
    return _merge_dicts(base, override, "")


def merge_all(*configs):
    result = {}
    for config in configs:
        result = merge(result, config)
    return result
PYEOF
