"""The dense layout's programs (``DenseSlots``: prefill -> insert -> generate, JetStream's functional form, which the
dense ``Engine`` runs) against step-by-step greedy decoding with the uncached model."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gyre_jax.serving.dense import DenseSlots
from gyre_jax.serving.sampling import key_for_seed
from gyre_jax.serving.shapes import pack_prompts as _pack_prompts
from gyre_jax.serving.shapes import packed_row_buckets, prompt_count_bucket
from gyre_jax.serving.types import ContextTooLongError, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def engine(engine) -> DenseSlots:
    """The shared test engine's dense programs (tests/serving/conftest.py)."""
    return engine.dense


@pytest.fixture
def other_engine(other_engine):
    eng, params, params_b = other_engine
    return eng.dense, params, params_b


class Driver:
    """Runs the engine like a serving loop would and records each slot's stream."""

    def __init__(self, engine: DenseSlots, params):
        self.engine, self.params = engine, params
        self.state = engine.init_decode_state()
        self.live: dict[int, dict] = {}  # slot -> {"prompt", "tokens", "logprobs"}
        self.done: list[dict] = []

    def insert(self, slot: int, prompt: list[int], sp: SamplingParams = GREEDY, seed: int = 0) -> None:
        if slot in self.live:
            self.done.append(self.live.pop(slot))
        prefix = self.engine.prefill(params=self.params, tokens=prompt, sampling_params=sp, key=key_for_seed(seed))
        assert int(prefix.length) == len(prompt)
        bucket = prefix.cache[0].k.shape[1]
        assert bucket == min(b for b in self.engine.prefill_buckets if b >= len(prompt))
        self.state = self.engine.insert(prefix, self.state, slot, sp)
        self.live[slot] = {
            "slot": slot,
            "prompt": prompt,
            "tokens": [int(prefix.token)],
            "logprobs": [float(prefix.logprob)],
        }

    def generate(self, steps: int) -> None:
        for _ in range(steps):
            # the longest live cache: decode attends over the smallest window above it (64, later 128)
            longest = max(len(r["prompt"]) + len(r["tokens"]) - 1 for r in self.live.values())
            self.state, result = self.engine.generate(
                self.params, self.state, max_length=longest, slot_limit=max(self.live) + 1
            )
            assert (
                result.tokens.shape
                == result.logprobs.shape
                == result.lengths.shape
                == (self.engine.max_concurrent_decodes,)
            )
            for slot, rec in self.live.items():
                rec["tokens"].append(int(result.tokens[slot]))
                rec["logprobs"].append(float(result.logprobs[slot]))
                # the slot's cache now holds the prompt and every token but the newest
                assert int(result.lengths[slot]) == len(rec["prompt"]) + len(rec["tokens"]) - 1

    def finish(self) -> list[dict]:
        return self.done + list(self.live.values())


def test_engine_properties_and_decode_state_layout(engine, cell_mesh) -> None:
    assert engine.max_concurrent_decodes == 4
    assert engine.max_prefill_length == 64
    assert engine.mesh is cell_mesh
    assert engine.prefill_buckets == (16, 32, 64, 128)  # buckets end at max_seq_len
    assert engine.decode_windows == (64, 128)
    assert [engine.decode_window(n) for n in (None, 0, 63, 64, 127, 500)] == [128, 64, 64, 128, 128, 128]
    assert engine.decode_slot_buckets == (2, 4)
    assert [engine.decode_slots(n) for n in (None, 1, 2, 3, 4)] == [4, 2, 2, 4, 4]
    state = engine.init_decode_state()
    # heads first, in blocks between the decode windows: a window is read as whole blocks, no copy
    assert engine.decode_blocks == (64, 64)
    kh, d = engine.cfg.num_kv_heads, engine.cfg.head_dim
    assert [b.shape for b in state.cache[0].k] == [(4, kh, 64, d)] * 2 and state.cache[0].length == 128
    assert state.cache[0].k[1].sharding.spec == P("data", None, None, None)  # slots split over the cell's data axis
    assert set(state.cache[0].k[0].sharding.device_set) == set(jax.devices()[4:8])
    assert state.tokens.sharding.spec == P("data")
    np.testing.assert_array_equal(state.lengths, 0)


