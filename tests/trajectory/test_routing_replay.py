"""Routing replay data path: expert ids in TITO records (compact, round trip), carried through branches, tree and
plain chunks and packed micro-batches aligned to each row's input tokens; config checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gyre_jax.config import config_from_dict, load_config
from gyre_jax.config.base import ConfigError
from gyre_jax.proxy.records import RecordStore, TitoRecord, decode_experts, encode_experts
from gyre_jax.trajectory.branches import build_branches
from gyre_jax.trajectory.packing import MicroBatchPacker
from gyre_jax.trajectory.reader import CorruptRecords, iter_records
from gyre_jax.trajectory.select import select
from gyre_jax.trajectory.tree import plain_chunks, tree_chunks

L, K = 3, 2  # MoE layers, experts per token


def _ids_for(tokens: list[int], part: int) -> np.ndarray:
    """Distinct, checkable expert ids [n, L, K]: a function of the token, the layer, the slot and the record part."""
    t = np.asarray(tokens)[:, None, None]
    return ((t * 7 + np.arange(L)[None, :, None] * 3 + np.arange(K)[None, None, :] + part * 50) % 120).astype(np.int16)


def _record(i: int, prompt: list[int], completion: list[int], prompt_experts: bool = True) -> TitoRecord:
    experts = _ids_for(completion, 1)
    experts[-1] = -1  # the last token is never fed back within its call
    return TitoRecord(
        execution_id="e0", call_index=i, thread_id="main", request_id=f"r{i}", prompt_ids=prompt,
        completion_ids=completion, completion_logprobs=[-0.5] * len(completion),
        policy_versions=[0] * len(completion), finish_reason="stop", temperature=1.0, reused_prefix_len=0,
        t_start=0.0, t_end=0.0, completion_experts=encode_experts(experts),
        prompt_experts=encode_experts(_ids_for(prompt, 2)) if prompt_experts else None,
    )  # fmt: skip


def test_encoding_is_compact_and_round_trips_through_a_record_file(tmp_path) -> None:
    small = _ids_for([5, 9, 1], 0)
    enc = encode_experts(small)
    assert enc["dtype"] == "int8" and enc["shape"] == [3, L, K] and len(enc["data"]) == 4 * ((3 * L * K + 2) // 3)
    np.testing.assert_array_equal(decode_experts(enc), small)
    big = small.astype(np.int16) + 200  # more than 127 experts: int16
    assert encode_experts(big)["dtype"] == "int16"
    np.testing.assert_array_equal(decode_experts(encode_experts(big)), big)
    rec = _record(0, [1, 2, 3], [4, 5])
    store = RecordStore(tmp_path)
    store.append(rec)
    (back,) = store.read("e0")
    np.testing.assert_array_equal(back.experts(), rec.experts())
    np.testing.assert_array_equal(back.experts("prompt"), _ids_for([1, 2, 3], 2))
    (strict,) = iter_records(tmp_path / "e0.jsonl", "e0", 64)  # the trainer's reader
    np.testing.assert_array_equal(strict.experts(), rec.experts())
    plain = _record(0, [1], [2])
    plain.completion_experts = plain.prompt_experts = None
    assert (
        json.loads(plain.to_json())["completion_experts"] is None
        and TitoRecord.from_json(plain.to_json()).experts() is None
    )


@pytest.mark.parametrize(
    "bad, reason",
    [
        ({"shape": [3, L, K], "dtype": "int8", "data": encode_experts(_ids_for([1], 0))["data"]}, "cannot reshape"),
        ({"shape": [2, L, K], "dtype": "float32", "data": ""}, "must be int8 or int16"),
        ({"shape": [2, L, K], "dtype": "int8", "data": "%%"}, "not an encode_experts dict"),
        ({"dtype": "int8"}, "not an encode_experts dict"),
    ],
)
def test_bad_expert_ids_in_a_record_exclude_it_with_the_reason(tmp_path, bad, reason) -> None:
    line = json.loads(_record(0, [1, 2], [3, 4]).to_json())
    line["completion_experts"] = bad
    (tmp_path / "e0.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(CorruptRecords, match=reason):
        list(iter_records(tmp_path / "e0.jsonl", "e0", 64))


def test_rows_for_another_number_of_tokens_are_refused() -> None:
    with pytest.raises(ValueError, match="completion_experts has 3 rows for 2 completion ids"):
        r = _record(0, [1], [2, 3])
        TitoRecord(**{**r.__dict__, "completion_experts": encode_experts(_ids_for([1, 2, 3], 0))})


def _records(prompt_experts: bool = True) -> list[TitoRecord]:
    """Two samples of one prompt (a tree: shared prefix), then a call continuing the first (multi-turn)."""
    p = [1, 2, 3, 4]
    return [
        _record(0, p, [10, 11, 12], prompt_experts),
        _record(1, p, [20, 21], prompt_experts),
        _record(2, p + [10, 11, 12, 30, 31], [40, 41, 42], prompt_experts),
    ]


@pytest.mark.parametrize("packing", ["tree", "plain"])
@pytest.mark.parametrize("prompt", [True, False])
def test_packed_micro_batches_carry_each_input_tokens_experts(packing, prompt) -> None:
    branches = build_branches(_records(), prompt_experts=prompt)
    sel = select("e0", branches, None)
    chunks = tree_chunks(sel, 32, 8) if packing == "tree" else plain_chunks(sel, 32)
    packer = MicroBatchPacker(rows=2, row_length=32, max_sequences=8, open_micro_batches=1, experts=(L, K))
    n = sel.num_selected
    (packed,) = [p for c in chunks for p in packer.add(c, 1.0, [1.0] * n, ["main"] * n)] + packer.flush()
    mb = packed.micro_batch
    assert mb.expert_ids.shape == (2, 32, L, K) and mb.expert_ids.dtype == np.int16
    # what each token (as the model's input) should carry: its completion's row; a prompt token its prompt
    # row (replayed prompts only); -1 for the last token of a call that a later call did not prefill
    completion = {10: 1, 11: 1, 20: 1, 40: 1, 41: 1}
    want_rows = 0
    for row in range(2):
        for t in range(32):
            if mb.segment_ids[row, t] == 0:
                assert (mb.expert_ids[row, t] == -1).all()  # padding routes itself
                continue
            tok, got = int(mb.tokens[row, t]), mb.expert_ids[row, t]
            if tok in completion:
                want = _ids_for([tok], 1)[0]
            elif tok in (12, 30, 31) and prompt:  # prefilled in call 2's prompt (12: last of call 0)
                want = _ids_for([tok], 2)[0]
            elif tok in (1, 2, 3, 4) and prompt:
                want = _ids_for([tok], 2)[0]
            else:  # a prompt token without prompt replay, or 21 / 42: last tokens never fed back
                want = np.full((L, K), -1)
            np.testing.assert_array_equal(got, want, err_msg=f"token {tok} at row {row}, position {t}")
            want_rows += 1
    assert want_rows == mb.num_tokens
    if packing == "tree":  # the shared prompt is laid out once
        assert mb.num_tokens < sum(len(b.tokens) - 1 for b in branches)


def test_without_replay_micro_batches_carry_no_expert_ids() -> None:
    sel = select("e0", build_branches(_records()), None)
    packer = MicroBatchPacker(rows=2, row_length=32, max_sequences=8, open_micro_batches=1)
    for c in tree_chunks(sel, 32, 8):
        packer.add(c, 1.0, [1.0] * sel.num_selected, ["main"] * sel.num_selected)
    assert all(p.micro_batch.expert_ids is None for p in packer.flush())


def test_routing_replay_config_keys() -> None:
    base = load_config([])
    moe = {"model.num_experts": 4, "model.num_experts_per_tok": 2, "model.moe_mlp_dim": 32}
    cfg = config_from_dict(base, {**moe, "rl.routing_replay": "replay", "rl.routing_replay_prompt": "replay"})
    assert cfg.rl.routing_replay == "replay" and cfg.rl.routing_replay_prompt == "replay"
    assert base.rl.routing_replay == "off" and base.rl.routing_replay_prompt == "recompute"  # the defaults
    with pytest.raises(ConfigError, match="routing_replay='replay' needs a MoE model, but the model is dense"):
        config_from_dict(base, {"rl.routing_replay": "replay"})
    with pytest.raises(ConfigError, match="routing_replay='always' must be one of"):
        config_from_dict(base, {**moe, "rl.routing_replay": "always"})
    with pytest.raises(ConfigError, match="routing_replay_prompt='x' must be one of"):
        config_from_dict(base, {**moe, "rl.routing_replay_prompt": "x"})
