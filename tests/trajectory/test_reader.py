"""Tests for gyre_jax/trajectory/reader.py: a record file is read whole or refused with a reason."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gyre_jax.proxy.records import RecordStore, TitoRecord
from gyre_jax.trajectory.reader import CorruptRecords, check_token_ids, iter_records


def rec(i, prompt=(1, 2), completion=(3, 4), eid="ex", **kw):
    n = len(completion)
    fields = dict(
        execution_id=eid,
        call_index=i,
        thread_id="main",
        request_id=f"r{i}",
        prompt_ids=list(prompt),
        completion_ids=list(completion),
        completion_logprobs=[-0.5] * n,
        policy_versions=[0] * n,
        finish_reason="stop",
        temperature=1.0,
        reused_prefix_len=0,
        t_start=0.0,
        t_end=0.0,
    )
    fields.update(kw)
    return fields


def write(tmp_path, lines, name="ex") -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(b"".join(x if isinstance(x, bytes) else (x + "\n").encode() for x in lines))
    return path


def line(**fields) -> str:
    return json.dumps(fields)


def test_a_whole_file_is_read_in_call_order(tmp_path):
    store = RecordStore(tmp_path)
    for i in range(3):
        store.append(TitoRecord(**rec(i, prompt=[1, 2] + [5] * i)))
    got = list(iter_records(store.path("ex"), "ex", vocab_size=8))
    assert [r.call_index for r in got] == [0, 1, 2]
    assert got[2].prompt_ids == [1, 2, 5, 5]


CASES = {
    "bad JSON in the middle": ([line(**rec(0)), "{not json", line(**rec(2))], r"ex\.jsonl:2: not valid JSON"),
    "truncated last line": ([line(**rec(0)), line(**rec(1)).encode()[:-9]], r"ex\.jsonl:2: truncated file"),
    "a record of another execution": (
        [line(**rec(0, eid="other"))],
        r"record of execution 'other' in the file of 'ex'",
    ),
    "a missing record": ([line(**rec(0)), line(**rec(2))], r"call_index 2 where 1 was expected"),
    "an unknown field": ([line(**rec(0), surprise=1)], r"not a TITO record .*surprise"),
    "a missing field": (
        [json.dumps({k: v for k, v in rec(0).items() if k != "prompt_ids"})],
        r"not a TITO record .*prompt_ids",
    ),
    "lengths that disagree": ([line(**rec(0, completion_logprobs=[-0.5]))], r"must have equal length"),
    "a NaN log-prob": ([line(**rec(0, completion_logprobs=[float("nan"), -0.5]))], r"finite log-probabilities"),
    "a positive log-prob": ([line(**rec(0, completion_logprobs=[0.5, -0.5]))], r"finite log-probabilities"),
    "a negative temperature": ([line(**rec(0, temperature=-0.5))], r"temperature -0.5 must be a finite number >= 0"),
    "an infinite temperature": ([line(**rec(0, temperature=float("inf")))], r"temperature inf must be"),
    "client_sampling not an object": ([line(**rec(0, client_sampling=[1]))], r"client_sampling must be an object"),
    "a token id outside the vocabulary": ([line(**rec(0, completion=(3, 99)))], r"token id 99, outside \[0, 8\)"),
    "a float token id": ([line(**rec(0, completion=(3, 4.5)))], r"completion_ids must be a list of integers"),
    "an empty prompt": ([line(**rec(0, prompt=()))], r"empty prompt_ids"),
    "an unknown agent kind": ([line(**rec(0), agent_kind="helper")], r"agent_kind 'helper' must be one of"),
    "a blank line": ([line(**rec(0)), ""], r"ex\.jsonl:2: blank line"),
    "not UTF-8": ([b"\xff\xfe{}\n"], r"not UTF-8"),
    "not an object": (["[1, 2]"], r"expected a JSON object, got list"),
    "an empty file": ([], r"empty record file"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_corrupt_files_are_refused_with_a_reason(tmp_path, case):
    lines, reason = CASES[case]
    path = write(tmp_path, lines)
    with pytest.raises(CorruptRecords, match=reason):
        list(iter_records(path, "ex", vocab_size=8))


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(CorruptRecords, match="no record file"):
        list(iter_records(tmp_path / "nope.jsonl", "nope"))


def test_check_token_ids():
    np.testing.assert_array_equal(check_token_ids([0, 5, 7], 8, "x"), [0, 5, 7])
    assert check_token_ids([0, 5], None, "x").dtype == np.int32
    with pytest.raises(CorruptRecords, match=r"x: token id 8 is outside \[0, 8\)"):
        check_token_ids([0, 8], 8, "x")
    with pytest.raises(CorruptRecords, match="must be integers"):
        check_token_ids([0, 1.5], 8, "x")
    with pytest.raises(CorruptRecords, match="must be integers"):
        check_token_ids([0, "a"], None, "x")
    with pytest.raises(CorruptRecords, match="int32"):
        check_token_ids([2**40], None, "x")