def test_greedy_generation_equals_uncached_step_by_step_decoding(engine, model_params, reference, prompts) -> None:
    """Slots join while others are mid-generation; a slot is reused by a shorter prompt after a longer one."""
    _, params, _ = model_params
    d = Driver(engine, params)
    d.insert(1, prompts[7])  # 16 tokens, alone in slot 1: steps run over slots 0-1 only
    d.generate(2)
    d.insert(2, prompts[0])  # 5 tokens: now all 4 slots are stepped
    d.generate(3)
    d.insert(0, prompts[1])  # 13 tokens, joins while slot 2 is mid-generation
    d.generate(2)
    d.insert(3, prompts[2])  # 1 token
    d.insert(1, prompts[3])  # 22 tokens (32 bucket): two inserts between the same generate steps
    d.generate(4)
    d.insert(0, prompts[5])  # 40 tokens (64 bucket) replaces slot 0
    d.generate(5)
    d.insert(0, prompts[6])  # 3 tokens: slot 0's cache still holds the 45 stale positions of the last occupant
    d.insert(3, prompts[4])  # 9 tokens
    d.generate(6)
    d.insert(2, (prompts[5] * 2)[:60])  # 60 tokens: the decode window grows from 64 to 128 positions mid-run
    d.generate(8)
    records = d.finish()
    assert len(records) == 9 and min(len(r["tokens"]) for r in records) >= 3

    for rec in records:
        want_tokens, want_logprobs = reference.greedy(params, rec["prompt"], len(rec["tokens"]))
        assert rec["tokens"] == want_tokens, (rec["slot"], len(rec["prompt"]))
        np.testing.assert_allclose(rec["logprobs"], want_logprobs, atol=1e-4, rtol=0)
    # a random model is not constant: the comparison above covers more than one token value
    assert len({t for r in records for t in r["tokens"]}) > 3


def test_sampled_slots_follow_their_keys_and_report_behaviour_logprobs(
    engine, model_params, reference, prompts
) -> None:
    """The same prompt and key in two slots (next to a greedy slot) give the same stream; log-probs are the model's."""
    _, params, _ = model_params
    sp = SamplingParams(temperature=1.0)
    d = Driver(engine, params)
    d.insert(0, prompts[4], sp, seed=7)
    d.insert(1, prompts[0])
    d.insert(3, prompts[4], sp, seed=7)
    d.insert(2, prompts[4], sp, seed=8)
    d.generate(8)
    same_a, greedy, same_b, other = (d.live[s] for s in (0, 1, 3, 2))
    assert same_a["tokens"] == same_b["tokens"]
    np.testing.assert_allclose(same_a["logprobs"], same_b["logprobs"], atol=1e-6)
    assert other["tokens"] != same_a["tokens"]
    assert greedy["tokens"] == reference.greedy(params, prompts[0], 9)[0]
    for rec in (same_a, other):
        # temperature 1: the behaviour log-prob is log_softmax(logits)[token] of the uncached model
        lp = reference.logprobs(params, rec["prompt"] + rec["tokens"])[len(rec["prompt"]) - 1 : -1]
        np.testing.assert_allclose(rec["logprobs"], lp[np.arange(len(rec["tokens"])), rec["tokens"]], atol=1e-4, rtol=0)
        assert not np.array_equal(rec["tokens"], lp.argmax(-1))  # really sampled, not greedy


def test_new_weights_of_the_same_layout_do_not_recompile(engine, model_params, reference, prompts) -> None:
    _, params, params_b = model_params
    d = Driver(engine, params)
    d.insert(0, prompts[1])
    d.generate(1)
    compiled = engine.programs.count("generate")
    d.params = params_b
    d.insert(1, prompts[1])
    d.generate(4)
    assert engine.programs.count("generate") == compiled
    # slot 1 ran entirely under the new weights
    assert d.live[1]["tokens"] == reference.greedy(params_b, prompts[1], 5)[0]
    assert d.live[1]["tokens"] != reference.greedy(params, prompts[1], 5)[0]


