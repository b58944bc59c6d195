"""What a request body's JSON may hold beyond being parseable: bounded nesting, valid Unicode, finite numbers.

Python's ``json`` accepts ``NaN`` / ``Infinity`` literals and lone UTF-16 surrogates (``"\\ud800"``) and parses
arrays nested as deep as its recursion limit; each would fail later, deep in rendering, tokenizing or record
writing, as a 500. ``parse`` refuses them up front as one ``ValueError`` naming what and where (the server
answers it as a 400 in the route's error style).
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_JSON_DEPTH = 128  # nesting levels a body may have (a deep tool schema is ~20; recursive code downstream ~1000)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value (RFC 8259); send a finite number or null")


def parse(body: bytes) -> Any:
    """``body`` (UTF-8 JSON text) as a Python value; ValueError saying what is wrong if it is not valid JSON, is
    nested deeper than ``MAX_JSON_DEPTH``, holds a NaN / Infinity literal or a lone surrogate."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"it is nested too deeply; this proxy accepts up to {MAX_JSON_DEPTH} levels") from None
    check(data)
    return data


def check(data: Any) -> None:
    """ValueError naming the first place (``messages.0.content``) where ``data`` (parsed JSON) is nested deeper than
    ``MAX_JSON_DEPTH`` or a string (or key) holds a lone UTF-16 surrogate. Iterative: any depth is safe to check."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:
        value, where = stack.pop()
        if len(where) > MAX_JSON_DEPTH:
            raise ValueError(f"it is nested deeper than {MAX_JSON_DEPTH} levels (at {_path(where[:8])}...)")
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, (*where, "<key>"))
                stack.append((item, (*where, key)))
        elif isinstance(value, list):
            stack.extend((item, (*where, str(i))) for i, item in enumerate(value))


def _check_text(text: str, where: tuple[str, ...]) -> None:
    found = _SURROGATE.search(text)
    if found is not None:
        raise ValueError(
            f"{_path(where)} holds a lone UTF-16 surrogate {found.group()!r}, which is not Unicode text; pair a high "
            "surrogate (\\ud800-\\udbff) with a low one (\\udc00-\\udfff) or send the character itself"
        )


def _path(where: tuple[str, ...]) -> str:
    return ".".join(where) or "the body"
