"""Session migration between serving loops on different submeshes (``export_sessions``/``drain`` ->
``import_session``): requests in flight continue token for token, cached sessions stay warm, the original
futures resolve, cancels follow the request, bad states are refused with a clear error."""

from __future__ import annotations

import concurrent.futures
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from timelimits import scaled

from gyre_jax.serving.loop import ServingLoop
from gyre_jax.serving.session import SessionState
from gyre_jax.serving.types import GenerationRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slow_engine import SlowEngine  # noqa: E402

TIMEOUT = 60.0


def _wait_until(cond, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


@pytest.fixture
def cells(engine, other_engine, model_params):
    """Loop "a" on devices 4-7 (slowed down so a test can act mid-generation) and loop "b" on devices 0-3."""
    engine_b, params_on_b, _ = other_engine
    a = ServingLoop(SlowEngine(engine), model_params[1], name="a").start()
    b = ServingLoop(engine_b, params_on_b, name="b").start()
    yield a, b
    for loop in (a, b):
        loop.stop()
        assert loop.error is None


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def test_in_flight_requests_move_to_another_submesh_and_continue_identically(
    cells, model_params, reference, prompts
) -> None:
    a, b = cells
    _, params, _ = model_params
    sampled = SamplingParams(temperature=1.0, max_tokens=30, seed=11)
    unmigrated = a.submit(GenerationRequest(prompt_ids=prompts[4], sampling=sampled)).result(scaled(TIMEOUT))

    requests = [
        GenerationRequest(prompt_ids=prompts[0], sampling=greedy(30), session_id="exec/main"),
        GenerationRequest(prompt_ids=prompts[4], sampling=sampled, session_id="exec/sub"),
        GenerationRequest(prompt_ids=prompts[3], sampling=greedy(25)),  # no session id: moves with a drain
    ]
    base = a.stats.tokens_generated
    futures = [a.submit(r) for r in requests]
    _wait_until(lambda: a.stats.tokens_generated >= base + 3 * 6)
    states = a.drain()
    assert a.num_in_flight() == 0 and not any(f.done() for f in futures)
    moved = {s.request.request_id: s for s in states if s.in_flight}
    assert set(moved) == {r.request_id for r in requests}
    for s in moved.values():  # the KV holds the prompt and every generated token but the newest
        assert s.kv_tokens == list(s.request.prompt_ids) + s.token_ids[:-1] and s.source == "a"
        assert 3 <= len(s.token_ids) < s.request.sampling.max_tokens and s.key is not None
    b.import_sessions(states)
    results = [f.result(scaled(TIMEOUT)) for f in futures]
    for req, result in zip(requests, results):
        assert result.cell == "b" and result.finish_reason == "length"
        if req.sampling.temperature == 0:
            want_tokens, want_logprobs = reference.greedy(params, req.prompt_ids, req.sampling.max_tokens)
            assert result.token_ids == want_tokens
            np.testing.assert_allclose(result.logprobs, want_logprobs, atol=1e-4, rtol=0)
    # a seeded sampled request continues with the same key state: identical to the unmigrated run
    assert results[1].token_ids == unmigrated.token_ids
    np.testing.assert_allclose(results[1].logprobs, unmigrated.logprobs, atol=1e-5, rtol=0)
    assert b.stats.prefill_tokens == 0  # nothing was recomputed on b
    assert a.stats.sessions_exported == b.stats.sessions_imported == 3


def test_cached_and_queued_sessions_move_and_stay_warm(cells, model_params, reference, prompts) -> None:
    a, b = cells
    _, params, _ = model_params
    first = a.submit(GenerationRequest(prompt_ids=prompts[3], sampling=greedy(6), session_id="s1")).result(
        scaled(TIMEOUT)
    )
    assert "s1" in a.prefix_cache
    # fill every slot of a, so one more request waits in its queue
    busy = [a.submit(GenerationRequest(prompt_ids=prompts[i], sampling=greedy(200))) for i in range(4)]
    nxt = prompts[3] + first.token_ids + [3, 1, 4]
    queued = a.submit(GenerationRequest(prompt_ids=nxt, sampling=greedy(5), session_id="s1"))
    _wait_until(lambda: a.stats.tokens_generated >= 8)
    assert a.num_in_flight() == 5

    states = a.export_sessions(["s1"])  # only that session: its cached entry and its queued request
    assert [(s.session_id, s.in_flight) for s in states] == [("s1", False), ("s1", True)]
    assert states[0].kv_tokens == prompts[3] + first.token_ids[:-1] and states[1].kv is None
    assert "s1" not in a.prefix_cache and a.num_in_flight() == 4
    b.import_sessions(states)
    result = queued.result(scaled(TIMEOUT))
    assert result.cell == "b" and result.token_ids == reference.greedy(params, nxt, 5)[0]
    assert result.cached_tokens == len(prompts[3]) + len(first.token_ids) - 1  # b's cache had the moved entry
    assert b.stats.prefill_tokens == len(nxt) - result.cached_tokens
    a.stop()  # a served its other requests all along, undisturbed (finished or cancelled by the stop)
    for i, f in enumerate(busy):
        r = f.result(scaled(TIMEOUT))
        assert r.cell == "a" and len(r.token_ids) >= 2
        reference.check_teacher_forced(params, prompts[i], r.token_ids, r.logprobs)


def test_cancel_follows_a_moved_request(cells, prompts) -> None:
    a, b = cells
    req = GenerationRequest(prompt_ids=prompts[1], sampling=greedy(1000), session_id="x")
    fut = a.submit(req)
    _wait_until(lambda: a.stats.tokens_generated >= 3)
    b.import_sessions(a.export_sessions(["x"]))
    _wait_until(lambda: b.stats.tokens_generated >= 3)
    a.cancel(req.request_id)  # whoever routed it to "a" still cancels it there: forwarded to "b"
    result = fut.result(scaled(TIMEOUT))
    assert result.finish_reason == "cancelled" and result.cell == "b" and len(result.token_ids) >= 6
    assert b.wait_idle(scaled(5.0))


def test_a_state_nobody_imports_can_be_cancelled(cells, prompts) -> None:
    a, _ = cells
    req = GenerationRequest(prompt_ids=prompts[0], sampling=greedy(1000), session_id="y")
    fut = a.submit(req)
    _wait_until(lambda: a.stats.tokens_generated >= 2)
    (state,) = a.export_sessions(["y"])
    assert not fut.done()
    state.cancel()
    result = fut.result(scaled(TIMEOUT))
    assert result.finish_reason == "cancelled" and result.token_ids == state.token_ids and len(result.token_ids) >= 2


def test_bad_states_are_refused_clearly(cells, engine, prompts) -> None:
    a, b = cells
    kv = engine.dense.export_slot(engine.dense.init_decode_state(), 0, 16)
    wrong_tokens = SessionState(
        "s",
        kv,
        kv_tokens=[1, 2, 3],
        kv_version=0,
        request=GenerationRequest(prompt_ids=[9, 9, 9, 9]),
        future=concurrent.futures.Future(),
    )
    with pytest.raises(ValueError, match="not a prefix of the request's prompt"):
        b.import_session(wrong_tokens)
    kv.pages = kv.pages[:1]
    with pytest.raises(ValueError, match="do not match this engine's layout"):
        b.import_session(SessionState("s", kv, kv_tokens=[1, 2], kv_version=0))
    # a moved request too long for the new cell fails its own future, not the loop
    fut = concurrent.futures.Future()
    b.import_session(
        SessionState(
            None,
            None,
            [],
            0,
            request=GenerationRequest(prompt_ids=[1] * 100),
            future=fut,
            token_ids=[1] * 40,
            logprobs=[0.0] * 40,
            policy_versions=[0] * 40,
        )
    )
    with pytest.raises(ValueError, match="does not fit serving loop b"):
        fut.result(scaled(TIMEOUT))
    ok = b.submit(GenerationRequest(prompt_ids=prompts[0], sampling=greedy(2))).result(scaled(TIMEOUT))
    assert len(ok.token_ids) == 2 and b.error is None


def test_token_listener_hears_every_token_once_across_a_move(cells, model_params, reference, prompts) -> None:
    """A listener hears each token as it is sampled (before the future resolves), in order, with no repeat when
    the request moves to another loop; the result holds exactly what it heard. A pickled request drops it."""
    import pickle

    a, b = cells
    _, params, _ = model_params
    heard = []
    request = GenerationRequest(prompt_ids=prompts[1], sampling=greedy(30), on_tokens=heard.append)
    future = a.submit(request)
    _wait_until(lambda: len(heard) >= 4)
    assert not future.done()  # tokens arrive while the request still runs
    b.import_sessions(a.drain())
    result = future.result(scaled(TIMEOUT))
    assert [c.start for c in heard] == list(range(len(heard)))
    assert [t for c in heard for t in c.token_ids] == result.token_ids
    assert [x for c in heard for x in c.logprobs] == result.logprobs
    assert [v for c in heard for v in c.policy_versions] == result.policy_versions
    assert result.token_ids == reference.greedy(params, prompts[1], 30)[0]
    assert pickle.loads(pickle.dumps(request)).on_tokens is None


def test_a_failing_listener_is_dropped_and_the_request_completes(cells, model_params, reference, prompts) -> None:
    a, _ = cells
    _, params, _ = model_params
    calls = []

    def broken(chunk) -> None:
        calls.append(chunk)
        raise RuntimeError("listener bug")

    result = a.submit(GenerationRequest(prompt_ids=prompts[2], sampling=greedy(5), on_tokens=broken)).result(
        scaled(TIMEOUT)
    )
    assert len(calls) == 1 and result.token_ids == reference.greedy(params, prompts[2], 5)[0]
    assert a.error is None


def test_router_continues_a_streamed_request_from_the_tokens_told(cells, model_params, reference, prompts) -> None:
    """Drained with cancel_in_flight mid-stream, a streamed request continues on the other loop from the tokens its
    caller heard (prompt + those tokens), not from scratch: the caller hears each token once and the result is
    exactly what it heard, the greedy completion of the original prompt."""
    from gyre_jax.proxy.router import Router

    a, b = cells
    _, params, _ = model_params
    router = Router({"a": a, "b": b})
    router.drain("b")
    heard = []
    request = GenerationRequest(prompt_ids=prompts[3], sampling=greedy(24), session_id="s", on_tokens=heard.append)
    future = router.submit(request)
    _wait_until(lambda: len(heard) >= 5)
    router.undrain("b")
    router.drain("a", cancel_in_flight=True)
    result = future.result(scaled(TIMEOUT))
    told = len(heard)
    assert router.retries == 1 and result.finish_reason == "length"
    assert [c.start for c in heard] == list(range(told))
    assert [t for c in heard for t in c.token_ids] == result.token_ids
    assert [x for c in heard for x in c.logprobs] == result.logprobs
    assert result.prompt_len == len(prompts[3])
    want, want_logprobs = reference.greedy(params, prompts[3], 24)
    assert result.token_ids == want
    np.testing.assert_allclose(result.logprobs, want_logprobs, atol=2e-3)
