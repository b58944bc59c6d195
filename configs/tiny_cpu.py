"""Default config: a tiny Qwen3-style agent trained with GSPO on CPU with 2 virtual devices.

Run: python -m gyre_jax.train --config configs/tiny_cpu.py [--config.a.b=value ...]
Two cells of 1 device: each serves rollouts and trains (cell 0, the core, holds the optimizer state);
the scheduling policy (config.schedule.policy) decides when each cell does which. On a 2-core machine more
virtual devices only add per-device overhead; to run multi-device cells (sharded serving and training) on one
host: --config.devices.num_cpu_devices=8 --config.mesh.data=4 --config.mesh.fsdp=2 --config.cells.data=4.

Every key and its default, with a comment saying what it does, is a field of the typed config in
gyre_jax/config/ (``RunConfig`` in run.py; its sections in cluster.py, rollout.py and training.py):
this file is those defaults but one (``serving.warmup``, below). ``python -c "from gyre_jax import config; print(config.default_config())"``
prints them all.
"""

from gyre_jax import config as config_lib


def get_config():
    c = config_lib.default_config()
    # Off here, on by default: compiling every serving shape up front costs this tiny model ~50 program shapes per
    # cell (measured on 2 CPU cores: 40 s a dense cell, 56 s a paged one; 117 s on loaded cores) against the few
    # shapes a short CPU run uses, and the tests run many short trainings from this file (CI on 2 cores). Turn it
    # on (--config.serving.warmup=true) for cells that serve for long.
    c.serving.warmup = False
    return c
