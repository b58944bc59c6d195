"""The Harbor verifier: a task's ``tests/test.sh`` run over the final workspace, in a fresh sandbox, so that what
the agent controls cannot change its reward, and a verifier that cannot run never produces one.

The verifier sees the workspace at the task's workdir (``/app``), the task's ``tests/`` read-only at ``/tests``
(mounted only now: the agent never saw it), an empty ``/logs`` (a fresh directory of a random name on the host),
the verifier kit read-only at ``/gyre-verifier`` (``GYRE_VERIFIER``: ``verifier_kit/``), no network, and an
environment built from nothing: PATH, a fresh home, locale, ``task.toml``'s ``[verifier] env``, ``GYRE_WORKSPACE``
/ ``GYRE_TESTS`` / ``GYRE_LOGS`` (the paths it sees), ``GYRE_VERIFIER_TIMEOUT_S``, and a Python that cannot be
shadowed by the workspace (``PYTHONSAFEPATH=1``, ``PYTHONNOUSERSITE=1``, the kit's ``sitecustomize`` putting the
workspace *last* on ``sys.path``): none of the agent's variables, keys or URLs. It writes the reward to
``/logs/verifier/reward.txt`` (a number) or ``reward.json`` (``{"reward": x}`` or a number); ``suspect.txt`` there
flags the execution ``reward_suspect`` (a line per sign of tampering), ``unavailable.txt`` says the verifier could
not run (no reward is read then). Without a sandbox (``sandbox="none"``) the paths are the host's: a task whose
test.sh hard-codes /app, /tests or /logs needs ``bwrap`` or ``docker``; the bundled suite reads the ``GYRE_*``
variables first.

What a suite's verifier needs is declared in task.toml (``[verifier.requires]``: ``commands``,
``python_modules``, ``install``) and checked before any work (``check_needs``; ``build.preflight`` and
``check_suite`` refuse with the install line) and again, once per task, before its first verification.

Around each run (docs/reliability.md has the classes of hacks each step closes): the task's ``tests/`` must
hash as when the executor first saw it (``pin``); the workspace may hold no symlink out of it and no hard link
to a file outside (``workspace_links``); with sandbox "none", the verifier interpreter's start-up files (``.pth``,
``sitecustomize``, the pytest package) must be as they were, and processes left by earlier executions that
cleared their environment are killed first (``process_group.kill_strays``). A test.sh killed by a signal gives no
reward (the tested code may have killed its verifier); the reward files are read without following links.

Outputs per execution, in ``<execution dir>/verifier/``: ``logs/verifier/reward.txt|json`` (what test.sh
wrote; ``suspect.txt``, ``unavailable.txt``, and the bundled driver's ``summary.json`` and ``pytest.log``),
``test.stdout``, ``test.stderr``.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import site
import stat
import subprocess
import sys
import sysconfig
import threading
import time
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gyre_jax.rollout import environments
from gyre_jax.rollout.evaluators import EvaluatorUnavailable, RewardSuspect
from gyre_jax.rollout.process_group import MARK_ENV, kill_group, kill_strays, sweep
from gyre_jax.rollout.sandbox import Launch, Limits, Mount, Sandbox
from gyre_jax.rollout.suites import DEFAULT_WORKDIR
from gyre_jax.rollout.tasks import Task

TESTS_INSIDE = environments.TESTS_INSIDE
LOGS_INSIDE = environments.LOGS_INSIDE
SOLUTION_INSIDE = environments.SOLUTION_INSIDE
KIT_DIR = environments.KIT_DIR  # mounted read-only at KIT_INSIDE
KIT_INSIDE = environments.KIT_INSIDE
MISSING_FILE = ".gyre-missing"  # under the logs dir: the commands test.sh itself ran and bash did not find
# test.sh runs as this bash's own process: GYRE_TEST_PID is its PID, so the kit's BASH_ENV handler records only
# test.sh's own "command not found" (not one of the tested code's bash scripts).
TEST_SH = 'export GYRE_TEST_PID=$$; exec bash "$0"'

MAX_REWARD_BYTES = 64 * 1024  # what is read of reward.txt / reward.json / suspect.txt / unavailable.txt
# Where a workspace symlink may point besides the workspace: the read-only system and this interpreter.
SYSTEM_PREFIXES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/dev/null")
NEEDS_KEYS = ("commands", "python_modules", "install")


def task_limits(task: Task, phase: str = "agent") -> Limits:
    """The resource limits a task's ``environment`` asks for (task.toml [environment]), with the network of
    ``phase`` ("agent" | "verifier": ``[agent]`` / ``[verifier] network_mode``, else the environment's)."""
    env = task.environment
    internet = env.get(f"{phase}_internet", env.get("allow_internet", False))
    return Limits(cpus=env.get("cpus"), memory_mb=env.get("memory_mb"), allow_internet=bool(internet))


def workdir_of(task: Task) -> str:
    """Where the workspace is mounted inside a sandbox: the Dockerfile's WORKDIR, ``/app`` by default."""
    return task.environment.get("workdir") or DEFAULT_WORKDIR


def image_context(task: Task) -> Path | None:
    """The task's ``environment/`` when it holds a Dockerfile (what the docker sandbox builds)."""
    if not task.source:
        return None
    context = Path(task.source) / "environment"
    return context if (context / "Dockerfile").is_file() else None


def base_env() -> dict[str, str]:
    """A process's environment that carries nothing of the run's: this Python first on PATH, a locale."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")])
    return {"PATH": path, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


def verifier_env(task: Task, paths: dict[str, str], home: str, timeout_s: float,
                 image: dict[str, str] | None = None, pip_target: str = "") -> dict[str, str]:  # fmt: skip
    """test.sh's whole environment (the module docstring): ``paths`` maps workspace / tests / logs / kit to the
    paths the verifier sees. The task's ``[verifier] env`` comes before the Python hardening, which wins (a
    ``PYTHONPATH`` of the task goes after the kit's). ``image``: in the task's built environment, the image's
    variables (its PATH, HOME=/root, ENVs) replace this machine's PATH. ``pip_target`` (sandbox "none"): where
    ``pip install`` goes instead of the trainer's interpreter (PIP_TARGET, also on PYTHONPATH)."""
    env = {**base_env(), **(image or {}), **task.verifier_env}
    if pip_target:
        env["PIP_TARGET"] = pip_target
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), pip_target) if p)
    extra = env.get("PYTHONPATH", "")
    env.update(
        HOME=(image or {}).get("HOME", home),
        GYRE_WORKSPACE=paths["workspace"],
        GYRE_TESTS=paths["tests"],
        GYRE_LOGS=paths["logs"],
        GYRE_VERIFIER=paths["kit"],
        GYRE_VERIFIER_TIMEOUT_S=f"{timeout_s:g}",
        BASH_ENV=f"{paths['kit']}/bash_env.sh",
        PYTHONPATH=os.pathsep.join([paths["kit"], *([extra] if extra else [])]),
        PYTHONSAFEPATH="1",
        PYTHONNOUSERSITE="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


@dataclass(frozen=True)
class VerifierNeeds:
    """What a task's verifier needs on the machine that runs it (task.toml ``[verifier.requires]``): commands on
    the verifier's PATH, Python modules importable by its ``python3``, and the line that installs them."""

    commands: tuple[str, ...] = ()
    python_modules: tuple[str, ...] = ()
    install: str = ""

    @classmethod
    def of(cls, task: Task) -> VerifierNeeds:
        """The task's declaration (none: nothing needed); ValueError naming the key when malformed."""
        if not task.source or not (Path(task.source) / "task.toml").is_file():
            return cls()
        table = tomllib.loads((Path(task.source) / "task.toml").read_text(encoding="utf-8"))
        needs = table.get("verifier", {}).get("requires", {})
        where = f"task {task.task_id}: task.toml [verifier.requires]"
        if not isinstance(needs, dict) or set(needs) - set(NEEDS_KEYS):
            raise ValueError(f"{where} must be a table with the keys {NEEDS_KEYS}, got {needs!r}")
        lists = {k: needs.get(k, []) for k in ("commands", "python_modules")}
        for key, value in lists.items():
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"{where} {key} must be a list of names, got {value!r}")
        if not isinstance(needs.get("install", ""), str):
            raise ValueError(f"{where} install must be a string (the command that installs what is listed)")
        return cls(tuple(lists["commands"]), tuple(lists["python_modules"]), needs.get("install", ""))

    def missing(self, path: str) -> list[str]:
        """What of it is not found with the verifier's ``path`` (each as a phrase)."""
        out = [f"the command {c!r}" for c in self.commands if shutil.which(c, path=path) is None]
        if not self.python_modules:
            return out
        python = shutil.which("python3", path=path)
        if python is None:
            return [*out, "python3 (for the Python modules " + ", ".join(self.python_modules) + ")"]
        probe = "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))"
        try:
            done = subprocess.run([python, "-I", "-c", probe, *self.python_modules], capture_output=True, text=True,
                                  timeout=120, env={"PATH": path, "PYTHONNOUSERSITE": "1"}, stdin=subprocess.DEVNULL)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            return [*out, f"a working {python} ({exc})"]
        if done.returncode != 0:
            return [*out, f"a working {python} (it failed: {done.stderr.strip()[-200:]})"]
        return out + [f"the Python module {m!r} (for {python})" for m in done.stdout.split()]


