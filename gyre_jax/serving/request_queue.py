"""The requests of a serving loop that wait for a decode slot: first come, first served (a request moved
in from another loop goes ahead of new ones), each given its admission order and, when it gets a slot, its
sampling key (from the request's seed, else derived from the loop's seed, name and a counter).

Not thread-safe: the serving loop's lock guards it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import zlib
from collections.abc import Callable, Iterable

import jax

from gyre_jax.serving import sampling
from gyre_jax.serving.batch import DecodeBatch
from gyre_jax.serving.jobs import Job
from gyre_jax.serving.types import GenerationRequest

log = logging.getLogger(__name__)


class RequestQueue:
    """Waiting jobs of loop ``loop_name`` (keys derived from ``seed``)."""

    def __init__(self, seed: int, loop_name: str):
        self.jobs: collections.deque[Job] = collections.deque()
        self._seq = itertools.count()
        self._seed, self._name, self._seed_counter = seed, loop_name, 0

    def __len__(self) -> int:
        return len(self.jobs)

    def next_seq(self) -> int:
        """The next admission order number (prefill is first come, first served)."""
        return next(self._seq)

    def key_for(self, request: GenerationRequest) -> jax.Array:
        seed = request.sampling.seed
        if seed is None:
            self._seed_counter += 1
            seed = zlib.crc32(f"{self._seed}/{self._name}/{self._seed_counter}".encode())
        return sampling.key_for_seed(seed)

    def admit(self, batch: DecodeBatch, reuse_stale_kv: bool) -> None:
        """Moves waiting jobs into the batch's free slots, each with its sampling key and any KV it can start
        from; a job whose admission fails fails alone."""
        free = batch.free_slots()
        while free and self.jobs:
            job = self.jobs.popleft()
            if job.future.done():  # e.g. resolved elsewhere while it waited
                continue
            try:
                if job.key is None:
                    job.key = self.key_for(job.request)
                batch.admit(free[0], job, reuse_stale_kv)
            except Exception as exc:  # this request fails; the loop serves on
                log.exception("serving loop %s: could not admit request %s", self._name, job.request.request_id)
                job.future.set_exception(exc)
                continue
            batch.slots[free.pop(0)] = job

    def take(self, wanted: Callable[[Job], bool]) -> list[Job]:
        """Removes and returns the wanted jobs, in order."""
        taken, kept = [], collections.deque()
        for job in self.jobs:
            (taken if wanted(job) else kept).append(job)
        self.jobs = kept
        return taken

    def cancel(self, request_ids: Iterable[str], cell: str) -> None:
        """The jobs of ``request_ids`` leave the queue, resolved as "cancelled"."""
        ids = set(request_ids)
        for job in self.take(lambda j: j.request.request_id in ids):
            job.resolve("cancelled", cell)
