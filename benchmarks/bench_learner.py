"""Learner benchmark: optimizer-step tokens/s and model-FLOPs utilization, packed + sharded vs a naive step.

Every variant runs the same ``Learner.step`` (GSPO micro-steps, summed gradients, one AdamW update) on
the same synthetic step of agent-like trajectories (long-tailed lengths, prompt / completion / tool
segments), from the same initial weights; only the layout and the mesh differ:

- ``naive``: unpacked (one trajectory per row, every row padded to the step's longest, the layout of
  ``trajectory.batch.make_micro_batches``), unsharded (one device). The baseline.
- ``packed/1dev``: trajectories packed first-fit-decreasing into fixed rows (segment ids, per-sequence
  positions), one device.
- ``packed/2dev``, ``packed/8dev``: the same micro-batches, params / optimizer state / batch sharded
  over a data=2 mesh, and over the default training mesh (data=4, fsdp=2); virtual devices on CPU.
- ``packed/core+satellite``: the streamed step on two 4-device cells, the core and one satellite
  claiming micro-steps from the shared queue (gradients summed on the core).

Two baselines are measured in the same run: the naive step (speed-up = naive step time / variant step
time) and the peak rate of a jitted fp32 square matmul on one device (MFU = model FLOP/s / peak). Step
time is the median of the timed steps, which run round-robin over the variants (after one compile step
each), so load from other processes on a shared machine falls on all variants alike.
Model FLOPs count only real tokens with their real causal context (3 x forward; forward = 2 x matmul
params incl. the LM head + 2 x 2 x H x D per attended key per layer), so padding is waste, not work.
The run also checks that every variant computes the same loss and gradient norm as the naive step, and
reports the FLOPs each layout actually executes (padding, and attention over every query-key pair of a
row, which the [B, T, T] mask hides but does not skip) next to the model FLOPs.

    python benchmarks/bench_learner.py                # the cpu suite (about 2-4 minutes on 2 cores)
    python benchmarks/bench_learner.py --suite smoke  # seconds; the same code path, for tests

Prints a table and writes JSON (``--out``, default ``benchmarks/results/learner_<suite>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gyre_jax.config import load_config  # noqa: E402
from gyre_jax.model.config import ModelConfig  # noqa: E402
from gyre_jax.model.sharding import init_params, make_mesh  # noqa: E402
from gyre_jax.rl.learner import Learner, OptimizerConfig  # noqa: E402
from gyre_jax.runtime.cells import make_cells  # noqa: E402
from gyre_jax.trajectory.batch import MicroBatch, make_micro_batches  # noqa: E402
from gyre_jax.trajectory.branches import Branch  # noqa: E402

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
SMALL = ModelConfig(
    vocab_size=272,
    num_layers=4,
    embed_dim=256,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    mlp_dim=768,
    rope_theta=10_000.0,
)


@dataclass(frozen=True)
class Suite:
    model: str
    sequences: int  # trajectories in the step
    median_len: int  # lognormal lengths (tokens), clipped to [min_len, max_len]
    sigma: float
    min_len: int
    max_len: int
    row_length: int  # packed rows
    packed_rows: int  # rows per packed micro-batch
    naive_rows: int  # rows per naive micro-batch (rl.micro_batch_size)
    steps: int  # timed steps per variant (after one compile step)
    peak_sizes: tuple[int, ...]


SUITES = {
    "smoke": Suite(
        "tiny",
        sequences=12,
        median_len=24,
        sigma=0.6,
        min_len=8,
        max_len=60,
        row_length=64,
        packed_rows=8,
        naive_rows=8,
        steps=1,
        peak_sizes=(256,),
    ),
    "cpu": Suite(
        "tiny",
        sequences=96,
        median_len=160,
        sigma=0.8,
        min_len=24,
        max_len=1000,
        row_length=1024,
        packed_rows=8,
        naive_rows=8,
        steps=3,
        peak_sizes=(1024, 2048),
    ),
    "cpu-small": Suite(
        "small",
        sequences=48,
        median_len=160,
        sigma=0.8,
        min_len=24,
        max_len=1000,
        row_length=1024,
        packed_rows=8,
        naive_rows=8,
        steps=2,
        peak_sizes=(1024, 2048),
    ),
}
MODELS = {"tiny": TINY, "small": SMALL}


# -- workload ----------------------------------------------------------------------------------------
def synthetic_branches(suite: Suite, vocab: int, seed: int = 0) -> list[Branch]:
    """Agent-like trajectories: a prompt, then turns of completion (trainable) and tool output (not)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(
        rng.lognormal(np.log(suite.median_len), suite.sigma, suite.sequences), suite.min_len, suite.max_len
    ).astype(int)
    out = []
    for i, n in enumerate(lengths):
        b = Branch(execution_id=f"e{i:03d}", thread_id="main", label="main")
        prompt = max(2, n // 5)
        b._append(rng.integers(0, 256, prompt).tolist(), trainable=False)
        trainable = True
        while len(b.tokens) < n:
            k = int(min(n - len(b.tokens), rng.integers(4, 40)))
            lp = (-np.log(vocab) + rng.normal(0, 0.05, k)).tolist() if trainable else None
            b._append(
                rng.integers(0, 256, k).tolist(),
                trainable=trainable,
                logprobs=lp,
                temperature=1.0,
                versions=[0] * k if trainable else None,
            )
            trainable = not trainable
        out.append(b)
    return out


def step_weights(branches: list[Branch], seed: int = 1) -> tuple[list[float], list[float]]:
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, len(branches)).tolist(), [1.0 / len(branches)] * len(branches)


