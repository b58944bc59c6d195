"""Attention memory at long T: dense masked ``jax.nn.dot_product_attention`` against ``model.blockwise``, same run.

For each T: the compiled temp bytes of d(loss)/d(q, k, v) (forward + backward, from XLA's
``memory_analysis()``; compile only, nothing runs) at B=1, H=4, K=2, D=32, one causal sequence of T
tokens (``tree_mask_spec`` of one segment; dense: ``trajectory.batch.attention_mask``). Where
T <= ``--time-max`` it also times one jitted forward+backward (median of ``--reps``, after a warm-up),
blockwise with and without skipping fully masked key blocks. Prints a table and writes JSON.

    python benchmarks/bench_long_context.py            # -> benchmarks/results/long_context.json
    python benchmarks/bench_long_context.py --lengths 1024 2048 --time-max 0 --out /tmp/lc.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.timing import median_ms  # noqa: E402
from gyre_jax.model.blockwise import blockwise_attention, tree_mask_spec  # noqa: E402
from gyre_jax.trajectory.batch import attention_mask  # noqa: E402

B, H, K, D = 1, 4, 2, 32


def grad_fn(kind: str, block: int):
    """kind: dense | blockwise | blockwise_noskip -> jitted (q, k, v, seg, end) -> (dq, dk, dv) of sum(out^2)."""

    def loss(q, k, v, seg, end):
        if kind == "dense":
            out = jax.nn.dot_product_attention(q, k, v, mask=attention_mask(seg, end)[:, None])
        else:
            spec = tree_mask_spec(seg, end)
            out = blockwise_attention(
                q, k, v, spec, block_q=block, block_k=block, skip_empty_blocks=kind == "blockwise"
            )
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, (0, 1, 2)))


def shapes(t: int):
    f32 = jnp.float32
    return (jax.ShapeDtypeStruct((B, t, H, D), f32), jax.ShapeDtypeStruct((B, t, K, D), f32),
            jax.ShapeDtypeStruct((B, t, K, D), f32), jax.ShapeDtypeStruct((B, t), jnp.int32),
            jax.ShapeDtypeStruct((B, t), jnp.int32))  # fmt: skip


def inputs(t: int):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, t, h, D)), jnp.float32) for h in (H, K, K))
    return q, k, v, jnp.ones((B, t), jnp.int32), jnp.full((B, t), t, jnp.int32)


def temp_bytes(fn, t: int) -> int | None:
    analysis = fn.lower(*shapes(t)).compile().memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def measure(t: int, block: int, time_max: int, reps: int) -> dict:
    fns = {kind: grad_fn(kind, block) for kind in ("dense", "blockwise", "blockwise_noskip")}
    row = {
        "T": t,
        "dense_temp_bytes": temp_bytes(fns["dense"], t),
        "blockwise_temp_bytes": temp_bytes(fns["blockwise"], t),
    }
    if t <= time_max:
        args = inputs(t)
        for kind, fn in fns.items():
            row[f"{kind}_ms"] = round(median_ms(fn, args, reps), 2)
    return row


def mib(x) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 65536])
    ap.add_argument("--block", type=int, default=128, help="block_q = block_k")
    ap.add_argument("--time-max", type=int, default=4096, help="time fwd+bwd only at T <= this (0: no times)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_context.json"))
    a = ap.parse_args(argv)
    rows = []
    print(
        f"{'T':>6} {'dense MiB':>10} {'blockwise MiB':>14} {'ratio':>7} {'dense ms':>9} {'bw ms':>8} {'bw noskip ms':>13}"
    )
    for t in a.lengths:
        row = measure(t, a.block, a.time_max, a.reps)
        rows.append(row)
        d, bw = row["dense_temp_bytes"], row["blockwise_temp_bytes"]
        ratio = f"{d / bw:.1f}x" if d and bw else "n/a"
        times = [f"{row[k]:.1f}" if k in row else "-" for k in ("dense_ms", "blockwise_ms", "blockwise_noskip_ms")]
        print(f"{t:>6} {mib(d):>10} {mib(bw):>14} {ratio:>7} {times[0]:>9} {times[1]:>8} {times[2]:>13}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
            "config": {"B": B, "H": H, "K": K, "D": D, "block_q": a.block, "block_k": a.block, "dtype": "float32",
                       "mask": "one causal sequence (tree_mask_spec / attention_mask)"},
            "measure": "compiled temp_size_in_bytes of jit(grad(sum(out**2))) wrt q, k, v; times: median ms",
            "reps": a.reps, "time": time.time()}  # fmt: skip
    out.write_text(json.dumps({"meta": meta, "baseline": "dense jax.nn.dot_product_attention", "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
