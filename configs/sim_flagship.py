"""Simulator preset: flagship (the numbers and their sources are in gyre_jax/sim/presets.py).

Run: python -m gyre_jax.sim --config configs/sim_flagship.py [--config.schedule.policy=async ...]
"""

from gyre_jax.sim.presets import flagship


def get_config():
    return flagship()
