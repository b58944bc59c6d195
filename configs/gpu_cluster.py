"""Preset: a GPU cluster of 8 hosts x 8 GPUs (H100 80 GB, NVLink in a host, InfiniBand between), Qwen3-30B-A3B, each
cell two whole hosts.

Launch one process per host (Slurm script and environment in docs/multihost.md):
    srun python -m gyre_jax.train --config configs/gpu_cluster.py [--config.a.b=value ...]
(add --config.model.checkpoint_dir=/shared/Qwen3-30B-A3B --config.tokenizer.kind=hf for real weights)
Check the memory first (no GPU needed): python -m gyre_jax.plan --config configs/gpu_cluster.py

Built on the defaults (``config.default_config()``: every key's own default; serving.warmup
on, unlike configs/tiny_cpu.py). JAX finds the coordinator, process count and id from Slurm's variables
(config.distributed.coordinator_address / num_processes / process_id left to auto-detect); each process
uses its host's 8 GPUs (config.distributed.local_device_ids). Parallelism: 4 cells of 16 GPUs, each two whole
hosts run in lockstep (docs/multihost.md): experts split 8 ways over a host's NVLink (``expert``) and the
parameters' embedding dimension 2 ways over the two hosts (``fsdp``); the training mesh is data=4 x fsdp=2 x
expert=8. Why two hosts: the core holds fp32 master weights, gradients and Adam moments of 30.5B parameters
(~490 GB); on one host of 8 x 80 GB that leaves too little for a 32K-token row's activations and the KV cache.
``python -m gyre_jax.plan --config configs/gpu_cluster.py`` prints every term per GPU and the margin.
"""

from gyre_jax import config as config_lib
from gyre_jax.model.config import QWEN3_30B_A3B
from gyre_jax.model.sharding import RULES_EXPERT


def get_config():
    c = config_lib.default_config()
    c.workdir = "/shared/runs/gpu_cluster"  # every host must see the same directory (checkpoints, records)
    c.devices.platform = "gpu"
    c.devices.memory_gib = 79.0  # an H100 80 GB as JAX reports it (python -m gyre_jax.plan's budget)
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 4, 2, 1
    c.mesh.expert = 8
    c.cells.num_cells = 4  # two whole hosts each: a cell is a set of whole hosts, never a scattered set of GPUs
    c.cells.data, c.cells.fsdp, c.cells.tensor = 1, 2, 1
    c.cells.expert = 8
    c.sharding_rules = RULES_EXPERT  # experts over `expert`, tokens data-parallel over it outside the MoE blocks
    config_lib.use_model(c, QWEN3_30B_A3B)  # bf16 compute on fp32 master weights, full remat

    c.model.max_context = 32768  # serving slots and training rows (blockwise attention derives from it)
    c.model.logits_chunk = 2048  # the [T, V] float32 logits of a 32K row would be 20 GB
    c.serving.max_concurrent_decodes = 16
    c.serving.max_prefill_length = 4096
    c.serving.prefill_buckets = (512, 1024, 2048, 4096)
    c.serving.page_size = 64
    c.serving.kv_pages = 4096  # 256K tokens of session prefix cache per cell

    c.proxy.host = "0.0.0.0"  # harnesses may run on other machines; they reach process 0's host over HTTP
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

    c.distributed.enabled = True  # coordinator_address, num_processes, process_id: detected from Slurm
    # One process drives all 8 GPUs of its host. Without this, JAX's Slurm detection would give each process
    # only the GPU numbered SLURM_LOCALID (its one-process-per-GPU layout).
    c.distributed.local_device_ids = tuple(range(8))
    c.distributed.initialization_timeout_s = 600.0  # hosts start at different times under srun
    c.distributed.heartbeat_timeout_s = 60.0
    return c
