"""Simulator preset: tiny (the numbers and their sources are in gyre_jax/sim/presets.py).

Run: python -m gyre_jax.sim --config configs/sim_tiny.py [--config.schedule.policy=async ...]
"""

from gyre_jax.sim.presets import tiny


def get_config():
    return tiny()
