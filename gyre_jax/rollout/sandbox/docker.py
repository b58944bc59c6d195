"""The "docker" backend: one container per process, from the task's ``environment/Dockerfile``.

The image is built once per context (``docker build -t gyre-task-<hash of the context's files> <context>``,
skipped when ``docker image inspect`` finds the tag). Each launch is ``docker run --rm --init -i --name
gyre-<id> --network none`` with the mounts as ``-v host:inside[:ro]``, this checkout read-only at
/opt/gyre-jax (PYTHONPATH points there), ``--cpus``/``--memory``, ``-w cwd`` and ``-e`` for the
environment. Network "proxy": the bridge's Unix socket is mounted at /run/gyre/proxy.sock and
``forward.py`` runs first inside (so the image needs ``python3``) and serves the proxy on 127.0.0.1:PORT;
with ``Limits.allow_internet`` the container gets Docker's default bridge network as well. ``cleanup``
removes the container (``docker rm -f``), since killing the ``docker run`` client does not stop it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from gyre_jax.rollout.sandbox.base import (
    PROXY_SOCKET_INSIDE,
    REPO_ROOT,
    Launch,
    Mount,
    Prepared,
    SandboxUnavailable,
    coerced_names,
    requested_limits,
)
from gyre_jax.rollout.sandbox.bridge import LazyBridge

REPO_INSIDE = "/opt/gyre-jax"
FORWARD_INSIDE = f"{REPO_INSIDE}/gyre_jax/rollout/sandbox/forward.py"
# What the docker client itself needs from this process's environment (the container gets Launch.env).
CLIENT_ENV = ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CONTEXT", "DOCKER_CERT_PATH",
              "DOCKER_TLS_VERIFY")  # fmt: skip
Builder = Callable[[str, Path, str], None]  # (docker executable, context dir, tag) -> None, raises on failure


def image_tag(context: Path) -> str:
    """``gyre-task-<16 hex>``: a hash of every file's relative path and bytes under ``context``."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(context):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            digest.update(str(path.relative_to(context)).encode() + b"\0")
            digest.update(os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
            digest.update(b"\0")
    return f"gyre-task-{digest.hexdigest()[:16]}"


def docker_build(exe: str, context: Path, tag: str) -> None:
    """Builds ``context`` as ``tag`` unless the image exists already; raises RuntimeError on failure."""
    if subprocess.run([exe, "image", "inspect", tag], capture_output=True).returncode == 0:
        return
    done = subprocess.run([exe, "build", "-t", tag, str(context)], capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip())[-600:]
        raise RuntimeError(f"`docker build -t {tag} {context}` failed (status {done.returncode}): {tail}")


def container_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with PYTHONPATH pointing at the checkout inside the container (/opt/gyre-jax)."""
    out = dict(env)
    entries = [REPO_INSIDE if p == str(REPO_ROOT) else p for p in out.get("PYTHONPATH", "").split(":") if p]
    out["PYTHONPATH"] = ":".join(entries if REPO_INSIDE in entries else [REPO_INSIDE, *entries])
    return out


def _volume(host: Path | str, inside: str, writable: bool) -> list[str]:
    if ":" in str(host) or ":" in inside:
        raise ValueError(f"docker -v cannot mount a path with ':' ({host} -> {inside}); rename it")
    return ["-v", f"{host}:{inside}" + ("" if writable else ":ro")]


def run_argv(exe: str, launch: Launch, image: str, name: str, socket: Path | None, port: int | None) -> list[str]:
    """The ``docker run`` argv for ``launch`` in a container ``name`` of ``image``; ``socket``/``port``: the
    proxy bridge (host socket) and port to serve inside, or None when the network is "none"."""
    share = launch.network == "proxy" and launch.limits.allow_internet
    argv = [exe, "run", "--rm", "--init", "-i", "--name", name, "--network", "bridge" if share else "none"]
    if launch.limits.cpus is not None:
        argv += ["--cpus", f"{launch.limits.cpus:g}"]
    if launch.limits.memory_mb is not None:
        argv += ["--memory", f"{launch.limits.memory_mb}m", "--memory-swap", f"{launch.limits.memory_mb}m"]
    for mount in sorted(launch.mounts, key=lambda m: len(Path(m.inside).parts)):
        argv += _volume(mount.host, mount.inside, mount.writable)
    argv += _volume(REPO_ROOT, REPO_INSIDE, False)
    inner = list(launch.argv)
    if socket is not None:
        argv += _volume(socket, PROXY_SOCKET_INSIDE, True)
        forward = ["python3", "-I", "-S", FORWARD_INSIDE, "--port", str(port), "--socket", PROXY_SOCKET_INSIDE]
        inner = [*forward, *(f"--unset={n}" for n in coerced_names(launch.env)), "--", *inner]
    argv += ["-w", launch.cwd]
    for key, value in container_env(launch.env).items():
        argv += ["-e", f"{key}={value}"]
    return [*argv, image, *inner]


class DockerSandbox:
    """See the module docstring. ``build`` replaces ``docker_build`` (tests, custom registries)."""

    name = "docker"
    maps_paths = True

    def __init__(
        self,
        proxy_address: tuple[str, int] | None,
        hide: Sequence[Path],
        state_dir: Path,
        *,
        build: Builder | None = None,
    ) -> None:
        self.proxy_address = proxy_address
        self.hide = [Path(p) for p in hide]  # a container sees only its image and its mounts anyway
        self.state_dir = Path(state_dir)
        self._build = build or docker_build
        self._lock = threading.Lock()
        self._images: dict[Path, str] = {}
        self._bridge = LazyBridge(proxy_address, self.state_dir)

    def _exe(self) -> str:
        exe = shutil.which("docker")
        if exe is None:
            raise SandboxUnavailable(
                "config.rollout.sandbox='docker' needs the docker CLI and a running daemon: `docker` is not on "
                "PATH; install Docker Engine (https://docs.docker.com/engine/install/), or use sandbox='bwrap'"
            )
        return exe

    def check(self) -> None:
        """Raises SandboxUnavailable unless ``docker info`` answers within 15 s."""
        exe = self._exe()
        try:
            done = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=15, stdin=subprocess.DEVNULL)
            lines = (done.stderr.strip() or done.stdout.strip()).splitlines()
            problem = (lines[0] if lines else f"status {done.returncode}") if done.returncode else None
        except (OSError, subprocess.TimeoutExpired) as exc:
            problem = str(exc).splitlines()[0]
        if problem is not None:
            raise SandboxUnavailable(
                f"config.rollout.sandbox='docker' needs a running Docker daemon: `docker info` failed: {problem}; "
                "start dockerd, or use sandbox='bwrap'"
            )

    def path(self, mount: Mount) -> str:
        return mount.inside

    def image(self, context: Path) -> str:
        """The image tag for ``context``, built on first use (once per context for this sandbox)."""
        context = Path(context).resolve()
        if not (context / "Dockerfile").is_file():
            raise ValueError(f"sandbox='docker' needs a Dockerfile in the task's environment dir {context}")
        with self._lock:
            if context not in self._images:
                tag = image_tag(context)
                self._build(self._exe(), context, tag)
                self._images[context] = tag
            return self._images[context]

    def prepare(self, launch: Launch) -> Prepared:
        """The ``docker run`` argv for ``launch`` (building its image first if needed), and the record."""
        if launch.image_context is None:
            raise ValueError(
                "sandbox='docker' needs Launch.image_context: the task's environment/ dir with a Dockerfile"
            )
        exe = self._exe()
        image = self.image(launch.image_context)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        name = f"gyre-{uuid.uuid4().hex[:16]}"
        proxied = launch.network == "proxy"
        socket = self._bridge.socket_path() if proxied else None
        argv = run_argv(exe, launch, image, name, socket, self._bridge.port if proxied else None)
        limited = launch.limits.cpus is not None or launch.limits.memory_mb is not None
        share = proxied and launch.limits.allow_internet
        applied = {"backend": "docker", "image": image, "container": name,
                   "network": "proxy+bridge" if share else launch.network, **requested_limits(launch.limits),
                   "limits": "docker" if limited else "none", "not_applied": []}  # fmt: skip

        def cleanup() -> None:
            try:
                subprocess.run([exe, "rm", "-f", name], capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired):
                pass

        env = {k: os.environ[k] for k in CLIENT_ENV if k in os.environ}
        return Prepared(argv=argv, env=env, cwd=self.state_dir, applied=applied, cleanup=cleanup)

    def close(self) -> None:
        """Stops the proxy bridge (idempotent)."""
        self._bridge.close()
