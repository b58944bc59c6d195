"""Proxy streaming benchmark on CPU with the tiny model: does a streamed completion's text leave as it is decoded?

For each API (OpenAI chat, OpenAI completions, Anthropic messages, OpenAI Responses) one client at a time
streams a completion of ``tokens`` tokens through the real stack (``Engine`` + ``ServingLoop`` + ``Router`` +
``ProxyServer``) over HTTP, ``repeats`` times, and the client measures:

  first_delta_s   time from sending the request to the first event carrying text (content, reasoning or
                  thinking text; the role chunk and ``message_start`` carry none)
  total_s         time to the end of the stream
  ratio           first_delta_s / total_s (median over the repeats; bar: <= 0.2; a proxy that sends the text
                  only when the completion is done scores about 1.0)
  gap_ms          median time between two consecutive text events
  ms/token        (last text event - first text event) / (completion tokens - 1): the rate the client is
                  served at, against the serving loop's median decode step time measured from the loop's own
                  step log during the same calls (near 1: the text leaves as fast as it is decoded)

Benchmark-only setting (stated in the table's notes): the proxy's tokenizer is the byte tokenizer with no
end-of-turn ids, so the serving loop never stops at ``<|im_end|>`` and every call runs to the ``tokens`` cap
(the random tiny model would otherwise end early at random). Everything else is the production path. The
model samples random bytes, so the text holds invalid UTF-8 (held back until a character boundary) and
special tokens (``<tool_call>`` holds back the rest of a chat reply's text, which then goes out at the end):
that is why some APIs see fewer text events than tokens.

    python benchmarks/bench_proxy.py                 # the full run (about a minute on 2 cores)
    python benchmarks/bench_proxy.py --smoke         # < 60 s: fewer tokens and repeats, same code paths

Prints a table and writes JSON (``--out``, default ``benchmarks/results/proxy.json``; ``--smoke``:
``proxy_smoke.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

APIS = ("chat", "completions", "messages", "responses")
BAR = 0.2


@dataclass(frozen=True)
class Sizes:
    tokens: int
    repeats: int
    max_seq_len: int


FULL = Sizes(tokens=200, repeats=7, max_seq_len=512)
SMOKE = Sizes(tokens=40, repeats=2, max_seq_len=128)


class NoStopTokenizer:
    """The byte tokenizer without end-of-turn ids (benchmark only): every completion runs to its token cap."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return ()


def request_of(api: str, base: str, key: str, model: str, tokens: int) -> tuple[str, dict, dict]:
    """(url, headers, body) of one streamed call of ``tokens`` tokens on ``api``."""
    auth = {"Authorization": f"Bearer {key}"}
    user = [{"role": "user", "content": "Tell me a long story."}]
    if api == "chat":
        return (
            f"{base}/v1/chat/completions",
            auth,
            {"model": model, "messages": user, "max_tokens": tokens, "stream": True},
        )
    if api == "completions":
        return f"{base}/v1/completions", auth, {"model": model, "prompt": "Once upon a time", "max_tokens": tokens,
                                                "stream": True}  # fmt: skip
    if api == "messages":
        headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
        return f"{base}/v1/messages", headers, {"model": model, "messages": user, "max_tokens": tokens, "stream": True}
    return f"{base}/v1/responses", auth, {"model": model, "input": user, "max_output_tokens": tokens, "stream": True}


