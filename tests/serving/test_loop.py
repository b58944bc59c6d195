"""ServingLoop: continuous batching over the engine — correctness under concurrency, stop/length/cancel,
rejection of prompts that do not fit, weight updates with policy versions, queueing and seeded sampling."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from timelimits import scaled, slow_factor

from gyre_jax.serving.loop import ServingLoop
from gyre_jax.serving.types import ContextTooLongError, GenerationRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slow_engine import SlowEngine  # noqa: E402

TIMEOUT = 60.0


def _start(engine, params, **kw) -> ServingLoop:
    return ServingLoop(engine, params, policy_version=0, name="test-cell", **kw).start()


@pytest.fixture
def loop(engine, model_params):
    loop = _start(engine, model_params[1])
    yield loop
    loop.stop()
    assert loop.error is None


@pytest.fixture
def slow_loop(engine, model_params):
    loop = _start(SlowEngine(engine), model_params[1])
    yield loop
    loop.stop()
    assert loop.error is None


def greedy(max_tokens: int, stop_ids: tuple[int, ...] = ()) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_ids=stop_ids)


def _wait_until(cond, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def test_concurrent_submits_complete_with_the_greedy_tokens(loop, model_params, reference, prompts) -> None:
    _, params, _ = model_params
    requests = [GenerationRequest(prompt_ids=p, sampling=greedy(4 + i)) for i, p in enumerate(prompts)]
    futures: dict[str, concurrent.futures.Future] = {}
    barrier = threading.Barrier(len(requests))

    def client(req):
        barrier.wait()
        futures[req.request_id] = loop.submit(req)

    threads = [threading.Thread(target=client, args=(r,)) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for req in requests:
        result = futures[req.request_id].result(timeout=scaled(TIMEOUT))
        n = req.sampling.max_tokens
        assert (result.request_id, result.finish_reason, result.prompt_len, result.cell) == (
            req.request_id,
            "length",
            len(req.prompt_ids),
            "test-cell",
        )
        want_tokens, want_logprobs = reference.greedy(params, req.prompt_ids, n)
        assert result.token_ids == want_tokens
        np.testing.assert_allclose(result.logprobs, want_logprobs, atol=1e-4, rtol=0)
        assert result.policy_versions == [0] * n
    assert loop.stats.requests_done == len(requests)
    assert loop.stats.prefill_tokens == sum(len(p) for p in prompts)


def test_more_requests_than_slots_are_queued_and_all_complete(loop, model_params, reference, prompts) -> None:
    _, params, _ = model_params
    slots = loop.engine.max_concurrent_decodes
    requests = [
        GenerationRequest(prompt_ids=prompts[i % len(prompts)], sampling=greedy(3 + i % 5)) for i in range(3 * slots)
    ]
    futures = [loop.submit(r) for r in requests]
    assert loop.num_in_flight() > slots  # some wait in the queue
    for req, fut in zip(requests, futures):
        result = fut.result(timeout=scaled(TIMEOUT))
        assert result.finish_reason == "length"
        assert result.token_ids == reference.greedy(params, req.prompt_ids, req.sampling.max_tokens)[0]
    assert loop.wait_idle(timeout=scaled(5.0))
    assert loop.num_in_flight() == 0


def test_stop_id_ends_the_completion_and_is_included(loop, model_params, reference, prompts) -> None:
    _, params, _ = model_params
    for prompt in (prompts[0], prompts[3]):
        ref, ref_logprobs = reference.greedy(params, prompt, 3)
        stop = ref[2]
        end = ref.index(stop) + 1  # the first time the stop id is sampled (may be before the 3rd token)
        result = loop.submit(GenerationRequest(prompt_ids=prompt, sampling=greedy(20, stop_ids=(999, stop)))).result(
            scaled(TIMEOUT)
        )
        assert result.finish_reason == "stop"
        assert result.token_ids == ref[:end]
        np.testing.assert_allclose(result.logprobs, ref_logprobs[:end], atol=1e-4, rtol=0)
    # a stop id as the very first (prefill-sampled) token
    first = reference.greedy(params, prompts[2], 1)[0][0]
    result = loop.submit(GenerationRequest(prompt_ids=prompts[2], sampling=greedy(20, stop_ids=(first,)))).result(
        scaled(TIMEOUT)
    )
    assert (result.token_ids, result.finish_reason) == ([first], "stop")


def test_length_at_max_tokens_and_at_the_context_limit(loop, model_params, reference, prompts) -> None:
    _, params, _ = model_params
    one = loop.submit(GenerationRequest(prompt_ids=prompts[1], sampling=greedy(1))).result(scaled(TIMEOUT))
    assert (one.token_ids, one.finish_reason) == (reference.greedy(params, prompts[1], 1)[0], "length")

    prompt = (prompts[5] * 2)[: loop.engine.max_prefill_length]  # 64 tokens; the context holds 128
    result = loop.submit(GenerationRequest(prompt_ids=prompt, sampling=greedy(1000))).result(scaled(TIMEOUT))
    assert result.finish_reason == "length"
    assert len(prompt) + len(result.token_ids) == loop.max_context
    reference.check_teacher_forced(params, prompt, result.token_ids, result.logprobs)


def test_cancel_frees_the_slot(slow_loop, model_params, reference, prompts) -> None:
    loop = slow_loop
    _, params, _ = model_params
    slots = loop.engine.max_concurrent_decodes
    long = [GenerationRequest(prompt_ids=prompts[i], sampling=greedy(1000)) for i in range(slots)]
    futures = [loop.submit(r) for r in long]
    queued = GenerationRequest(prompt_ids=prompts[4], sampling=greedy(1000))
    queued_future = loop.submit(queued)
    _wait_until(
        lambda: loop.stats.prefill_tokens == sum(len(r.prompt_ids) for r in long) and loop.stats.generate_steps >= 3
    )

    loop.cancel(queued.request_id)  # still waiting for a slot
    result = queued_future.result(scaled(TIMEOUT))
    assert (result.finish_reason, result.token_ids) == ("cancelled", [])

    loop.cancel(long[0].request_id)  # running
    result = futures[0].result(scaled(TIMEOUT))
    assert result.finish_reason == "cancelled"
    budget = loop.max_context - len(long[0].prompt_ids)
    assert 3 <= len(result.token_ids) < budget
    reference.check_teacher_forced(params, long[0].prompt_ids, result.token_ids, result.logprobs)

    # the freed slot serves a new request while the other long requests are still running
    short = GenerationRequest(prompt_ids=prompts[6], sampling=greedy(3))
    assert loop.submit(short).result(scaled(TIMEOUT)).token_ids == reference.greedy(params, prompts[6], 3)[0]
    assert not any(f.done() for f in futures[1:])

    for req in long[1:]:
        loop.cancel(req.request_id)
    assert all(f.result(scaled(TIMEOUT)).finish_reason == "cancelled" for f in futures[1:])
    assert loop.wait_idle(timeout=scaled(5.0))
    loop.cancel("req-that-does-not-exist")  # harmless
    after = loop.submit(GenerationRequest(prompt_ids=prompts[0], sampling=greedy(2))).result(scaled(TIMEOUT))
    assert (after.token_ids, after.finish_reason) == (reference.greedy(params, prompts[0], 2)[0], "length")


def test_prompts_that_do_not_fit_fail_their_future_and_the_loop_serves_on(
    loop, model_params, reference, prompts
) -> None:
    _, params, _ = model_params
    for n in (loop.max_context, loop.max_context + 50):
        with pytest.raises(
            ContextTooLongError, match=f"prompt of {n} tokens does not fit .* at most {loop.max_context - 1}"
        ):
            loop.submit(GenerationRequest(prompt_ids=[1] * n)).result(scaled(TIMEOUT))
    # longer than one prefill call (max_prefill_length) but within the context: prefilled in chunks
    long_prompt = (prompts[5] * 3)[: loop.engine.max_prefill_length + 30]
    result = loop.submit(GenerationRequest(prompt_ids=long_prompt, sampling=greedy(4))).result(scaled(TIMEOUT))
    reference.check_teacher_forced(params, long_prompt, result.token_ids, result.logprobs)
    with pytest.raises(ValueError, match="empty prompt"):
        loop.submit(GenerationRequest(prompt_ids=[])).result(scaled(TIMEOUT))
    with pytest.raises(ValueError, match="temperature"):
        loop.submit(GenerationRequest(prompt_ids=[1], sampling=SamplingParams(temperature=-1.0))).result(
            scaled(TIMEOUT)
        )
    result = loop.submit(GenerationRequest(prompt_ids=prompts[2], sampling=greedy(5))).result(scaled(TIMEOUT))
    assert result.token_ids == reference.greedy(params, prompts[2], 5)[0]
    assert loop.error is None


def test_update_params_tags_later_tokens_with_the_new_version(slow_loop, model_params, reference, prompts) -> None:
    loop = slow_loop
    _, params, params_b = model_params
    running = GenerationRequest(prompt_ids=prompts[0], sampling=greedy(1000))
    running_future = loop.submit(running)
    _wait_until(lambda: loop.stats.tokens_generated >= 3)
    loop.update_params(params_b, version=1)
    later = loop.submit(GenerationRequest(prompt_ids=prompts[1], sampling=greedy(6))).result(scaled(TIMEOUT))
    assert loop.policy_version == 1
    assert later.policy_versions == [1] * 6
    assert later.token_ids == reference.greedy(params_b, prompts[1], 6)[0]  # produced by the new weights
    assert later.token_ids != reference.greedy(params, prompts[1], 6)[0]

    loop.cancel(running.request_id)
    result = running_future.result(scaled(TIMEOUT))
    versions = result.policy_versions
    assert len(versions) == len(result.token_ids)
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    old = versions.count(0)
    assert old >= 4  # the prefill token and the >= 3 generated before the update
    reference.check_teacher_forced(params, prompts[0], result.token_ids[:old], result.logprobs[:old])


def test_seeded_sampled_request_is_reproducible(loop, model_params, reference, prompts) -> None:
    _, params, _ = model_params

    def seeded(seed: int) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids=prompts[4], sampling=SamplingParams(temperature=1.0, max_tokens=12, seed=seed)
        )

    alone = loop.submit(seeded(42)).result(scaled(TIMEOUT))
    # the same seed again, this time batched with other traffic in other slots
    others = [
        loop.submit(GenerationRequest(prompt_ids=p, sampling=SamplingParams(temperature=1.0, max_tokens=15)))
        for p in prompts[:3]
    ]
    again = loop.submit(seeded(42)).result(scaled(TIMEOUT))
    other_seed = loop.submit(seeded(43)).result(scaled(TIMEOUT))
    for f in others:
        f.result(scaled(TIMEOUT))
    assert again.token_ids == alone.token_ids
    # float32 rounding apart (a prefill batched with other prompts may tile its matmuls differently: a few ulps)
    np.testing.assert_allclose(again.logprobs, alone.logprobs, rtol=1e-6, atol=1e-6)
    assert other_seed.token_ids != alone.token_ids
    # behaviour log-probs are the model's log_softmax at the sampled tokens (temperature 1)
    lp = reference.logprobs(params, prompts[4] + alone.token_ids)[len(prompts[4]) - 1 : -1]
    np.testing.assert_allclose(alone.logprobs, lp[np.arange(12), alone.token_ids], atol=1e-4, rtol=0)
    # unseeded requests get distinct keys from the loop
    a = loop.submit(GenerationRequest(prompt_ids=prompts[4], sampling=SamplingParams(temperature=1.0, max_tokens=12)))
    b = loop.submit(GenerationRequest(prompt_ids=prompts[4], sampling=SamplingParams(temperature=1.0, max_tokens=12)))
    assert a.result(scaled(TIMEOUT)).token_ids != b.result(scaled(TIMEOUT)).token_ids


def test_stop_ends_the_thread(engine, model_params) -> None:
    loop = _start(engine, model_params[1])
    thread = loop._thread
    assert thread is not None and thread.is_alive()
    loop.stop()
    assert not thread.is_alive() and loop.error is None


# -- chunked prefill -------------------------------------------------------------------------------


class RecordingEngine(SlowEngine):
    """Records the order of prefill and generate calls (and can slow both down)."""

    def __init__(self, engine, step_s: float = 0.0, prefill_s: float = 0.0):
        super().__init__(engine, step_s)
        self._prefill_s = prefill_s * slow_factor()  # scaled as SlowEngine's step
        self.calls: list[tuple] = []

    def prefill(self, params, slot, tokens, sampling, key, *, final=True):
        # on top of a prefix: the slot holds KV already, or the prompt comes in chunks (all on a full-length cache)
        on_top = self._engine.slot_length(slot) > 0 or not final
        self.calls.append(("prefill", len(tokens), on_top))
        out = self._engine.prefill(params, slot, tokens, sampling, key, final=final)
        time.sleep(self._prefill_s)
        return out

    def generate(self, params, **kw):
        self.calls.append(("generate",))
        return super().generate(params, **kw)


def test_chunked_prefill_interleaves_with_decoding(engine, model_params, reference, prompts) -> None:
    """A 100-token prompt (longer than one prefill call) joins while another request decodes: it is prefilled
    16 tokens per step between generate steps, and both streams are the uncached model's greedy ones."""
    _, params, _ = model_params
    rec = RecordingEngine(engine, step_s=0.005)
    loop = _start(rec, params, prefill_chunk=16)
    try:
        running = loop.submit(GenerationRequest(prompt_ids=prompts[0], sampling=greedy(80)))
        _wait_until(lambda: loop.stats.tokens_generated >= 2)
        mark = len(rec.calls)
        long_prompt = (prompts[5] * 3)[:100]
        joined = loop.submit(GenerationRequest(prompt_ids=long_prompt, sampling=greedy(5))).result(scaled(TIMEOUT))
        assert running.result(scaled(TIMEOUT)).token_ids == reference.greedy(params, prompts[0], 80)[0]
    finally:
        loop.stop()
    reference.check_teacher_forced(params, long_prompt, joined.token_ids, joined.logprobs)
    chunks = [c for c in rec.calls[mark:] if c[0] == "prefill"]
    assert [c[1] for c in chunks] == [16] * 6 + [4] and all(c[2] for c in chunks)  # each on top of the last
    after = rec.calls[mark:]
    first, last = after.index(chunks[0]), len(after) - 1 - after[::-1].index(chunks[-1])
    window = after[first : last + 1]
    # never two prefill calls in a row: the running request got a generate step after every chunk
    assert all(not (a[0] == b[0] == "prefill") for a, b in zip(window, window[1:])), window
    assert loop.stats.prefill_calls == 1 + 7


