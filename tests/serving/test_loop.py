"""ServingLoop: continuous batching over the engine — correctness under concurrency, stop/length/cancel,
rejection of prompts that do not fit, weight updates with policy versions, queueing and seeded sampling."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import pytest

from gyre_jax.serving.loop import ServingLoop
from gyre_jax.serving.types import ContextTooLongError, GenerationRequest, SamplingParams

TIMEOUT = 60.0


class SlowEngine:
    """The shared engine with a pause after every generate step, so a test can act while requests are running."""

    def __init__(self, engine, step_s: float = 0.02):
        self._engine, self._step_s = engine, step_s

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, params, decode_state):
        out = self._engine.generate(params, decode_state)
        time.sleep(self._step_s)
        return out


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
    deadline = time.monotonic() + timeout
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
        result = futures[req.request_id].result(timeout=TIMEOUT)
        n = req.sampling.max_tokens
        assert (result.request_id, result.finish_reason, result.prompt_len, result.cell) == (
            req.request_id, "length", len(req.prompt_ids), "test-cell")
        want_tokens, want_logprobs = reference.greedy(params, req.prompt_ids, n)
        assert result.token_ids == want_tokens
        np.testing.assert_allclose(result.logprobs, want_logprobs, atol=1e-4, rtol=0)
        assert result.policy_versions == [0] * n
    assert loop.stats.requests_done == len(requests)
    assert loop.stats.prefill_tokens == sum(len(p) for p in prompts)


def test_more_requests_than_slots_are_queued_and_all_complete(loop, model_params, reference, prompts) -> None:
    _, params, _ = model_params
    slots = loop.engine.max_concurrent_decodes
    requests = [GenerationRequest(prompt_ids=prompts[i % len(prompts)], sampling=greedy(3 + i % 5)) for i in range(3 * slots)]
    futures = [loop.submit(r) for r in requests]
    assert loop.num_in_flight() > slots  # some wait in the queue
    for req, fut in zip(requests, futures):
        result = fut.result(timeout=TIMEOUT)
        assert result.finish_reason == "length"
        assert result.token_ids == reference.greedy(params, req.prompt_ids, req.sampling.max_tokens)[0]
    assert loop.wait_idle(timeout=5.0)
    assert loop.num_in_flight() == 0


def test_stop_id_ends_the_completion_and_is_included(loop, model_params, reference, prompts) -> None:
    _, params, _ = model_params
    for prompt in (prompts[0], prompts[3]):
        ref, ref_logprobs = reference.greedy(params, prompt, 3)
        stop = ref[2]
        end = ref.index(stop) + 1  # the first time the stop id is sampled (may be before the 3rd token)
        result = loop.submit(GenerationRequest(prompt_ids=prompt, sampling=greedy(20, stop_ids=(999, stop)))).result(TIMEOUT)
        assert result.finish_reason == "stop"
        assert result.token_ids == ref[:end]
        np.testing.assert_allclose(result.logprobs, ref_logprobs[:end], atol=1e-4, rtol=0)
    # a stop id as the very first (prefill-sampled) token
    first = reference.greedy(params, prompts[2], 1)[0][0]
    result = loop.submit(GenerationRequest(prompt_ids=prompts[2], sampling=greedy(20, stop_ids=(first,)))).result(TIMEOUT)
    assert (result.token_ids, result.finish_reason) == ([first], "stop")


def test_length_at_max_tokens_and_at_the_context_limit(loop, model_params, reference, prompts) -> None:
    _, params, _ = model_params
    one = loop.submit(GenerationRequest(prompt_ids=prompts[1], sampling=greedy(1))).result(TIMEOUT)
    assert (one.token_ids, one.finish_reason) == (reference.greedy(params, prompts[1], 1)[0], "length")

    prompt = (prompts[5] * 2)[: loop.engine.max_prefill_length]  # 64 tokens; the context holds 128
    result = loop.submit(GenerationRequest(prompt_ids=prompt, sampling=greedy(1000))).result(TIMEOUT)
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
    _wait_until(lambda: loop.stats.prefill_tokens == sum(len(r.prompt_ids) for r in long) and loop.stats.generate_steps >= 3)

    loop.cancel(queued.request_id)  # still waiting for a slot
    result = queued_future.result(TIMEOUT)
    assert (result.finish_reason, result.token_ids) == ("cancelled", [])

    loop.cancel(long[0].request_id)  # running
    result = futures[0].result(TIMEOUT)
    assert result.finish_reason == "cancelled"
    budget = loop.max_context - len(long[0].prompt_ids)
    assert 3 <= len(result.token_ids) < budget
    reference.check_teacher_forced(params, long[0].prompt_ids, result.token_ids, result.logprobs)

    # the freed slot serves a new request while the other long requests are still running
    short = GenerationRequest(prompt_ids=prompts[6], sampling=greedy(3))
    assert loop.submit(short).result(TIMEOUT).token_ids == reference.greedy(params, prompts[6], 3)[0]
    assert not any(f.done() for f in futures[1:])

    for req in long[1:]:
        loop.cancel(req.request_id)
    assert all(f.result(TIMEOUT).finish_reason == "cancelled" for f in futures[1:])
    assert loop.wait_idle(timeout=5.0)
    loop.cancel("req-that-does-not-exist")  # harmless
    after = loop.submit(GenerationRequest(prompt_ids=prompts[0], sampling=greedy(2))).result(TIMEOUT)
    assert (after.token_ids, after.finish_reason) == (reference.greedy(params, prompts[0], 2)[0], "length")


def test_prompts_that_do_not_fit_fail_their_future_and_the_loop_serves_on(loop, model_params, reference, prompts) -> None:
    _, params, _ = model_params
    too_long_for_prefill = loop.submit(GenerationRequest(prompt_ids=[1] * (loop.engine.max_prefill_length + 1)))
    too_long_for_context = loop.submit(GenerationRequest(prompt_ids=[1] * loop.max_context))
    for fut in (too_long_for_prefill, too_long_for_context):
        with pytest.raises(ContextTooLongError, match="does not fit"):
            fut.result(TIMEOUT)
    with pytest.raises(ValueError, match="empty prompt"):
        loop.submit(GenerationRequest(prompt_ids=[])).result(TIMEOUT)
    with pytest.raises(ValueError, match="temperature"):
        loop.submit(GenerationRequest(prompt_ids=[1], sampling=SamplingParams(temperature=-1.0))).result(TIMEOUT)
    result = loop.submit(GenerationRequest(prompt_ids=prompts[2], sampling=greedy(5))).result(TIMEOUT)
    assert result.token_ids == reference.greedy(params, prompts[2], 5)[0]
    assert loop.error is None


def test_update_params_tags_later_tokens_with_the_new_version(slow_loop, model_params, reference, prompts) -> None:
    loop = slow_loop
    _, params, params_b = model_params
    running = GenerationRequest(prompt_ids=prompts[0], sampling=greedy(1000))
    running_future = loop.submit(running)
    _wait_until(lambda: loop.stats.tokens_generated >= 3)
    loop.update_params(params_b, version=1)
    later = loop.submit(GenerationRequest(prompt_ids=prompts[1], sampling=greedy(6))).result(TIMEOUT)
    assert loop.policy_version == 1
    assert later.policy_versions == [1] * 6
    assert later.token_ids == reference.greedy(params_b, prompts[1], 6)[0]  # produced by the new weights
    assert later.token_ids != reference.greedy(params, prompts[1], 6)[0]

    loop.cancel(running.request_id)
    result = running_future.result(TIMEOUT)
    versions = result.policy_versions
    assert len(versions) == len(result.token_ids)
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    old = versions.count(0)
    assert old >= 4  # the prefill token and the >= 3 generated before the update
    reference.check_teacher_forced(params, prompts[0], result.token_ids[:old], result.logprobs[:old])


def test_seeded_sampled_request_is_reproducible(loop, model_params, reference, prompts) -> None:
    _, params, _ = model_params

    def seeded(seed: int) -> GenerationRequest:
        return GenerationRequest(prompt_ids=prompts[4], sampling=SamplingParams(temperature=1.0, max_tokens=12, seed=seed))

    alone = loop.submit(seeded(42)).result(TIMEOUT)
    # the same seed again, this time batched with other traffic in other slots
    others = [loop.submit(GenerationRequest(prompt_ids=p, sampling=SamplingParams(temperature=1.0, max_tokens=15)))
              for p in prompts[:3]]
    again = loop.submit(seeded(42)).result(TIMEOUT)
    other_seed = loop.submit(seeded(43)).result(TIMEOUT)
    for f in others:
        f.result(TIMEOUT)
    assert again.token_ids == alone.token_ids
    np.testing.assert_allclose(again.logprobs, alone.logprobs, atol=1e-6)
    assert other_seed.token_ids != alone.token_ids
    # behaviour log-probs are the model's log_softmax at the sampled tokens (temperature 1)
    lp = reference.logprobs(params, prompts[4] + alone.token_ids)[len(prompts[4]) - 1:-1]
    np.testing.assert_allclose(alone.logprobs, lp[np.arange(12), alone.token_ids], atol=1e-4, rtol=0)
    # unseeded requests get distinct keys from the loop
    a = loop.submit(GenerationRequest(prompt_ids=prompts[4], sampling=SamplingParams(temperature=1.0, max_tokens=12)))
    b = loop.submit(GenerationRequest(prompt_ids=prompts[4], sampling=SamplingParams(temperature=1.0, max_tokens=12)))
    assert a.result(TIMEOUT).token_ids != b.result(TIMEOUT).token_ids


def test_stop_ends_the_thread(engine, model_params) -> None:
    loop = _start(engine, model_params[1])
    thread = loop._thread
    assert thread is not None and thread.is_alive()
    loop.stop()
    assert not thread.is_alive() and loop.error is None
