"""The host side of the programs' shapes, shared by both KV layouts: length buckets, slot buckets, prompt counts,
packing several whole prompts into rows (``pack_prompts``, the layout of ``steps.prefill_many``), and requests'
sampling settings as the programs take them. Pure functions over numpy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import jax
import numpy as np

from gyre_jax.serving.types import ContextTooLongError, SamplingParams


def buckets(sizes: Sequence[int], limit: int) -> tuple[int, ...]:
    """The distinct ``sizes`` in (0, limit), ascending, then ``limit``: the sizes one dimension compiles for."""
    return tuple(sorted({b for b in sizes if 0 < b < limit})) + (limit,)


def bucket(sizes: Sequence[int], n: int) -> int:
    """The smallest of ``sizes`` (ascending) holding ``n``; raises ContextTooLongError past the largest."""
    for b in sizes:
        if b >= n:
            return b
    raise ContextTooLongError(f"prompt chunk of {n} tokens exceeds the largest prefill bucket {sizes[-1]}")


def slot_buckets(given: Sequence[int] | None, slots: int, on_one_device: bool) -> tuple[int, ...]:
    """The numbers of leading slots a generate step may run over: ``given``, by default the powers of 2 when the
    slots live on one device (slicing slots split over devices would move them), else only all of them."""
    if given is None:
        given = [2**i for i in range(slots.bit_length())] if on_one_device else []
    return buckets(given, slots)


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prompt_count_bucket(count: int) -> int:
    """The prompts one ``prefill_many`` program takes for ``count`` prompts: the next power of 2."""
    return pow2_at_least(count)


def packed_row_buckets(prompts: int) -> tuple[int, ...]:
    """The packed row counts ``prefill_many`` compiles for a ``prompts`` (a power of 2) bucket: half, three quarters
    and all of it (one prompt per row, the most any mix needs; prompts of a quarter to all of the longest's bucket
    need ~0.7 rows each)."""
    return tuple(sorted({max(1, prompts // 2), max(1, 3 * prompts // 4), prompts}))


def prompt_counts(slots: int) -> list[int]:
    """The prompt-count buckets ``prefill_many`` takes on ``slots`` slots: 2, 4, ... up to the one holding them all."""
    out, count = [], 2
    while slots >= 2 and count // 2 < slots:
        out.append(count)
        count *= 2
    return out


class PrefillSizes(Protocol):
    max_prefill_length: int
    max_seq_len: int
    prefill_buckets: tuple[int, ...]


def pack_prompts(prompts: Sequence[Sequence[int]], sizes: PrefillSizes) -> tuple[np.ndarray, ...]:
    """Whole prompts packed side by side in rows as wide as the bucket of the longest (first fit, longest first):
    tokens, positions, segments [rows, width] and each prompt's row, offset and length [P] (``steps.prefill_many``'s
    layout; P = ``prompt_count_bucket``, the padding prompts of length 0; rows the smallest of
    ``packed_row_buckets(P)`` that holds them). Raises for a prompt one prefill program cannot take."""
    longest = max(len(p) for p in prompts)
    if min(len(p) for p in prompts) == 0:
        raise ValueError("cannot prefill an empty prompt")
    if longest > sizes.max_prefill_length or longest >= sizes.max_seq_len:
        raise ContextTooLongError(
            f"prompt of {longest} tokens exceeds max_prefill_length={sizes.max_prefill_length} (or leaves no "
            f"room within max_seq_len={sizes.max_seq_len}); prefill it alone, in chunks"
        )
    width, count = bucket(sizes.prefill_buckets, longest), prompt_count_bucket(len(prompts))
    used: list[int] = []  # tokens taken in each row so far
    where = np.zeros((2, count), np.int32)  # each prompt's (row, offset)
    for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
        row = next((r for r, u in enumerate(used) if u + len(prompts[i]) <= width), len(used))
        if row == len(used):
            used.append(0)
        where[:, i] = row, used[row]
        used[row] += len(prompts[i])
    rows = next(b for b in packed_row_buckets(count) if b >= len(used))
    tokens, positions, segments = (np.zeros((rows, width), np.int32) for _ in range(3))
    lengths = np.zeros((count,), np.int32)
    for i, p in enumerate(prompts):
        (row, start), n = where[:, i], len(p)
        tokens[row, start : start + n], positions[row, start : start + n] = p, np.arange(n)
        segments[row, start : start + n], lengths[i] = i + 1, n
    return tokens, positions, segments, where[0], where[1], lengths


def one_token_prompts(rows: int, width: int, count: int) -> tuple[np.ndarray, ...]:
    """A ``pack_prompts`` layout of ``rows`` x ``width`` with one one-token prompt per row and ``count - rows``
    padding prompts (``warmup``: any packed shape, whether or not a prompt mix packs into it)."""
    tokens, positions, segments = (np.zeros((rows, width), np.int32) for _ in range(3))
    segments[:, 0] = np.arange(1, rows + 1)
    row, lengths = np.zeros((count,), np.int32), np.zeros((count,), np.int32)
    row[:rows], lengths[:rows] = np.arange(rows), 1
    return tokens, positions, segments, row, np.zeros((count,), np.int32), lengths


def sampling_args(sp: SamplingParams) -> tuple:
    """(temperature [] f32, top_k [] int32, top_p [] f32): a request's sampling settings as the programs take them."""
    return np.float32(sp.temperature), np.int32(sp.top_k), np.float32(sp.top_p)


def sampling_rows(sampling: Sequence[SamplingParams], rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``sampling_args`` of several requests as [rows] arrays, padded to ``rows`` with the first request's."""
    sp = [*sampling, *[sampling[0]] * (rows - len(sampling))]
    return (
        np.asarray([x.temperature for x in sp], np.float32),
        np.asarray([x.top_k for x in sp], np.int32),
        np.asarray([x.top_p for x in sp], np.float32),
    )


def key_rows(keys: Sequence, rows: int) -> np.ndarray:
    """Sampling keys [2] each as one [rows, 2] uint32 host array, padded with the first."""
    host = [np.asarray(k, np.uint32) for k in jax.device_get(list(keys))]
    return np.stack([*host, *[host[0]] * (rows - len(host))])
