"""Router: session affinity, least-in-flight placement, draining, cancel forwarding, in-flight accounting."""

from __future__ import annotations

import concurrent.futures

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.proxy.router import Router
from gyre_jax.serving.types import GenerationRequest, GenerationResult


class HeldBackend:
    """Futures stay pending until ``finish`` (or ``cancel``) resolves them."""

    def __init__(self, max_context: int = 1024, fail_submit: bool = False) -> None:
        self.max_context = max_context
        self.fail_submit = fail_submit
        self.pending: dict[str, concurrent.futures.Future[GenerationResult]] = {}
        self.received: list[GenerationRequest] = []
        self.cancelled: list[str] = []

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        if self.fail_submit:
            raise RuntimeError("backend refused the request")
        self.received.append(request)
        future: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
        self.pending[request.request_id] = future
        return future

    def finish(self, request_id: str, reason: str = "stop") -> None:
        self.pending.pop(request_id).set_result(GenerationResult(request_id, [1], [-0.5], [3], reason, 1))

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        if request_id in self.pending:
            self.finish(request_id, "cancelled")


def request(session: str | None) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2, 3], session_id=session)


def backend_of(backends: dict[str, HeldBackend], req: GenerationRequest) -> str:
    (name,) = [n for n, b in backends.items() if req in b.received]
    return name


def test_affinity_and_least_loaded_placement() -> None:
    backends = {"a": HeldBackend(), "b": HeldBackend()}
    router = Router(backends)
    first = request("s1")
    router.submit(first)
    assert backend_of(backends, first) == "a"  # tie: first named
    second = request("s2")
    router.submit(second)
    assert backend_of(backends, second) == "b"  # a has one in flight
    again = request("s1")
    router.submit(again)
    assert backend_of(backends, again) == "a"  # affinity beats load
    assert (router.in_flight("a"), router.in_flight("b")) == (2, 1)
    backends["a"].finish(first.request_id)
    backends["a"].finish(again.request_id)
    assert (router.in_flight("a"), router.in_flight("b")) == (0, 1)
    # Both idle and each with one pinned session: the tie goes to the first named.
    third = request("s3")
    router.submit(third)
    assert backend_of(backends, third) == "a"
    assert router.session_backend("s3") == "a" and router.session_backend("unknown") is None


def test_sequential_sessions_spread_by_pinned_count() -> None:
    backends = {"a": HeldBackend(), "b": HeldBackend(), "c": HeldBackend()}
    router = Router(backends)
    for session in ["s1", "s2", "s3", "s1", "s2", "s3"]:
        req = request(session)
        router.submit(req)
        backends[backend_of(backends, req)].finish(req.request_id)
    assert [router.session_backend(s) for s in ["s1", "s2", "s3"]] == ["a", "b", "c"]


def test_drain_moves_new_requests_and_all_drained_raises() -> None:
    backends = {"a": HeldBackend(), "b": HeldBackend()}
    router = Router(backends)
    held = request("s1")
    router.submit(held)
    router.drain("a")
    moved = request("s1")
    router.submit(moved)
    assert backend_of(backends, moved) == "b" and router.session_backend("s1") == "b"
    router.drain("b")
    with pytest.raises(RuntimeError, match="all serving backends are drained"):
        router.submit(request("s2"))
    # In-flight requests on a drained backend still complete and are still cancellable.
    router.cancel(held.request_id)
    assert backends["a"].cancelled == [held.request_id] and router.in_flight("a") == 0
    router.undrain("a")
    after = request("s1")
    router.submit(after)
    assert backend_of(backends, after) == "a"
    with pytest.raises(KeyError, match="unknown backend"):
        router.drain("zz")


def test_cancel_forwards_only_to_the_owner() -> None:
    backends = {"a": HeldBackend(), "b": HeldBackend()}
    router = Router(backends)
    req_a, req_b = request("x"), request("y")
    fut_a = router.submit(req_a)
    router.submit(req_b)
    router.cancel(req_a.request_id)
    assert backends["a"].cancelled == [req_a.request_id] and backends["b"].cancelled == []
    assert fut_a.result().finish_reason == "cancelled"
    router.cancel(req_a.request_id)  # already finished: ignored
    router.cancel("never-submitted")
    assert backends["a"].cancelled == [req_a.request_id]