def test_prompts_that_do_not_fit_are_rejected(engine, model_params, cell_mesh, rules) -> None:
    graphdef, params, _ = model_params
    key = key_for_seed(0)
    with pytest.raises(ContextTooLongError, match="max_prefill_length=64"):
        engine.prefill(params=params, tokens=[1] * 65, sampling_params=GREEDY, key=key)
    with pytest.raises(ValueError, match="empty"):
        engine.prefill(params=params, tokens=[], sampling_params=GREEDY, key=key)
    # with prefill allowed up to the context, a prompt must still leave room for one generated token
    full = DenseSlots(
        engine.cfg,
        graphdef,
        cell_mesh,
        rules,
        max_concurrent_decodes=4,
        max_seq_len=32,
        max_prefill_length=32,
        prefill_buckets=(16,),
    )
    assert full.prefill_buckets == (16, 32)
    with pytest.raises(ContextTooLongError, match="no room to generate within max_seq_len=32"):
        full.prefill(params=params, tokens=[1] * 32, sampling_params=GREEDY, key=key)
    with pytest.raises(ContextTooLongError):
        full.prefill(params=params, tokens=[1] * 33, sampling_params=GREEDY, key=key)
    assert issubclass(ContextTooLongError, ValueError)


def _chunked_prefix(engine, params, prompt, chunks, sp=GREEDY, seed=0, fresh_first=False):
    """Prefills ``prompt`` in chunks of the given sizes, each on top of the previous (the request key every time),
    starting from the engine's empty full-length prefix (or, ``fresh_first``, from a bucket-sized first chunk)."""
    prefix, start = (None if fresh_first else engine.empty_prefix(key_for_seed(seed))), 0
    assert prefix is None or int(prefix.length) == 0
    for n in chunks:
        prefix = engine.prefill(
            params=params,
            tokens=prompt[start : start + n],
            sampling_params=sp,
            key=key_for_seed(seed),
            existing_prefix=prefix,
        )
        start += n
    assert start == len(prompt) and int(prefix.length) == len(prompt)
    return prefix


def test_chunked_prefill_equals_uncached_greedy_and_keeps_seeded_sampling(
    engine, model_params, reference, prompts
) -> None:
    """Prompts prefilled in chunks (including one longer than max_prefill_length) decode like the uncached model."""
    _, params, _ = model_params
    long_prompt = (prompts[5] * 3)[:100]  # > max_prefill_length=64: needs two prefill calls
    cases = [
        (prompts[5], (16, 16, 8), True),
        (prompts[3], (1, 21), False),
        (long_prompt, (64, 36), False),
        (prompts[0], (5,), False),
    ]
    state = engine.init_decode_state()
    streams = {}
    for slot, (prompt, chunks, fresh_first) in enumerate(cases):
        prefix = _chunked_prefix(engine, params, prompt, chunks, fresh_first=fresh_first)
        assert prefix.cache[0].k.shape[1] == engine.max_seq_len  # on top of a prefix: full-length cache
        state = engine.insert(prefix, state, slot, GREEDY)
        streams[slot] = [int(prefix.token)], [float(prefix.logprob)]
    for _ in range(6):
        state, result = engine.generate(params, state)
        assert result.valid.all()
        for slot in streams:
            streams[slot][0].append(int(result.tokens[slot]))
            streams[slot][1].append(float(result.logprobs[slot]))
    for slot, (prompt, _, _) in enumerate(cases):
        want_tokens, want_logprobs = reference.greedy(params, prompt, 7)
        assert streams[slot][0] == want_tokens, slot
        np.testing.assert_allclose(streams[slot][1], want_logprobs, atol=1e-4, rtol=0)

    # sampling: the first token depends on the whole prompt and the key, not on how it was chunked
    sp = SamplingParams(temperature=1.0)
    whole = engine.prefill(params=params, tokens=prompts[5], sampling_params=sp, key=key_for_seed(3))
    firsts = set()
    for chunks in ((20, 20), (1, 39), (8, 8, 8, 8, 8)):
        chunked = _chunked_prefix(engine, params, prompts[5], chunks, sp=sp, seed=3)
        assert int(chunked.token) == int(whole.token)
        np.testing.assert_allclose(float(chunked.logprob), float(whole.logprob), atol=1e-5)
        np.testing.assert_array_equal(chunked.key, whole.key)
    for seed in range(12):  # different keys do sample different tokens here, so the equality above is not vacuous
        firsts.add(
            int(engine.prefill(params=params, tokens=prompts[5], sampling_params=sp, key=key_for_seed(seed)).token)
        )
    assert len(firsts) > 1
    with pytest.raises(ContextTooLongError, match="no room to generate"):
        _chunked_prefix(engine, params, long_prompt + [1] * 28, (64, 64))


