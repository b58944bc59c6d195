"""Strict, streaming reading of one execution's TITO record file for training.

The trainer only learns from an execution whose record log is whole. ``iter_records`` yields the
records of ``<record_dir>/<execution_id>.jsonl`` one at a time (an execution's prompts can add up to
gigabytes, so they are never all held) and raises ``CorruptRecords`` with a reason that names the
file, the line and what was wrong. The checks:

- the file exists and holds at least one record;
- every line ends with a newline: a last line without one means the write was cut off (truncated
  file). ``RecordStore.read`` ignores such a line for other readers; the trainer excludes the
  execution instead of training on a log that ends in the middle of a call;
- every line parses as a ``TitoRecord`` of this execution, with ``call_index`` equal to its line
  number (the proxy assigns indices as it appends, so a gap or a reordering means lost records);
- completion log-probs are finite and <= 0, temperatures finite and >= 0 (0 is a greedy call, served
  under ``proxy.sampling = "client"``: read, kept as context, never trained: ``branches.py``),
  ``client_sampling`` an object or null, and, when ``vocab_size`` is given, every token id lies in
  ``[0, vocab_size)``.

An execution that fails a check is excluded from training with that reason; the pipeline goes on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gyre_jax.proxy.records import AGENT_KINDS, TitoRecord


class CorruptRecords(ValueError):
    """An execution's record file cannot be trained on; ``str(error)`` says why."""


class NoRecords(CorruptRecords):
    """An execution has no recorded model call (no file, or an empty one): nothing is damaged, its harness made no
    call the proxy served (it crashed first, or every call was refused: see its result's ``refused_calls``)."""


def _check_ids(ids, what: str, vocab_size: int | None, where: str) -> None:
    if not all(type(i) is int for i in ids):
        raise CorruptRecords(f"{where}: {what} must be a list of integers")
    if vocab_size is not None and ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i in ids if i < 0 or i >= vocab_size)
        raise CorruptRecords(
            f"{where}: {what} holds token id {bad}, outside [0, {vocab_size}) of the model's vocabulary"
        )


def check_token_ids(ids, vocab_size: int | None, where: str):
    """[L] token ids -> int32 array, or ``CorruptRecords`` if they are not integers in ``[0, vocab_size)``."""
    arr = np.asarray(ids)
    if arr.size and arr.dtype.kind not in "iu":
        raise CorruptRecords(f"{where}: token ids must be integers (found {arr.dtype} values)")
    if vocab_size is not None and arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
        raise CorruptRecords(f"{where}: token id {bad} is outside [0, {vocab_size}) of the model's vocabulary")
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise CorruptRecords(f"{where}: token ids must fit in int32")
    return arr.astype(np.int32, copy=False)


def parse_record(line: str, execution_id: str, line_no: int, vocab_size: int | None, where: str) -> TitoRecord:
    """One line -> a validated ``TitoRecord`` (``line_no`` counts from 0), or ``CorruptRecords``."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise CorruptRecords(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise CorruptRecords(f"{where}: expected a JSON object, got {type(obj).__name__}")
    try:
        rec = TitoRecord(**obj)
    except TypeError as e:  # missing or unknown fields
        raise CorruptRecords(f"{where}: not a TITO record ({e})") from None
    except ValueError as e:  # TitoRecord's own length check
        raise CorruptRecords(f"{where}: {e}") from None
    if rec.execution_id != execution_id:
        raise CorruptRecords(f"{where}: record of execution {rec.execution_id!r} in the file of {execution_id!r}")
    if rec.call_index != line_no:
        raise CorruptRecords(
            f"{where}: call_index {rec.call_index} where {line_no} was expected "
            f"(records are appended in call order: one is missing or out of place)"
        )
    if not isinstance(rec.thread_id, str) or not rec.thread_id:
        raise CorruptRecords(f"{where}: thread_id must be a non-empty string")
    if rec.agent_kind not in AGENT_KINDS:
        raise CorruptRecords(f"{where}: agent_kind {rec.agent_kind!r} must be one of {AGENT_KINDS}")
    if not isinstance(rec.prompt_ids, list) or not isinstance(rec.completion_ids, list):
        raise CorruptRecords(f"{where}: prompt_ids and completion_ids must be lists")
    # Prompt ids are checked once they are laid out in branches (``check_token_ids``): a prompt repeats its
    # thread's earlier tokens, so checking every prompt in full would cost quadratic time on long runs.
    _check_ids(rec.completion_ids, "completion_ids", vocab_size, where)
    if not all(isinstance(x, (int, float)) and math.isfinite(x) and x <= 1e-4 for x in rec.completion_logprobs):
        raise CorruptRecords(f"{where}: completion_logprobs must be finite log-probabilities (<= 0)")
    if not all(type(v) is int for v in rec.policy_versions):
        raise CorruptRecords(f"{where}: policy_versions must be integers")
    if not (isinstance(rec.temperature, (int, float)) and math.isfinite(rec.temperature) and rec.temperature >= 0):
        raise CorruptRecords(f"{where}: temperature {rec.temperature!r} must be a finite number >= 0 (0: greedy)")
    if rec.client_sampling is not None and not isinstance(rec.client_sampling, dict):
        raise CorruptRecords(f"{where}: client_sampling must be an object or null")
    if not rec.prompt_ids:
        raise CorruptRecords(f"{where}: empty prompt_ids")
    return rec


def iter_records(path: str | Path, execution_id: str, vocab_size: int | None = None) -> Iterator[TitoRecord]:
    """Yields the execution's records in call order; raises ``CorruptRecords`` at the first problem."""
    path = Path(path)
    if not path.exists():
        raise NoRecords(f"{path}: no record file (the execution made no recorded model call)")
    count = 0
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            for line_no, line in enumerate(f):
                where = f"{path}:{line_no + 1}"
                if not line.endswith("\n"):
                    raise CorruptRecords(
                        f"{where}: truncated file: the last line has no newline (the write was cut off)"
                    )
                if not line.strip():
                    raise CorruptRecords(f"{where}: blank line")
                yield parse_record(line, execution_id, line_no, vocab_size, where)
                count += 1
        except UnicodeDecodeError as e:
            raise CorruptRecords(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a line)") from None
    if count == 0:
        raise NoRecords(f"{path}: empty record file (no recorded model call)")
