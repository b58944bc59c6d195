"""ServingLoop on a PagedEngine: concurrent requests, session turns decoding from their cached pages in place,
eviction when slots need the pool, weight updates, and sessions moving in from a dense loop."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from timelimits import scaled, slow_factor

from gyre_jax.serving.loop import ServingLoop
from gyre_jax.serving.paged import PagedEngine
from gyre_jax.serving.types import GenerationRequest, SamplingParams

from .conftest import BUCKETS, CFG, MAX_PREFILL
from .test_loop import _turns

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slow_engine import SlowEngine  # noqa: E402

TIMEOUT = 60.0
PAGE = 16  # the dense test engine's page size: sessions move between the two


class SlowPaged(PagedEngine):
    """A pause after every generate program, so a test can act while requests run."""

    def generate(self, params, *, num_steps: int = 1, wait: bool = True):
        out = super().generate(params, num_steps=num_steps, wait=wait)
        time.sleep(0.02 * slow_factor())  # scaled as SlowEngine's step
        return out


def paged_loop(model_params, mesh, rules, params=None, num_pages=32, cls=PagedEngine, start=True, **kw) -> ServingLoop:
    engine = cls(CFG, model_params[0], mesh, rules, max_concurrent_decodes=4, num_pages=num_pages, page_size=PAGE,
                 max_prefill_length=MAX_PREFILL, prefill_buckets=BUCKETS)  # fmt: skip
    loop = ServingLoop(engine, model_params[1] if params is None else params, name="paged", **kw)
    return loop.start() if start else loop


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def _wait_until(cond, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


@pytest.fixture
def loop(model_params, cell_mesh, rules):
    loop = paged_loop(model_params, cell_mesh, rules, prefill_chunk=16)
    yield loop
    loop.stop()
    assert loop.error is None


def test_concurrent_requests_complete_with_the_greedy_tokens(loop, model_params, reference, prompts) -> None:
    _, params, _ = model_params
    requests = [GenerationRequest(prompt_ids=p, sampling=greedy(12 + i)) for i, p in enumerate(prompts)]
    results = [f.result(scaled(TIMEOUT)) for f in [loop.submit(r) for r in requests]]  # 8 requests, 4 slots
    for req, result in zip(requests, results):
        assert result.token_ids == reference.greedy(params, req.prompt_ids, req.sampling.max_tokens)[0]
        assert result.finish_reason == "length"
    assert loop.stats.prefill_tokens == sum(len(p) for p in prompts)  # chunks of 16, each prefilled once
    assert loop.engine.allocator.num_used == 0  # no session ids: every page went back


@pytest.mark.parametrize("together", [True, False])
def test_a_burst_at_an_idle_loop_is_prefilled_in_one_program(
    model_params, cell_mesh, rules, reference, prompts, together
) -> None:
    """Four whole prompts waiting when the loop starts: with ``prefill_together`` one ``prefill_many`` program
    prefills them all into their slots' pages, else one program each; the same greedy tokens either way."""
    _, params, _ = model_params
    loop = paged_loop(model_params, cell_mesh, rules, start=False, prefill_chunk=16, prefill_together=together)
    chosen = [prompts[i] for i in (0, 1, 4, 7)]  # 5, 13, 9, 16 tokens: each one chunk
    futures = [loop.submit(GenerationRequest(prompt_ids=p, sampling=greedy(6))) for p in chosen]
    loop.start()
    try:
        results = [f.result(scaled(TIMEOUT)) for f in futures]
    finally:
        loop.stop()
    assert loop.error is None
    for prompt, result in zip(chosen, results):
        assert result.token_ids == reference.greedy(params, prompt, 6)[0]
    assert loop.stats.prefill_calls == (1 if together else 4)
    assert loop.stats.prefill_tokens == sum(len(p) for p in chosen)
    assert loop.engine.allocator.num_used == 0


