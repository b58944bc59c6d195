"""The decode slots of one serving loop, on an engine of either KV layout.

``DecodeBatch`` owns which job holds which of its ``engine_api.ServingEngine``'s slots, each job's prefill
progress, the weights it runs (and their policy version), the generate steps in flight, and what each sampled token
does to its job (stop, budget, context limit); the engine holds the slots' KV. It does the device side of one loop
iteration (``step``): prefill chunks of the slots still prefilling (oldest first), start those whose prompt is
complete, dispatch one generate program and read the oldest in flight. Jobs end here: their session's KV goes to
the session cache and their future resolves. Used from the loop thread; slot changes that other threads may read
are made under ``lock``.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence

import jax
import numpy as np

from gyre_jax.serving.engine_api import ServingEngine
from gyre_jax.serving.jobs import Job, LoopStats, Step
from gyre_jax.serving.kv_cache import KVPages
from gyre_jax.serving.session_cache import SessionCache

log = logging.getLogger(__name__)


class DecodeBatch:
    """``engine.max_concurrent_decodes`` slots serving weights ``params`` of policy ``version``."""

    def __init__(
        self,
        engine: ServingEngine,
        params,
        version: int,
        *,
        name: str,
        prefill_chunk: int,
        lock: threading.Condition,
        stats: LoopStats,
        cache: SessionCache | None,
        prefill_together: bool = True,
        lookahead: int = 2,
    ):
        self.engine = engine
        self.params = params
        self.version = version
        self.name = name
        self.max_context = engine.max_seq_len
        self.prefill_chunk = prefill_chunk
        self.lock = lock
        self.stats = stats
        self.cache = cache
        self.together = prefill_together
        self.slots: list[Job | None] = [None] * engine.max_concurrent_decodes
        self.lookahead = lookahead  # decode steps dispatched after the oldest step in flight before it is read
        self.in_flight: collections.deque[Step] = collections.deque()  # dispatched, tokens not read yet; oldest first

    def set_weights(self, params, version: int) -> bool:
        """New weights for the next step; True if the policy version changed."""
        changed = version != self.version
        self.params, self.version = params, version
        return changed

    def has_work(self) -> bool:
        return any(s is not None for s in self.slots)

    def free_slots(self) -> list[int]:
        return [slot for slot, job in enumerate(self.slots) if job is None]

    # -- a job's start: the KV it starts from ---------------------------------------------------------
    def admit(self, slot: int, job: Job, reuse_stale_kv: bool) -> None:
        """Gives free ``slot`` the KV ``job`` (with its sampling key) can start from: imported, or its session's
        cache entry."""
        try:
            self._place(slot, job, reuse_stale_kv)
        except Exception:
            self.engine.release(slot)  # nothing of the job stays in the slot
            raise

    def _place(self, slot: int, job: Job, reuse_stale_kv: bool) -> None:
        if job.kv is not None:
            ready = job.done if job.resuming else min(job.done, len(job.target) - 1)  # >= 1 token left to sample from
            if ready > 0:
                self.engine.import_kv(slot, job.kv, ready)
            job.done, job.kv = ready, None
            return
        sid = job.request.session_id
        if self.cache is None or sid is None or job.resuming:
            return
        hit = self.cache.take(sid, job.target, None if reuse_stale_kv else self.version)
        if hit is None:
            return
        pages, job.done, job.kv_version = hit
        self.engine.attach(slot, pages)
        job.cached_tokens = job.done

    # -- one iteration -----------------------------------------------------------------------------
    def step(self, multi_step: bool = False) -> Step | None:
        """Prefills, dispatches the next generate program, then reads the oldest in flight once ``lookahead``
        decode steps follow it (or nothing new was dispatched); returns the step read, if any. The device never
        waits for this thread, whose wait and bookkeeping overlap the steps queued; a request that ends at step k
        wastes its tokens of the steps dispatched after k. ``multi_step`` (nothing waits to join the batch): with
        every slot decoding, up to the engine's ``decode_steps`` steps run in one program."""
        self.prefill_step()
        step = self._dispatch_generate(self.in_flight, multi_step)
        if step is not None:
            self.in_flight.append(step)
        if not self.in_flight:
            return None
        ahead = sum(s.num_steps for s in self.in_flight) - self.in_flight[0].num_steps
        if step is not None and ahead < self.lookahead:
            return None
        oldest = self.in_flight.popleft()
        collect(self, oldest)
        return oldest

    def flush(self) -> None:
        """Collects every step in flight, so slots, tokens and decode state agree (before an export or recompute)."""
        while self.in_flight:
            collect(self, self.in_flight.popleft())

    def prefill_step(self) -> None:
        """Prefills up to ``prefill_chunk`` tokens of the slots still prefilling (oldest first); slots whose
        prompt is complete start decoding. With no slot decoding, goes on until one can start. Whole prompts
        that fit one chunk are prefilled together in one program (``prefill_together``): with no slot decoding,
        all of them at once, so a burst of requests starts in one iteration."""
        pending = sorted(
            ((slot, job) for slot, job in enumerate(self.slots) if job is not None and not job.decoding),
            key=lambda sj: sj[1].seq,
        )
        if not pending:
            return
        must_start = not any(j is not None and j.decoding for j in self.slots)
        spent = prefill_together(self, pending, None if must_start else self.prefill_chunk) if self.together else 0
        if spent:
            pending = [(slot, job) for slot, job in pending if not job.decoding and self.slots[slot] is job]
            must_start = False
        for slot, job in pending:
            while job.done < len(job.target):
                if spent >= self.prefill_chunk and not must_start:
                    return
                n = min(self.prefill_chunk, len(job.target) - job.done)
                if not self._prefill_chunk(slot, job, n):
                    break
                spent += n
            else:
                self._start_decoding(slot, job)
                must_start = False

    def _prefill_chunk(self, slot: int, job: Job, n: int) -> bool:
        """Prefills the next ``n`` ids of the job's target; False if that failed (the job failed, its slot is free)."""
        try:
            first = self.engine.prefill(
                self.params, slot, job.target[job.done : job.done + n], job.request.sampling, job.key,
                final=job.done + n == len(job.target),
            )  # fmt: skip
        except Exception as exc:  # this request fails; the loop serves on
            log.warning("serving loop %s: prefill of %s failed: %s", self.name, job.request.request_id, exc)
            with self.lock:
                self.slots[slot] = None
                self.engine.release(slot)
            if not job.future.done():
                job.future.set_exception(exc)
            return False
        if job.kv_version is None:
            job.kv_version = self.version
        if first.experts is not None:  # routing replay: the experts of these prompt tokens
            job.note_prompt_experts(job.done, first.experts)
        job.first = first
        job.done += n
        self.stats.prefill_tokens += n
        self.stats.prefill_calls += 1
        return True

    def prefill_group(self, slots: Sequence[int], jobs: Sequence[Job]) -> list[tuple]:
        """Prefills the whole targets of ``jobs`` (no KV to start from) in one program into ``slots`` and starts
        them; returns each one's first sampled (token, log-prob)."""
        sampling = [job.request.sampling for job in jobs]
        firsts = self.engine.prefill_many(
            self.params, slots, [job.target for job in jobs], sampling, [job.key for job in jobs]
        )
        self.engine.start(slots)
        tokens, logprobs = jax.device_get((firsts.token, firsts.logprob))
        for i, job in enumerate(jobs if firsts.experts is not None else ()):  # routing replay: the prompts' experts
            job.note_prompt_experts(0, np.asarray(firsts.experts[i])[: len(job.target)])
        return list(zip(tokens, logprobs))

    def _start_decoding(self, slot: int, job: Job) -> None:
        if job.resuming:  # its last token was sampled before the move/update: decode from it, with the key after it
            self.engine.resume(slot, job.tokens[-1], job.key, job.request.sampling)
            self.begin(slot, job, None)
            return
        self.engine.start([slot])
        first, job.first = jax.device_get((job.first.token, job.first.logprob)), None
        self.begin(slot, job, first)

    def begin(self, slot: int, job: Job, first: tuple | None) -> None:
        """``job``, started in ``slot``, decodes from now on; ``first``: (token, log-prob) its prefill sampled
        (None: a resumed job, whose last token is already recorded)."""
        sp = job.request.sampling
        job.budget = min(sp.max_tokens, self.max_context - len(job.request.prompt_ids)) - len(job.tokens)
        with self.lock:
            job.decoding = True
            if first is None:
                if job.budget <= 0:
                    self.finish(slot, "length")
                return
            self.accept(slot, int(first[0]), float(first[1]))

    def _dispatch_generate(self, in_flight: Sequence[Step], multi_step: bool = False) -> Step | None:
        """Starts a generate program for the decoding slots (not waiting for it; the engine sizes it by their
        lengths): one step, or with ``multi_step`` up to the engine's ``decode_steps`` (``num_steps``)."""
        decoding, owes = self._decoding(in_flight)
        if not decoding:
            return None
        n = num_steps(self, decoding, owes, multi_step)
        result = self.engine.generate(self.params, num_steps=n, wait=False)
        self.stats.generate_steps += n
        self.stats.generate_calls += 1
        return Step(result=result, jobs=decoding, version=self.version, num_steps=n)

    def _decoding(self, in_flight: Sequence[Step]) -> tuple[dict[int, Job], dict[int, int]]:
        """The decoding slots' jobs and the tokens each is still owed by the programs ``in_flight`` (``owed``), or
        none when those programs end every one of them (each owed at least its remaining budget): a next program
        would only compute tokens to discard."""
        decoding = {slot: j for slot, j in enumerate(self.slots) if j is not None and j.decoding}
        owes = owed(in_flight, decoding)
        if in_flight and all(j.budget <= owes[slot] for slot, j in decoding.items()):
            return {}, {}
        return decoding, owes

    # -- a job's tokens and end (caller holds the lock) ---------------------------------------------
    def accept(self, slot: int, token: int, logprob: float, version: int | None = None) -> None:
        """Records a sampled token (``version``: the policy that sampled it; default the current one)."""
        job = self.slots[slot]
        assert job is not None
        ended = job.record(token, logprob, self.version if version is None else version)
        if ended is not None:
            self.finish(slot, ended[0], stop_reason=ended[1])

    def finish(self, slot: int, reason: str, stop_reason=None, save: bool = True) -> None:
        """Ends the request in ``slot``: frees the slot (its session's KV kept by the session cache), resolves its
        future."""
        job = self.slots[slot]
        self.slots[slot] = None
        if job is None:
            return
        sid = job.request.session_id
        if save and job.decoding and self.cache is not None and sid is not None:
            kv_tokens = list(job.request.prompt_ids) + job.tokens[:-1]  # the newest token is sampled, not cached
            self.cache.store(sid, kv_tokens, self.version if job.kv_version is None else job.kv_version, slot)
            self.stats.cache = self.cache.stats  # before the request's future resolves
        else:
            self.engine.release(slot)
        self.stats.requests_done += 1
        job.resolve(reason, self.name, stop_reason)

    def cancel(self, request_ids: set[str]) -> None:
        """Ends the requests of ``request_ids`` that hold a slot as "cancelled"."""
        for slot, job in enumerate(self.slots):
            if job is not None and job.request.request_id in request_ids:
                self.finish(slot, "cancelled")

    # -- weight updates and migration -----------------------------------------------------------------
    def recompute_in_flight(self) -> None:
        """on_update="recompute": every request in a slot prefills its KV again under the new weights."""
        keys = self.engine.keys()
        for slot, job in enumerate(self.slots):
            if job is None:
                continue
            if job.decoding:
                job.key = keys[slot].copy()
                job.target = list(job.request.prompt_ids) + job.tokens[:-1]
                job.decoding = False
            self.engine.release(slot)
            job.done, job.first, job.kv_version, job.cached_tokens = 0, None, None, 0

    def export(self, wanted) -> list[tuple[Job, KVPages | None, list[int], np.ndarray | None]]:
        """Takes the wanted jobs (by session id) out of their slots: (job, KV, ids the KV holds, sampling key)
        each; a decoding job's key comes from its slot, a prefilling job's is its own."""
        out, keys = [], None
        for slot, job in enumerate(self.slots):
            if job is None or not wanted(job.request.session_id):
                continue
            if job.decoding:
                keys = self.engine.keys() if keys is None else keys
                kv_tokens, key = list(job.request.prompt_ids) + job.tokens[:-1], keys[slot]
            else:
                kv_tokens, key = job.target[: job.done], None if job.key is None else np.asarray(job.key)
            kv = self.engine.export(slot, len(kv_tokens)) if kv_tokens else None
            self.engine.release(slot)
            self.slots[slot] = None
            out.append((job, kv, kv_tokens, key))
        return out


