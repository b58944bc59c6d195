"""What an execution in a built task environment costs: starting its session (a private mount namespace, the
overlay of the task's layers over the host with the execution's own upper layer, bwrap, the keeper), one launch
(``true`` through nsenter), and ending it; against the named baseline, a per-execution copy of the same layers
(``cp -a``: what a copy-on-write by copying costs without overlayfs; ext4 here has no reflinks).

Run (root, bwrap): ``python benchmarks/bench_environment.py TASK_DIR [--repeats 5]``; prints a table and writes
``benchmarks/results/environment.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gyre_jax.rollout.sandbox import EnvLaunch, Launch, make_sandbox  # noqa: E402
from gyre_jax.rollout.sandbox.environment import Host, build_layer  # noqa: E402


def du_mb(path: Path) -> float:
    done = subprocess.run(["du", "-sm", str(path)], capture_output=True, text=True)
    return float(done.stdout.split()[0]) if done.returncode == 0 else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    t0 = time.monotonic()
    layer = build_layer(Path(args.task), Host.detect())
    build_s = time.monotonic() - t0
    tmp = Path(tempfile.mkdtemp(prefix="bench-env-", dir="/var/tmp"))
    box = make_sandbox("bwrap", proxy_address=None, hide=[tmp], state_dir=tmp / "state")
    session, copy = [], []
    try:
        for i in range(args.repeats):
            state = tmp / f"s{i}"
            work = tmp / f"w{i}"
            work.mkdir()
            env = EnvLaunch(state=state, lower=tuple(layer.lower), mounts=(), internet=False, end=True)
            t = time.monotonic()
            prepared = box.prepare(Launch(argv=["true"], cwd="/", env={"PATH": "/usr/bin:/bin"}, mounts=(),
                                          network="none", environment=env))  # fmt: skip
            code = subprocess.run(prepared.argv, env=prepared.env, cwd=prepared.cwd).returncode
            prepared.cleanup()
            session.append(time.monotonic() - t)
            assert code == 0, f"true failed in the session ({code}); see {state / 'session.log'}"
            t = time.monotonic()
            for n, lower in enumerate(layer.lower):
                subprocess.run(["cp", "-a", lower, str(work / f"l{n}")], check=True)
            copy.append(time.monotonic() - t)
            shutil.rmtree(work)
    finally:
        box.close()
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(du_mb(Path(p)) for p in layer.lower)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    result = {"task": Path(args.task).name, "layer_mb": size, "build_s": round(build_s, 2), "cached": layer.cached,
              "session_true_s_median": round(med(session), 3), "copy_layers_s_median": round(med(copy), 3),
              "ratio_copy_over_session": round(med(copy) / med(session), 2), "repeats": args.repeats,
              "load": os.getloadavg()}  # fmt: skip
    print(f"{'task':24s} {'layers MB':>9s} {'session+true s':>14s} {'cp -a layers s':>14s} {'ratio':>6s}")
    print(f"{result['task']:24s} {size:9.0f} {result['session_true_s_median']:14.3f} "
          f"{result['copy_layers_s_median']:14.3f} {result['ratio_copy_over_session']:6.2f}")  # fmt: skip
    print(f"(the host's root, the lowest layer, is never copied: a copy-based design would add it for non-host bases)"
          f"; load {result['load']}")  # fmt: skip
    out = REPO / "benchmarks" / "results" / "environment.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
