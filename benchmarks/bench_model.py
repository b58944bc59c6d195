"""Model training-speed benchmark: forward+backward tokens/s and model-FLOPs utilization (MFU).

The baseline is measured in the same run: the peak matmul rate of this device in the benchmark's
compute dtype (a square ``jnp.dot``, best of several sizes). MFU = model FLOP/s / that peak, where model
FLOPs per token are ``ModelConfig.train_flops_per_token`` (6 x active matmul params + causal
attention, MaxText-style). The step is ``jax.value_and_grad`` of next-token cross-entropy over a
packed causal batch (plus the router load-balancing loss for MoE), jitted once, run on one device.

    python benchmarks/bench_model.py --suite cpu      # tiny + ~100M configs (fp32), this machine's CPU
    python benchmarks/bench_model.py --suite gpu      # ~0.6B / ~1.1B, bf16 compute on fp32 master weights
    python benchmarks/bench_model.py --suite smoke    # seconds: the same code path, for tests

Prints a table and writes JSON (``--out``, default ``benchmarks/results/model_<suite>.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .` (e.g. on a lent GPU machine)
    sys.path.insert(0, str(REPO))

from gyre_jax.model.attention import segment_mask  # noqa: E402
from gyre_jax.model.config import PRESETS, ModelConfig  # noqa: E402
from gyre_jax.model.sharding import RULES_DATA, init_params, make_mesh  # noqa: E402
from gyre_jax.progress import Progress  # noqa: E402

H200_BF16_REFERENCE = 790e12  # FLOP/s, an 8192^3 bf16 matmul measured on this project's lent H200


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    batch: int
    seq_len: int
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    moe_impl: str = "ragged"
    attention: str = "xla"

    def model_config(self) -> ModelConfig:
        return dataclasses.replace(
            PRESETS[self.preset],
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            remat_policy=self.remat,
            moe_impl=self.moe_impl,
            attention_impl=self.attention,
        )


SUITES: dict[str, dict] = {
    "smoke": dict(
        peak_sizes=(256,),
        peak_dtype="float32",
        steps=2,
        cases=[
            Case("tiny", "tiny", batch=2, seq_len=32),
            Case("tiny_moe", "tiny_moe", batch=2, seq_len=32),
            Case("tiny/remat", "tiny", batch=2, seq_len=32, remat="full"),
        ],
    ),
    "cpu": dict(
        peak_sizes=(1024, 2048),
        peak_dtype="float32",
        steps=5,
        cases=[
            Case("tiny", "tiny", batch=8, seq_len=256),
            Case("tiny_moe", "tiny_moe", batch=8, seq_len=256),
            Case("tiny_moe/dense_impl", "tiny_moe", batch=8, seq_len=256, moe_impl="dense"),
            Case("qwen3_100m", "qwen3_100m", batch=2, seq_len=256),
            Case("qwen3_100m/remat_full", "qwen3_100m", batch=2, seq_len=256, remat="full"),
        ],
    ),
    "gpu": dict(
        peak_sizes=(4096, 8192),
        peak_dtype="bfloat16",
        steps=10,
        cases=[
            Case("qwen3_1b/bf16", "qwen3_1b", batch=8, seq_len=2048, dtype="bfloat16"),
            Case(
                "qwen3_1b/bf16/remat_dots", "qwen3_1b", batch=16, seq_len=2048, dtype="bfloat16", remat="dots_no_batch"
            ),
            Case("qwen3_1b/bf16/cudnn", "qwen3_1b", batch=8, seq_len=2048, dtype="bfloat16", attention="cudnn"),
            Case("qwen3_0p6b/bf16", "qwen3_0p6b", batch=16, seq_len=2048, dtype="bfloat16"),
        ],
    ),
}


def matmul_peak(sizes, dtype: str, repeats: int = 5) -> dict:
    """Best FLOP/s of a jitted square matmul over ``sizes`` (the same-run baseline)."""
    best = {"flops_per_s": 0.0}
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
        f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
        f(a, b).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(a, b).block_until_ready()
            times.append(time.perf_counter() - t0)
        rate = 2 * n**3 / min(times)
        if rate > best["flops_per_s"]:
            best = {"n": n, "dtype": dtype, "flops_per_s": rate}
    return best


def _loss(graphdef, params, tokens, segment_ids, aux_coef):
    """Next-token cross-entropy over a packed causal batch (+ MoE load balancing). tokens, segment_ids: [B, T]."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    model = nnx.merge(graphdef, params)
    logits, _, aux = model(tokens, positions, segment_mask(model.cfg, segment_ids), return_aux=True)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)  # [B, T-1, V] float32
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(nll) + aux_coef * aux.load_balancing_loss


