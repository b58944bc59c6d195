"""The trajectory pipeline on Grain: finished executions -> trees -> selection -> packed micro-batches.

The chain (each stage a Grain dataset or transform; the iterator state is checkpointable):

    QueueSource(queue)                  QueuedExecution      (the durable queue of finished executions)
      .map(LoadExecution(record_dir))   LoadedExecution      (records -> branches; corrupt files excluded)
      .map(SelectBranches(...))         SelectedExecution    (J_max by priority, de-duplicated targets)
      .map(BuildChunks(...))            ExecutionChunks      (prefix-tree or plain layout, <= one row each)
    PackIterDataset(...)                PackedBatch          (micro-batches of rows x row_length tokens)

Every stage handles one execution at a time, so memory stays flat however many executions flow
through. The iterator state is JSON: the queue position where the current optimizer step's
packing began plus how many micro-batches of it were already handed out. Packing is
deterministic, so restoring the state reproduces the rest of the stream exactly: a resumed run
neither drops nor repeats an execution. ``TrajectoryPipeline`` wraps the chain for the trainer
(``enqueue`` a step's executions, ``next_step()`` to get its micro-batches, ``get_state``/
``set_state`` for the checkpoint).
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grain
import numpy as np

from gyre_jax.faultpoints import kill_point
from gyre_jax.trajectory.batch import MicroBatch
from gyre_jax.trajectory.branches import Branch, BranchBuilder
from gyre_jax.trajectory.packing import MicroBatchPacker, PackedMicroBatch, SequenceInfo
from gyre_jax.trajectory.queue import ExecutionQueue, QueuedExecution
from gyre_jax.trajectory.reader import CorruptRecords, NoRecords, check_token_ids, iter_records
from gyre_jax.trajectory.select import AUXILIARY_POLICIES, Selection, execution_rng, select
from gyre_jax.trajectory.tree import Chunk, plain_chunks, tree_chunks

log = logging.getLogger("gyre_jax.trajectory")

PACKING = ("tree", "plain")
STEP_STATS = (
    "executions",
    "excluded",
    "greedy_calls",
    "branches",
    "selected",
    "targets",
    "chunk_tokens",
    "tokens_computed",
    "tokens_trained",
    "rows",
    "sequences",
    "micro_batches",
)
STATE_VERSION = 1


@dataclass(frozen=True)
class TrajectoryConfig:
    """What the pipeline does; ``RunConfig.trajectory_config()`` derives it from the run config.

    ``max_branches``: J_max (None = uncapped). ``packing``: "tree" (shared prefixes computed once) or
    "plain" (each branch its own sequence). Micro-batches are ``rows x row_length`` tokens with at
    most ``max_sequences`` sequences; ``open_micro_batches`` are filled at once (``packing.py``).
    ``message_end_id`` (the chat template's ``<|im_end|>``) lets structure tell sub-agents from summaries
    within one thread, for records whose threads mix agents (``branches.py``; None: one agent per thread, as the
    proxy names them); ``auxiliary``: "lowest" (utility-call branches last in J_max selection) or "exclude";
    ``vocab_size`` bounds token ids; ``seed`` seeds branch sampling. ``replay_experts`` = (MoE layers, k):
    micro-batches carry the records' expert ids for routing replay (``rl.routing_replay = "replay"``);
    None (default): they carry none. ``replay_prompt``: prompt tokens' recorded experts too
    (``rl.routing_replay_prompt = "replay"``); else they are -1 (routed by the learner).
    """

    max_branches: int | None = 5
    packing: str = "tree"
    row_length: int = 1024
    rows: int = 8
    max_sequences: int = 64
    open_micro_batches: int = 4
    seed: int = 0
    message_end_id: int | None = None
    vocab_size: int | None = None
    main_thread: str = "main"
    auxiliary: str = "lowest"
    replay_experts: tuple[int, int] | None = None
    replay_prompt: bool = False

    def __post_init__(self) -> None:
        if self.auxiliary not in AUXILIARY_POLICIES:
            raise ValueError(f"auxiliary={self.auxiliary!r} must be one of {AUXILIARY_POLICIES}")
        if self.packing not in PACKING:
            raise ValueError(f"packing={self.packing!r} must be one of {PACKING}")
        if self.max_branches is not None and self.max_branches < 1:
            raise ValueError(f"max_branches={self.max_branches} must be >= 1 (or None for uncapped)")
        for name in ("row_length", "rows", "max_sequences", "open_micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.rows * self.row_length


# Why the pipeline leaves an execution out of training: each exclusion reason starts with one of these and a colon.
LEFT_OUT_KINDS = ("weight 0", "no records", "corrupt records", "unreadable records", "nothing to train", "does not fit")


def left_out_counts(reasons: Iterable[str]) -> dict[str, int]:
    """``{"left_out/<kind>": count}`` of exclusion ``reasons`` (kinds of ``LEFT_OUT_KINDS``, spaces as ``_``;
    ``other`` for a reason of no known kind), for the step's metrics."""
    counts: collections.Counter[str] = collections.Counter()
    for reason in reasons:
        kind = reason.split(":", 1)[0]
        counts[kind.replace(" ", "_") if kind in LEFT_OUT_KINDS else "other"] += 1
    return {f"left_out/{kind}": n for kind, n in sorted(counts.items())}


# -- elements ---------------------------------------------------------------------------------------------------------


@dataclass
class LoadedExecution:
    entry: QueuedExecution
    branches: list[Branch] | None = None
    excluded: str | None = None
    greedy_calls: int = 0  # calls kept as context only (temperature 0, see branches.py)


@dataclass
class SelectedExecution:
    entry: QueuedExecution
    selection: Selection | None = None
    excluded: str | None = None
    greedy_calls: int = 0


@dataclass
class ExecutionChunks:
    entry: QueuedExecution
    selection: Selection | None = None
    chunks: list[Chunk] = field(default_factory=list)
    excluded: str | None = None
    greedy_calls: int = 0


@dataclass
class PackedBatch:
    """One pipeline output: a micro-batch of ``step`` (None when a step has nothing to train), whether it
    is the step's last, and the executions excluded (``(execution_id, reason)``) since the previous output."""

    step: int
    packed: PackedMicroBatch | None
    end_of_step: bool
    excluded: list[tuple[str, str]] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)


