"""Decode tokens/s and training-step time on a lent GPU, beside ``gpu_model_bench.sh`` (model MFU).

Our ``Engine`` decodes static batches of 1, 8 and 32 (64-token prompts, 64 new tokens; one step per program and 8
steps per program) and one training step runs on [8, T] tokens, both as a user's plain jitted forward + backward
+ AdamW and as ``Learner.step`` (kind "sft"), for two models: the ``bench_vs_tunix.py`` Qwen3 shape (fp32,
T = 256) and the ``qwen3_1b`` preset in bf16 on fp32 master weights (T = 2048). Each measurement is the median of
5 runs after the warm-up calls (``--smoke``: the vs-Tunix smoke shape, 2 runs, on any backend); model TFLOP/s use
``ModelConfig.train_flops_per_token``. The functions measured are ``bench_vs_tunix.py``'s, which needs no Tunix
for them. Runs from the checkout with no install (the H200 image has JAX with CUDA, flax, optax, orbax).

    python3 benchmarks/gpu_checks.py OUT.json [--smoke] [--train1b]   # --train1b: only qwen3_1b's training steps

Prints one line per measurement and writes JSON (the rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench_vs_tunix as B  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from gyre_jax.model.config import PRESETS  # noqa: E402
from gyre_jax.model.sharding import RULES_DATA, init_params, make_mesh  # noqa: E402


def timed(fn, reps: int) -> tuple[float, float]:
    """(median, best) seconds of ``reps`` calls of ``fn`` after ``bench_vs_tunix.WARMUP`` calls (a donating step's
    second call compiles again: its inputs are now the first call's outputs)."""
    for _ in range(B.WARMUP):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def models(smoke: bool, train_1b_only: bool):
    """(name, model config, bench_vs_tunix sizes) of each model measured."""
    sz = B.SMOKE if smoke else B.FULL
    if not train_1b_only:
        yield "vs_tunix_shape_fp32", B.our_config(sz), sz
    if not smoke:
        cfg = dataclasses.replace(PRESETS["qwen3_1b"], dtype="bfloat16")
        yield "qwen3_1b_bf16", cfg, dataclasses.replace(sz, vocab=cfg.vocab_size, train_seq=2048, train_batch=8)


def measure(name: str, cfg, sz, mesh, reps: int, decode: bool) -> list[dict]:
    rows = []
    graphdef, params = init_params(cfg, mesh, RULES_DATA, seed=0)
    rng = np.random.default_rng(0)
    vocab = min(cfg.vocab_size, 512)
    for batch in sz.batches if decode else ():
        prompts = [rng.integers(0, vocab, sz.prompt_len).tolist() for _ in range(batch)]
        for steps in (1, 8):
            engine = B.make_engine(cfg, graphdef, mesh, sz, batch, steps)
            med, best = timed(functools.partial(B.ours_engine_generate, engine, params, prompts, sz), reps)
            rows.append(dict(model=name, what=f"decode batch {batch}, {steps} step(s)/program", batch=batch,
                             decode_steps=steps, median_s=med, best_s=best,
                             tokens_per_s=batch * sz.new_tokens / med))  # fmt: skip
            print(rows[-1], flush=True)
    tokens = B.train_tokens(sz, vocab)
    flops = cfg.train_flops_per_token(sz.train_seq) * tokens.size
    steps = (
        ("plain fwd+bwd+adamw", lambda: B.ours_plain_step(cfg, graphdef, params, tokens, 1e-4)),
        ("Learner.step sft", lambda: B.ours_learner_step(cfg, graphdef, mesh, params, tokens, 1e-4)),
    )
    for kind, make in steps:
        med, best = timed(make(), reps)
        rows.append(dict(model=name, what=f"train step [{sz.train_batch}, {sz.train_seq}] {kind}", median_s=med,
                         best_s=best, tokens_per_s=tokens.size / med, model_tflops_per_s=flops / med / 1e12))  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="JSON path for the rows")
    ap.add_argument("--smoke", action="store_true", help="the vs-Tunix smoke shape, 2 runs per measurement")
    ap.add_argument("--train1b", action="store_true", help="only qwen3_1b's training steps")
    args = ap.parse_args(argv)
    out_path, smoke, train_1b_only = args.out, args.smoke, args.train1b
    report = {"devices": str(jax.devices()), "jax": jax.__version__, "rows": []}
    mesh = make_mesh(jax.devices()[:1], dict(data=1))
    for name, cfg, sz in models(smoke, train_1b_only):
        try:
            report["rows"] += measure(name, cfg, sz, mesh, 2 if smoke else 5, decode=not train_1b_only)
        except Exception:  # one model failing leaves the other's rows
            report["rows"].append(dict(model=name, error=traceback.format_exc()[-2000:]))
            traceback.print_exc()
        out_path.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
