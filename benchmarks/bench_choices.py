"""n > 1 choices on a real ``ServingLoop`` (tiny model, CPU): how many prompt tokens each way of submitting the n
samples prefills, and how long the call takes. The proxy submits the first choice, then the rest at once
(``TurnPipeline._wait_choices``); the alternatives are measured beside it in the same run.

  all_at_once       n requests of one session submitted together (none can reuse: the session's cache entry
                    only exists once a request finished)
  first_then_rest   the proxy's way: the first alone, then the other n - 1 together (one of them takes the
                    session's entry: the prompt's KV left by the first)
  sequential        one after another (each takes the entry the previous one left)
  proxy             n choices through a real ProxyServer chat call (``first_then_rest`` end to end)

    python benchmarks/bench_choices.py [--prompt 600] [--max-tokens 24] [--n 2 4] [--out FILE]

Prints a table and writes JSON (default ``benchmarks/results/choices.json``): per (strategy, n) the prompt
tokens prefilled (loop counter) over the prompt length, and the wall time (best of ``--repeats``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def build(max_seq_len: int):
    """A started tiny ServingLoop on one CPU device with a session prefix cache."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from gyre_jax.config import load_config
    from gyre_jax.model.config import ModelConfig
    from gyre_jax.model.sharding import init_params, make_mesh
    from gyre_jax.model.tokenizer import ByteTokenizer
    from gyre_jax.serving.engine import Engine
    from gyre_jax.serving.loop import ServingLoop

    tok = ByteTokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size, num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2,
                      head_dim=16, mlp_dim=128, rope_theta=10000.0)  # fmt: skip
    rules = tuple((k, v) for k, v in load_config([]).sharding_rules)
    mesh = make_mesh(jax.devices()[:1], dict(data=1))
    graphdef, params = init_params(cfg, mesh, rules, seed=0)
    engine = Engine(cfg, graphdef, mesh, rules, max_concurrent_decodes=8, max_seq_len=max_seq_len,
                    max_prefill_length=256, prefill_buckets=(64, 256))  # fmt: skip
    return ServingLoop(engine, params, name="cell0", detokenize=tok.decode).start(), tok


def submit_all(loop, requests) -> list:
    return [f.result(120) for f in [loop.submit(r) for r in requests]]


def run_strategy(loop, strategy: str, prompt: list[int], n: int, max_tokens: int, session: str) -> None:
    from gyre_jax.serving.types import GenerationRequest, SamplingParams

    reqs = [GenerationRequest(list(prompt), SamplingParams(max_tokens=max_tokens, seed=i), session_id=session)
            for i in range(n)]  # fmt: skip
    if strategy == "all_at_once":
        submit_all(loop, reqs)
    elif strategy == "first_then_rest":
        submit_all(loop, reqs[:1])
        submit_all(loop, reqs[1:])
    else:
        for r in reqs:
            submit_all(loop, [r])


def run_proxy(loop, tok, prompt_text: str, n: int, max_tokens: int, session: str, store_dir: Path) -> None:
    import openai

    from gyre_jax.proxy.records import RecordStore
    from gyre_jax.proxy.server import ProxyServer

    with ProxyServer(loop, tok, RecordStore(store_dir)) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key=proxy.open_execution(session), max_retries=0)
        client.chat.completions.create(model="gyre-tiny", messages=[{"role": "user", "content": prompt_text}],
                                       n=n, max_tokens=max_tokens)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--n", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/choices.json"))
    args = ap.parse_args()
    loop, tok = build(max_seq_len=1024)
    text = ("The quick brown fox jumps over the lazy dog. " * 64)[: args.prompt - 16]
    prompt = tok.encode(text)
    chat_prompt_len = len(tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"))
    run_strategy(loop, "all_at_once", prompt, 2, 4, "warmup")  # compile
    rows, tmp = [], Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-choices-{os.getpid()}"
    counter = iter(range(10**6))
    for n in args.n:
        for strategy in ("all_at_once", "first_then_rest", "sequential", "proxy"):
            best, prefilled = float("inf"), None
            for _ in range(args.repeats):
                session = f"s{next(counter)}"
                before = loop.stats.prefill_tokens
                t0 = time.perf_counter()
                if strategy == "proxy":
                    run_proxy(loop, tok, text, n, args.max_tokens, session, tmp / session)
                else:
                    run_strategy(loop, strategy, prompt, n, args.max_tokens, session)
                best = min(best, time.perf_counter() - t0)
                prefilled = loop.stats.prefill_tokens - before
            plen = chat_prompt_len if strategy == "proxy" else len(prompt)
            rows.append({"strategy": strategy, "n": n, "prompt_tokens": plen, "prefilled_tokens": prefilled,
                         "prefilled_over_prompt": prefilled / plen, "best_s": best})  # fmt: skip
    loop.stop()
    print(f"{'strategy':<16} {'n':>2} {'prompt':>6} {'prefilled':>9} {'x prompt':>8} {'best s':>7}")
    for r in rows:
        print(f"{r['strategy']:<16} {r['n']:>2} {r['prompt_tokens']:>6} {r['prefilled_tokens']:>9} "
              f"{r['prefilled_over_prompt']:>8.2f} {r['best_s']:>7.3f}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
