"""Benchmark: what a cell over several processes costs (``runtime.lockstep``), against the same cell in one process.

    python benchmarks/bench_lockstep.py                      # ~20 min on 2 cores
    python benchmarks/bench_lockstep.py --steps 1 --reps 1   # a shorter pass (fewer samples)

Every run is ``python -m gyre_jax.train --config configs/tiny_cpu.py`` (the tiny model, 8 virtual CPU devices, a
data=4 x fsdp=2 training mesh, 2 tasks x 4 samples a step, no evaluation) resuming from one warm-started checkpoint
(60 demonstration steps, made once by a one-process run), so every layout trains the same programs from the same
weights. What is compared comes from each run's ``cost_measurements.json`` (docs/records.md): the serving loop's
iterations, the micro-steps, optimizer steps, role switches, weight syncs and session moves, timed where the run
times them (on the cell's driver: for a cell over processes, sending each device call to its peers is inside).

1. **Lockstep overhead**: one cell of 8 devices (data 4 x fsdp 2; the core, serving and training in turn), in one
   process (``one_process``, the baseline) and over 2 processes x 4 devices (``two_processes``: process 0 drives
   the cell, process 1 replays every device call). Decode steps (serving iterations without a prefill, grouped by
   batch size; stalls dropped as the simulator's calibration drops them: longer than 1 s and 20 x the median),
   micro-steps and optimizer steps; ratio = median over median, samples pooled over ``--reps`` repetitions that
   alternate which layout runs first.
2. **Moves between cells over processes**: two cells of 4 devices (data 2 x fsdp 2) under the elastic policy, in
   one process (``one_process_2cells``, the baseline) and as 4 processes x 2 devices (``four_processes_2cells``:
   each cell spans 2 processes). Role switch times each way (serving -> training: the cell's sessions move to the
   other cell with their KV, then the cell loads the current weights; training -> serving: the weights are
   published onto its serving layout), weight syncs at step ends, and session moves alone (``[sessions, seconds]``).

3. **Where a decode step's time goes** (``--engine``, also run by default): the same cell's engine driven
   directly (``ServingLoop``, 16 requests of 100 tokens, 3 rounds; no harnesses, no training) in 1 process x 8
   devices and in 2 processes x 4, with the lockstep's own work timed on both sides (the driver encoding each
   call, the peer decoding it, the peer waiting for the next message, the peer running the program), the number
   of collectives in the compiled decode program, and what one collective costs in each layout (a program of 4
   all-reduces within each process's devices, and of 4 across processes, against the same program without them).

4. **Session moves between cells over processes**: ``tests/runtime/lockstep_worker.py`` (4 processes x 2
   devices, 2 cells of 2 processes each; what ``tests/runtime/test_lockstep.py`` checks for equal completions)
   moves 3 requests mid-generation from cell 1 to cell 0 and 3 from cell 0 to cell 1, KV included, then an idle
   session's cached KV; each ``move_sessions_to`` is timed on process 0.

Prints markdown tables and writes JSON (``--out``, default ``benchmarks/results/lockstep.json``). Every run has a
timeout; a failed run stops the benchmark with its log's last lines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
BASE = [
    "--config", "configs/tiny_cpu.py", "--config.devices.num_cpu_devices=8", "--config.mesh.data=4",
    "--config.mesh.fsdp=2", "--config.rollout.tasks_per_step=2", "--config.rl.group_size=4",
    "--config.rollout.num_tasks=2", "--config.eval.samples_per_task=0", "--config.metrics.progress_bar=false",
    "--config.metrics.tensorboard=false", "--config.rollout.timeout_s=600", "--config.warm_start.steps=60",
]  # fmt: skip
ONE_CELL = ["--config.cells.num_cells=1", "--config.cells.data=4", "--config.cells.fsdp=2"]
# tool calls of ~1 s: sessions wait between calls, so a cell leaving serving has sessions (and their KV) to move
TWO_CELLS = ["--config.cells.num_cells=2", "--config.cells.data=2", "--config.cells.fsdp=2",
             "--config.schedule.policy=elastic", "--config.rollout.tool_latency_median_s=1.0"]  # fmt: skip
LAYOUTS = {  # name -> (processes, cell flags)
    "one_process": (1, ONE_CELL),
    "two_processes": (2, ONE_CELL),
    "one_process_2cells": (1, TWO_CELLS),
    "four_processes_2cells": (4, TWO_CELLS),
}
STALL_MIN_S, STALL_FACTOR = 1.0, 20.0  # gyre_jax.sim.calibrate's COMPILE_MIN_S, COMPILE_FACTOR


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # the config makes the devices
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # every run compiles its own: no layout starts warmer
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(workdir: Path, processes: int, extra: list[str], timeout_s: float) -> None:
    """One run of ``processes`` processes; raises with the logs' tails if any exits non-zero or runs past the
    timeout."""
    args = [*BASE, *extra, f"--config.workdir={workdir}"]
    if processes > 1:
        port = _free_port()
        args += ["--config.distributed.enabled=true", f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                 f"--config.distributed.num_processes={processes}"]  # fmt: skip
    cmds = [[PY, "-m", "gyre_jax.train", *args] + ([f"--config.distributed.process_id={p}"] if processes > 1 else [])
            for p in range(processes)]  # fmt: skip
    run_processes(cmds, [workdir.parent / f"{workdir.name}.p{p}.log" for p in range(processes)], timeout_s,
                  workdir.name)  # fmt: skip


def run_processes(cmds: list[list[str]], logs: list[Path], timeout_s: float, what: str) -> None:
    """Starts ``cmds`` together (output to ``logs``) and waits for all; raises with the logs' tails if any exits
    non-zero or they run past ``timeout_s`` (then all are killed)."""
    procs = [subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)
             for cmd, log in zip(cmds, logs)]  # fmt: skip
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
            break
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    if codes != [0] * len(procs):
        tails = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs)
        raise SystemExit(f"{what}: exit codes {codes} (None: past {timeout_s:.0f} s)\n{tails}")


def steady(times: list[float]) -> list[float]:
    """``times`` without the stalls (a jit compile, a step boundary): longer than 1 s and 20 x the median."""
    if not times:
        return []
    cut = max(STALL_MIN_S, STALL_FACTOR * statistics.median(times))
    return [t for t in times if t <= cut]


def _stats(times: list[float]) -> dict:
    if not times:
        return {"n": 0}
    s = sorted(times)
    return {"n": len(s), "median_s": statistics.median(s), "p90_s": s[min(len(s) - 1, int(0.9 * len(s)))]}


def samples(measurements: list[dict]) -> dict[str, list[float]]:
    """The timed samples of one layout's runs, pooled: ``decode`` (all batch sizes), ``decode_b<N>`` (batch N),
    ``micro_step``, ``optimizer_step``, ``to_training``, ``to_serving``, ``weight_sync``, ``session_move``."""
    out: dict[str, list[float]] = {}
    for m in measurements:
        decode = steady([float(s) for _, _, s in m.get("decode_steps", [])])
        cut = max(decode) if decode else 0.0
        for b, _, s in m.get("decode_steps", []):
            if s <= cut:
                out.setdefault("decode", []).append(float(s))
                out.setdefault(f"decode_b{int(b)}", []).append(float(s))
        for key, name in (("optimizer_steps", "optimizer_step"), ("serving_to_training", "to_training"),
                          ("training_to_serving", "to_serving"), ("weight_syncs", "weight_sync")):  # fmt: skip
            out.setdefault(name, []).extend(float(x) for x in m.get(key, []))
        out.setdefault("micro_step", []).extend(steady([float(s) for _, s in m.get("micro_steps", [])]))
        out.setdefault("session_move", []).extend(float(s) for _, s in m.get("session_moves", []))
    return out


def compare(base: dict[str, list[float]], other: dict[str, list[float]], min_n: int = 3) -> dict[str, dict]:
    """Per sample kind present in both with >= ``min_n`` samples: each side's stats and ``ratio`` = other's
    median / base's median."""
    out = {}
    for key in sorted(set(base) & set(other)):
        a, b = _stats(base[key]), _stats(other[key])
        if a["n"] >= min_n and b["n"] >= min_n:
            out[key] = {"baseline": a, "measured": b, "ratio": b["median_s"] / a["median_s"]}
    return out


