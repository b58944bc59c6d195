"""Helpers of the overload part (tests/faults/test_overload.py, benchmarks/faults/overload.py): a paced backend
that streams tokens the way a serving loop does, raw-socket HTTP clients (a normal streaming call, a reader
that never reads, a slowloris sender, oversized headers) and the storm of concurrent streaming clients.

Everything is loopback only. Clients are raw asyncio sockets so hundreds of them cost little memory and CPU in
the measuring process; the proxy runs in the same process (its RSS is the process's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.serving.types import GenerationRequest, GenerationResult, TokenChunk

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a benchmark loads this file by its path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timelimits import scaled  # noqa: E402  (tests/timelimits.py: hang guards scaled to the machine's load)

BYTES = ByteTokenizer()
IM_END = BYTES.token_id("<|im_end|>")
ENDLESS = "ENDLESS"  # a prompt containing it is answered with text until its max_tokens (or a cancel)
HOLD = "HOLD"  # a prompt containing it makes no token until ``PacedBackend.hold`` is cleared
REPLY = "the quick brown fox jumps over the lazy dog. "


@dataclass
class _Live:
    request: GenerationRequest
    future: concurrent.futures.Future
    ids: list[int]
    endless: bool
    held: bool
    out: list[int] = field(default_factory=list)


class PacedBackend:
    """A ``GenerationBackend`` stepped like a serving loop: one thread gives every live request
    ``tokens_per_tick`` tokens each ``tick_s`` and tells its listener. A reply is ``REPLY`` + <|im_end|>; a
    prompt with ``ENDLESS`` gets ``REPLY`` repeated up to its max_tokens; one with ``HOLD`` waits while
    ``hold`` is set. ``cancelled`` holds the ids of requests cancelled while live; ``peak_live`` the most live
    at once."""

    def __init__(self, tick_s: float = 0.002, tokens_per_tick: int = 8, max_context: int = 1 << 24) -> None:
        self.tick_s = tick_s
        self.tokens_per_tick = tokens_per_tick
        self.max_context = max_context
        self.hold = threading.Event()
        self.hold.set()
        self.cancelled: set[str] = set()
        self.endless_ids: list[str] = []  # requests whose prompt asked for ENDLESS, in submission order
        self.submitted = 0
        self.peak_live = 0
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="paced-backend", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        prompt = BYTES.decode(request.prompt_ids)
        endless = ENDLESS in prompt
        ids = BYTES.encode(REPLY) + ([] if endless else [IM_END])
        live = _Live(request, concurrent.futures.Future(), ids, endless, HOLD in prompt)
        with self._lock:
            self._live[request.request_id] = live
            self.submitted += 1
            if endless:
                self.endless_ids.append(request.request_id)
            self.peak_live = max(self.peak_live, len(self._live))
        return live.future

    def cancel(self, request_id: str) -> None:
        with self._lock:
            live = self._live.pop(request_id, None)
            if live is not None:
                self.cancelled.add(request_id)
        if live is not None:
            live.future.set_result(self._result(live, "cancelled"))

    def live(self) -> int:
        with self._lock:
            return len(self._live)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            with self._lock:
                lives = [live for live in self._live.values() if not (live.held and self.hold.is_set())]
            for live in lives:
                self._step(live)

    def _step(self, live: _Live) -> None:
        start, budget = len(live.out), live.request.sampling.max_tokens
        n = min(self.tokens_per_tick, budget - start)
        new = [live.ids[(start + k) % len(live.ids)] for k in range(n)] if live.endless else live.ids[start : start + n]
        live.out.extend(new)
        with self._lock:
            if live.request.request_id not in self._live:
                return  # cancelled meanwhile
            if live.request.on_tokens is not None and new:
                k = len(new)
                live.request.on_tokens(TokenChunk(live.request.request_id, start, tuple(new), (-0.5,) * k, (0,) * k))
            done = (new and new[-1] == IM_END) or len(live.out) >= budget
            if done:
                del self._live[live.request.request_id]
        if done:
            live.future.set_result(self._result(live, "stop" if live.out[-1] == IM_END else "length"))

    @staticmethod
    def _result(live: _Live, reason: str) -> GenerationResult:
        out = list(live.out)
        return GenerationResult(live.request.request_id, out, [-0.5] * len(out), [0] * len(out), reason,
                                len(live.request.prompt_ids), stop_reason=IM_END if reason == "stop" else None)  # fmt: skip


@contextlib.contextmanager
def proxy(workdir: Path, backend: PacedBackend | None = None, **kwargs) -> Iterator[tuple[ProxyServer, PacedBackend]]:
    """A started ProxyServer (``kwargs``) over ``backend`` (a fresh PacedBackend if None), byte tokenizer."""
    backend = backend or PacedBackend()
    store = RecordStore(workdir / f"records-{time.monotonic_ns()}")
    try:
        with ProxyServer(backend, BYTES, store, model_name="gyre-tiny", **kwargs) as server:
            yield server, backend
    finally:
        backend.shutdown()


# -- raw HTTP clients ----------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a client got: the HTTP status (0: no response, ``error`` says why), headers (lower-case), the
    de-chunked body, seconds from connect to the end."""

    status: int
    headers: dict[str, str]
    body: bytes
    latency_s: float
    error: str = ""