def test_a_slot_beyond_the_decode_window_samples_nothing(engine, model_params, reference, prompts) -> None:
    """A too-small max_length hint never corrupts a slot: it is reported invalid and left as it was."""
    _, params, _ = model_params
    state = engine.init_decode_state()
    long_prompt = (prompts[5] * 2)[:64]
    for slot, p in ((0, prompts[0]), (1, long_prompt)):
        state = engine.insert(
            engine.prefill(params=params, tokens=p, sampling_params=GREEDY, key=key_for_seed(0)), state, slot, GREEDY
        )
    state, result = engine.generate(params, state, max_length=len(prompts[0]))  # window 64: position 64 is outside
    np.testing.assert_array_equal(result.valid, [True, False, False, False])
    np.testing.assert_array_equal(result.lengths[:2], [len(prompts[0]) + 1, 64])
    state, result = engine.generate(params, state, max_length=64)  # window 128: slot 1 continues, unharmed
    assert result.valid[:2].all()
    assert int(result.tokens[1]) == reference.greedy(params, long_prompt, 2)[0][1]
    state = engine.insert(
        engine.prefill(params=params, tokens=prompts[2], sampling_params=GREEDY, key=key_for_seed(0)), state, 3, GREEDY
    )
    lengths = np.asarray(state.lengths)
    state, result = engine.generate(params, state, max_length=70, slot_limit=2)  # slot 3 is left out
    np.testing.assert_array_equal(result.valid, [True, True, False, False])
    np.testing.assert_array_equal(result.lengths, lengths + [1, 1, 0, 0])
    state, result = engine.generate(params, state, max_length=70)  # all slots: slot 3 continues, unharmed
    assert result.valid[[0, 1, 3]].all()
    assert int(result.tokens[3]) == reference.greedy(params, prompts[2], 2)[0][1]


def test_released_slots_are_invalid_and_write_nothing(engine, model_params, prompts) -> None:
    _, params, _ = model_params
    state = engine.init_decode_state()
    state, result = engine.generate(params, state)
    assert not result.valid.any()  # no slot holds a request yet
    for slot in (0, 1):
        state = engine.insert(
            engine.prefill(params=params, tokens=prompts[slot], sampling_params=GREEDY, key=key_for_seed(0)),
            state,
            slot,
            GREEDY,
        )
    state = engine.release(state, 1)
    before = np.asarray(state.cache[0].k[0][1])
    state, result = engine.generate(params, state)
    np.testing.assert_array_equal(result.valid, [True, False, False, False])
    np.testing.assert_array_equal(result.lengths[:2], [len(prompts[0]) + 1, len(prompts[1])])
    np.testing.assert_array_equal(np.asarray(state.cache[0].k[0][1]), before)  # the released slot's KV is untouched


