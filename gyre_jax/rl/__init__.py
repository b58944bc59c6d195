"""RL: losses, advantages and the learner."""