def check_needs(tasks: Iterable[Task], sandbox: str) -> None:
    """Raises ``EvaluatorUnavailable`` naming the first task whose verifier needs something this machine lacks,
    with its install line. The docker sandbox is not checked here: its images provide what they need."""
    if sandbox == "docker":
        return
    path, seen = base_env()["PATH"], set()
    for task in tasks:
        needs = VerifierNeeds.of(task)
        if needs in seen or not task.source:
            continue
        seen.add(needs)
        missing = needs.missing(path)
        if missing:
            how = f"install it: {needs.install}" if needs.install else "install it"
            raise EvaluatorUnavailable(
                f"the verifier of task {task.task_id} needs {' and '.join(missing)}, which this machine lacks "
                f"(task.toml [verifier.requires]); {how}, then run the same command again"
            )


def verifier_problem(suite: str, sandbox: str) -> str | None:
    """For ``build.preflight``: why the suite's verifiers cannot run here (one line naming what to install), or
    None. The builtin suite's evaluator needs nothing."""
    from gyre_jax.rollout.suites import load_tasks, parse_suite_spec

    if parse_suite_spec(suite)[0] == "builtin":
        return None
    tasks, _ = load_tasks(suite)
    try:
        check_needs(tasks, sandbox)
    except (EvaluatorUnavailable, ValueError) as exc:
        return f"config.rollout.suite={suite!r}: {exc}"
    return None


