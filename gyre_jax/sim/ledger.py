"""The simulated rollout's books, the facts the policy decides from (the simulator's counterpart of the real
controller's ``elastic.ledger.RolloutLedger``): the waterlevel, executions dispatched and finished per step,
the due ones outstanding, the policy version and the staleness each execution was trained at.

Executions have a global index ``i`` in dispatch (task) order; execution ``i`` is in group ``i // G``. A group
carries a *label*: the step it trains in. Without partial rollouts the label is fixed, ``i // batch_size``.
With partial rollouts (``assign``) a step trains the first ``tasks`` groups to complete: a group that
completes while the step being filled still lacks groups swaps labels with the youngest incomplete group
of that step, which carries on (its sessions keep running across the weight updates) into the completing
group's later step. Per-token staleness: every segment's tokens carry the version that produced them
(``ServingModel.tok_v``); an execution whose oldest token is more than ``drop_bound`` versions behind the
step it is assigned to is dropped (no training work; its slot time is counted as wasted).

Group quorum (``quorum`` < G): once ``quorum`` of a group's executions have ended, the group is complete; the
simulator aborts its other members (``abort``), which count as ended (the waterlevel's f) but train nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from gyre_jax.elastic.state import Waterlevel


class SimLedger:
    """Books of a run of ``steps`` steps of ``batch_size`` executions (groups of ``group_size``): the
    ``elastic.state.RolloutBooks`` the policy's state is built from (``state.cluster_state``, as in the real
    controller). ``pool_steps`` (>= steps) batches of executions may be dispatched (partial rollouts
    dispatch past the last step)."""

    def __init__(
        self,
        steps: int,
        batch_size: int,
        group_size: int = 1,
        pool_steps: int | None = None,
        drop_bound: int | None = None,
        order: Callable[[int], list[int]] | None = None,
        quorum: int = 0,
    ):
        self.steps, self.n, self.g = steps, batch_size, group_size
        self.batch_size = batch_size
        self.pool_steps = max(steps, pool_steps or steps)
        self.total = self.pool_steps * batch_size
        self.drop_bound = drop_bound
        self.quorum = quorum if 0 < quorum < group_size else group_size  # ended members that complete a group
        # admission order: order(step) -> positions of the step's executions in the order they are dispatched
        # (asked once, when the step's first execution is dispatched); None: task order
        self.order = order
        self._step_order: list[int] | None = None
        self.was_dispatched = [False] * self.total
        self.wl = Waterlevel()
        self.next_exec = 0
        self.dispatch_ver = [0] * self.total  # policy version each execution was dispatched under
        self.disp_count = [0] * self.pool_steps  # per label
        self.fin_count = [0] * self.pool_steps
        self.version = 0  # optimizer steps applied
        self.due_out = 0  # executions of steps <= version dispatched and not finished
        self.step_end: list[float] = []  # when each step's optimizer step ended
        self.staleness: list[int] = []  # per trained execution: versions between its dispatch and its step
        # groups and their labels (partial rollouts move them)
        groups = self.total // group_size
        self.per_step = batch_size // group_size  # groups per step
        self.label = [gi // self.per_step for gi in range(groups)]
        self.grp_fin = [0] * groups  # members ended (aborted ones included)
        self.grp_ended = [0] * groups  # members whose harness ended by itself (finished or timed out)
        self.aborted = [False] * self.total  # ended by the group quorum: trains nothing
        self.finished_flag = [False] * self.total
        self.dropped = [False] * self.total
        self.complete = [0] * self.pool_steps  # complete groups assigned to each step
        self.assigned: list[list[int]] = [[] for _ in range(self.pool_steps)]
        self.filling = 0  # the lowest step still short of complete groups
        self.open: list[list[int]] = [[] for _ in range(self.pool_steps)]  # heaps of -group, lazily cleaned
        for gi in range(groups):
            self.open[self.label[gi]].append(-gi)
        for h in self.open:
            heapq.heapify(h)
        self.swaps = 0

    def step_of(self, i: int) -> int:
        """The step execution ``i`` trains in (its group's label)."""
        return self.label[i // self.g]

    def dispatch(self) -> int:
        """The next execution in task order is dispatched under the current version; returns its index."""
        k, pos = divmod(self.next_exec, self.n)
        self.next_exec += 1
        if self.order is None:
            i = k * self.n + pos
        else:
            if pos == 0:
                self._step_order = self.order(k)
            i = k * self.n + self._step_order[pos]
        self.was_dispatched[i] = True
        step = self.label[i // self.g]
        self.disp_count[step] += 1
        if step <= self.version:
            self.due_out += 1
        self.dispatch_ver[i] = self.version
        return i

    def finished(self, i: int, aborted: bool = False) -> bool:
        """Execution ``i``'s harness ended (``aborted``: by the group quorum); True if that completed its group."""
        gi = i // self.g
        if aborted:
            self.aborted[i] = True
        else:
            self.grp_ended[gi] += 1
        step = self.label[gi]
        self.fin_count[step] += 1
        if step <= self.version:
            self.due_out -= 1
        self.wl.finished += 1
        self.finished_flag[i] = True
        self.grp_fin[gi] += 1
        return self.grp_fin[gi] == self.g

    def quorum_reached(self, i: int) -> list[int]:
        """After execution ``i`` ended by itself: the members of its group to abort now (the group's
        ``quorum``-th member just ended), else []."""
        gi = i // self.g
        if self.quorum == self.g or self.grp_ended[gi] != self.quorum:
            return []
        return [j for j in range(gi * self.g, (gi + 1) * self.g) if not self.finished_flag[j]]

    def trains(self, i: int) -> bool:
        """Execution ``i`` is in its step's training data (neither dropped nor aborted)."""
        return not (self.dropped[i] or self.aborted[i])

    # -- partial rollouts: a step trains the first groups to complete -------------------------------
    def assign(self, gi: int) -> tuple[int, int, int]:
        """Group ``gi`` completed: it trains in the step being filled. Returns (step, swapped group or -1,
        the label the swapped group had and ``gi`` now has)."""
        s, old = self.filling, self.label[gi]
        other = -1
        if old != s:
            h = self.open[s]
            while h and (self.label[-h[0]] != s or self.grp_fin[-h[0]] == self.g):
                heapq.heappop(h)  # stale: relabelled or complete
            if not h:
                raise RuntimeError(f"partial rollouts: step {s} has no incomplete group to trade with group {gi}")
            other = -heapq.heappop(h)
            self._relabel(other, s, old)
            self._relabel(gi, old, s)
            heapq.heappush(self.open[old], -other)
            self.swaps += 1
        self.complete[s] += 1
        self.assigned[s].append(gi)
        while self.filling < self.pool_steps and self.complete[self.filling] == self.per_step:
            self.filling += 1
        return s, other, old

    def _relabel(self, gi: int, old: int, new: int) -> None:
        """Moves group ``gi``'s counts from step ``old`` to step ``new``."""
        self.label[gi] = new
        v = self.version
        for i in range(gi * self.g, (gi + 1) * self.g):
            if not self.was_dispatched[i]:
                continue  # not dispatched: counted under its label when it is
            self.disp_count[old] -= 1
            self.disp_count[new] += 1
            if self.finished_flag[i]:
                self.fin_count[old] -= 1
                self.fin_count[new] += 1
            else:
                self.due_out += (new <= v) - (old <= v)

    def drop_stale(self, gi: int, step: int, oldest_version: list[int]) -> list[int]:
        """Marks group ``gi``'s executions whose oldest token (``oldest_version[i]``) is more than the drop bound
        behind ``step`` as dropped; returns them."""
        if self.drop_bound is None:
            return []
        out = [
            i
            for i in range(gi * self.g, (gi + 1) * self.g)
            if not self.aborted[i] and step - oldest_version[i] > self.drop_bound
        ]
        for i in out:
            self.dropped[i] = True
        return out

    def members(self, v: int) -> range | list[int]:
        """The executions step ``v`` trains (in group order)."""
        if self.assigned[v]:
            return [i for gi in sorted(self.assigned[v]) for i in range(gi * self.g, (gi + 1) * self.g)]
        return range(v * self.n, (v + 1) * self.n)

    def trained(self, v: int, now: float) -> None:
        """Step ``v``'s optimizer step ended at ``now``: the policy version is ``v + 1``."""
        for i in self.members(v):
            if self.trains(i):
                self.staleness.append(v - self.dispatch_ver[i])
        self.version = v + 1
        if self.version < self.pool_steps:
            self.due_out += self.disp_count[self.version] - self.fin_count[self.version]
        self.step_end.append(now)

    # -- the books a policy's state is built from (``elastic.state.RolloutBooks``) --------------------
    @property
    def undispatched(self) -> int:
        return self.total - self.next_exec

    def step_counts(self, step: int) -> tuple[int, int]:
        """(dispatched, finished) executions of ``step`` (zeros past the last step)."""
        return (self.disp_count[step], self.fin_count[step]) if step < self.steps else (0, 0)

    def due_outstanding(self, version: int) -> int:
        """Executions of steps <= ``version`` (the current one) dispatched and not finished."""
        if version != self.version:
            raise ValueError(f"the books are at version {self.version}, not {version}")
        return self.due_out