# -- source ------------------------------------------------------------------------------------------------------------


class _QueueIterator(grain.DatasetIterator):
    def __init__(self, queue: ExecutionQueue):
        super().__init__()
        self._queue = queue
        self._offset = 0
        self._index = 0

    def __next__(self) -> QueuedExecution:
        got = self._queue.read_at(self._offset)
        if got is None:
            raise StopIteration  # nothing more queued yet; a later call reads what is appended meanwhile
        entry, offset = got
        if entry.index != self._index:
            raise ValueError(
                f"{self._queue.path}: entry index {entry.index} at byte {self._offset}, expected {self._index}"
            )
        self._offset, self._index = offset, self._index + 1
        return entry

    def get_state(self) -> dict[str, Any]:
        return {"offset": self._offset, "index": self._index}

    def set_state(self, state: dict[str, Any]) -> None:
        self._offset, self._index = int(state["offset"]), int(state["index"])


class QueueSource(grain.IterDataset):
    """Streams the queue's entries in order; state ``{"offset": byte, "index": entry}``."""

    def __init__(self, queue: ExecutionQueue):
        super().__init__()
        self.queue = queue

    def __iter__(self) -> _QueueIterator:
        return _QueueIterator(self.queue)


# -- transforms --------------------------------------------------------------------------------------------------------


class LoadExecution(grain.transforms.Map):
    """Reads an execution's records (strictly, see ``reader.py``) into labelled branches."""

    def __init__(self, record_dir: str | os.PathLike, config: TrajectoryConfig):
        self.record_dir = Path(record_dir)
        self.config = config

    def map(self, entry: QueuedExecution) -> LoadedExecution:
        if entry.weight == 0.0:  # queued for the record only (see ExecutionQueue.append_step): not read, not trained
            return LoadedExecution(
                entry=entry,
                excluded="weight 0: left out by the trainer (its group was skipped or it is over the staleness bound)",
            )
        path = self.record_dir / f"{entry.execution_id}.jsonl"
        try:
            c = self.config
            builder = BranchBuilder(c.main_thread, c.message_end_id, prompt_experts=c.replay_prompt)
            for rec in iter_records(path, entry.execution_id, self.config.vocab_size):
                builder.add(rec)
            branches = builder.finish()
            for i, b in enumerate(branches):
                check_token_ids(b.tokens, self.config.vocab_size, f"{path}: branch {i} ({b.label})")
        except NoRecords as e:  # not damage: its harness made no call the proxy served (crashed, or refused)
            return LoadedExecution(entry=entry, excluded=f"no records: {e}")
        except CorruptRecords as e:
            return LoadedExecution(entry=entry, excluded=f"corrupt records: {e}")
        except OSError as e:  # unreadable file (permissions, I/O error): this execution only
            return LoadedExecution(entry=entry, excluded=f"unreadable records: {path}: {e}")
        return LoadedExecution(entry=entry, branches=branches, greedy_calls=builder.greedy_calls)


