"""Preset: a Cloud TPU v5p-128 slice (64 chips, 16 hosts x 4 chips, 95 GB HBM per chip), Qwen3-30B-A3B, each cell
two whole hosts.

Launch the same command on every host (gcloud recipe in docs/multihost.md):
    python -m gyre_jax.train --config configs/tpu_pod.py [--config.a.b=value ...]
(add --config.model.checkpoint_dir=/mnt/disks/models/Qwen3-30B-A3B --config.tokenizer.kind=hf for real weights)
Check the memory first (no TPU needed): python -m gyre_jax.plan --config configs/tpu_pod.py

Built on the defaults (``config.default_config()``: every key's own default; serving.warmup
on, unlike configs/tiny_cpu.py). JAX reads the worker id and the slice's hosts from the TPU VM metadata
(config.distributed left to auto-detect). Parallelism: 4 cells of 16 chips, each four whole hosts run in lockstep
(workers 0-3 are the core): experts split 4 ways within a host (``expert``), the embedding dimension 4 ways over
the hosts (``fsdp``); the training mesh is data=4 x fsdp=4 x expert=4. The core holds fp32 master weights,
gradients and Adam moments of 30.5B parameters (~490 GB): one host's 4 x 95 GB cannot, and with two hosts per
cell the core needs ~90 GiB per chip (the plan's table in docs/multihost.md).
``python -m gyre_jax.plan --config configs/tpu_pod.py`` prints every term per chip and the margin.
"""

from gyre_jax import config as config_lib
from gyre_jax.model.config import QWEN3_30B_A3B
from gyre_jax.model.sharding import RULES_EXPERT


def get_config():
    c = config_lib.default_config()
    c.workdir = "/mnt/shared/runs/tpu_pod"  # a filesystem every host mounts (e.g. Filestore / GCS FUSE)
    c.devices.platform = "tpu"
    c.devices.memory_gib = 88.0  # a v5p chip's 95 GB as JAX reports it (python -m gyre_jax.plan's budget)
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.expert = 4, 4, 1, 4
    c.cells.num_cells = 4  # 16 chips each = 4 whole hosts
    c.cells.data, c.cells.fsdp, c.cells.tensor, c.cells.expert = 1, 4, 1, 4
    c.sharding_rules = RULES_EXPERT  # experts over `expert`, tokens data-parallel over it outside the MoE blocks
    config_lib.use_model(c, QWEN3_30B_A3B)  # bf16 compute on fp32 master weights, full remat

    c.model.max_context = 32768  # serving slots and training rows (blockwise attention derives from it)
    c.model.logits_chunk = 2048  # the [T, V] float32 logits of a 32K row would be 20 GB
    c.serving.max_concurrent_decodes = 16
    c.serving.max_prefill_length = 4096
    c.serving.prefill_buckets = (512, 1024, 2048, 4096)
    c.serving.page_size = 64
    c.serving.kv_pages = 4096

    c.proxy.host = "0.0.0.0"  # harnesses reach worker 0 over HTTP (from the pod or from other VMs)
    c.proxy.allow_remote_bind = True  # 0.0.0.0 is refused without it
    c.proxy.port = 8000
    c.rollout.tasks_per_step = 16
    c.rollout.max_parallel = 256
    c.rollout.max_tokens_per_call = 4096
    c.rollout.timeout_s = 3600.0
    c.rl.group_size = 16
    c.warm_start.steps = 0
    # RL of a pretrained checkpoint: 1e-6, as veRL, TRL and slime default to (the 3e-4 default is for the tiny model
    # trained from scratch; at 3e-4 SmolLM2-135M collapsed within 4 steps, docs/results.md)
    c.optimizer.learning_rate, c.optimizer.warmup_steps = 1e-6, 0

    c.distributed.enabled = True  # everything else detected from the TPU VM metadata
    c.distributed.initialization_timeout_s = 600.0
    c.distributed.heartbeat_timeout_s = 60.0
    return c
