"""A Harbor task's environment without a Docker daemon: its Dockerfile applied once into a cached layer, and what
this machine can and cannot honour of it.

**Approximation.** The base image is approximated by this host's root file system (read-only, the lowest layer):
``debian:*`` and ``python:X.Y*`` on a Debian host, ``ubuntu:*`` on a Debian or Ubuntu host (same package manager
and, for what tasks install, the same package names; ``BaseImage.approximated`` says what differs). A
``python:X.Y`` image gets Python X.Y from an interpreter of this machine (a pyenv build, or the system's), linked
at ``/usr/local/bin`` as the image has it. Any other base (alpine, fedora, a CUDA image, ...) is refused.

**Layers** (overlayfs, lowest first): this host's ``/``; the *base layer* (``/root`` made opaque, so the host's
home never shows, and the base's Python hard-linked in at its own prefix); the *task layer* (the Dockerfile's
steps: ``WORKDIR`` / ``ENV`` recorded, ``COPY`` / ``ADD`` of the build context, ``RUN`` under ``/bin/sh -c`` as
root with Docker's default capabilities and the host network, i.e. the registries reachable here). Layers are
built once per content (a hash of the base, the Dockerfile and the context) under ``cache_dir()`` and reused by
every execution, which adds its own writable upper layer (``sandbox/bwrap.py``, session mode). Building needs
root (mounting overlayfs and applying packages' owners): elsewhere ``EnvironmentUnavailable`` says so.

**Needs.** ``task_needs`` lists, per task, what its environment, verifier and oracle need from this machine (the
base image's approximation, a Python version, every host a script fetches from) and whether it is here;
``refusals`` turns the missing ones into one line each naming the instruction. Hosts are probed once per run
(``Reachability``: a TCP connection within a few seconds).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from gyre_jax.rollout.sandbox.dockerfile import Dockerfile, parse

LAYER_FORMAT = 2  # bump when how a layer is built changes: old layers are then rebuilt
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Docker's default capabilities of a container (what RUN steps and executions keep; SYS_ADMIN is not among them).
DOCKER_CAPS = ("chown", "dac_override", "fowner", "fsetid", "kill", "setgid", "setuid", "setpcap",
               "net_bind_service", "net_raw", "sys_chroot", "mknod", "audit_write", "setfcap")  # fmt: skip
_URL = re.compile(r"\b(?:https?|ftp|git)://([A-Za-z0-9.-]+)(?::(\d+))?[^\s'\"`)|;]*")
_SCP = re.compile(r"\bgit@([A-Za-z0-9.-]+):")
# A line that fetches what it names (a URL elsewhere, e.g. an XML namespace in inline data, is not a need).
_FETCH = re.compile(
    r"\b(curl|wget|git|pip3?|uvx?|npm|npx|apt(-get)?|aria2c|fetch|download\w*|urlopen|urlretrieve|"
    r"requests|httpx|clone|cargo|go|install|ADD|Rscript|R)\b"
)
_PYTHON_IMAGE = re.compile(r"^(?:docker\.io/)?(?:library/)?python:(\d+)\.(\d+)(?:\.\d+)?(?:-(.*))?$")


class EnvironmentUnavailable(RuntimeError):
    """This machine cannot build or mount task environments; the message says why and what to do."""


class EnvironmentBuildError(RuntimeError):
    """A task's Dockerfile step failed; the message names the step and ends with the build log's tail."""


@dataclass(frozen=True)
class Host:
    """What this machine offers as a base: its distribution and the Pythons found (version -> prefix)."""

    distro: str  # "debian", "ubuntu", ... (os-release ID)
    release: str  # "12", "24.04" (VERSION_ID)
    codename: str
    pythons: dict[str, str]  # "3.13" -> "/root/.pyenv/versions/3.13.0" (a prefix with bin/pythonX.Y)

    @classmethod
    def detect(cls) -> Host:
        info = {}
        try:
            for line in Path("/etc/os-release").read_text().splitlines():
                key, _, value = line.partition("=")
                info[key] = value.strip().strip('"')
        except OSError:
            pass
        pythons: dict[str, str] = {}
        roots = [Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"]
        for root in roots:
            for prefix in sorted(
                root.glob("*"), key=lambda p: [int(x) if x.isdigit() else 0 for x in p.name.split(".")]
            ):
                match = re.fullmatch(r"(\d+)\.(\d+)\.\d+", prefix.name)
                if match and (prefix / "bin" / f"python{match[1]}.{match[2]}").exists():
                    pythons[f"{match[1]}.{match[2]}"] = str(prefix)  # the newest patch release wins
        for exe in sorted(Path("/usr/bin").glob("python3.*")):
            match = re.fullmatch(r"python(\d+)\.(\d+)", exe.name)
            if match:
                pythons.setdefault(f"{match[1]}.{match[2]}", "/usr")
        return cls(info.get("ID", ""), info.get("VERSION_ID", ""), info.get("VERSION_CODENAME", ""), pythons)

    @property
    def name(self) -> str:
        return f"{self.distro} {self.release} ({self.codename})" if self.codename else f"{self.distro} {self.release}"


@dataclass(frozen=True)
class BaseImage:
    """How a ``FROM`` image is approximated here: the host's root, plus ``python`` (version, prefix) for
    ``python:X.Y`` images; ``approximated`` is "" for an exact match, else what differs."""

    image: str
    python: str = ""
    python_prefix: str = ""
    approximated: str = ""

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def base_image(image: str, host: Host) -> BaseImage | str:
    """``image`` as approximated on ``host``, or the one-line reason it cannot be."""
    if host.distro not in ("debian", "ubuntu"):
        return f"FROM {image}: this host ({host.name}) is not Debian or Ubuntu; task environments need one"
    name = image.split("@")[0]
    match = _PYTHON_IMAGE.match(name)
    if match:
        version, variant = f"{match[1]}.{match[2]}", match[3] or ""
        if host.distro != "debian":
            return f"FROM {image}: python images are Debian-based; this host is {host.name}"
        if version not in host.pythons:
            have = ", ".join(sorted(host.pythons)) or "none"
            return f"FROM {image}: no Python {version} on this machine (have {have}; e.g. `pyenv install {version}`)"
        if "alpine" in variant or "windows" in variant:
            return f"FROM {image}: {variant} images are not approximated by a Debian host"
        diff = (
            []
            if (host.codename and host.codename in variant)
            else [f"{variant or 'default'} distribution -> {host.name}"]
        )
        prefix = host.pythons[version]
        if prefix == "/usr":
            diff.append(f"Python {version} of the system (no pip unless installed)")
        return BaseImage(image, version, prefix, "; ".join(diff))
    repo, _, tag = name.rpartition(":") if ":" in name.split("/")[-1] else (name, "", "latest")
    repo = repo.removeprefix("docker.io/").removeprefix("library/")
    if repo == "debian":
        exact = tag.split("-")[0] in (host.release, host.codename, f"{host.release}.0") and host.distro == "debian"
        return BaseImage(image, approximated="" if exact else f"debian:{tag} -> {host.name}")
    if repo == "ubuntu":
        exact = host.distro == "ubuntu" and tag in (host.release, host.codename)
        return BaseImage(image, approximated="" if exact else f"ubuntu:{tag} -> {host.name} (apt, same package names)")
    return f"FROM {image}: only debian, ubuntu and python base images are approximated on this host ({host.name})"


def cache_dir() -> Path:
    """Where built layers live: ``$GYRE_ENV_CACHE``, else ``/var/tmp/gyre-environments``."""
    return Path(os.environ.get("GYRE_ENV_CACHE", "/var/tmp/gyre-environments"))


def context_digest(context: Path) -> str:
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(context):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            digest.update(str(path.relative_to(context)).encode() + b"\0")
            digest.update(os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()


@dataclass
class Layer:
    """A built task environment: ``lower`` (overlay lower dirs, highest first, ending with ``/``), the image's
    ``env`` and ``workdir``, the ``base`` it approximates, and its build record."""

    lower: list[str]
    env: dict[str, str]
    workdir: str
    base: BaseImage
    path: Path
    build_s: float = 0.0
    cached: bool = False

    def to_dict(self) -> dict:
        return {"lower": self.lower, "env": self.env, "workdir": self.workdir, "base": asdict(self.base),
                "build_s": self.build_s}  # fmt: skip


@dataclass(frozen=True)
class Need:
    """One thing a task needs here: ``what`` (e.g. "host astral.sh:443"), ``where`` (the line naming it),
    ``phase`` ("environment" | "verifier" | "oracle"), and whether this machine ``has`` it."""

    phase: str
    what: str
    where: str
    has: bool
    detail: str = ""

    def line(self) -> str:
        state = "ok" if self.has else "MISSING"
        return f"{self.phase}: {self.what} [{state}] ({self.where}){': ' + self.detail if self.detail else ''}"


class Reachability:
    """Which hosts answer a TCP connection from here (probed in parallel, once each)."""

    def __init__(self, timeout_s: float = 4.0) -> None:
        self.timeout_s = timeout_s
        self._known: dict[tuple[str, int], bool] = {}
        self._lock = threading.Lock()

    def probe(self, endpoints: set[tuple[str, int]]) -> None:
        todo = [e for e in endpoints if e not in self._known]
        if not todo:
            return
        with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
            for endpoint, ok in zip(todo, pool.map(self._connect, todo)):
                with self._lock:
                    self._known[endpoint] = ok

    def _connect(self, endpoint: tuple[str, int]) -> bool:
        try:
            with socket.create_connection(endpoint, timeout=self.timeout_s):
                return True
        except OSError:
            return False

    def __call__(self, host: str, port: int) -> bool:
        self.probe({(host, port)})
        return self._known[(host, port)]


# Calls that fetch from a hub without naming a URL: the host they reach.
_IMPLICIT = ((re.compile(r"\b(from_pretrained|hf_hub_download|snapshot_download|huggingface-cli|load_dataset)\b"),
              "huggingface.co", 443),)  # fmt: skip


def fetched_hosts(text: str) -> list[tuple[int, str, int, str]]:
    """(line number, host, port, the URL or call) of every URL (http, https, ftp, git, git@host:) a script fetches
    from (on a line with a fetching command), and of the hub calls that fetch without one (``from_pretrained``)."""
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        for pattern, host, port in _IMPLICIT:
            hit = pattern.search(line)
            if hit and not line.lstrip().startswith("#"):
                out.append((number, host, port, hit.group(0)))
        if line.lstrip().startswith("#") or not _FETCH.search(line):
            continue
        for match in _URL.finditer(line):
            scheme = match.group(0).split(":")[0]
            port = int(match.group(2)) if match.group(2) else {"https": 443, "http": 80, "ftp": 21, "git": 9418}[scheme]
            host = (urlparse(match.group(0)).hostname or match.group(1)).lower()
            if host not in ("localhost", "127.0.0.1", "0.0.0.0") and "." in host:
                out.append((number, host, port, match.group(0)))
        for match in _SCP.finditer(line):
            if match.group(1).lower() not in ("localhost", "127.0.0.1"):
                out.append((number, match.group(1).lower(), 22, match.group(0)))
    return out


def read_dockerfile(task_dir: Path) -> Dockerfile | None:
    path = Path(task_dir) / "environment" / "Dockerfile"
    return parse(path.read_text(encoding="utf-8", errors="replace")) if path.is_file() else None


def task_needs(task_dir: Path, host: Host, reach: Reachability) -> list[Need]:
    """What the task at ``task_dir`` needs from this machine (see the module docstring), in phase order."""
    task_dir = Path(task_dir)
    needs: list[Need] = []
    df = read_dockerfile(task_dir)
    scripts = [
        (
            "environment",
            "environment/Dockerfile",
            "\n".join(s.line if s.kind == "RUN" else "" for s in df.steps) if df else "",
        )
    ]
    for phase, folder in (("verifier", "tests"), ("oracle", "solution")):  # every text file the phase runs
        for path in sorted((task_dir / folder).rglob("*")) if (task_dir / folder).is_dir() else []:
            if path.is_file() and path.stat().st_size < 1_000_000:
                text = path.read_text(encoding="utf-8", errors="replace")
                if "\0" not in text:
                    scripts.append((phase, str(path.relative_to(task_dir)), text))
    if df is not None:
        for refusal in df.refusals:
            needs.append(Need("environment", "docker", refusal, False, "cannot be applied without a Docker daemon"))
        base = base_image(df.base, host) if df.base else "the Dockerfile has no FROM"
        if isinstance(base, str):
            needs.append(
                Need("environment", f"base image {df.base or '?'}", "environment/Dockerfile FROM", False, base)
            )
        else:
            what = f"base image {df.base}" + (f" with Python {base.python}" if base.python else "")
            needs.append(Need("environment", what, "environment/Dockerfile FROM", True,
                              f"approximated: {base.approximated}" if base.approximated else "this host"))  # fmt: skip
    found = [(phase, rel, hit) for phase, rel, text in scripts for hit in fetched_hosts(text)]
    reach.probe({(h, p) for _, _, (_, h, p, _) in found})
    seen = set()
    for phase, rel, (number, host, port, url) in found:
        if (phase, host, port) in seen:
            continue
        seen.add((phase, host, port))
        where = f"{rel}" + (f" line {number}" if phase != "environment" else "")
        if phase == "environment":
            where = next((f"environment/Dockerfile line {s.lineno}" for s in df.steps if url in s.line), rel)
        needs.append(Need(phase, f"host {host}:{port}", where, reach(host, port), f"fetches {url[:100]}"))
    return needs


def refusals(needs: list[Need], phases: tuple[str, ...] = ("environment", "verifier")) -> list[str]:
    """One line per missing need of ``phases`` (what refuses the task for training; add "oracle" to check it)."""
    out = []
    for need in needs:
        if need.phase in phases and not need.has:
            reason = (
                need.detail
                if need.what.startswith(("base image", "docker"))
                else f"{need.what} is not reachable from this machine"
            )
            out.append(
                f"{need.phase}: {need.where}: {reason}" + (f" ({need.detail})" if need.what.startswith("host") else "")
            )
    return out


# -- building ---------------------------------------------------------------------------------------------------


# Mounts a layer stack in the calling (private) mount namespace, then execs "$@". The host's root is the lowest
# layer through a read-only overlay of its own ("$s/host": "/" plus an empty tmpfs dir): overlayfs refuses a
# lower layer that contains another layer (the layers live under /), but not one inside a stacked overlay.
MOUNT_SCRIPT = r"""set -e
s=$1; lowers=$2; upper=$3; work=$4; merged=$5; shift 5
mkdir -p "$s/empty" "$s/host" "$merged"
mount -t tmpfs -o size=64k,mode=755 gyre-empty "$s/empty"
mkdir "$s/empty/e"
mount -t overlay overlay -o ro,lowerdir=/:"$s/empty/e" "$s/host"
mount -t overlay overlay -o "lowerdir=$lowers:$s/host,upperdir=$upper,workdir=$work" "$merged"
exec "$@"
"""


def mount_argv(state: Path, lower: list[str], upper: Path, work: Path, merged: Path) -> list[str]:
    """argv prefix: a private mount namespace with ``lower`` (highest first) over the host's root, ``upper``
    writable, merged at ``merged``; the command given after it runs there."""
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", MOUNT_SCRIPT, "gyre-mount",
            str(state), ":".join(lower), str(upper), str(work), str(merged)]  # fmt: skip


def check_can_build() -> None:
    """Raises EnvironmentUnavailable unless this process can mount overlayfs in a private mount namespace."""
    if os.geteuid() != 0:
        raise EnvironmentUnavailable(
            "task environments (a Dockerfile applied without docker) need root here (overlayfs mounts and package "
            "owners); run as root, or use sandbox='docker' with a daemon, or a suite without Dockerfile steps"
        )
    for tool in ("unshare", "bwrap", "nsenter", "setpriv"):
        if shutil.which(tool) is None:
            raise EnvironmentUnavailable(f"task environments need `{tool}` on PATH (util-linux / bubblewrap)")


def _opaque(path: Path) -> None:
    os.setxattr(path, "trusted.overlay.opaque", b"y")


def _link_tree(src: Path, dst: Path) -> None:
    """``src`` copied to ``dst`` as hard links (a lower layer is never written), plain copies across devices."""
    try:
        shutil.copytree(src, dst, symlinks=True, copy_function=os.link)
    except OSError:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, symlinks=True)


def _build_base(base: BaseImage, root: Path) -> Path:
    """The base layer's upper dir for ``base`` (built once): an opaque /root, the Python linked at /usr/local."""
    upper = root / f"base-{base.key()}-v{LAYER_FORMAT}"
    if (upper / ".gyre-done").exists():
        return upper
    tmp = upper.with_name(upper.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "root").mkdir(parents=True)
    _opaque(tmp / "root")  # the host's home never shows through
    for name in ("bashrc", "profile"):  # root's dot files as Debian's and Ubuntu's base-files install them
        skel = Path("/usr/share/base-files") / f"dot.{name}"
        if skel.is_file():
            shutil.copy2(skel, tmp / "root" / f".{name}")
    if base.python:
        prefix = Path(base.python_prefix)
        if prefix != Path("/usr"):
            if str(prefix).startswith("/root/"):
                _link_tree(prefix, tmp / str(prefix).lstrip("/"))
            bindir = tmp / "usr" / "local" / "bin"
            bindir.mkdir(parents=True, exist_ok=True)
            v = base.python
            for name, target in ((f"python{v}", f"python{v}"), ("python3", f"python{v}"), ("python", f"python{v}"),
                                 (f"pip{v}", f"pip{v}"), ("pip3", f"pip{v}"), ("pip", f"pip{v}")):  # fmt: skip
                if (prefix / "bin" / target).exists():
                    (bindir / name).symlink_to(prefix / "bin" / target)
        else:
            bindir = tmp / "usr" / "local" / "bin"
            bindir.mkdir(parents=True, exist_ok=True)
            for name in ("python3", "python"):
                (bindir / name).symlink_to(f"/usr/bin/python{base.python}")
    (tmp / ".gyre-done").write_text("")
    if upper.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.rename(tmp, upper)
    return upper


