"""Routing replay across a retried stream: a continuation's expert ids, split back to the caller's prompt and
completion (``router._split_told_experts``)."""

from __future__ import annotations

import numpy as np

from gyre_jax.proxy.router import _split_told_experts
from gyre_jax.serving.types import GenerationResult


def _result(prompt_rows, completion_rows, n_tokens):
    return GenerationResult(
        "r", list(range(n_tokens)), [-0.1] * n_tokens, [0] * n_tokens, "stop", 3,
        expert_ids=completion_rows, prompt_expert_ids=prompt_rows,
    )  # fmt: skip


def test_the_told_tokens_rows_move_from_the_continuations_prompt_to_the_completion() -> None:
    prompt = np.arange(5 * 2 * 2, dtype=np.int16).reshape(5, 2, 2)  # 3 prompt ids + 2 told tokens
    completion = np.full((3, 2, 2), 7, np.int16)
    split = _split_told_experts(_result(prompt, completion, 3), told=2)
    np.testing.assert_array_equal(split["prompt_expert_ids"], prompt[:3])
    np.testing.assert_array_equal(split["expert_ids"], np.concatenate([prompt[3:], completion]))
    # a continuation that sampled its one token in prefill: no generate step, its own row is not known
    split = _split_told_experts(_result(prompt, None, 1), told=2)
    np.testing.assert_array_equal(split["expert_ids"], np.concatenate([prompt[3:], np.full((1, 2, 2), -1)]))
    assert _split_told_experts(_result(None, None, 1), told=2) == {"expert_ids": None, "prompt_expert_ids": None}
