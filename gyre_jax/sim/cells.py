"""The cells of a simulated run as the scheduler sees them (``elastic.state.Cells``, the real controller's
class: each cell's role, SERVING, TRAINING or SWITCHING to a target, whether it is busy, a micro-step, the
optimizer step or a weight pull, and the switch a busy cell owes), plus what only the simulator keeps: the
weight version a training cell holds, the token of its latest timed event and the time each cell spent
per role.

The per-cell lists (``role``, ``target``, ``busy``) are shared with the serving and training models: they
are updated in place, never replaced.
"""

from __future__ import annotations

from gyre_jax.elastic.state import Cells, Role

SERVING, TRAINING, SWITCHING = Role.SERVING, Role.TRAINING, Role.SWITCHING
ROLE_NAMES = ("serving", "training", "switching")


class CellRoles(Cells):
    """Roles and switches of ``len(roles)`` cells of ``slots`` serving slots each (cell 0 is the core),
    starting in ``roles``; ``policy`` is named in errors."""

    def __init__(self, roles: list[Role], policy: str, slots: int = 0):
        super().__init__(roles, [slots] * len(roles), owner=f"policy {policy}")
        k = self.k
        self.policy = policy
        self.wver = [0] * k  # weight version held by a training cell
        self.switch_tok = [0] * k  # token of the cell's latest micro-step, switch or pull event
        self.role_since = [0.0] * k
        self.role_time = [dict.fromkeys(ROLE_NAMES, 0.0) for _ in range(k)]
        self.switch_count = {"serving_to_training": 0, "training_to_serving": 0, "migrations": 0, "waited": 0}

    def account(self, c: int, now: float) -> None:
        """Adds the time since the cell's last role change (or last account) to its current role."""
        self.role_time[c][self.role[c].value] += now - self.role_since[c]
        self.role_since[c] = now

    def begin_switch_at(self, c: int, want: Role, now: float) -> Role:
        """Cell ``c`` starts switching to ``want`` at ``now``; returns the role it leaves."""
        self.account(c, now)
        old = self.begin_switch(c, want)
        self.switch_count["serving_to_training" if old is SERVING else "training_to_serving"] += 1
        return old

    def end_switch_at(self, c: int, now: float) -> Role:
        """Cell ``c`` has its new role at ``now``; returns it."""
        self.account(c, now)
        return self.end_switch(c)

    def fractions(self, cell_time: float) -> dict[str, float]:
        """Cell-time per role, as shares of ``cell_time``."""
        return {name: float(sum(t[name] for t in self.role_time) / cell_time) for name in ROLE_NAMES}

    def text(self) -> str:
        return " ".join(f"{c}:{r.value[:5]}" for c, r in enumerate(self.role))
