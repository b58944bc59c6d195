"""Prefix-tree layout of an execution's selected branches: chunks that each fit one packed row.

The tree's nodes are targets ``(tokens[t], tokens[t + 1])`` (see ``select.py``): a node's input is
``tokens[t]``, its target ``tokens[t + 1]``, its position its depth ``t``. Sorting the branches'
token sequences lexicographically gives a depth-first order of the tree; branch ``k`` then adds the
nodes of its path below its common prefix with the branch before it (``start = lcp - 1``: where two
branches diverge at token ``d``, the input token ``d - 1`` appears once per child, because its
target differs). Attention is ancestor-only: ``subtree_end[i]`` is one past the last descendant of
node ``i`` (the ``attention_mask`` contract of ``batch.py``).

A tree larger than a row is cut into *chunks*: runs of consecutive branches (in depth-first order)
whose union fits ``row_length``; each chunk repeats the ancestors it needs, so chunks are
independent. A target is trained (``loss_mask`` = 1) only in the chunk holding the branch it is
assigned to, so every branch's whole sequence sits in one row (GSPO's ratio needs all of it) and
every target is trained once. Plain packing uses one branch per chunk: the same arrays with no
sharing (the fallback, and the reference the tree layout must equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre_jax.trajectory.select import Selection


@dataclass(frozen=True)
class Chunk:
    """One row's worth of an execution's tree, all arrays [N] (N <= row_length):

    tokens/targets/positions/subtree_end (chunk-relative)/versions/seq: int32; loss_mask/old_logprobs/
    temperature: float32. ``seq[i]`` indexes ``sequences`` (the selected-branch indices trained
    here); it is meaningful where ``loss_mask`` is 1. ``experts``: [N, L_moe, K] int16, the recorded
    experts of each node's input token (-1 = none; routing replay), or None when no member recorded any.
    """

    execution_id: str
    tokens: np.ndarray
    targets: np.ndarray
    positions: np.ndarray
    subtree_end: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: np.ndarray
    temperature: np.ndarray
    versions: np.ndarray
    seq: np.ndarray
    sequences: tuple[int, ...]
    experts: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


def dfs_order(sel: Selection) -> list[int]:
    """Selected-branch indices in depth-first order of the prefix tree (lexicographic token order)."""
    return sorted(range(sel.num_selected), key=lambda k: sel.branches[k].tokens)


def _start(sel: Selection, prev: int | None, k: int) -> int:
    """First depth of branch k's nodes not already laid out by ``prev`` (the branch before it)."""
    n = len(sel.arrays[k].tokens) - 1
    if prev is None:
        return 0
    return min(max(int(sel.lcp[prev, k]) - 1, 0), n)


def _placement(sel: Selection, members: list[int]) -> tuple[list[int], list[int]]:
    """Where each member's nodes go: (starts [M]: its first depth not laid out by the member before it,
    offsets [M + 1]: member i's nodes are chunk positions offsets[i] .. offsets[i + 1] - 1)."""
    starts, offsets = [], [0]
    prev = None
    for k in members:
        s = _start(sel, prev, k)
        starts.append(s)
        offsets.append(offsets[-1] + len(sel.arrays[k].tokens) - 1 - s)
        prev = k
    return starts, offsets


def _subtree_ends(sel: Selection, members: list[int], idx: int, start: int, offsets: list[int]) -> np.ndarray:
    """[nodes of member idx] int32: one past the last descendant of each of member idx's nodes (chunk positions).

    Descendants of node (k, t) end with the last later member that still shares it (t < lcp - 1); lcp
    between sorted sequences is the running minimum of adjacent lcps."""
    lo, hi = offsets[idx], offsets[idx + 1]
    ends = np.full((hi - lo,), hi, np.int32)
    run = None
    for nxt in range(idx + 1, len(members)):
        adj = int(sel.lcp[members[nxt - 1], members[nxt]])
        run = adj if run is None else min(run, adj)
        cut = run - 1 - start
        if cut <= 0:
            break
        ends[: min(cut, hi - lo)] = offsets[nxt + 1]
    return ends