def tests_digest(task: Task) -> str:
    """A hash of every file under the task's ``tests/`` (relative path and bytes; a symlink by its target)."""
    digest, root = hashlib.sha256(), Path(task.source) / "tests"
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        if path.is_symlink():
            digest.update(b"link:" + os.readlink(path).encode())
        elif path.is_file():
            digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def _within(path: str, parent: str) -> bool:
    parent = parent.rstrip("/") or "/"
    return path == parent or path.startswith(parent + "/") or parent == "/"


def workspace_links(workspace: Path, inside: str, max_entries: int = 200_000) -> list[str]:
    """Symlinks of ``workspace`` whose target (as seen from ``inside``, where the verifier mounts it) leaves it
    for anything but the read-only system or this interpreter, and hard links to files outside it: one line
    each (at most 5 named)."""
    allowed = [*SYSTEM_PREFIXES, sys.prefix, sys.base_prefix, os.path.realpath(sys.prefix)]
    found, inodes, seen = [], {}, 0
    for root, dirs, files in os.walk(workspace):
        rel_root = os.path.relpath(root, workspace)
        for name in dirs + files:
            seen += 1
            if seen > max_entries:
                break
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            rel = os.path.normpath(os.path.join(rel_root, name))
            if stat.S_ISLNK(st.st_mode):
                text = os.readlink(path)
                target = os.path.normpath(os.path.join(inside, rel_root, text))
                if not _within(target, inside) and not any(_within(target, a) for a in allowed):
                    found.append(f"{rel} -> {text}")
            elif stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                count, _, first = inodes.get((st.st_dev, st.st_ino), (0, 0, rel))
                inodes[(st.st_dev, st.st_ino)] = (count + 1, st.st_nlink, first)
    found += [f"{rel} is a hard link to a file outside the workspace" for n, links, rel in inodes.values() if n < links]
    if not found:
        return []
    more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
    return [f"the workspace links out of itself: {', '.join(found[:5])}{more}"]


