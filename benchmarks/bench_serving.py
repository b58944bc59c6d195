"""Serving benchmarks on CPU with the tiny model: continuous batching, loop overhead, session prefix cache,
chunked prefill. Every result is a ratio against a baseline measured in the same run (the machine is
shared and noisy; absolute times are printed for context only).

  throughput    generated tokens/s of ``ServingLoop`` with 1, 8 and 32 concurrent sessions (closed loop:
                each session sends its next request when the last one returns) vs a naive loop serving
                one request at a time (prefill, insert, then generate steps on a 1-slot engine)
  overhead      ``ServingLoop`` wall time per generate step with every slot decoding vs back-to-back raw
                jitted decode steps (``DenseSlots.generate_program``, no host work); target: within 15%
  prefix_cache  prefill tokens of a 20-turn agent session (each prompt = previous prompt + completion +
                new tokens) / its final context length, with the session prefix cache and without it
  chunked       longest pause between two decode steps of running sessions while a long prompt is
                prefilled, chunked (``prefill_chunk``) vs in one prefill call
  burst         seconds until every request of a burst at an idle cell has its first token, whole prompts
                prefilled together in one program vs one prompt per prefill call, on the dense engine and on
                the paged one (``PagedEngine``, ``serving.kv_layout="paged"``)

    python benchmarks/bench_serving.py              # the full run (a few minutes on 2 cores)
    python benchmarks/bench_serving.py --smoke      # seconds-scale sizes, same code paths (for tests)

``--smoke`` skips the engines' full ``warmup()`` (every shape; most of a smoke run's time, and what
tests/serving/test_warmup.py covers): shapes the smoke uses compile at first use, inside its timings.

Each comparison runs both sides back to back, ``repeats`` times; the table shows the ratio of the best run of
each side (the least disturbed by other jobs on a shared machine) and the median of the paired ratios; the JSON
keeps every run. Prints a table and writes JSON (``--out``, default ``benchmarks/results/serving.json``; ``--smoke``:
``serving_smoke.json``). Runs on a ``--cell-devices``-device cell (default 1: on a 2-core CPU virtual
devices add no compute, and a 1-slot baseline on 4 devices would be replicated 4 times).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Sizes:
    slots: int
    max_seq_len: int
    buckets: tuple[int, ...]
    concurrency: tuple[int, ...]
    requests_per_session: int
    prompt_len: tuple[int, int]  # uniform range for throughput prompts
    max_tokens: int  # per throughput request
    naive_requests: int
    overhead_steps: int
    repeats: int
    turns: int
    first_prompt: int
    turn_new_tokens: int
    turn_completion: int
    long_prompt: int
    chunk: int
    background_sessions: int
    decode_steps: int  # the multi-step loop's steps per generate program


FULL = Sizes(
    slots=32,
    max_seq_len=1024,
    buckets=(128, 256, 512, 1024),
    concurrency=(1, 8, 32),
    requests_per_session=2,
    prompt_len=(32, 128),
    max_tokens=64,
    naive_requests=8,
    overhead_steps=150,
    repeats=5,
    turns=20,
    first_prompt=96,
    turn_new_tokens=24,
    turn_completion=16,
    long_prompt=900,
    chunk=128,
    background_sessions=8,
    decode_steps=8,
)
SMOKE = Sizes(
    slots=4,
    max_seq_len=128,
    buckets=(64,),
    concurrency=(1, 4),
    requests_per_session=1,
    prompt_len=(8, 24),
    max_tokens=8,
    naive_requests=2,
    overhead_steps=10,
    repeats=1,
    turns=5,
    first_prompt=16,
    turn_new_tokens=6,
    turn_completion=6,
    long_prompt=100,
    chunk=32,
    background_sessions=2,
    decode_steps=4,
)


def _setup_devices(n: int) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
        ).strip()


# ------------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the code paths in seconds")
    ap.add_argument(
        "--cell-devices", type=int, default=1, help="devices in the serving cell (slots are split over them)"
    )
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serving[_smoke].json)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    _setup_devices(max(8, args.cell_devices))

    import jax
    import numpy as np

    from gyre_jax.config import load_config
    from gyre_jax.model.sharding import init_params, make_mesh
    from gyre_jax.serving.engine import Engine
    from gyre_jax.serving.loop import ServingLoop
    from gyre_jax.serving.paged import PagedEngine
    from gyre_jax.serving.sampling import key_for_seed
    from gyre_jax.serving.types import GenerationRequest, SamplingParams

    sz = SMOKE if args.smoke else FULL
    # smoke: one layer (less to compile per program: the warm-up is most of a smoke run; same code paths)
    config = load_config(["--config.model.num_layers=1"] if args.smoke else [])
    cfg = config.model_config()
    rules = tuple((k, v) for k, v in config.sharding_rules)
    mesh = make_mesh(jax.devices()[: args.cell_devices], dict(data=args.cell_devices))
    graphdef, params = init_params(cfg, mesh, rules, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    vocab = 256  # byte tokens: ids any prompt could hold

    def make_engine(slots: int, max_prefill: int, decode_steps: int = 1) -> Engine:
        return Engine(
            cfg,
            graphdef,
            mesh,
            rules,
            max_concurrent_decodes=slots,
            max_seq_len=sz.max_seq_len,
            max_prefill_length=max_prefill,
            prefill_buckets=sz.buckets,
            decode_steps=decode_steps,
        )

    engine = make_engine(sz.slots, sz.max_seq_len)
    engine_multi = make_engine(sz.slots, sz.max_seq_len, sz.decode_steps)
    engine1 = make_engine(1, sz.max_seq_len)
    page = 16  # the paged layout (``serving.kv_layout="paged"``) with the dense engine's capacity: the burst rows
    paged = PagedEngine(cfg, graphdef, mesh, rules, max_concurrent_decodes=sz.slots, page_size=page,
                        num_pages=sz.slots * sz.max_seq_len // page, max_pages_per_slot=sz.max_seq_len // page,
                        max_prefill_length=sz.max_seq_len, prefill_buckets=sz.buckets)  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=sz.max_tokens)

    def prompt(n: int) -> list[int]:
        return rng.integers(0, vocab, size=n).tolist()

    def load() -> list[float]:
        return [round(x, 2) for x in os.getloadavg()]

    report: dict = {
        "benchmark": "serving",
        "smoke": args.smoke,
        "platform": jax.default_backend(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "cell_devices": args.cell_devices,
        "model": {"layers": cfg.num_layers, "embed": cfg.embed_dim, "params": cfg.num_params},
        "sizes": sz.__dict__,
        "load_avg_start": load(),
    }

    # -- warm-up: compile every shape the measurements use, so no compile is timed ---------------------------
    t_warm = time.perf_counter()
    for b in sz.buckets:
        for eng in (engine, engine1):
            eng.dense.prefill(
                params=params, tokens=prompt(min(b, sz.max_seq_len - 1)), sampling_params=greedy, key=key_for_seed(0)
            )
    warm_loop = ServingLoop(engine, params, name="warm", prefill_chunk=sz.chunk).start()
    warm_sessions = [GenerationRequest(prompt_ids=prompt(sz.first_prompt), sampling=greedy, session_id="warm")]
    for req in warm_sessions + [GenerationRequest(prompt_ids=prompt(sz.long_prompt), sampling=greedy)]:
        r = warm_loop.submit(req).result()
        nxt = req.prompt_ids + r.token_ids + prompt(3)
        warm_loop.submit(GenerationRequest(prompt_ids=nxt, sampling=greedy, session_id=req.session_id)).result()
    warm_loop.stop()
    for eng in (engine, engine1, engine_multi) if not args.smoke else ():  # smoke: compiled at first use
        eng.warmup(params)
    # the paged engine: only the burst's shapes, by bursts like the measured ones (its whole warmup(), ~110 shapes
    # at these sizes, would take this process past the kernel's 65,530 memory maps beside the dense engines':
    # XLA:CPU maps ~200 regions per compiled program of this model)
    warm_rng = np.random.default_rng(args.seed + 1)
    for _ in range(3 if not args.smoke else 0):
        for together in (True, False):
            burst = [warm_rng.integers(0, vocab, size=int(warm_rng.integers(*sz.prompt_len))).tolist() for _ in
                     range(sz.slots)]  # fmt: skip
            burst_start(ServingLoop, paged, params, burst, GenerationRequest, SamplingParams, together)
    naive_generate(engine1.dense, params, [prompt(20)], greedy)
    for together in (True, False):  # the burst's shapes: all slots' prompts in one program, and one at a time
        burst_start(ServingLoop, engine, params, [prompt(sz.prompt_len[1] - 1)] * sz.slots, GenerationRequest,
                    SamplingParams, together)  # fmt: skip
    report["warmup_s"] = round(time.perf_counter() - t_warm, 1)

    # -- throughput (each repeat runs the naive baseline, the loop and the multi-step loop back to back; ratios
    # per pair). The multi-step loop: the same loop on an engine with decode_steps > 1 (one program per
    # decode_steps tokens while every slot decodes and nothing waits to join) --------------------------------
    tput: dict = {
        "max_tokens": sz.max_tokens, "prompt_len": list(sz.prompt_len), "slots": sz.slots,
        "decode_steps": sz.decode_steps,
    }  # fmt: skip
    rows = []
    for c in sz.concurrency:
        loop = ServingLoop(engine, params, name=f"c{c}", kv_pages=0).start()
        loop_multi = ServingLoop(engine_multi, params, name=f"m{c}", kv_pages=0).start()
        naive, looped, multi = [], [], []
        for _ in range(sz.repeats):
            naive_prompts = [prompt(int(rng.integers(*sz.prompt_len))) for _ in range(sz.naive_requests)]
            naive.append(naive_generate(engine1.dense, params, naive_prompts, greedy))
            prompts_ = [
                [prompt(int(rng.integers(*sz.prompt_len))) for _ in range(sz.requests_per_session)] for _ in range(c)
            ]
            looped.append(closed_loop(loop, prompts_, greedy, GenerationRequest))
            multi.append(closed_loop(loop_multi, prompts_, greedy, GenerationRequest))
        loop.stop()
        loop_multi.stop()
        best = max(looped) / max(naive)
        median = statistics.median(a / b for a, b in zip(looped, naive))
        tput[f"c{c}"] = {
            "tokens_per_s_best": max(looped),
            "naive_tokens_per_s_best": max(naive),
            "vs_naive_best": best,
            "vs_naive_median_of_pairs": median,
            "runs": looped,
            "naive_runs": naive,
            "multi_step_tokens_per_s_best": max(multi),
            "multi_step_vs_loop_best": max(multi) / max(looped),
            "multi_step_vs_loop_median_of_pairs": statistics.median(a / b for a, b in zip(multi, looped)),
            "multi_step_vs_naive_best": max(multi) / max(naive),
            "multi_step_runs": multi,
            "multi_step_programs": loop_multi.stats.generate_calls,
            "multi_step_steps": loop_multi.stats.generate_steps,
        }
        m = tput[f"c{c}"]
        rows.append(
            (
                f"multi-step loop ({sz.decode_steps} steps/program), {c} sessions",
                f"{max(multi):,.0f} tok/s",
                f"{m['multi_step_vs_loop_best']:.2f}x the one-step loop; median of paired runs "
                f"{m['multi_step_vs_loop_median_of_pairs']:.2f}x; {m['multi_step_vs_naive_best']:.2f}x naive",
            )
        )
        rows.append(
            (
                f"throughput, {c} concurrent sessions",
                f"{max(looped):,.0f} tok/s",
                f"{best:.2f}x naive one-at-a-time ({max(naive):,.0f} tok/s); median of paired runs {median:.2f}x",
            )
        )
    report["throughput"] = tput

    # -- a burst of requests arriving at an idle cell: prefilled together vs one prompt per call, on the dense
    # engine (``burst_start``) and on the paged one (``burst_start_paged``: into the slots' pages) ---------------
    for key, eng, label in (("burst_start", engine, ""), ("burst_start_paged", paged, ", paged KV")):
        burst: dict = {"requests": sz.slots, "prompt_len": list(sz.prompt_len)}
        runs: dict = {"together": [], "one_per_call": [], "calls_together": 0, "calls_one_per_call": 0}
        for _ in range(sz.repeats):
            prompts_ = [prompt(int(rng.integers(*sz.prompt_len))) for _ in range(sz.slots)]
            for name, together in (("together", True), ("one_per_call", False)):
                t, calls = burst_start(ServingLoop, eng, params, prompts_, GenerationRequest, SamplingParams, together)
                runs[name].append(t)
                runs[f"calls_{name}"] = calls
        burst.update(runs)
        burst["together_over_one_per_call_best"] = min(runs["together"]) / min(runs["one_per_call"])
        burst["median_of_pairs"] = statistics.median(a / b for a, b in zip(runs["together"], runs["one_per_call"]))
        report[key] = burst
        rows.append(
            (
                f"burst of {sz.slots} requests{label}, every first token",
                f"{1e3 * min(runs['together']):.1f} ms",
                f"{burst['together_over_one_per_call_best']:.2f}x one prompt per prefill call "
                f"({1e3 * min(runs['one_per_call']):.1f} ms, {runs['calls_one_per_call']} calls vs "
                f"{runs['calls_together']}); median of pairs {burst['median_of_pairs']:.2f}x",
            )
        )

    # -- loop overhead vs raw jitted decode steps (interleaved per repeat) --------------------------------------
    raw, raw_fetch, looped = [], [], []
    for _ in range(sz.repeats):
        raw.append(raw_steps(engine.dense, params, fill(engine.dense, params, sz, prompt, greedy), sz.overhead_steps))
        looped.append(loop_steps(engine, params, sz, prompt, ServingLoop, GenerationRequest, SamplingParams))
        raw_fetch.append(
            fetch_steps(engine.dense, params, fill(engine.dense, params, sz, prompt, greedy), sz.overhead_steps)
        )
    over = {
        "raw_step_ms_best": 1e3 * min(raw),
        "raw_fetch_step_ms_best": 1e3 * min(raw_fetch),
        "loop_step_ms_best": 1e3 * min(looped),
        "steps": sz.overhead_steps,
        "slots": sz.slots,
    }
    over["loop_vs_raw_best"] = min(looped) / min(raw)
    over["loop_vs_raw_median_of_pairs"] = statistics.median(a / b for a, b in zip(looped, raw))
    over["loop_vs_raw_fetch_best"] = min(looped) / min(raw_fetch)
    over["overhead_pct_best"] = 100 * (over["loop_vs_raw_best"] - 1)
    over["target_pct"] = 15.0
    over["runs_ms"] = {
        "raw": [1e3 * x for x in raw],
        "raw_fetch": [1e3 * x for x in raw_fetch],
        "loop": [1e3 * x for x in looped],
    }
    report["overhead"] = over
    rows.append(
        (
            f"loop step, {sz.slots} slots busy",
            f"{over['loop_step_ms_best']:.2f} ms",
            f"{over['loop_vs_raw_best']:.3f}x raw jitted steps ({over['raw_step_ms_best']:.2f} ms); median of paired "
            f"runs {over['loop_vs_raw_median_of_pairs']:.3f}x; {over['loop_vs_raw_fetch_best']:.3f}x raw + token fetch",
        )
    )

    # -- session prefix cache --------------------------------------------------------------------------------
    first = prompt(sz.first_prompt)
    extra = [prompt(sz.turn_new_tokens) for _ in range(sz.turns)]
    pc: dict = {"turns": sz.turns}
    for name, pages in (("with_cache", None), ("without_cache", 0)):
        loop = ServingLoop(engine, params, name=name, kv_pages=pages, prefill_chunk=sz.chunk).start()
        t0 = time.perf_counter()
        final, completions = session(loop, first, extra, sz.turn_completion, GenerationRequest, SamplingParams)
        wall = time.perf_counter() - t0
        loop.stop()
        pc[name] = {
            "prefill_tokens": loop.stats.prefill_tokens,
            "final_context": final,
            "prefill_over_final_context": loop.stats.prefill_tokens / final,
            "wall_s": wall,
            "cache": loop.stats.cache.__dict__,
        }
        pc.setdefault("completions", completions)
        assert completions == pc["completions"], "the cache changed a greedy completion"
    pc["wall_with_over_without"] = pc["with_cache"]["wall_s"] / pc["without_cache"]["wall_s"]
    report["prefix_cache"] = pc
    for name in ("with_cache", "without_cache"):
        r = pc[name]
        rows.append(
            (
                f"{sz.turns}-turn session, {name.replace('_', ' ')}",
                f"{r['prefill_tokens']:,} prefill tokens",
                f"{r['prefill_over_final_context']:.2f}x final context ({r['final_context']} tokens), {r['wall_s']:.2f} s",
            )
        )

    # -- chunked prefill: decode pauses while a long prompt arrives -------------------------------------------
    ch: dict = {"long_prompt": sz.long_prompt, "chunk": sz.chunk, "background_sessions": sz.background_sessions}
    long_prompt = prompt(sz.long_prompt)
    for name, chunk in (("chunked", sz.chunk), ("one_call", sz.max_seq_len)):
        stalls, ttfts = [], []
        for _ in range(sz.repeats):
            stall, ttft = decode_pause(
                engine, params, sz, prompt, long_prompt, chunk, ServingLoop, GenerationRequest, SamplingParams
            )
            stalls.append(stall)
            ttfts.append(ttft)
        ch[name] = {
            "max_decode_pause_ms": 1e3 * statistics.median(stalls),
            "ttft_ms": 1e3 * statistics.median(ttfts),
            "runs_pause_ms": [1e3 * s for s in stalls],
            "runs_ttft_ms": [1e3 * t for t in ttfts],
        }
    ch["pause_chunked_over_one_call"] = ch["chunked"]["max_decode_pause_ms"] / ch["one_call"]["max_decode_pause_ms"]
    ch["ttft_chunked_over_one_call"] = ch["chunked"]["ttft_ms"] / ch["one_call"]["ttft_ms"]
    report["chunked_prefill"] = ch
    rows.append(
        (
            f"longest decode pause, {sz.long_prompt}-token prompt joins",
            f"{ch['chunked']['max_decode_pause_ms']:.1f} ms",
            f"{ch['pause_chunked_over_one_call']:.2f}x one prefill call ({ch['one_call']['max_decode_pause_ms']:.1f} ms); "
            f"its TTFT {ch['ttft_chunked_over_one_call']:.2f}x",
        )
    )

    report["load_avg_end"] = load()
    out = (
        Path(args.out)
        if args.out
        else REPO / "benchmarks" / "results" / ("serving_smoke.json" if args.smoke else "serving.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    width = max(len(r[0]) for r in rows)
    print(
        f"\nserving benchmark ({'smoke' if args.smoke else 'full'}; {jax.default_backend()}, {args.cell_devices}-device cell, "
        f"{sz.slots} slots x {sz.max_seq_len} tokens, model {cfg.num_params / 1e6:.2f}M params; load avg "
        f"{report['load_avg_start']} -> {report['load_avg_end']})"
    )
    for name, value, ratio in rows:
        print(f"  {name:<{width}}  {value:>22}  {ratio}")
    print(f"wrote {out}")
    return 0


# ------------------------------------------------------------------------------------------------------------
# measurements (plain functions over the engine / loop; imports are passed in or done lazily after device setup)


def naive_generate(engine, params, prompts, sp) -> float:
    """One request at a time on a 1-slot engine's dense programs (``DenseSlots``): prefill, insert, generate until
    max_tokens. Returns tokens/s."""
    from gyre_jax.serving.sampling import key_for_seed

    state = engine.init_decode_state()
    tokens = 0
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        prefix = engine.prefill(params=params, tokens=p, sampling_params=sp, key=key_for_seed(i))
        state = engine.insert(prefix, state, 0, sp)
        int(prefix.token)  # the first token reaches the host, as a server would send it
        tokens += 1
        for i in range(sp.max_tokens - 1):
            state, result = engine.generate(params, state, max_length=len(p) + i)
            tokens += int(result.valid[0])
        state = engine.release(state, 0)
    return tokens / (time.perf_counter() - t0)


def closed_loop(loop, prompts_per_session, sp, request_cls) -> float:
    """One client thread per session, each sending its requests one after another. Returns generated tokens/s."""
    counts = [0] * len(prompts_per_session)
    barrier = threading.Barrier(len(prompts_per_session) + 1)

    def client(i, prompts):
        barrier.wait()
        for p in prompts:
            counts[i] += len(loop.submit(request_cls(prompt_ids=p, sampling=sp)).result().token_ids)

    threads = [threading.Thread(target=client, args=(i, p)) for i, p in enumerate(prompts_per_session)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def burst_start(loop_cls, engine, params, prompts, request_cls, sampling_cls, together: bool) -> tuple[float, int]:
    """A burst of requests queued on an idle loop (max_tokens=1: each ends at its first token). Returns the seconds
    until every one has its first token, from the loop's start, and the prefill calls it took."""
    loop = loop_cls(engine, params, name="burst", kv_pages=0, prefill_together=together)
    futures = [
        loop.submit(request_cls(prompt_ids=p, sampling=sampling_cls(temperature=0.0, max_tokens=1))) for p in prompts
    ]
    t0 = time.perf_counter()
    loop.start()
    for f in futures:
        f.result()
    elapsed = time.perf_counter() - t0
    loop.stop()
    return elapsed, loop.stats.prefill_calls