def _trained_here(sel: Selection, k: int, start: int, lo: int, local: dict[int, int]):
    """Yields (o, where, src) for each branch o trained in this chunk that owns targets among branch k's
    nodes from depth ``start`` on: ``where`` their chunk positions, ``src`` their indices in o's arrays."""
    depth = np.arange(start, len(sel.arrays[k].tokens) - 1, dtype=np.int32)
    owner = sel.owners(k)[start : len(sel.arrays[k].tokens) - 1]  # [nodes]
    for o in np.unique(owner[owner >= 0]):
        o = int(o)
        if o not in local:
            continue  # trained in the chunk that holds branch o
        hit = owner == o
        yield o, np.flatnonzero(hit) + lo, depth[hit] + 1


def layout(sel: Selection, members: list[int]) -> Chunk:
    """Lays out the union of ``members``' paths (consecutive in depth-first order) as one chunk."""
    starts, offsets = _placement(sel, members)
    n = offsets[-1]
    tokens, targets, positions, subtree_end, seq = (np.zeros((n,), np.int32) for _ in range(5))
    loss_mask, old_logprobs = np.zeros((n,), np.float32), np.zeros((n,), np.float32)
    temperature = np.ones((n,), np.float32)
    versions = np.full((n,), -1, np.int32)
    local = {k: i for i, k in enumerate(members)}
    shapes = [sel.arrays[k].experts.shape[1:] for k in members if sel.arrays[k].experts is not None]
    experts = np.full((n, *shapes[0]), -1, np.int16) if shapes else None
    for idx, k in enumerate(members):
        a, s, lo, hi = sel.arrays[k], starts[idx], offsets[idx], offsets[idx + 1]
        if hi == lo:
            continue
        length = len(a.tokens)
        tokens[lo:hi] = a.tokens[s : length - 1]
        if a.experts is not None:
            experts[lo:hi] = a.experts[s : length - 1]  # a node's routing is its input token's
        targets[lo:hi] = a.tokens[s + 1 : length]
        positions[lo:hi] = np.arange(s, length - 1, dtype=np.int32)
        subtree_end[lo:hi] = _subtree_ends(sel, members, idx, s, offsets)
        for o, where, src in _trained_here(sel, k, s, lo, local):
            ao = sel.arrays[o]
            loss_mask[where] = 1.0
            old_logprobs[where] = ao.logprobs[src]
            temperature[where] = ao.temperature[src]
            versions[where] = ao.versions[src]
            seq[where] = local[o]
    return Chunk(
        execution_id=sel.execution_id,
        tokens=tokens,
        targets=targets,
        positions=positions,
        subtree_end=subtree_end,
        loss_mask=loss_mask,
        old_logprobs=old_logprobs,
        temperature=temperature,
        versions=versions,
        seq=seq,
        sequences=tuple(members),
        experts=experts,
    )


def max_path_len(sel: Selection) -> int:
    """Nodes on the longest root-to-leaf path (the row length a branch needs)."""
    return max((len(a.tokens) - 1 for a in sel.arrays), default=0)


def tree_chunks(sel: Selection, row_length: int, max_sequences: int) -> list[Chunk]:
    """The execution's prefix tree cut into chunks of at most ``row_length`` nodes and ``max_sequences`` branches."""
    if max_path_len(sel) > row_length:
        raise ValueError(
            f"a branch of {max_path_len(sel) + 1} tokens needs rows of >= {max_path_len(sel)} tokens "
            f"(row_length={row_length})"
        )
    chunks, members, size, prev = [], [], 0, None
    for k in dfs_order(sel):
        cost = len(sel.arrays[k].tokens) - 1 - _start(sel, prev, k)
        if members and (size + cost > row_length or len(members) >= max_sequences):
            chunks.append(layout(sel, members))
            members, size, prev = [], 0, None
            cost = len(sel.arrays[k].tokens) - 1
        members.append(k)
        size += cost
        prev = k
    if members:
        chunks.append(layout(sel, members))
    return chunks


def plain_chunks(sel: Selection, row_length: int) -> list[Chunk]:
    """One chunk per selected branch (no shared prefixes): plain sequence packing."""
    if max_path_len(sel) > row_length:
        raise ValueError(
            f"a branch of {max_path_len(sel) + 1} tokens needs rows of >= {max_path_len(sel)} tokens "
            f"(row_length={row_length})"
        )
    return [layout(sel, [k]) for k in range(sel.num_selected)]
