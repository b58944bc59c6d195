"""Which Harbor tasks run in their built environment, and what an execution of one mounts and starts from.

A task whose ``environment["mode"]`` is "build" (it has a Dockerfile or ``docker_image`` and no
``[verifier.requires]``, ``suites.load_harbor_task``) runs under sandbox "bwrap" in its environment: the layer its
Dockerfile builds (``sandbox/environment.py``, once per content) with a writable layer of the execution's own
(``<execution>/env/upper``), in one session for its harness and its verifier (``sandbox/session.py``). Its
workspace starts as what the layers hold at the image's WORKDIR. Under sandbox "none" such a task cannot be
honoured without writing outside the execution (its Dockerfile's steps, its absolute paths): ``problems`` refuses
it at load. Under "docker" the image is the Dockerfile itself (``sandbox/docker.py``).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from gyre_jax.rollout.sandbox import EnvLaunch, Mount, Sandbox
from gyre_jax.rollout.sandbox.environment import Builds, Layer, Need, Reachability, refusals, seed_workspace, task_needs
from gyre_jax.rollout.sandbox.environment import image_env as image_env_of
from gyre_jax.rollout.suites import DOCKER_FILES
from gyre_jax.rollout.tasks import Task

ENV_DIR = "env"  # <execution dir>/env: the execution's own layer (upper), the session's mount points, tests / logs
TESTS_INSIDE, LOGS_INSIDE, SOLUTION_INSIDE, EXEC_DIR_INSIDE = "/tests", "/logs", "/solution", "/gyre"
KIT_DIR = Path(__file__).resolve().with_name("verifier_kit")
KIT_INSIDE = "/gyre-verifier"
SKILLS_HOMES = (".claude/skills",)  # where a harness's home gets the task's skills_dir (Harbor copies them there)
# Scripts that install into the interpreter or the system they run with (refused under sandbox "none").
_INSTALLS = re.compile(r"\b(apt-get|apt|dpkg|yum|dnf|apk)\s+(-\S+\s+)*install\b|\bpip3?\s+install\b|-m\s+pip\s+install\b"
                       r"|\buv\s+pip\s+install\b|\bnpm\s+(-g\s+)?install\s+-g\b|\|\s*(ba)?sh\b")  # fmt: skip
_ABSOLUTE = re.compile(r"(?<![\w./$-])/(app|tests|logs|solution)\b")


def uses_environment(task: Task, sandbox: Sandbox) -> bool:
    """Whether ``task`` runs in its built environment under ``sandbox`` (bwrap and a "build"-mode task)."""
    return bool(task.source) and sandbox.name == "bwrap" and task.environment.get("mode") == "build"


def layer(task: Task, sandbox: Sandbox) -> Layer:
    """The task's environment layer (built on first use by the sandbox's ``Builds``)."""
    builds: Builds = sandbox.builds  # type: ignore[attr-defined]
    return builds.layer(Path(task.source), timeout_s=float(task.environment.get("build_timeout_s") or 1800.0))


def session_mounts(task: Task, exec_dir: Path, solution: bool) -> tuple[Mount, ...]:
    """The fixed mounts of an execution's session (its harness's and its verifier's, created here)."""
    env = Path(exec_dir) / ENV_DIR
    for name in ("tests", "logs/verifier", "logs/agent"):
        (env / name).mkdir(parents=True, exist_ok=True)
    mounts = [Mount(Path(exec_dir) / "harness", EXEC_DIR_INSIDE, writable=True),
              Mount(Path(exec_dir) / "workspace", task.environment.get("workdir") or "/app", writable=True),
              Mount(env / "tests", TESTS_INSIDE), Mount(env / "logs", LOGS_INSIDE, writable=True),
              Mount(KIT_DIR, KIT_INSIDE)]  # fmt: skip
    if solution and (Path(task.source) / "solution").is_dir():
        mounts.append(Mount(Path(task.source) / "solution", SOLUTION_INSIDE))
    return tuple(mounts)


def env_launch(task: Task, sandbox: Sandbox, exec_dir: Path, *, solution: bool, end: bool,
               internet: bool | None = None) -> EnvLaunch | None:  # fmt: skip
    """The ``Launch.environment`` of one launch of an execution of ``task`` (None: not in an environment).
    ``end``: the verifier's launch, which ends the session. The session's network is the environment's
    (``allow_internet``); ``internet`` overrides it when this launch starts the session."""
    if not uses_environment(task, sandbox):
        return None
    built = layer(task, sandbox)
    keep = built.base.python_prefix if built.base.python_prefix.startswith("/root/") else ""
    net = task.environment.get("allow_internet", True) if internet is None else internet
    return EnvLaunch(state=Path(exec_dir) / ENV_DIR, lower=tuple(built.lower),
                     mounts=session_mounts(task, exec_dir, solution), internet=bool(net), keep_python=keep,
                     image_env=tuple(image_env(task, sandbox).items()), end=end)  # fmt: skip


