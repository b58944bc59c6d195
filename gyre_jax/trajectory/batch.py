"""Micro-batches for the learner: the ``MicroBatch`` record, its attention mask, and simple builders.

Every token array is ``[B, T]``; every token belongs to one sequence ``seq_index`` whose per-sequence
values (``advantages``, ``seq_weights``) are ``[S]``. Inputs are ``tokens[:-1]`` and targets
``tokens[1:]`` of each branch; a target is trainable where the policy generated it. The trajectory
pipeline (``packing.py``) fills micro-batches with tree-packed or plainly packed rows; the builders
here (``make_micro_batches``: one branch per row; ``supervised_micro_batch``) are the simple layouts.

Attention is described by ``segment_ids`` and ``subtree_end``: token ``i`` may attend to token ``j``
iff both are in the same non-zero segment, ``j <= i`` and ``i < subtree_end[j]`` (tokens laid out in
depth-first order of a prefix tree; ``subtree_end[j]`` is one past the last token below ``j``). For a
plain sequence ``subtree_end`` is the end of its segment and this is the usual causal mask; for a
tree-packed row it is ancestor-only attention. ``attention_mask`` builds it inside jit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import numpy as np

from gyre_jax.model.attention import tree_causal_mask
from gyre_jax.trajectory.branches import Branch


@jax.tree_util.register_dataclass
@dataclass
class MicroBatch:
    """tokens/positions/segment_ids/subtree_end/targets/seq_index: [B, T] int32; loss_mask/old_logprobs/
    temperature: [B, T] float32; advantages/seq_weights: [S] float32; versions: [B, T] int32 or None.

    ``positions`` are RoPE positions (a token's index in its own sequence: its depth in a tree);
    ``versions`` is the policy version that sampled each trainable target (-1 elsewhere), for
    staleness metrics; it is not used by the loss. ``expert_ids``: [B, T, L_moe, K] int16 or None (routing
    replay, ``rl.routing_replay = "replay"``): the experts serving selected for each input token, which the
    learner's forward uses instead of its own top-k; a row of -1 routes that token itself. None (dense
    models, replay off): the model routes every token, at no cost.
    """

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    subtree_end: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: np.ndarray
    temperature: np.ndarray
    seq_index: np.ndarray
    advantages: np.ndarray
    seq_weights: np.ndarray
    versions: np.ndarray | None = None
    expert_ids: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(np.sum(self.segment_ids != 0))

    @property
    def num_target_tokens(self) -> int:
        return int(np.sum(self.loss_mask > 0))


def attention_mask(segment_ids: jax.Array, subtree_end: jax.Array) -> jax.Array:
    """[B, T] x2 -> [B, T, T] bool: query i sees key j iff same non-zero segment, j <= i < subtree_end[j].

    The dense form of the packed-row rule (``model.attention.tree_causal_mask``; the model's forwards build
    it, or its mask-free ``MaskSpec``, with ``model.attention.tree_mask`` per ``attention_impl``)."""
    return tree_causal_mask(segment_ids, subtree_end)


def empty_micro_batch(b: int, t: int, s: int, experts: tuple[int, int] | None = None) -> MicroBatch:
    """An all-padding micro-batch: [b, t] token arrays, [s] sequence arrays; with ``experts`` = (L_moe, K),
    ``expert_ids`` [b, t, L_moe, K] all -1 (routing replay)."""
    return MicroBatch(
        tokens=np.zeros((b, t), np.int32),
        positions=np.zeros((b, t), np.int32),
        segment_ids=np.zeros((b, t), np.int32),
        subtree_end=np.zeros((b, t), np.int32),
        targets=np.zeros((b, t), np.int32),
        loss_mask=np.zeros((b, t), np.float32),
        old_logprobs=np.zeros((b, t), np.float32),
        temperature=np.ones((b, t), np.float32),
        seq_index=np.zeros((b, t), np.int32),
        advantages=np.zeros((s,), np.float32),
        seq_weights=np.zeros((s,), np.float32),
        versions=np.full((b, t), -1, np.int32),
        expert_ids=None if experts is None else np.full((b, t, *experts), -1, np.int16),
    )


def _empty(b: int, t: int) -> MicroBatch:
    mb = empty_micro_batch(b, t, b)
    mb.seq_index[:] = np.arange(b, dtype=np.int32)[:, None]  # one sequence per row
    return mb


def row_length(max_len: int, multiple: int = 128) -> int:
    return max(multiple, int(math.ceil(max_len / multiple)) * multiple)


def make_micro_batches(
    branches: list[Branch],
    advantages: list[float],
    seq_weights: list[float],
    micro_batch_size: int,
    multiple: int = 128,
) -> list[MicroBatch]:
    """Pads ``branches`` into micro-batches of ``micro_batch_size`` rows (last one padded with empty rows)."""
    if not branches:
        return []
    length = row_length(max(len(b.tokens) - 1 for b in branches), multiple)
    out = []
    for start in range(0, len(branches), micro_batch_size):
        chunk = list(range(start, min(start + micro_batch_size, len(branches))))
        mb = _empty(micro_batch_size, length)
        for row, i in enumerate(chunk):
            br = branches[i]
            n = len(br.tokens) - 1
            mb.tokens[row, :n] = br.tokens[:-1]
            mb.positions[row, :n] = np.arange(n)
            mb.segment_ids[row, :n] = 1
            mb.subtree_end[row, :n] = n
            mb.targets[row, :n] = br.tokens[1:]
            mb.loss_mask[row, :n] = np.asarray(br.trainable[1:], np.float32)
            mb.old_logprobs[row, :n] = br.logprobs[1:]
            mb.temperature[row, :n] = br.temperature[1:]
            mb.versions[row, :n] = br.versions[1:]
            mb.advantages[row] = advantages[i]
            mb.seq_weights[row] = seq_weights[i]
        out.append(mb)
    return out


def supervised_micro_batch(
    sequences: list[tuple[list[int], list[bool]]], total_targets: int, length: int
) -> MicroBatch:
    """A micro-batch for the supervised warm start: ``loss_mask`` holds per-token weights 1/total_targets."""
    mb = _empty(len(sequences), length)
    for row, (ids, trainable) in enumerate(sequences):
        n = min(len(ids) - 1, length)
        mb.tokens[row, :n] = ids[:n]
        mb.positions[row, :n] = np.arange(n)
        mb.segment_ids[row, :n] = 1
        mb.subtree_end[row, :n] = n
        mb.targets[row, :n] = ids[1 : n + 1]
        mb.loss_mask[row, :n] = np.asarray(trainable[1 : n + 1], np.float32) / max(total_targets, 1)
    return mb


def replace(mb: MicroBatch, **changes) -> MicroBatch:
    return dataclasses.replace(mb, **changes)
