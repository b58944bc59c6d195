#!/usr/bin/env bash
set -euo pipefail
cat > iniparse.py <<'EOF'
"""An INI parser with ${section:key} interpolation."""

import re

_MISSING = object()
_INLINE = re.compile(r"[ \t][;#]")
_TRUE = {"1", "yes", "true", "on"}
_FALSE = {"0", "no", "false", "off"}


class ParseError(ValueError):
    def __init__(self, lineno, line, what):
        self.lineno, self.line = lineno, line
        super().__init__(f"line {lineno}: {what}: {line!r}")


class InterpolationError(ValueError):
    pass


class InterpolationCycleError(InterpolationError):
    def __init__(self, chain):
        self.chain = list(chain)
        super().__init__("interpolation cycle: " + " -> ".join(self.chain))


class NoSectionError(KeyError):
    pass


class NoOptionError(KeyError):
    pass


def _strip_comment(text):
    m = _INLINE.search(text)
    return (text[: m.start()] if m else text).strip()


class Config:
    def __init__(self, data):
        self._data = data  # section -> {key: raw value}, DEFAULT included

    def sections(self):
        return [s for s in self._data if s != "DEFAULT"]

    def has_section(self, name):
        return name in self._data and name != "DEFAULT"

    def _section(self, section):
        if not self.has_section(section):
            raise NoSectionError(f"no section [{section}]")
        return self._data[section]

    def options(self, section):
        own = self._section(section)
        return list(own) + [k for k in self._data.get("DEFAULT", {}) if k not in own]

    def _raw(self, section, key):
        own = self._section(section)
        key = key.lower()
        if key in own:
            return own[key]
        default = self._data.get("DEFAULT", {})
        if key in default:
            return default[key]
        raise NoOptionError(f"no option {key!r} in section [{section}]")

    def _interpolate(self, section, key, stack):
        here = f"{section}:{key}"
        if here in stack:
            raise InterpolationCycleError(stack[stack.index(here):] + [here])
        stack = stack + [here]
        raw = self._raw(section, key)
        out, i = [], 0
        while i < len(raw):
            ch = raw[i]
            if ch == "$" and raw.startswith("$$", i):
                out.append("$")
                i += 2
            elif ch == "$" and raw.startswith("${", i):
                end = raw.find("}", i)
                if end < 0:
                    raise InterpolationError(f"unterminated '${{' in option {here!r}")
                ref = raw[i + 2:end]
                rsec, _, rkey = ref.rpartition(":")
                rsec = rsec.strip() or section
                rkey = rkey.strip().lower()
                try:
                    out.append(self._interpolate(rsec, rkey, stack))
                except (NoSectionError, NoOptionError):
                    raise InterpolationError(
                        f"option {here!r} refers to ${{{ref}}}, which does not exist") from None
                i = end + 1
            else:
                out.append(ch)
                i += 1
        return "".join(out)

    def get(self, section, key, fallback=_MISSING, raw=False):
        try:
            if raw:
                return self._raw(section, key)
            self._raw(section, key)
        except (NoSectionError, NoOptionError):
            if fallback is _MISSING:
                raise
            return fallback
        return self._interpolate(section, key.lower(), [])

    def _convert(self, section, key, fallback, conv, what):
        value = self.get(section, key, fallback=fallback)
        if fallback is not _MISSING and value is fallback:
            return value
        try:
            return conv(value)
        except ValueError:
            raise ValueError(f"[{section}] {key} = {value!r} is not {what}") from None

    def getint(self, section, key, fallback=_MISSING):
        return self._convert(section, key, fallback, int, "an integer")

    def getfloat(self, section, key, fallback=_MISSING):
        return self._convert(section, key, fallback, float, "a number")

    def getbool(self, section, key, fallback=_MISSING):
        def conv(v):
            v = v.strip().lower()
            if v in _TRUE:
                return True
            if v in _FALSE:
                return False
            raise ValueError(v)

        return self._convert(section, key, fallback, conv, "a boolean (1/yes/true/on or 0/no/false/off)")

    def getlist(self, section, key, sep=",", fallback=_MISSING):
        def conv(v):
            items = []
            for line in v.split("\n"):
                items.extend(x.strip() for x in line.split(sep))
            return [x for x in items if x]

        return self._convert(section, key, fallback, conv, "a list")

    def as_dict(self):
        return {s: {k: self.get(s, k) for k in self.options(s)} for s in self.sections()}


def parse(text):
    data = {}
    section = None
    last_key = None  # key that a continuation line may extend
    for lineno, line in enumerate(text.split("\n"), start=1):
        if line.endswith("\r"):
            line = line[:-1]
        stripped = line.strip()
        if not stripped:
            last_key = None
            continue
        if stripped[0] in ";#":
            continue
        if line[0] in " \t":
            if last_key is None:
                raise ParseError(lineno, line, "indented continuation line without a key above it")
            text_ = _strip_comment(line)
            data[section][last_key] += "\n" + text_
            continue
        if stripped.startswith("["):
            if not stripped.endswith("]"):
                raise ParseError(lineno, line, "section header must end with ']'")
            name = stripped[1:-1].strip()
            if not name or any(c in name for c in "[]:"):
                raise ParseError(lineno, line, "bad section name (empty or contains '[', ']' or ':')")
            if name in data:
                raise ParseError(lineno, line, f"duplicate section [{name}]")
            data[name] = {}
            section, last_key = name, None
            continue
        m = re.search(r"[=:]", line)
        if not m:
            raise ParseError(lineno, line, "expected 'key = value', '[section]' or a comment")
        key = line[: m.start()].strip().lower()
        if not key:
            raise ParseError(lineno, line, "empty key")
        if section is None:
            raise ParseError(lineno, line, "key outside of any section; add a [section] header above it")
        if key in data[section]:
            raise ParseError(lineno, line, f"duplicate key {key!r} in section [{section}]")
        data[section][key] = _strip_comment(line[m.end():])
        last_key = key
    return Config(data)
EOF
