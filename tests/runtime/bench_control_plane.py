"""Benchmark: does waiting for process 0's next decision stall this process's own devices?

    python tests/runtime/bench_control_plane.py [--out bench_control_plane.json]

Starts 2 processes x 4 virtual CPU devices on loopback. Process 1 keeps running a small jitted matmul on
its own 4 devices (a stand-in for its serving cell's decode steps) while a second thread waits for a
decision that process 0 sends only after ``DELAY_S``. Baseline: the same matmul with nothing pending.
Compared: ``broadcast_decision(via="kv")`` (the run's control-plane store, runtime.kvstore) and
``broadcast_decision(via="devices")`` (``multihost_utils.broadcast_one_to_all``, a collective over every
device). Prints a table and writes JSON: per mode the slowest matmul while the decision was pending, and
its ratio to the baseline median.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DELAY_S = 3.0
MODES = ("kv", "devices")


def child(pid: int, port: int, out: Path) -> None:
    sys.path.insert(0, str(REPO))
    import numpy as np

    from gyre_jax import runtime
    from gyre_jax.config import config_from_dict, load_config

    config = config_from_dict(
        load_config([]),
        {
            "distributed.enabled": True,
            "distributed.coordinator_address": f"127.0.0.1:{port}",
            "distributed.num_processes": 2,
            "distributed.process_id": pid,
        },
    )
    runtime.initialize(config)

    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    local = Mesh(np.array(jax.local_devices()), ("d",))
    matmul = jax.jit(lambda a: (a @ a.T).sum())
    a = jax.device_put(np.ones((512, 512), np.float32), NamedSharding(local, PartitionSpec("d")))

    def timed() -> float:
        t = time.perf_counter()
        matmul(a).block_until_ready()
        return time.perf_counter() - t

    for mode in MODES:  # compile both broadcast paths and the matmul first
        runtime.broadcast_decision({"warm": mode}, via=mode)
    timed()
    result = {}
    runtime.sync("baseline")
    if pid == 1:
        result["baseline_median_s"] = float(np.median([timed() for _ in range(20)]))
    for mode in MODES:
        runtime.sync(f"start-{mode}")
        if pid == 0:
            time.sleep(DELAY_S)
            runtime.broadcast_decision({"mode": mode}, via=mode)
            continue
        got: dict = {}

        def wait_for_decision(got=got, mode=mode) -> None:
            got["v"] = runtime.broadcast_decision(None, via=mode)

        waiter = threading.Thread(target=wait_for_decision)
        waiter.start()
        times = []
        while waiter.is_alive():
            times.append(timed())
            time.sleep(0.05)
        waiter.join()
        assert got["v"] == {"mode": mode}
        result[mode] = {"max_s": max(times), "median_s": float(np.median(times)), "runs": len(times)}
    if pid == 1:
        (out / "result.json").write_text(json.dumps(result))
    runtime.sync("end")
    runtime.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench_control_plane.json")
    parser.add_argument("--child", type=int, default=-1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dir", default="")
    args = parser.parse_args()
    if args.child >= 0:
        child(args.child, args.port, Path(args.dir))
        return 0
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--child", str(pid), "--port", str(port), "--dir", tmp],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for pid in (0, 1)
        ]
        for p in procs:
            if p.wait(timeout=300) != 0:
                raise SystemExit(f"child exited {p.returncode}")
        result = json.loads((Path(tmp) / "result.json").read_text())
    base = result["baseline_median_s"]
    rows = [("baseline (nothing pending)", base, base, 1.0)]
    for mode in MODES:
        r = result[mode]
        rows.append((f"decision pending, via={mode}", r["median_s"], r["max_s"], r["max_s"] / base))
        result[mode]["max_over_baseline"] = r["max_s"] / base
    print(f"local 512x512 matmul on process 1's 4 devices while process 0 sends its decision after {DELAY_S:.0f} s")
    print(f"{'':32} {'median ms':>10} {'max ms':>10} {'max / baseline':>15}")
    for name, med, mx, ratio in rows:
        print(f"{name:32} {med * 1e3:10.2f} {mx * 1e3:10.2f} {ratio:15.1f}")
    result.update(delay_s=DELAY_S, machine=f"{os.cpu_count()} cpus")
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
