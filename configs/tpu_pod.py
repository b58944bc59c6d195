"""Preset: a Cloud TPU v5p-64 slice (32 chips, 8 hosts x 4 chips, 95 GB HBM per chip), Qwen3-8B.

Launch the same command on every host (gcloud recipe in docs/multihost.md):
    python -m gyre_jax.train --config configs/tpu_pod.py [--config.a.b=value ...]
(add --config.model.checkpoint_dir=/mnt/disks/models/Qwen3-8B --config.tokenizer.kind=hf for real weights)

Built on the defaults (``config.default_config()``: every key's own default; serving.warmup
on, unlike configs/tiny_cpu.py). JAX reads the worker id and the slice's hosts from the TPU VM metadata
(config.distributed left to auto-detect). Parallelism: 8 cells of 4 chips, each cell one whole host
(worker 0's host is the core); inside a cell, tensor=4 (32 query / 8 KV heads split 4 ways). A cell
over several hosts (needed for a core larger than one host's HBM, e.g. Qwen3-30B-A3B's ~490 GB of
master weights, gradients and Adam moments) is not supported yet by the multi-process trainer. Memory
(estimates, not measured here): the core's fp32 master weights, gradients and Adam moments are about
16 bytes x 8.2B = 131 GB over 4 x 95 GB, with full remat for the 32K-token rows. The training mesh
(data=8 x tensor=4) is used for initialization.
"""

from gyre_jax import config as config_lib
from gyre_jax.model.config import QWEN3_8B


def get_config():
    c = config_lib.default_config()
    c.workdir = "/mnt/shared/runs/tpu_pod"  # a filesystem every host mounts (e.g. Filestore / GCS FUSE)
    c.devices.platform = "tpu"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 8, 1, 4
    c.cells.num_cells = 8  # 4 chips each = 1 whole host
    c.cells.data, c.cells.fsdp, c.cells.tensor = 1, 1, 4
    config_lib.use_model(c, QWEN3_8B)  # bf16 compute on fp32 master weights, full remat

    c.serving.max_concurrent_decodes = 16
    c.serving.max_seq_len = 32768
    c.serving.max_prefill_length = 4096
    c.serving.prefill_buckets = (512, 1024, 2048, 4096)
    c.serving.page_size = 64
    c.serving.kv_pages = 4096
    c.trajectory.row_length = 32768
    c.trajectory.tokens_per_micro_batch = 32768

    c.proxy.host = "0.0.0.0"  # harnesses reach worker 0 over HTTP (from the pod or from other VMs)
    c.proxy.allow_remote_bind = True  # 0.0.0.0 is refused without it
    c.proxy.port = 8000
    c.rollout.tasks_per_step = 16
    c.rollout.max_parallel = 256
    c.rollout.max_tokens_per_call = 4096
    c.rollout.timeout_s = 3600.0
    c.rl.group_size = 16
    c.warm_start.steps = 0

    c.distributed.enabled = True  # everything else detected from the TPU VM metadata
    c.distributed.initialization_timeout_s = 600.0
    c.distributed.heartbeat_timeout_s = 60.0
    return c