def fill(engine, params, sz, prompt, sp):
    """A decode state with every slot holding a short prompt (what the overhead steps run over)."""
    from gyre_jax.serving.sampling import key_for_seed

    state = engine.init_decode_state()
    for slot in range(engine.max_concurrent_decodes):
        prefix = engine.prefill(params=params, tokens=prompt(16), sampling_params=sp, key=key_for_seed(slot))
        state = engine.insert(prefix, state, slot, sp)
    import jax

    jax.block_until_ready(state)
    return state


SKIP = 5  # decode steps run before a timed window (the loop's window starts after its 5th step too)


def raw_steps(engine, params, state, n) -> float:
    """Seconds per step of back-to-back raw jitted decode steps over the same decode windows as the loop's
    (every slot starts at 16 tokens), no host work, one sync at the end."""
    import jax

    windows = [engine.decode_window(16 + i) for i in range(SKIP + n)]
    for w in windows[:SKIP]:
        state, *out = engine.generate_program(*engine.flat_params(params), state, w, engine.max_concurrent_decodes)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for w in windows[SKIP:]:
        state, *out = engine.generate_program(*engine.flat_params(params), state, w, engine.max_concurrent_decodes)
    jax.block_until_ready((state, out))
    return (time.perf_counter() - t0) / n


