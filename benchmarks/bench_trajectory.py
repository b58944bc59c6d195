"""Trajectory benchmark: forward-backward work and step time of capped / tree-packed training, and pipeline throughput.

Workload: synthetic executions shaped like long-horizon agent runs (``gyre_jax.trajectory.synthetic``):
a long main thread with a large shared system prompt, context compactions that restart from a summary,
sub-agents with their own system prompts, and retries. The shape is configurable (``--shape k=v``).

Part 1, training cost. The same executions go through the real pipeline (records on disk -> trees ->
selection -> packing) under each variant, and one optimizer step (``Learner.step``: GSPO micro-steps,
summed gradients, AdamW) is timed on the resulting micro-batches. All variants use the same micro-batch
shape, so they share one compile and differ only in how many micro-batches they need:

- ``uncapped``: every branch, plain sequence packing. The baseline (ratios are variant / uncapped).
- ``J=5``, ``J=3``, ``J=1``: at most J branches per execution by priority (plain packing).
- ``J=5 tree``: the J=5 selection tree-packed (shared prefixes computed once).
- ``uncapped tree``: every branch, tree-packed.

Reported per variant: forward-backward tokens (non-padding tokens computed), rows, micro-batches,
trained targets, median step time, and the first step's loss and gradient norm (a tree and a plain
layout of the same selection must agree). Published reference: J_max=5 takes 74.8% and J_max=1 41.4% of
the uncapped forward-backward time.

Part 2, pipeline throughput: executions/s through the whole Grain pipeline (no model) for growing
numbers of executions, against a named baseline measured in the same run (parsing the same record
files with ``RecordStore.read``), and the peak Python heap (``tracemalloc``) while streaming: it must
stay flat as the number of executions grows.

    python benchmarks/bench_trajectory.py                 # the cpu suite (10-30 minutes on 2 shared cores)
    python benchmarks/bench_trajectory.py --suite smoke   # seconds; the same code path, for tests
    python benchmarks/bench_trajectory.py --shape context_limit=3000 --shape num_calls=96 --row-length 4096

Prints tables and writes JSON (``--out``, default ``benchmarks/results/trajectory_<suite>.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path

import jax  # noqa: E402
import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gyre_jax.config import load_config  # noqa: E402
from gyre_jax.model.config import ModelConfig  # noqa: E402
from gyre_jax.model.sharding import init_params, make_mesh  # noqa: E402
from gyre_jax.proxy.records import RecordStore  # noqa: E402
from gyre_jax.rl.learner import Learner, OptimizerConfig  # noqa: E402
from gyre_jax.trajectory.pipeline import TrajectoryConfig, TrajectoryPipeline  # noqa: E402
from gyre_jax.trajectory.synthetic import MESSAGE_END, TraceShape, write_executions  # noqa: E402

TINY = ModelConfig(
    vocab_size=272,
    num_layers=2,
    embed_dim=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    mlp_dim=384,
    rope_theta=10_000.0,
)  # the default config's model

# A long-horizon run scaled to CPU rows: 48 calls, ~8K tokens of main-thread context compacted at 1.5K
# (about five summaries), a 300-token system prompt shared by the main agent's branches, a sub-agent
# every 12 calls, 5% retries. Every branch fits a row of 2048 tokens.
TRAIN_SHAPE = TraceShape(
    num_calls=48,
    system_len=300,
    task_len=60,
    completion_len=(15, 100),
    tool_output_len=(15, 200),
    context_limit=1500,
    summary_len=120,
    subagent_every=12,
    subagent_calls=6,
    subagent_system_len=200,
    retry_prob=0.05,
)
SMOKE_SHAPE = TraceShape(
    num_calls=8,
    system_len=20,
    task_len=8,
    completion_len=(3, 10),
    tool_output_len=(3, 12),
    context_limit=90,
    summary_len=8,
    subagent_every=4,
    subagent_calls=2,
    subagent_system_len=12,
    retry_prob=0.1,
)


@dataclass(frozen=True)
class Suite:
    executions: int  # executions in the timed optimizer step (part 1)
    shape: TraceShape  # part 1 workload
    row_length: int
    rows: int  # rows per micro-batch
    max_sequences: int
    steps: int  # timed steps per variant (after one warm-up step)
    pipeline_sizes: tuple[int, ...]  # part 2: numbers of executions streamed
    pipeline_shape: TraceShape
    pipeline_row_length: int
    group: int  # executions per optimizer step in part 2


SUITES = {
    "smoke": Suite(
        executions=3,
        shape=SMOKE_SHAPE,
        row_length=256,
        rows=2,
        max_sequences=16,
        steps=1,
        pipeline_sizes=(4, 8),
        pipeline_shape=SMOKE_SHAPE,
        pipeline_row_length=256,
        group=2,
    ),
    "cpu": Suite(
        executions=6,
        shape=TRAIN_SHAPE,
        row_length=2048,
        rows=2,
        max_sequences=32,
        steps=3,
        pipeline_sizes=(16, 32, 64),
        pipeline_shape=TraceShape(),
        pipeline_row_length=8192,
        group=8,
    ),
}
VARIANTS = (
    ("uncapped", None, "plain"),
    ("J=5", 5, "plain"),
    ("J=3", 3, "plain"),
    ("J=1", 1, "plain"),
    ("J=5 tree", 5, "tree"),
    ("uncapped tree", None, "tree"),
)
REFERENCE = {"J=5": 0.748, "J=1": 0.414}  # published: fraction of the uncapped forward-backward time


def _advantages(n: int) -> list[float]:
    return np.random.default_rng(1).normal(0.0, 1.0, n).round(4).tolist()


# -- part 1 ------------------------------------------------------------------------------------------------------------
def build_step(store: RecordStore, ids: list[str], work: Path, name: str, config: TrajectoryConfig):
    pipe = TrajectoryPipeline(store.root, work / name.replace(" ", "_").replace("=", ""), config)
    pipe.enqueue(0, list(zip(ids, _advantages(len(ids)))))
    t0 = time.perf_counter()
    step = pipe.next_step()
    return step, time.perf_counter() - t0


def time_steps(learner: Learner, params, variants: list[list], steps: int):
    """Times one optimizer step per variant, ``steps`` rounds, variants interleaved within each round.

    Two clocks: wall seconds, and CPU seconds of this process (all XLA threads). The machine is shared
    with other jobs, so wall time swings with their load; CPU time counts only this step's own work
    and is the one the ratios use. Returns ([wall per round], [cpu per round]) per variant and the
    warm-up step's metrics.
    """
    firsts = []
    for micro_batches in variants:  # warm-up (compiles once: every variant has the same micro-batch shape)
        state = learner.init_state(jax.tree.map(lambda x: x.copy(), params))
        state, first = learner.step(state, micro_batches)
        jax.block_until_ready(state)
        firsts.append(first)
    wall: list[list[float]] = [[] for _ in variants]
    cpu: list[list[float]] = [[] for _ in variants]
    for _ in range(steps):
        for i, micro_batches in enumerate(variants):
            state = learner.init_state(jax.tree.map(lambda x: x.copy(), params))
            jax.block_until_ready(state)
            w0, c0 = time.perf_counter(), time.process_time()
            state, _ = learner.step(state, micro_batches)
            jax.block_until_ready(state)
            wall[i].append(time.perf_counter() - w0)
            cpu[i].append(time.process_time() - c0)
    return wall, cpu, firsts


def run_training(suite: Suite, shape: TraceShape, row_length: int, work: Path) -> dict:
    store = RecordStore(work / "records")
    ids = [f"exec{i:03d}" for i in range(suite.executions)]
    write_executions(store, ids, shape, seed=0)
    devices = jax.devices()
    mesh = make_mesh(devices[:1], {})
    rules = load_config([]).sharding_rules
    graphdef, params = init_params(TINY, mesh, rules, seed=0)
    learner = Learner(TINY, graphdef, mesh, rules, OptimizerConfig(learning_rate=1e-4))
    steps = []
    for name, cap, packing in VARIANTS:
        config = TrajectoryConfig(
            max_branches=cap,
            packing=packing,
            row_length=row_length,
            rows=suite.rows,
            max_sequences=suite.max_sequences,
            seed=0,
            message_end_id=MESSAGE_END,
            vocab_size=TINY.vocab_size,
        )
        step, pipeline_s = build_step(store, ids, work, name, config)
        if step.excluded:
            raise SystemExit(
                f"{name}: executions excluded ({step.excluded[:2]}...): the comparison needs every execution; "
                f"raise --row-length"
            )
        steps.append((step, pipeline_s))
    wall, cpu, firsts = time_steps(learner, params, [s.micro_batches for s, _ in steps], suite.steps)
    rows = []
    for (name, cap, packing), (step, pipeline_s), all_s, all_cpu, first in zip(VARIANTS, steps, wall, cpu, firsts):
        s = step.stats
        rows.append(
            dict(
                name=name,
                max_branches=cap,
                packing=packing,
                branches=s["branches"],
                selected=s["selected"],
                micro_batches=s["micro_batches"],
                rows=s["rows"],
                fb_tokens=s["tokens_computed"],
                padded_tokens=s["micro_batches"] * suite.rows * row_length,
                trained_targets=s["tokens_trained"],
                step_cpu_s=statistics.median(all_cpu),
                step_cpu_s_all=all_cpu,
                step_s=statistics.median(all_s),
                step_s_all=all_s,
                pipeline_s=pipeline_s,
                loss=first["loss"],
                grad_norm=first["grad_norm"],
            )
        )
    base = rows[0]
    for r in rows:
        r["fb_tokens_vs_uncapped"] = r["fb_tokens"] / base["fb_tokens"]
        r["step_time_vs_uncapped"] = r["step_cpu_s"] / base["step_cpu_s"]  # CPU seconds: robust to other jobs
        r["step_wall_vs_uncapped"] = r["step_s"] / base["step_s"]
        r["reference_vs_uncapped"] = REFERENCE.get(r["name"])
    by = {r["name"]: r for r in rows}
    checks = {
        "tree_and_plain_J5_train_the_same_targets": by["J=5 tree"]["trained_targets"] == by["J=5"]["trained_targets"],
        "tree_and_plain_J5_same_loss": abs(by["J=5 tree"]["loss"] - by["J=5"]["loss"])
        <= 1e-4 * max(abs(by["J=5"]["loss"]), 1e-6),
        "tree_and_plain_J5_same_grad_norm": abs(by["J=5 tree"]["grad_norm"] - by["J=5"]["grad_norm"])
        <= 1e-3 * by["J=5"]["grad_norm"],
        "uncapped_tree_and_plain_same_loss": abs(by["uncapped tree"]["loss"] - base["loss"])
        <= 1e-4 * max(abs(base["loss"]), 1e-6),
    }
    return dict(
        executions=suite.executions,
        shape=asdict(shape),
        row_length=row_length,
        rows_per_micro_batch=suite.rows,
        model=asdict(TINY),
        params=TINY.num_params,
        timed_rounds=suite.steps,
        variants=rows,
        checks=checks,
    )


# -- part 2 ------------------------------------------------------------------------------------------------------------
def drain(store: RecordStore, ids: list[str], work: Path, config: TrajectoryConfig, group: int, trace_memory: bool):
    qdir = work / f"queue-{len(ids)}-{int(trace_memory)}"
    pipe = TrajectoryPipeline(store.root, qdir, config)
    adv = _advantages(len(ids))
    for k in range(0, len(ids), group):
        pipe.enqueue(k // group, list(zip(ids[k : k + group], adv[k : k + group])))
    gc.collect()
    if trace_memory:
        tracemalloc.start()
    t0 = time.perf_counter()
    trained = tokens = 0
    for _ in range(0, len(ids), group):
        step = pipe.next_step()  # the step's micro-batches are dropped after this: a trainer would consume them
        trained += len(step.executions)
        tokens += step.stats["tokens_computed"]
    elapsed = time.perf_counter() - t0
    peak = None
    if trace_memory:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    shutil.rmtree(qdir)
    return elapsed, peak, trained, tokens


def run_pipeline(suite: Suite, work: Path) -> dict:
    store = RecordStore(work / "pipeline-records")
    biggest = max(suite.pipeline_sizes)
    all_ids = [f"p{i:04d}" for i in range(biggest)]
    write_executions(store, all_ids, suite.pipeline_shape, seed=1)
    config = TrajectoryConfig(
        max_branches=5,
        packing="tree",
        row_length=suite.pipeline_row_length,
        rows=4,
        max_sequences=64,
        message_end_id=MESSAGE_END,
        vocab_size=suite.pipeline_shape.vocab_size,
    )
    record_bytes = sum(store.path(e).stat().st_size for e in all_ids) / biggest
    out = []
    for n in suite.pipeline_sizes:
        ids = all_ids[:n]
        t0 = time.perf_counter()
        for e in ids:
            store.read(e)  # the baseline: only parse the same record files
        parse_s = time.perf_counter() - t0
        elapsed, _, trained, tokens = drain(store, ids, work, config, suite.group, trace_memory=False)
        _, peak, _, _ = drain(store, ids, work, config, suite.group, trace_memory=True)
        out.append(
            dict(
                executions=n,
                trained=trained,
                seconds=elapsed,
                executions_per_s=n / elapsed,
                parse_only_s=parse_s,
                vs_parse_only=elapsed / parse_s,
                tokens_out=tokens,
                peak_heap_mb=peak / 2**20,
            )
        )
    first = out[0]["peak_heap_mb"]
    for r in out:
        r["peak_heap_vs_smallest"] = r["peak_heap_mb"] / first
    return dict(
        shape=asdict(suite.pipeline_shape),
        row_length=suite.pipeline_row_length,
        group=suite.group,
        record_mb_per_execution=record_bytes / 2**20,
        runs=out,
        memory_flat=max(r["peak_heap_vs_smallest"] for r in out) < 1.5,
    )


# -- main --------------------------------------------------------------------------------------------------------------
def parse_shape(base: TraceShape, items: list[str]) -> TraceShape:
    fields = {f.name: f for f in dataclasses.fields(TraceShape)}
    changes = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--shape {item!r}: unknown field {key!r}; fields: {', '.join(fields)}")
        current = getattr(base, key)
        try:
            if isinstance(current, tuple):
                changes[key] = tuple(int(v) for v in value.split(","))
            elif isinstance(current, bool):
                changes[key] = value.lower() in ("1", "true", "yes")
            else:
                changes[key] = type(current)(value)
        except ValueError:
            raise SystemExit(f"--shape {item!r}: {value!r} is not a valid {type(current).__name__}") from None
    return dataclasses.replace(base, **changes)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a TraceShape field of the training workload (ranges: low,high)",
    )
    parser.add_argument("--executions", type=int, default=None, help="executions in the timed step")
    parser.add_argument("--row-length", type=int, default=None, help="tokens per packed row (training part)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    parser.add_argument("--skip-pipeline", action="store_true", help="only the training part")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/trajectory_<suite>.json)")
    args = parser.parse_args(argv)
    suite = SUITES[args.suite]
    suite = dataclasses.replace(suite, executions=args.executions or suite.executions, steps=args.steps or suite.steps)
    shape = parse_shape(suite.shape, args.shape)
    row_length = args.row_length or suite.row_length

    work = Path(tempfile.mkdtemp(prefix="bench_trajectory-"))
    try:
        training = run_training(suite, shape, row_length, work)
        pipeline = None if args.skip_pipeline else run_pipeline(suite, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    devices = jax.devices()
    report = dict(
        suite=args.suite,
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
        platform=devices[0].platform,
        device=str(getattr(devices[0], "device_kind", devices[0].platform)),
        cpu_count=os.cpu_count(),
        jax_version=jax.__version__,
        python=platform.python_version(),
        baseline="training: 'uncapped' (every branch, plain packing) in the same run; ratios = variant / uncapped "
        "(step time: median CPU seconds of the step over interleaved rounds; wall seconds also recorded). "
        "pipeline: parsing the same record files with RecordStore.read; memory: the smallest run's peak heap",
        reference=REFERENCE,
        training=training,
        pipeline=pipeline,
    )
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"trajectory_{args.suite}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))

    t = training
    print(
        f"{report['device']} ({report['platform']}, {os.cpu_count()} cores), jax {jax.__version__}; model "
        f"{TINY.num_params / 1e6:.2f}M params; {t['executions']} executions, micro-batches of {suite.rows} x {row_length}"
    )
    print(
        f"{'variant':<14} {'branches':>8} {'FB tokens':>10} {'vs uncapped':>11} {'rows':>5} {'micro-b.':>8} {'targets':>8} "
        f"{'step cpu s':>10} {'vs uncapped':>11} {'published':>9} {'wall s':>7} {'loss':>10} {'grad norm':>9}"
    )
    for r in t["variants"]:
        ref = f"{r['reference_vs_uncapped']:.1%}" if r["reference_vs_uncapped"] else ""
        print(
            f"{r['name']:<14} {r['selected']:>4}/{r['branches']:<3} {r['fb_tokens']:>10,} {r['fb_tokens_vs_uncapped']:>11.1%} "
            f"{r['rows']:>5} {r['micro_batches']:>8} {r['trained_targets']:>8,} {r['step_cpu_s']:>10.2f} "
            f"{r['step_time_vs_uncapped']:>11.1%} {ref:>9} {r['step_s']:>7.1f} {r['loss']:>10.4g} {r['grad_norm']:>9.4g}"
        )
    print("checks: " + ", ".join(f"{k}={v}" for k, v in t["checks"].items()))
    if pipeline:
        p = pipeline
        print(
            f"\npipeline (J=5, tree packing, rows of {p['row_length']}; {p['record_mb_per_execution']:.2f} MB of records "
            f"per execution, {p['group']} executions per step)"
        )
        print(
            f"{'executions':>10} {'exec/s':>8} {'s':>7} {'vs parse-only':>13} {'peak heap MB':>12} {'vs smallest':>11}"
        )
        for r in p["runs"]:
            print(
                f"{r['executions']:>10} {r['executions_per_s']:>8.2f} {r['seconds']:>7.2f} {r['vs_parse_only']:>13.2f}x "
                f"{r['peak_heap_mb']:>12.1f} {r['peak_heap_vs_smallest']:>11.2f}"
            )
        print(f"memory flat: {p['memory_flat']}")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