class SelectBranches(grain.transforms.Map):
    """J_max branches by priority (seeded within a label) with de-duplicated targets (``select.py``)."""

    def __init__(self, config: TrajectoryConfig):
        self.config = config

    def map(self, element: LoadedExecution) -> SelectedExecution:
        greedy = element.greedy_calls
        if element.excluded is not None:
            return SelectedExecution(entry=element.entry, excluded=element.excluded, greedy_calls=greedy)
        eid = element.entry.execution_id
        sel = select(eid, element.branches, self.config.max_branches, execution_rng(self.config.seed, eid),
                     auxiliary=self.config.auxiliary)  # fmt: skip
        if sel.num_selected == 0:
            reason = "nothing to train: no policy-generated token"
            if greedy:
                reason = (
                    f"nothing to train: every call was greedy (temperature 0, {greedy} calls; proxy.sampling=client)"
                )
            return SelectedExecution(entry=element.entry, excluded=reason, greedy_calls=greedy)
        return SelectedExecution(entry=element.entry, selection=sel, greedy_calls=greedy)


class BuildChunks(grain.transforms.Map):
    """Lays the selection out as a prefix tree (or one branch per chunk) in row-sized chunks (``tree.py``)."""

    def __init__(self, config: TrajectoryConfig):
        self.config = config

    def map(self, element: SelectedExecution) -> ExecutionChunks:
        if element.excluded is not None:
            return ExecutionChunks(entry=element.entry, excluded=element.excluded, greedy_calls=element.greedy_calls)
        c, sel = self.config, element.selection
        try:
            if c.packing == "tree":
                chunks = tree_chunks(sel, c.row_length, c.max_sequences)
            else:
                chunks = plain_chunks(sel, c.row_length)
        except ValueError as e:
            return ExecutionChunks(
                entry=element.entry,
                excluded=f"does not fit: {e}; raise trajectory.row_length (with model.context_parallel = n a "
                "row's tokens are split over n devices: raise both to hold longer rows in the same memory per device)",
                greedy_calls=element.greedy_calls,
            )
        return ExecutionChunks(entry=element.entry, selection=sel, chunks=chunks, greedy_calls=element.greedy_calls)


# -- packing -----------------------------------------------------------------------------------------------------------


