"""gyre-jax: reinforcement learning of LLM agents on extremely long-horizon tasks, in JAX."""

__version__ = "0.1.0"
