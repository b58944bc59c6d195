"""Overload and slow clients on one real proxy (issue 19 item 4): bounded admission (429 + Retry-After), the
request cap (503 + Retry-After), a reader that never reads, slowloris senders, oversized headers; the real
``openai`` and ``anthropic`` SDKs retrying a 429. Loopback only; raw-socket clients (``_overload_util``).

Nothing here depends on speed: held generations (``HOLD``) fix how many calls are in flight when the others
arrive, and time bounds are generous multiples of the configured timeouts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import sys
import threading
from pathlib import Path

import anthropic
import openai
import pytest
from timelimits import scaled

from gyre_jax.config.base import ConfigError
from gyre_jax.config.rollout import ProxySection
from gyre_jax.proxy.admission import Admission
from gyre_jax.proxy.connections import ConnectionLimits

_spec = importlib.util.spec_from_file_location("_overload_util", Path(__file__).with_name("_overload_util.py"))
u = importlib.util.module_from_spec(_spec)
sys.modules["_overload_util"] = u
_spec.loader.exec_module(u)

# Small limits so the test is quick; header_timeout_s must exceed keep_alive_s.
LIMITS = ConnectionLimits(max_requests=1000, header_timeout_s=2.0, body_timeout_s=2.0, write_timeout_s=1.0,
                          keep_alive_s=1)  # fmt: skip
RSS_GROWTH_BOUND = 32 << 20  # see test_storm_of_streaming_clients


def held_call(key: str, api: str = "openai") -> bytes:
    return u.streaming_call(key, api, prompt=u.HOLD)


async def until(predicate, timeout_s: float, what: str) -> None:
    timeout_s = scaled(timeout_s)  # a hang guard
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


def test_storm_of_streaming_clients(tmp_path):
    """256 streaming clients at once on 8 slots + 16 queue places: the 24 held calls complete with whole SSE
    streams once let go, the other 232 get 429 with Retry-After at once; no more than 8 generations ever run at
    once; then a normal call succeeds; RSS grows by less than RSS_GROWTH_BOUND.

    The bound: 256 connections each hold at most one ~300-byte request, an h11 connection, a task and a client
    socket here (tens of KiB each, ~10 MiB in all), 24 live generations of 47 tokens and their records.
    Measured: +6..8 MiB at 256 clients; +28 MiB at 1024, level after that over 8 rounds of 1024
    (benchmarks/faults/overload.py). 32 MiB leaves room for the allocator's arenas."""
    # a long header timeout: the clients share this process with the proxy and may be slow to send on a busy machine
    limits = dataclasses.replace(LIMITS, header_timeout_s=30.0)
    with u.proxy(tmp_path, max_active_calls=8, max_queued_calls=16, limits=limits) as (server, backend):
        keys = [server.open_execution(f"exec-{i}") for i in range(16)]
        warm = asyncio.run(u.normal_calls(server.port, keys[0], 2))
        assert [o.status for o in warm] == [200, 200]
        rss_before = u.rss_bytes()

        async def storm() -> list[tuple[str, u.Outcome]]:
            apis = ["openai" if i % 2 == 0 else "anthropic" for i in range(256)]
            calls = [u.exchange(server.port, held_call(keys[i % 16], api)) for i, api in enumerate(apis)]
            tasks = asyncio.gather(*calls)
            await until(lambda: server.admission_stats()["refused"] == 232, 60, "232 refusals")
            stats = server.admission_stats()
            assert (stats["active"], stats["waiting"]) == (8, 16)
            backend.hold.clear()  # let the held generations go
            return list(zip(apis, await tasks))

        outcomes = asyncio.run(storm())
        result = u.Storm(outcomes, u.rss_bytes())
        assert result.bad() == []
        counts = result.counts()
        assert counts == {"ok": 24, "refused_429": 232, "refused_503": 0, "bad": 0}
        assert backend.peak_live <= 8
        for api, outcome in outcomes:
            if outcome.status == 429:
                body = json.loads(outcome.body)
                kind = body["error"]["type"] if api == "anthropic" else body["error"]["code"]
                assert kind == ("rate_limit_error" if api == "anthropic" else "rate_limit_exceeded")
                assert outcome.headers["retry-after"] == "1"
        u.wait_until(lambda: server.admission_stats()["active"] == 0, 10, "the slots to be freed")
        stats = server.admission_stats()
        assert stats["admitted"] == 2 + 24 and stats["waiting"] == 0
        after = asyncio.run(u.normal_calls(server.port, keys[0], 1))[0]
        assert after.status == 200 and u.sse_complete("openai", after.body)
        assert u.rss_bytes() - rss_before < RSS_GROWTH_BOUND, (rss_before, u.rss_bytes())