class _PackIterator(grain.DatasetIterator):
    """Packs each step's chunks into micro-batches; a step's last micro-batch has ``end_of_step``.

    State: ``{"window": parent state where the current step began, "emitted": outputs of it handed out}``.
    """

    def __init__(self, parent: grain.DatasetIterator, config: TrajectoryConfig):
        super().__init__(parent)
        self._config = config
        self._restart(parent.get_state(), 0)

    def _restart(self, window: dict[str, Any], skip: int) -> None:
        c = self._config
        self._packer = MicroBatchPacker(
            c.rows, c.row_length, c.max_sequences, c.open_micro_batches, experts=c.replay_experts
        )
        self._out: collections.deque[PackedBatch] = collections.deque()
        self._window = window
        self._window_used = False  # whether anything was consumed since the window began
        self._emitted = 0
        self._skip = skip
        self._step: int | None = None
        self._excluded: list[tuple[str, str]] = []
        self._stats: collections.Counter[str] = collections.Counter()

    def _take_pending(self) -> tuple[list[tuple[str, str]], dict[str, int]]:
        excluded, stats = self._excluded, dict(self._stats)
        self._excluded, self._stats = [], collections.Counter()
        return excluded, stats

    def _consume(self, element: ExecutionChunks) -> None:
        e = element.entry
        if self._step is None:
            self._step = e.step
        elif e.step != self._step:
            raise ValueError(
                f"queue entry {e.index} belongs to step {e.step} but step {self._step} has not ended "
                f"(each step must be enqueued whole, with its last entry marked)"
            )
        self._stats["executions"] += 1
        self._stats["greedy_calls"] += element.greedy_calls
        if element.excluded is not None:
            log.warning("execution %s excluded from training: %s", e.execution_id, element.excluded)
            self._excluded.append((e.execution_id, element.excluded))
            self._stats["excluded"] += 1
        else:
            sel = element.selection
            weights = [e.weight * w for w in sel.branch_weights]
            labels = [b.label for b in sel.branches]
            self._stats["branches"] += sel.num_branches
            self._stats["selected"] += sel.num_selected
            self._stats["targets"] += sel.num_targets
            for chunk in element.chunks:
                self._stats["chunk_tokens"] += chunk.size
                for packed in self._packer.add(chunk, e.advantage, weights, labels):
                    excluded, stats = self._take_pending()
                    self._out.append(
                        PackedBatch(step=e.step, packed=packed, end_of_step=False, excluded=excluded, stats=stats)
                    )
        if e.last_in_step:
            finished = self._packer.flush() or [None]  # a step with nothing to train still ends with one output
            for i, packed in enumerate(finished):
                last = i == len(finished) - 1
                excluded, stats = self._take_pending() if last else ([], {})
                self._out.append(
                    PackedBatch(step=e.step, packed=packed, end_of_step=last, excluded=excluded, stats=stats)
                )
            self._step = None

    def __next__(self) -> PackedBatch:
        while True:
            if self._out:
                item = self._out.popleft()
                self._emitted += 1
                if self._skip > 0:  # replaying after set_state: already handed out before the checkpoint
                    self._skip -= 1
                    continue
                return item
            if self._window_used and self._step is None and self._packer.empty:
                if self._skip > 0:
                    raise ValueError(
                        f"the restored state skips {self._skip} more micro-batches than its step produced: "
                        f"it does not belong to this queue"
                    )
                self._window, self._emitted = self._parent.get_state(), 0  # a new step starts here
                self._window_used = False
            element = next(self._parent)  # StopIteration: the queue holds nothing more for now
            self._window_used = True
            self._consume(element)

    def get_state(self) -> dict[str, Any]:
        if self._step is None and self._packer.empty and not self._out and self._skip == 0:
            return {"version": STATE_VERSION, "window": self._parent.get_state(), "emitted": 0}  # between steps
        return {"version": STATE_VERSION, "window": self._window, "emitted": self._emitted + self._skip}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"trajectory pipeline state version {state.get('version')!r} is not {STATE_VERSION}: "
                f"it was saved by another version of gyre_jax.trajectory"
            )
        self._parent.set_state(state["window"])
        self._restart(state["window"], int(state["emitted"]))


class PackIterDataset(grain.IterDataset):
    """Micro-batches of ``rows x row_length`` tokens from a stream of ``ExecutionChunks`` (one step at a time)."""

    def __init__(self, parent: grain.IterDataset, config: TrajectoryConfig):
        super().__init__(parent)
        self.config = config

    def __iter__(self) -> _PackIterator:
        return _PackIterator(self._parent.__iter__(), self.config)


def build_dataset(queue: ExecutionQueue, record_dir: str | os.PathLike, config: TrajectoryConfig) -> PackIterDataset:
    """The whole chain as a Grain ``IterDataset`` of ``PackedBatch``."""
    ds = QueueSource(queue).map(LoadExecution(record_dir, config)).map(SelectBranches(config)).map(BuildChunks(config))
    return PackIterDataset(ds, config)


# -- the trainer's handle ----------------------------------------------------------------------------------------------