def startup_files() -> dict[str, tuple[int, int, int]]:
    """(mtime, size, inode) of what the verifier's Python runs at start or as its test runner: ``*.pth``,
    ``sitecustomize`` and ``usercustomize`` of its site and standard-library directories, and every file of the
    pytest, _pytest and pluggy packages (with sandbox "none" an agent could rewrite them)."""
    dirs = {*site.getsitepackages(), sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]}
    files = []
    for d in dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        files += [
            os.path.join(d, n) for n in names if n.endswith(".pth") or n in ("sitecustomize.py", "usercustomize.py")
        ]
    for package in ("pytest", "_pytest", "pluggy"):
        spec = importlib.util.find_spec(package)
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            files += [str(p) for p in Path(folder).rglob("*.py")]
    out = {}
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            continue
        out[f] = (st.st_mtime_ns, st.st_size, st.st_ino)
    return out


def killed_by(returncode: int | None, sandbox: Sandbox) -> int | None:
    """The signal that ended test.sh (a negative status; through bwrap or docker, 128 + the signal), or None."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    if sandbox.maps_paths and 128 < returncode < 128 + signal.NSIG:
        return returncode - 128
    return None


def _read_small(path: Path) -> str | None:
    """The text of ``path`` (at most MAX_REWARD_BYTES), None if absent; a symlink, FIFO or device is tampering."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RewardSuspect(
                [f"{path.name} is a symlink (not followed): something other than the verifier made it"]
            ) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RewardSuspect([f"{path.name} is not a regular file: something other than the verifier made it"])
        return os.read(fd, MAX_REWARD_BYTES).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def _tail(path: Path, n: int = 300) -> str:
    try:
        data = path.read_bytes()[-n:]
    except OSError:
        return ""
    return " ".join(data.decode("utf-8", errors="replace").split())


def train_reward(data: dict, reward_key: str | None) -> float:
    """The reward that trains, from a reward.json of named rewards (Harbor's multi-reward form): ``reward_key``
    (task.toml ``[verifier] reward_key``) when the task names one, else ``"reward"``, else the mean of all named
    rewards (each a number). ValueError naming what is missing or not a number."""
    key = reward_key or ("reward" if "reward" in data else None)
    if key is not None:
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"verifier's reward.json holds {data!r}; expected a number under {key!r}")
        return float(value)
    values = list(data.values())
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise ValueError(f"verifier's reward.json holds {data!r}; expected {{'reward': <number>}}, named numbers, "
                         "or a number")  # fmt: skip
    return float(sum(values) / len(values))


def read_reward(logs: Path, reward_key: str | None = None) -> float:
    """The reward test.sh wrote under ``logs/verifier/`` (reward.txt, else reward.json, ``train_reward``);
    ValueError if none, and ``RewardSuspect`` if one is a symlink or not a regular file."""
    txt, js = _read_small(logs / "verifier" / "reward.txt"), None
    if txt is not None:
        text = txt.strip()
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"verifier wrote {text[:80]!r} to reward.txt; expected a number in [0, 1]") from None
    js = _read_small(logs / "verifier" / "reward.json")
    if js is not None:
        try:
            data = json.loads(js)
        except json.JSONDecodeError as exc:
            raise ValueError(f"verifier's reward.json is not valid JSON ({exc})") from None
        if isinstance(data, dict):
            return train_reward(data, reward_key)
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise ValueError(f"verifier's reward.json holds {data!r}; expected {{'reward': <number>}} or a number")
        return float(data)
    raise ValueError("verifier wrote no reward (neither /logs/verifier/reward.txt nor reward.json)")


