"""Preset: a Cloud TPU v5p-64 slice (32 chips, 8 hosts x 4 chips, 95 GB HBM per chip), Qwen3-30B-A3B.

Launch the same command on every host (gcloud recipe in docs/multihost.md):
    python -m gyre_jax.train --config configs/tpu_pod.py [--config.a.b=value ...]
(add --config.model.checkpoint_dir=/mnt/disks/models/Qwen3-30B-A3B --config.tokenizer.kind=hf for real weights)

Built on configs/tiny_cpu.py. JAX reads the worker id and the slice's hosts from the TPU VM metadata
(config.distributed left to auto-detect). Parallelism: 4 cells of 8 chips, each cell two whole hosts
(a v5p slice's chips are all connected by ICI, so a cell over 2 hosts is still one torus block); inside a
cell, experts are split 8 ways. The training mesh is data=4 x expert=8. Memory (estimates, not measured
here): the core's fp32 master weights, gradients and Adam moments are about 490 GB over 8 x 95 GB.
"""

import dataclasses
import importlib.util
from pathlib import Path

from gyre_jax import distributed
from gyre_jax.model.config import QWEN3_30B_A3B
from gyre_jax.model.sharding import RULES_EXPERT


def _tiny_cpu():
    spec = importlib.util.spec_from_file_location("gyre_config_tiny_cpu_base", Path(__file__).with_name("tiny_cpu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def get_config():
    c = _tiny_cpu()
    c.workdir = "/mnt/shared/runs/tpu_pod"  # a filesystem every host mounts (e.g. Filestore / GCS FUSE)
    c.devices.platform = "tpu"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 4, 1, 1
    c.mesh.expert = 8
    c.cells.num_cells = 4  # 8 chips each = 2 whole hosts of 4 chips
    c.cells.data, c.cells.fsdp, c.cells.tensor = 1, 1, 1
    c.cells.expert = 8
    c.sharding_rules = RULES_EXPERT
    for field in dataclasses.fields(QWEN3_30B_A3B):
        c.model[field.name] = getattr(QWEN3_30B_A3B, field.name)
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat_policy = "full"

    c.serving.max_concurrent_decodes = 16
    c.serving.max_seq_len = 32768
    c.serving.max_prefill_length = 4096
    c.serving.prefill_buckets = (512, 1024, 2048, 4096)
    c.serving.page_size = 64
    c.serving.kv_pages = 4096
    c.trajectory.row_length = 32768
    c.trajectory.tokens_per_micro_batch = 32768

    c.proxy.host = "0.0.0.0"  # harnesses reach worker 0 over HTTP (from the pod or from other VMs)
    c.proxy.port = 8000
    c.rollout.tasks_per_step = 16
    c.rollout.max_parallel = 256
    c.rollout.max_tokens_per_call = 4096
    c.rollout.timeout_s = 3600.0
    c.rl.group_size = 16
    c.warm_start.steps = 0

    c.distributed = distributed.default_config()
    c.distributed.enabled = True  # everything else detected from the TPU VM metadata
    c.distributed.initialization_timeout_s = 600.0
    c.distributed.heartbeat_timeout_s = 60.0
    return c