def test_request_cap_answers_503_with_retry_after(tmp_path):
    """Beyond ``max_requests`` requests in progress, a call gets 503 + Retry-After in its API's style at once."""
    limits = ConnectionLimits(max_requests=2, header_timeout_s=2.0, keep_alive_s=1)
    with u.proxy(tmp_path, max_active_calls=4, max_queued_calls=4, limits=limits) as (server, backend):
        key = server.open_execution("exec")

        async def run() -> tuple[list[u.Outcome], u.Outcome, u.Outcome]:
            held = asyncio.gather(*(u.exchange(server.port, held_call(key)) for _ in range(2)))
            await until(lambda: server.admission_stats()["active"] == 2, 30, "2 held calls")
            over_openai = await u.exchange(server.port, u.streaming_call(key, "openai"))
            over_anthropic = await u.exchange(server.port, u.streaming_call(key, "anthropic"))
            backend.hold.clear()
            return await held, over_openai, over_anthropic

        held, over_openai, over_anthropic = asyncio.run(run())
        assert [o.status for o in held] == [200, 200] and all(u.sse_complete("openai", o.body) for o in held)
        for outcome in (over_openai, over_anthropic):
            assert outcome.status == 503 and outcome.headers["retry-after"] == "1", outcome
        assert json.loads(over_anthropic.body)["error"]["type"] == "overloaded_error"
        assert json.loads(over_openai.body)["error"]["code"] == "too_many_requests"
        assert server.admission_stats()["refused_503"] == 2
        after = asyncio.run(u.normal_calls(server.port, key, 1))[0]
        assert after.status == 200


def test_every_oversized_head_of_a_burst_gets_its_431_not_a_reset(tmp_path):
    """60 clients at once each send a 64 KiB head: every one reads its 431. The proxy refuses a head while the rest
    of it is still arriving; closing at once with those bytes unread made the kernel reset the connection,
    discarding the answer before some clients read it (3 of 40 in a burst here, before the lingering close)."""
    with u.proxy(tmp_path, max_active_calls=2, max_queued_calls=4, limits=LIMITS) as (server, _):
        key = server.open_execution("exec")

        async def run() -> list[u.Outcome]:
            return await asyncio.gather(
                *(u.exchange(server.port, u.oversized_headers(key, 64 * 1024)) for _ in range(60))
            )

        outcomes = asyncio.run(run())
        assert [o for o in outcomes if o.status != 431] == []
        assert asyncio.run(u.normal_calls(server.port, key, 1))[0].status == 200


def test_slow_clients_do_not_block_others(tmp_path):
    """A reader that never reads (its stream endless), slowloris senders (head and body) and oversized headers,
    all at once: normal calls are served meanwhile; the non-reader's generation is cancelled and its slot
    freed after the write timeout; the slowloris senders get 408 after theirs; the oversized head gets 431;
    then the proxy serves normally."""
    backend = u.PacedBackend(tokens_per_tick=4096)  # big deltas: the non-reader's socket buffers fill quickly
    with u.proxy(tmp_path, backend, max_active_calls=2, max_queued_calls=4, limits=LIMITS) as (server, _):
        key = server.open_execution("exec")

        async def body_slowloris() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(u.streaming_call(key, "openai")[:-20])  # the head and most of the body, never the rest
            try:
                return await asyncio.wait_for(reader.read(-1), scaled(20))
            finally:
                writer.close()

        async def run():
            endless = u.streaming_call(key, "openai", prompt=u.ENDLESS, max_tokens=10_000_000)
            stuck = await u.never_reads(server.port, endless)
            slow = [asyncio.ensure_future(u.slowloris(server.port, 0.1, scaled(20))) for _ in range(20)]
            slow_body = asyncio.ensure_future(body_slowloris())
            big = await u.exchange(server.port, u.oversized_headers(key, 64 * 1024))
            fits = await u.exchange(server.port, u.oversized_headers(key, 8 * 1024))
            normal = await u.normal_calls(server.port, key, 5, timeout_s=10)
            await until(lambda: backend.endless_ids and backend.endless_ids[0] in backend.cancelled, 20,
                        "the non-reader's generation to be cancelled")  # fmt: skip
            await until(lambda: server.admission_stats()["active"] == 0, 10, "the non-reader's slot to be freed")
            stuck.close()
            return big, fits, normal, await asyncio.gather(*slow), await slow_body

        big, fits, normal, slow, slow_body = asyncio.run(run())
        assert all(o.status == 200 and u.sse_complete("openai", o.body) for o in normal), normal
        assert big.status == 431 and "over this proxy's limit" in json.loads(big.body)["error"]["message"]
        assert fits.status == 200
        for answer, seconds in slow:
            assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
            assert 2.0 <= seconds < 2.0 + scaled(13.0)  # the header timeout's 408, not the test's own limit
        assert slow_body.startswith(b"HTTP/1.1 408") and b"request body did not arrive" in slow_body
        after = asyncio.run(u.normal_calls(server.port, key, 1))[0]
        assert after.status == 200 and u.sse_complete("openai", after.body)
        assert backend.live() == 0