def test_max_context_submit_failure_and_construction() -> None:
    backends = {"a": HeldBackend(max_context=4096), "b": HeldBackend(max_context=2048, fail_submit=True)}
    router = Router(backends)
    assert router.max_context == 2048 and router.names == ("a", "b")
    router.submit(request("s1"))  # to a
    moved = request("s2")
    router.submit(moved)  # b is least loaded but refuses: a takes it
    assert backend_of(backends, moved) == "a" and router.in_flight("b") == 0 and router.in_flight("a") == 2
    backends["a"].fail_submit = True
    with pytest.raises(RuntimeError, match="refused"):
        router.submit(request("s3"))
    assert router.in_flight("a") == 2 and router.in_flight("b") == 0
    with pytest.raises(ValueError, match="at least one backend"):
        Router({})
    with pytest.raises(ValueError, match="max_retries"):
        Router(backends, max_retries=-1)


def test_drain_with_cancel_moves_in_flight_requests_transparently() -> None:
    backends = {"a": HeldBackend(), "b": HeldBackend()}
    router = Router(backends)
    req = request("s1")
    future = router.submit(req)
    assert backend_of(backends, req) == "a"
    router.drain("a", cancel_in_flight=True)
    # The backend cancelled it; the router re-submitted the same request to b, and the caller still waits.
    assert backends["a"].cancelled == [req.request_id] and not future.done()
    assert [r.request_id for r in backends["b"].received] == [req.request_id]
    assert (router.in_flight("a"), router.in_flight("b"), router.retries) == (0, 1, 1)
    backends["b"].finish(req.request_id)
    assert future.result().finish_reason == "stop" and router.in_flight("b") == 0
    assert router.session_backend("s1") == "b"


def test_lost_request_is_parked_until_a_backend_is_undrained() -> None:
    backends = {"a": HeldBackend(), "b": HeldBackend()}
    router = Router(backends)
    req = request("s1")
    future = router.submit(req)
    router.drain("b")
    router.drain("a", cancel_in_flight=True)  # nowhere to go: it waits
    assert router.parked() == 1 and not future.done()
    router.undrain("b")
    assert router.parked() == 0
    assert [r.request_id for r in backends["b"].received] == [req.request_id]
    backends["b"].finish(req.request_id)
    assert future.result().finish_reason == "stop"
    # A parked request cancelled by its caller resolves "cancelled" at once and is never re-submitted.
    other = request("s2")
    other_future = router.submit(other)
    router.drain("a")
    router.drain(backend_of(backends, other), cancel_in_flight=True)
    assert router.parked() == 1
    router.cancel(other.request_id)
    assert other_future.result().finish_reason == "cancelled" and router.parked() == 0
    router.undrain("a")
    assert sum(r.request_id == other.request_id for b in backends.values() for r in b.received) == 1


def test_a_backend_that_stops_mid_request_is_retried_elsewhere_and_caller_cancel_is_not() -> None:
    backends = {"a": HeldBackend(), "b": HeldBackend()}
    router = Router(backends, max_retries=1)
    req = request("s1")
    future = router.submit(req)
    backends["a"].pending.pop(req.request_id).set_exception(RuntimeError("serving loop a is stopped"))
    assert [r.request_id for r in backends["b"].received] == [req.request_id] and not future.done()
    # The second loss exceeds max_retries=1: the caller gets the outcome.
    backends["b"].finish(req.request_id, "cancelled")
    assert future.result().finish_reason == "cancelled" and router.retries == 1
    # A cancel the caller asked for is final.
    mine = request("s2")
    mine_future = router.submit(mine)
    router.cancel(mine.request_id)
    assert mine_future.result().finish_reason == "cancelled" and router.retries == 1


