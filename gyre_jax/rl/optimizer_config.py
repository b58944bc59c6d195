"""The optimizer's frozen config (``OptimizerConfig``) and its learning-rate schedules' names.

Kept apart from ``learner.py`` (which builds the optax chain from it) so that the run config
(``gyre_jax.config``, whose ``optimizer`` section is an ``OptimizerConfig``) loads without JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm clipping. Learning rate: linear warmup over ``warmup_steps``, then
    ``schedule``: ``constant``, or ``cosine`` / ``linear`` decay to ``learning_rate * min_lr_ratio`` over
    the next ``decay_steps`` optimizer steps (constant afterwards)."""

    learning_rate: float
    warmup_steps: int = 0
    b1: float = 0.9
    b2: float = 0.99
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    schedule: str = "constant"
    decay_steps: int = 0
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optimizer schedule {self.schedule!r} must be one of {SCHEDULES}")
        if self.schedule != "constant" and self.decay_steps < 1:
            raise ValueError(f"optimizer schedule {self.schedule!r} needs decay_steps >= 1 (got {self.decay_steps})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optimizer min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