def pack_first_fit(branches: list[Branch], advantages, seq_weights, row_length: int, rows: int) -> list[MicroBatch]:
    """First-fit-decreasing sequence packing: each trajectory is a segment of a row (positions restart at
    0, causal within the segment); rows are grouped ``rows`` at a time; every micro-batch has the same
    [rows, row_length] tokens and [S] sequence slots (S = the most any micro-batch needs)."""
    order = sorted(range(len(branches)), key=lambda i: -len(branches[i].tokens))
    row_fill: list[int] = []
    row_items: list[list[int]] = []
    for i in order:
        n = len(branches[i].tokens) - 1
        if n > row_length:
            raise ValueError(f"a trajectory of {n} tokens does not fit rows of {row_length}")
        for r, fill in enumerate(row_fill):
            if fill + n <= row_length:
                row_fill[r] += n
                row_items[r].append(i)
                break
        else:
            row_fill.append(n)
            row_items.append([i])
    groups = [row_items[k : k + rows] for k in range(0, len(row_items), rows)]
    num_seqs = max(sum(len(r) for r in g) for g in groups)
    out = []
    for g in groups:
        shape = (rows, row_length)
        mb = MicroBatch(
            tokens=np.zeros(shape, np.int32),
            positions=np.zeros(shape, np.int32),
            segment_ids=np.zeros(shape, np.int32),
            subtree_end=np.zeros(shape, np.int32),
            targets=np.zeros(shape, np.int32),
            loss_mask=np.zeros(shape, np.float32),
            old_logprobs=np.zeros(shape, np.float32),
            temperature=np.ones(shape, np.float32),
            seq_index=np.zeros(shape, np.int32),
            advantages=np.zeros(num_seqs, np.float32),
            seq_weights=np.zeros(num_seqs, np.float32),
        )
        s = 0
        for row, items in enumerate(g):
            lo = 0
            for seg, i in enumerate(items, start=1):
                br = branches[i]
                n = len(br.tokens) - 1
                hi = lo + n
                mb.tokens[row, lo:hi] = br.tokens[:-1]
                mb.targets[row, lo:hi] = br.tokens[1:]
                mb.positions[row, lo:hi] = np.arange(n)
                mb.segment_ids[row, lo:hi] = seg
                mb.subtree_end[row, lo:hi] = hi
                mb.loss_mask[row, lo:hi] = np.asarray(br.trainable[1:], np.float32)
                mb.old_logprobs[row, lo:hi] = br.logprobs[1:]
                mb.temperature[row, lo:hi] = br.temperature[1:]
                mb.seq_index[row, lo:hi] = s
                mb.advantages[s], mb.seq_weights[s] = advantages[i], seq_weights[i]
                s += 1
                lo = hi
        out.append(mb)
    return out


def model_train_flops(cfg: ModelConfig, lengths) -> float:
    """Forward + backward model FLOPs of causal sequences of ``lengths`` tokens (dense model)."""
    if getattr(cfg, "num_experts", 0):
        raise ValueError("not supported yet: MoE FLOPs in this benchmark (count active experts)")
    e, h, k, d, m, v, layers = (
        cfg.embed_dim,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.mlp_dim,
        cfg.vocab_size,
        cfg.num_layers,
    )
    matmul_params = layers * (e * h * d + 2 * e * k * d + h * d * e + 3 * e * m) + e * v  # q, k, v, o, MLP, LM head
    total = 0.0
    for n in lengths:
        attended = n * (n + 1) / 2  # token t attends to t + 1 keys
        total += 2.0 * matmul_params * n + layers * 2 * 2 * h * d * attended
    return 3.0 * total


