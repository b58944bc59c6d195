"""Preset: RL of a real Qwen3 checkpoint on a Harbor task directory (Terminal-Bench 2 / SWE-style tasks), through
Claude Code in bubblewrap sandboxes, on the GPU cluster of configs/gpu_cluster.py (8 hosts x 8 GPUs, cells of two
hosts).

Launch one process per host (docs/multihost.md), pointing at your checkpoint and task directory:
    srun python -m gyre_jax.train --config configs/coding_gpu_cluster.py \
        --config.model.checkpoint_dir=/shared/Qwen3-30B-A3B --config.tokenizer.kind=hf \
        --config.rollout.suite=harbor:/shared/tasks/terminal-bench-2
Harnesses run on process 0's host (the executor runs there), each in its own sandbox with the task's cpus and
memory applied through cgroups; size `rollout.max_parallel` to that host's cores and memory. Tasks whose
test.sh hard-codes /app, /tests and /logs run unchanged (bwrap maps them). The suite is loaded and every task
checked when the config loads.
"""

from pathlib import Path

from gyre_jax import config as config_lib


def get_config():
    c = config_lib.base_config(Path(__file__).with_name("gpu_cluster.py"))
    c.workdir = "/shared/runs/coding_gpu_cluster"
    c.tokenizer.tools_format = "qwen3"
    c.rollout.suite = f"harbor:{Path(__file__).resolve().parents[1] / 'suites' / 'pyrepo'}"  # replace with yours
    c.rollout.heldout_fraction = 0.1
    c.rollout.harness = "claude-code"  # its full default request (about 49 KB: system prompt and 12 tools)
    c.rollout.sandbox = "bwrap"
    c.rollout.max_turns = 100
    c.rollout.max_parallel = 64
    c.rollout.timeout_s = 3600.0  # for tasks whose task.toml sets no [agent] timeout_sec
    c.proxy.host = "127.0.0.1"  # harnesses run on this host, reaching the proxy through their sandbox's bridge
    c.eval.split = "heldout"
    c.eval.num_tasks = 32
    c.eval.samples_per_task = 4
    return c
