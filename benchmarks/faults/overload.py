"""Overload and slow clients on one proxy (issue 19 item 4): the long version of tests/faults/test_overload.py.

``run(quick, seed, workdir)`` starts a real ProxyServer (loopback) over a paced backend that streams tokens like
a serving loop, and injects: a storm of concurrent streaming clients (256 quick, 1024 long; OpenAI and Anthropic
alternately) on bounded admission, a reader that never reads, slowloris senders (head and body), oversized
headers, queued clients that leave, and the real ``openai`` SDK retrying a 429. Each fault is one row (see
benchmarks/faults/ in docs/reliability.md); ``extra`` has refusal counts by code, p50/p99 latency of the
completed calls and the process's RSS before, during (peak) and after each storm.

Run through ``python benchmarks/bench_faults.py --case overload`` (the integrator's dispatcher).
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import sys
import threading
import time
from pathlib import Path

_UTIL = Path(__file__).resolve().parents[2] / "tests" / "faults" / "_overload_util.py"
COMMAND = "python benchmarks/bench_faults.py --case overload"
MIB = 1 << 20
STORM_MAX_REQUESTS = 512


def _util():
    if "_overload_util" not in sys.modules:
        spec = importlib.util.spec_from_file_location("_overload_util", _UTIL)
        module = importlib.util.module_from_spec(spec)
        sys.modules["_overload_util"] = module
        spec.loader.exec_module(module)
    return sys.modules["_overload_util"]


def _row(fault: str, injected: int, lost: int, ok: bool, printed: str, double: int = 0, needs: str = "") -> dict:
    return {"fault": fault, "injected": injected, "lost": lost, "double_counted": double,
            "outcome": "ok" if ok else "fails", "printed": printed, "command": COMMAND, "needs": needs}  # fmt: skip


def _limits(header_timeout_s: float = 2.0, max_requests: int = 512):
    """Short timeouts so the slow-client rows take seconds. The storm passes a long header timeout: its clients
    share this process (and its GIL) with the proxy, and on a loaded machine one may take seconds between its
    connect and its request head, which a 2 s header timeout would rightly close (seen: 361 of 3072 at 1024
    clients while other work ran)."""
    from gyre_jax.proxy.connections import ConnectionLimits

    return ConnectionLimits(max_requests=max_requests, header_timeout_s=header_timeout_s, body_timeout_s=2.0,
                            write_timeout_s=2.0, keep_alive_s=1)  # fmt: skip


def storm_row(workdir: Path, clients: int, rounds: int) -> tuple[dict, dict]:
    """``rounds`` storms of ``clients`` streaming calls on 32 slots + 128 queue places, and a cap of
    STORM_MAX_REQUESTS requests in progress (refusals by 429 answer fast, so the cap is rarely reached here;
    ``cap_row`` shows it).

    lost: calls that got neither a whole stream nor a proper refusal, or completed without a record;
    double_counted: records beyond the completed calls."""
    u = _util()
    with u.proxy(workdir, u.PacedBackend(tick_s=0.002, tokens_per_tick=4), max_active_calls=32, max_queued_calls=128,
                 limits=_limits(header_timeout_s=30.0, max_requests=STORM_MAX_REQUESTS)) as (server, backend):  # fmt: skip
        ids = [f"exec-{i}" for i in range(64)]
        keys = [server.open_execution(i) for i in ids]
        asyncio.run(u.normal_calls(server.port, keys[0], 3))  # warm up: the first calls import and allocate
        base_records = sum(server.execution_calls(i) for i in ids)
        rss_before = u.rss_bytes()
        storms, rss_rounds = [], []
        for _ in range(rounds):  # RSS after each round: it levels off (nothing a call leaves behind accumulates)
            storms.append(asyncio.run(u.storm(server.port, keys, clients)))
            rss_rounds.append(u.rss_bytes() / MIB)
        after = asyncio.run(u.normal_calls(server.port, keys[0], 1))[0]
        time.sleep(0.5)
        rss_after = u.rss_bytes()
        records = sum(server.execution_calls(i) for i in ids) - base_records - 1
        stats = server.admission_stats()
    counts = {k: sum(s.counts()[k] for s in storms) for k in storms[0].counts()}
    latencies = [o.latency_s for s in storms for _, o in s.outcomes if o.status == 200]
    merged = u.Storm([x for s in storms for x in s.outcomes], max(s.rss_peak for s in storms)).latencies()
    lost = counts["bad"] + max(0, counts["ok"] - records)
    double = max(0, records - counts["ok"])
    ok = lost == 0 and double == 0 and after.status == 200 and backend.peak_live <= 32
    printed = (f"{counts['ok']} streams complete, {counts['refused_429']} x 429, {counts['refused_503']} x 503 (all with "
               f"Retry-After), {counts['bad']} other; p50 {merged.get('p50_s', 0):.2f} s p99 {merged.get('p99_s', 0):.2f}"
               f" s; next call {after.status}")  # fmt: skip
    extra = {"clients": clients, "rounds": rounds, "counts": counts, "latency": merged, "completed": len(latencies),
             "rss_mib": {"before": rss_before / MIB, "peak_during": max(s.rss_peak for s in storms) / MIB,
                         "after": rss_after / MIB, "after_each_round": rss_rounds}, "peak_generations": backend.peak_live, "admission": stats,
             "limits": {"max_active_calls": 32, "max_queued_calls": 128, "max_requests": STORM_MAX_REQUESTS}}  # fmt: skip
    return _row(f"overload: {clients} streaming clients x {rounds}", clients * rounds, lost, ok, printed, double), extra


def slow_rows(workdir: Path, slowloris: int) -> tuple[list[dict], dict]:
    """A non-reader, ``slowloris`` head and body senders and oversized heads at once, with normal calls meanwhile."""
    u = _util()
    backend = u.PacedBackend(tokens_per_tick=4096)
    with u.proxy(workdir, backend, max_active_calls=4, max_queued_calls=16, limits=_limits()) as (server, _):
        key = server.open_execution("exec")
        got = asyncio.run(_slow_clients(u, server, backend, key, slowloris))
        after = asyncio.run(u.normal_calls(server.port, key, 1))[0]
    normal_lost = sum(not (o.status == 200 and u.sse_complete("openai", o.body)) for o in got["normal"])
    normal_ok = normal_lost == 0  # "lost" below: normal calls that failed (an abusive client's refusal is not)
    normal_max = max(o.latency_s for o in got["normal"])
    served = f"; {len(got['normal'])} normal calls meanwhile, slowest {normal_max:.2f} s; next call {after.status}"
    heads = [a for a, _ in got["heads"]]
    late_heads = sum(not a.startswith(b"HTTP/1.1 408") for a in heads)
    late_bodies = sum(not a.startswith(b"HTTP/1.1 408") for a in got["bodies"])
    cancelled = got["freed_s"] is not None
    rows = [
        _row("overload: client never reads its stream", 1, normal_lost, cancelled and normal_ok,
             f"write timeout 2 s: stream aborted, generation cancelled, slot freed after {got['freed_s'] or -1:.1f} s"
             + served),
        _row("overload: slowloris request heads", slowloris, normal_lost, late_heads == 0 and normal_ok,
             f"{len(heads) - late_heads}/{len(heads)} got 408 after {max(s for _, s in got['heads']):.1f} s (header "
             "timeout 2 s)" + served),
        _row("overload: slowloris request bodies", slowloris, normal_lost, late_bodies == 0 and normal_ok,
             f"{len(got['bodies']) - late_bodies}/{len(got['bodies'])} got 408 (body timeout 2 s)" + served),
        _row("overload: oversized request heads (64 KiB)", slowloris, normal_lost,
             all(o.status == 431 for o in got["big"]) and normal_ok,
             f"{sum(o.status == 431 for o in got['big'])}/{len(got['big'])} got 431" + served),
    ]  # fmt: skip
    extra = {"normal_latency_max_s": normal_max, "never_reader_freed_after_s": got["freed_s"],
             "slowloris_408_after_s": [s for _, s in got["heads"]]}  # fmt: skip
    return rows, extra


async def _slow_clients(u, server, backend, key: str, count: int) -> dict:
    async def body_slowloris() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(u.streaming_call(key, "openai")[:-20])
        try:
            return await asyncio.wait_for(reader.read(-1), 30)
        finally:
            writer.close()

    t0 = time.monotonic()
    stuck = await u.never_reads(server.port, u.streaming_call(key, "openai", u.ENDLESS, max_tokens=50_000_000))
    heads = [asyncio.ensure_future(u.slowloris(server.port, 0.1, 30)) for _ in range(count)]
    bodies = [asyncio.ensure_future(body_slowloris()) for _ in range(count)]
    big = await asyncio.gather(*(u.exchange(server.port, u.oversized_headers(key, 64 * 1024)) for _ in range(count)))
    normal = await u.normal_calls(server.port, key, 10, timeout_s=30)
    freed_s = None
    while time.monotonic() - t0 < 30:
        if backend.endless_ids and backend.endless_ids[0] in backend.cancelled:
            if server.admission_stats()["active"] == 0:
                freed_s = time.monotonic() - t0
                break
        await asyncio.sleep(0.02)
    stuck.close()
    return {"heads": await asyncio.gather(*heads), "bodies": await asyncio.gather(*bodies), "big": big,
            "normal": normal, "freed_s": freed_s}  # fmt: skip


def cap_row(workdir: Path, cap: int, extra: int) -> dict:
    """``cap`` held calls fill the request cap; ``extra`` more at once each get 503 + Retry-After at once."""
    u = _util()
    limits = _limits(header_timeout_s=30.0, max_requests=cap)
    with u.proxy(workdir, max_active_calls=cap // 2, max_queued_calls=cap, limits=limits) as (server, backend):
        key = server.open_execution("exec")

        async def run() -> tuple[list, list]:
            held = asyncio.gather(
                *(u.exchange(server.port, u.streaming_call(key, "openai", u.HOLD)) for _ in range(cap))
            )
            while server.admission_stats()["active"] + server.admission_stats()["waiting"] < cap:
                await asyncio.sleep(0.02)
            over = await asyncio.gather(*(u.exchange(server.port, u.streaming_call(key, api))
                                          for api in ["openai", "anthropic"] * (extra // 2)))  # fmt: skip
            backend.hold.clear()
            return await held, over

        held, over = asyncio.run(run())
    refused = sum(u.refused_properly(o) and o.status == 503 for o in over)
    done = sum(o.status == 200 and u.sse_complete("openai", o.body) for o in held)
    ok = refused == len(over) and done == cap
    return _row("overload: requests over the cap (max_requests)", len(over), len(over) - refused + cap - done, ok,
                f"{refused}/{len(over)} got 503 + Retry-After at once; the {done}/{cap} held calls then completed")  # fmt: skip


def queue_leave_row(workdir: Path, leavers: int) -> dict:
    """``leavers`` queued clients disconnect while one held call has the only slot: each leaves the queue."""
    u = _util()
    with u.proxy(workdir, max_active_calls=1, max_queued_calls=leavers, limits=_limits()) as (server, backend):
        key = server.open_execution("exec")

        async def run() -> int:
            held = asyncio.ensure_future(u.exchange(server.port, u.streaming_call(key, "openai", u.HOLD)))
            while server.admission_stats()["active"] != 1:
                await asyncio.sleep(0.02)
            conns = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(leavers)]
            for _, writer in conns:
                writer.write(u.streaming_call(key, "openai"))
            while server.admission_stats()["waiting"] != leavers:
                await asyncio.sleep(0.02)
            for _, writer in conns:
                writer.close()
            deadline = time.monotonic() + 30
            while server.admission_stats()["waiting"] and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            backend.hold.clear()
            return (await held).status

        status = asyncio.run(run())
        stats = server.admission_stats()
        ran = backend.submitted
    ok = stats["left_queue"] == leavers and ran == 1 and status == 200
    return _row("overload: queued clients disconnect", leavers, leavers - stats["left_queue"], ok,
                f"{stats['left_queue']}/{leavers} left the queue, none run; the held call then {status}")  # fmt: skip


def sdk_retry_row(workdir: Path) -> dict:
    """The real ``openai`` SDK gets 429 + Retry-After while the only slot is held, retries and succeeds."""
    import openai

    u = _util()
    with u.proxy(workdir, max_active_calls=1, max_queued_calls=0, limits=_limits()) as (server, backend):
        key = server.open_execution("exec")
        held = threading.Thread(
            target=lambda: asyncio.run(u.exchange(server.port, u.streaming_call(key, "openai", u.HOLD)))
        )
        held.start()
        u.wait_until(lambda: server.admission_stats()["active"] == 1, 30, "the held call")
        reply: list[str] = []
        client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=5)
        caller = threading.Thread(
            target=lambda: reply.append(
                client.chat.completions.create(
                    model="gyre-tiny", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
                )
                .choices[0]
                .message.content
            )
        )
        caller.start()
        u.wait_until(lambda: server.admission_stats()["refused"] >= 1, 30, "a 429")
        backend.hold.clear()
        caller.join(60)
        held.join(30)
        refused = server.admission_stats()["refused"]
    ok = reply == [u.REPLY]
    return _row("overload: openai SDK retries a 429", refused, 0 if ok else 1, ok,
                f"{refused} x 429 with Retry-After: 1, then the SDK's retry got {'the reply' if ok else reply}")  # fmt: skip


def run(quick: bool, seed: int, workdir: Path) -> dict:
    """Rows per fault and the storm figures; ``quick``: 256 clients once (seconds), else 1024 clients x 3."""
    random.seed(seed)  # nothing here is random; the seed is accepted for the dispatcher's uniform call
    workdir.mkdir(parents=True, exist_ok=True)
    clients, rounds, slow = (256, 1, 20) if quick else (1024, 3, 200)
    storm, storm_extra = storm_row(workdir, clients, rounds)
    slow_rows_, slow_extra = slow_rows(workdir, slow)
    rows = [storm, cap_row(workdir, 16, 64 if quick else 512), *slow_rows_,
            queue_leave_row(workdir, 8 if quick else 64), sdk_retry_row(workdir)]  # fmt: skip
    return {"rows": rows, "extra": {"storm": storm_extra, "slow_clients": slow_extra}}


if __name__ == "__main__":
    import json
    import tempfile

    quick = "--long" not in sys.argv
    with tempfile.TemporaryDirectory() as tmp:
        out = run(quick, 0, Path(tmp))
    for row in out["rows"]:
        print(f"{row['outcome']:5} {row['fault']}: {row['printed']}")
    print(json.dumps(out["extra"], indent=1))
