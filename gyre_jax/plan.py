"""``python -m gyre_jax.plan``: what a config's cells hold per device, and whether it fits the device's memory,
before anything starts (no device is touched: the mesh is abstract).

    python -m gyre_jax.plan --config configs/gpu_cluster.py [--config.a.b=v ...] [--device-gib 80] [--json out.json]

Every cell holds a serving engine (weights, decode slots' KV, the session prefix cache's page pool) and computes
gradient micro-steps (gradients, the micro-step's activations); the core cell also holds the optimizer state. The
terms, per device of a cell of the config's ``cells`` shape and ``sharding_rules``:

- **weights, gradients, optimizer**: summed over the model's parameters, each leaf's bytes divided by the number
  of devices its ``PartitionSpec`` splits it over (the same rules and ``logical_to_spec`` the run applies: a
  dimension that an axis does not divide is not split);
- **gathered layer**: the largest layer's weights that ``fsdp`` splits, in the compute dtype, gathered over it
  (twice: the forward's and the backward's copy);
- **micro-step tokens**: ``model.memory.train_memory``'s saved and working bytes for one row of
  ``trajectory.row_length`` tokens (over ``model.context_parallel`` shards), times the rows one device computes
  (the micro-batch's rows over the batch axes); not divided by tensor or expert parallelism, so an upper bound;
- **decode slots** and **page pool**: the serving engine's KV arrays (``serving.max_concurrent_decodes`` slots of
  ``serving.max_seq_len``; ``serving.kv_pages`` pages of ``serving.page_size``), split like the engine splits them.

A cell fits when its total is at most ``FIT_FRACTION`` of the device's memory (``devices.memory_gib``, or
``--device-gib``): the rest is left to the compiler's workspace and fragmentation. Exit status 0 when every cell
fits, 1 when one does not, 2 for a bad config or arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
from flax import nnx

from gyre_jax import config as config_lib
from gyre_jax.config.run import RunConfig
from gyre_jax.model import memory
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import abstract_model, logical_to_spec
from gyre_jax.serving.kv_cache import CACHE_AXES, SLOT_CACHE_AXES

GIB = 2**30
FIT_FRACTION = 0.9
EXIT_USAGE = 2


@dataclass(frozen=True)
class CellPlan:
    """Bytes per device of one cell's role (``core``: holds the optimizer state; ``cell``: any other)."""

    role: str
    devices: int
    shape: dict
    weights: float
    gradients: float
    optimizer: float
    gathered_layer: float
    tokens: float
    decode_slots: float
    page_pool: float

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.gathered_layer + self.tokens + self.decode_slots
                + self.page_pool)  # fmt: skip


def _split(spec: jax.sharding.PartitionSpec, mesh_shape: dict) -> int:
    """How many devices a leaf with ``spec`` is split over."""
    n = 1
    for entry in spec:
        for axis in (entry,) if isinstance(entry, str) else (entry or ()):
            n *= mesh_shape[axis]
    return n


def _leaf_bytes(cfg: ModelConfig, mesh: jax.sharding.AbstractMesh, rules, itemsize: int) -> tuple[float, float]:
    """(bytes per device of every parameter at ``itemsize`` bytes each, the largest layer's bytes per device of the
    leaves ``fsdp`` splits, as gathered over it)."""
    _, state = abstract_model(cfg)
    total, per_layer = 0.0, {}
    no_fsdp = {**dict(mesh.shape), "fsdp": 1}
    for path, var in nnx.to_flat_state(state):
        logical = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        spec = logical_to_spec(logical, rules, mesh, var.shape)
        size = math.prod(var.shape) * itemsize
        split, unsplit_fsdp = _split(spec, mesh.shape), _split(spec, no_fsdp)
        total += size / split
        layer = next((p for p in path if isinstance(p, int)), None)
        if layer is not None and unsplit_fsdp < split:  # split over fsdp: gathered for the layer's compute
            per_layer[layer] = per_layer.get(layer, 0.0) + size / unsplit_fsdp
    return total, max(per_layer.values(), default=0.0)


def _kv_bytes(cfg: ModelConfig, mesh, rules, axes, shape) -> float:
    """One layer's keys and values of ``shape`` per device, times the layers."""
    spec = logical_to_spec(axes, rules, mesh, shape)
    return 2 * cfg.num_layers * math.prod(shape) * memory.DTYPE_BYTES[cfg.dtype] / _split(spec, mesh.shape)


