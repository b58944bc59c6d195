"""PagedEngine (one page pool, block tables) against the dense Engine and the uncached reference decoder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from timelimits import scaled

from gyre_jax.serving.paged import PagedEngine, PagePoolExhausted
from gyre_jax.serving.sampling import key_for_seed
from gyre_jax.serving.types import ContextTooLongError, SamplingParams

from .conftest import BUCKETS, CFG, MAX_PREFILL, _ref_logits

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0)
PAGE = 8


def paged(model_params, mesh, rules, num_pages=64, **kw) -> PagedEngine:
    return PagedEngine(
        CFG,
        model_params[0],
        mesh,
        rules,
        max_concurrent_decodes=4,
        num_pages=num_pages,
        page_size=PAGE,
        max_prefill_length=MAX_PREFILL,
        prefill_buckets=BUCKETS,
        **kw,
    )


def uncached_logprobs(graphdef, params, ids: list[int]) -> np.ndarray:
    """log_softmax of the uncached causal forward [n, V] (n <= 256: past the shared reference's 128)."""
    tokens, seg = np.zeros((1, 256), np.int32), np.zeros((1, 256), np.int32)
    tokens[0, : len(ids)], seg[0, : len(ids)] = ids, 1
    return np.asarray(_ref_logits(graphdef, params, jnp.asarray(tokens), jnp.asarray(seg)))[0, : len(ids)]


def dense_stream(engine, params, prompt, sp, seed, steps):
    """The dense engine's tokens and log-probs for ``prompt`` (chunked past max_prefill_length) in slot 0."""
    key, prefix = key_for_seed(seed), None
    for i in range(0, len(prompt), MAX_PREFILL):
        if prefix is None and len(prompt) > MAX_PREFILL:
            prefix = engine.empty_prefix(key)
        prefix = engine.prefill(
            params=params, tokens=prompt[i : i + MAX_PREFILL], sampling_params=sp, key=key, existing_prefix=prefix
        )
    state = engine.insert(prefix, engine.init_decode_state(), 0, sp)
    tokens, logprobs = [int(prefix.token)], [float(prefix.logprob)]
    for _ in range(steps):
        state, r = engine.generate(params, state)
        tokens.append(int(r.tokens[0]))
        logprobs.append(float(r.logprobs[0]))
    return tokens, logprobs


def paged_streams(eng, params, requests, steps, num_steps=1, schedule=None, together=False):
    """requests: {slot: (prompt, sampling, seed)} prefilled (one at a time, or with ``together`` all in one
    ``prefill_many``) then decoded together -> {slot: (tokens, logprobs)}; ``steps`` decode steps in programs of
    ``num_steps`` each, or of the counts in ``schedule``."""
    prompts, sps, keys = zip(*((p, sp, key_for_seed(seed)) for p, sp, seed in requests.values()))
    if together:
        many = jax.device_get(eng.prefill_many(params, list(requests), prompts, sps, keys))
        firsts = list(zip(many.token, many.logprob))
    else:
        firsts = [jax.device_get(eng.prefill(params, slot, *args)) for slot, *args in zip(requests, prompts, sps, keys)]
        firsts = [(f.token, f.logprob) for f in firsts]
    out = {}
    for slot, (token, logprob) in zip(requests, firsts):
        eng.start([slot])
        out[slot] = ([int(token)], [float(logprob)])
    for n in schedule or [num_steps] * (steps // num_steps):
        r = eng.generate(params, num_steps=n)
        toks, lps, valid = (np.reshape(a, (n, -1)) for a in (r.tokens, r.logprobs, r.valid))
        for slot in requests:
            assert valid[:, slot].all()
            out[slot][0].extend(int(t) for t in toks[:, slot])
            out[slot][1].extend(float(x) for x in lps[:, slot])
    return out


@pytest.fixture(scope="module")
def requests(prompts):
    rng = np.random.default_rng(1)
    long = rng.integers(0, 256, size=150).tolist()  # three prefill chunks, 19 pages
    return {0: (prompts[1], GREEDY, 0), 1: (long, SAMPLED, 7), 3: (prompts[5], SAMPLED, 3)}


def test_paged_decoding_gives_the_dense_engines_tokens_and_the_references_greedy_stream(
    model_params, cell_mesh, rules, engine, reference, requests
) -> None:
    _, params, _ = model_params
    eng = paged(model_params, cell_mesh, rules)
    got = paged_streams(eng, params, requests, steps=24)
    long_prompt = requests[1][0]
    dense_cfg = dict(engine=engine.dense, params=params, steps=24)
    for slot, (prompt, sp, seed) in requests.items():
        tokens, logprobs = got[slot]
        if len(prompt) + 24 < engine.max_seq_len:  # the dense engine holds it
            want_t, want_lp = dense_stream(prompt=prompt, sp=sp, seed=seed, **dense_cfg)
            assert tokens == want_t
            np.testing.assert_allclose(logprobs, want_lp, atol=1e-5, rtol=0)
    # the 150-token prompt is past the dense engine's max_seq_len=128: the reference decoder checks it
    reference.check_teacher_forced(params, *requests[0][:1], *got[0])
    lp = uncached_logprobs(model_params[0], params, long_prompt + got[1][0][:-1])[len(long_prompt) - 1 :]
    np.testing.assert_allclose(got[1][1], lp[np.arange(len(got[1][0])), got[1][0]], atol=1e-4, rtol=0)
    # each slot holds the pages its context reached (and one ahead at most), nothing more
    for slot, (prompt, _, _) in requests.items():
        assert eng.slot_length(slot) == len(prompt) + 24
    held = sum(-(-(len(p) + 25) // PAGE) for p, _, _ in requests.values())
    assert eng.allocator.num_used <= held
    assert eng.kv_bytes_held() == eng.allocator.num_used * eng.page_bytes


def test_several_steps_in_one_program_equal_one_step_programs(model_params, cell_mesh, rules, requests) -> None:
    _, params, _ = model_params
    one = paged_streams(paged(model_params, cell_mesh, rules), params, requests, steps=12)
    eng = paged(model_params, cell_mesh, rules, decode_steps=4)
    four = paged_streams(eng, params, requests, steps=12, num_steps=4)
    eng = paged(model_params, cell_mesh, rules, decode_steps=4)
    mixed = paged_streams(eng, params, requests, steps=12, schedule=(3, 4, 1, 2, 2))  # any count up to 4
    for slot in requests:
        assert four[slot][0] == mixed[slot][0] == one[slot][0]
        np.testing.assert_allclose(four[slot][1], one[slot][1], atol=1e-6, rtol=0)
        np.testing.assert_allclose(mixed[slot][1], one[slot][1], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="num_steps=5 must be between 1 and the engine's decode_steps=4"):
        eng.generate(params, num_steps=5)


def test_several_prompts_prefilled_in_one_program_equal_one_at_a_time(model_params, cell_mesh, rules, prompts) -> None:
    """``prefill_many`` of 3 prompts of different lengths into slots 2, 0, 3 (packed in rows of the longest's
    bucket, one padding prompt): the first tokens and log-probs, the streams of 6 decode steps after them and the
    pages taken are those of ``prefill`` one prompt at a time; a prompt past ``max_prefill_length`` or a slot
    holding pages is refused before anything is written."""
    _, params, _ = model_params
    requests = {2: (prompts[5], SAMPLED, 3), 0: (prompts[0], GREEDY, 4),
                3: (prompts[7], SamplingParams(temperature=0.7, top_k=5), 5)}  # 40, 5, 16 tokens  # fmt: skip
    one_eng, many_eng = paged(model_params, cell_mesh, rules), paged(model_params, cell_mesh, rules)
    one = paged_streams(one_eng, params, requests, steps=6)
    many = paged_streams(many_eng, params, requests, steps=6, together=True)
    for slot in requests:
        assert many[slot][0] == one[slot][0]
        np.testing.assert_allclose(many[slot][1], one[slot][1], atol=1e-5, rtol=0)
        assert many_eng.slot_length(slot) == one_eng.slot_length(slot) == len(requests[slot][0]) + 6
    assert many_eng.allocator.num_used == one_eng.allocator.num_used
    np.testing.assert_array_equal(many_eng.keys(), one_eng.keys())
    with pytest.raises(ContextTooLongError, match="prefill it alone, in chunks"):
        many_eng.prefill_many(params, [1], [[1] * (MAX_PREFILL + 1)], [GREEDY], [key_for_seed(0)])
    with pytest.raises(ValueError, match="slot 0 holds a request"):
        many_eng.prefill_many(params, [0, 1], [[1, 2], [3]], [GREEDY] * 2, [key_for_seed(0)] * 2)
    assert many_eng.slot_length(1) == 0 and many_eng.allocator.num_used == one_eng.allocator.num_used


def test_a_sessions_pages_pass_to_its_next_request_without_a_copy(model_params, cell_mesh, rules, prompts) -> None:
    _, params, _ = model_params
    eng = paged(model_params, cell_mesh, rules)
    first = prompts[5]
    token = int(eng.prefill(params, 0, first, GREEDY, key_for_seed(0)).token)
    eng.start([0])
    tokens = [token] + [int(eng.generate(params).tokens[0]) for _ in range(6)]
    kept = eng.release(0, keep=eng.slot_length(0))
    assert kept.length == len(first) + 6 and eng.allocator.num_used == len(kept.pages)
    follow_up = [7, 8, 9, 10, 11]  # the harness's next message
    history = first + tokens + follow_up  # the newest sampled token is not in the pages yet: it leads the suffix
    eng.attach(2, kept)
    assert eng.allocator.num_used == len(kept.pages)  # no page taken: the slot reads the session's pages in place
    cont = eng.prefill(params, 2, history[kept.length :], GREEDY, key_for_seed(0))
    eng.start([2])
    cont_tokens = [int(cont.token)] + [int(eng.generate(params).tokens[2]) for _ in range(5)]
    fresh = paged(model_params, cell_mesh, rules)
    want = paged_streams(fresh, params, {1: (history, GREEDY, 0)}, steps=5)[1][0]
    assert cont_tokens == want
    eng.release(2)
    assert eng.allocator.num_used == 0


def test_a_session_moves_between_engines_as_kv_pages(model_params, cell_mesh, rules, prompts) -> None:
    _, params, _ = model_params
    a, b = paged(model_params, cell_mesh, rules), paged(model_params, cell_mesh, rules, num_pages=32)
    b.prefill(params, 0, prompts[0], GREEDY, key_for_seed(1))  # b's first pages are taken: other page ids
    prompt = prompts[5] + prompts[3]  # 62 tokens
    token = int(a.prefill(params, 1, prompt, GREEDY, key_for_seed(0)).token)
    a.start([1])
    history = prompt + [token] + [int(a.generate(params).tokens[1]) for _ in range(7)]  # 70 tokens, 69 cached
    kv = a.export(1, a.slot_length(1))
    assert kv.num_pages == 16  # 69 tokens: 9 pages of 8, rounded up to a power of 2
    after = [int(a.generate(params).tokens[1]) for _ in range(4)]  # the source goes on
    b.import_kv(3, kv, len(history) - 2)
    assert b.slot_length(3) == 68 and b.allocator.num_used == 1 + 9  # slot 0's page, then the session's 68 + 1
    token = int(b.prefill(params, 3, history[-2:], GREEDY, key_for_seed(0)).token)
    b.start([3])
    moved = [token] + [int(b.generate(params).tokens[3]) for _ in range(3)]
    assert moved == after


def test_sessions_are_bounded_by_free_pages_with_errors_that_say_what_to_raise(
    model_params, cell_mesh, rules, prompts
) -> None:
    _, params, _ = model_params
    eng = paged(model_params, cell_mesh, rules, num_pages=8)  # 64 tokens in all
    eng.prefill(params, 0, prompts[5], GREEDY, key_for_seed(0))  # 40 tokens + 1: 6 pages
    with pytest.raises(PagePoolExhausted, match="num_pages"):
        eng.prefill(params, 1, prompts[3], GREEDY, key_for_seed(0))  # 22 tokens + 1: 3 pages, 2 free
    eng.release(0)
    eng.prefill(params, 1, prompts[3], GREEDY, key_for_seed(0))  # the freed pages serve it
    capped = paged(model_params, cell_mesh, rules, num_pages=16, max_pages_per_slot=4)
    with pytest.raises(ContextTooLongError, match="max_pages_per_slot=4"):
        capped.prefill(params, 0, prompts[5], GREEDY, key_for_seed(0))
    with pytest.raises(ValueError, match="num_pages=0"):
        paged(model_params, cell_mesh, rules, num_pages=0)


def test_the_paged_benchmark_section_runs_and_writes_its_table(tmp_path) -> None:
    out = tmp_path / "paged.json"
    cmd = [sys.executable, "benchmarks/bench_long_context.py", "--section", "paged", "--paged-lengths", "512", "2048"]
    cmd += ["--paged-chunk", "256", "--page-size", "64", "--paged-steps", "2", "--paged-out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["live_tokens"] for r in rows] == [512, 2048] and "held/live" in proc.stdout
    for r in rows:  # whole pages of 64: the bytes held are the live tokens' exactly; the dense engine's are fixed
        assert (
            r["kv_bytes_held"] == r["live_kv_bytes"]
            and r["dense_kv_bytes"] == 8 * 2048 * r["live_kv_bytes"] // r["live_tokens"]
        )
        assert r["paged_decode_ms"] > 0 and r["dense_decode_ms"] > 0
