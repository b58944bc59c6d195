"""A Dockerfile read into the steps a daemon-less build applies (``environment.py``), and what it cannot honour.

``parse(text)`` -> ``Dockerfile``: its base image (``FROM``), then one ``Step`` per instruction in order, with
line continuations joined, comments dropped, ``ARG`` / ``ENV`` values substituted (``$VAR``, ``${VAR}``,
``${VAR:-default}``) and each step's source line kept for messages. ``Dockerfile.refusals`` names each
instruction that cannot be applied without Docker (a second ``FROM`` stage, ``COPY --from`` another image, a
heredoc, ``ADD`` of a URL, a non-root ``USER``), one line each; ``Dockerfile.notes`` names what is read but has no
effect here (``CMD``, ``EXPOSE``, ...; Harbor keeps its containers up with its own command). Pure: reads nothing.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import PurePosixPath

DEFAULT_WORKDIR = "/app"
APPLIED = ("FROM", "WORKDIR", "ENV", "ARG", "COPY", "ADD", "RUN", "USER", "SHELL")
IGNORED = ("CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "VOLUME", "HEALTHCHECK", "STOPSIGNAL", "MAINTAINER")
_VAR = re.compile(r"\$(?:\{(\w+)(?::?-([^}]*))?\}|(\w+))")


@dataclass(frozen=True)
class Step:
    """One instruction to apply: ``kind`` in APPLIED; ``args`` its words (RUN: ``[shell command]`` or the exec
    form's argv with ``exec_form``); ``flags`` its ``--name=value`` options; ``line`` the text as written."""

    kind: str
    args: tuple[str, ...]
    line: str
    lineno: int
    flags: tuple[tuple[str, str], ...] = ()
    exec_form: bool = False


@dataclass
class Dockerfile:
    """The parsed file: ``base`` (the first FROM's image), ``steps`` after it, the final ``workdir`` and ``env``
    (what a process in the image starts with), ``refusals`` and ``notes`` (one line each, naming the instruction)."""

    base: str = ""
    steps: list[Step] = field(default_factory=list)
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    shell: tuple[str, ...] = ("/bin/sh", "-c")
    refusals: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def workdir_or_default(self) -> str:
        """Where the workspace is mounted: the last WORKDIR, or /app (Harbor's convention) without one."""
        return self.workdir if self.workdir != "/" else DEFAULT_WORKDIR


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction text) with ``\\`` continuations joined and comments / blanks dropped."""
    out, buf, start = [], "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):  # a comment line inside a continued instruction
            continue
        if not buf:
            start = number
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        out.append((start, (buf + raw).strip()))
        buf = ""
    if buf.strip():
        out.append((start, buf.strip()))
    return out


def substitute(text: str, values: dict[str, str]) -> str:
    """``$VAR``, ``${VAR}`` and ``${VAR:-default}`` replaced from ``values`` (unknown: empty or the default)."""

    def one(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        if name in values:
            return values[name]
        return match.group(2) or ""

    return _VAR.sub(one, text)


def _split_flags(words: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    flags = []
    while words and words[0].startswith("--"):
        name, _, value = words.pop(0)[2:].partition("=")
        flags.append((name, value))
    return flags, words


def _pairs(rest: str) -> list[tuple[str, str]]:
    """ENV / ARG operands: ``K=V K2="v 2"`` or the legacy ``K value with spaces``."""
    words = shlex.split(rest, posix=True)
    if words and "=" not in words[0]:
        return [(words[0], rest.split(None, 1)[1] if len(rest.split(None, 1)) > 1 else "")]
    return [(w.partition("=")[0], w.partition("=")[2]) for w in words]


def parse(text: str) -> Dockerfile:
    """The steps of a Dockerfile (module docstring); never raises on content: what it cannot read is a refusal."""
    df = Dockerfile()
    args: dict[str, str] = {}  # ARG values (before and after FROM)
    env: dict[str, str] = {}
    stages, heredoc_end = 0, ""
    for lineno, line in logical_lines(text):
        if heredoc_end:  # the body of a refused heredoc
            heredoc_end = "" if line.strip() == heredoc_end else heredoc_end
            continue
        word, _, rest = line.partition(" ")
        kind, rest = word.upper(), rest.strip()
        where = f"Dockerfile line {lineno} `{line[:120]}`"
        heredoc = re.search(r"<<-?\s*['\"]?(\w+)", rest) if kind in ("RUN", "COPY", "ADD") else None
        if heredoc:
            df.refusals.append(f"{where}: heredocs need BuildKit (docker); not applied without it")
            heredoc_end = heredoc.group(1)
            continue
        if kind == "FROM":
            stages += 1
            if stages > 1:
                df.refusals.append(f"{where}: a second build stage (multi-stage builds need docker)")
                continue
            words = substitute(rest, args).split()
            _, words = _split_flags(words)
            df.base = words[0] if words else ""
            continue
        if kind == "ARG":
            for name, value in _pairs(rest):
                args.setdefault(name, substitute(value, {**args, **env}))
            continue
        if stages == 0:
            df.refusals.append(f"{where}: an instruction before FROM")
            continue
        values = {**args, **env}
        if kind in IGNORED:
            df.notes.append(f"{where}: {kind} has no effect without docker (the sandbox runs its own command)")
            continue
        if kind == "ONBUILD":
            df.notes.append(f"{where}: ONBUILD applies only to images built FROM this one")
            continue
        if kind not in APPLIED:
            df.refusals.append(f"{where}: unknown instruction {kind}")
            continue
        if kind == "ENV":
            for name, value in _pairs(rest):
                env[name] = substitute(value, values)
                df.steps.append(Step("ENV", (name, env[name]), line, lineno))
            continue
        if kind == "WORKDIR":
            path = substitute(rest, values).strip().strip("\"'")
            df.workdir = path if path.startswith("/") else str(PurePosixPath(df.workdir) / path)
            df.steps.append(Step("WORKDIR", (df.workdir,), line, lineno))
            continue
        if kind == "USER":
            user = substitute(rest, values).strip().split(":")[0]
            if user not in ("root", "0"):
                df.refusals.append(f"{where}: USER {user}: processes run as root in this sandbox")
            continue
        if kind == "SHELL":
            try:
                df.shell = tuple(json.loads(rest))
            except (json.JSONDecodeError, TypeError):
                df.refusals.append(f"{where}: SHELL needs the JSON form")
            continue
        if kind == "RUN":
            flags, body = _split_flags(rest.split(" ")) if rest.startswith("--") else ([], [rest])
            command = " ".join(body).strip()
            if command.startswith("["):
                try:
                    argv = json.loads(command)
                    df.steps.append(Step("RUN", tuple(str(a) for a in argv), line, lineno, tuple(flags), True))
                except json.JSONDecodeError:
                    df.refusals.append(f"{where}: RUN's exec form is not valid JSON")
                continue
            if any(name == "mount" for name, _ in flags):
                df.notes.append(f"{where}: RUN --mount is BuildKit's cache/secret mount: run without it")
            df.steps.append(Step("RUN", (command,), line, lineno, tuple(flags)))
            continue
        # COPY / ADD
        body = substitute(rest, values)
        if body.lstrip().startswith("["):
            try:
                words = [str(w) for w in json.loads(body)]
                flags: list[tuple[str, str]] = []
            except json.JSONDecodeError:
                df.refusals.append(f"{where}: {kind}'s JSON form is not valid JSON")
                continue
        else:
            flags, words = _split_flags(shlex.split(body, posix=True))
        if dict(flags).get("from"):
            df.refusals.append(f"{where}: {kind} --from={dict(flags)['from']} needs that image (docker)")
            continue
        if len(words) < 2:
            df.refusals.append(f"{where}: {kind} needs a source and a destination")
            continue
        if kind == "ADD" and any(re.match(r"^[a-z]+://", w) for w in words[:-1]):
            df.refusals.append(f"{where}: ADD of a URL is not applied (fetch it in a RUN step)")
            continue
        df.steps.append(Step(kind, tuple(words), line, lineno, tuple(flags)))
    df.env = env
    if stages == 0:
        df.refusals.append("the Dockerfile has no FROM")
    return df
