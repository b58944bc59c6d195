"""Tests for gyre_jax/trajectory/branches.py: branches from TITO records, labels, and J_max selection."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.proxy.records import TitoRecord
from gyre_jax.trajectory.branches import PRIORITY, build_branches, select_branches

MARK = 1000  # first token of every "fresh" prompt is MARK + k (unique): it can never extend another branch
tokens = st.lists(st.integers(0, 255), min_size=0, max_size=6)


def rec(call_index, prompt, completion, thread="main", logprobs=None, versions=None, temperature=0.7, eid="ex"):
    n = len(completion)
    return TitoRecord(
        execution_id=eid,
        call_index=call_index,
        thread_id=thread,
        request_id=f"r{call_index}",
        prompt_ids=list(prompt),
        completion_ids=list(completion),
        completion_logprobs=list(logprobs) if logprobs is not None else [-0.5 - 0.01 * i for i in range(n)],
        policy_versions=list(versions) if versions is not None else [call_index] * n,
        finish_reason="stop",
        temperature=temperature,
        reused_prefix_len=0,
        t_start=0.0,
        t_end=1.0,
    )


# -- a linear conversation ------------------------------------------------------------------------


@st.composite
def linear_conversations(draw):
    prompt = draw(st.lists(st.integers(0, 255), min_size=1, max_size=8))
    n_calls = draw(st.integers(1, 6))
    records, expected = (
        [],
        {
            "tokens": list(prompt),
            "trainable": [False] * len(prompt),
            "logprobs": [0.0] * len(prompt),
            "temperature": [1.0] * len(prompt),
            "versions": [-1] * len(prompt),
        },
    )
    for i in range(n_calls):
        if i > 0:
            new = draw(tokens)  # tool result / user turn appended after the previous completion
            prompt = records[-1].prompt_ids + records[-1].completion_ids + new
            expected["tokens"] += new
            expected["trainable"] += [False] * len(new)
            expected["logprobs"] += [0.0] * len(new)
            expected["temperature"] += [1.0] * len(new)
            expected["versions"] += [-1] * len(new)
        completion = draw(st.lists(st.integers(0, 255), min_size=1, max_size=6))
        logprobs = draw(
            st.lists(st.floats(-20.0, 0.0, allow_nan=False), min_size=len(completion), max_size=len(completion))
        )
        temperature = draw(st.sampled_from([0.5, 0.7, 1.0, 1.3]))
        versions = [draw(st.integers(0, 9))] * len(completion)
        records.append(rec(i, prompt, completion, logprobs=logprobs, versions=versions, temperature=temperature))
        expected["tokens"] += completion
        expected["trainable"] += [True] * len(completion)
        expected["logprobs"] += logprobs
        expected["temperature"] += [temperature] * len(completion)
        expected["versions"] += versions
    shuffle_seed = draw(st.integers(0, 1000))
    return records, expected, shuffle_seed


@settings(max_examples=60, deadline=None)
@given(linear_conversations())
def test_linear_conversation_is_one_main_branch_training_exactly_the_completions(case):
    records, expected, shuffle_seed = case
    shuffled = list(records)
    random.Random(shuffle_seed).shuffle(shuffled)  # build_branches orders by call_index itself
    for recs in (records, shuffled):
        branches = build_branches(recs)
        assert len(branches) == 1
        (b,) = branches
        assert b.label == "main" and b.thread_id == "main" and b.execution_id == "ex"
        assert b.num_calls == len(records)
        assert b.tokens == expected["tokens"]
        assert b.trainable == expected["trainable"]
        assert b.logprobs == expected["logprobs"]
        assert b.temperature == expected["temperature"]
        assert b.versions == expected["versions"]
        # The trainable tokens are exactly the completions, in call order, with their logprobs.
        assert [t for t, m in zip(b.tokens, b.trainable) if m] == [t for r in records for t in r.completion_ids]
        assert [lp for lp, m in zip(b.logprobs, b.trainable) if m] == [
            lp for r in records for lp in r.completion_logprobs
        ]
        assert b.num_trainable == sum(len(r.completion_ids) for r in records)


# -- several threads, fresh prompts, continuations -----------------------------------------------

THREADS = ("main", "sub-a", "sub-b")


@st.composite
def multi_thread_executions(draw):
    """Records plus the expected branches: calls either continue one of their thread's branches or
    start fresh (a summary, a sub-agent, an edited history) with a prompt that extends no branch."""
    n_calls = draw(st.integers(1, 12))
    records, model = [], []  # model: dicts with thread, label, tokens, trainable, num_calls
    fresh = {t: 0 for t in THREADS}
    for i in range(n_calls):
        thread = "main" if i == 0 else draw(st.sampled_from(THREADS))
        own = [b for b in model if b["thread"] == thread]
        extra = draw(tokens)
        completion = draw(tokens)  # may be empty: a branch can end up with no trainable token
        if own and draw(st.booleans()):
            target = own[draw(st.integers(0, len(own) - 1))]
            prompt = target["tokens"] + extra
        else:
            k = fresh[thread]
            fresh[thread] += 1
            kind = ("main" if thread == "main" else "subagent") + ("" if k == 0 else "-summary")
            prompt = [MARK + i] + extra
            target = {"thread": thread, "label": kind, "tokens": [], "trainable": [], "num_calls": 0}
            model.append(target)
        target["trainable"] += [False] * (len(prompt) - len(target["tokens"])) + [True] * len(completion)
        target["tokens"] = prompt + completion
        target["num_calls"] += 1
        records.append(rec(i, prompt, completion, thread=thread))
    return records, model


@settings(max_examples=80, deadline=None)
@given(multi_thread_executions())
def test_fresh_prompts_start_labelled_branches_and_continuations_extend_them(case):
    records, model = case
    branches = build_branches(records)
    assert [(b.thread_id, b.label) for b in branches] == [(m["thread"], m["label"]) for m in model]
    for b, m in zip(branches, model):
        assert b.tokens == m["tokens"]
        assert b.trainable == m["trainable"]
        assert b.num_calls == m["num_calls"]
        assert len(b.logprobs) == len(b.temperature) == len(b.versions) == len(b.tokens)
        assert all(v == -1 for v, tr in zip(b.versions, b.trainable) if not tr)


@settings(max_examples=80, deadline=None)
@given(multi_thread_executions(), st.integers(1, 8))
def test_select_branches_respects_cap_priority_and_skips_untrainable(case, max_branches):
    records, _ = case
    branches = build_branches(records)
    chosen = select_branches(branches, max_branches)
    eligible = [b for b in branches if b.num_trainable > 0]
    assert len(chosen) == min(max_branches, len(eligible))
    assert all(b.num_trainable > 0 for b in chosen)
    assert len({id(b) for b in chosen}) == len(chosen)
    key = {id(b): (PRIORITY.index(b.label), i) for i, b in enumerate(branches)}
    keys = [key[id(b)] for b in chosen]
    assert keys == sorted(keys)  # main > main-summary > subagent > subagent-summary, then appearance
    worst_chosen = max(keys, default=(-1, -1))
    for b in eligible:
        if id(b) not in {id(c) for c in chosen}:
            assert key[id(b)] > worst_chosen  # nothing left out outranks anything kept


def test_select_branches_priority_order_on_a_concrete_execution():
    records = [
        rec(0, [MARK + 0, 1], [2, 3], thread="main"),  # main
        rec(1, [MARK + 1, 1], [5], thread="sub-a"),  # subagent
        rec(2, [MARK + 2], [6], thread="sub-a"),  # subagent-summary
        rec(3, [MARK + 3], [7], thread="main"),  # main-summary
        rec(4, [MARK + 4], [], thread="main"),  # main-summary without trainable tokens
        rec(5, [MARK + 5], [8], thread="sub-b"),  # subagent
        rec(6, [MARK + 6], [9], thread="main"),  # main-summary
    ]
    branches = build_branches(records)
    assert [b.label for b in branches] == [
        "main",
        "subagent",
        "subagent-summary",
        "main-summary",
        "main-summary",
        "subagent",
        "main-summary",
    ]
    first = lambda bs: [b.tokens[0] - MARK for b in bs]  # noqa: E731
    assert first(select_branches(branches, 1)) == [0]
    assert first(select_branches(branches, 3)) == [0, 3, 6]
    assert first(select_branches(branches, 4)) == [0, 3, 6, 1]
    assert first(select_branches(branches, 10)) == [0, 3, 6, 1, 5, 2]  # branch 4 has nothing to train
    assert select_branches([b for b in branches if b.num_trainable == 0], 5) == []


def test_summary_subagent_and_edited_history_start_new_branches():
    records = [
        rec(0, [1, 2], [3, 4]),
        rec(1, [1, 2, 3, 4, 9], [5]),  # continues main
        rec(2, [1, 2, 3], [7]),  # edited history (a prefix, not an extension): new branch
        rec(3, [20, 21], [22], thread="worker"),  # a sub-agent
        rec(4, [20, 21, 22, 23], [24], thread="worker"),  # continues the sub-agent
        rec(5, [30], [31]),  # a context summary of the main thread
    ]
    branches = build_branches(records)
    assert [(b.label, b.thread_id, b.num_calls) for b in branches] == [
        ("main", "main", 2),
        ("main-summary", "main", 1),
        ("subagent", "worker", 2),
        ("main-summary", "main", 1),
    ]
    assert branches[0].tokens == [1, 2, 3, 4, 9, 5]
    assert branches[0].trainable == [False, False, True, True, False, True]
    assert branches[2].tokens == [20, 21, 22, 23, 24]
    assert branches[2].trainable == [False, False, True, False, True]


def test_a_call_continues_the_longest_branch_it_extends():
    records = [
        rec(0, [1, 2], [3]),  # branch X = [1, 2, 3]
        rec(1, [1], [2, 3, 4]),  # prompt [1] does not extend X: branch Y = [1, 2, 3, 4]
        rec(2, [1, 2, 3, 4, 5], [6]),  # extends both X and Y: continues Y, the longer one
    ]
    x, y = build_branches(records)
    assert x.tokens == [1, 2, 3] and x.num_calls == 1
    assert y.tokens == [1, 2, 3, 4, 5, 6] and y.num_calls == 2
    assert y.trainable == [False, True, True, True, False, True]


def test_branches_from_a_record_store_round_trip(tmp_path):
    from gyre_jax.proxy.records import RecordStore

    store = RecordStore(tmp_path)
    records = [rec(1, [1, 2, 3, 4, 5], [6]), rec(0, [1, 2], [3, 4])]
    for r in records:
        store.append(r)
    read = store.read("ex")
    assert [r.call_index for r in read] == [0, 1]
    (b,) = build_branches(read)
    assert b.tokens == [1, 2, 3, 4, 5, 6] and b.trainable == [False, False, True, True, False, True]


def test_first_thread_stands_in_for_main_consistently_when_no_main_thread_is_named():
    records = [
        rec(0, [1, 2], [3], thread="session-7f3a"),
        rec(1, [40], [41], thread="session-7f3a"),  # a context summary of that (main) thread
        rec(2, [50], [51], thread="session-9b1c"),  # a real sub-agent
    ]
    branches = build_branches(records)
    assert [b.label for b in branches] == ["main", "main-summary", "subagent"]
    # With J_max = 2 the main thread's summary must outrank the sub-agent.
    assert [b.tokens[0] for b in select_branches(branches, 2)] == [1, 40]


# -- labels from structure (no thread metadata) ----------------------------------------------------------------------

END = 99  # stands for <|im_end|>: the first message (system prompt) ends at its first occurrence


def test_structure_tells_subagents_from_summaries_within_one_thread():
    sys_main, sys_sub = [1, 1, END], [2, 2, END]
    records = [
        rec(0, sys_main + [5, END], [6, END], thread="sess"),  # main
        rec(1, sys_main + [5, END, 6, END, 7], [8], thread="sess"),  # continues main
        rec(2, sys_sub + [9, END], [10], thread="sess"),  # own system prompt: a sub-agent
        rec(3, sys_sub + [9, END, 10, 11], [12], thread="sess"),  # continues the sub-agent
        rec(4, sys_main + [30, END], [31], thread="sess"),  # same system prompt, new history: summary
        rec(5, sys_sub + [40, END], [41], thread="sess"),  # the sub-agent restarted: its summary
        rec(6, [3, 3, END, 50], [51], thread="sess"),  # a second sub-agent
        rec(7, sys_main + [5, END], [60], thread="sess"),  # a retry of call 0 (shares the prompt)
    ]
    branches = build_branches(records, message_end_id=END)
    assert [b.label for b in branches] == [
        "main",
        "subagent",
        "main-summary",
        "subagent-summary",
        "subagent",
        "main-summary",
    ]
    assert [b.agent for b in branches] == [0, 1, 0, 1, 2, 0]
    # Explicit thread ids win over structure: a different thread is always another agent.
    records[4] = rec(4, sys_main + [30, END], [31], thread="other")
    assert build_branches(records, message_end_id=END)[2].label == "subagent"
    # Without a message end id, structure is not used: new branches of a thread are that thread's summaries.
    assert [b.label for b in build_branches(records[:4])] == ["main", "main-summary"]


def test_branch_builder_takes_records_in_call_order_only():
    from gyre_jax.trajectory.branches import BranchBuilder

    builder = BranchBuilder()
    builder.add(rec(1, [1], [2]))
    with pytest.raises(ValueError, match="call order"):
        builder.add(rec(0, [1], [2]))


def test_auxiliary_calls_are_never_main_and_come_last_or_not_at_all():
    """opencode's first call is its title: an auxiliary record. The real agent after it is the main agent; the
    title's branch is labelled ``auxiliary``, selected last, or never with ``auxiliary="exclude"``."""
    from gyre_jax.trajectory.select import candidate_order, select

    title = rec(0, [90, 91], [92])
    title.agent_kind = "auxiliary"
    title.thread_id = "main~0123456789ab"
    records = [title, rec(1, [1, 2], [3]), rec(2, [1, 2, 3, 4], [5]), rec(3, [7, 8], [9], thread="main~fedcba987654")]
    branches = build_branches(records)
    assert [b.label for b in branches] == ["auxiliary", "main", "subagent"]
    assert PRIORITY[-1] == "auxiliary" and candidate_order(branches, None) == [1, 2, 0]
    assert candidate_order(branches, None, "exclude") == [1, 2]
    assert [b.label for b in select("ex", branches, None, auxiliary="exclude").branches] == ["main", "subagent"]
    assert [b.label for b in select("ex", branches, None).branches] == ["main", "subagent", "auxiliary"]
    with pytest.raises(ValueError, match="auxiliary='last' must be one of"):
        candidate_order(branches, None, "last")
    # An execution of only auxiliary calls has no main branch; old records (no agent_kind) load as before.
    assert [b.label for b in build_branches([title])] == ["auxiliary"]
    line = rec(0, [1], [2]).to_json().replace(',"agent_kind":""', "")
    assert "agent_kind" not in line and TitoRecord.from_json(line).agent_kind == ""