def test_queued_client_that_leaves_is_dropped(tmp_path):
    """A queued call whose client disconnects leaves the queue (its place is free for the next one)."""
    with u.proxy(tmp_path, max_active_calls=1, max_queued_calls=1, limits=LIMITS) as (server, backend):
        key = server.open_execution("exec")

        async def run() -> u.Outcome:
            held = asyncio.ensure_future(u.exchange(server.port, held_call(key)))
            await until(lambda: server.admission_stats()["active"] == 1, 30, "the held call")
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(u.streaming_call(key, "openai"))
            await until(lambda: server.admission_stats()["waiting"] == 1, 30, "a queued call")
            writer.close()
            await until(lambda: server.admission_stats()["waiting"] == 0, 30, "the queued call to leave")
            queued = asyncio.ensure_future(u.exchange(server.port, u.streaming_call(key, "openai")))
            await until(lambda: server.admission_stats()["waiting"] == 1, 30, "the next queued call")
            backend.hold.clear()
            assert (await held).status == 200
            return await queued

        queued = asyncio.run(run())
        assert queued.status == 200 and u.sse_complete("openai", queued.body)
        # a stream's slot is freed just after its last byte went out: the client may see the end first
        u.wait_until(lambda: server.admission_stats()["active"] == 0, 10, "the slot to be freed")
        stats = server.admission_stats()
        assert stats["left_queue"] == 1 and stats["refused"] == 0 and stats["active"] == 0
        assert backend.submitted == 2  # the call that left was never run


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_sdk_retries_429_then_succeeds(tmp_path, api):
    """The real SDK gets 429 + Retry-After while the only slot is held, retries, and succeeds once it is free."""
    with u.proxy(tmp_path, max_active_calls=1, max_queued_calls=0, limits=LIMITS) as (server, backend):
        key = server.open_execution("exec")
        held = threading.Thread(target=lambda: asyncio.run(u.exchange(server.port, held_call(key))))
        held.start()
        u.wait_until(lambda: server.admission_stats()["active"] == 1, 30, "the held call")
        result: list[str] = []
        retries = round(scaled(5))  # ~1 s apart (Retry-After): the held call frees its slot within them, loaded or not

        def call() -> None:
            if api == "openai":
                client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=retries)
                reply = client.chat.completions.create(model="gyre-tiny", max_tokens=64,
                                                       messages=[{"role": "user", "content": "hi"}])  # fmt: skip
                result.append(reply.choices[0].message.content)
            else:
                client = anthropic.Anthropic(base_url=server.anthropic_base_url, api_key=key, max_retries=retries)
                reply = client.messages.create(model="gyre-tiny", max_tokens=64,
                                               messages=[{"role": "user", "content": "hi"}])  # fmt: skip
                result.append(reply.content[0].text)

        caller = threading.Thread(target=call)
        caller.start()
        u.wait_until(lambda: server.admission_stats()["refused"] >= 1, 30, "a 429")
        backend.hold.clear()
        caller.join(scaled(60))
        held.join(scaled(30))
        assert result == [u.REPLY]
        assert server.admission_stats()["admitted"] == 2