def request_bytes(path: str, key: str, body: dict, api: str) -> bytes:
    """A whole HTTP/1.1 POST of ``body`` as JSON, with the API's auth header and ``Connection: close``."""
    payload = json.dumps(body).encode()
    auth = (
        f"x-api-key: {key}\r\nanthropic-version: 2023-06-01" if api == "anthropic" else f"Authorization: Bearer {key}"
    )
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + payload


def streaming_call(key: str, api: str, prompt: str = "hi", max_tokens: int = 64) -> bytes:
    """A streamed model call's request: OpenAI chat completions or Anthropic messages."""
    messages = [{"role": "user", "content": prompt}]
    body = {"model": "gyre-tiny", "messages": messages, "max_tokens": max_tokens, "stream": True}
    return request_bytes("/v1/messages" if api == "anthropic" else "/v1/chat/completions", key, body, api)


async def exchange(port: int, data: bytes, timeout_s: float = 60.0, rcvbuf: int | None = None) -> Outcome:
    """Sends ``data`` and reads the response to its end (the server closes: ``Connection: close``)."""
    t0 = time.monotonic()
    writer = None
    try:
        async with asyncio.timeout(scaled(timeout_s)):  # a hang guard: the outcome says if it ran out
            sock = socket.socket()
            if rcvbuf is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
            writer.write(data)
            await writer.drain()
            raw = await reader.read(-1)
    except (OSError, TimeoutError) as exc:
        return Outcome(0, {}, b"", time.monotonic() - t0, f"{type(exc).__name__}: {exc}")
    finally:
        if writer is not None:
            writer.close()
    return parse_response(raw, time.monotonic() - t0)


def parse_response(raw: bytes, latency_s: float) -> Outcome:
    """An HTTP/1.1 response's status, headers and body (de-chunked)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return Outcome(0, {}, raw, latency_s, f"no complete response head in {len(raw)} bytes")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    return Outcome(status, headers, body, latency_s)


def dechunk(body: bytes) -> bytes:
    out, rest = bytearray(), body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2 :]
    return bytes(out)


def sse_complete(api: str, body: bytes) -> bool:
    """Whether ``body`` is a whole, successful SSE stream: OpenAI ends with ``data: [DONE]``, Anthropic with
    ``message_stop``; neither has an error event; the text deltas make ``REPLY``."""
    events = [e for e in body.decode().split("\n\n") if e.strip() and not e.startswith(":")]
    if api == "anthropic":
        if not events or not events[-1].startswith("event: message_stop") or any("event: error" in e for e in events):
            return False
        data = [json.loads(e.split("data: ", 1)[1]) for e in events]
        text = "".join(d["delta"].get("text", "") for d in data if d.get("type") == "content_block_delta")
        return text == REPLY
    if not events or events[-1] != "data: [DONE]":
        return False
    data = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    if any("error" in d for d in data):
        return False
    return "".join(c["delta"].get("content") or "" for d in data for c in d["choices"]) == REPLY


def refused_properly(outcome: Outcome) -> bool:
    """A 429 or 503 with a whole-seconds ``Retry-After`` and a JSON error body."""
    if outcome.status not in (429, 503) or not outcome.headers.get("retry-after", "").isdigit():
        return False
    return "error" in json.loads(outcome.body)


async def never_reads(port: int, data: bytes) -> socket.socket:
    """Connects with a tiny receive buffer, sends ``data`` and returns the socket, never reading from it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, data)
    return sock


