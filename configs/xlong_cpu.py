"""A long-horizon workload on CPU: executions of 100+ model calls and >100K tokens, trained with context parallelism.

Run: python -m gyre_jax.train --config configs/xlong_cpu.py [--config.total_steps=1 ...]
(the benchmark-length run of docs/long_context.md, "The long-horizon workload"; tests/test_xlong.py runs the
same config at small lengths). Each execution runs the ``long`` harness (gyre_jax/rollout/long_harness.py)
on a ``longlog`` task (docs/tasks.md): 24 log files of 4,000 characters read in pieces of 1,000 (one model call
each), every 4th file by a sub-agent, the main conversation compacted into a summary continuation before it
passes 34K tokens: about 115 calls and 250K tokens per execution; the branches kept for training are 32-35K
tokens long. They train on 8 virtual CPU devices: 2 cells of 4, each row of 36,864 tokens split over a
``context`` axis of 4 devices (ring attention, ``model.context_parallel = 4``, blockwise attention), so
nothing is excluded for length: serving.max_seq_len and trajectory.row_length hold a whole branch.
"""

from pathlib import Path

from gyre_jax import config as config_lib


def get_config():
    c = config_lib.base_config(Path(__file__).with_name("tiny_cpu.py"))
    c.workdir = "runs/xlong_cpu"
    c.total_steps = 3
    c.checkpoint_every = 3
    # 8 virtual devices in 2 cells of 4 (the default run has 2 cells of 1): each cell's 4 devices are its context axis
    c.devices.num_cpu_devices = 8
    c.mesh.data, c.mesh.fsdp = 4, 2
    c.cells.data, c.cells.num_cells = 4, 2
    # A small model (the one of benchmarks/bench_long_context.py): long rows on 2-core CPUs stay minutes, not hours.
    c.model.num_layers, c.model.embed_dim, c.model.mlp_dim = 2, 64, 128
    c.model.num_heads, c.model.num_kv_heads, c.model.head_dim = 4, 2, 16
    c.model.attention_impl = "blockwise"
    c.model.context_parallel = 4  # divides mesh.data = cells.data = 4: each cell trains a row over 4 devices
    c.model.remat_policy = "full"
    c.rollout.task_kinds = ("longlog",)
    c.rollout.harness = "long"
    c.rollout.num_tasks = 4
    c.rollout.tasks_per_step = 1
    c.rollout.max_tokens_per_call = 64
    c.rollout.timeout_s = 7200.0
    c.rollout.tool_latency_median_s = 0.0
    c.rollout.long_files = 24
    c.rollout.long_file_chars = 4000
    c.rollout.long_read_chars = 1000
    c.rollout.long_system_chars = 12000  # >= 9 x a call's new tokens: each continuing call reuses >= 90% of its prompt
    c.rollout.long_compact_tokens = 34000
    c.rollout.long_subagent_every = 4
    c.rl.group_size = 2
    c.rl.max_branches = 2  # J_max: the main branch and one summary continuation (both >= 32K tokens) per execution
    c.warm_start.steps = 0  # the longlog kind has no demonstrations
    c.eval.samples_per_task = 0  # an evaluation is one more round of long executions; 1 turns it on
    c.eval.split = "heldout"
    c.eval.num_tasks = 1
    # Serving: the dense per-slot KV cache: slots x max_seq_len x 512 bytes per token (this model) = 4 x 36,864 x
    # 512 B = 72 MiB per cell; the session prefix cache holds 8192 pages = 128K tokens. (--config.serving.kv_layout=
    # paged holds KV by live length instead, one pool of kv_pages per cell: docs/long_context.md, "Paged KV".)
    c.serving.max_seq_len = 36864
    c.serving.max_concurrent_decodes = 4
    c.serving.max_prefill_length = 1024
    c.serving.prefill_buckets = (256, 512, 1024)
    c.serving.kv_pages = 8192
    c.trajectory.row_length = 36864  # = serving.max_seq_len: every branch fits a row (9,216 tokens per context shard)
    c.trajectory.tokens_per_micro_batch = 36864
    c.metrics.progress_bar = False
    return c
