"""Preset: a GPU cluster of 4 hosts x 8 GPUs (e.g. H100 80 GB, NVLink in a host, InfiniBand between), Qwen3-30B-A3B.

Launch one process per host (Slurm script and environment in docs/multihost.md):
    srun python -m gyre_jax.train --config configs/gpu_cluster.py [--config.a.b=value ...]
(add --config.model.checkpoint_dir=/shared/Qwen3-30B-A3B --config.tokenizer.kind=hf for real weights)

Built on the defaults (``config.default_config()``: every key's own default; serving.warmup
on, unlike configs/tiny_cpu.py). JAX finds the coordinator, process count and id from Slurm's variables
(config.distributed.coordinator_address / num_processes / process_id left to auto-detect); each process
uses its host's 8 GPUs (config.distributed.local_device_ids). Parallelism:
4 cells, each one whole host (8 GPUs, experts split 8 ways over NVLink); the training mesh is data=4
(over the hosts) x expert=8. Memory (estimates, not measured here): the core cell holds fp32 master
weights, gradients and Adam moments, about 16 bytes x 30.5B parameters = 490 GB over 8 x 80 GB, so
remat is on and the KV cache is kept to 16 slots x 32K tokens x 96 KB = 50 GB per cell.
"""

from gyre_jax import config as config_lib
from gyre_jax.model.config import QWEN3_30B_A3B
from gyre_jax.model.sharding import RULES_EXPERT


def get_config():
    c = config_lib.default_config()
    c.workdir = "/shared/runs/gpu_cluster"  # every host must see the same directory (checkpoints, records)
    c.devices.platform = "gpu"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 4, 1, 1
    c.mesh.expert = 8
    c.cells.num_cells = 4  # one per host: a cell is a set of whole hosts, never a scattered set of GPUs
    c.cells.data, c.cells.fsdp, c.cells.tensor = 1, 1, 1
    c.cells.expert = 8
    c.sharding_rules = RULES_EXPERT  # experts over `expert`, tokens data-parallel over it outside the MoE blocks
    config_lib.use_model(c, QWEN3_30B_A3B)  # bf16 compute on fp32 master weights, full remat

    c.serving.max_concurrent_decodes = 16
    c.serving.max_seq_len = 32768
    c.serving.max_prefill_length = 4096
    c.serving.prefill_buckets = (512, 1024, 2048, 4096)
    c.serving.page_size = 64
    c.serving.kv_pages = 4096  # 256K tokens of session prefix cache per cell
    c.trajectory.row_length = 32768
    c.trajectory.tokens_per_micro_batch = 32768

    c.proxy.host = "0.0.0.0"  # harnesses may run on other machines; they reach process 0's host over HTTP
    c.proxy.allow_remote_bind = True  # 0.0.0.0 is refused without it
    c.proxy.port = 8000
    c.rollout.tasks_per_step = 16
    c.rollout.max_parallel = 256
    c.rollout.max_tokens_per_call = 4096
    c.rollout.timeout_s = 3600.0
    c.rl.group_size = 16
    c.warm_start.steps = 0

    c.distributed.enabled = True  # coordinator_address, num_processes, process_id: detected from Slurm
    # One process drives all 8 GPUs of its host. Without this, JAX's Slurm detection would give each process
    # only the GPU numbered SLURM_LOCALID (its one-process-per-GPU layout).
    c.distributed.local_device_ids = tuple(range(8))
    c.distributed.initialization_timeout_s = 600.0  # hosts start at different times under srun
    c.distributed.heartbeat_timeout_s = 60.0
    return c
