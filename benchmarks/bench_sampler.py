"""Sampling cost per decode step: ``gyre_jax.serving.sampling.sample`` against the previous sampler, which sorted
the whole vocabulary on every call (``always_sorting`` below, kept here as the baseline), in the same run.

Rows: batch x vocab x setting (untruncated: temperature 1, top-k 0, top-p 1, what agents' harnesses mostly send;
top-p 0.95; greedy). Prints a table and writes JSON (median of ``--reps`` jitted calls, after a warm-up).

    python benchmarks/bench_sampler.py                  # -> benchmarks/results/sampler.json
    python benchmarks/bench_sampler.py --smoke --out /tmp/sampler.json
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.timing import median_ms  # noqa: E402
from gyre_jax.serving.sampling import sample  # noqa: E402


def always_sorting(logits, keys, temperature, top_k, top_p):
    """The previous sampler (before the truncation fast path): sorts every row on every call."""
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature)
    scaled = logits / t[:, None]
    logp = jax.nn.log_softmax(scaled, axis=-1)
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    keep_count = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (keep_count - 1)[:, None], axis=-1)
    truncated = jnp.where(scaled >= jnp.maximum(kth, pth), scaled, -jnp.inf)
    sampled = jax.vmap(lambda kd, row: jax.random.categorical(jax.random.wrap_key_data(kd), row))(keys, truncated)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


SETTINGS = {"untruncated": (1.0, 0, 1.0), "top_p_0.95": (1.0, 0, 0.95), "greedy": (0.0, 0, 1.0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one small shape, few repetitions")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sampler.json"))
    a = ap.parse_args(argv)
    shapes = [(8, 512)] if a.smoke else [(1, 512), (32, 512), (1, 151936), (32, 151936)]
    reps = 3 if a.smoke else a.reps
    new, old = jax.jit(sample), jax.jit(always_sorting)
    rows = []
    print(f"{'batch':>5} {'vocab':>7} {'setting':<12} {'sorting ms':>10} {'sample ms':>10} {'speedup':>8}")
    for batch, vocab in shapes:
        logits = jax.random.normal(jax.random.key(0), (batch, vocab), jnp.float32) * 3
        keys = jax.random.key_data(jax.random.split(jax.random.key(1), batch))
        for name, (temp, k, p) in SETTINGS.items():
            args = (logits, keys, jnp.full((batch,), temp), jnp.full((batch,), k, jnp.int32), jnp.full((batch,), p))
            same = bool(jnp.all(new(*args)[0] == old(*args)[0]))
            t_old, t_new = median_ms(old, args, reps), median_ms(new, args, reps)
            rows.append({"batch": batch, "vocab": vocab, "setting": name, "always_sorting_ms": round(t_old, 4),
                         "sample_ms": round(t_new, 4), "speedup": round(t_old / t_new, 2), "same_tokens": same})  # fmt: skip
            print(f"{batch:>5} {vocab:>7} {name:<12} {t_old:>10.3f} {t_new:>10.3f} {t_old / t_new:>7.2f}x"
                  + ("" if same else "  (tokens differ)"))  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
            "reps": reps, "time": time.time()}  # fmt: skip
    out.write_text(
        json.dumps({"meta": meta, "baseline": "always_sorting (the previous sampler)", "rows": rows}, indent=1)
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
