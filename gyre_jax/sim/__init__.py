"""Discrete-event cluster simulator: the real scheduling policies (``gyre_jax.elastic.policies``) on a
cost model of serving, training and role switches, with workload presets shaped from published runs."""
