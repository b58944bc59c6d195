"""Applies a Dockerfile's steps into a task layer: run as ``unshare --mount -- python -I build_layer.py PLAN``.

The plan (``environment.build_layer`` writes it, JSON) names the merged tree (mounted by ``MOUNT_SCRIPT`` in this
process's private mount namespace, so it is gone with it), the build context, the steps and the capabilities. It
applies each step on the merged tree: WORKDIR creates the directory, ENV is
kept for later steps, COPY / ADD copy from the context (ADD unpacks a local tar archive), RUN runs the shell
command in bubblewrap with the merged tree as ``/``, the host network, a PID namespace and Docker's default
capabilities. On a failing step it writes ``failed.txt`` (the step) beside the plan and exits 1.
Standard library only (run with ``-I``, outside the package's imports).
"""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path, PurePosixPath

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def inside(merged: Path, path: str) -> Path:
    return merged / PurePosixPath(path).as_posix().lstrip("/")


def copy_step(step: dict, merged: Path, context: Path, workdir: str) -> None:
    *sources, dest = step["args"]
    dest_abs = dest if dest.startswith("/") else str(PurePosixPath(workdir) / dest)
    target = inside(merged, dest_abs)
    matched: list[Path] = []
    for source in sources:
        hits = (
            sorted(glob.glob(str(context / source.lstrip("/"))))
            if any(c in source for c in "*?[")
            else [str(context / source.lstrip("/"))]
        )
        for hit in hits:
            path = Path(hit)
            if not path.resolve().is_relative_to(context.resolve()):
                raise ValueError(f"{source} leaves the build context")
            if not path.exists():
                raise FileNotFoundError(f"{source} is not in the build context {context}")
            matched.append(path)
    as_dir = dest.endswith("/") or len(matched) > 1 or any(p.is_dir() for p in matched)
    for path in matched:
        if step["kind"] == "ADD" and path.is_file() and tarfile.is_tarfile(path):
            target.mkdir(parents=True, exist_ok=True)
            with tarfile.open(path) as archive:
                archive.extractall(target, filter="tar")
        elif path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            shutil.copytree(path, target, symlinks=True, dirs_exist_ok=True)
        else:
            out = target / path.name if as_dir else target
            out.parent.mkdir(parents=True, exist_ok=True)
            if out.is_dir() and not out.is_symlink():
                out = out / path.name
            shutil.copy2(path, out, follow_symlinks=False)


def run_step(argv: list[str], merged: Path, env: dict[str, str], workdir: str, caps: list[str],
             hide: list[str]) -> int:  # fmt: skip
    wd = inside(merged, workdir)
    wd.mkdir(parents=True, exist_ok=True)
    bwrap = ["bwrap", "--bind", str(merged), "/", "--dev", "/dev", "--tmpfs", "/dev/shm", "--proc", "/proc",
             "--ro-bind", "/sys", "/sys", "--tmpfs", "/run", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
             "--die-with-parent", "--cap-drop", "ALL"]  # fmt: skip
    for cap in caps:
        bwrap += ["--cap-add", f"CAP_{cap.upper()}"]
    for path in hide:
        if inside(merged, path).is_dir():
            bwrap += ["--tmpfs", path]
    bwrap += ["--chdir", workdir, "--", *argv]
    return subprocess.run(bwrap, env=env, stdin=subprocess.DEVNULL).returncode


def main(plan_file: str) -> int:
    plan = json.loads(Path(plan_file).read_text())
    merged = Path(plan["merged"])  # mounted by environment.MOUNT_SCRIPT before this process started
    context, env, workdir = Path(plan["context"]), {"PATH": plan.get("path", DEFAULT_PATH), "HOME": "/root"}, "/"
    for number, step in enumerate(plan["steps"], start=1):
        kind, args = step["kind"], step["args"]
        print(f"== step {number}/{len(plan['steps'])}: {step['line'][:200]}", flush=True)
        try:
            if kind == "WORKDIR":
                workdir = args[0]
                inside(merged, workdir).mkdir(parents=True, exist_ok=True)
            elif kind == "ENV":
                env[args[0]] = args[1]
            elif kind in ("COPY", "ADD"):
                copy_step(step, merged, context, workdir)
            elif kind == "RUN":
                argv = list(args) if step.get("exec_form") else [*plan["shell"], args[0]]
                code = run_step(argv, merged, env, workdir, plan["caps"], plan["hide"])
                if code != 0:
                    raise RuntimeError(f"exit status {code}")
        except Exception as exc:  # noqa: BLE001 - the step is named in failed.txt, the error in the log
            print(f"!! step failed: {type(exc).__name__}: {exc}", flush=True)
            Path(plan_file).with_name("failed.txt").write_text(
                f"Dockerfile line {step['lineno']} `{step['line'][:160]}` ({exc})"
            )
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