def test_cancel_during_chunked_prefill_frees_the_slot(engine, model_params, reference, prompts) -> None:
    _, params, _ = model_params
    rec = RecordingEngine(engine, step_s=0.002, prefill_s=0.05)
    loop = _start(rec, params, prefill_chunk=16)
    try:
        keep_busy = loop.submit(GenerationRequest(prompt_ids=prompts[2], sampling=greedy(1000)))
        long_req = GenerationRequest(prompt_ids=(prompts[5] * 3)[:100], sampling=greedy(5))
        long_future = loop.submit(long_req)
        _wait_until(lambda: sum(c[0] == "prefill" and c[2] for c in rec.calls) >= 1)  # its 2nd chunk is done
        loop.cancel(long_req.request_id)
        result = long_future.result(scaled(TIMEOUT))
        assert (result.finish_reason, result.token_ids) == ("cancelled", [])
        assert sum(c[0] == "prefill" and c[1] == 4 for c in rec.calls) == 0  # its last chunk never ran
        short = loop.submit(GenerationRequest(prompt_ids=prompts[6], sampling=greedy(3))).result(scaled(TIMEOUT))
        assert short.token_ids == reference.greedy(params, prompts[6], 3)[0]
        loop.cancel("no-such-request")  # unknown ids are harmless
        assert not keep_busy.done()
    finally:
        loop.stop()
    assert keep_busy.result(scaled(TIMEOUT)).finish_reason == "cancelled" and loop.error is None