def image_env(task: Task, sandbox: Sandbox) -> dict[str, str]:
    """The variables a process of the task's image starts with (PATH, HOME=/root, the Dockerfile's ENVs, the
    task's ``[environment] env``); {} when the task does not run in its environment."""
    if not uses_environment(task, sandbox):
        return {}
    return {**image_env_of(layer(task, sandbox)), **task.environment.get("env", {})}


def seed(task: Task, sandbox: Sandbox, exec_dir: Path) -> None:
    """The execution's workspace (``<exec_dir>/workspace``): in its environment, what the layers hold at the
    image's WORKDIR (and the task's skills in the harness's home); otherwise the task's ``environment/`` minus its
    Docker files."""
    workspace = Path(exec_dir) / "workspace"
    if uses_environment(task, sandbox):
        built = layer(task, sandbox)
        seed_workspace(built, workspace)
        skills = task.environment.get("skills_dir")
        if skills:
            for lower in reversed(built.lower):
                src = Path(lower) / skills.lstrip("/")
                if src.is_dir():
                    for home in SKILLS_HOMES:
                        shutil.copytree(src, Path(exec_dir) / "harness" / "home" / home, dirs_exist_ok=True)
        return
    ignore = shutil.ignore_patterns(*DOCKER_FILES)
    shutil.copytree(Path(task.source) / "environment", workspace, ignore=ignore, symlinks=True, dirs_exist_ok=True)


def needs(task: Task, reach: Reachability, host=None) -> list[Need]:
    """What the task needs from this machine (``sandbox.environment.task_needs``)."""
    from gyre_jax.rollout.sandbox.environment import Host

    return task_needs(Path(task.source), host or Host.detect(), reach)


def problems(task: Task, sandbox_name: str, found: list[Need], oracle: bool = False) -> list[str]:
    """Why ``task`` cannot be honoured on this machine under ``sandbox_name`` (one line each; [] when it can):
    the missing needs of its environment and verifier (and oracle with ``oracle``), a network mode this sandbox
    cannot enforce, and, under "none", a task that needs its environment built or writes outside its execution."""
    where = f"task {task.task_id}"
    out: list[str] = []
    if not task.source:
        return out
    for key in ("network_mode",):
        if task.environment.get(key) == "allowlist":
            out.append(f"{where}: [environment] network_mode='allowlist' (only listed hosts) cannot be enforced here")
    if sandbox_name == "docker":
        return out
    if sandbox_name == "none":
        if task.environment.get("mode") == "build":
            out.append(f"{where}: its environment (environment/Dockerfile) is built only by sandbox 'bwrap' or 'docker'; "
                       "sandbox 'none' would apply it to this machine itself")  # fmt: skip
        for rel in ("tests/test.sh", "solution/solve.sh"):
            path = Path(task.source) / rel
            text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
            if rel == "solution/solve.sh" and not oracle:
                continue
            hit = _INSTALLS.search(text)
            if hit:
                out.append(f"{where}: {rel} installs software (`{hit.group(0).strip()}`): under sandbox 'none' that "
                           "would change this machine or the trainer's interpreter; use sandbox 'bwrap'")  # fmt: skip
            hit = _ABSOLUTE.search(text)
            if hit:
                out.append(f"{where}: {rel} uses the absolute path {hit.group(0)}: under sandbox 'none' that is this "
                           "machine's own; use sandbox 'bwrap' (or read the GYRE_* variables)")  # fmt: skip
        return out
    phases = ("environment", "verifier", "oracle") if oracle else ("environment", "verifier")
    if task.environment.get("mode") == "build":
        out += [f"{where}: {line}" for line in refusals(found, phases)]
    else:
        out += [f"{where}: {line}" for line in refusals(found, tuple(p for p in phases if p != "environment"))]
    return out


def honoured(tasks: list[Task], sandbox_name: str) -> tuple[list[Task], list[str]]:
    """(the tasks this machine can honour under ``sandbox_name``, one line per reason for the others)."""
    from gyre_jax.rollout.sandbox.environment import Host

    reach, host = Reachability(), Host.detect()
    kept, refused = [], []
    for task in tasks:
        lines = problems(task, sandbox_name, needs(task, reach, host) if task.source else [])
        kept += [] if lines else [task]
        refused += lines
    return kept, refused
