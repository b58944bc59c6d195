"""Preset: a Cloud TPU v5p-1024 slice (512 chips, 128 hosts x 4 chips, 95 GB HBM per chip), Qwen3-235B-A22B, each
cell 32 whole hosts.

Built on configs/tpu_pod.py (gcloud launch on every worker, 32K-token rows; docs/multihost.md) with the model and
the cells changed:
    python -m gyre_jax.train --config configs/tpu_pod_235b.py [--config.a.b=value ...]
Check the memory first (no TPU needed): python -m gyre_jax.plan --config configs/tpu_pod_235b.py

Parallelism: 4 cells of 128 chips, each 32 whole hosts run in lockstep: experts split 4 ways within a host
(``expert``), the embedding dimension 32 ways over the hosts (``fsdp``); the training mesh is data=4 x fsdp=32 x
expert=4. The core's fp32 master weights, gradients and Adam moments of 235B parameters are ~3.8 TB; beside them a
32K-token row's activations (~38 GiB per chip: a row is not split over fsdp) and the serving KV must fit, and with
16 hosts per cell the core does not (the plan's table in docs/multihost.md). 32 decode slots per cell: one per
fsdp shard.
"""

from pathlib import Path

from gyre_jax import config as config_lib
from gyre_jax.model.config import QWEN3_235B_A22B


def get_config():
    c = config_lib.base_config(Path(__file__).with_name("tpu_pod.py"))
    c.workdir = "/mnt/shared/runs/tpu_pod_235b"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.expert = 4, 32, 1, 4
    c.cells.num_cells = 4
    c.cells.data, c.cells.fsdp, c.cells.tensor, c.cells.expert = 1, 32, 1, 4
    config_lib.use_model(c, QWEN3_235B_A22B)  # bf16 compute on fp32 master weights, full remat
    c.model.logits_chunk = 2048  # use_model set the model preset's 0; max_context (32K) is the base's
    c.serving.max_concurrent_decodes = 32
    return c