# -- session prefix cache --------------------------------------------------------------------------


def _turns(loop, reference, params, session_id, first_prompt, turns, *, extra=(7, 8, 9), n=6):
    """Runs a multi-turn session (each prompt = previous prompt + completion + new tokens); checks every
    completion against the uncached model; returns the results."""
    prompt, results = list(first_prompt), []
    for turn in range(turns):
        result = loop.submit(GenerationRequest(prompt_ids=prompt, sampling=greedy(n), session_id=session_id)).result(
            scaled(TIMEOUT)
        )
        want_tokens, want_logprobs = reference.greedy(params, prompt, n)
        assert result.token_ids == want_tokens, (session_id, turn)
        np.testing.assert_allclose(result.logprobs, want_logprobs, atol=1e-4, rtol=0)
        results.append((list(prompt), result))
        prompt = prompt + result.token_ids + [x + turn for x in extra]
    return results


def test_session_prefix_cache_prefills_only_new_tokens(loop, model_params, reference, prompts) -> None:
    _, params, _ = model_params
    before = loop.stats.prefill_tokens
    results = _turns(loop, reference, params, "exec-1/main", prompts[4], 5)
    prefilled = loop.stats.prefill_tokens - before
    assert results[0][1].cached_tokens == 0
    for (prev_prompt, prev), (_, result) in zip(results, results[1:]):
        # everything but the previous completion's last token (sampled, never fed) came from the cache
        assert result.cached_tokens == len(prev_prompt) + len(prev.token_ids) - 1
    final_context = len(results[-1][0])
    assert prefilled == sum(len(p) - r.cached_tokens for p, r in results)
    assert prefilled <= final_context  # without the cache every turn would prefill its whole prompt:
    assert sum(len(p) for p, _ in results) > 2.5 * final_context
    cache = loop.stats.cache
    assert (cache.hits, cache.misses, cache.tokens_reused) == (4, 1, sum(r.cached_tokens for _, r in results))
    assert cache.entries == 1 and cache.pages_used == -(-(final_context + 5) // loop.engine.page_size)

    # a new branch of the same session (e.g. after a context summary) reuses only the common prefix
    branch = results[2][0][:10] + [1, 2, 3]
    result = loop.submit(GenerationRequest(prompt_ids=branch, sampling=greedy(4), session_id="exec-1/main")).result(
        scaled(TIMEOUT)
    )
    assert result.cached_tokens == 10 and result.token_ids == reference.greedy(params, branch, 4)[0]


def test_prefix_cache_evicts_least_recently_used_sessions_within_its_page_budget(
    engine, model_params, reference, prompts
) -> None:
    _, params, _ = model_params
    loop = _start(engine, params, kv_pages=5)  # 5 pages x 16 tokens: two sessions of ~30 tokens fit, not three
    try:
        sessions = {f"s{i}": prompts[i + 3] for i in range(3)}  # 22, 9 and 40 tokens
        first = {sid: _turns(loop, reference, params, sid, p, 1)[0] for sid, p in sessions.items()}
        cache = loop.stats.cache
        assert cache.evictions >= 1 and cache.pages_used <= 5 and "s0" not in loop.prefix_cache
        assert loop.prefix_cache.sessions()[-1] == "s2"  # the most recent one stays
        for sid in ("s2", "s0"):  # s2 hits; s0 was evicted: a full prefill, still correct
            prompt, prev = first[sid]
            nxt = prompt + prev.token_ids + [1, 2]
            result = loop.submit(GenerationRequest(prompt_ids=nxt, sampling=greedy(4), session_id=sid)).result(
                scaled(TIMEOUT)
            )
            assert result.token_ids == reference.greedy(params, nxt, 4)[0]
            assert result.cached_tokens == (0 if sid == "s0" else len(prompt) + len(prev.token_ids) - 1)
        assert loop.stats.cache.pages_used <= 5
    finally:
        loop.stop()


def test_prefix_cache_and_weight_updates(engine, model_params, reference, prompts) -> None:
    """Default: KV of an older policy is never reused (every prompt is computed by the current weights);
    reuse_stale_kv=True keeps it."""
    _, params, params_b = model_params
    for reuse in (False, True):
        loop = _start(engine, params, reuse_stale_kv=reuse)
        try:
            ((prompt, r1),) = _turns(loop, reference, params, "s", prompts[1], 1)
            loop.update_params(params_b, version=1)
            nxt = prompt + r1.token_ids + [4, 5]
            r2 = loop.submit(GenerationRequest(prompt_ids=nxt, sampling=greedy(5), session_id="s")).result(
                scaled(TIMEOUT)
            )
            assert r2.policy_versions == [1] * 5
            if reuse:
                assert r2.cached_tokens == len(prompt) + len(r1.token_ids) - 1
            else:
                assert r2.cached_tokens == 0 and loop.stats.cache.stale_drops == 1
                assert r2.token_ids == reference.greedy(params_b, nxt, 5)[0]
                nxt2 = nxt + r2.token_ids + [6]  # the entry stored under version 1 is reused under version 1
                r3 = loop.submit(GenerationRequest(prompt_ids=nxt2, sampling=greedy(3), session_id="s")).result(
                    scaled(TIMEOUT)
                )
                assert r3.cached_tokens == len(nxt) + 4 and r3.token_ids == reference.greedy(params_b, nxt2, 3)[0]
        finally:
            loop.stop()


def test_recompute_on_update_continues_in_flight_requests_under_the_new_weights(
    engine, model_params, reference, prompts
) -> None:
    _, params, params_b = model_params
    loop = _start(SlowEngine(engine), params, on_update="recompute")
    try:
        req = GenerationRequest(prompt_ids=prompts[3], sampling=greedy(1000))
        fut = loop.submit(req)
        _wait_until(lambda: loop.stats.tokens_generated >= 3)
        prefilled = loop.stats.prefill_tokens
        loop.update_params(params_b, version=1)
        _wait_until(lambda: loop.stats.tokens_generated >= 12)
        loop.cancel(req.request_id)
        result = fut.result(scaled(TIMEOUT))
    finally:
        loop.stop()
    old = result.policy_versions.count(0)
    assert old >= 4 and result.policy_versions == [0] * old + [1] * (len(result.token_ids) - old)
    assert loop.stats.prefill_tokens == prefilled + len(prompts[3]) + old - 1  # its whole KV, once more
    reference.check_teacher_forced(params, prompts[3], result.token_ids[:old], result.logprobs[:old])
    # after the update: exactly the new policy's greedy continuation of everything so far
    reference.check_teacher_forced(
        params_b, prompts[3] + result.token_ids[:old], result.token_ids[old:], result.logprobs[old:]
    )
    with pytest.raises(ValueError, match="on_update"):
        ServingLoop(engine, params, on_update="restart")


# -- stop strings ----------------------------------------------------------------------------------


def _one_char_per_token(ids) -> str:
    """A detokenizer with one distinct character per id (the byte tokenizer would turn random bytes into U+FFFD)."""
    return "".join(chr(0x4E00 + int(i)) for i in ids)


def test_stop_strings_end_the_completion_at_the_completing_token(engine, model_params, reference, prompts) -> None:
    _, params, _ = model_params
    ref = reference.greedy(params, prompts[1], 12)[0]
    stop = _one_char_per_token(ref[5:7])
    end = next(i + 1 for i in range(1, 12) if stop in _one_char_per_token(ref[: i + 1]))
    loop = _start(engine, params, detokenize=_one_char_per_token)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=12, stop_strings=("never", stop))
        result = loop.submit(GenerationRequest(prompt_ids=prompts[1], sampling=sp)).result(scaled(TIMEOUT))
        assert (result.finish_reason, result.stop_reason, result.token_ids) == ("stop", stop, ref[:end])
        # a stop string inside the prompt does not count
        sp = SamplingParams(temperature=0.0, max_tokens=3, stop_strings=(_one_char_per_token(prompts[1][:2]),))
        result = loop.submit(GenerationRequest(prompt_ids=prompts[1], sampling=sp)).result(scaled(TIMEOUT))
        assert result.finish_reason == "length" and result.stop_reason is None
    finally:
        loop.stop()
    with pytest.raises(ValueError, match="no detokenize function"):
        _start(engine, params).submit(GenerationRequest(prompt_ids=[1], sampling=sp)).result(scaled(TIMEOUT))
    with pytest.raises(ValueError, match="non-empty strings"):
        SamplingParams(stop_strings=("",)).validate()


