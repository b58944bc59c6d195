"""A follower process of a multi-process run (``jax.process_index() > 0``; docs/multihost.md).

It takes part in the run's collective start (the model's initialization or checkpoint load, the warm start
and publishing the params to the cells: programs over every process's devices, in the same order as the
leader), then either drives its cells (the first process of each: ``runtime.host.CellHost`` serves them as
process 0's controller directs) or, as another process of a cell over several hosts, replays every device call
of that cell's driver (``runtime.lockstep.Replayer``), until the run ends. It builds no proxy, executor,
pipeline or trainer.
"""

from __future__ import annotations

import logging
import threading

import jax

from gyre_jax import build, runtime
from gyre_jax import config as config_lib
from gyre_jax.rl.learner import Learner
from gyre_jax.rollout.suites import TaskSuite
from gyre_jax.runtime.cells import Cell
from gyre_jax.runtime.host import CellHost, HostedCell
from gyre_jax.runtime.local import LocalCell
from gyre_jax.runtime.lockstep import Replayer

log = logging.getLogger("gyre_jax")


def follow(config, suite: TaskSuite) -> int:
    """Runs this follower process's part of the run described by ``config`` (``suite``: its task suite, for the
    warm start's demonstrations); returns the exit status."""
    s = build.setup(config)
    objects = {}  # what this process holds for the driver of its cell, if it is not its first process
    if s.process in s.cells[0].processes[1:]:  # the core over several processes: its checkpoints, as the leader's
        directory = config_lib.resolve_workdir(config) / "checkpoints"
        objects["checkpointer/checkpoints"] = build.core_checkpointer(s, directory, config.keep_checkpoints)
    latest = runtime.broadcast_decision(None)["latest"]  # the leader's: whether the warm start runs
    core = None
    if latest is None:
        params = s.params
        if config.warm_start.steps > 0:
            params = build.warm_start(s, suite, threading.Event())
        core = build.core_params(s, params)
    s.params = None
    factory = build.CellFactory(s, config.loss_config())
    replaying = [cell for cell in s.cells if s.process in cell.processes[1:]]
    if replaying:  # a cell over several processes, driven by another: replay its driver's calls
        return _replay(s, config, factory, replaying[0], core, objects)
    layouts = {cell.index: factory.layout(cell) for cell in s.cells}
    mine = {  # each serves from the leader's first SetWeights on (``LocalCell.serve``)
        cell.index: HostedCell(
            LocalCell(cell, layouts[cell.index], None, factory.worker(cell), lambda p, v, c=cell: factory.loop(c, p, v))
        )
        for cell in s.cells
        if cell.processes[0] == s.process
    }
    core_abstract = build.abstract_params(s, layouts[0].param_shardings)
    host = CellHost(runtime.runtime().client, s.process, mine, layouts, core_abstract)
    log.info("process %d follows process 0 with %s", s.process, ", ".join(c.name for c in mine.values()))
    host.serve()
    jax.effects_barrier()
    return 0


def _replay(s: build.Setup, config, factory: build.CellFactory, cell: Cell, core, objects: dict) -> int:
    """This process's part of ``cell`` (driven by its first process): the objects its driver's calls name, then
    every call in the driver's order until it stops."""
    objects.update({c.name: c for c in s.cells})
    objects["factory"] = factory
    objects[f"worker/{cell.name}"] = factory.worker(cell)
    if cell.index == 0:  # the core: its learner, built as the leader builds its own (build.core_learner)
        args = (s.model_cfg, s.graphdef, cell.mesh, s.rules, config.optimizer)
        objects["learner"] = Learner(*args, loss_cfg=config.loss_config())
    replayer = Replayer(runtime.runtime().client, cell, s.process, objects)
    if core is not None and cell.index == 0:
        replayer.adopt("core", core)
    log.info("process %d runs %s in lockstep with process %d (its driver)", s.process, cell.name, cell.processes[0])
    replayer.run()
    log.info("process %d: %s done after %d lockstep calls", s.process, cell.name, replayer.calls)
    jax.effects_barrier()
    return 0
