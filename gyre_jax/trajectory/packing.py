"""Packing chunks into fixed-shape micro-batches of a token budget.

A micro-batch is ``rows x row_length`` tokens (``[B, T]``, the same shape every time, so the
learner's jitted step compiles once) with at most ``max_sequences`` sequences (``[S]``). Chunks
(``tree.py``) are placed first-fit into the rows of a few micro-batches being filled at once; each
chunk is its own segment of its row (segment ids 1, 2, ... per row; 0 = padding). When a chunk fits
no open row (or no sequence slots are left), the oldest open micro-batch is finished. Packing is a
deterministic function of the chunk sequence, which is what makes the pipeline's resume exact.

Per sequence ``s``: ``advantages[s]`` is its execution's advantage and ``seq_weights[s]`` is
``execution weight x within-execution branch weight`` (``select.py``), so the sum of micro-batch
losses over an optimizer step is the step loss with each execution counted once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gyre_jax.trajectory.batch import MicroBatch, empty_micro_batch
from gyre_jax.trajectory.tree import Chunk


@dataclass(frozen=True)
class SequenceInfo:
    """Where sequence ``s`` of a packed micro-batch came from."""

    execution_id: str
    branch: int  # index into the execution's Selection.branches
    label: str


@dataclass
class PackedMicroBatch:
    """A packed micro-batch and what is in it: ``sequences[s]`` describes sequence ``s``."""

    micro_batch: MicroBatch
    sequences: list[SequenceInfo] = field(default_factory=list)

    @property
    def executions(self) -> list[str]:
        return list(dict.fromkeys(s.execution_id for s in self.sequences))


class _OpenMicroBatch:
    """A micro-batch being filled: its arrays, how full each row is, and its sequences so far."""

    def __init__(self, rows: int, row_length: int, max_sequences: int, experts: tuple[int, int] | None = None):
        self.mb = empty_micro_batch(rows, row_length, max_sequences, experts)
        self.row_length, self.max_sequences = row_length, max_sequences
        self.fill = [0] * rows
        self.segments = [0] * rows
        self.sequences: list[SequenceInfo] = []

    def find_row(self, chunk: Chunk) -> int | None:
        if len(self.sequences) + len(chunk.sequences) > self.max_sequences:
            return None
        return next((r for r, f in enumerate(self.fill) if f + chunk.size <= self.row_length), None)

    def place(self, chunk: Chunk, row: int, advantage: float, seq_weights: list[float], labels: list[str]) -> None:
        mb, lo = self.mb, self.fill[row]
        hi = lo + chunk.size
        self.segments[row] += 1
        first_seq = len(self.sequences)
        mb.tokens[row, lo:hi] = chunk.tokens
        mb.targets[row, lo:hi] = chunk.targets
        mb.positions[row, lo:hi] = chunk.positions
        mb.segment_ids[row, lo:hi] = self.segments[row]
        mb.subtree_end[row, lo:hi] = chunk.subtree_end + lo
        mb.loss_mask[row, lo:hi] = chunk.loss_mask
        mb.old_logprobs[row, lo:hi] = chunk.old_logprobs
        mb.temperature[row, lo:hi] = chunk.temperature
        mb.versions[row, lo:hi] = chunk.versions
        if mb.expert_ids is not None and chunk.experts is not None:
            mb.expert_ids[row, lo:hi] = chunk.experts
        mb.seq_index[row, lo:hi] = np.where(chunk.loss_mask > 0, chunk.seq + first_seq, 0)
        for k in chunk.sequences:
            s = len(self.sequences)
            mb.advantages[s] = advantage
            mb.seq_weights[s] = seq_weights[k]
            self.sequences.append(SequenceInfo(execution_id=chunk.execution_id, branch=k, label=labels[k]))
        self.fill[row] = hi


class MicroBatchPacker:
    """Fills micro-batches of ``[rows, row_length]`` tokens and ``max_sequences`` sequence slots.

    Up to ``open_micro_batches`` are filled at once (first fit over all their rows); when a chunk fits
    none of them, the oldest is finished. More open micro-batches pack tighter; finished ones come out
    in the order they were opened. ``experts`` = (L_moe, K): micro-batches carry ``expert_ids`` (routing
    replay; chunks' recorded experts, -1 elsewhere); None: they carry none.
    """

    def __init__(
        self,
        rows: int,
        row_length: int,
        max_sequences: int,
        open_micro_batches: int = 4,
        experts: tuple[int, int] | None = None,
    ):
        if min(rows, row_length, max_sequences, open_micro_batches) < 1:
            raise ValueError(
                f"rows={rows}, row_length={row_length}, max_sequences={max_sequences}, "
                f"open_micro_batches={open_micro_batches} must all be >= 1"
            )
        self.rows, self.row_length, self.max_sequences = rows, row_length, max_sequences
        self.open_micro_batches = open_micro_batches
        self.experts = experts
        self._open: list[_OpenMicroBatch] = []

    @property
    def empty(self) -> bool:
        return not self._open

    def add(
        self, chunk: Chunk, advantage: float, seq_weights: list[float], labels: list[str]
    ) -> list[PackedMicroBatch]:
        """Places ``chunk``; returns the micro-batches this finished. ``seq_weights``/``labels`` are indexed like
        the execution's Selection.branches."""
        if chunk.size > self.row_length:
            raise ValueError(f"a chunk of {chunk.size} tokens does not fit rows of {self.row_length}")
        if len(chunk.sequences) > self.max_sequences:
            raise ValueError(f"a chunk of {len(chunk.sequences)} sequences exceeds max_sequences={self.max_sequences}")
        for ob in self._open:
            row = ob.find_row(chunk)
            if row is not None:
                ob.place(chunk, row, advantage, seq_weights, labels)
                return []
        out = []
        if len(self._open) == self.open_micro_batches:
            out.append(self._finish(self._open.pop(0)))
        ob = _OpenMicroBatch(self.rows, self.row_length, self.max_sequences, self.experts)
        ob.place(chunk, 0, advantage, seq_weights, labels)
        self._open.append(ob)
        return out

    @staticmethod
    def _finish(ob: _OpenMicroBatch) -> PackedMicroBatch:
        return PackedMicroBatch(micro_batch=ob.mb, sequences=ob.sequences)

    def flush(self) -> list[PackedMicroBatch]:
        """Finishes every open micro-batch (oldest first)."""
        out = [self._finish(ob) for ob in self._open]
        self._open = []
        return out
