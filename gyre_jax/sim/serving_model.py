"""The serving side of a simulated run: sessions on serving cells.

It owns which serving cell holds which session (execution ``i``), the time of each session's current segment
(tool time + prefill + decoded tokens x the decode step time its cell's load gives when the segment starts,
``CostModel.serving``), its timeout, the sessions waiting for a slot (dispatched executions, and sessions
moved off a cell that left serving), and the slot occupancy the result reports. Segment ends are ``SEG``
events; moving a session cancels its pending one (a new token).
"""

from __future__ import annotations

import collections
import heapq
from typing import TYPE_CHECKING

import numpy as np

from gyre_jax.elastic.state import Role
from gyre_jax.sim.events import SEG, EventQueue
from gyre_jax.sim.workload import SegmentPlan

if TYPE_CHECKING:
    from gyre_jax.sim.simulator import SimConfig

SERVING = Role.SERVING


class ServingModel:
    """Sessions of ``config`` on cells whose roles are ``roles`` (shared, read only), timed on ``clock``;
    ``plans``: step -> its executions' ``SegmentPlan`` (filled by the driver before it dispatches a step)."""

    def __init__(self, config: SimConfig, clock: EventQueue, roles: list[Role], plans: dict[int, SegmentPlan]):
        cost = config.cost
        k, e = config.num_cells, config.pool_steps * config.batch_size
        self.clock, self.role, self.plans = clock, roles, plans
        self.k, self.n = k, config.batch_size
        self.slots = config.slots_per_cell
        self.replicas = config.cell_accelerators // cost.serving.replica_accelerators
        sv = cost.serving  # decode step = base + per_seq * B / replicas + per_token * X / replicas (B, X per cell)
        self.dec_base = sv.decode_base_s
        self.dec_seq = sv.decode_per_seq_s / self.replicas
        self.dec_ctx = sv.decode_per_context_token_s / self.replicas
        self.interference = config.prefill_interference
        self.balanced = config.placement == "balanced"
        self.timeout_s = config.workload.timeout_s
        self.initial_context = float(config.workload.initial_context)
        self.kv_s_per_token = cost.switch.kv_migration_s_per_token
        # per cell
        self.resident = [0] * k
        self.load_b = [0.0] * k  # sessions, weighted by the share of their time they spend in model calls
        self.load_x = [0.0] * k  # context tokens those sessions read, weighted the same way
        self.load_p = [0.0] * k  # sum of the resident sessions' prefill shares (prefill_interference)
        self.sessions: list[set[int]] = [set() for _ in range(k)]
        self.occ_area = [0.0] * k  # slot-seconds occupied
        self.occ_last = [0.0] * k
        self.pause_area = [0.0] * k  # slot-seconds paused for weight syncs
        # per session (execution index i: step i // n, position i % n)
        self.dispatch_t = [0.0] * e
        self.start_t = [0.0] * e
        self.cell_of = [-1] * e
        self.seg = [0] * e
        self.seg_t0 = [0.0] * e
        self.seg_full = [0.0] * e
        self.seg_end = [0.0] * e
        self.tok = [0] * e  # token of the session's pending SEG event
        self.timed = [False] * e  # the pending SEG event is the timeout
        self.duty = [0.0] * e
        self.pduty = [0.0] * e  # share of the current segment spent prefilling
        self.ctx = [0.0] * e
        self.deadline = [0.0] * e
        # per-token versions: a segment's tokens carry the version serving at its start (set by the driver);
        # per session the oldest token's version, decoded tokens, their sum weighted by version, last segment counted
        self.version, self.ver0, self.tok_n, self.tok_v, self.counted = 0, [0] * e, [0.0] * e, [0.0] * e, [-1] * e
        self.slot_s = [0.0] * e  # an ended session's seconds from its slot to its end
        # waiting for a slot
        self.queue: collections.deque[int] = collections.deque()  # dispatched, never started
        self.held: list[int] = []  # heap of moved sessions: the oldest step's sessions get a slot first
        self.held_frac: dict[int, float] = {}  # session -> share of its segment still to run
        self.held_t: dict[int, float] = {}  # session -> when it lost its slot (its timeout clock stops)
        self.no_free_slot = False
        # ended sessions
        self.durations: list[float] = []
        self.waits: list[float] = []
        self.tokens_done: list[float] = []  # trajectory tokens of each ended execution
        self.timeouts = 0
        self.aborts = 0  # sessions ended by their group's quorum (not in ``durations``)

    # -- slots ------------------------------------------------------------------------------------
    def best_cell(self, exclude: int = -1) -> int:
        """Where a session goes: the serving cell with a free slot that stays serving longest (the highest
        index: cells leave in index order), so cells next in line to leave hold few sessions; with
        ``placement="balanced"`` the serving cell with the fewest sessions."""
        role, resident, slots = self.role, self.resident, self.slots
        if self.balanced:
            best = -1
            for c in range(self.k):
                if (
                    role[c] is SERVING
                    and c != exclude
                    and resident[c] < slots
                    and (best < 0 or resident[c] < resident[best])
                ):
                    best = c
            return best
        for c in range(self.k - 1, -1, -1):
            if role[c] is SERVING and c != exclude and resident[c] < slots:
                return c
        return -1

    def enqueue(self, i: int) -> None:
        """Execution ``i`` was dispatched: it waits for a slot."""
        self.dispatch_t[i] = self.clock.now
        self.queue.append(i)

    def start_waiting(self) -> list[tuple[int, int]]:
        """Gives free slots to moved sessions and dispatched executions, the oldest step first; returns the
        executions that started, as (execution, cell)."""
        started: list[tuple[int, int]] = []
        if self.no_free_slot:
            return started
        now = self.clock.now
        while self.held or self.queue:
            c = self.best_cell()
            if c < 0:
                self.no_free_slot = True  # until a slot frees or a cell starts serving
                break
            if self.held and (not self.queue or self.held[0] < self.queue[0]):
                i = heapq.heappop(self.held)
                frac = self.held_frac.pop(i)
                self.deadline[i] += now - self.held_t.pop(i)
                self.attach(i, c, frac, self.kv_s_per_token * self.ctx[i])
                continue
            i = self.queue.popleft()
            self.start_t[i] = now
            self.ver0[i] = self.version
            self.deadline[i] = now + self.timeout_s
            self.waits.append(now - self.dispatch_t[i])
            self.seg[i] = 0
            started.append((i, c))
            self.attach(i, c, 1.0, 0.0)
        return started

    def touch(self, c: int) -> None:
        """Brings cell ``c``'s occupied slot-seconds up to now."""
        now = self.clock.now
        self.occ_area[c] += self.resident[c] * (now - self.occ_last[c])
        self.occ_last[c] = now

    def reopen(self, c: int) -> None:
        """Cell ``c`` starts serving (again): its slots are free from now."""
        self.occ_last[c] = self.clock.now
        self.no_free_slot = False

    # -- a session on a cell ----------------------------------------------------------------------
    def attach(self, i: int, c: int, frac: float, delay: float) -> None:
        """Session ``i`` takes a slot of cell ``c`` and runs the remaining ``frac`` of its segment after ``delay``."""
        self.touch(c)
        self.cell_of[i] = c
        self.resident[c] += 1
        self.sessions[c].add(i)
        self.begin_segment(i, frac, delay)

    def _unload(self, i: int, c: int) -> None:
        d = self.duty[i]
        self.load_b[c] -= d
        self.load_x[c] -= d * self.ctx[i]
        self.load_p[c] -= self.pduty[i]

    def _leave(self, i: int) -> int:
        """Frees session ``i``'s slot and voids its pending segment event; returns the cell it left."""
        c = self.cell_of[i]
        self.touch(c)
        self.resident[c] -= 1
        self.sessions[c].discard(i)
        self.no_free_slot = False
        if self.resident[c] == 0:
            self.load_b[c] = self.load_x[c] = self.load_p[c] = 0.0
        self.tok[i] += 1
        return c

    def detach(self, i: int) -> float:
        """Takes session i off its cell; returns the share of its current segment still to run."""
        self._unload(i, self.cell_of[i])
        self._leave(i)
        full = self.seg_full[i]
        return max(0.0, self.seg_end[i] - max(self.clock.now, self.seg_t0[i])) / full if full > 0 else 0.0

    def end(self, i: int) -> int:
        """Session ``i`` ended (its segment end already unloaded its cell); returns the cell it left."""
        c = self._leave(i)
        self.slot_s[i] = self.clock.now - self.start_t[i]
        self.durations.append(self.slot_s[i])
        return c

    def begin_segment(self, i: int, frac: float, delay: float) -> None:
        """Times session ``i``'s current segment on its cell's load now and schedules its end (or timeout)."""
        step, j = divmod(i, self.n)
        p = self.plans[step]
        k = p.offset[j] + self.seg[i]
        c = self.cell_of[i]
        ctx = p.ctx[k]
        if self.counted[i] != k:
            self.counted[i] = k
            self.tok_n[i] += p.gen[k]
            self.tok_v[i] += p.gen[k] * self.version
        load_b, load_x = self.load_b, self.load_x
        step_s = self.dec_base + self.dec_seq * (load_b[c] + 1.0) + self.dec_ctx * (load_x[c] + ctx)
        if self.interference:
            step_s *= 1.0 + max(0.0, self.load_p[c] / self.replicas)
        prefill = p.prefill_s[k]
        model_s = prefill + p.gen[k] * step_s
        dur = p.tool_s[k] + model_s
        duty = model_s / dur if dur > 0 else 0.0
        self.duty[i] = duty
        pduty = prefill / dur if dur > 0 else 0.0
        self.pduty[i] = pduty
        self.load_p[c] += pduty
        self.ctx[i] = ctx
        load_b[c] += duty
        load_x[c] += duty * ctx
        clock = self.clock
        t0 = clock.now + delay
        end = t0 + frac * dur
        self.seg_t0[i] = t0
        self.seg_full[i] = dur
        self.seg_end[i] = end
        tok = self.tok[i] + 1
        self.tok[i] = tok
        deadline = self.deadline[i]
        timed = end >= deadline
        self.timed[i] = timed
        heapq.heappush(clock.heap, (deadline if timed else end, next(clock.seq), SEG, i, tok))  # clock.push, inlined

    def segment_end(self, i: int) -> tuple[str, float] | None:
        """Session ``i``'s segment (or its time) is up: None if its next segment began, else how its execution
        ended, ("timeout" | "finished", trajectory tokens); the session still holds its slot (``end``)."""
        c, d = self.cell_of[i], self.duty[i]  # self._unload(i, c), inlined: the hot path
        self.load_b[c] -= d
        self.load_x[c] -= d * self.ctx[i]
        self.load_p[c] -= self.pduty[i]
        step, j = divmod(i, self.n)
        p = self.plans[step]
        k = p.offset[j] + self.seg[i]
        if self.timed[i]:
            prev = p.tokens_end[k - 1] if self.seg[i] > 0 else self.initial_context
            full = self.seg_full[i]
            done = 1.0 - (self.seg_end[i] - self.clock.now) / full if full > 0 else 1.0
            tokens = prev + (p.tokens_end[k] - prev) * min(max(done, 0.0), 1.0)
            self.timeouts += 1
            self.tokens_done.append(tokens)
            return "timeout", tokens
        self.seg[i] += 1
        if self.seg[i] >= p.count[j]:
            self.tokens_done.append(float(p.tokens[j]))
            return "finished", float(p.tokens[j])
        self.begin_segment(i, 1.0, 0.0)
        return None

    def abort(self, i: int) -> bool:
        """Ends dispatched session ``i`` now (its group's quorum ended without it), on a slot, held after a move
        or queued. False if it never had a slot; else True, and ``slot_s[i]`` is set as for a session that ended."""
        self.aborts += 1
        c = self.cell_of[i]
        if c >= 0 and i in self.sessions[c]:
            self.detach(i)
        elif i in self.held_frac:  # moved off a cell that left serving, waiting for a slot
            self.held.remove(i)
            heapq.heapify(self.held)
            del self.held_frac[i], self.held_t[i]
        else:
            self.queue.remove(i)  # dispatched, never started
            return False
        self.slot_s[i] = self.clock.now - self.start_t[i]
        return True

    # -- cells that pause or leave serving --------------------------------------------------------
    def pause(self, c: int, sync_s: float) -> None:
        """Serving cell ``c`` pauses ``sync_s`` for a weight sync: its sessions' segments resume after it."""
        if sync_s > 0 and self.sessions[c]:
            self.pause_area[c] += self.resident[c] * sync_s
            for i in sorted(self.sessions[c]):
                frac = self.detach(i)
                self.attach(i, c, frac, sync_s)

    def vacate(self, c: int, first_ahead: int) -> tuple[int, int]:
        """Cell ``c`` leaves serving: each of its sessions moves (KV migration time) to the serving cell that
        stays longest, or waits for a slot; a due session (< ``first_ahead``) takes the slot of the youngest
        session of a later step, which waits instead. Returns (sessions moved, sessions that wait)."""
        moved = waited = 0
        for i in sorted(self.sessions[c]):
            frac = self.detach(i)
            dest = self.best_cell(exclude=c)
            if dest < 0 and i < first_ahead:
                dest = self._evict_ahead(first_ahead)
                if dest >= 0:
                    waited += 1  # the evicted session
            if dest < 0:
                self._hold(i, frac)
                waited += 1
            else:
                moved += 1
                self.attach(i, dest, frac, self.kv_s_per_token * self.ctx[i])
        return moved, waited

    def _hold(self, i: int, frac: float) -> None:
        heapq.heappush(self.held, i)
        self.held_frac[i] = frac
        self.held_t[i] = self.clock.now

    def _evict_ahead(self, first_ahead: int) -> int:
        """Frees a slot for a due session: the youngest session of a later step, on a serving cell, waits."""
        victim = -1
        for c in range(self.k):
            if self.role[c] is SERVING and self.sessions[c]:
                youngest = max(self.sessions[c])
                if youngest >= first_ahead and youngest > victim:
                    victim = youngest
        if victim < 0:
            return -1
        dest = self.cell_of[victim]
        self._hold(victim, self.detach(victim))
        return dest

    # -- what it measured -------------------------------------------------------------------------
    def busy_s(self) -> float:
        """Slot-occupied serving time (weight-sync pauses excluded), in cell-seconds, up to the last ``touch``."""
        return sum(max(0.0, self.occ_area[c] - self.pause_area[c]) / self.slots for c in range(self.k))


def execution_stats(sv: ServingModel) -> dict[str, float]:
    """Serving model ``sv``'s ended executions: count, timeout share, durations (slot to end), waits for a slot, tokens."""
    d = np.asarray(sv.durations) if sv.durations else np.zeros(1)
    waits = np.asarray(sv.waits) if sv.waits else np.zeros(1)
    return {
        "ended": len(sv.durations),
        "timeout_fraction": sv.timeouts / max(1, len(sv.durations)),
        "aborted": sv.aborts,
        "duration_mean_s": float(d.mean()),
        "duration_p50_s": float(np.percentile(d, 50)),
        "duration_p90_s": float(np.percentile(d, 90)),
        "duration_max_s": float(d.max()),
        "wait_mean_s": float(waits.mean()),
        "tokens_mean": float(np.mean(sv.tokens_done)) if sv.tokens_done else 0.0,
    }
