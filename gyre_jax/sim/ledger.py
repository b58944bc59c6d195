"""The simulated rollout's books, the facts the policy decides from (the simulator's counterpart of the real
controller's ``elastic.ledger.RolloutLedger``): the waterlevel, executions dispatched and finished per step,
the due ones outstanding, the policy version and the staleness each execution was trained at.

Executions have a global index ``i`` in dispatch (task) order: step ``i // batch_size``.
"""

from __future__ import annotations

from gyre_jax.elastic.policies import ClusterState, Waterlevel
from gyre_jax.sim.cells import CellRoles


class SimLedger:
    """Books of a run of ``steps`` steps of ``batch_size`` executions on ``cells`` of ``slots`` serving slots,
    and the ``ClusterState`` the policy reads them from (``observe``)."""

    def __init__(self, steps: int, batch_size: int, cells: CellRoles, slots: int):
        self.steps, self.n = steps, batch_size
        self.total = steps * batch_size
        self.wl = Waterlevel()
        self.next_exec = 0
        self.dispatch_ver = [0] * self.total  # policy version each execution was dispatched under
        self.disp_count = [0] * steps
        self.fin_count = [0] * steps
        self.version = 0  # optimizer steps applied
        self.due_out = 0  # executions of steps <= version dispatched and not finished
        self.step_end: list[float] = []  # when each step's optimizer step ended
        self.staleness: list[int] = []  # per trained execution: versions between its dispatch and its step
        self.state = ClusterState(
            time=0.0,
            roles=cells.role,
            capacity=[slots] * cells.k,
            waterlevel=self.wl,
            targets=cells.target,
            busy=cells.busy,
            batch_size=batch_size,
        )

    def dispatch(self) -> int:
        """The next execution in task order is dispatched under the current version; returns its index."""
        i = self.next_exec
        self.next_exec += 1
        step = i // self.n
        self.disp_count[step] += 1
        if step <= self.version:
            self.due_out += 1
        self.dispatch_ver[i] = self.version
        return i

    def finished(self, i: int) -> None:
        """Execution ``i``'s harness ended."""
        step = i // self.n
        self.fin_count[step] += 1
        if step <= self.version:
            self.due_out -= 1
        self.wl.finished += 1

    def trained(self, v: int, now: float) -> None:
        """Step ``v``'s optimizer step ended at ``now``: the policy version is ``v + 1``."""
        for i in range(v * self.n, (v + 1) * self.n):
            self.staleness.append(v - self.dispatch_ver[i])
        self.version = v + 1
        if self.version < self.steps:
            self.due_out += self.disp_count[self.version] - self.fin_count[self.version]
        self.step_end.append(now)

    def observe(self, now: float, held: int, processed: int, ready: int, in_flight: int) -> ClusterState:
        """The policy's state with the books written in; ``held``: sessions waiting to get a slot back;
        ``processed``, ``ready``, ``in_flight``: step ``version``'s executions queued for training, micro-steps
        ready to claim and micro-steps running (0 once every step is trained)."""
        st, v = self.state, self.version
        st.time = now
        st.version = v
        st.undispatched = self.total - self.next_exec
        st.due_outstanding = self.due_out
        st.held = held
        if v < self.steps:
            st.step_dispatched = self.disp_count[v]
            st.step_finished = self.fin_count[v]
        else:
            st.step_dispatched = st.step_finished = 0
        st.step_processed, st.ready, st.in_flight = processed, ready, in_flight
        return st