def test_multi_step_programs_and_lookahead_give_the_one_step_loops_tokens(engine, model_params, rules, prompts) -> None:
    """An engine with ``decode_steps=4`` (4 steps per program while every slot decodes and nothing waits) and loops
    that read a step 1 or 2 steps after dispatching it: every request gets the tokens, log-probs, finish reason
    and cached tokens of the one-step loop that reads each step after dispatching the next: seeded sampling,
    budgets that are not multiples of 4, a stop id met inside a program, and a session's next call on its cached
    KV."""
    from gyre_jax.serving.engine import Engine

    e = engine
    multi = Engine(
        e.cfg, e.graphdef, e.mesh, rules, max_concurrent_decodes=e.max_concurrent_decodes, max_seq_len=e.max_seq_len,
        max_prefill_length=e.max_prefill_length, prefill_buckets=e.prefill_buckets, decode_steps=4,
    )  # fmt: skip
    params = model_params[1]

    def sampled(n, seed, stop=()):
        return SamplingParams(temperature=1.0, max_tokens=n, seed=seed, stop_ids=stop)

    def run(eng, stop_id, lookahead):
        loop = _start(eng, params, lookahead=lookahead)
        try:
            first = [
                GenerationRequest(prompt_ids=prompts[i], sampling=sampled(n, 10 + i, stop), session_id=f"s{i}")
                for i, n, stop in (
                    (0, 9, ()),
                    (1, 6, ()),
                    (2, 13, (stop_id,) if stop_id is not None else ()),
                    (4, 10, ()),
                )
            ]
            out = [f.result(timeout=scaled(TIMEOUT)) for f in [loop.submit(r) for r in first]]
            follow = GenerationRequest(
                prompt_ids=prompts[0] + out[0].token_ids + [5, 6, 7], sampling=sampled(11, 99), session_id="s0"
            )
            out.append(loop.submit(follow).result(timeout=scaled(TIMEOUT)))
            return out, loop.stats
        finally:
            loop.stop()

    base, _ = run(engine, None, 1)
    stop_id = base[2].token_ids[5]
    cut = base[2].token_ids.index(stop_id) + 1  # the one-step loop stops request 2 at the id's first occurrence
    assert base[4].cached_tokens > 0  # the follow-up reused its session's KV
    for eng, lookahead in ((engine, 2), (multi, 1), (multi, 2)):
        got, stats = run(eng, stop_id, lookahead)
        assert got[2].finish_reason == "stop" and got[2].token_ids == base[2].token_ids[:cut]
        np.testing.assert_allclose(got[2].logprobs, base[2].logprobs[:cut], atol=1e-5)
        for w, g in zip(base[:2] + base[3:], got[:2] + got[3:]):
            assert (g.token_ids, g.finish_reason, g.cached_tokens) == (w.token_ids, w.finish_reason, w.cached_tokens)
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
        if eng is multi:
            assert stats.generate_calls < stats.generate_steps  # programs of 4 steps did run