def fetch_steps(engine, params, state, n) -> float:
    """Seconds per step of ``DenseSlots.generate`` (jitted step + the host copy of its tokens), back to back."""
    for i in range(SKIP):
        state, _ = engine.generate(params, state, max_length=16 + i)
    t0 = time.perf_counter()
    for i in range(SKIP, SKIP + n):
        state, _ = engine.generate(params, state, max_length=16 + i)
    return (time.perf_counter() - t0) / n


def loop_steps(engine, params, sz, prompt, loop_cls, request_cls, sampling_cls) -> float:
    """Seconds per generate step of a ServingLoop with every slot decoding (measured between two step counts)."""
    loop = loop_cls(engine, params, name="overhead", kv_pages=0).start()
    sp = sampling_cls(temperature=0.0, max_tokens=sz.max_seq_len)
    reqs = [request_cls(prompt_ids=prompt(16), sampling=sp) for _ in range(engine.max_concurrent_decodes)]
    futures = [loop.submit(r) for r in reqs]
    _wait(lambda: loop.stats.generate_steps >= SKIP)
    s0, t0 = loop.stats.generate_steps, time.perf_counter()
    _wait(lambda: loop.stats.generate_steps >= s0 + sz.overhead_steps, poll=0.0005)
    s1, t1 = loop.stats.generate_steps, time.perf_counter()
    assert loop.stats.requests_done == 0, "a request finished inside the window: raise max_seq_len"
    for r in reqs:
        loop.cancel(r.request_id)
    for f in futures:
        f.result()
    loop.stop()
    return (t1 - t0) / (s1 - s0)