def table(title: str, base: str, other: str, rows: dict[str, dict]) -> str:
    lines = [f"\n### {title}\n", f"| part | n ({base}) | median ms ({base}) | n ({other}) | median ms ({other}) "
             f"| ratio {other} / {base} |", "|---|---|---|---|---|---|"]  # fmt: skip
    for key, r in rows.items():
        a, b = r["baseline"], r["measured"]
        lines.append(f"| {key} | {a['n']} | {a['median_s'] * 1e3:.2f} | {b['n']} | {b['median_s'] * 1e3:.2f} "
                     f"| {r['ratio']:.3f} |")  # fmt: skip
    return "\n".join(lines)


# -- part 3: the engine driven directly ------------------------------------------------------------------
ENGINE_REQUESTS, ENGINE_TOKENS, ENGINE_ROUNDS = 16, 100, 3
DECODE_PROGRAM = "generate"  # the engine's decode step (``steps.decode_step``) in its program table
COLLECTIVE_OPS = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def engine_child(pid: int, processes: int, port: int, out: Path) -> None:
    """One process of part 3 (see the module docstring); process 0 writes ``out`` (JSON), the peer its own
    timings to ``out`` with ``.peer`` appended."""
    import collections
    import re

    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))
    from layouts import EIGHT_DEVICES

    from gyre_jax import runtime
    from gyre_jax.config import config_from_dict, load_config

    over: dict = {"cells.num_cells": 1, "cells.data": 4, "cells.fsdp": 2}
    if processes > 1:
        over.update({"distributed.enabled": True, "distributed.coordinator_address": f"127.0.0.1:{port}",
                     "distributed.num_processes": processes, "distributed.process_id": pid})  # fmt: skip
    config = config_from_dict(load_config(["--config", str(REPO / "configs" / "tiny_cpu.py"), *EIGHT_DEVICES]), over)
    runtime.initialize(config)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from gyre_jax.model.sharding import abstract_model, init_params
    from gyre_jax.runtime import lockstep
    from gyre_jax.serving.engine import Engine
    from gyre_jax.serving.loop import ServingLoop
    from gyre_jax.serving.types import GenerationRequest, SamplingParams

    times: dict[str, list[float]] = collections.defaultdict(list)

    def timed(name: str, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[name].append(time.perf_counter() - t0)

        return wrapper

    class Factory:
        def __init__(self, cfg, graphdef, rules):
            self.cfg, self.graphdef, self.rules = cfg, graphdef, rules

        def make_engine(self, cell):
            return Engine(self.cfg, self.graphdef, cell.mesh, self.rules, max_concurrent_decodes=ENGINE_REQUESTS,
                          max_seq_len=256, max_prefill_length=64, prefill_buckets=(16, 32, 64), page_size=16)  # fmt: skip

    rules = tuple((k, v) for k, v in config.sharding_rules)
    cfg = config.model_config()
    cell = runtime.make_cells(None, 1, {"data": 4, "fsdp": 2})[0]
    _, params = init_params(cfg, cell.mesh, rules, seed=0)
    factory = Factory(cfg, abstract_model(cfg)[0], rules)
    objects = {"factory": factory, cell.name: cell}

    # what one collective costs here: 4 all-reduces within each process's devices / across processes
    mesh = cell.mesh
    x = jax.make_array_from_callback(
        (4, 64), NamedSharding(mesh, PartitionSpec("data", "fsdp")), lambda i: np.ones((4, 64), np.float32)[i]
    )

    def reduce_over(axis: int | None):
        def f(x):
            for _ in range(4):
                x = x + (jnp.sum(x, axis=axis, keepdims=True) if axis is not None else x) * 1e-3
            return x

        return jax.jit(f, out_shardings=x.sharding)

    collectives = {}
    for name, axis in (("none", None), ("within_process", 1), ("across_processes", 0)):
        fn = reduce_over(axis)
        jax.block_until_ready(fn(x))
        ts = []
        for _ in range(200):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            ts.append(time.perf_counter() - t0)
        collectives[name] = statistics.median(ts)

    if processes > 1 and pid > 0:  # the peer: replays the driver's calls, timing its parts
        replayer = lockstep.Replayer(runtime.runtime().client, cell, pid, objects)
        replayer.adopt("params", params)
        replayer.channel.recv = timed("peer_wait", replayer.channel.recv)
        replayer.decode = timed("peer_decode", replayer.decode)
        find = lockstep.find_program

        def find_timed(engine, name):
            program = find(engine, name)
            return type("Timed", (), {"run": staticmethod(timed(f"peer_run_{name}", program.run))})

        lockstep.find_program = find_timed
        replayer.run()
        Path(str(out) + ".peer").write_text(json.dumps({k: v for k, v in times.items()}))
        runtime.shutdown()
        return
    if processes > 1:
        group = lockstep.drive(runtime.runtime().client, cell, objects)
        mine = group.adopt("params", params)
        group.encode = timed("driver_encode", group.encode)
        engine = lockstep.LockstepEngine(group, group.call("factory", "make_engine", cell, bind="engine"), "engine")
        inner = engine._engine
    else:
        mine, engine = params, factory.make_engine(cell)
        inner = engine
    loop = ServingLoop(engine, mine, name=cell.name, kv_pages=64).start()
    rounds = []
    for _ in range(ENGINE_ROUNDS):
        before = len(loop.step_log)
        futures = [
            loop.submit(
                GenerationRequest(
                    list(range(5 + i, 20 + i)),
                    SamplingParams(temperature=1.0 if i % 2 else 0.0, max_tokens=ENGINE_TOKENS, seed=i),
                )
            )  # fmt: skip
            for i in range(ENGINE_REQUESTS)
        ]
        for f in futures:
            f.result(timeout=600)
        rounds.append([s for b, _, p, s, _ in list(loop.step_log)[before:] if not p and b > 0])
    loop.stop()
    counts = collections.Counter()  # of one compiled decode step (every window and slot bucket has the same ops)
    decode = [c for key, c in inner.programs._compiled.items() if key[0] == DECODE_PROGRAM]
    if decode:
        counts.update(re.findall(r" (" + "|".join(COLLECTIVE_OPS) + r")(?:-start)?\(", decode[0].as_text()))
    if processes > 1:
        group.stop()
    res = {"processes": processes, "decode_rounds_s": rounds, "times": dict(times),
           "decode_collectives": dict(counts), "collective_program_s": collectives}  # fmt: skip
    out.write_text(json.dumps(res))
    if processes > 1:
        runtime.shutdown()


def run_engine_part(root: Path, timeout_s: float) -> dict:
    """Part 3: the one-process run, then the two-process one; their results combined."""
    results = {}
    for processes in (1, 2):
        out = root / f"engine_{processes}.json"
        port = _free_port()
        cmds = [[PY, __file__, "--engine-child", str(pid), str(processes), str(port), str(out)]
                for pid in range(processes)]  # fmt: skip
        logs = [root / f"engine_{processes}_p{pid}.log" for pid in range(processes)]
        run_processes(cmds, logs, timeout_s, f"engine part ({processes} processes)")
        results[processes] = json.loads(out.read_text())
        if processes > 1:
            results["peer"] = json.loads(Path(str(out) + ".peer").read_text())
    return combine_engine(results)


def combine_engine(results: dict) -> dict:
    """The decode-step medians (all rounds but the first, which compiles), the lockstep's parts per call, the
    collectives of the decode program and what one costs in each layout."""
    one, two, peer = results[1], results[2], results["peer"]

    def steady_median(rounds):
        return statistics.median([s for r in rounds[1:] for s in r])

    step1, step2 = steady_median(one["decode_rounds_s"]), steady_median(two["decode_rounds_s"])
    runs = peer.get(f"peer_run_{DECODE_PROGRAM}", [])
    per_call = {
        "driver_encode_ms": statistics.median(two["times"]["driver_encode"]) * 1e3,
        "peer_decode_ms": statistics.median(peer["peer_decode"]) * 1e3,
        "peer_wait_ms": statistics.median(peer["peer_wait"]) * 1e3,
        "peer_runs_decode_program_ms": statistics.median(runs) * 1e3 if runs else None,
    }

    def per_collective(c):  # 4 collectives per program, over the program without them
        return {k: (c[k] - c["none"]) / 4 * 1e3 for k in ("within_process", "across_processes")}

    return {
        "decode_step_ms": {"one_process": step1 * 1e3, "two_processes": step2 * 1e3, "ratio": step2 / step1},
        "lockstep_per_call": per_call,
        "decode_collectives": two["decode_collectives"],
        "collective_ms": {
            "one_process": per_collective(one["collective_program_s"]),
            "two_processes": per_collective(two["collective_program_s"]),
        },  # fmt: skip
    }


def run_moves_part(root: Path, timeout_s: float) -> dict:
    """Part 4: the 4-process move choreography of ``tests/runtime/lockstep_worker.py``, timed."""
    out = root / "moves"
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    worker = REPO / "tests" / "runtime" / "lockstep_worker.py"
    cmds = [[PY, str(worker), str(pid), str(port), str(out)] for pid in range(4)]
    run_processes(cmds, [out / f"p{pid}.log" for pid in range(4)], timeout_s, "moves part")
    res = json.loads((out / "lockstep.json").read_text())
    states = {"1_to_0_in_flight": res["moved_1_to_0_states"], "0_to_1_in_flight": res["moved_0_to_1_states"]}
    return {"move_s": res["move_s"], "sessions": {k: len(v) for k, v in states.items()},
            "in_flight": {k: sum(1 for f, _ in v if f) for k, v in states.items()}}  # fmt: skip


def engine_table(e: dict) -> str:
    d, c, lc = e["decode_step_ms"], e["collective_ms"], e["lockstep_per_call"]
    n = sum(e["decode_collectives"].values())
    lines = [
        "\n### The decode step of one cell of 8 devices, engine driven directly\n",
        "| | one process x 8 | two processes x 4 | ratio |",
        "|---|---|---|---|",
        f"| decode step, median ms | {d['one_process']:.2f} | {d['two_processes']:.2f} | {d['ratio']:.2f} |",
        f"| one collective within a process's devices, ms | {c['one_process']['within_process']:.3f} "
        f"| {c['two_processes']['within_process']:.3f} | |",
        f"| one collective across the cell's devices, ms | {c['one_process']['across_processes']:.3f} "
        f"| {c['two_processes']['across_processes']:.3f} | |",
        f"| collectives in the compiled decode program | {n} ({e['decode_collectives']}) | | |",
        "",
        "| lockstep, per call (two processes) | ms |",
        "|---|---|",
    ]
    lines += [f"| {k[:-3].replace('_', ' ')} | {v:.3f} |" for k, v in lc.items() if v is not None]
    return "\n".join(lines)


def train_parts(root: Path, args: argparse.Namespace) -> dict:
    """Parts 1 and 2: the warm start, then the runs in alternating order; prints their tables."""
    warm = root / "warm"
    shutil.rmtree(warm, ignore_errors=True)
    print(f"warm start (one process, 60 steps) in {warm}", flush=True)
    train(warm, 1, [*ONE_CELL, "--config.total_steps=0"], args.timeout)
    order = []
    for r in range(args.reps):  # alternating, so that a slower stretch of the machine falls on both
        pair = ["one_process", "two_processes"]
        order += pair if r % 2 == 0 else pair[::-1]
    order += ["one_process_2cells", "four_processes_2cells"]
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for i, name in enumerate(order):
        processes, flags = LAYOUTS[name]
        wd = root / f"{i}-{name}"
        shutil.rmtree(wd, ignore_errors=True)
        shutil.copytree(warm / "checkpoints" / "0", wd / "checkpoints" / "0")
        t = time.monotonic()
        train(wd, processes, [*flags, f"--config.total_steps={args.steps}"], args.timeout)
        runs[name].append(json.loads((wd / "cost_measurements.json").read_text()))
        print(f"{name}: {time.monotonic() - t:.0f} s", flush=True)
    pooled = {name: samples(ms) for name, ms in runs.items()}
    overhead = compare(pooled["one_process"], pooled["two_processes"])
    moves = compare(pooled["one_process_2cells"], pooled["four_processes_2cells"], min_n=1)
    print(table("A cell of 8 devices over 2 processes x 4 against one process x 8 (runtime.lockstep)",
                "one_process", "two_processes", overhead))  # fmt: skip
    print(table("Two cells of 4 devices, each over 2 processes (4 x 2) against one process x 8: moves",
                "one_process_2cells", "four_processes_2cells", moves))  # fmt: skip
    return {"steps": args.steps, "reps": args.reps, "order": order, "overhead": overhead, "moves": moves,
            "samples": pooled}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="RL steps per run (after the warm start)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of the lockstep-overhead pair")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "lockstep.json")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    parser.add_argument("--engine", action="store_true", help="only part 3 (the engine driven directly)")
    parser.add_argument("--engine-child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_child:
        pid, processes, port, out = args.engine_child
        engine_child(int(pid), int(processes), int(port), Path(out))
        return 0
    t0 = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="bench_lockstep_")) if args.keep is None else args.keep
    root.mkdir(parents=True, exist_ok=True)
    res = {
        "benchmark": "lockstep",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }
    if not args.engine:
        res.update(train_parts(root, args))
    print("engine part (1 process, then 2)", flush=True)
    res["engine"] = run_engine_part(root, args.timeout)
    print(engine_table(res["engine"]))
    print("moves part (4 processes)", flush=True)
    res["moves_between_cells"] = run_moves_part(root, args.timeout)
    print("\n### Session moves between two cells of 2 processes each (4 x 2 devices), KV included\n")
    print("| move | sessions | of them in flight | seconds |\n|---|---|---|---|")
    m = res["moves_between_cells"]
    for k, v in m["move_s"].items():
        print(f"| {k.replace('_', ' ')} | {m['sessions'].get(k, 1)} | {m['in_flight'].get(k, 0)} | {v:.3f} |")
    res["wall_s"] = time.monotonic() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {args.out} ({res['wall_s']:.0f} s)")
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
