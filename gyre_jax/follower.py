"""A follower process of a multi-process run (``jax.process_index() > 0``; docs/multihost.md).

It takes part in the run's collective start (the model's initialization or checkpoint load, the warm start
and publishing the params to the cells: programs over every process's devices, in the same order as the
leader), then serves its own cells as process 0's controller directs (``runtime.host.CellHost``) until
the leader stops it. It builds no proxy, executor, pipeline or trainer.
"""

from __future__ import annotations

import logging
import threading

import jax

from gyre_jax import build, runtime
from gyre_jax.rollout.suites import TaskSuite
from gyre_jax.runtime.host import CellHost, HostedCell
from gyre_jax.runtime.local import LocalCell

log = logging.getLogger("gyre_jax")


def follow(config, suite: TaskSuite) -> int:
    """Runs this follower process's part of the run described by ``config`` (``suite``: its task suite, for the
    warm start's demonstrations); returns the exit status."""
    s = build.setup(config)
    latest = runtime.broadcast_decision(None)["latest"]  # the leader's: whether the warm start runs
    if latest is None:
        params = s.params
        if config.warm_start.steps > 0:
            params = build.warm_start(s, suite, threading.Event())
        build.core_params(s, params)
    s.params = None
    factory = build.CellFactory(s, config.loss_config())
    layouts = {cell.index: factory.layout(cell) for cell in s.cells}
    mine = {  # each serves from the leader's first SetWeights on (``LocalCell.serve``)
        cell.index: HostedCell(
            LocalCell(cell, layouts[cell.index], None, factory.worker(cell), lambda p, v, c=cell: factory.loop(c, p, v))
        )
        for cell in s.cells
        if cell.processes == (s.process,)
    }
    core_abstract = build.abstract_params(s, layouts[0].param_shardings)
    host = CellHost(runtime.runtime().client, s.process, mine, layouts, core_abstract)
    log.info("process %d follows process 0 with %s", s.process, ", ".join(c.name for c in mine.values()))
    host.serve()
    jax.effects_barrier()
    return 0