def read_verdict(logs: Path, suspect: list[str], reward_key: str | None = None) -> float:
    """The reward under ``logs`` (``read_reward``), or ``EvaluatorUnavailable`` when the verifier wrote
    ``unavailable.txt``, or ``RewardSuspect`` when ``suspect`` or its ``suspect.txt`` holds a reason."""
    verifier = logs / "verifier"
    if verifier.is_symlink() or not verifier.is_dir():
        raise RewardSuspect([*suspect, "/logs/verifier was replaced by a symlink or a file"])
    unavailable = _read_small(verifier / "unavailable.txt")
    if unavailable is not None:
        raise EvaluatorUnavailable(f"the verifier could not run: {' '.join(unavailable.split())[:600]}")
    flagged = _read_small(verifier / "suspect.txt")
    suspect = suspect + [line.strip() for line in (flagged or "").splitlines() if line.strip()]
    try:
        reward = read_reward(logs, reward_key)
    except (ValueError, RewardSuspect) as exc:
        if suspect or isinstance(exc, RewardSuspect):
            raise RewardSuspect([*suspect, str(exc)]) from None
        raise
    if suspect:
        raise RewardSuspect(suspect, reward)
    return reward


class HarborVerifier:
    """An evaluator ``(task, workspace) -> reward`` for Harbor tasks (see the module docstring).

    The workspace is ``<execution dir>/workspace``; the verifier's files go to ``<execution dir>/verifier/``,
    recreated empty first (so nothing the agent left there is read as a reward). Raises on a missing or
    unparsable reward and on a timeout (``TimeoutError``), ``EvaluatorUnavailable`` when the verifier cannot run,
    ``RewardSuspect`` on signs of tampering: the executor then excludes the execution (never a 0).
    ``pin(tasks)`` records the tasks' tests/ before any harness runs (the executor does it).
    """

    def __init__(self, sandbox: Sandbox, timeout_s: float, kill_grace_s: float = 1.0) -> None:
        self.sandbox = sandbox
        self.timeout_s = float(timeout_s)
        self.kill_grace_s = kill_grace_s
        self._lock = threading.Lock()
        self._pins: dict[str, str] = {}  # task source -> tests_digest when first seen
        self._ready: set[VerifierNeeds] = set()  # needs found present on this machine
        self._startup = startup_files() if not sandbox.maps_paths else {}
        self._strays = 0  # stray processes killed so far (sandbox "none"), by any verification of this executor

    def pin(self, tasks: Iterable[Task]) -> None:
        """Records each Harbor task's ``tests_digest`` the first time it is seen (before its harness runs)."""
        for task in tasks:
            if task.source and task.source not in self._pins and (Path(task.source) / "tests").is_dir():
                digest = tests_digest(task)
                with self._lock:
                    self._pins.setdefault(task.source, digest)

    def _check_needs(self, task: Task) -> None:
        needs = VerifierNeeds.of(task)
        if needs in self._ready or self.sandbox.name == "docker":
            return
        check_needs([task], self.sandbox.name)
        with self._lock:
            self._ready.add(needs)

    def _changed(self, task: Task) -> tuple[list[str], list[str]]:
        """(reasons that forbid running the tests, reasons to flag the result): tests/ no longer what was pinned;
        the verifier interpreter's start-up or runner files changed (sandbox "none")."""
        pinned = self._pins.get(task.source)
        blocking = []
        if pinned is not None and tests_digest(task) != pinned:
            blocking.append(f"the task's tests/ ({Path(task.source) / 'tests'}) changed after the run started")
        flags = []
        if self._startup:
            now = startup_files()
            changed = sorted(f for f in set(now) | set(self._startup) if now.get(f) != self._startup.get(f))
            if changed:
                flags.append(f"the verifier's Python start-up or runner files changed: {', '.join(changed[:3])}")
        return blocking, flags

    def __call__(self, task: Task, workspace: Path) -> float:
        workspace = Path(workspace)
        if not task.source:
            raise ValueError(f"task {task.task_id} has no Harbor source directory to verify it with")
        if not workspace.is_dir():
            raise FileNotFoundError(f"workspace {workspace} of task {task.task_id} does not exist; cannot verify")
        self._check_needs(task)
        blocking, suspect = self._changed(task)
        if blocking:
            raise RewardSuspect(blocking)
        out = workspace.parent / "verifier"  # not in the harness's view: nothing it left is read as a reward
        if out.is_symlink() or out.is_file():
            out.unlink()
        elif out.exists():
            shutil.rmtree(out)
        out.mkdir()
        timeout_s = task.verifier_timeout_s or self.timeout_s
        if environments.uses_environment(task, self.sandbox):
            logs, returncode = self._run_in_environment(task, workspace, out, timeout_s, suspect)
        else:
            logs, returncode = self._run_fresh(task, workspace, out, timeout_s, suspect)
        died = killed_by(returncode, self.sandbox)
        if died is not None:
            raise RewardSuspect(
                [*suspect, f"tests/test.sh was killed by signal {died}: a verifier that did not finish gives no reward"]
            )
        self._missing_commands(task, logs, out)
        return read_verdict(logs, suspect, task.environment.get("reward_key"))

    def _run_fresh(self, task: Task, workspace: Path, out: Path, timeout_s: float,
                   suspect: list[str]) -> tuple[Path, int | None]:  # fmt: skip
        """test.sh in a fresh sandbox over the final workspace (the tasks run on this machine's system)."""
        run_dir = out / f"run-{secrets.token_hex(8)}"  # a fresh name: nothing can know it in advance
        (run_dir / "logs" / "verifier").mkdir(parents=True)
        (run_dir / "home").mkdir()
        tests = Mount(Path(task.source) / "tests", TESTS_INSIDE)
        mounts = (Mount(workspace, workdir_of(task), writable=True), tests,
                  Mount(run_dir / "logs", LOGS_INSIDE, writable=True), Mount(KIT_DIR, KIT_INSIDE))  # fmt: skip
        ws, tests_in, logs_in, kit_in = (self.sandbox.path(m) for m in mounts)
        home = str(run_dir / "home") if not self.sandbox.maps_paths else "/tmp"
        paths = {"workspace": ws, "tests": tests_in, "logs": logs_in, "kit": kit_in}
        pip_target = str(run_dir / "home" / "pip-target") if not self.sandbox.maps_paths else ""
        env = verifier_env(task, paths, home, timeout_s, pip_target=pip_target)
        limits = task_limits(task, "verifier")
        launch = Launch(argv=["bash", "-c", TEST_SH, f"{tests_in}/test.sh"], cwd=ws, env=env, mounts=mounts,
                        network="proxy" if limits.allow_internet and self.sandbox.name == "bwrap" else "none",
                        limits=limits, image_context=image_context(task))  # fmt: skip
        # (bwrap: "proxy" with allow_internet shares the host network and bridges nothing: the run's proxy is
        # never reached by a verifier)
        suspect += workspace_links(workspace, ws)
        self._kill_strays()  # those left by earlier executions: dead before this run's files exist
        strays_before = self._strays
        returncode = self._run(launch, out, timeout_s)
        self._kill_strays()  # before the reward is read: whatever was left running can write nothing more
        if self._strays > strays_before:  # they may have written into this run's files, whoever killed them
            suspect.append(f"{self._strays - strays_before} stray process(es) (detached, environment cleared) "
                           "were killed while this verifier ran")  # fmt: skip
        shutil.rmtree(run_dir / "home", ignore_errors=True)
        os.replace(run_dir / "logs", out / "logs")
        run_dir.rmdir()
        return out / "logs", returncode

    def _run_in_environment(self, task: Task, workspace: Path, out: Path, timeout_s: float,
                            suspect: list[str]) -> tuple[Path, int | None]:  # fmt: skip
        """test.sh in the execution's environment session, as Harbor runs it in the agent's container: the files
        and the processes the agent left, ``/tests`` filled only now, ``/logs`` emptied first, the image's PATH and
        HOME; the session (every process in it) ends with test.sh, before the reward is read."""
        exec_dir = workspace.parent
        stage = exec_dir / environments.ENV_DIR
        mounts = environments.session_mounts(task, exec_dir, solution=False)
        for name, source in (("tests", Path(task.source) / "tests"), ("logs", None)):
            folder = stage / name  # emptied in place: the session's bind mount holds this very directory
            for child in list(folder.iterdir()):
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
            if source is not None:
                shutil.copytree(source, folder, dirs_exist_ok=True)
        (stage / "logs" / "verifier").mkdir()
        workdir = workdir_of(task)
        paths = {"workspace": workdir, "tests": TESTS_INSIDE, "logs": LOGS_INSIDE, "kit": KIT_INSIDE}
        env = verifier_env(task, paths, "/root", timeout_s, image=environments.image_env(task, self.sandbox))
        limits = task_limits(task, "verifier")
        own = [m for m in mounts if m.inside in (workdir, TESTS_INSIDE, LOGS_INSIDE, KIT_INSIDE)]
        launch = Launch(argv=["bash", "-c", TEST_SH, f"{TESTS_INSIDE}/test.sh"], cwd=workdir, env=env,
                        mounts=tuple(own), network="none", limits=limits,
                        environment=environments.env_launch(task, self.sandbox, exec_dir, solution=False, end=True,
                                                            internet=limits.allow_internet))  # fmt: skip
        if launch.environment.internet != limits.allow_internet:
            suspect_note = (f"the verifier's network ({'internet' if limits.allow_internet else 'none'}) differs "
                            "from its session's, which the agent's phase fixed")  # fmt: skip
            (out / "note.txt").write_text(suspect_note + "\n")
        suspect += workspace_links(workspace, workdir)
        returncode = self._run(launch, out, timeout_s)
        shutil.copytree(stage / "logs", out / "logs", symlinks=True)
        return out / "logs", returncode

    def _missing_commands(self, task: Task, logs: Path, out: Path) -> None:
        """Raises EvaluatorUnavailable when test.sh itself ran a command this environment lacks (the kit's
        BASH_ENV handler recorded it) that test.sh names: the verifier could not run as written, whatever it
        wrote as a reward."""
        recorded = _read_small(logs / MISSING_FILE)
        if not recorded:
            return
        text = (Path(task.source) / "tests" / "test.sh").read_text(encoding="utf-8", errors="replace")
        words = set(re.findall(r"[\w./+-]+", text))
        missing = sorted({c for c in recorded.split() if c in words})
        if missing:
            tail = _tail(out / "test.stderr")
            raise EvaluatorUnavailable(
                f"tests/test.sh ran {', '.join(repr(c) for c in missing)}, which this environment lacks (command not "
                f"found); the verifier could not run as written{': ' + tail if tail else ''}"
            )

    def _kill_strays(self) -> None:
        """Sandbox "none": kills the processes left by executions that detached and cleared their environment, and
        counts them (bwrap and docker end everything with the sandbox)."""
        if self.sandbox.maps_paths:
            return
        killed = kill_strays()
        with self._lock:
            self._strays += len(killed)

    def _run(self, launch: Launch, out: Path, timeout_s: float) -> int | None:
        """Runs test.sh to its end (its group killed, then whatever left the group); its exit status."""
        mark = secrets.token_hex(12)
        launch = dataclasses.replace(launch, env={**launch.env, MARK_ENV: mark})
        prepared = self.sandbox.prepare(launch)
        try:
            with open(out / "test.stdout", "wb") as so, open(out / "test.stderr", "wb") as se:
                proc = subprocess.Popen(prepared.argv, cwd=prepared.cwd, env=prepared.env, stdin=subprocess.DEVNULL,
                                        stdout=so, stderr=se, start_new_session=True)  # fmt: skip
                deadline = time.monotonic() + timeout_s
                while proc.poll() is None and time.monotonic() < deadline:
                    try:
                        proc.wait(timeout=0.05)
                    except subprocess.TimeoutExpired:
                        pass
                timed_out = proc.poll() is None
                kill_group(proc.pid, self.kill_grace_s, proc)
                returncode = proc.wait()
                sweep(mark, self.kill_grace_s, exclude=proc.pid)
        finally:
            prepared.cleanup()
        if timed_out:
            raise TimeoutError(f"verifier tests/test.sh exceeded {timeout_s} s and was killed (a timeout never scores)")
        return returncode
