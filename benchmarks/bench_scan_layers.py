"""Layer scan benchmark: compile time and compiled memory of a training step, per depth, scanned vs unrolled.

For each depth (number of decoder layers), layer layout (``model.scan_layers``: the per-layer loop, "unrolled",
or the stacked layers as one ``lax.scan`` body, "scan") and remat policy, the step is ``jax.value_and_grad`` of
next-token cross-entropy over a packed causal batch (the ``bench_model.py`` step), jitted on one device:

- **trace s**: tracing + lowering to StableHLO (``jit(...).lower``); **compile s**: XLA's ``.compile()``; each
  the fastest of ``--compiles`` runs from an empty cache (the machine is shared); **cpu s**: the compile's CPU
  seconds (this process, all threads: what other processes on the machine change least);
- **peak MiB**: XLA's ``compiled.memory_analysis()`` of that step: arguments + outputs + temporaries - aliased
  (weights, batch, gradients and everything the backward keeps); **temp MiB**: the temporaries alone;
- **decode**: the same for one cached decode step (no gradient; the cached forward runs layer by layer in
  both layouts, over slices of the stacked weights with scan; |dloss| is then the logits' max difference);
- **step s**: the median of ``--rounds`` runs of the compiled step, the two layouts alternating (same device,
  same moment: their ratio is what to read on a shared machine); **|dloss|**: the two layouts' losses differ
  by this (same seed: same weights).

Widths are the tiny preset's (E=128, 4 heads, 2 KV heads, D=32, MLP 384, vocab 272, float32).

    python benchmarks/bench_scan_layers.py                       # depths 2 8 16 32, remat none and full
    python benchmarks/bench_scan_layers.py --depths 2 4 --rounds 1 --out /tmp/s.json   # seconds

Prints a table and writes JSON (``--out``, default ``benchmarks/results/scan_layers_cpu.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from benchmarks.bench_model import _loss  # noqa: E402
from gyre_jax.model.attention import cache_mask, init_cache  # noqa: E402
from gyre_jax.model.config import TINY  # noqa: E402
from gyre_jax.model.sharding import RULES_DATA, init_params, make_mesh  # noqa: E402

MIB = 1024**2


def _compile(fn, args, repeats: int) -> tuple[dict, object]:
    """Lowers and compiles ``jit(fn)(*args)`` ``repeats`` times from an empty cache (the machine is shared: the
    fastest is the cost): the best trace and compile times, XLA's memory analysis, and the executable."""
    traces, compiles, cpu = [], [], []
    for _ in range(repeats):
        jax.clear_caches()
        t0, c0 = time.perf_counter(), time.process_time()
        lowered = jax.jit(fn).lower(*args)
        t1, c1 = time.perf_counter(), time.process_time()
        compiled = lowered.compile()
        traces.append(t1 - t0)
        compiles.append(time.perf_counter() - t1)
        cpu.append((c1 - c0, time.process_time() - c1))
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    row = dict(
        trace_s=min(traces),
        compile_s=min(compiles),
        trace_cpu_s=min(c[0] for c in cpu),
        compile_cpu_s=min(c[1] for c in cpu),
        trace_s_all=traces,
        compile_s_all=compiles,
    )
    return dict(row, peak_bytes=int(peak), temp_bytes=int(m.temp_size_in_bytes)), compiled


