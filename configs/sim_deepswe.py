"""Simulator preset: deepswe (the numbers and their sources are in gyre_jax/sim/presets.py).

Run: python -m gyre_jax.sim --config configs/sim_deepswe.py [--config.schedule.policy=async ...]
"""

from gyre_jax.sim.presets import deepswe


def get_config():
    return deepswe()