def test_admission_is_fifo():
    """Slots go to queued calls in arrival order; a newcomer does not overtake the queue."""

    async def run() -> list[int]:
        admission = Admission(max_active=1, max_queued=3)

        async def connected() -> bool:
            return False

        order: list[int] = []

        async def call(i: int) -> None:
            assert await admission.acquire(connected)
            order.append(i)
            await asyncio.sleep(0)
            admission.release()

        assert await admission.acquire(connected)
        tasks = [asyncio.ensure_future(call(i)) for i in range(3)]
        await asyncio.sleep(0.01)
        assert admission.stats().waiting == 3
        with pytest.raises(Exception) as refused:
            await admission.acquire(connected)
        assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
        admission.release()
        await asyncio.gather(*tasks)
        assert admission.stats().active == 0
        return order

    assert asyncio.run(run()) == [0, 1, 2]


def test_config_admission_keys():
    """proxy.max_active_calls / max_queued_calls: validated; 0 derives them from rollout.max_parallel."""
    assert ProxySection().admission_limits(16) == (128, 512)
    assert ProxySection().admission_limits(1) == (64, 256)
    assert ProxySection(max_active_calls=3, max_queued_calls=5).admission_limits(16) == (3, 5)
    with pytest.raises(ConfigError, match="config.proxy.max_active_calls=-1 must be >= 0"):
        ProxySection(max_active_calls=-1)
    with pytest.raises(ConfigError, match="config.proxy.max_queued_calls=-2 must be >= 0"):
        ProxySection(max_queued_calls=-2)


def test_closed_stream_cancels_its_generation_and_frees_its_slot():
    """An ``sse.EventStream`` whose send fails mid-stream closes its events and runs its ``on_close`` callbacks;
    a turn's wait closed at a yield (its stream abandoned) cancels the backend request."""
    from types import SimpleNamespace

    from starlette.requests import ClientDisconnect

    from gyre_jax.proxy import sse
    from gyre_jax.proxy.waiting import Waiter
    from gyre_jax.serving.types import GenerationRequest, SamplingParams

    backend = u.PacedBackend()
    try:

        async def run() -> tuple[list[str], list[str], str]:
            request = GenerationRequest(prompt_ids=u.BYTES.encode(u.ENDLESS), sampling=SamplingParams(max_tokens=10**6))
            turn = SimpleNamespace(generation=request, execution=SimpleNamespace(begin=lambda rid: None,
                                                                                 finish=lambda rid: None))  # fmt: skip

            async def connected() -> bool:
                return False

            async def events():
                async for item in Waiter(backend).wait(turn, connected, listen=True):
                    yield sse.data({"n": len(item.token_ids) if item is not None else 0})

            stream = sse.response(events())
            closed: list[str] = []
            stream.on_close.append(lambda: closed.append("slot"))
            sent: list[str] = []

            async def send(message) -> None:
                sent.append(message["type"])
                if len(sent) == 3:  # the head, one event, then the client is gone
                    raise OSError("connection reset")

            async def receive():
                await asyncio.sleep(3600)

            with pytest.raises(ClientDisconnect):  # Starlette's name for the OSError of a send
                await stream({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
            # on a loop that goes on (as the server's does): the abandoned wait is closed, not cancelled
            await until(lambda: request.request_id in backend.cancelled, 10, "the generation to be cancelled")
            return closed, sent

        closed, sent = asyncio.run(run())
        assert closed == ["slot"] and sent[0] == "http.response.start"
        assert backend.live() == 0
    finally:
        backend.shutdown()


def test_a_head_passing_the_limit_while_still_arriving_gets_431_like_a_whole_one(tmp_path):
    """h11 refuses a head still incomplete past ``max_header_bytes`` ("receive buffer too long"): that is the same
    431, with the same JSON error body, as a whole oversized head gets from the connection cap (not uvicorn's 400),
    whichever way the bytes arrive; the proxy then serves normally."""
    with u.proxy(tmp_path, u.PacedBackend(), limits=LIMITS) as (server, _):
        key = server.open_execution("exec")

        async def dribble() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"b" * (64 * 1024)
            answer = asyncio.ensure_future(reader.read(1 << 16))  # read as it comes: the server closes after it
            try:
                for i in range(0, len(head), 4096):  # never the end of the head: h11 sees it incomplete
                    if answer.done():
                        break
                    writer.write(head[i : i + 4096])
                    await writer.drain()
                    await asyncio.sleep(0.01)
                return await asyncio.wait_for(answer, scaled(20))
            finally:
                writer.close()

        answer = asyncio.run(dribble())
        assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert "over this proxy's limit" in body["error"]["message"]
        after = asyncio.run(u.normal_calls(server.port, key, 1))[0]
        assert after.status == 200 and u.sse_complete("openai", after.body)