def test_session_turns_decode_from_their_cached_pages_in_place(loop, model_params, reference, prompts) -> None:
    _, params, _ = model_params
    results, pages = [], []
    for turn in range(4):
        prompt = prompts[4] if turn == 0 else results[-1][0] + results[-1][1].token_ids + [7 + turn, 8]
        results += _turns(loop, reference, params, "exec-1/main", prompt, 1)
        pages.append(loop.prefix_cache.entry("exec-1/main").pages)
    for (prev_prompt, prev), (_, result) in zip(results, results[1:]):
        assert result.cached_tokens == len(prev_prompt) + len(prev.token_ids) - 1  # all but the newest token
    for before, after in zip(pages, pages[1:]):  # each turn's pages are the last turn's, where they were, plus more
        assert after[: len(before)] == before
    final = len(results[-1][0]) + len(results[-1][1].token_ids) - 1
    assert loop.engine.allocator.num_used == len(pages[-1]) == -(-final // PAGE)
    assert loop.stats.prefill_tokens == sum(len(p) - r.cached_tokens for p, r in results)
    cache = loop.stats.cache
    assert (cache.hits, cache.misses, cache.stores, cache.entries) == (3, 1, 4, 1)


def test_slots_that_need_pages_evict_cached_sessions_least_recently_used_first(
    model_params, cell_mesh, rules, reference, prompts
) -> None:
    _, params, _ = model_params
    loop = paged_loop(model_params, cell_mesh, rules, num_pages=5)  # 80 tokens for slots and sessions together
    try:
        first = {sid: _turns(loop, reference, params, sid, prompts[i + 3], 1)[0] for i, sid in enumerate("abc")}
        cache = loop.stats.cache
        assert cache.evictions >= 1 and "a" not in loop.prefix_cache and loop.prefix_cache.sessions()[-1] == "c"
        prompt, prev = first["c"]
        nxt = prompt + prev.token_ids + [1, 2]
        result = loop.submit(GenerationRequest(prompt_ids=nxt, sampling=greedy(4), session_id="c")).result(
            scaled(TIMEOUT)
        )
        assert result.token_ids == reference.greedy(params, nxt, 4)[0]
        assert result.cached_tokens == len(prompt) + len(prev.token_ids) - 1
        too_long = GenerationRequest(prompt_ids=list(range(100)), sampling=greedy(4))  # 7 pages: more than the pool
        with pytest.raises(ValueError, match="context 80 tokens"):
            loop.submit(too_long).result(scaled(TIMEOUT))
        again = loop.submit(GenerationRequest(prompt_ids=prompts[0], sampling=greedy(3))).result(scaled(TIMEOUT))
        assert again.token_ids == reference.greedy(params, prompts[0], 3)[0]  # the loop serves on
    finally:
        loop.stop()
    assert loop.error is None


def test_recompute_on_update_continues_under_the_new_weights(model_params, cell_mesh, rules, reference, prompts):
    _, params, params_b = model_params
    loop = paged_loop(model_params, cell_mesh, rules, cls=SlowPaged, on_update="recompute")
    try:
        req = GenerationRequest(prompt_ids=prompts[3], sampling=greedy(1000))
        fut = loop.submit(req)
        _wait_until(lambda: loop.stats.tokens_generated >= 3)
        loop.update_params(params_b, version=1)
        _wait_until(lambda: loop.stats.tokens_generated >= 12)
        loop.cancel(req.request_id)
        result = fut.result(scaled(TIMEOUT))
    finally:
        loop.stop()
    old = result.policy_versions.count(0)
    assert old >= 3 and result.policy_versions == [0] * old + [1] * (len(result.token_ids) - old)
    reference.check_teacher_forced(params, prompts[3], result.token_ids[:old], result.logprobs[:old])
    reference.check_teacher_forced(
        params_b, prompts[3] + result.token_ids[:old], result.token_ids[old:], result.logprobs[old:]
    )


def test_requests_move_from_a_dense_loop_into_a_paged_one_and_continue(
    engine, other_mesh, other_engine, model_params, rules, reference, prompts
) -> None:
    _, params, _ = model_params
    a = ServingLoop(SlowEngine(engine), params, name="a").start()
    b = paged_loop(model_params, other_mesh, rules, params=other_engine[1])
    try:
        requests = [
            GenerationRequest(prompt_ids=prompts[0], sampling=greedy(30), session_id="exec/main"),
            GenerationRequest(prompt_ids=prompts[3], sampling=greedy(25)),
        ]
        futures = [a.submit(r) for r in requests]
        _wait_until(lambda: a.stats.tokens_generated >= 2 * 6)
        b.import_sessions(a.drain())
        for req, fut in zip(requests, futures):
            result = fut.result(scaled(TIMEOUT))
            assert result.cell == "paged"
            assert result.token_ids == reference.greedy(params, req.prompt_ids, req.sampling.max_tokens)[0]
        assert b.stats.prefill_tokens == 0  # the KV moved: nothing recomputed
        # and back out of the paged loop: its cached session exports as pages
        (state,) = b.export_sessions({"exec/main"}, include_cached=True)
        assert state.kv is not None and len(state.kv_tokens) == len(prompts[0]) + 29
    finally:
        for loop in (a, b):
            loop.stop()
            assert loop.error is None
