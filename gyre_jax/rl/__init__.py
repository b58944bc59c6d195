"""RL: objectives (GSPO, GSPO-token, GRPO, k3 KL), group advantages, staleness, what a step trains on, and the
learner: jitted micro-steps on any cell, the streaming micro-step queue, exact gradient accumulation, AdamW.
See docs/learner.md."""
