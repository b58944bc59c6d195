"""Tests for gyre_jax/rollout/tasks.py: the built-in suite, demonstrations and the evaluator."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy import chat_template
from gyre_jax.proxy.tito import assistant_completion_text, render_demonstration
from gyre_jax.rollout.tasks import (
    ANSWER_FILE,
    INPUT_FILE,
    KINDS,
    BuiltinSuite,
    Task,
    evaluate,
    partial_credit,
    transform,
)


def test_tasks_for_step_is_deterministic_in_seed_and_step():
    a = BuiltinSuite(seed=7).tasks_for_step(3, 16)
    b = BuiltinSuite(seed=7).tasks_for_step(3, 16)
    assert a == b
    assert [t.to_json() for t in a] == [t.to_json() for t in b]
    other_step = BuiltinSuite(seed=7).tasks_for_step(4, 16)
    other_seed = BuiltinSuite(seed=8).tasks_for_step(3, 16)
    inputs = [t.files[INPUT_FILE] for t in a]
    assert inputs != [t.files[INPUT_FILE] for t in other_step]
    assert inputs != [t.files[INPUT_FILE] for t in other_seed]
    # Asking for fewer tasks gives a prefix (the same random stream), so n can change between runs.
    assert BuiltinSuite(seed=7).tasks_for_step(3, 5) == a[:5]


def test_task_ids_are_unique_across_steps():
    suite = BuiltinSuite(seed=0)
    ids = [t.task_id for step in range(5) for t in suite.tasks_for_step(step, 4)]
    assert len(set(ids)) == len(ids)
    assert suite.tasks_for_step(12, 2)[1].task_id == "s000012-t1"


def test_tasks_have_the_right_kinds_inputs_and_answers():
    suite = BuiltinSuite(
        kinds=("upper", "reverse"), seed=1, max_turns=5, tool_latency_median_s=0.1, tool_latency_sigma=0.5
    )
    tasks = suite.tasks_for_step(0, 200)
    assert {t.kind for t in tasks} == {"upper", "reverse"}
    for t in tasks:
        text = t.files[INPUT_FILE]
        assert 4 <= len(text) <= 8 and text.isascii() and text.isalpha() and text.islower()
        assert t.expected == {ANSWER_FILE: transform(t.kind, text)}
        assert t.max_turns == 5 and t.tool_latency_median_s == 0.1 and t.tool_latency_sigma == 0.5
        assert [tool["function"]["name"] for tool in t.tools] == ["read_file", "write_file"]
    assert {len(t.files[INPUT_FILE]) for t in tasks} == set(range(4, 9))
    assert (
        transform("copy", "abc") == "abc"
        and transform("upper", "abc") == "ABC"
        and transform("reverse", "abc") == "cba"
    )


def test_suite_rejects_bad_arguments():
    with pytest.raises(ValueError, match="subset of"):
        BuiltinSuite(kinds=("copy", "sort"))
    with pytest.raises(ValueError, match="non-empty"):
        BuiltinSuite(kinds=())
    with pytest.raises(ValueError, match="max_turns"):
        BuiltinSuite(max_turns=0)
    with pytest.raises(ValueError, match="tool_latency_sigma"):
        BuiltinSuite(tool_latency_sigma=-1.0)
    with pytest.raises(ValueError, match="step"):
        BuiltinSuite().tasks_for_step(-1, 2)


def test_task_json_round_trip_keeps_key_order():
    task = BuiltinSuite(seed=3).tasks_for_step(0, 1)[0]
    text = task.to_json()
    again = Task.from_json(text)
    assert again == task
    # Tool schemas keep their key order: the harness sends them as read, and the prompt renders them so.
    assert json.dumps(json.loads(text)["tools"]) == json.dumps(BuiltinSuite().tools)
    assert list(json.loads(text)) == ["task_id", "kind", "system", "instruction", "files", "expected", "tools",
                                      "max_turns", "tool_latency_median_s", "tool_latency_sigma", "source",
                                      "agent_timeout_s", "verifier_timeout_s", "environment", "verifier_env",
                                      "metadata"]  # fmt: skip
    # A task JSON written before the Harbor fields existed still loads (they default).
    old = {k: v for k, v in json.loads(text).items() if k in [f.name for f in dataclasses.fields(Task)][:10]}
    assert Task.from_dict(old) == task


def test_task_from_json_reports_what_is_wrong():
    data = BuiltinSuite().tasks_for_step(0, 1)[0].to_dict()
    with pytest.raises(ValueError, match="missing keys \\['max_turns'\\]"):
        Task.from_dict({k: v for k, v in data.items() if k != "max_turns"})
    with pytest.raises(ValueError, match="unknown keys \\['extra'\\]"):
        Task.from_dict({**data, "extra": 1})
    with pytest.raises(ValueError, match="not valid JSON"):
        Task.from_json("{")
    with pytest.raises(ValueError, match="relative path"):
        Task.from_dict({**data, "files": {"../x": "a"}})
    with pytest.raises(ValueError, match="max_turns"):
        Task.from_dict({**data, "max_turns": 0})


def test_demonstration_shape_and_answer():
    task = BuiltinSuite(kinds=("reverse",), seed=0).tasks_for_step(0, 1)[0]
    demo = task.demonstration()
    assert [m["role"] for m in demo] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    read, write = demo[2]["tool_calls"][0], demo[4]["tool_calls"][0]
    assert read["function"]["name"] == "read_file" and json.loads(read["function"]["arguments"]) == {
        "path": "input.txt"
    }
    assert demo[3] == {"role": "tool", "tool_call_id": read["id"], "content": task.files[INPUT_FILE]}
    assert write["function"]["name"] == "write_file"
    assert json.loads(write["function"]["arguments"]) == {"path": "answer.txt", "content": task.files[INPUT_FILE][::-1]}
    assert demo[5]["tool_call_id"] == write["id"] and demo[5]["content"] == "ok"
    assert demo[6] == {"role": "assistant", "content": "Done."}


def test_demonstration_writes_a_full_score_answer(tmp_path):
    for task in BuiltinSuite(seed=5).demonstration_tasks(12, seed=2):
        workspace = tmp_path / task.task_id
        workspace.mkdir()
        for message in task.demonstration():
            for call in message.get("tool_calls", []):
                if call["function"]["name"] == "write_file":
                    args = json.loads(call["function"]["arguments"])
                    (workspace / args["path"]).write_text(args["content"])
        assert evaluate(task, workspace) == 1.0


def test_demonstrations_render_through_tito_with_assistant_tokens_trainable():
    suite = BuiltinSuite(seed=0)
    tok = ByteTokenizer()
    demos = suite.demonstrations(30, seed=4)
    assert demos == suite.demonstrations(30, seed=4)
    assert demos != suite.demonstrations(30, seed=5)
    for demo in demos:
        conv = render_demonstration(tok, demo, suite.tools)
        assert len(conv.ids) == len(conv.trainable)
        trained = tok.decode([i for i, t in zip(conv.ids, conv.trainable) if t])
        expected = "".join(
            assistant_completion_text(m) + chat_template.IM_END for m in demo if m["role"] == "assistant"
        )
        # Equal only if all three assistant turns are in one branch (a new branch restarts the ids).
        assert trained == expected
        assert tok.decode(conv.ids).startswith(chat_template.render(demo[:2], suite.tools, add_generation_prompt=True))
        assert len(conv.ids) < 1100  # short enough for the tiny model's context (tiny_cpu: 1536)


def test_demonstration_tasks_differ_from_step_tasks():
    suite = BuiltinSuite(seed=0)
    demo_inputs = [t.files[INPUT_FILE] for t in suite.demonstration_tasks(8, seed=0)]
    step_inputs = [t.files[INPUT_FILE] for t in suite.tasks_for_step(0, 8)]
    assert demo_inputs != step_inputs


def _task(expected: str) -> Task:
    return Task(
        task_id="t", kind="copy", system="", instruction="i", files={INPUT_FILE: expected}, expected={ANSWER_FILE: expected},
        tools=[], max_turns=1, tool_latency_median_s=0.0, tool_latency_sigma=0.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("written", "reward"),
    [
        ("QKZMT", 1.0),
        ("QKZMT\n", 1.0),
        ("QKZMT\r\n", 1.0),
        ("QKZ", 0.6),
        ("QKZMTXX", 5 / 7),
        ("qkzmt", 0.0),
        ("XKZMT", 0.8),
        ("", 0.0),
        ("QKZMT\n\n", 5 / 6),
    ],
)
def test_evaluate_partial_credit(tmp_path, written, reward):
    (tmp_path / ANSWER_FILE).write_text(written, newline="")
    assert evaluate(_task("QKZMT"), tmp_path) == pytest.approx(reward)


def test_evaluate_missing_answer_scores_zero_but_missing_workspace_raises(tmp_path):
    assert evaluate(_task("ABC"), tmp_path) == 0.0
    (tmp_path / ANSWER_FILE).mkdir()  # a directory is not an answer
    assert evaluate(_task("ABC"), tmp_path) == 0.0
    with pytest.raises(FileNotFoundError, match="does not exist"):
        evaluate(_task("ABC"), tmp_path / "gone")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        evaluate(_task("ABC"), tmp_path / "file")


def test_evaluate_tolerates_invalid_utf8(tmp_path):
    (tmp_path / ANSWER_FILE).write_bytes(b"AB\xff")
    assert evaluate(_task("ABC"), tmp_path) == pytest.approx(2 / 3)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=12), st.text(max_size=12))
def test_partial_credit_is_a_reward_and_one_only_on_a_match(expected, got):
    score = partial_credit(expected, got)
    assert 0.0 <= score <= 1.0
    strip = lambda s: s[:-2] if s.endswith("\r\n") else s[:-1] if s.endswith("\n") else s  # noqa: E731
    assert (score == 1.0) == (strip(expected) == strip(got))
    assert partial_credit(expected, expected) == 1.0


def test_every_kind_is_drawn_and_named_in_its_instruction():
    tasks = BuiltinSuite(kinds=KINDS, seed=0).tasks_for_step(0, 60)
    assert {t.kind for t in tasks} == set(KINDS)
    assert len({t.instruction for t in tasks}) == len(KINDS)
    for t in tasks:
        assert INPUT_FILE in t.instruction and ANSWER_FILE in t.instruction