def test_slot_kv_through_pages_continues_like_the_uncached_model(engine, model_params, reference, prompts) -> None:
    """save_slot -> pool pages -> load_prefix -> prefill only the new tokens: what the session prefix cache does."""
    _, params, _ = model_params
    p = engine.page_size
    assert engine.max_seq_len % p == 0 and engine.pages_per_seq == engine.max_seq_len // p
    pool = engine.init_page_pool(24)
    assert pool.pages[0].k.shape == (24, p, engine.cfg.num_kv_heads, engine.cfg.head_dim)
    state = engine.init_decode_state()
    prompt = prompts[3]  # 22 tokens
    prefix = engine.prefill(params=params, tokens=prompt, sampling_params=GREEDY, key=key_for_seed(0))
    state = engine.insert(prefix, state, 2, GREEDY)
    turn1 = [int(prefix.token)]
    for _ in range(9):
        state, result = engine.generate(params, state)
        turn1.append(int(result.tokens[2]))
    assert turn1 == reference.greedy(params, prompt, 10)[0]
    kv_tokens = prompt + turn1[:-1]  # 31 tokens are in the slot's cache
    pages = [7, 3, 20]  # scattered, out of order: 3 pages of 16 hold 31 tokens
    pool = engine.save_slot(pool, state, 2, pages)
    state = engine.release(state, 2)

    # the next turn extends the conversation; only the tokens after the cached 31 are prefilled
    turn2_prompt = prompt + turn1 + [5, 6, 7]
    for reused in (len(kv_tokens), 17):  # the whole entry, or only part of it (a shorter common prefix)
        loaded = engine.load_prefix(pool, pages, reused, key_for_seed(1))
        prefix = engine.prefill(
            params=params,
            tokens=turn2_prompt[reused:],
            sampling_params=GREEDY,
            key=key_for_seed(1),
            existing_prefix=loaded,
        )
        state = engine.insert(prefix, state, 0, GREEDY)
        tokens = [int(prefix.token)]
        for _ in range(5):
            state, result = engine.generate(params, state)
            tokens.append(int(result.tokens[0]))
        assert tokens == reference.greedy(params, turn2_prompt, 6)[0], reused
    with pytest.raises(ValueError, match="length=49"):
        engine.load_prefix(pool, pages, 49, key_for_seed(1))


def test_kv_export_import_to_another_submesh_continues_identically(
    engine, other_engine, model_params, reference, prompts
) -> None:
    """A decoding slot moves to an engine on other devices mid-generation: greedy and seeded sampled streams
    are token for token those of the unmigrated run."""
    _, params, _ = model_params
    engine_b, params_on_b, _ = other_engine
    assert not set(engine_b.mesh.devices.flat) & set(engine.mesh.devices.flat)
    cases = [(prompts[1], GREEDY, 0), (prompts[4], SamplingParams(temperature=1.0), 5)]

    def run(prompt, sp, seed, migrate_after=None):
        eng, prm, state = engine, params, engine.init_decode_state()
        prefix = eng.prefill(params=prm, tokens=prompt, sampling_params=sp, key=key_for_seed(seed))
        state = eng.insert(prefix, state, 1, sp)
        tokens, logprobs = [int(prefix.token)], [float(prefix.logprob)]
        for step in range(12):
            if step == migrate_after:
                kv = eng.export_slot(state, 1, len(prompt) + len(tokens) - 1)
                key = state.keys[1]
                moved = engine_b.to_mesh(kv)
                assert set(moved.pages[0].k.sharding.device_set) <= set(engine_b.mesh.devices.flat)
                eng, prm, state = engine_b, params_on_b, engine_b.init_decode_state()
                prefix = eng.prefix_from_pages(
                    moved,
                    len(prompt) + len(tokens) - 1,
                    jax.device_put(key, eng._replicated),
                    token=tokens[-1],
                    logprob=logprobs[-1],
                )
                state = eng.insert(prefix, state, 3, sp)  # another slot index on the new engine
            slot = 1 if eng is engine else 3
            state, result = eng.generate(prm, state)
            tokens.append(int(result.tokens[slot]))
            logprobs.append(float(result.logprobs[slot]))
        return tokens, logprobs

    for prompt, sp, seed in cases:
        base_tokens, base_logprobs = run(prompt, sp, seed)
        for migrate_after in (0, 5):
            tokens, logprobs = run(prompt, sp, seed, migrate_after)
            assert tokens == base_tokens, (len(prompt), migrate_after)
            np.testing.assert_allclose(logprobs, base_logprobs, atol=1e-5, rtol=0)
        if sp.temperature == 0:
            assert base_tokens == reference.greedy(params, prompt, 13)[0]

    bad = engine.export_slot(engine.init_decode_state(), 0, 16)
    bad.pages = bad.pages[:1]
    with pytest.raises(ValueError, match="do not match this engine's layout"):
        engine_b.to_mesh(bad)


