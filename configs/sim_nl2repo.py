"""Simulator preset: nl2repo (the numbers and their sources are in gyre_jax/sim/presets.py).

Run: python -m gyre_jax.sim --config configs/sim_nl2repo.py [--config.schedule.policy=async ...]
"""

from gyre_jax.sim.presets import nl2repo


def get_config():
    return nl2repo()
