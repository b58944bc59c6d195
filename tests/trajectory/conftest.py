"""Shared hypothesis strategy for the trajectory tests: random executions whose branches form real trees.

Calls extend an earlier call (a continuation), fork from the middle of one (a summary or edited
history sharing a prefix), repeat an earlier prompt (a retry, often sampling the same tokens again:
the alphabet is tiny), or start fresh; threads are "main" or a sub-agent's. Tests take the strategy
from the ``executions`` fixture and draw with ``st.data()``.
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

from gyre_jax.proxy.records import TitoRecord

ALPHABET = 6  # token ids 0..5: shared prefixes and identical completions happen often
MAX_BRANCH_LEN = 48


def make_record(
    eid: str, call_index: int, prompt, completion, thread="main", logprobs=None, temperature=1.0, version=0
) -> TitoRecord:
    n = len(completion)
    return TitoRecord(
        execution_id=eid,
        call_index=call_index,
        thread_id=thread,
        request_id=f"r{call_index}",
        prompt_ids=list(prompt),
        completion_ids=list(completion),
        completion_logprobs=list(logprobs) if logprobs is not None else [-0.5] * n,
        policy_versions=[version] * n,
        finish_reason="stop",
        temperature=temperature,
        reused_prefix_len=0,
        t_start=0.0,
        t_end=0.0,
    )


def _tokens(lo: int, hi: int):
    return st.lists(st.integers(0, ALPHABET - 1), min_size=lo, max_size=hi)


@st.composite
def random_execution(draw, execution_id: str = "ex", max_calls: int = 8):
    """A list of TitoRecords (call order) whose branches share prefixes in every way the proxy can produce."""
    n_calls = draw(st.integers(1, max_calls))
    records: list[TitoRecord] = []
    for i in range(n_calls):
        thread = "main" if i == 0 else draw(st.sampled_from(["main", "main", "sub"]))
        how = draw(st.sampled_from(["extend", "extend", "fork", "retry", "fresh"])) if records else "fresh"
        seqs = [r.prompt_ids + r.completion_ids for r in records]
        if how == "extend":
            prompt = draw(st.sampled_from(seqs)) + draw(_tokens(0, 4))
        elif how == "fork":
            base = draw(st.sampled_from(seqs))
            prompt = base[: draw(st.integers(1, len(base)))] + draw(_tokens(0, 3))
        elif how == "retry":
            prompt = []  # set below
        else:
            prompt = draw(_tokens(1, 5))
        completion = draw(_tokens(0, 4))
        if how == "retry":  # the same prompt again; often the same first tokens sampled again
            again = draw(st.sampled_from(records))
            prompt = list(again.prompt_ids)
            if draw(st.booleans()):
                completion = list(again.completion_ids[: draw(st.integers(0, len(again.completion_ids)))]) + draw(
                    _tokens(0, 2)
                )
        if len(prompt) + len(completion) > MAX_BRANCH_LEN:
            prompt = draw(_tokens(1, 5))  # keep branches short enough for the test rows
        logprobs = draw(
            st.lists(st.floats(-3.0, -0.0625, width=32), min_size=len(completion), max_size=len(completion))
        )
        records.append(
            make_record(
                execution_id,
                i,
                prompt,
                completion,
                thread=thread,
                logprobs=logprobs,
                temperature=draw(st.sampled_from([0.7, 1.0])),
                version=draw(st.integers(0, 3)),
            )
        )
    return records


@pytest.fixture(scope="session")
def executions():
    """The strategy factory: ``data.draw(executions("e1"))``."""
    return random_execution