def _blockwise_engine(engine, cell_mesh, rules) -> DenseSlots:
    """``engine``'s twin with attention_impl='blockwise' (MaskSpec masks, 16-token blocks), the same parameters."""
    from gyre_jax.model.sharding import abstract_model

    cfg = dataclasses.replace(engine.cfg, attention_impl="blockwise", attention_block_q=16, attention_block_k=16)
    graphdef, _ = abstract_model(cfg)
    return DenseSlots(
        cfg,
        graphdef,
        cell_mesh,
        rules,
        max_concurrent_decodes=engine.max_concurrent_decodes,
        max_seq_len=engine.max_seq_len,
        max_prefill_length=engine.max_prefill_length,
        prefill_buckets=engine.prefill_buckets,
        decode_windows=engine.decode_windows,
        decode_slot_buckets=engine.decode_slot_buckets,
    )


def test_blockwise_attention_engine_generates_the_dense_greedy_tokens(
    engine, model_params, cell_mesh, rules, reference, prompts
):
    """attention_impl='blockwise' (MaskSpec per prefill / decode step, 16-token blocks): fresh and chunked
    prefills and decode steps over a window and over slot subsets give the uncached dense model's greedy tokens."""
    _, params, _ = model_params
    blockwise = _blockwise_engine(engine, cell_mesh, rules)
    assert blockwise.decode_windows == (64, 128) and blockwise.decode_slot_buckets == (2, 4)
    d = Driver(blockwise, params)
    d.insert(1, prompts[7])  # alone in slot 1: steps over slots 0-1, a 64-position window
    d.generate(2)
    d.insert(2, prompts[3])  # 22 tokens: all 4 slots stepped
    d.generate(3)
    prefix = _chunked_prefix(blockwise, params, prompts[5], (16, 16, 8))  # on top of prefixes: full-length cache
    d.state = blockwise.insert(prefix, d.state, 0, GREEDY)
    d.live[0] = {"slot": 0, "prompt": prompts[5], "tokens": [int(prefix.token)], "logprobs": [float(prefix.logprob)]}
    d.generate(4)
    records = d.finish()
    for rec in records:
        want_tokens, want_logprobs = reference.greedy(params, rec["prompt"], len(rec["tokens"]))
        assert rec["tokens"] == want_tokens, (rec["slot"], len(rec["prompt"]))
        np.testing.assert_allclose(rec["logprobs"], want_logprobs, atol=1e-4, rtol=0)
    assert len({t for r in records for t in r["tokens"]}) > 3