def executed_train_flops(cfg: ModelConfig, micro_batches) -> float:
    """The FLOPs the step actually runs: every row position (padding too) through the matmuls, and every
    query-key pair of a row through attention (the [B, T, T] mask is applied, not skipped)."""
    e, h, k, d, m, v, layers = (
        cfg.embed_dim,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.mlp_dim,
        cfg.vocab_size,
        cfg.num_layers,
    )
    matmul_params = layers * (e * h * d + 2 * e * k * d + h * d * e + 3 * e * m) + e * v
    total = 0.0
    for mb in micro_batches:
        rows, t = mb.tokens.shape
        total += rows * (2.0 * matmul_params * t + layers * 2 * 2 * h * d * t * t)
    return 3.0 * total


def matmul_peak(sizes, repeats: int = 5) -> dict:
    """Best FLOP/s of a jitted fp32 square matmul on one device (the MFU denominator, measured in this run)."""
    best = {"flops_per_s": 0.0}
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
        f = jax.jit(jnp.dot)
        f(a, b).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(a, b).block_until_ready()
            times.append(time.perf_counter() - t0)
        rate = 2 * n**3 / min(times)
        if rate > best["flops_per_s"]:
            best = {"n": n, "flops_per_s": rate}
    return best


# -- variants ----------------------------------------------------------------------------------------
class Variant:
    """One learner (its own mesh, jits and state) stepping over one layout of the step's data."""

    def __init__(self, name: str, cfg: ModelConfig, mesh, micro_batches, satellite_mesh=None):
        rules = load_config([]).sharding_rules
        graphdef, params = init_params(cfg, mesh, rules, seed=0)
        self.name, self.mesh, self.micro_batches, self.satellite_mesh = name, mesh, micro_batches, satellite_mesh
        self.learner = Learner(cfg, graphdef, mesh, rules, OptimizerConfig(learning_rate=1e-4))
        self.satellites = (
            [self.learner.make_satellite(satellite_mesh, "satellite")] if satellite_mesh is not None else []
        )
        for sat in self.satellites:  # compile the satellite's micro-step too (whoever claims what in the steps)
            jax.block_until_ready(sat.micro_step(sat.snapshot(params), micro_batches[0]))
        self.state = self.learner.init_state(params)
        self.times: list[float] = []
        self.on_core: list[int] = []
        t0 = time.perf_counter()
        self.first = self._step()  # compiles; also the correctness reference (same initial weights everywhere)
        self.compile_s = time.perf_counter() - t0
        if self.first["skipped"]:
            raise FloatingPointError(f"{name}: the first step was skipped (non-finite loss or gradients)")

    def _step(self) -> dict:
        self.state, m = self.learner.step(self.state, self.micro_batches, satellites=self.satellites)
        jax.block_until_ready(self.state)
        return m

    def timed_step(self) -> None:
        t0 = time.perf_counter()
        m = self._step()
        self.times.append(time.perf_counter() - t0)
        self.on_core.append(m["micro_steps_core"])

    def summary(self) -> dict:
        mbs = self.micro_batches
        return dict(
            name=self.name,
            devices=int(self.mesh.devices.size) + (int(self.satellite_mesh.devices.size) if self.satellite_mesh else 0),
            micro_batches=len(mbs),
            micro_batch_shape=list(mbs[0].tokens.shape),
            computed_tokens=int(sum(mb.tokens.size for mb in mbs)),
            compile_s=self.compile_s,
            step_s=statistics.median(self.times),
            step_s_min=min(self.times),
            step_s_all=self.times,
            micro_steps_on_core=self.on_core,
            first_step_loss=self.first["loss"],
            first_step_grad_norm=self.first["grad_norm"],
        )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (after one compile step)")
    parser.add_argument("--only", default=None, help="run the naive baseline and the variants whose name contains this")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/learner_<suite>.json)")
    args = parser.parse_args(argv)
    suite = SUITES[args.suite]
    steps = args.steps or suite.steps
    cfg = MODELS[suite.model]
    devices = jax.devices()
    if len(devices) < 8:
        raise SystemExit(
            f"this benchmark needs 8 devices (virtual CPU devices are made when run as a script); JAX sees {len(devices)}"
        )

    branches = synthetic_branches(suite, cfg.vocab_size)
    adv, weights = step_weights(branches)
    lengths = [len(b.tokens) - 1 for b in branches]
    real_tokens = sum(lengths)
    flops = model_train_flops(cfg, lengths)
    naive_mbs = make_micro_batches(branches, adv, weights, suite.naive_rows)
    packed_mbs = pack_first_fit(branches, adv, weights, suite.row_length, suite.packed_rows)
    load_before = os.getloadavg()
    peak = matmul_peak(suite.peak_sizes)

    one = make_mesh(devices[:1], {})
    two = make_mesh(devices[:2], dict(data=2))
    full = make_mesh(devices[:8], dict(data=4, fsdp=2))
    cell0, cell1 = make_cells(devices[:8], 2, dict(data=4))
    variants = [
        ("naive", one, naive_mbs, None),
        ("packed/1dev", one, packed_mbs, None),
        ("packed/2dev", two, packed_mbs, None),
        ("packed/8dev", full, packed_mbs, None),
        ("packed/core+satellite", cell0.mesh, packed_mbs, cell1.mesh),
    ]
    built = [
        Variant(name, cfg, mesh, mbs, sat)
        for name, mesh, mbs, sat in variants
        if not args.only or name == "naive" or args.only in name
    ]
    # Timed steps round-robin over the variants: load from other processes on a shared machine hits all alike.
    for _ in range(steps):
        for v in built:
            v.timed_step()
    results = []
    for v in built:
        row = v.summary()
        row["tokens_per_s"] = real_tokens / row["step_s"]
        row["model_flops_per_s"] = flops / row["step_s"]
        row["mfu"] = row["model_flops_per_s"] / peak["flops_per_s"]
        row["padding_fraction"] = 1.0 - real_tokens / row["computed_tokens"]
        row["executed_flops_per_step"] = executed_train_flops(cfg, v.micro_batches)
        row["executed_flops_per_s"] = row["executed_flops_per_step"] / row["step_s"]
        row["executed_utilization"] = row["executed_flops_per_s"] / peak["flops_per_s"]
        results.append(row)
    base = results[0]
    for row in results:
        row["speedup_vs_naive"] = base["step_s"] / row["step_s"]
        row["loss_rel_diff_vs_naive"] = abs(row["first_step_loss"] - base["first_step_loss"]) / max(
            abs(base["first_step_loss"]), 1e-12
        )
        row["grad_norm_rel_diff_vs_naive"] = (
            abs(row["first_step_grad_norm"] - base["first_step_grad_norm"]) / base["first_step_grad_norm"]
        )
    same = all(r["loss_rel_diff_vs_naive"] < 1e-4 and r["grad_norm_rel_diff_vs_naive"] < 1e-3 for r in results)
    report = dict(
        suite=args.suite,
        suite_config=asdict(suite),
        model=asdict(cfg),
        params=cfg.num_params,
        baseline="naive: unpacked rows padded to the step's longest trajectory, one device (speedup = naive step s / step s); "
        "mfu = model FLOP/s / fp32 matmul peak on one device, both measured in this run",
        platform=devices[0].platform,
        device=str(getattr(devices[0], "device_kind", devices[0].platform)),
        cpu_count=os.cpu_count(),
        jax_version=jax.__version__,
        python=platform.python_version(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
        peak=peak,
        sequences=len(lengths),
        real_tokens=real_tokens,
        length_stats=dict(min=min(lengths), median=float(np.median(lengths)), max=max(lengths)),
        model_flops_per_step=flops,
        same_loss_and_grad_norm_as_naive=same,
        steps=steps,
        results=results,
        load_average_before=load_before,
        load_average_after=os.getloadavg(),
    )
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"learner_{args.suite}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))

    print(
        f"{report['device']} ({report['platform']}, {os.cpu_count()} cores), jax {jax.__version__}; fp32 matmul peak "
        f"{peak['flops_per_s'] / 1e9:,.1f} GFLOP/s (n={peak.get('n')}); 1-min load average {load_before[0]:.1f} "
        f"before, {report['load_average_after'][0]:.1f} after (other processes share the machine)"
    )
    print(
        f"step: {len(lengths)} trajectories, {real_tokens:,} tokens (length min/median/max {min(lengths)}/"
        f"{int(np.median(lengths))}/{max(lengths)}), model {cfg.num_params / 1e6:.2f}M params, "
        f"{flops / 1e9:,.1f} model GFLOP per optimizer step"
    )
    header = (
        f"{'variant':24s} {'dev':>3s} {'micro-batches':>15s} {'padding':>8s} {'run/model':>9s} {'step s':>8s} "
        f"{'tokens/s':>10s} {'GFLOP/s':>8s} {'MFU':>6s} {'vs naive':>9s}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        shape = "x".join(str(x) for x in r["micro_batch_shape"])
        print(
            f"{r['name']:24s} {r['devices']:>3d} {r['micro_batches']:>4d} x {shape:>8s} {r['padding_fraction']:8.1%} "
            f"{r['executed_flops_per_step'] / flops:8.2f}x {r['step_s']:8.3f} {r['tokens_per_s']:10,.0f} {r['model_flops_per_s'] / 1e9:8.2f} {r['mfu']:6.1%} "
            f"{r['speedup_vs_naive']:8.2f}x"
        )
    print("run/model: FLOPs the step executes (padding, and every query-key pair of a row) / model FLOPs")
    print(f"same loss and grad norm as naive in every variant: {same}")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