def _time_alternating(steps: list, rounds: int) -> list[list[float]]:
    """steps: (executable, args) per layout -> seconds of each run, the layouts alternating ``rounds`` times."""
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for i, (compiled, args) in enumerate(steps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times[i].append(time.perf_counter() - t0)
    return times


def run_depth(depth: int, remat: str, batch: int, seq_len: int, rounds: int, repeats: int, device) -> list[dict]:
    """The training step in both layouts at one depth and remat policy: compile each, then run them alternately."""
    rng = np.random.default_rng(0)
    tokens = jax.device_put(jnp.asarray(rng.integers(0, TINY.vocab_size, (batch, seq_len)), jnp.int32), device)
    segments = jax.device_put(jnp.ones((batch, seq_len), jnp.int32), device)
    coef = jnp.float32(0.0)
    mesh = make_mesh([device], {})
    rows, steps = [], []
    for scan in (False, True):
        cfg = dataclasses.replace(TINY, num_layers=depth, remat_policy=remat, scan_layers=scan)
        graphdef, params = init_params(cfg, mesh, RULES_DATA, seed=0)
        step = jax.value_and_grad(lambda p, *a, graphdef=graphdef: _loss(graphdef, p, *a))
        args = (params, tokens, segments, coef)
        row, compiled = _compile(step, args, repeats)
        loss, grads = compiled(*args)  # warm-up
        jax.block_until_ready(grads)
        rows.append(dict(depth=depth, layout="scan" if scan else "unrolled", remat=remat, loss=float(loss), **row))
        steps.append((compiled, args))
    for row, ts in zip(rows, _time_alternating(steps, rounds)):
        row.update(step_s=statistics.median(ts), step_s_all=ts, dloss=abs(rows[1]["loss"] - rows[0]["loss"]))
    return rows


def run_decode(depth: int, batch: int, cache_len: int, rounds: int, repeats: int, device) -> list[dict]:
    """One cached decode step (a token per row over a ``cache_len`` cache) in both layouts: compile, memory, time.
    The cached forward runs layer by layer in both layouts (over slices of the stacked weights with scan)."""
    positions = jax.device_put(jnp.full((batch, 1), cache_len // 2, jnp.int32), device)
    tokens = jax.device_put(jnp.ones((batch, 1), jnp.int32), device)
    mesh = make_mesh([device], {})
    rows, steps = [], []
    for scan in (False, True):
        cfg = dataclasses.replace(TINY, num_layers=depth, scan_layers=scan)
        graphdef, params = init_params(cfg, mesh, RULES_DATA, seed=0)
        cache = jax.device_put(init_cache(cfg, batch, cache_len), device)

        def step(p, tok, pos, c, graphdef=graphdef, cfg=cfg):
            return nnx.merge(graphdef, p)(tok, pos, cache_mask(cfg, pos, cache_len), c)

        args = (params, tokens, positions, cache)
        row, compiled = _compile(step, args, repeats)
        logits = np.asarray(compiled(*args)[0])
        rows.append(dict(depth=depth, layout="scan" if scan else "unrolled", remat="-", logits=logits, **row))
        steps.append((compiled, args))
    diff = float(np.max(np.abs(rows[1].pop("logits") - rows[0].pop("logits"))))
    for row, ts in zip(rows, _time_alternating(steps, rounds)):
        row.update(step_s=statistics.median(ts), step_s_all=ts, dloss=diff)
    return rows


def print_table(results: list[dict]) -> None:
    header = (
        f"{'depth':>5s} {'remat':>5s} {'layout':>8s} {'trace s':>8s} {'compile s':>9s} {'cpu s':>6s} "
        f"{'peak MiB':>9s} {'temp MiB':>9s} {'step s':>7s} {'|dloss|':>8s}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['depth']:5d} {r['remat']:>5s} {r['layout']:>8s} {r['trace_s']:8.2f} {r['compile_s']:9.2f} "
            f"{r['compile_cpu_s']:6.2f} "
            f"{r['peak_bytes'] / MIB:9.1f} {r['temp_bytes'] / MIB:9.1f} {r['step_s']:7.3f} {r['dloss']:8.1e}"
        )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 8, 16, 32])
    parser.add_argument("--remat", nargs="+", default=["none", "full"], help="remat policies to measure")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--compiles", type=int, default=3, help="compiles of each program (the fastest is reported)")
    parser.add_argument("--cache-len", type=int, default=256, help="decode: KV cache slots per row")
    parser.add_argument("--rounds", type=int, default=5, help="timed runs of each compiled step (alternating)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "scan_layers_cpu.json"))
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    results = []
    for depth in args.depths:
        for remat in args.remat:
            rows = run_depth(depth, remat, args.batch, args.seq_len, args.rounds, args.compiles, device)
            results += rows
            print_table(rows)
            sys.stdout.flush()
    decode = []
    for depth in args.depths:
        rows = run_decode(depth, args.batch, args.cache_len, args.rounds, args.compiles, device)
        decode += rows
        print_table(rows)
        sys.stdout.flush()
    report = dict(
        benchmark="layer scan: compile time and compiled memory of a training step per depth, scan vs unrolled",
        model={k: getattr(TINY, k) for k in ("embed_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")},
        vocab_size=TINY.vocab_size,
        batch=args.batch,
        seq_len=args.seq_len,
        rounds=args.rounds,
        compiles=args.compiles,
        measure="trace_s: jit(...).lower; compile_s: .compile() (each the fastest of `compiles`); *_cpu_s: CPU seconds of this process; peak_bytes: memory_analysis() arguments + outputs + "
        "temporaries - aliased; temp_bytes: temporaries; step_s: median of the compiled step, layouts alternating",
        device=str(getattr(device, "device_kind", device.platform)),
        platform=device.platform,
        jax_version=jax.__version__,
        python=platform.python_version(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
        results=results,
        decode_measure="one cached decode step (B rows x 1 token over --cache-len slots), no gradient: trace_s, "
        "compile_s, peak_bytes, temp_bytes as above; dloss: max |logits difference| between the layouts",
        decode=decode,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print("\ntraining step (value_and_grad):")
    print_table(results)
    print("\ncached decode step:")
    print_table(decode)
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