def layer_key(task_dir: Path, base: BaseImage) -> str:
    context = Path(task_dir) / "environment"
    digest = hashlib.sha256(f"{LAYER_FORMAT}\0{base.key()}\0".encode())
    digest.update(context_digest(context).encode())
    return digest.hexdigest()[:20]


def build_layer(task_dir: Path, host: Host, root: Path | None = None, timeout_s: float = 1800.0,
                log=None) -> Layer:  # fmt: skip
    """The task's environment layer, built now or found in the cache (a file lock keeps concurrent builders of
    the same layer to one). Raises EnvironmentBuildError naming the failing step, or EnvironmentUnavailable."""
    check_can_build()
    task_dir = Path(task_dir)
    df = read_dockerfile(task_dir)
    if df is None:
        raise EnvironmentBuildError(f"{task_dir}/environment has no Dockerfile")
    if df.refusals:
        raise EnvironmentBuildError(df.refusals[0])
    base = base_image(df.base, host)
    if isinstance(base, str):
        raise EnvironmentBuildError(base)
    root = Path(root or cache_dir())
    root.mkdir(parents=True, exist_ok=True)
    base_upper = _build_base(base, root)
    path = root / f"layer-{layer_key(task_dir, base)}"
    lock = root / f"{path.name}.lock"
    with open(lock, "w") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)
        meta = path / "layer.json"
        if meta.is_file():
            data = json.loads(meta.read_text())
            return Layer([str(path / "upper"), str(base_upper)], data["env"], data["workdir"], base, path,
                         data.get("build_s", 0.0), cached=True)  # fmt: skip
        shutil.rmtree(path, ignore_errors=True)
        (path / "upper").mkdir(parents=True)
        (path / "work").mkdir()
        plan = {"steps": [{"kind": s.kind, "args": list(s.args), "line": s.line, "lineno": s.lineno} for s in df.steps],
                "merged": str(path / "merged"), "context": str(task_dir / "environment"), "shell": list(df.shell),
                "upper": str(path / "upper"), "work": str(path / "work"), "caps": list(DOCKER_CAPS),
                "hide": [str(root)], "path": image_path(base)}  # fmt: skip
        (path / "plan.json").write_text(json.dumps(plan))
        t0 = time.monotonic()
        tmp_upper = path / "upper" / "tmp"  # the image's own /tmp: the host's never shows through
        tmp_upper.mkdir()
        tmp_upper.chmod(0o1777)
        _opaque(tmp_upper)
        argv = [
            *mount_argv(path / "mnt", [str(base_upper)], path / "upper", path / "work", path / "merged"),
            sys.executable,
            "-I",
            str(Path(__file__).with_name("build_layer.py")),
            str(path / "plan.json"),
        ]
        with open(path / "build.log", "wb") as out:
            try:
                done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      timeout=timeout_s)  # fmt: skip
                code = done.returncode
            except subprocess.TimeoutExpired:
                code = None
        build_s = time.monotonic() - t0
        tail = (path / "build.log").read_bytes()[-1500:].decode("utf-8", errors="replace").strip()
        if code != 0:
            failed = (path / "failed.txt").read_text().strip() if (path / "failed.txt").exists() else ""
            what = failed or ("the build exceeded build_timeout_sec" if code is None else f"status {code}")
            raise EnvironmentBuildError(
                f"environment build failed at {what} (log {path / 'build.log'}): ...{tail[-600:]}"
            )
        shutil.rmtree(path / "work", ignore_errors=True)
        data = {"env": df.env, "workdir": df.workdir_or_default, "build_s": round(build_s, 2), "base": asdict(base)}
        meta.write_text(json.dumps(data))
        return Layer([str(path / "upper"), str(base_upper)], df.env, df.workdir_or_default, base, path,
                     round(build_s, 2))  # fmt: skip