@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_a_stopped_request_wastes_the_lookahead_steps_and_no_more(engine, model_params, prompts, lookahead) -> None:
    """A lone request that stops at a stop id: the loop had dispatched ``lookahead`` steps past the one that sampled
    it (their tokens discarded), and none after it read that step; its tokens are the one-step loop's."""
    params = model_params[1]
    probe = _start(engine, params, lookahead=1)
    try:
        free = probe.submit(GenerationRequest(prompt_ids=prompts[3], sampling=greedy(24))).result(
            timeout=scaled(TIMEOUT)
        )
    finally:
        probe.stop()
    stop_id = free.token_ids[6]
    cut = free.token_ids.index(stop_id) + 1  # tokens up to the id's first occurrence; the first came from prefill
    assert cut + lookahead < 24
    loop = _start(engine, params, lookahead=lookahead)
    try:
        got = loop.submit(GenerationRequest(prompt_ids=prompts[3], sampling=greedy(24, (stop_id,)))).result(
            scaled(TIMEOUT)
        )
        assert got.finish_reason == "stop" and got.token_ids == free.token_ids[:cut]
        assert _wait_until(lambda: not loop._batch.in_flight) is None
        assert loop.stats.generate_steps == cut - 1 + lookahead
    finally:
        loop.stop()