def test_session_table_is_bounded() -> None:
    backends = {"a": HeldBackend(), "b": HeldBackend()}
    router = Router(backends, max_sessions=2)
    for session in ["s1", "s2", "s3"]:
        router.submit(request(session))
    assert router.session_backend("s1") is None and router.session_backend("s3") is not None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("submit"), st.sampled_from(["s0", "s1", "s2", "s3", None])),
            st.tuples(st.just("finish"), st.integers(0, 20)),
            st.tuples(st.just("drain"), st.sampled_from(["a", "b", "c"])),
            st.tuples(st.just("undrain"), st.sampled_from(["a", "b", "c"])),
        ),
        max_size=40,
    )
)
def test_routing_invariants(ops: list[tuple[str, object]]) -> None:
    """Never routes to a drained backend, keeps sessions where they are while possible, counts in-flight exactly."""
    backends = {name: HeldBackend() for name in ["a", "b", "c"]}
    router = Router(backends)
    drained: set[str] = set()
    outstanding: list[tuple[str, str]] = []  # (backend, request id)
    for op, arg in ops:
        if op == "submit":
            before = router.session_backend(arg) if arg is not None else None
            req = request(arg)
            if drained == set(backends):
                with pytest.raises(RuntimeError):
                    router.submit(req)
                continue
            loads = {n: router.in_flight(n) for n in backends if n not in drained}
            router.submit(req)
            name = backend_of(backends, req)
            assert name not in drained
            if before is not None and before not in drained:
                assert name == before
            else:
                assert loads[name] == min(loads.values())
            outstanding.append((name, req.request_id))
        elif op == "finish" and outstanding:
            name, request_id = outstanding.pop(int(arg) % len(outstanding))
            backends[name].finish(request_id)
        elif op == "drain":
            router.drain(arg)
            drained.add(arg)
        elif op == "undrain":
            router.undrain(arg)
            drained.discard(arg)
        for name in backends:
            assert router.in_flight(name) == sum(1 for n, _ in outstanding if n == name)


def test_a_streamed_request_retried_after_tokens_went_out_continues_from_them() -> None:
    from gyre_jax.serving.types import SamplingParams, TokenChunk

    backends = {"a": HeldBackend(), "b": HeldBackend()}
    router = Router(backends)
    heard: list[TokenChunk] = []
    req = GenerationRequest([1, 2, 3], SamplingParams(max_tokens=10), session_id="s", on_tokens=heard.append)
    future = router.submit(req)
    (sent,) = backends["a"].received
    for k, token in enumerate([7, 8, 9]):  # the backend tells three tokens, then is drained
        sent.on_tokens(TokenChunk(req.request_id, k, (token,), (-0.1 * k,), (4,)))
    router.drain("a", cancel_in_flight=True)
    (continuation,) = backends["b"].received
    assert continuation.request_id == req.request_id and continuation.prompt_ids == [1, 2, 3, 7, 8, 9]
    assert continuation.sampling.max_tokens == 7 and req.sampling.max_tokens == 10
    sent.on_tokens(TokenChunk(req.request_id, 3, (99,), (0.0,), (4,)))  # late, from the given-up attempt: dropped
    continuation.on_tokens(TokenChunk(req.request_id, 0, (5,), (-1.0,), (6,)))
    backends["b"].pending.pop(req.request_id).set_result(GenerationResult(req.request_id, [5], [-1.0], [6], "stop", 6))
    result = future.result()
    assert [c.start for c in heard] == [0, 1, 2, 3] and [c.token_ids[0] for c in heard] == [7, 8, 9, 5]
    assert (result.token_ids, result.policy_versions, result.prompt_len) == ([7, 8, 9, 5], [4, 4, 4, 6], 3)
    assert result.logprobs == [0.0, -0.1, -0.2, -1.0] and result.finish_reason == "stop"

    # told tokens that used the whole budget: no continuation, the caller gets them as a length finish
    full = GenerationRequest([1], SamplingParams(max_tokens=2), session_id="t", on_tokens=heard.append)
    full_future = router.submit(full)
    (sent,) = [r for r in backends["b"].received if r.request_id == full.request_id]
    for k in range(2):
        sent.on_tokens(TokenChunk(full.request_id, k, (k,), (0.0,), (4,)))
    router.undrain("a")
    router.drain("b", cancel_in_flight=True)
    assert full_future.result().token_ids == [0, 1] and full_future.result().finish_reason == "length"
    assert not any(r.request_id == full.request_id for r in backends["a"].received)