def test_several_steps_in_one_program_equal_as_many_single_steps(engine, model_params, rules, prompts) -> None:
    """``generate(num_steps=n)``, n <= decode_steps = 4: the tokens, log-probs, lengths and final state of n single
    steps (sampled slots, a greedy one, an empty one), for 4 and for 3 (the same compiled program: its trip count is
    an argument); a slot whose cache fills the decode window stops being stepped mid-program."""
    graphdef, params, _ = model_params
    e, slots = engine, engine.max_concurrent_decodes
    engine = DenseSlots(
        e.cfg, graphdef, e.mesh, rules, max_concurrent_decodes=slots, max_seq_len=e.max_seq_len,
        max_prefill_length=e.max_prefill_length, prefill_buckets=e.prefill_buckets, decode_steps=4,
    )  # fmt: skip
    sp = SamplingParams(temperature=1.0)
    runs = []
    for schedule in ((1,) * 8, (4, 4), (3, 1, 4)):
        d = Driver(engine, params)
        d.insert(0, prompts[4], sp, seed=7)
        d.insert(1, prompts[0])
        d.insert(3, (prompts[5] * 2)[:62], sp, seed=3)  # 62 tokens: fills the 64-position window after 2 steps
        out = []
        for n in schedule:
            if n == 1:
                d.state, r = engine.generate(params, d.state, max_length=60, slot_limit=4)  # window 64
                out.append((r.tokens, r.logprobs, r.lengths, r.valid))
            else:
                # window 64 too (57 + n - 1): a hint below slot 3's length, so that its cache fills the window
                d.state, r = engine.generate(params, d.state, max_length=57, slot_limit=4, num_steps=n)
                assert r.tokens.shape == r.logprobs.shape == r.valid.shape == (n, slots)
                out.extend(zip(r.tokens, r.logprobs, r.lengths, r.valid))
        runs.append((out, jax.device_get(d.state)))
    (one, state_one), *multi = runs
    for several, state_several in multi:
        for a, b in zip(one, several, strict=True):
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_allclose(a[1], b[1], atol=1e-6)
            np.testing.assert_array_equal(a[2], b[2])
            np.testing.assert_array_equal(a[3], b[3])
        assert [bool(x[3][2]) for x in several] == [False] * 8  # the empty slot is never stepped
        assert [bool(x[3][3]) for x in several] == [True, True] + [False] * 6  # slot 3 filled the window
        assert all(bool(x[3][0]) for x in several) and len({int(x[0][0]) for x in several}) > 1  # sampled
        for a, b in zip(jax.tree.leaves(state_one), jax.tree.leaves(state_several)):
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=1e-6)
    assert engine.programs.count("generate_steps") == 1  # 3 and 4 steps: one program
    with pytest.raises(ValueError, match="num_steps=5 must be between 1 and the engine's decode_steps=4"):
        engine.generate(params, multi[-1][1], num_steps=5)


def test_pack_prompts_places_each_prompt_whole_and_alone_in_the_fewest_bucketed_rows(engine) -> None:
    """First fit, longest first, rows as wide as the longest prompt's bucket; the row count the smallest of
    ``packed_row_buckets`` that holds them; every prompt's tokens contiguous from position 0 in its own segment."""
    rng = np.random.default_rng(1)
    assert packed_row_buckets(1) == (1,) and packed_row_buckets(2) == (1, 2) and packed_row_buckets(32) == (16, 24, 32)
    for lengths, width, rows in (
        ((22, 13, 9, 5), 32, 2),  # 22 + 9 | 13 + 5
        ((16, 16, 16), 16, 3),  # full rows: one prompt each, 3 of the 4-prompt bucket
        ((40, 30, 20, 10, 8, 3), 64, 4),  # 8 prompts: 40 + 20 + 3 | 30 + 10 + 8 -> 2 rows, the bucket's least is 4
        ((1, 1), 16, 1),
    ):
        prompts = [rng.integers(1, 256, size=n).tolist() for n in lengths]
        tokens, positions, segments, row, offset, length = _pack_prompts(prompts, engine)
        assert tokens.shape == positions.shape == segments.shape == (rows, width)
        assert len(row) == len(offset) == len(length) == prompt_count_bucket(len(prompts))
        taken = np.zeros((rows, width), bool)
        for i, p in enumerate(prompts):
            cols = slice(offset[i], offset[i] + len(p))
            assert length[i] == len(p) and tokens[row[i], cols].tolist() == p
            assert positions[row[i], cols].tolist() == list(range(len(p))) and (segments[row[i], cols] == i + 1).all()
            assert not taken[row[i], cols].any()
            taken[row[i], cols] = True
        assert (segments[~taken] == 0).all() and (length[len(prompts) :] == 0).all()


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_packed_prompts_prefill_as_each_alone(engine, model_params, cell_mesh, rules, prompts, impl) -> None:
    """``prefill_many`` of 5 prompts packed 2-3 per row (3 rows for 8 prompt entries; dense masks and MaskSpecs):
    each prompt's first token (greedy and sampled), log-prob, key and KV equal ``prefill`` of it alone, and its
    KV is zero past its length (the next prompt's tokens in its row are not copied)."""
    eng = engine if impl == "xla" else _blockwise_engine(engine, cell_mesh, rules)
    _, params, _ = model_params
    chosen = [prompts[i] for i in (3, 1, 4, 0, 6)]  # 22, 13, 9, 5, 3 tokens: bucket 32, 2 rows -> 4 of 8
    sps = [GREEDY, SamplingParams(temperature=1.0), GREEDY, SamplingParams(temperature=0.8, top_k=7), GREEDY]
    keys = [key_for_seed(s) for s in range(5)]
    assert _pack_prompts(chosen, eng)[0].shape == (4, 32)
    many = jax.device_get(eng.prefill_many(params=params, prompts=chosen, sampling=sps, keys=keys))
    assert many.token.shape == (8,) and many.cache[0].k.shape[:2] == (8, 32)
    for i, (p, sp, key) in enumerate(zip(chosen, sps, keys)):
        alone = jax.device_get(eng.prefill(params=params, tokens=p, sampling_params=sp, key=key))
        n = len(p)
        assert int(many.token[i]) == int(alone.token) and int(many.length[i]) == n
        np.testing.assert_allclose(many.logprob[i], alone.logprob, atol=1e-5)
        np.testing.assert_array_equal(many.key[i], alone.key)
        for a, b in zip(many.cache, alone.cache):
            for x, y in ((a.k, b.k), (a.v, b.v)):
                np.testing.assert_allclose(x[i, :n], y[0, :n], atol=1e-5)
                assert not np.asarray(x[i, n:]).any()
    assert not any(np.asarray(c.k[5:]).any() for c in many.cache)  # the padding entries hold nothing