def session(loop, first, extra, completion, request_cls, sampling_cls):
    """A multi-turn session: each prompt = previous prompt + completion + new tokens. Returns (final context
    length, the completions)."""
    sp = sampling_cls(temperature=0.0, max_tokens=completion)
    prompt, completions = list(first), []
    for turn, new in enumerate(extra):
        result = loop.submit(request_cls(prompt_ids=prompt, sampling=sp, session_id="agent/main")).result()
        completions.append(result.token_ids)
        if turn == len(extra) - 1:
            return len(prompt) + len(result.token_ids), completions
        prompt = prompt + result.token_ids + new


def decode_pause(engine, params, sz, prompt, long_prompt, chunk, loop_cls, request_cls, sampling_cls):
    """Background sessions decode; a long prompt joins. Returns (longest gap between two generate steps while it
    was prefilled, its time to first token)."""
    stamps: list[float] = []

    class Timed:
        def __getattr__(self, name):
            return getattr(engine, name)

        def generate(self, p, **kw):
            out = engine.generate(p, **kw)
            stamps.append(time.perf_counter())
            return out

    loop = loop_cls(Timed(), params, name="chunked", kv_pages=0, prefill_chunk=chunk).start()
    sp = sampling_cls(temperature=0.0, max_tokens=sz.max_seq_len)
    background = [request_cls(prompt_ids=prompt(16), sampling=sp) for _ in range(sz.background_sessions)]
    futures = [loop.submit(r) for r in background]
    _wait(lambda: loop.stats.generate_steps >= 5)
    t0 = time.perf_counter()
    result = loop.submit(
        request_cls(prompt_ids=long_prompt, sampling=sampling_cls(temperature=0.0, max_tokens=1))
    ).result()
    t1 = time.perf_counter()
    assert len(result.token_ids) == 1
    _wait(lambda: stamps[-1] > t1)  # the first decode step after the long prompt's prefill
    before = [t for t in stamps if t < t0][-1:]
    during = [t for t in stamps if t0 <= t <= t1]
    after = [t for t in stamps if t > t1][:1]
    edges = before + during + after
    pause = max(b - a for a, b in zip(edges, edges[1:]))
    for r in background:
        loop.cancel(r.request_id)
    for f in futures:
        f.result()
    loop.stop()
    return pause, t1 - t0


def _wait(cond, timeout: float = 600.0, poll: float = 0.002) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached in time")
        time.sleep(poll)


if __name__ == "__main__":
    sys.exit(main())
