"""Per-token staleness, partial rollouts and admission by duration history, for one simulated run.

``VersionBooks`` keeps what the issue-21 mechanisms add to the rollout's books (``ledger.py``):

- per-token staleness: each trained step's oldest token and token-weighted mean, from the versions the
  serving model recorded per segment (``ServingModel.ver0``, ``tok_v``, ``tok_n``);
- partial rollouts: a completed group is assigned to the step being filled (``SimLedger.assign``), the group
  it displaces carries on into a later step, and executions whose oldest token is beyond the drop bound
  are dropped: no training work; their slot time (in the steps trained) is counted as wasted, not busy;
- group quorum: executions aborted when their group's quorum ended without them train nothing; their slot
  time (in the steps trained) is counted as wasted, apart from the drops';
- admission by history: every ended execution's duration is recorded per task
  (``policies.DurationHistory``); with ``admission="longest_first"`` a step's executions are dispatched
  in the order of their tasks' predicted durations, longest first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from gyre_jax.elastic.policies import DurationHistory
from gyre_jax.sim.events import EVAL
from gyre_jax.sim.ledger import SimLedger
from gyre_jax.sim.serving_model import ServingModel
from gyre_jax.sim.training_model import TrainingModel
from gyre_jax.sim.workload import task_ids

if TYPE_CHECKING:
    from gyre_jax.sim.simulator import SimConfig


class VersionBooks:
    """The run ``config``'s per-token staleness, partial-rollout assignments and duration history."""

    def __init__(self, config: SimConfig, ledger: SimLedger, serving: ServingModel, training: TrainingModel):
        self.cfg, self.ledger, self.serving, self.training = config, ledger, serving, training
        self.history = DurationHistory()
        self.per_step: list[tuple[int, float]] = []  # per trained step: (max, mean) per-token staleness
        self.wasted = 0.0  # cell-seconds of slots held by the dropped or aborted executions of the steps trained
        self.aborted_s = 0.0  # the aborted executions' share of ``wasted``
        # at each step's end: (time, busy cell-seconds so far) for the steady-state busy fraction
        self.busy_at_step_end: list[tuple[float, float]] = []
        if config.admission == "longest_first":
            ledger.order = self.admission_order

    def task_of(self, i: int) -> int:
        """The dataset task of execution ``i``."""
        cfg = self.cfg
        step, j = divmod(i, cfg.batch_size)
        task = step * cfg.tasks_per_step + j // cfg.group_size
        return task % cfg.workload.task_pool if cfg.workload.task_pool else task

    def ended(self, i: int, group_done: bool, aborted: bool = False) -> None:
        """Execution ``i``'s harness ended (its slot time is in ``serving.slot_s``); ``group_done``: its group is
        complete; ``aborted``: by its group's quorum (its duration is cut short: not recorded in the history)."""
        if not aborted:
            self.history.record(self.task_of(i), self.serving.slot_s[i])
        if group_done and self.cfg.partial_rollouts:
            self.assign(i // self.cfg.group_size)

    def abort(self, j: int) -> bool:
        """Execution ``j``'s group reached its quorum without it: it ends now (one not dispatched yet ends at its
        dispatch: ``end_aborted``, called by the driver). True if it had started (its session ended now)."""
        if not self.ledger.was_dispatched[j]:
            self.ledger.aborted[j] = True
            return False
        had_slot = self.serving.abort(j)
        self.end_aborted(j, had_slot)
        return had_slot

    def end_aborted(self, j: int, had_slot: bool) -> None:
        """Aborted execution ``j`` ends: it trains nothing, and its (empty) data counts as evaluated at once;
        ``had_slot``: it had started (else it counts as started now: it no longer waits for a slot)."""
        if not had_slot:
            self.ledger.wl.started += 1
        group_done = self.ledger.finished(j, aborted=True)
        self.training.exec_work[j] = 0.0
        self.serving.clock.push(self.serving.clock.now, EVAL, j)
        self.ended(j, group_done, aborted=True)

    def admission_order(self, step: int) -> list[int]:
        """Positions of step ``step``'s executions in dispatch order: its tasks, longest predicted first."""
        g = self.cfg.group_size
        ids = task_ids(self.cfg.workload, step, self.cfg.tasks_per_step).tolist()
        return [t * g + m for t in self.history.order(ids) for m in range(g)]

    def assign(self, group: int) -> None:
        """Partial rollouts: a completed group trains in the step being filled; the group it displaces (the
        youngest incomplete one of that step) carries on into the completed group's old step. Executions
        whose oldest token is beyond the drop bound for that step are dropped."""
        ledger, g = self.ledger, self.cfg.group_size
        step, other, old = ledger.assign(group)
        if other >= 0:
            for i in range(group * g, (group + 1) * g):
                self.training.move(i, old, step)
            for i in range(other * g, (other + 1) * g):
                self.training.move(i, step, old)
        for i in ledger.drop_stale(group, step, self.serving.ver0):
            self.training.drop(i)

    def step_trained(self, v: int) -> None:
        """Records step ``v``'s per-token staleness: the max over its executions' oldest tokens, and the
        token-weighted mean (dropped and aborted executions excluded: their slot time is wasted)."""
        sv, ledger, oldest, n_tok, v_tok = self.serving, self.ledger, 0, 0.0, 0.0
        for i in ledger.members(v):
            if not ledger.trains(i):
                w = sv.slot_s[i] / self.cfg.slots_per_cell
                self.wasted += w
                if ledger.aborted[i]:
                    self.aborted_s += w
                continue
            oldest = max(oldest, v - sv.ver0[i])
            n_tok += sv.tok_n[i]
            v_tok += sv.tok_v[i]
        self.per_step.append((oldest, v - v_tok / n_tok if n_tok > 0 else 0.0))

    def dropped(self) -> list[int]:
        """The executions dropped from the steps trained so far."""
        ledger = self.ledger
        return [i for v in range(len(ledger.step_end)) for i in ledger.members(v) if ledger.dropped[i]]

    def wasted_s(self) -> float:
        """Cell-seconds of serving slots the dropped or aborted executions of the trained steps held."""
        return self.wasted

    def step_ended(self, now: float, training_busy_s: float) -> None:
        """Notes the busy cell-seconds (serving slots up to ``now``, ``training_busy_s``, less waste) at a step end."""
        sv = self.serving
        for c in range(self.cfg.num_cells):
            sv.touch(c)
        self.busy_at_step_end.append((now, sv.busy_s() + training_busy_s - self.wasted))

    def steady_busy(self) -> dict[str, Any]:
        """The busy fraction between the ends of step 1 and step ``steps - 4`` (whole run if under 8 steps): no
        warm-up, and no end where runs differ in how much they may still dispatch (partial rollouts dispatch
        past the last step, a fixed batch per step does not)."""
        marks, k = self.busy_at_step_end, self.cfg.num_cells
        a, b = (1, self.cfg.steps - 4) if self.cfg.steps >= 8 and len(marks) >= self.cfg.steps - 3 else (None, None)
        if a is None:
            return {"busy_fraction": None, "steps": None}
        (t0, b0), (t1, b1) = marks[a], marks[b]
        return {"busy_fraction": (b1 - b0) / (k * (t1 - t0)), "steps": [a + 1, b]}

    def result(self, cell_time: float) -> dict[str, Any]:
        """The ``SimResult`` fields ``token_staleness`` and ``partial``."""
        ledger = self.ledger
        dropped = len(self.dropped())
        trained = [i for v in range(len(ledger.step_end)) for i in ledger.members(v)]
        aborted = sum(ledger.aborted[i] for i in trained)
        tok = self.per_step or [(0, 0.0)]
        return {
            "steady": self.steady_busy(),
            "token_staleness": {
                "max": int(max(m for m, _ in tok)),
                "mean": float(np.mean([x for _, x in tok])),
                "per_step": [[int(m), float(x)] for m, x in tok],
            },
            "partial": {
                "carried_groups": ledger.swaps,
                "dropped": dropped,
                "dropped_fraction": dropped / (self.cfg.steps * self.cfg.batch_size),
                "wasted_fraction": self.wasted_s() / cell_time,
                "aborted": aborted,
                "aborted_fraction": aborted / (self.cfg.steps * self.cfg.batch_size),
                "aborted_wasted_fraction": self.aborted_s / cell_time,
            },
        }
