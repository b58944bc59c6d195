"""A recorded event sequence through the simulator's books: at every decision of a ``decisions.jsonl`` (a real
run's, or the simulator's own: ``Simulator(decisions_path=...)``), the ``ClusterState`` the simulator builds
from the same events and the decision a fresh policy object takes on it, compared with what was recorded.

This checks the invariant "a scheduling policy object behaves the same in the simulator and in a real run
on the same event sequence": the books are the simulator's (``SimLedger``, ``CellRoles``; sessions take free
serving slots as the simulator's serving model gives them, counted), the builder is the one both drivers
call (``elastic.state.cluster_state``), and each recorded event is booked as the simulator books it:

- ``step_began``: every cell serving, the policy's initial roles as switches (how a real segment starts);
- ``finished``: an execution of the event's step ends (its slot frees);
- ``switched``: the cell has its target role; ``micro_step_done`` / ``weights_pulled``: the cell is free and
  begins the switch it owed; ``step_trained``: the version moves on and the core begins any switch it owed;
- after each event, waiting sessions take the free slots; after each decision, its switches begin (a busy
  cell owes its switch), its executions are dispatched and take free slots.

What the training side measures is taken from the record, not recomputed (the simulator's training model
needs its cost model): ``time``, ``busy``, ``step_processed``, ``ready``, ``in_flight``. Every other field
(roles, targets, capacity, the waterlevel, version, the step's counts, ``undispatched``, ``due_outstanding``,
``held``) is the simulator's, and a field that differs is a divergence. Scope: one segment starting at step 0,
without partial rollouts or group quorums (the real run has neither).

    python -m gyre_jax.sim.replay WORKDIR      # a run's decisions.jsonl against its config.json; exit 1 on a divergence
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_jax.elastic import events as ev
from gyre_jax.elastic.policies import SchedulingPolicy
from gyre_jax.elastic.state import ClusterState, Role, TrainingFacts, cluster_state, state_dict, state_from_dict
from gyre_jax.sim.cells import CellRoles
from gyre_jax.sim.ledger import SimLedger

MEASURED = ("time", "busy", "step_processed", "ready", "in_flight")  # taken from the record


@dataclass(frozen=True)
class Divergence:
    """Decision ``line`` (0-based) on ``event``: each differing field as (recorded, replayed); ``roles`` and
    ``dispatch`` are the decision's."""

    line: int
    event: ev.Event
    fields: dict[str, tuple[Any, Any]]

    def __str__(self) -> str:
        diffs = ", ".join(
            f"{k}: recorded {a!r}, simulator {b!r}" for k, a, b in ((k, *v) for k, v in self.fields.items())
        )
        return f"decision {self.line} ({self.event.kind} at {self.event.time:.3f}): {diffs}"


