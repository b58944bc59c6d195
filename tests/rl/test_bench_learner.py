"""Tests for benchmarks/bench_learner.py's own parts (no timing, no model compile): the first-fit packer keeps
every trajectory's tokens, masks, positions and weights, and gives the same GSPO loss as the unpacked layout;
the model-FLOPs count matches a token-by-token count."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from gyre_jax.rl.losses import GSPOParams, LossInputs, gspo_loss
from gyre_jax.trajectory.batch import make_micro_batches

SPEC = importlib.util.spec_from_file_location(
    "bench_learner", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_learner.py"
)
bench = importlib.util.module_from_spec(SPEC)
sys.modules.setdefault("bench_learner", bench)  # dataclasses look their module up by name
SPEC.loader.exec_module(bench)


@pytest.fixture(scope="module")
def workload():
    suite = bench.SUITES["smoke"]
    branches = bench.synthetic_branches(suite, vocab=272, seed=3)
    adv, w = bench.step_weights(branches)
    return suite, branches, adv, w


def test_packer_keeps_every_trajectory_exactly_once(workload):
    suite, branches, adv, w = workload
    mbs = bench.pack_first_fit(branches, adv, w, suite.row_length, suite.packed_rows)
    assert len({(mb.tokens.shape, mb.advantages.shape) for mb in mbs}) == 1  # one shape: one compile
    found = []
    for mb in mbs:
        rows, length = mb.tokens.shape
        for r in range(rows):
            for seg in sorted(set(mb.segment_ids[r]) - {0}):
                idx = np.flatnonzero(mb.segment_ids[r] == seg)
                assert np.array_equal(idx, np.arange(idx[0], idx[-1] + 1))  # contiguous
                assert np.array_equal(mb.positions[r, idx], np.arange(len(idx)))  # positions restart
                assert np.all(mb.subtree_end[r, idx] == idx[-1] + 1)  # plain causal segment
                (s,) = set(mb.seq_index[r, idx])
                found.append(
                    (
                        mb.tokens[r, idx].tolist(),
                        mb.targets[r, idx].tolist(),
                        mb.loss_mask[r, idx].tolist(),
                        float(mb.advantages[s]),
                        float(mb.seq_weights[s]),
                    )
                )
    want = [
        (b.tokens[:-1], b.tokens[1:], [float(t) for t in b.trainable[1:]], a, x) for b, a, x in zip(branches, adv, w)
    ]
    assert len(found) == len(want)
    by_tokens = {tuple(f[0]): f for f in found}
    assert len(by_tokens) == len(found)  # the synthetic trajectories are distinct
    for tokens, targets, mask, a, x in want:
        got = by_tokens[tuple(tokens)]
        assert got[1] == targets and got[2] == mask
        assert got[3] == pytest.approx(a, rel=1e-6) and got[4] == pytest.approx(x, rel=1e-6)
    with pytest.raises(ValueError, match="does not fit"):
        bench.pack_first_fit(branches, adv, w, row_length=8, rows=2)


def _loss(mbs, logp_of):
    total = 0.0
    for mb in mbs:
        logp = np.zeros(mb.tokens.shape, np.float32)
        for (r, t), m in np.ndenumerate(mb.loss_mask):
            if m:
                logp[r, t] = logp_of(mb, r, t)
        loss, _ = gspo_loss(LossInputs.of(mb, logp), GSPOParams(clip_low=0.2, clip_high=0.28))
        total += float(loss)
    return total


def test_packed_and_unpacked_layouts_give_the_same_gspo_loss(workload):
    """The same per-token log-probs (a function of the token and what precedes it in its trajectory) give the
    same step loss in both layouts: the packing changes where tokens sit, not what is trained."""
    suite, branches, adv, w = workload

    def logp_of(mb, r, t):  # depends on the token, its position and its own segment's history only
        seg = mb.segment_ids[r]
        start = np.flatnonzero(seg == seg[t])[0]
        return -1.0 - 0.01 * (int(np.sum(mb.tokens[r, start : t + 1])) % 97) - 0.001 * mb.positions[r, t]

    packed = bench.pack_first_fit(branches, adv, w, suite.row_length, suite.packed_rows)
    naive = make_micro_batches(branches, adv, w, suite.naive_rows)
    assert _loss(packed, logp_of) == pytest.approx(_loss(naive, logp_of), rel=1e-5)


def test_model_flops_match_a_token_by_token_count():
    cfg = bench.TINY
    e, h, k, d, m, v, layers = (
        cfg.embed_dim,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.mlp_dim,
        cfg.vocab_size,
        cfg.num_layers,
    )
    per_token_matmul = 2 * (layers * (2 * e * h * d + 2 * e * k * d + 3 * e * m) + e * v)
    want = 0.0
    for n in (5, 17):
        for t in range(n):
            want += 3 * (per_token_matmul + layers * 4 * h * d * (t + 1))
    assert bench.model_train_flops(cfg, [5, 17]) == pytest.approx(want)


def test_executed_flops_count_padding_and_full_row_attention(workload):
    suite, branches, adv, w = workload
    cfg = bench.TINY
    packed = bench.pack_first_fit(branches, adv, w, suite.row_length, suite.packed_rows)
    naive = make_micro_batches(branches, adv, w, suite.naive_rows)
    model = bench.model_train_flops(cfg, [len(b.tokens) - 1 for b in branches])
    # A row of T tokens executes what one causal sequence of T tokens would, plus the masked upper triangle.
    rows, t = packed[0].tokens.shape
    one_row = bench.executed_train_flops(cfg, packed[:1]) / rows
    upper = 3 * cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * t * (t - 1) / 2
    assert one_row == pytest.approx(bench.model_train_flops(cfg, [t]) + upper)
    assert model < bench.executed_train_flops(cfg, packed) < bench.executed_train_flops(cfg, naive)
