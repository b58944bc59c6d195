"""The supervised warm start (``build.warm_start``): ``warm_start.target_loss`` stops it once the mean loss of
its last 25 steps reaches the target, and ``steps`` caps it."""

import logging
import threading

import jax
import numpy as np

from gyre_jax import build
from gyre_jax.config import load_config

SMALL = ["--config.model.num_layers=1", "--config.model.embed_dim=32", "--config.model.mlp_dim=64",
         "--config.model.head_dim=8", "--config.model.num_heads=4", "--config.model.num_kv_heads=2",
         "--config.warm_start.batch_size=2", "--config.warm_start.warmup_steps=5"]  # fmt: skip


def _warm(overrides: list[str], caplog):
    config = load_config([*SMALL, *overrides])
    s = build.setup(config)
    initial = jax.tree.map(np.asarray, s.params)  # the warm start donates s.params
    done = []
    with caplog.at_level(logging.INFO, logger="gyre_jax"):
        caplog.clear()
        params = build.warm_start(s, build.make_suite(config), threading.Event(), on_done=lambda *a: done.append(a))
    return initial, params, done


def test_the_warm_start_stops_at_its_target_loss_and_otherwise_runs_every_step(caplog):
    # a target every loss meets: the first check with 25 losses to average (step 25) stops it
    initial, params, done = _warm(["--config.warm_start.steps=200", "--config.warm_start.target_loss=100"], caplog)
    [(steps, loss)] = done
    assert steps == 25 and 0 < loss <= 100
    assert "reached warm_start.target_loss=100 at step 25" in caplog.text
    assert "warm start: 25 steps in" in caplog.text
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool((np.asarray(a) != b).any()), params, initial))
    assert any(moved)  # it trained
    # a target no loss meets: every step runs, and the log says which key to raise
    _, _, done = _warm(["--config.warm_start.steps=30", "--config.warm_start.target_loss=1e-9"], caplog)
    [(steps, loss)] = done
    assert steps == 30 and loss > 1e-9
    assert "warm_start.target_loss=1e-09 not reached in warm_start.steps=30" in caplog.text
    # no target (0: off; the default config has one): every step, and no target message
    _, _, done = _warm(["--config.warm_start.steps=27", "--config.warm_start.target_loss=0"], caplog)
    assert [d[0] for d in done] == [27] and "target_loss" not in caplog.text
