"""Preset: one host with 8 GPUs (e.g. 8 x H100 80 GB), one process, Qwen3-1.7B shapes.

Run: python -m gyre_jax.train --config configs/gpu_single_host.py [--config.a.b=value ...]
     (add --config.model.checkpoint_dir=/path/to/Qwen3-1.7B --config.tokenizer.kind=hf for real weights)

Built on the defaults (``config.default_config()``: every key's own default; serving.warmup
on, unlike configs/tiny_cpu.py). Parallelism: the training mesh is
fsdp=4 x tensor=2 over the 8 GPUs; 4 cells of 2 GPUs (tensor=2: a cell is a part of the host, its tensor
pair shares NVLink). One process drives all 8 GPUs, so config.distributed stays disabled. Memory
(estimates, not measured here): the core cell holds fp32 master weights, gradients and Adam moments, about
16 bytes x 2.0B parameters = 32 GB over 2 GPUs, plus its KV cache (8 slots x 32K tokens x 112 KB =
29 GB) and activations (remat on): ``python -m gyre_jax.plan --config configs/gpu_single_host.py``.
"""

from gyre_jax import config as config_lib
from gyre_jax.model.config import QWEN3_1P7B


def get_config():
    c = config_lib.default_config()
    c.workdir = "runs/gpu_single_host"
    c.devices.platform = "gpu"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 4, 2
    c.cells.num_cells = 4
    c.cells.data, c.cells.fsdp, c.cells.tensor = 1, 1, 2
    config_lib.use_model(c, QWEN3_1P7B)  # bf16 compute on fp32 master weights, full remat

    c.devices.memory_gib = 79.0  # an H100 80 GB as JAX reports it (python -m gyre_jax.plan's budget)
    c.model.max_context = 32768  # serving slots and training rows (blockwise attention derives from it)
    c.model.logits_chunk = 2048  # the [T, V] float32 logits of a 32K row would be 20 GB
    c.serving.max_concurrent_decodes = 8  # decode slots per cell
    c.serving.max_prefill_length = 4096
    c.serving.prefill_buckets = (512, 1024, 2048, 4096)
    c.serving.page_size = 64
    c.serving.kv_pages = 2048  # 128K tokens of session prefix cache per cell

    c.rollout.tasks_per_step = 8
    c.rollout.max_parallel = 64
    c.rollout.max_tokens_per_call = 4096
    c.rollout.timeout_s = 3600.0
    c.rl.group_size = 16  # GSPO rollouts per task (published setting)
    c.warm_start.steps = 0  # a real checkpoint needs no format warm start
    # RL of a pretrained checkpoint: 1e-6, as veRL, TRL and slime default to (the 3e-4 default is for the tiny model
    # trained from scratch; at 3e-4 SmolLM2-135M collapsed within 4 steps, docs/results.md)
    c.optimizer.learning_rate, c.optimizer.warmup_steps = 1e-6, 0

    return c
