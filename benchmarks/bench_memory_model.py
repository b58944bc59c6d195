"""The memory model (``gyre_jax/model/memory.py``) against XLA, and its projection for the GPU and TPU presets.

Part 1, measured: the learner's supervised micro-step (``GradWorker._sft_grads``: forward, target log-probs,
backward) of a small model on one CPU device, compiled for rows of T tokens; XLA's ``memory_analysis()`` temp
bytes (compile only: nothing runs) against the model's per-token terms (activations + attention + logits; the
weights and gradients are the program's arguments and outputs, not temp). For each setting (remat policy,
attention kernel, logits chunk) it prints both at each T and the growth between the two largest T, per token.

Part 2, projected: bytes per device of one branch of 128K, 256K and 1M tokens for the presets' models (bf16
compute on fp32 master weights, full remat, blockwise attention, logits in chunks of 2048), the parameters over
the cell's model-parallel devices, and the fewest context shards that fit each accelerator's memory.

    python benchmarks/bench_memory_model.py                      # -> benchmarks/results/memory_model.json
    python benchmarks/bench_memory_model.py --lengths 256 512 --out /tmp/mm.json   # the CI smoke form
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre_jax.model import memory  # noqa: E402
from gyre_jax.model.config import QWEN3_1P7B, QWEN3_8B, QWEN3_30B_A3B, ModelConfig  # noqa: E402
from gyre_jax.model.sharding import abstract_model, make_mesh  # noqa: E402
from gyre_jax.rl.micro_step import GradWorker  # noqa: E402
from gyre_jax.trajectory.batch import MicroBatch  # noqa: E402

SMALL = ModelConfig(
    vocab_size=4096, num_layers=2, embed_dim=128, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384,
    rope_theta=1e4, attention_block_q=128, attention_block_k=128,
)  # fmt: skip
SETTINGS = {
    "xla, no remat": dict(attention_impl="xla", remat_policy="none"),
    "blockwise, no remat": dict(attention_impl="blockwise", remat_policy="none"),
    "blockwise, dots": dict(attention_impl="blockwise", remat_policy="dots"),
    "blockwise, full remat": dict(attention_impl="blockwise", remat_policy="full"),
    "blockwise, full, chunk 256": dict(attention_impl="blockwise", remat_policy="full", logits_chunk=256),
}
GIB = 2**30
# (preset, model, model-parallel devices per cell (params and optimizer state split over them), accelerator GiB)
PRESETS = [
    ("gpu_single_host (H100 80 GB)", QWEN3_1P7B, 2, 80),
    ("a v5p host (95 GB)", QWEN3_8B, 4, 95),
    ("an H200 host (141 GB)", QWEN3_30B_A3B, 8, 141),
]
PROJECT = dict(dtype="bfloat16", param_dtype="float32", remat_policy="full", attention_impl="blockwise",
               logits_chunk=2048)  # fmt: skip


def _sft_program(cfg: ModelConfig, t: int):
    """The SFT micro-step's jitted function and abstract arguments for one row of ``t`` tokens, one CPU device."""
    from gyre_jax.config import load_config

    mesh = make_mesh(jax.devices()[:1], dict(data=1))
    graphdef, abstract = abstract_model(cfg)
    worker = GradWorker(cfg, graphdef, mesh, load_config([]).sharding_rules)
    i32, f32 = jax.ShapeDtypeStruct((1, t), jnp.int32), jax.ShapeDtypeStruct((1, t), jnp.float32)
    seq = jax.ShapeDtypeStruct((1,), jnp.float32)
    mb = MicroBatch(tokens=i32, positions=i32, segment_ids=i32, subtree_end=i32, targets=i32, loss_mask=f32,
                    old_logprobs=f32, temperature=f32, seq_index=i32, advantages=seq, seq_weights=seq)  # fmt: skip
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                          worker.param_shardings)  # fmt: skip
    return worker, params, mb