def test_several_prompts_prefilled_in_one_program_equal_one_at_a_time(engine, model_params, prompts) -> None:
    """``prefill_many`` + ``insert_many`` of 3 prompts of different lengths (one padding row): the first tokens,
    log-probs, keys and slot KV of ``prefill`` + ``insert`` each, and the same streams after 5 generate steps."""
    _, params, _ = model_params
    chosen = [prompts[4], prompts[0], prompts[7]]  # 9, 5, 16 tokens: one bucket (16), rows padded to 4
    sps = [SamplingParams(temperature=1.0), GREEDY, SamplingParams(temperature=0.7, top_k=5)]
    keys = [key_for_seed(s) for s in (3, 4, 5)]
    slots = [2, 0, 3]
    one = engine.init_decode_state()
    for p, sp, k, slot in zip(chosen, sps, keys, slots):
        one = engine.insert(engine.prefill(params=params, tokens=p, sampling_params=sp, key=k), one, slot, sp)
    batched = engine.prefill_many(params=params, prompts=chosen, sampling=sps, keys=keys)
    assert batched.token.shape == (4,) and [int(x) for x in batched.length] == [9, 5, 16, 0]
    many = engine.insert_many(batched, engine.init_decode_state(), slots, sps)
    streams = []
    for state in (one, many):
        out = []
        for _ in range(5):
            state, r = engine.generate(params, state)
            out.append((r.tokens, r.logprobs, r.valid))
        streams.append((out, jax.device_get(state)))
    (out_one, s_one), (out_many, s_many) = streams
    for a, b in zip(out_one, out_many):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_allclose(a[1], b[1], atol=1e-5)
        np.testing.assert_array_equal(a[2], b[2])
    assert [bool(v) for v in out_many[0][2]] == [True, False, True, True]  # slot 1 was never filled
    for a, b in zip(jax.tree.leaves(s_one), jax.tree.leaves(s_many)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=1e-5)
    with pytest.raises(ContextTooLongError, match="prefill it alone, in chunks"):
        engine.prefill_many(params=params, prompts=[[1] * (engine.max_prefill_length + 1)], sampling=[GREEDY],
                            keys=[keys[0]])  # fmt: skip