class BooksReplay:
    """The simulator's books for a run of ``steps`` steps of ``batch_size`` executions on cells of ``slots``
    serving slots, driven by recorded decisions (``check``) with ``policy`` deciding afresh."""

    def __init__(self, policy: SchedulingPolicy, *, steps: int, batch_size: int, slots: int):
        self.policy = policy
        self.cells = CellRoles([Role.SERVING] * policy.num_cells, policy.name, slots)
        self.ledger = SimLedger(steps, batch_size)
        self.waiting: collections.deque[int] = collections.deque()  # dispatched, no slot yet
        self.running: dict[int, list[int]] = collections.defaultdict(list)  # step -> executions on a slot
        self.lines = 0

    def check(self, line: dict[str, Any]) -> Divergence | None:
        """Books one recorded decision's event, builds the state, decides, carries the decision out; returns
        what differs from the record (None: nothing)."""
        event, recorded = ev.event_from_dict(line["event"]), state_from_dict(line["state"])
        index, self.lines = self.lines, self.lines + 1
        self._book(event)
        self._start_waiting()
        self.cells.busy[:] = recorded.busy or [False] * self.cells.k
        facts = TrainingFacts(recorded.step_processed, recorded.ready, recorded.in_flight)
        state = cluster_state(recorded.time, self.ledger.version, self.cells, self.ledger, facts)
        decision = self.policy.plan(event, state)
        fields = _differences(recorded, state)
        if [r.value for r in decision.roles] != line["roles"]:
            fields["roles"] = (line["roles"], [r.value for r in decision.roles])
        if decision.dispatch != line["dispatch"]:
            fields["dispatch"] = (line["dispatch"], decision.dispatch)
        for c, want in self.cells.switches_to_begin(decision.roles):
            self.cells.begin_switch(c, want)
        for _ in range(min(decision.dispatch, self.ledger.undispatched)):
            self.waiting.append(self.ledger.dispatch())
            self.ledger.wl.dispatched += 1
        self._start_waiting()
        return Divergence(index, event, fields) if fields else None

    def _book(self, event: ev.Event) -> None:
        cells, ledger = self.cells, self.ledger
        if isinstance(event, ev.StepBegan):
            if event.step != 0 or ledger.wl.dispatched:
                raise ValueError(f"the replay covers one segment from step 0; a segment begins at step {event.step}")
            cells.reset([Role.SERVING] * cells.k)
            for c, want in cells.switches_to_begin(self.policy.initial_roles()):
                cells.begin_switch(c, want)
        elif isinstance(event, ev.Finished):
            if not self.running[event.step]:
                raise ValueError(f"an execution of step {event.step} finished but none of that step holds a slot")
            ledger.finished(self.running[event.step].pop())
        elif isinstance(event, ev.Switched):
            cells.end_switch(event.cell)
        elif isinstance(event, (ev.MicroStepDone, ev.WeightsPulled)):
            self._owed_switch(event.cell)
        elif isinstance(event, ev.StepTrained):
            ledger.trained(event.step, event.time)
            self._owed_switch(0)

    def _owed_switch(self, c: int) -> None:
        want = self.cells.take_pending(c)
        if want is not None:
            self.cells.begin_switch(c, want)

    def _start_waiting(self) -> None:
        """Waiting sessions take the free slots of the serving cells (the simulator's serving model, counted)."""
        wl = self.ledger.wl
        free = self.cells.serving_slots() - wl.sessions
        while self.waiting and free > 0:
            i = self.waiting.popleft()
            self.running[self.ledger.step_of(i)].append(i)
            wl.started += 1
            free -= 1


def _differences(recorded: ClusterState, replayed: ClusterState) -> dict[str, tuple[Any, Any]]:
    a, b = state_dict(recorded), state_dict(replayed)
    return {k: (a[k], b[k]) for k in a if k not in MEASURED and a[k] != b[k]}


def replay(
    lines: Iterable[dict[str, Any]], policy: SchedulingPolicy, *, steps: int, batch_size: int, slots: int
) -> list[Divergence]:
    """Every recorded decision through ``BooksReplay``; the divergences (empty: the simulator's books give the
    same states and ``policy`` the same decisions)."""
    books = BooksReplay(policy, steps=steps, batch_size=batch_size, slots=slots)
    return [d for d in (books.check(line) for line in lines) if d is not None]


def read_decisions(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a ``decisions.jsonl``."""
    return [json.loads(x) for x in Path(path).read_text(encoding="utf-8").splitlines() if x.strip()]


def main(argv: list[str] | None = None) -> int:
    from gyre_jax.elastic.policies import make_policy
    from gyre_jax.sim.calibrate import run_sim_config

    ap = argparse.ArgumentParser(prog="python -m gyre_jax.sim.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("workdir", help="a run directory (config.json and decisions.jsonl)")
    ap.add_argument("--show", type=int, default=5, help="divergences to print")
    args = ap.parse_args(argv)
    path = Path(args.workdir) / "decisions.jsonl"
    if not path.is_file():
        print(f"error: {path} not found (a run writes decisions.jsonl in its workdir)", file=sys.stderr)
        return 2
    cfg = run_sim_config(args.workdir)
    policy = make_policy(cfg.policy, cfg.num_cells, **dict(cfg.policy_options))
    lines = read_decisions(path)
    out = replay(lines, policy, steps=cfg.steps, batch_size=cfg.batch_size, slots=cfg.slots_per_cell)
    for d in out[: args.show]:
        print(d)
    print(f"{len(lines)} decisions, {len(out)} diverge from the simulator's books")
    return 1 if out else 0


if __name__ == "__main__":
    raise SystemExit(main())