def measured_temp(cfg: ModelConfig, t: int) -> int:
    """XLA's temp bytes of the SFT micro-step on one row of ``t`` tokens (compile only)."""
    worker, params, mb = _sft_program(cfg, t)
    analysis = worker._sft_grads.lower(params, mb).compile().memory_analysis()
    if analysis is None:
        raise SystemExit("this backend's compiled memory_analysis() is None: nothing to compare")
    return int(analysis.temp_size_in_bytes)


def measured_saved(cfg: ModelConfig, t: int) -> int:
    """Bytes of JAX's saved residuals of the SFT loss (what the backward keeps; the arguments excluded): the
    list ``jax.ad_checkpoint.print_saved_residuals`` prints, from its private twin that returns it."""
    from flax import nnx
    from jax._src.ad_checkpoint import saved_residuals

    from gyre_jax.rl import losses
    from gyre_jax.rl.micro_step import _logprobs_and_aux

    worker, params, mb = _sft_program(cfg, t)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (params, mb))

    def loss(p, batch):
        return losses.token_nll_loss(_logprobs_and_aux(worker.graphdef, p, batch, False)[0], batch.loss_mask)

    with nnx.use_eager_sharding(False):
        found = saved_residuals(loss, *zeros)
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, why in found if "from the argument" not in why)


def measure(lengths: list[int]) -> list[dict]:
    rows = []
    for name, fields in SETTINGS.items():
        cfg = dataclasses.replace(SMALL, **fields)
        saved = {t: measured_saved(cfg, t) for t in lengths}
        temp = {t: measured_temp(cfg, t) for t in lengths}
        pred_saved = {t: memory.saved_bytes(cfg, t) for t in lengths}
        pred_peak = {t: memory.train_memory(cfg, t).per_token for t in lengths}
        rows.append(dict(setting=name, fields=fields, saved=saved, predicted_saved=pred_saved, xla_temp=temp,
                         predicted_saved_plus_working=pred_peak))  # fmt: skip
    return rows


def project() -> list[dict]:
    rows = []
    for name, model, shards, gib in PRESETS:
        cfg = dataclasses.replace(model, **PROJECT)
        for tokens in (131072, 262144, 1048576):
            one = memory.train_memory(cfg, tokens, fsdp=shards)
            c = memory.min_context_shards(cfg, tokens, 0.9 * gib * GIB, fsdp=shards)
            rows.append(dict(preset=name, tokens=tokens, state_gib=one.state / GIB,
                             tokens_gib_1_shard=one.per_token / GIB, context_shards=c,
                             per_device_gib=memory.train_memory(cfg, tokens, context=max(c, 1), fsdp=shards).total / GIB,
                             kv_gib_per_session=memory.kv_bytes_per_token(cfg) * tokens / GIB))  # fmt: skip
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory_model.json"))
    args = ap.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    lengths = sorted(args.lengths)
    rows = measure(lengths)
    print(
        "saved residuals (what the backward keeps): measured / predicted MiB;  XLA temp / predicted saved+working MiB"
    )
    for r in rows:
        cells = "  ".join(
            f"T={t}: {r['saved'][t] / 2**20:.1f} / {r['predicted_saved'][t] / 2**20:.1f};"
            f" {r['xla_temp'][t] / 2**20:.1f} / {r['predicted_saved_plus_working'][t] / 2**20:.1f}"
            for t in lengths
        )
        print(f"{r['setting']:28s} {cells}")
    proj = project()
    print(f"\n{'preset':30s} {'tokens':>8s} {'state GiB':>10s} {'tokens GiB (1 shard)':>21s} {'context shards':>15s} "
          f"{'GiB/device':>11s} {'KV GiB (serving)':>17s}")  # fmt: skip
    for p in proj:
        print(f"{p['preset']:30s} {p['tokens']:>8d} {p['state_gib']:>10.1f} {p['tokens_gib_1_shard']:>21.1f} "
              f"{p['context_shards']:>15d} {p['per_device_gib']:>11.1f} {p['kv_gib_per_session']:>17.1f}")  # fmt: skip
    out = dict(platform=platform.platform(), jax=jax.__version__, model=dataclasses.asdict(SMALL), measured=rows,
               projected=proj, projection_fields=PROJECT)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=lambda o: np.asarray(o).tolist()))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