@dataclass
class StepBatches:
    """Everything one optimizer step trains on.

    ``micro_batches[i]`` holds sequences ``sequences[i]``; ``executions`` have at least one trained
    sequence; ``excluded`` are ``(execution_id, reason)``; ``stats`` counts executions, branches,
    selected, targets (de-duplicated trainable targets), chunk_tokens (laid-out tokens),
    tokens_computed (non-padding tokens of the micro-batches), tokens_trained and rows.
    """

    step: int
    micro_batches: list[MicroBatch]
    sequences: list[list[SequenceInfo]]
    executions: list[str]
    excluded: list[tuple[str, str]]
    stats: dict[str, int]


class TrajectoryPipeline:
    """The pipeline over ``<queue_dir>/queue.jsonl`` and the record files in ``record_dir``.

    ``state``: a ``get_state()`` from a checkpoint (None: a fresh run, at the start of the queue).
    With ``discard_unsaved`` (the default), queue entries appended after that state was taken are
    dropped: the run that appended them stopped before its next checkpoint, and the trainer runs
    those steps again. Entries queued before the checkpoint but not yet trained are kept.
    """

    def __init__(
        self,
        record_dir: str | os.PathLike,
        queue_dir: str | os.PathLike,
        config: TrajectoryConfig,
        state: dict[str, Any] | None = None,
        discard_unsaved: bool = True,
    ):
        self.config = config
        self.queue = ExecutionQueue(queue_dir)
        self.dataset = build_dataset(self.queue, record_dir, config)
        self._iter = iter(self.dataset)
        if state is not None:
            self.set_state(state, discard_unsaved=discard_unsaved)
        elif discard_unsaved:
            dropped = self.queue.truncate(0, 0)
            if dropped:
                log.warning("dropped %d queued executions of an earlier attempt that no checkpoint holds", dropped)

    def enqueue(
        self,
        step: int,
        executions: list[tuple[str, float]],
        normalizer: int | None = None,
        *,
        last: bool = True,
        untrained: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        """Queues one optimizer step's finished executions ``(execution_id, advantage)``; each weighs
        ``1 / normalizer`` (default: how many are given). Durable (fsynced) when this returns. ``last=False``
        leaves the step open for more parts; ``untrained`` executions weigh 0 (``ExecutionQueue.append_step``)."""
        self.queue.append_step(step, executions, normalizer, last=last, untrained=untrained)
        kill_point("pipeline")

    def __iter__(self):
        return self._iter

    def next_step(self) -> StepBatches:
        """The micro-batches of the next queued step. Raises (consuming nothing) if no whole step is queued."""
        saved = self._iter.get_state()
        mbs, seqs, excluded = [], [], []
        stats: collections.Counter[str] = collections.Counter({k: 0 for k in STEP_STATS})
        try:
            while True:
                item = next(self._iter)
                excluded.extend(item.excluded)
                stats.update(item.stats)
                if item.packed is not None:
                    mb = item.packed.micro_batch
                    mbs.append(mb)
                    seqs.append(item.packed.sequences)
                    stats["tokens_computed"] += mb.num_tokens
                    stats["tokens_trained"] += mb.num_target_tokens
                    stats["rows"] += int(np.sum(np.any(mb.segment_ids != 0, axis=1)))
                if item.end_of_step:
                    break
        except StopIteration:
            self._iter.set_state(saved)
            raise RuntimeError("the execution queue holds no complete step to train on; enqueue() one first") from None
        executions = list(dict.fromkeys(s.execution_id for group in seqs for s in group))
        stats["sequences"] = sum(len(g) for g in seqs)
        stats["micro_batches"] = len(mbs)
        return StepBatches(
            step=item.step,
            micro_batches=mbs,
            sequences=seqs,
            executions=executions,
            excluded=excluded,
            stats=dict(stats),
        )

    def get_state(self) -> dict[str, Any]:
        """JSON-serializable state for the checkpoint: the iterator's position and the queue's length now."""
        offset, index = self.queue.end()
        return {"iterator": self._iter.get_state(), "queue_end": {"offset": offset, "index": index}}

    def set_state(self, state: dict[str, Any], discard_unsaved: bool = True) -> None:
        """Resumes from ``state``; with ``discard_unsaved``, entries queued after it was taken are dropped."""
        if discard_unsaved:
            end = state["queue_end"]
            dropped = self.queue.truncate(int(end["offset"]), int(end["index"]))
            if dropped:
                log.warning("dropped %d queued executions appended after the checkpoint", dropped)
        self._iter.set_state(state["iterator"])
