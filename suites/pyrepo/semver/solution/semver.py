"""Semantic Versioning 2.0.0."""

import re
from dataclasses import dataclass
from functools import total_ordering

_NUM = r"0|[1-9]\d*"
_IDENT = re.compile(r"[0-9A-Za-z-]+")
_VERSION = re.compile(rf"({_NUM})\.({_NUM})\.({_NUM})(?:-([0-9A-Za-z.-]+))?(?:\+([0-9A-Za-z.-]+))?")


def _check_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _pre_ident(ident):
    if isinstance(ident, int) and not isinstance(ident, bool):
        return _check_int("a numeric prerelease identifier", ident)
    if not isinstance(ident, str) or not _IDENT.fullmatch(ident):
        raise ValueError(f"bad prerelease identifier {ident!r}")
    if ident.isdigit():
        if len(ident) > 1 and ident[0] == "0":
            raise ValueError(f"numeric prerelease identifier with a leading zero: {ident!r}")
        return int(ident)
    return ident


def _build_ident(ident):
    if not isinstance(ident, str) or not _IDENT.fullmatch(ident):
        raise ValueError(f"bad build identifier {ident!r}")
    return ident


def _pre_key(pre):
    # a release sorts after every prerelease; numeric identifiers before alphanumeric ones
    if not pre:
        return (1,)
    return (0, tuple((0, i, "") if isinstance(i, int) else (1, 0, i) for i in pre), len(pre))


@total_ordering
@dataclass(frozen=True, eq=False, init=False)
class Version:
    major: int
    minor: int
    patch: int
    prerelease: tuple
    build: tuple

    def __init__(self, major, minor=0, patch=0, prerelease=(), build=()):
        object.__setattr__(self, "major", _check_int("major", major))
        object.__setattr__(self, "minor", _check_int("minor", minor))
        object.__setattr__(self, "patch", _check_int("patch", patch))
        object.__setattr__(self, "prerelease", tuple(_pre_ident(i) for i in prerelease))
        object.__setattr__(self, "build", tuple(_build_ident(i) for i in build))

    @classmethod
    def parse(cls, text):
        m = _VERSION.fullmatch(text) if isinstance(text, str) else None
        if not m:
            raise ValueError(f"not a semantic version: {text!r}")
        major, minor, patch, pre, build = m.groups()
        return cls(
            int(major),
            int(minor),
            int(patch),
            pre.split(".") if pre is not None else (),
            build.split(".") if build is not None else (),
        )

    def _key(self):
        return (self.major, self.minor, self.patch, _pre_key(self.prerelease))

    def __eq__(self, other):
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() == other._key()

    def __lt__(self, other):
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() < other._key()

    def __hash__(self):
        return hash(self._key())

    def __str__(self):
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(str(i) for i in self.prerelease)
        if self.build:
            text += "+" + ".".join(self.build)
        return text

    def __repr__(self):
        return f"Version.parse({str(self)!r})"

    def bump_major(self):
        if self.prerelease and self.minor == 0 and self.patch == 0:
            return Version(self.major, 0, 0)
        return Version(self.major + 1, 0, 0)

    def bump_minor(self):
        if self.prerelease and self.patch == 0:
            return Version(self.major, self.minor, 0)
        return Version(self.major, self.minor + 1, 0)

    def bump_patch(self):
        if self.prerelease:
            return Version(self.major, self.minor, self.patch)
        return Version(self.major, self.minor, self.patch + 1)

    def bump_prerelease(self, label="rc"):
        if not isinstance(label, str):
            raise ValueError(f"label must be a str, got {label!r}")
        label_ids = [_pre_ident(i) for i in label.split(".")]
        if not self.prerelease:
            return Version(self.major, self.minor, self.patch + 1, (*label_ids, 1))
        pre = list(self.prerelease)
        if isinstance(pre[-1], int):
            pre[-1] += 1
        else:
            pre.append(1)
        return Version(self.major, self.minor, self.patch, pre)


def compare(a, b):
    va, vb = Version.parse(a), Version.parse(b)
    return (va > vb) - (va < vb)
