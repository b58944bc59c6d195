"""Tests for gyre_jax/trajectory/tree.py: the prefix-tree layout, its ancestor-only attention, and chunking.

Every property is checked from the chunk arrays alone: the ancestors a node may attend to (by the
``attention_mask`` rule ``j <= i < subtree_end[j]``) must spell exactly the prefix of a selected
branch, nodes are unique within a chunk (shared prefixes laid out once), and each target the naive
de-duplication assigns is trained exactly once, with the behaviour values of the branch it belongs to.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.trajectory.branches import Branch, build_branches
from gyre_jax.trajectory.select import execution_rng, select
from gyre_jax.trajectory.tree import dfs_order, layout, plain_chunks, tree_chunks


def naive_owners(branches):
    owner = {}
    for j, b in enumerate(branches):
        for t in range(len(b.tokens) - 1):
            if b.trainable[t + 1]:
                owner.setdefault(tuple(b.tokens[: t + 2]), j)
    return owner


def node_prefixes(chunk) -> list[tuple[int, ...]]:
    """Each node's full prefix (ancestor inputs, then its target), read back through the attention rule."""
    out = []
    for i in range(chunk.size):
        anc = [j for j in range(i + 1) if i < chunk.subtree_end[j]]
        assert list(chunk.positions[anc]) == list(range(chunk.positions[i] + 1)), "ancestors must be one per depth"
        out.append(tuple(int(x) for x in chunk.tokens[anc]) + (int(chunk.targets[i]),))
    return out


def check_chunks(sel, chunks, row_length, max_sequences):
    owner = naive_owners(sel.branches)
    trained: dict[tuple[int, ...], int] = {}
    placed = []
    for chunk in chunks:
        assert chunk.size <= row_length and 1 <= len(chunk.sequences) <= max_sequences
        assert np.all(chunk.subtree_end > np.arange(chunk.size)) and np.all(chunk.subtree_end <= chunk.size)
        prefixes = node_prefixes(chunk)
        assert len(set(prefixes)) == len(prefixes), "a node appears once per chunk"
        members = [sel.branches[k] for k in chunk.sequences]
        placed.extend(chunk.sequences)
        # Exactly the members' paths: every node lies on a member's path, and every member's path is complete.
        member_prefixes = {tuple(b.tokens[: t + 2]) for b in members for t in range(len(b.tokens) - 1)}
        assert set(prefixes) == member_prefixes
        for i, p in enumerate(prefixes):
            if chunk.loss_mask[i] == 0:
                continue
            o = owner[p]
            assert chunk.sequences[chunk.seq[i]] == o, "a target is trained in the sequence it is assigned to"
            b, t = sel.branches[o], len(p) - 1
            assert chunk.old_logprobs[i] == np.float32(b.logprobs[t])
            assert chunk.temperature[i] == np.float32(b.temperature[t])
            assert chunk.versions[i] == b.versions[t]
            assert p not in trained, "trained once"
            trained[p] = o
    assert sorted(placed) == list(range(sel.num_selected))
    assert trained == owner  # every assigned target is trained, in its own branch's sequence


@settings(max_examples=120, deadline=None)
@given(
    data=st.data(),
    cap=st.sampled_from([None, 2, 5]),
    row_length=st.sampled_from([48, 64, 200]),
    max_sequences=st.sampled_from([1, 2, 8]),
)
def test_tree_chunks_are_the_prefix_tree_with_ancestor_only_attention(executions, data, cap, row_length, max_sequences):
    branches = build_branches(data.draw(executions("ex")))
    sel = select("ex", branches, cap, execution_rng(0, "ex"))
    chunks = tree_chunks(sel, row_length, max_sequences)
    check_chunks(sel, chunks, row_length, max_sequences)
    plain = plain_chunks(sel, row_length)
    check_chunks(sel, plain, row_length, 1)
    for chunk in plain:  # plain rows: causal over one whole branch
        b = sel.branches[chunk.sequences[0]]
        np.testing.assert_array_equal(chunk.tokens, b.tokens[:-1])
        np.testing.assert_array_equal(chunk.positions, np.arange(len(b.tokens) - 1))
        assert np.all(chunk.subtree_end == chunk.size)
    # Sharing only ever removes work: the tree lays out at most as many tokens as the branches one by one.
    assert sum(c.size for c in chunks) <= sum(c.size for c in plain)
    if len(chunks) == 1:  # one chunk = the whole prefix tree: one node per distinct (prefix, target)
        distinct = {tuple(b.tokens[: t + 2]) for b in sel.branches for t in range(len(b.tokens) - 1)}
        assert chunks[0].size == len(distinct)


def _branch(tokens, trainable, label="main"):
    n = len(tokens)
    return Branch(
        execution_id="ex",
        thread_id="main",
        label=label,
        tokens=list(tokens),
        trainable=list(trainable),
        logprobs=[-0.5 if t else 0.0 for t in trainable],
        temperature=[1.0] * n,
        versions=[0 if t else -1 for t in trainable],
    )


def test_layout_of_a_concrete_tree():
    # system [1, 2], then main goes on with [3, 4] and a summary with [5]; a retry re-samples [3] then 6.
    main = _branch([1, 2, 3, 4], [False, False, True, True])
    summary = _branch([1, 2, 5], [False, False, True], label="main-summary")
    retry = _branch([1, 2, 3, 6], [False, False, True, True], label="main-summary")
    sel = select("ex", [main, summary, retry], None)
    assert [b.tokens for b in sel.branches] == [main.tokens, summary.tokens, retry.tokens]
    assert [sel.branches[k].tokens for k in dfs_order(sel)] == [[1, 2, 3, 4], [1, 2, 3, 6], [1, 2, 5]]
    (chunk,) = tree_chunks(sel, 16, 8)
    # Nodes (input -> target): 1->2, 2->3, 3->4 | 3->6 (input 3 repeated: its target differs) | 2->5 (input 2 repeated)
    np.testing.assert_array_equal(chunk.tokens, [1, 2, 3, 3, 2])
    np.testing.assert_array_equal(chunk.targets, [2, 3, 4, 6, 5])
    np.testing.assert_array_equal(chunk.positions, [0, 1, 2, 2, 1])
    np.testing.assert_array_equal(chunk.subtree_end, [5, 4, 3, 4, 5])
    # 2->3 was generated by main and by the retry: trained once, in main's sequence (selected first).
    np.testing.assert_array_equal(chunk.loss_mask, [0, 1, 1, 1, 1])
    assert [chunk.sequences[s] for s, m in zip(chunk.seq, chunk.loss_mask) if m] == [0, 0, 2, 1]
    # Rows of 3 tokens: each chunk repeats the ancestors it needs; the shared target is still trained once.
    small = tree_chunks(sel, 3, 8)
    assert [c.size for c in small] == [3, 3, 2]
    assert sum(c.loss_mask.sum() for c in small) == 4


def test_branches_longer_than_a_row_are_refused_with_the_needed_length():
    sel = select("ex", [_branch(range(10), [False] * 5 + [True] * 5)], None)
    with pytest.raises(ValueError, match=r"needs rows of >= 9 tokens \(row_length=8\)"):
        tree_chunks(sel, 8, 4)
    with pytest.raises(ValueError, match="row_length=8"):
        plain_chunks(sel, 8)
    assert layout(sel, [0]).size == 9
