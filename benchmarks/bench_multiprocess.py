"""Benchmark: what crossing processes costs, for host messages and for weights.

    python benchmarks/bench_multiprocess.py            # about a minute on 2 busy cores
    python benchmarks/bench_multiprocess.py --smoke    # seconds; the same code path, for tests

Starts itself as 2 child processes x 4 virtual CPU devices on loopback (gloo collectives), the layout
of ``tests/runtime/``: process 0 is the leader, process 1 a follower. Two measurements, each with a
baseline measured in the same run:

1. **Channel round trip** (``gyre_jax.runtime.channel.Channel``, the leader <-> follower host messages
   over a direct TCP connection): process 0 sends a message on one channel, process 1 receives it and
   sends it back on another; median and p90 over N round trips, for a small payload (a
   ``GenerationRequest`` with a 2,000-token prompt) and a large one (a dict of numpy arrays of ~200 KB, a
   packed micro-batch's fields). Baseline: the same ping-pong between two threads of process 0 over
   ``queue.Queue``, with the same pickling (``pickle.dumps`` / ``loads`` on both sides), so the ratio is
   what crossing processes adds. Also measured (N / 5 round trips): the channel before, one key per
   message in a key-value store (``KVChannel``; since the control plane moved to the run's own store,
   ``runtime.kvstore``, through that store, uncompressed; docs/multihost.md's table was measured through
   jax's coordination client, which gzips every request, so ``zlib.compress(payload, 6)`` is timed alone too).
2. **Weights across processes** (``runtime.transfer``, what ``RemoteCell.set_weights`` and
   ``RemoteWorker.snapshot`` run): the tiny model's params (``model.config.TINY``, initialized on cell 0
   with the default config's sharding rules) moved from a 4-device cell on process 0 (mesh data=4) to a
   4-device cell on process 1, point to point (``uuid``: ``runtime.p2p``) and, for comparison, by the
   program over both cells (the path before, still the fallback). Both processes call it; process 1
   passes ``jax.ShapeDtypeStruct`` leaves with the source shardings. Timed on process 1 from a common
   barrier (``runtime.sync``) to ``block_until_ready`` of its result. Baselines: ``jax.device_put`` of the
   same params between two 2-device meshes within process 0 (devices 0-1 -> 2-3), and, like for like, a
   point-to-point move between 2-device meshes across processes (devices 0-1 -> 4-5); and a 4-byte array
   point to point between the cells (the fixed cost of one move). The variants run round robin (after
   warm-up calls that compile them), so load from other work falls on all alike. MB/s = the params' bytes
   / the median time / 1e6; ``dest_device_bytes`` is what lands on the destination devices (every device
   of a cell holds a full copy of the tiny model's params under the default rules). The leader's own
   call, which returns once its side is offered (point to point) or dispatched (program), is reported too.

Prints markdown tables and writes JSON (``--out``, default ``benchmarks/results/multiprocess.json``;
``--smoke``: fewer repeats, default ``benchmarks/results/multiprocess_smoke.json``). Every wait has a
timeout; if a child fails or hangs, the parent kills the other and exits with the failing child's last
lines of stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 4
PROMPT_TOKENS = 2000
VOCAB = 151_936  # Qwen3's: realistic token ids (their pickled size depends on the value)
MB_ROWS, MB_ROW_LEN = 5, 1024  # packed micro-batch: 5 rows x 1024 tokens, ~200 KB over its fields
RECV_TIMEOUT_MS = 60_000  # one message
SYNC_TIMEOUT_S = 60.0  # a barrier between timed calls
SETUP_TIMEOUT_S = 300.0  # a barrier after start-up / compiles
SIZES = {  # (warm-up round trips, timed round trips, warm-up calls per weights variant, timed calls)
    "full": (10, 200, 2, 30),
    "smoke": (2, 8, 1, 2),
}


# == child (one of the 2 processes) =======================================================================
def _pct(times: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(times, np.float64), q))


def _stats_ms(times_s: list[float]) -> dict:
    return {"median_ms": _pct(times_s, 50) * 1e3, "p90_ms": _pct(times_s, 90) * 1e3, "n": len(times_s)}


def _payloads() -> dict:
    import numpy as np

    from gyre_jax.serving.types import GenerationRequest, SamplingParams

    rng = np.random.default_rng(0)
    request = GenerationRequest(
        prompt_ids=[int(t) for t in rng.integers(0, VOCAB, PROMPT_TOKENS)],
        sampling=SamplingParams(),
        session_id="bench-session-0",
    )
    shape = (MB_ROWS, MB_ROW_LEN)
    micro_batch = {
        name: rng.integers(0, 1000, shape, dtype=np.int32)
        for name in ("tokens", "positions", "segment_ids", "subtree_end", "targets", "seq_index", "versions")
    }
    micro_batch.update(
        {name: rng.random(shape, dtype=np.float32) for name in ("loss_mask", "old_logprobs", "temperature")}
    )
    micro_batch.update({name: rng.random(64, dtype=np.float32) for name in ("advantages", "seq_weights")})
    return {"small": request, "large": micro_batch}


def _describe(name: str, obj) -> str:
    if name == "small":
        return f"GenerationRequest, {len(obj.prompt_ids)}-token prompt"
    return f"micro-batch dict of {len(obj)} numpy arrays ({sum(a.nbytes for a in obj.values())} array bytes)"


def _queue_round_trips(obj, warmup: int, n: int) -> list[float]:
    """The baseline: ping-pong of pickled ``obj`` between this thread and an echo thread over queue.Queue."""
    ping: queue.Queue = queue.Queue()
    pong: queue.Queue = queue.Queue()

    def echo() -> None:
        for _ in range(warmup + n):
            got = pickle.loads(ping.get(timeout=RECV_TIMEOUT_MS / 1e3))
            pong.put(pickle.dumps(got, protocol=pickle.HIGHEST_PROTOCOL))

    th = threading.Thread(target=echo, name="bench-echo", daemon=True)
    th.start()
    times = []
    for i in range(warmup + n):
        t = time.perf_counter()
        ping.put(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        pickle.loads(pong.get(timeout=RECV_TIMEOUT_MS / 1e3))
        if i >= warmup:
            times.append(time.perf_counter() - t)
    th.join(timeout=RECV_TIMEOUT_MS / 1e3)
    return times


class KVChannel:
    """The host channel before (kept here only to measure it): one key per message in the run's key-value
    store (``bench/kv/<name>/<k>``; the reader deletes each key)."""

    def __init__(self, client, name: str):
        self.client, self.name, self._send, self._recv = client, name, 0, 0

    def send(self, obj) -> None:
        self.client.key_value_set_bytes(f"bench/kv/{self.name}/{self._send}", pickle.dumps(obj, protocol=5))
        self._send += 1

    def recv(self, timeout_ms: int):
        key = f"bench/kv/{self.name}/{self._recv}"
        data = self.client.blocking_key_value_get_bytes(key, timeout_ms)
        self._recv += 1
        self.client.key_value_delete(key)
        return pickle.loads(data)


def _ping_pong(pid: int, ping, pong, obj, warmup: int, n: int) -> list[float]:
    """Process 0 sends ``obj`` on ``ping`` and waits for it back on ``pong`` (process 1 echoes); its times."""
    times = []
    if pid == 0:
        for i in range(warmup + n):
            t = time.perf_counter()
            ping.send(obj)
            pong.recv(timeout_ms=RECV_TIMEOUT_MS)
            if i >= warmup:
                times.append(time.perf_counter() - t)
    else:
        for _ in range(warmup + n):
            pong.send(ping.recv(timeout_ms=RECV_TIMEOUT_MS))
    return times


def _bench_channels(pid: int, client, warmup: int, n: int) -> dict:
    from gyre_jax import runtime
    from gyre_jax.runtime.channel import Channel

    ping, pong = Channel(client, "bench-ping"), Channel(client, "bench-pong")
    kv_ping, kv_pong = KVChannel(client, "ping"), KVChannel(client, "pong")
    out = {}
    for name, obj in _payloads().items():
        runtime.sync(f"channel-{name}", timeout_s=SETUP_TIMEOUT_S)
        times = _ping_pong(pid, ping, pong, obj, warmup, n)
        runtime.sync(f"kv-{name}", timeout_s=SETUP_TIMEOUT_S)
        kv_times = _ping_pong(pid, kv_ping, kv_pong, obj, max(1, warmup // 5), max(2, n // 5))
        runtime.sync(f"queue-{name}", timeout_s=SYNC_TIMEOUT_S)
        if pid == 0:  # process 1 waits at the next barrier meanwhile (host-side, idle)
            base = _queue_round_trips(obj, warmup, n)
            ch, q, kv = _stats_ms(times), _stats_ms(base), _stats_ms(kv_times)
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            gzip_s = []
            for _ in range(5):  # jax's coordination client gzips every request (use_compression=True)
                t = time.perf_counter()
                packed = zlib.compress(data, 6)
                gzip_s.append(time.perf_counter() - t)
            out[name] = {
                "payload": _describe(name, obj),
                "pickled_bytes": len(data),
                "gzip6_bytes": len(packed),
                "gzip6_ms": _pct(gzip_s, 50) * 1e3,
                "channel": ch,
                "kv_channel": kv,
                "queue": q,
                "median_ratio": ch["median_ms"] / q["median_ms"],
                "p90_ratio": ch["p90_ms"] / q["p90_ms"],
                "kv_median_ratio": kv["median_ms"] / q["median_ms"],
                "channel_times_ms": [t * 1e3 for t in times],
            }
    runtime.sync("channels-done", timeout_s=SETUP_TIMEOUT_S)
    return out


def _tree_bytes(tree) -> int:
    import jax
    import numpy as np

    return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _bench_weights(pid: int, warmup: int, repeats: int) -> dict:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from gyre_jax import runtime
    from gyre_jax.config import load_config
    from gyre_jax.model.config import TINY
    from gyre_jax.model.sharding import (
        abstract_model,
        init_params,
        make_mesh,
        param_shardings,
    )

    rules = tuple(tuple(r) for r in load_config([]).sharding_rules)
    cells = runtime.make_cells(None, 2, {"data": DEVICES_PER_PROCESS})
    devs = runtime.cells.host_ordered()  # 0-3 on process 0, 4-7 on process 1
    mesh01, mesh23, mesh45 = (make_mesh(devs[i : i + 2], {"data": 2}) for i in (0, 2, 4))
    _, abstract = abstract_model(TINY)
    sh = {
        "cell0": param_shardings(abstract, rules, cells[0].mesh),
        "cell1": param_shardings(abstract, rules, cells[1].mesh),
        "m01": param_shardings(abstract, rules, mesh01),
        "m23": param_shardings(abstract, rules, mesh23),
        "m45": param_shardings(abstract, rules, mesh45),
    }

    def like(shardings):  # what a process that holds none of a mesh passes for it
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)

    one = NamedSharding(cells[0].mesh, PartitionSpec())  # a 4-byte array, replicated: the latency floor
    if pid == 0:
        _, params4 = init_params(TINY, cells[0].mesh, rules, seed=0)
        params2 = jax.block_until_ready(jax.device_put(params4, sh["m01"]))
        tiny = jax.device_put(np.ones((1,), np.float32), one)
    else:
        params4, params2 = like(sh["cell0"]), like(sh["m01"])
        tiny = jax.ShapeDtypeStruct((1,), np.float32, sharding=one)
    param_bytes = _tree_bytes(abstract)
    uuids = iter(range(1, 1 << 30))  # one per point-to-point move; both processes draw them in one order

    def p2p(tree, shardings):
        return lambda: runtime.transfer(tree, shardings, uuid=next(uuids))

    # name -> (what it is, devices, bytes, cross-process?, call)
    variants = {
        "transfer_p2p_4to4_cross": (
            "transfer point to point across processes, 4-device cells",
            "0-3 -> 4-7",
            param_bytes,
            True,
            p2p(params4, sh["cell1"]),
        ),
        "transfer_p2p_2to2_cross": (
            "transfer point to point across processes, 2-device meshes",
            "0-1 -> 4-5",
            param_bytes,
            True,
            p2p(params2, sh["m45"]),
        ),
        "transfer_program_4to4_cross": (
            "transfer by a program over both cells (before), 4-device cells",
            "0-3 -> 4-7",
            param_bytes,
            True,
            lambda: runtime.transfer(params4, sh["cell1"]),
        ),
        "device_put_2to2_local": (
            "jax.device_put within process 0, 2-device meshes",
            "0-1 -> 2-3",
            param_bytes,
            False,
            lambda: jax.device_put(params2, sh["m23"]),
        ),
        "transfer_p2p_4to4_cross_4B": (
            "transfer point to point across processes, 4-device cells, one 4-byte array (latency floor)",
            "0-3 -> 4-7",
            4,
            True,
            p2p(tiny, NamedSharding(cells[1].mesh, PartitionSpec())),
        ),
    }
    runtime.sync("weights-ready", timeout_s=SETUP_TIMEOUT_S)
    times: dict[str, list[float]] = {k: [] for k in variants}
    dest_bytes: dict[str, int] = {}
    for r in range(warmup + repeats):
        for name, (_, _, _, cross, call) in variants.items():
            runtime.sync(f"{name}-{r}", timeout_s=SETUP_TIMEOUT_S if r < warmup else SYNC_TIMEOUT_S)
            if not cross and pid != 0:  # process 1 waits at the next barrier (host-side, idle)
                continue
            t = time.perf_counter()
            out = jax.block_until_ready(call())  # process 0, cross: its result has no shards (returns once offered)
            dt = time.perf_counter() - t
            if r >= warmup:
                times[name].append(dt)
            dest_bytes[name] = int(sum(s.data.nbytes for x in jax.tree.leaves(out) for s in x.addressable_shards))
            del out
    runtime.sync("weights-done", timeout_s=SETUP_TIMEOUT_S)
    return {
        "model": "TINY",
        "param_bytes": param_bytes,
        "leaves": len(jax.tree.leaves(abstract)),
        "warmup": warmup,
        "repeats": repeats,
        "variants": {
            name: {
                "what": what,
                "devices": devices,
                "bytes": nbytes,
                "cross_process": cross,
                "times_s": times[name],
                "dest_device_bytes": dest_bytes.get(name, 0),
            }
            for name, (what, devices, nbytes, cross, _) in variants.items()
        },
    }


def child(pid: int, port: int, out_dir: Path, smoke: bool) -> None:
    t_start = time.perf_counter()
    sys.path.insert(0, str(REPO))
    from gyre_jax import runtime
    from gyre_jax.config import config_from_dict, load_config

    config = config_from_dict(
        load_config([]),
        {
            "distributed.enabled": True,
            "distributed.coordinator_address": f"127.0.0.1:{port}",
            "distributed.num_processes": NUM_PROCESSES,
            "distributed.process_id": pid,
            "distributed.initialization_timeout_s": 120.0,
            "devices.num_cpu_devices": NUM_PROCESSES * DEVICES_PER_PROCESS,  # 8: a data=4 x fsdp=2 mesh
            "mesh.data": 4,
            "mesh.fsdp": 2,
            "cells.data": 4,
        },
    )
    runtime.initialize(config)
    import jax

    ch_warm, ch_n, w_warm, w_n = SIZES["smoke" if smoke else "full"]
    client = runtime.runtime().client
    runtime.sync("start", timeout_s=SETUP_TIMEOUT_S)
    phases = {"start": time.perf_counter() - t_start}
    result = {"process_id": pid, "local_devices": [d.id for d in jax.local_devices()], "phases_s": phases}
    t = time.perf_counter()
    result["channel"] = _bench_channels(pid, client, ch_warm, ch_n)
    phases["channel"], t = time.perf_counter() - t, time.perf_counter()
    result["weights"] = _bench_weights(pid, w_warm, w_n)
    phases["weights"] = time.perf_counter() - t
    (out_dir / f"result_{pid}.json").write_text(json.dumps(result))
    runtime.sync("end", timeout_s=SETUP_TIMEOUT_S)
    runtime.shutdown()


# == parent ===============================================================================================
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no output)"
    return "\n".join("    " + line for line in lines[-n:]) or "    (empty)"


def run_children(tmp: Path, smoke: bool, timeout_s: float) -> list[dict]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONUNBUFFERED"] = "1"
    procs, logs = [], []
    for pid in range(NUM_PROCESSES):
        log = tmp / f"child_{pid}.log"
        logs.append(log)
        cmd = [
            sys.executable,
            "-u",
            str(Path(__file__).resolve()),
            "--child",
            str(pid),
            "--port",
            str(port),
            "--dir",
            str(tmp),
        ] + (["--smoke"] if smoke else [])
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))

    def kill_all() -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the child's own session: it and nothing else
                except ProcessLookupError:
                    pass
                p.wait(timeout=30)

    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):  # one failed: the other's watchdog stops it
                grace = time.monotonic() + 10.0
                while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                    time.sleep(0.2)
                break
            time.sleep(0.2)
        hung = [i for i, p in enumerate(procs) if p.poll() is None]
        if hung and all(p.returncode in (None, 0) for p in procs):
            tails = "\n".join(f"  process {i}:\n{_tail(log)}" for i, log in enumerate(logs))  # before the kill
            kill_all()
            raise SystemExit(
                f"bench_multiprocess: child process(es) {hung} did not finish within {timeout_s:.0f} s "
                f"(a hang?); killed them. Last lines of each before that:\n{tails}"
            )
    finally:
        kill_all()
    codes = [p.returncode for p in procs]
    if any(codes):
        # The one that failed first is the one whose exit code is not the watchdog's "peer lost" (75).
        culprits = [i for i, c in enumerate(codes) if c not in (0, 75, -signal.SIGKILL)] or [
            i for i, c in enumerate(codes) if c != 0
        ]
        i = culprits[0]
        raise SystemExit(
            f"bench_multiprocess: child process {i} failed (exit code {codes[i]}; all: {codes}). "
            f"Last lines of its output:\n{_tail(logs[i])}"
        )
    return [json.loads((tmp / f"result_{pid}.json").read_text()) for pid in range(NUM_PROCESSES)]


def combine(results: list[dict], smoke: bool) -> dict:
    import jax

    channel = results[0]["channel"]
    weights = {k: v for k, v in results[0]["weights"].items() if k != "variants"}
    weights["variants"] = {}
    for name, v0 in results[0]["weights"]["variants"].items():
        v1 = results[1]["weights"]["variants"][name]
        dest = v1 if v0["cross_process"] else v0  # timed where the bytes land, to completion
        med = _pct(dest["times_s"], 50)
        v = {k: v0[k] for k in ("what", "devices", "cross_process", "bytes")}
        v.update(
            timed_on_process=1 if v0["cross_process"] else 0,
            dest_device_bytes=dest["dest_device_bytes"],
            median_s=med,
            p90_s=_pct(dest["times_s"], 90),
            mb_per_s=v["bytes"] / med / 1e6,
            times_s=dest["times_s"],
        )
        if v0["cross_process"]:  # how long the leader's call takes (it returns once its side is dispatched)
            v["leader_median_s"] = _pct(v0["times_s"], 50)
        weights["variants"][name] = v
    base = weights["variants"]["device_put_2to2_local"]["median_s"]
    for v in weights["variants"].values():
        v["median_over_device_put_2to2"] = v["median_s"] / base
    v = weights["variants"]
    weights["p2p_4to4_over_p2p_2to2"] = (
        v["transfer_p2p_4to4_cross"]["median_s"] / v["transfer_p2p_2to2_cross"]["median_s"]
    )
    weights["program_4to4_over_p2p_4to4"] = (
        v["transfer_program_4to4_cross"]["median_s"] / v["transfer_p2p_4to4_cross"]["median_s"]
    )
    return {
        "benchmark": "bench_multiprocess",
        "smoke": smoke,
        "processes": NUM_PROCESSES,
        "devices_per_process": DEVICES_PER_PROCESS,
        "platform": "cpu (virtual devices, gloo collectives over loopback)",
        "machine": f"{os.cpu_count()} cpus, {platform.machine()}",
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "jax_version": jax.__version__,
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "phases_s": [r["phases_s"] for r in results],
        "channel": channel,
        "weights": weights,
    }


def tables(res: dict) -> str:
    lines = [
        (
            "Channel round trip (process 0 -> process 1 -> process 0): TCP Channel (now), the key-value store "
            "(before), queue.Queue between two threads of one process with the same pickling:"
        ),
        "",
        (
            "| payload | pickled bytes | Channel median ms | Channel p90 ms | key-value (before) median ms | "
            "queue median ms | queue p90 ms | Channel / queue | key-value / queue |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in res["channel"].items():
        lines.append(
            f"| {name}: {c['payload']} | {c['pickled_bytes']:,} | {c['channel']['median_ms']:.3f} | "
            f"{c['channel']['p90_ms']:.3f} | {c['kv_channel']['median_ms']:.2f} | {c['queue']['median_ms']:.3f} | "
            f"{c['queue']['p90_ms']:.3f} | {c['median_ratio']:.1f} | {c['kv_median_ratio']:.0f} |"
        )
    w = res["weights"]
    lines += [
        "",
        (
            f"Weights: {w['model']} params ({w['param_bytes']:,} bytes, {w['leaves']} arrays), "
            f"median of {w['repeats']} calls:"
        ),
        "",
        (
            "| move | devices | bytes | bytes on destination devices | median ms | p90 ms | MB/s | "
            "vs device_put 2->2 | leader's call median ms |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in w["variants"].values():
        leader = f"{v['leader_median_s'] * 1e3:.2f}" if "leader_median_s" in v else "-"
        lines.append(
            f"| {v['what']} | {v['devices']} | {v['bytes']:,} | {v['dest_device_bytes']:,} | "
            f"{v['median_s'] * 1e3:.2f} | {v['p90_s'] * 1e3:.2f} | {v['mb_per_s']:.2f} | "
            f"{v['median_over_device_put_2to2']:.2f} | {leader} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="JSON path (default benchmarks/results/multiprocess[_smoke].json)")
    parser.add_argument("--smoke", action="store_true", help="a very short run (tests)")
    parser.add_argument("--timeout", type=float, default=0.0, help="seconds for the whole run (default 600; smoke 180)")
    parser.add_argument("--child", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child >= 0:
        child(args.child, args.port, Path(args.dir), args.smoke)
        return 0
    out = Path(args.out or REPO / "benchmarks" / "results" / f"multiprocess{'_smoke' if args.smoke else ''}.json")
    timeout_s = args.timeout or (180.0 if args.smoke else 600.0)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_multiprocess_") as tmp:
        results = run_children(Path(tmp), args.smoke, timeout_s)
    res = combine(results, args.smoke)
    res["wall_s"] = time.monotonic() - t0
    print(tables(res))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {out} ({res['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
