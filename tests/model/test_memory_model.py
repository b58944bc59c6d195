"""The memory model (``gyre_jax/model/memory.py``) against what JAX actually keeps for the backward of the learner's
micro-step (its saved residuals, traced at two lengths: nothing compiles), and its projection's arithmetic."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.bench_memory_model import SETTINGS, SMALL, measured_saved
from gyre_jax.model import memory
from gyre_jax.model.config import QWEN3_8B

# (setting, relative tolerance): the per-token inventory is exact where nothing is quadratic; the dense mask's and
# the "dots" policy's quadratic residuals are modelled to within a few percent
TOLERANCE = {
    "blockwise, no remat": 0.01,
    "blockwise, full remat": 0.01,
    "blockwise, full, chunk 256": 0.01,
    "xla, no remat": 0.06,
    "blockwise, dots": 0.10,
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_saved_bytes_match_what_jax_keeps_for_the_backward(setting):
    cfg = dataclasses.replace(SMALL, num_layers=1, vocab_size=1024, **SETTINGS[setting])
    for t in (256, 512):
        got, predicted = measured_saved(cfg, t), memory.saved_bytes(cfg, t)
        assert predicted == pytest.approx(got, rel=TOLERANCE[setting]), (t, got, predicted)


def test_remat_and_chunks_shrink_what_is_kept_and_context_shards_divide_the_tokens():
    base = dataclasses.replace(QWEN3_8B, dtype="bfloat16", attention_impl="blockwise")
    none, full = (memory.saved_bytes(dataclasses.replace(base, remat_policy=r), 65536) for r in ("none", "full"))
    assert full < none / 5
    chunked = dataclasses.replace(base, remat_policy="full", logits_chunk=2048)
    # the learner's head keeps no logits for its backward (only each token's log-sum-exp), chunked or not: chunks
    # shrink the logits' working set at the peak, not what is saved
    assert memory.saved_bytes(chunked, 65536) == full
    unchunked = dataclasses.replace(chunked, logits_chunk=0)
    assert memory.train_memory(chunked, 65536).total < memory.train_memory(unchunked, 65536).total - 2**30
    one = memory.train_memory(chunked, 1 << 20, fsdp=4)
    eight = memory.train_memory(chunked, 1 << 20, context=8, fsdp=4)
    assert eight.state == one.state and eight.saved == pytest.approx(one.saved / 8)
    c = memory.min_context_shards(chunked, 1 << 20, 95 * 2**30, fsdp=4)
    assert c >= 2 and memory.train_memory(chunked, 1 << 20, context=c, fsdp=4).total <= 95 * 2**30
    assert memory.train_memory(chunked, 1 << 20, context=c // 2, fsdp=4).total > 95 * 2**30
    assert memory.min_context_shards(chunked, 1 << 20, 1e9, fsdp=1) == 0  # the weights alone do not fit
    with pytest.raises(ValueError, match="context=0"):
        memory.train_memory(chunked, 1024, context=0)
