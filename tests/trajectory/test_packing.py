"""Tests for gyre_jax/trajectory/packing.py, and the invariant tree packing exists for:

tree-packed per-token log-probs, GSPO loss and gradients equal the same computation on the selected
branches expanded one per row (each row masked to the targets the naive de-duplication assigns to
its branch, with the same sequence weights). The model is the project's Qwen3-style decoder and the
log-probs come from the learner's ``token_logprobs`` (the packed-mask interface). Every micro-batch
has the same shape ([2, 48], 8 sequence slots), so the objective compiles once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.model.config import ModelConfig
from gyre_jax.model.modules import Transformer
from gyre_jax.rl.learner import token_logprobs
from gyre_jax.rl.losses import GSPOParams, LossInputs, gspo_loss
from gyre_jax.trajectory.batch import empty_micro_batch
from gyre_jax.trajectory.branches import Branch, build_branches
from gyre_jax.trajectory.packing import MicroBatchPacker
from gyre_jax.trajectory.select import execution_rng, select
from gyre_jax.trajectory.tree import layout, plain_chunks, tree_chunks

CFG = ModelConfig(
    vocab_size=8, num_layers=2, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, rope_theta=10000.0
)
ROWS, T, S = 2, 48, 8
CLIP = GSPOParams(
    clip_low=0.999, clip_high=1e6
)  # wide: no sequence is clipped, so every one carries gradient and the comparison bites


@pytest.fixture(scope="module")
def model():
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))

    @jax.jit
    def objective(params, mb):
        def loss_fn(p):
            logp = token_logprobs(graphdef, p, mb)  # [B, T]
            loss, _ = gspo_loss(LossInputs.of(mb, logp), CLIP)
            return loss, logp

        (loss, logp), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, logp, grads

    return params, objective


def evaluate(model, batches):
    """batches: [(MicroBatch, [(execution_id, branch) per sequence])] -> (loss, grads, {(exec, branch, depth): logp})."""
    params, objective = model
    total, grads, logps = 0.0, None, {}
    for mb, seqs in batches:
        loss, logp, g = objective(params, mb)
        total += float(loss)
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        logp = np.asarray(logp)
        for b, t in zip(*np.nonzero(mb.loss_mask)):
            key = seqs[mb.seq_index[b, t]] + (int(mb.positions[b, t]),)
            assert key not in logps, "a target trained twice"
            logps[key] = float(logp[b, t])
    return total, grads, logps


def packed_batches(executions, mode):
    """executions: [(execution_id, Selection, advantage, execution weight)] -> packed micro-batches."""
    packer, out = MicroBatchPacker(ROWS, T, S), []
    for _eid, sel, adv, weight in executions:
        chunks = tree_chunks(sel, T, S) if mode == "tree" else plain_chunks(sel, T)
        for chunk in chunks:
            out += packer.add(chunk, adv, [weight * w for w in sel.branch_weights], [b.label for b in sel.branches])
    out += packer.flush()
    return [(p.micro_batch, [(s.execution_id, s.branch) for s in p.sequences]) for p in out]


def expanded_batches(executions):
    """The reference: each selected branch alone in its row; masks from a naive de-duplication by prefix."""
    rows = []
    for eid, sel, adv, weight in executions:
        owner = {}
        for k, b in enumerate(sel.branches):
            for t in range(len(b.tokens) - 1):
                if b.trainable[t + 1]:
                    owner.setdefault(tuple(b.tokens[: t + 2]), k)
        for k, b in enumerate(sel.branches):
            mask = [owner.get(tuple(b.tokens[: t + 2])) == k for t in range(len(b.tokens) - 1)]
            rows.append((eid, k, b, mask, adv, weight / sel.num_selected))
    out = []
    for start in range(0, len(rows), ROWS):
        mb, seqs = empty_micro_batch(ROWS, T, S), []
        for r, (eid, k, b, mask, adv, w) in enumerate(rows[start : start + ROWS]):
            n = len(b.tokens) - 1
            mb.tokens[r, :n], mb.targets[r, :n] = b.tokens[:-1], b.tokens[1:]
            mb.positions[r, :n], mb.segment_ids[r, :n], mb.subtree_end[r, :n] = np.arange(n), 1, n
            mb.loss_mask[r, :n] = mask
            mb.old_logprobs[r, :n], mb.temperature[r, :n] = b.logprobs[1:], b.temperature[1:]
            mb.seq_index[r, :n] = r
            mb.advantages[r], mb.seq_weights[r] = adv, w
            seqs.append((eid, k))
        out.append((mb, seqs))
    return out


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    n_exec=st.integers(1, 3),
    cap=st.sampled_from([None, 1, 3]),
    advantages=st.lists(st.floats(-2.0, 2.0, width=32), min_size=3, max_size=3),
)
def test_tree_packed_logprobs_loss_and_gradients_equal_the_branches_expanded_one_by_one(
    model, executions, data, n_exec, cap, advantages
):
    execs = []
    for i in range(n_exec):
        eid = f"e{i}"
        sel = select(eid, build_branches(data.draw(executions(eid))), cap, execution_rng(0, eid))
        if sel.num_selected:
            execs.append((eid, sel, advantages[i], 1.0 / n_exec))
    if not execs:
        return
    loss_ref, grads_ref, logp_ref = evaluate(model, expanded_batches(execs))
    assert len(logp_ref) == sum(sel.num_targets for _, sel, _, _ in execs)
    for mode in ("tree", "plain"):
        batches = packed_batches(execs, mode)
        loss, grads, logp = evaluate(model, batches)
        assert logp.keys() == logp_ref.keys()  # same targets, each trained once, in the same sequence
        np.testing.assert_allclose([logp[k] for k in logp_ref], list(logp_ref.values()), rtol=1e-5, atol=2e-5)
        assert loss == pytest.approx(loss_ref, rel=1e-5, abs=1e-6)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6),
            grads,
            grads_ref,
        )
    if any(abs(a) > 1e-3 for _, _, a, _ in execs):
        norm = float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads_ref))))
        assert norm > 0  # the comparison above is not between two zero gradients


# -- the packer on concrete chunks ----------------------------------------------------------------------------------


def _sel(eid, *branch_specs):
    branches = []
    for i, (tokens, trainable) in enumerate(branch_specs):
        n = len(tokens)
        branches.append(
            Branch(
                execution_id=eid,
                thread_id="main",
                label="main" if i == 0 else "main-summary",
                tokens=list(tokens),
                trainable=list(trainable),
                logprobs=[-0.25] * n,
                temperature=[1.0] * n,
                versions=[7] * n,
            )
        )
    return select(eid, branches, None)


def test_packer_places_chunks_first_fit_as_segments_with_their_sequences():
    a = _sel("a", ([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]))  # 4 nodes
    b = _sel("b", ([1, 2, 3], [0, 1, 1]), ([1, 2, 4], [0, 1, 1]))  # tree: 1->2, 2->3, 2->4: 3 nodes, 2 sequences
    c = _sel("c", ([6, 6, 6, 6, 6, 6, 6], [0, 1, 1, 1, 1, 1, 1]))  # 6 nodes
    packer = MicroBatchPacker(rows=2, row_length=8, max_sequences=4, open_micro_batches=1)
    assert packer.add(tree_chunks(a, 8, 4)[0], 1.5, [0.5], ["main"]) == []
    assert packer.add(tree_chunks(b, 8, 4)[0], -1.0, [0.125, 0.125], ["main", "main-summary"]) == []
    assert packer.add(tree_chunks(c, 8, 4)[0], 2.0, [0.25], ["main"]) == []  # row 0 is full: row 1
    (out,) = packer.flush()
    mb = out.micro_batch
    assert mb.tokens.shape == (2, 8) and mb.advantages.shape == (4,)
    np.testing.assert_array_equal(mb.segment_ids, [[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(mb.subtree_end[0, :7], [4, 4, 4, 4, 7, 6, 7])  # b's chunk starts at 4
    np.testing.assert_array_equal(mb.positions[0, :7], [0, 1, 2, 3, 0, 1, 1])
    np.testing.assert_array_equal(mb.advantages, [1.5, -1.0, -1.0, 2.0])
    np.testing.assert_allclose(mb.seq_weights, [0.5, 0.125, 0.125, 0.25])
    assert [(s.execution_id, s.branch) for s in out.sequences] == [("a", 0), ("b", 0), ("b", 1), ("c", 0)]
    assert out.executions == ["a", "b", "c"]
    np.testing.assert_array_equal(mb.seq_index[0], [0, 0, 0, 0, 1, 1, 2, 0])  # only trained targets carry a sequence
    np.testing.assert_array_equal(mb.loss_mask[0], [0, 1, 1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(mb.versions[0], [-1, 7, 7, 7, 7, 7, 7, -1])
    assert mb.num_tokens == 13 and mb.num_target_tokens == 12
    assert packer.flush() == [] and packer.empty


def test_packer_finishes_the_oldest_micro_batch_when_rows_or_sequence_slots_run_out():
    one = _sel("x", ([1, 2, 3, 4, 5], [0, 1, 1, 1, 1]))
    chunk = layout(one, [0])  # 4 tokens
    packer = MicroBatchPacker(rows=2, row_length=8, max_sequences=3, open_micro_batches=1)
    done = [packer.add(chunk, 1.0, [1.0], ["main"]) for _ in range(3)]
    assert done == [[], [], []]  # rows hold 4 + 4 tokens: three chunks fit in two rows
    finished = packer.add(chunk, 1.0, [1.0], ["main"])  # a fourth exceeds the 3 sequence slots
    assert len(finished) == 1 and len(finished[0].sequences) == 3
    assert [len(p.sequences) for p in packer.flush()] == [1]
    with pytest.raises(ValueError, match="does not fit rows of 3"):
        MicroBatchPacker(rows=1, row_length=3, max_sequences=4).add(chunk, 1.0, [1.0], ["main"])
    with pytest.raises(ValueError, match="must all be >= 1"):
        MicroBatchPacker(rows=0, row_length=3, max_sequences=4)


def test_open_micro_batches_let_later_small_chunks_fill_earlier_gaps():
    big = layout(_sel("b", (list(range(8)), [0] + [1] * 7)), [0])  # 7 tokens
    small = layout(_sel("s", ([1, 2], [0, 1])), [0])  # 1 token
    chunks = [big, big, small, small]  # rows of 8: each big chunk leaves a gap of 1
    for window, fills in ((1, [7, 8, 1]), (2, [8, 8])):  # a micro-batch is one row of 8 here
        packer = MicroBatchPacker(rows=1, row_length=8, max_sequences=4, open_micro_batches=window)
        out = [p for c in chunks for p in packer.add(c, 0.0, [1.0], ["main"])] + packer.flush()
        assert [int(np.sum(p.micro_batch.segment_ids > 0)) for p in out] == fills
        assert sum(len(p.sequences) for p in out) == 4  # every chunk placed once