def text_of(api: str, payload: dict) -> str:
    """The text an SSE payload carries for the client (content, reasoning or thinking), "" if none."""
    if api == "chat":
        delta = payload["choices"][0]["delta"] if payload.get("choices") else {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    if api == "completions":
        return payload["choices"][0]["text"] if payload.get("choices") else ""
    if api == "messages":
        delta = payload.get("delta", {}) if payload.get("type") == "content_block_delta" else {}
        return delta.get("text") or delta.get("thinking") or ""
    if payload.get("type") in ("response.output_text.delta", "response.reasoning_text.delta"):
        return payload["delta"]
    return ""


def usage_tokens(api: str, payload: dict) -> int | None:
    if api == "chat" or api == "completions":
        return (payload.get("usage") or {}).get("completion_tokens")
    if api == "messages":
        return (payload.get("usage") or {}).get("output_tokens") if payload.get("type") == "message_delta" else None
    if payload.get("type") == "response.completed":
        return payload["response"]["usage"]["output_tokens"]
    return None


def one_call(client, api: str, url: str, headers: dict, body: dict) -> dict:
    """Streams one call with ``client`` (an ``httpx.Client``, its connection kept alive between calls as an SDK
    client's is); the client-side times of each text event, the end, and the completion tokens."""
    if api in ("chat", "completions"):
        body = {**body, "stream_options": {"include_usage": True}}
    times, tokens = [], None
    t0 = time.perf_counter()
    with client.stream("POST", url, json=body, headers=headers, timeout=300) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{api}: HTTP {reply.status_code}: {reply.read()[:300]!r}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if text_of(api, payload):
                times.append(time.perf_counter() - t0)
            tokens = usage_tokens(api, payload) or tokens
    total = time.perf_counter() - t0
    if not times:
        raise RuntimeError(f"{api}: the stream carried no text")
    gaps = [b - a for a, b in zip(times, times[1:])]
    per_token = 1e3 * (times[-1] - times[0]) / (tokens - 1) if tokens and tokens > 1 else None
    return {"first_delta_s": times[0], "total_s": total, "ratio": times[0] / total, "text_events": len(times),
            "gap_median_ms": 1e3 * statistics.median(gaps) if gaps else None, "stream_ms_per_token": per_token,
            "completion_tokens": tokens}  # fmt: skip


def decode_steps_ms(step_log, start: int) -> list[float]:
    """Durations (ms) of the loop iterations since entry ``start`` that decoded without prefilling."""
    return [1e3 * dt for batch, _ctx, prefilled, dt, _end in list(step_log)[start:] if batch >= 1 and prefilled == 0]


def summarize(api: str, runs: list[dict], steps_ms: list[float]) -> dict:
    gap = statistics.median([r["gap_median_ms"] for r in runs if r["gap_median_ms"] is not None])
    per_token = statistics.median([r["stream_ms_per_token"] for r in runs if r["stream_ms_per_token"] is not None])
    step = statistics.median(steps_ms)
    return {
        "api": api,
        "first_delta_s": statistics.median(r["first_delta_s"] for r in runs),
        "total_s": statistics.median(r["total_s"] for r in runs),
        "ratio_median": statistics.median(r["ratio"] for r in runs),
        "text_events_median": statistics.median(r["text_events"] for r in runs),
        "completion_tokens": [r["completion_tokens"] for r in runs],
        "gap_median_ms": gap,
        "stream_ms_per_token": per_token,
        "step_median_ms": step,
        "per_token_vs_step": per_token / step,
        "meets_bar": statistics.median(r["ratio"] for r in runs) <= BAR,
        "runs": runs,
    }


def table(rows: list[dict], sz: Sizes) -> str:
    lines = [f"streamed completions of {sz.tokens} tokens, median of {sz.repeats} (tiny model, CPU)", "",
             f"{'API':<12}{'first delta s':>14}{'total s':>10}{'first/total':>13}{'text events':>13}"
             f"{'gap ms':>9}{'ms/token':>10}{'step ms':>9}{'ms/token / step':>17}"]  # fmt: skip
    for r in rows:
        lines.append(f"{r['api']:<12}{r['first_delta_s']:>14.3f}{r['total_s']:>10.3f}{r['ratio_median']:>13.3f}"
                     f"{r['text_events_median']:>13.0f}{r['gap_median_ms']:>9.2f}{r['stream_ms_per_token']:>10.2f}"
                     f"{r['step_median_ms']:>9.2f}{r['per_token_vs_step']:>17.2f}")  # fmt: skip
    lines += ["", f"bar: first/total <= {BAR}. gap: median time between two text events (about 0 when events",
              "arrive in bursts); ms/token: (last - first text event) / (completion tokens - 1), the rate the client",
              "is served at, against the loop's median decode step (1.0: the stream keeps up with decoding).",
              "Notes: the proxy's tokenizer has no end-of-turn ids (benchmark only), so every call runs to the",
              "token cap; one client at a time (1 decode slot); text events < tokens where random bytes are not",
              "yet a whole character or a sampled <tool_call> holds a chat reply's rest back to the end."]  # fmt: skip
    return "\n".join(lines)


def build_stack(sz: Sizes, seed: int, record_dir: str):
    """Engine + ServingLoop + Router + ProxyServer (started) on the default tiny model; (loop, server)."""
    import jax

    from gyre_jax.config import load_config
    from gyre_jax.model.sharding import init_params, make_mesh
    from gyre_jax.model.tokenizer import ByteTokenizer
    from gyre_jax.proxy.records import RecordStore
    from gyre_jax.proxy.router import Router
    from gyre_jax.proxy.server import ProxyServer
    from gyre_jax.serving.engine import Engine
    from gyre_jax.serving.loop import ServingLoop

    config = load_config([])
    cfg = config.model_config()
    rules = tuple((k, v) for k, v in config.sharding_rules)
    mesh = make_mesh(jax.devices()[:1], dict(data=1))
    graphdef, params = init_params(cfg, mesh, rules, seed=seed)
    engine = Engine(cfg, graphdef, mesh, rules, max_concurrent_decodes=1, max_seq_len=sz.max_seq_len,
                    max_prefill_length=sz.max_seq_len, prefill_buckets=(64, sz.max_seq_len))  # fmt: skip
    engine.warmup(params)
    tokenizer = NoStopTokenizer(ByteTokenizer())
    loop = ServingLoop(engine, params, name="cell0", detokenize=tokenizer.decode).start()
    server = ProxyServer(Router({"cell0": loop}), tokenizer, RecordStore(record_dir), max_tokens_cap=sz.tokens,
                         seed=seed).start()  # fmt: skip
    return loop, server


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="fewer tokens and repeats: the code paths in < 60 s")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/proxy[_smoke].json)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import tempfile

    import httpx
    import jax

    sz = SMOKE if args.smoke else FULL
    t_start, load_start = time.perf_counter(), [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as record_dir:
        loop, server = build_stack(sz, args.seed, record_dir)
        base = server.anthropic_base_url
        rows = []
        try:
            with httpx.Client() as client:
                for api in APIS:
                    key = server.open_execution(f"bench-{api}")
                    url, headers, body = request_of(api, base, key, server.model_name, sz.tokens)
                    one_call(client, api, url, headers, body)  # warm-up: compiles what this prompt shape needs
                    start = len(loop.step_log)
                    runs = [one_call(client, api, url, headers, body) for _ in range(sz.repeats)]
                    rows.append(summarize(api, runs, decode_steps_ms(loop.step_log, start)))
        finally:
            server.stop()
            loop.stop()
    report = {"benchmark": "proxy", "smoke": args.smoke, "platform": jax.default_backend(),
              "python": platform.python_version(), "jax": jax.__version__, "sizes": sz.__dict__, "bar": BAR,
              "benchmark_only": "proxy tokenizer without end-of-turn ids: every call runs to the token cap",
              "results": rows, "wall_s": round(time.perf_counter() - t_start, 1), "load_avg_start": load_start,
              "load_avg_end": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip
    out = Path(args.out or REPO / "benchmarks" / "results" / ("proxy_smoke.json" if args.smoke else "proxy.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(rows, sz))
    print(f"\nwrote {out} ({report['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