def test_lookahead_below_one_is_rejected(engine, model_params) -> None:
    with pytest.raises(ValueError, match="lookahead=0 must be >= 1"):
        ServingLoop(engine, model_params[1], lookahead=0)


def test_a_burst_of_requests_starts_with_one_prefill_program(engine, model_params, reference, prompts) -> None:
    """Requests queued before the loop's first iteration (no slot decoding) are prefilled together in one
    program and all start at once, and they decode in as many steps as their budgets need; each gets the greedy
    tokens of the uncached model, and a seeded sampled one the tokens it gets alone."""
    params = model_params[1]
    burst = [GenerationRequest(prompt_ids=prompts[i], sampling=greedy(6)) for i in (0, 4, 7)]
    alone = GenerationRequest(prompt_ids=prompts[1], sampling=SamplingParams(temperature=1.0, max_tokens=6, seed=5))
    loop = ServingLoop(engine, params, policy_version=0, name="burst")
    futures = [loop.submit(r) for r in [*burst, alone]]  # queued: the loop thread has not started
    loop.start()
    try:
        results = [f.result(timeout=scaled(TIMEOUT)) for f in futures]
        assert loop.stats.prefill_calls == 1 and loop.stats.prefill_tokens == sum(
            len(r.prompt_ids) for r in [*burst, alone]
        )
        # the prefill sampled each request's first token; 5 more steps end them all, and no program runs past
        # the last (the step dispatched while the 5th is in flight would only compute tokens to discard)
        assert loop.stats.generate_steps == 5
    finally:
        loop.stop()
    for req, res in zip(burst, results):
        assert res.token_ids == reference.greedy(params, req.prompt_ids, 6)[0]
    solo = _start(engine, params)
    try:
        want = solo.submit(dataclasses.replace(alone, request_id="again")).result(timeout=scaled(TIMEOUT))
        assert solo.stats.prefill_calls == 1
    finally:
        solo.stop()
    assert results[-1].token_ids == want.token_ids
    np.testing.assert_allclose(results[-1].logprobs, want.logprobs, atol=1e-5)