async def slowloris(port: int, interval_s: float, limit_s: float) -> tuple[bytes, float]:
    """Sends a request head one byte per ``interval_s``, never finishing it; what the server answered before
    closing, and when (seconds; ``limit_s`` if it never closed)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10_000
    got = b""
    try:
        for byte in head:
            writer.write(bytes([byte]))
            with contextlib.suppress(TimeoutError):
                got += await asyncio.wait_for(reader.read(4096), interval_s)
            if reader.at_eof() or time.monotonic() - t0 > limit_s:
                break
    except OSError:
        pass
    finally:
        writer.close()
    return got, time.monotonic() - t0


def oversized_headers(key: str, header_bytes: int) -> bytes:
    """A model call with one header of ``header_bytes`` bytes."""
    request = streaming_call(key, "openai")
    return request.replace(b"Connection: close\r\n", b"Connection: close\r\nX-Big: " + b"b" * header_bytes + b"\r\n")


# -- the storm -----------------------------------------------------------------------------------------------------


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


@dataclass
class Storm:
    """A storm's outcomes, each with its API; RSS sampled during it."""

    outcomes: list[tuple[str, Outcome]]
    rss_peak: int

    def counts(self) -> dict[str, int]:
        """Outcomes by kind: ``ok`` (a whole SSE stream), ``refused_429`` / ``refused_503`` (with Retry-After),
        ``bad`` (anything else)."""
        counts = {"ok": 0, "refused_429": 0, "refused_503": 0, "bad": 0}
        for api, outcome in self.outcomes:
            if outcome.status == 200 and sse_complete(api, outcome.body):
                counts["ok"] += 1
            elif refused_properly(outcome):
                counts[f"refused_{outcome.status}"] += 1
            else:
                counts["bad"] += 1
        return counts

    def bad(self) -> list[Outcome]:
        return [o for api, o in self.outcomes if not (o.status == 200 and sse_complete(api, o.body))
                and not refused_properly(o)]  # fmt: skip

    def latencies(self) -> dict[str, float]:
        """p50 / p99 / max seconds of the completed calls."""
        done = sorted(o.latency_s for api, o in self.outcomes if o.status == 200)
        if not done:
            return {}
        p99 = done[min(len(done) - 1, int(0.99 * len(done)))]
        return {"p50_s": statistics.median(done), "p99_s": p99, "max_s": done[-1], "completed": len(done)}


async def storm(port: int, keys: list[str], clients: int, timeout_s: float = 60.0) -> Storm:
    """``clients`` streamed calls at once (alternately OpenAI and Anthropic), each on its own connection."""
    peak = rss_bytes()
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_bytes())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.05)

    sampler = asyncio.ensure_future(sample())
    apis = ["openai" if i % 2 == 0 else "anthropic" for i in range(clients)]
    calls = [exchange(port, streaming_call(keys[i % len(keys)], api), timeout_s) for i, api in enumerate(apis)]
    outcomes = await asyncio.gather(*calls)
    done.set()
    await sampler
    return Storm(list(zip(apis, outcomes)), max(peak, rss_bytes()))


async def normal_calls(port: int, key: str, count: int, timeout_s: float = 30.0) -> list[Outcome]:
    """``count`` streamed OpenAI calls one after another."""
    return [await exchange(port, streaming_call(key, "openai"), timeout_s) for _ in range(count)]


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    timeout_s = scaled(timeout_s)
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)