def run_case(case: Case, steps: int, device) -> dict:
    cfg = case.model_config()
    mesh = make_mesh([device], {})
    graphdef, params = init_params(cfg, mesh, RULES_DATA, seed=0)
    rng = np.random.default_rng(0)
    tokens = jax.device_put(
        jnp.asarray(rng.integers(0, cfg.vocab_size, size=(case.batch, case.seq_len)), jnp.int32), device
    )
    segments = jax.device_put(jnp.ones((case.batch, case.seq_len), jnp.int32), device)
    step = jax.jit(jax.value_and_grad(_loss, argnums=1), static_argnums=(0,))
    coef = jnp.float32(cfg.router_aux_loss_coef if cfg.is_moe else 0.0)
    t0 = time.perf_counter()
    loss, grads = step(graphdef, params, tokens, segments, coef)
    jax.block_until_ready(grads)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss, grads = step(graphdef, params, tokens, segments, coef)
        jax.block_until_ready(grads)
        times.append(time.perf_counter() - t0)
    if not np.isfinite(float(loss)):
        raise FloatingPointError(f"non-finite loss {float(loss)}")
    step_s = statistics.median(times)
    tokens_per_step = case.batch * case.seq_len
    flops_per_token = cfg.train_flops_per_token(case.seq_len)
    return dict(
        params=cfg.num_params,
        active_params=cfg.num_active_params,
        compile_s=compile_s,
        step_s=step_s,
        step_s_all=times,
        tokens_per_s=tokens_per_step / step_s,
        model_flops_per_token=flops_per_token,
        model_flops_per_s=flops_per_token * tokens_per_step / step_s,
        loss=float(loss),
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per case (after one compile step)")
    parser.add_argument("--only", default=None, help="run only cases whose name contains this text")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/model_<suite>.json)")
    args = parser.parse_args(argv)
    suite = SUITES[args.suite]
    device = jax.devices()[0]
    steps = args.steps or suite["steps"]
    peak = matmul_peak(suite["peak_sizes"], suite["peak_dtype"])
    results = []
    cases = [case for case in suite["cases"] if not args.only or args.only in case.name]
    progress = Progress(f"bench_model {args.suite}", total=len(cases), unit="cases")  # counts, rate, time left
    for case in cases:
        progress.note(case.name)
        row = dict(dataclasses.asdict(case))
        try:
            row.update(run_case(case, steps, device))
            row["mfu"] = row["model_flops_per_s"] / peak["flops_per_s"]
            if device.platform == "gpu":
                row["mfu_vs_h200_reference"] = row["model_flops_per_s"] / H200_BF16_REFERENCE
        except Exception as exc:  # one failing variant (e.g. cudnn attention unavailable) must not lose the others
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        results.append(row)
        jax.clear_caches()
        progress.update(1)
    progress.close()
    report = dict(
        suite=args.suite,
        baseline="matmul peak measured in this run (mfu = model FLOP/s / peak)",
        device=str(getattr(device, "device_kind", device.platform)),
        platform=device.platform,
        jax_version=jax.__version__,
        python=platform.python_version(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
        peak=peak,
        steps=steps,
        results=results,
    )
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"model_{args.suite}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(
        f"device: {report['device']} ({device.platform}), jax {jax.__version__}; matmul peak "
        f"{peak['flops_per_s'] / 1e9:,.1f} GFLOP/s ({peak['dtype']}, n={peak.get('n')})"
    )
    header = f"{'case':28s} {'params':>9s} {'B x T':>10s} {'dtype':>9s} {'step s':>8s} {'tokens/s':>10s} {'GFLOP/s':>10s} {'MFU':>6s}"
    print(header)
    print("-" * len(header))
    for r in results:
        if "error" in r:
            print(f"{r['name']:28s} error: {r['error'][:80]}")
            continue
        print(
            f"{r['name']:28s} {r['params'] / 1e6:8.1f}M {r['batch']:>4d} x {r['seq_len']:<4d} {r['dtype']:>9s} "
            f"{r['step_s']:8.3f} {r['tokens_per_s']:10,.0f} {r['model_flops_per_s'] / 1e9:10,.1f} {r['mfu']:6.1%}"
        )
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