def collect(batch: DecodeBatch, step: Step | None) -> None:
    """Gives each job of ``batch`` its token of ``step``; a slot whose job ended or changed since it was dispatched
    (finished, cancelled, exported) ignores it."""
    if step is None:
        return
    result = step.result.to_host()
    tokens, logprobs, valid = result.tokens.tolist(), result.logprobs.tolist(), result.valid.tolist()
    experts = result.experts
    if step.num_steps == 1:  # one row per step of the program
        tokens, logprobs, valid = [tokens], [logprobs], [valid]
        experts = None if experts is None else experts[None]
    with batch.lock:
        for i in range(step.num_steps):
            for slot, job in step.jobs.items():
                if batch.slots[slot] is not job or not job.decoding:
                    continue  # ended (at an earlier step of this program, or since), or another job's now
                if not valid[i][slot]:  # cannot happen while budgets respect the context; never pass garbage on
                    log.error(
                        "serving loop %s: slot %d sampled no valid token (request %s); ending it",
                        batch.name,
                        slot,
                        job.request.request_id,
                    )
                    batch.finish(slot, "length")
                    continue
                batch.stats.tokens_generated += 1
                if experts is not None:
                    job.note_experts(experts[i][slot])
                batch.accept(slot, tokens[i][slot], logprobs[i][slot], step.version)