def plan(c: RunConfig) -> list[CellPlan]:
    """The core cell's and the other cells' bytes per device (one ``CellPlan`` each; just the core when the run has
    one cell)."""
    cfg = c.model_config()
    context = cfg.context_parallel
    shape = c.cells.shape(context)
    mesh = jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape.keys()))
    rules = c.sharding_rules
    param_bytes = memory.DTYPE_BYTES[cfg.param_dtype]
    weights, largest = _leaf_bytes(cfg, mesh, rules, param_bytes)
    gathered = 2 * largest * memory.DTYPE_BYTES[cfg.dtype] / param_bytes
    optimizer = weights * memory.ADAM_BYTES / param_bytes
    row = c.trajectory.row_length
    rows = max(1, c.trajectory.tokens_per_micro_batch // row)
    batch_split = _split(logical_to_spec(("batch",), rules, mesh, (rows,)), shape)
    tokens = memory.train_memory(cfg, row, context=context).per_token * math.ceil(rows / batch_split)
    sv = c.serving
    slots = _kv_bytes(cfg, mesh, rules, SLOT_CACHE_AXES,
                      (sv.max_concurrent_decodes, cfg.num_kv_heads, sv.max_seq_len, cfg.head_dim))  # fmt: skip
    pages = _kv_bytes(cfg, mesh, rules, CACHE_AXES, (sv.kv_pages, sv.page_size, cfg.num_kv_heads, cfg.head_dim))
    devices = c.cells.num_devices
    core = CellPlan("core", devices, shape, weights, weights, optimizer, gathered, tokens, slots, pages)
    if c.cells.num_cells == 1:
        return [core]
    return [core, CellPlan("cell", devices, shape, weights, weights, 0.0, gathered, tokens, slots, pages)]


def table(c: RunConfig, plans: list[CellPlan], device_gib: float) -> str:
    cfg = c.model_config()
    lines = [
        f"model: {cfg.num_params / 1e9:.2f}B parameters ({cfg.num_active_params / 1e9:.2f}B active), "
        f"{cfg.param_dtype} master weights, {cfg.dtype} compute, remat {cfg.remat_policy!r}",
        f"cells: {c.cells.num_cells} x {c.cells.num_devices} devices {plans[0].shape}; rows of "
        f"{c.trajectory.row_length} tokens, {c.trajectory.tokens_per_micro_batch} per micro-step; "
        f"{c.serving.max_concurrent_decodes} decode slots x {c.serving.max_seq_len}, "
        f"{c.serving.kv_pages} pages x {c.serving.page_size}",
        "",
        "| GiB per device | " + " | ".join(p.role for p in plans) + " |",
        "|---|" + "---:|" * len(plans),
    ]
    for term in ("weights", "gradients", "optimizer", "gathered_layer", "tokens", "decode_slots", "page_pool"):
        lines.append(f"| {term.replace('_', ' ')} | " + " | ".join(f"{getattr(p, term) / GIB:.1f}" for p in plans)
                     + " |")  # fmt: skip
    lines.append("| **total** | " + " | ".join(f"**{p.total / GIB:.1f}**" for p in plans) + " |")
    if device_gib:
        budget = FIT_FRACTION * device_gib
        lines.append(f"| margin to {FIT_FRACTION:.0%} of {device_gib:g} GiB | "
                     + " | ".join(f"{budget - p.total / GIB:+.1f}" for p in plans) + " |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre_jax.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-gib", type=float, default=0.0,
                        help="memory per device (default: the config's devices.memory_gib)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also write the plan here")
    args, rest = parser.parse_known_args(argv)
    try:
        c = config_lib.load_config(rest)
    except (config_lib.ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    device_gib = args.device_gib or c.devices.memory_gib
    plans = plan(c)
    print(table(c, plans, device_gib))
    fits = all(p.total <= FIT_FRACTION * device_gib * GIB for p in plans) if device_gib else None
    if fits is None:
        print("no device memory given (devices.memory_gib or --device-gib): nothing checked")
    else:
        print(f"{'fits' if fits else 'DOES NOT FIT'}: every cell's total "
              f"{'is' if fits else 'is not'} within {FIT_FRACTION:.0%} of {device_gib:g} GiB per device")  # fmt: skip
    if args.json:
        rows = [{**asdict(p), "total": p.total} for p in plans]
        args.json.write_text(json.dumps({"device_gib": device_gib, "fit_fraction": FIT_FRACTION, "fits": fits,
                                         "cells": rows}, indent=1) + "\n")  # fmt: skip
    return 0 if fits in (True, None) else 1


if __name__ == "__main__":
    sys.exit(main())