def image_path(base: BaseImage) -> str:
    """The image's PATH: Docker's default, with the base Python's own bin (where ``pip install`` puts scripts:
    /usr/local/bin in the real image) right after /usr/local/bin."""
    if base.python_prefix and base.python_prefix != "/usr":
        return DEFAULT_PATH.replace("/usr/local/bin:", f"/usr/local/bin:{base.python_prefix}/bin:")
    return DEFAULT_PATH


def image_env(layer: Layer) -> dict[str, str]:
    """The environment a process of the image starts with: its PATH (``image_path``) and HOME for root, then the
    Dockerfile's ENVs."""
    return {"PATH": image_path(layer.base), "HOME": "/root", **layer.env}


def seed_workspace(layer: Layer, workspace: Path) -> None:
    """``workspace`` filled with what the layers hold at the image's WORKDIR (whiteouts dropped), highest layer
    winning; the host's own directory at that path (the lowest layer, ``/``) is never copied."""
    workspace.mkdir(parents=True, exist_ok=True)
    rel = layer.workdir.lstrip("/")
    for lower in reversed(layer.lower):  # base first, then the task layer over it
        src = Path(lower) / rel
        if not src.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(src):
            out = workspace / os.path.relpath(dirpath, src)
            out.mkdir(exist_ok=True)
            for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                source, target = Path(dirpath) / name, out / name
                st = os.lstat(source)
                if (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == 0:  # a whiteout: deleted by a RUN step
                    if target.is_dir() and not target.is_symlink():
                        shutil.rmtree(target)
                    elif target.exists() or target.is_symlink():
                        target.unlink()
                    continue
                if target.is_symlink() or target.is_file():
                    target.unlink()
                if source.is_symlink():
                    target.symlink_to(os.readlink(source))
                else:
                    shutil.copy2(source, target)


@dataclass
class Builds:
    """The layers of a run's tasks, built on first use (thread-safe), and the failures, kept as given."""

    host: Host = field(default_factory=Host.detect)
    root: Path | None = None
    _layers: dict[str, Layer | EnvironmentBuildError] = field(default_factory=dict)
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def layer(self, task_dir: Path, timeout_s: float = 1800.0) -> Layer:
        key = str(Path(task_dir).resolve())
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._layers:
                try:
                    self._layers[key] = build_layer(Path(task_dir), self.host, self.root, timeout_s)
                except EnvironmentBuildError as exc:
                    self._layers[key] = exc
            found = self._layers[key]
        if isinstance(found, EnvironmentBuildError):
            raise found
        return found