def owed(in_flight: Sequence[Step], decoding: dict[int, Job]) -> dict[int, int]:
    """Per slot of ``decoding``, the tokens the programs ``in_flight`` will still give its job (their steps that
    stepped that job)."""
    out = dict.fromkeys(decoding, 0)
    for step in in_flight:
        for slot, job in step.jobs.items():
            if decoding.get(slot) is job:
                out[slot] += step.num_steps
    return out


def num_steps(batch: DecodeBatch, decoding: dict[int, Job], owes: dict[int, int], multi_step: bool) -> int:
    """Steps of ``batch``'s next program: 1, or with ``multi_step`` and no slot still prefilling, up to the engine's
    ``decode_steps``, no more than the most any decoding job still owes beyond ``owes`` (``owed``: a static
    batch's last program ends with its last token)."""
    if not multi_step or len(decoding) != sum(j is not None for j in batch.slots):
        return 1
    left = max(j.budget - owes[slot] for slot, j in decoding.items())
    return max(1, min(batch.engine.decode_steps, left))


def prefill_together(batch: DecodeBatch, pending: list[tuple[int, Job]], budget: int | None) -> int:
    """Prefills, in one program, the oldest of ``batch``'s ``pending`` (slot, job) pairs whose whole prompt fits
    one chunk and has no KV to start from, up to ``budget`` prompt tokens (None: all of them), and starts them
    decoding; returns the tokens prefilled (0 when fewer than 2 qualify: the one-prompt path serves them)."""
    group, tokens = [], 0
    for slot, job in pending:
        n = len(job.target)
        if job.done or job.resuming or n > batch.prefill_chunk:  # it starts from KV, or from a sampled token
            continue
        if budget is not None and tokens + n > budget:
            break
        group.append((slot, job))
        tokens += n
    if len(group) < 2:
        return 0
    try:
        firsts = batch.prefill_group([slot for slot, _ in group], [job for _, job in group])
    except Exception as exc:  # e.g. the device ran out of memory for the batch: one at a time instead
        log.warning(
            "serving loop %s: prefill of %d prompts together failed (%s); one at a time", batch.name, len(group), exc
        )
        return 0
    for (slot, job), first in zip(group, firsts):
        job.kv_version, job.done = batch.version, len(job.target)
        batch.begin(slot, job, first)
    batch.stats.prefill_tokens += tokens
    batch.stats.prefill_calls += 1
    return tokens
