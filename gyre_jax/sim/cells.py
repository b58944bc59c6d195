"""The cells of a simulated run as the scheduler sees them: each cell's role (SERVING, TRAINING, or SWITCHING
to a target), whether it is busy (a micro-step, the optimizer step or a weight pull), the switch a busy cell
owes, the weight version a training cell holds, and the time each cell spent per role.

Per-cell lists are shared with the policy's ``ClusterState`` (``roles``, ``targets``, ``busy``) and with the
serving and training models: they are updated in place, never replaced.
"""

from __future__ import annotations

from collections.abc import Iterator

from gyre_jax.elastic.policies import Role

SERVING, TRAINING, SWITCHING = Role.SERVING, Role.TRAINING, Role.SWITCHING
ROLE_NAMES = ("serving", "training", "switching")


class CellRoles:
    """Roles and switches of ``len(roles)`` cells (cell 0 is the core), starting in ``roles``."""

    def __init__(self, roles: list[Role], policy: str):
        k = len(roles)
        self.k = k
        self.policy = policy  # named in errors
        self.role: list[Role] = list(roles)
        self.target: list[Role | None] = [None] * k
        self.busy = [False] * k
        self.pending_switch: list[Role | None] = [None] * k
        self.any_pending = False
        self.wver = [0] * k  # weight version held by a training cell
        self.switch_tok = [0] * k  # token of the cell's latest micro-step, switch or pull event
        self.role_since = [0.0] * k
        self.role_time = [dict.fromkeys(ROLE_NAMES, 0.0) for _ in range(k)]
        self.switch_count = {"serving_to_training": 0, "training_to_serving": 0, "migrations": 0, "waited": 0}

    def switches_to_begin(self, wanted: list[Role]) -> Iterator[tuple[int, Role]]:
        """The switches to begin now (cell, role) for the roles a policy wants, in cell order; a busy cell
        owes its switch until it is free (``take_pending``), a switching cell finishes its switch first."""
        if len(wanted) != self.k:
            raise RuntimeError(f"policy {self.policy} returned {len(wanted)} roles for {self.k} cells")
        role, busy, pending = self.role, self.busy, self.pending_switch
        if wanted == role and not self.any_pending:
            return
        self.any_pending = False
        for c in range(self.k):
            want, cur = wanted[c], role[c]
            if cur is SWITCHING:
                continue
            if want is cur:
                pending[c] = None
                continue
            if want is not SERVING and want is not TRAINING:
                raise RuntimeError(f"policy {self.policy} asked cell {c} for role {want!r} (SERVING or TRAINING only)")
            if busy[c]:
                pending[c] = want  # finishes its micro-step / weight pull first
                self.any_pending = True
                continue
            yield c, want

    def take_pending(self, c: int) -> Role | None:
        """The switch cell ``c`` owes (None if none), now no longer owed."""
        want = self.pending_switch[c]
        self.pending_switch[c] = None
        return want

    def account(self, c: int, now: float) -> None:
        """Adds the time since the cell's last role change (or last account) to its current role."""
        self.role_time[c][self.role[c].value] += now - self.role_since[c]
        self.role_since[c] = now

    def begin_switch(self, c: int, want: Role, now: float) -> Role:
        """Cell ``c`` starts switching to ``want``; returns the role it leaves."""
        old = self.role[c]
        self.account(c, now)
        self.role[c] = SWITCHING
        self.target[c] = want
        self.switch_count["serving_to_training" if old is SERVING else "training_to_serving"] += 1
        return old

    def end_switch(self, c: int, now: float) -> Role:
        """Cell ``c`` has its new role; returns it."""
        self.account(c, now)
        want = self.target[c]
        self.role[c] = want
        self.target[c] = None
        return want

    def fractions(self, cell_time: float) -> dict[str, float]:
        """Cell-time per role, as shares of ``cell_time``."""
        return {name: float(sum(t[name] for t in self.role_time) / cell_time) for name in ROLE_NAMES}

    def text(self) -> str:
        return " ".join(f"{c}:{r.value[:5]}" for c, r in enumerate(self.role))
