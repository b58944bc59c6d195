"""Simulator preset: terminal (the numbers and their sources are in gyre_jax/sim/presets.py).

Run: python -m gyre_jax.sim --config configs/sim_terminal.py [--config.schedule.policy=async ...]
"""

from gyre_jax.sim.presets import terminal


def get_config():
    return terminal()
