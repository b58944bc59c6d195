"""Attention memory at long T: dense masked ``jax.nn.dot_product_attention`` against ``model.blockwise``, same run.

For each T: the compiled temp bytes of d(loss)/d(q, k, v) (forward + backward, from XLA's
``memory_analysis()``; compile only, nothing runs) at B=1, H=4, K=2, D=32, one causal sequence of T
tokens (``tree_mask_spec`` of one segment; dense: ``trajectory.batch.attention_mask``). Where
T <= ``--time-max`` it also times one jitted forward+backward (median of ``--reps``, after a warm-up),
blockwise with and without skipping fully masked key blocks. Prints a table and writes JSON.

Context parallelism (``--section cp``): the longest row (one causal sequence) whose RL micro-step
(``rl.micro_step.GradWorker``, a tiny 2-layer model, blockwise attention, full remat) fits a fixed
per-device memory budget (XLA's compiled ``memory_analysis()``: arguments + outputs + temporaries), on
1 device and with ``model.context_parallel = 8`` over 8 virtual CPU devices (ring attention,
``model/ring.py``), and the micro-step time of both at the 1-device length.

Paged decoding (``--section paged``): one ``serving.paged.PagedEngine`` slot whose session grows by chunked
prefill (each growth a new turn: ``release(keep=True)`` then ``attach``, the session's pages reused in place)
to each of ``--paged-lengths`` tokens, decoding ``--paged-steps`` tokens at each: KV bytes held against the
live tokens' bytes, and the decode step time. Baseline in the same run: the dense ``Engine`` sized for the
longest session (``max_seq_len``), its bytes from its decode state's shapes and its decode step timed at the
same live lengths (decode speed does not depend on the cached values, so its slots are given the lengths
without a prefill).

    python benchmarks/bench_long_context.py            # -> benchmarks/results/long_context.json
    python benchmarks/bench_long_context.py --section cp   # -> benchmarks/results/long_context_cp.json (~15 min)
    python benchmarks/bench_long_context.py --section paged     # -> benchmarks/results/long_context_paged.json
    python benchmarks/bench_long_context.py --section attention --lengths 1024 2048 --time-max 0 --out /tmp/lc.json
    python benchmarks/bench_long_context.py --section cp --cp-budget-mib 16 --cp-time 0 --cp-out /tmp/cp.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # the CP section's devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.timing import median_ms  # noqa: E402
from gyre_jax.model.blockwise import blockwise_attention, tree_mask_spec  # noqa: E402
from gyre_jax.trajectory.batch import attention_mask  # noqa: E402

B, H, K, D = 1, 4, 2, 32


def grad_fn(kind: str, block: int):
    """kind: dense | blockwise | blockwise_noskip -> jitted (q, k, v, seg, end) -> (dq, dk, dv) of sum(out^2)."""

    def loss(q, k, v, seg, end):
        if kind == "dense":
            out = jax.nn.dot_product_attention(q, k, v, mask=attention_mask(seg, end)[:, None])
        else:
            spec = tree_mask_spec(seg, end)
            out = blockwise_attention(
                q, k, v, spec, block_q=block, block_k=block, skip_empty_blocks=kind == "blockwise"
            )
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, (0, 1, 2)))


def shapes(t: int):
    f32 = jnp.float32
    return (jax.ShapeDtypeStruct((B, t, H, D), f32), jax.ShapeDtypeStruct((B, t, K, D), f32),
            jax.ShapeDtypeStruct((B, t, K, D), f32), jax.ShapeDtypeStruct((B, t), jnp.int32),
            jax.ShapeDtypeStruct((B, t), jnp.int32))  # fmt: skip


def inputs(t: int):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, t, h, D)), jnp.float32) for h in (H, K, K))
    return q, k, v, jnp.ones((B, t), jnp.int32), jnp.full((B, t), t, jnp.int32)


def temp_bytes(fn, t: int) -> int | None:
    analysis = fn.lower(*shapes(t)).compile().memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def measure(t: int, block: int, time_max: int, reps: int) -> dict:
    fns = {kind: grad_fn(kind, block) for kind in ("dense", "blockwise", "blockwise_noskip")}
    row = {
        "T": t,
        "dense_temp_bytes": temp_bytes(fns["dense"], t),
        "blockwise_temp_bytes": temp_bytes(fns["blockwise"], t),
    }
    if t <= time_max:
        args = inputs(t)
        for kind, fn in fns.items():
            row[f"{kind}_ms"] = round(median_ms(fn, args, reps), 2)
    return row


# -- context parallelism ------------------------------------------------------------------------------------------

CP_MODEL = dict(vocab_size=256, num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                rope_theta=10000.0, attention_impl="blockwise", remat_policy="full")  # fmt: skip


def cp_worker(devices: int, block: int):
    """A GradWorker over ``devices`` CPU devices: one device (context_parallel 1) or a ``context`` axis of them."""
    from gyre_jax.config import load_config
    from gyre_jax.model.config import ModelConfig
    from gyre_jax.model.sharding import abstract_model, make_mesh
    from gyre_jax.rl.micro_step import GradWorker

    cfg = ModelConfig(**CP_MODEL, attention_block_q=block, attention_block_k=block, context_parallel=devices)
    mesh = make_mesh(jax.devices()[:devices], {"context": devices} if devices > 1 else {})
    graphdef, _ = abstract_model(cfg)
    return GradWorker(cfg, graphdef, mesh, load_config([]).sharding_rules)


def cp_batch(t: int, segments: int = 1):
    """One row of ``t`` tokens, ``segments`` plain causal sequences of equal length, every target trained."""
    from gyre_jax.trajectory.batch import empty_micro_batch

    mb = empty_micro_batch(1, t, segments)
    rng = np.random.default_rng(0)
    n = t // segments
    for s in range(segments):
        sl = slice(s * n, (s + 1) * n)
        mb.tokens[0, sl], mb.targets[0, sl] = rng.integers(0, 256, n), rng.integers(0, 256, n)
        mb.positions[0, sl], mb.segment_ids[0, sl], mb.subtree_end[0, sl] = np.arange(n), s + 1, (s + 1) * n
        mb.seq_index[0, sl] = s
    mb.loss_mask[:] = 1.0
    mb.old_logprobs[:] = -5.5
    mb.advantages[:], mb.seq_weights[:] = 1.0, 1.0 / segments
    return mb


def cp_bytes(worker, t: int) -> int:
    """Per-device bytes of the compiled RL micro-step (arguments + outputs + temporaries - aliased) at one row of
    ``t`` tokens: XLA's ``memory_analysis()`` of the jitted gradient function, compile only."""
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          abstract_params(worker), worker.param_shardings)  # fmt: skip
    mb = cp_batch(t)
    mb.versions = None
    shard = worker.batch_shardings(mb)
    batch = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), mb, shard)
    with jax.set_mesh(worker.mesh):
        m = worker._rl_grads.lower(params, batch, None).compile().memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def abstract_params(worker):
    from gyre_jax.model.sharding import abstract_model

    return abstract_model(worker.model_cfg)[1]


def longest_within(worker, budget: int, step: int, log) -> tuple[int, dict[int, int]]:
    """The longest row (a multiple of ``step`` tokens) whose micro-step fits ``budget`` bytes per device:
    doubling, then bisection; returns (T, {T: bytes} of every length compiled)."""
    seen: dict[int, int] = {}

    def fits(t: int) -> bool:
        seen[t] = cp_bytes(worker, t)
        log(f"  {worker.mesh.devices.size} device(s) T={t}: {seen[t] / 2**20:.1f} MiB")
        return seen[t] <= budget

    if not fits(step):
        return 0, seen
    lo, hi = step, 2 * step
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, seen


def cp_step_ms(worker, t: int, reps: int) -> float:
    """Median ms of one RL micro-step (forward + backward) at one row of ``t`` tokens (params from seed 0)."""
    from gyre_jax.model.sharding import init_params

    _, params = init_params(worker.model_cfg, worker.mesh, worker.rules, seed=0)
    mb = cp_batch(t)
    return median_ms(lambda p, b: worker.micro_step(p, b)[0], (params, mb), reps)


def context_parallel(a) -> dict:
    """The CP section: longest trainable row within ``a.cp_budget_mib`` per device, 1 device vs ``a.cp_devices``,
    and the micro-step time of both at the 1-device length."""
    budget, step, n = int(a.cp_budget_mib * 2**20), a.cp_step, a.cp_devices
    one, many = cp_worker(1, a.cp_block), cp_worker(n, a.cp_block)
    t1, seen1 = longest_within(one, budget, step, print)
    tn, seen_n = longest_within(many, budget, step, print)
    row = {"budget_bytes": budget, "devices": n, "longest_1": t1, f"longest_{n}": tn, "ratio": tn / max(t1, 1),
           "bytes_1": seen1, f"bytes_{n}": seen_n}  # fmt: skip
    if a.cp_time and t1:
        row["step_T"] = t1
        row["step_ms_1"] = round(cp_step_ms(one, t1, a.reps), 1)
        row[f"step_ms_{n}"] = round(cp_step_ms(many, t1, a.reps), 1)
    return row


def mib(x) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f}"


def attention_section(a) -> None:
    rows = []
    print(
        f"{'T':>6} {'dense MiB':>10} {'blockwise MiB':>14} {'ratio':>7} {'dense ms':>9} {'bw ms':>8} {'bw noskip ms':>13}"
    )
    for t in a.lengths:
        row = measure(t, a.block, a.time_max, a.reps)
        rows.append(row)
        d, bw = row["dense_temp_bytes"], row["blockwise_temp_bytes"]
        ratio = f"{d / bw:.1f}x" if d and bw else "n/a"
        times = [f"{row[k]:.1f}" if k in row else "-" for k in ("dense_ms", "blockwise_ms", "blockwise_noskip_ms")]
        print(f"{t:>6} {mib(d):>10} {mib(bw):>14} {ratio:>7} {times[0]:>9} {times[1]:>8} {times[2]:>13}")
    meta = {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
            "config": {"B": B, "H": H, "K": K, "D": D, "block_q": a.block, "block_k": a.block, "dtype": "float32",
                       "mask": "one causal sequence (tree_mask_spec / attention_mask)"},
            "measure": "compiled temp_size_in_bytes of jit(grad(sum(out**2))) wrt q, k, v; times: median ms",
            "reps": a.reps, "time": time.time()}  # fmt: skip
    write(a.out, {"meta": meta, "baseline": "dense jax.nn.dot_product_attention", "rows": rows})


def cp_section(a) -> None:
    row = context_parallel(a)
    n = a.cp_devices
    print(f"\ncontext parallelism: per-device budget {a.cp_budget_mib} MiB (compiled RL micro-step, 1 row)")
    print(f"{'devices':>8} {'longest T':>10} {'step ms at T=' + str(row.get('step_T', '-')):>20}")
    print(f"{1:>8} {row['longest_1']:>10} {row.get('step_ms_1', '-'):>20}")
    print(f"{n:>8} {row[f'longest_{n}']:>10} {row.get(f'step_ms_{n}', '-'):>20}")
    print(f"longest row {n} devices / 1 device: {row['ratio']:.1f}x")
    meta = {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
            "model": dict(CP_MODEL, attention_block_q=a.cp_block, attention_block_k=a.cp_block, dtype="float32"),
            "measure": "per-device argument + output + temp - alias bytes of the compiled GradWorker RL micro-step "
                       "(XLA memory_analysis, compile only) for one row of T tokens (one causal sequence); lengths "
                       f"searched in multiples of {a.cp_step} (doubling, then bisection); times: median ms of "
                       "micro_step (8 virtual CPU devices share the host's cores: indicative only)",
            "reps": a.reps, "time": time.time()}  # fmt: skip
    write(a.cp_out, {"meta": meta, "baseline": "the same micro-step on 1 device", "context_parallel": row})


def paged_setup(a):
    """(cfg, paged engine of one slot, dense engine sized for the longest session, params) on one device."""
    from gyre_jax.config import load_config
    from gyre_jax.model.config import ModelConfig
    from gyre_jax.model.sharding import init_params, make_mesh
    from gyre_jax.serving.dense import DenseSlots
    from gyre_jax.serving.paged import PagedEngine

    cfg = ModelConfig(**dict(CP_MODEL, remat_policy="none"), attention_block_q=a.cp_block, attention_block_k=a.cp_block)
    mesh, rules = make_mesh(jax.devices()[:1], {}), load_config([]).sharding_rules
    graphdef, params = init_params(cfg, mesh, rules, seed=0)
    longest = max(a.paged_lengths)
    sizes = dict(max_prefill_length=a.paged_chunk, prefill_buckets=(a.paged_chunk,))
    paged = PagedEngine(cfg, graphdef, mesh, rules, max_concurrent_decodes=1, num_pages=-(-longest // a.page_size),
                        page_size=a.page_size, **sizes)  # fmt: skip
    windows = tuple(sorted(set(a.paged_lengths)))
    dense = DenseSlots(cfg, graphdef, mesh, rules, max_concurrent_decodes=a.dense_slots, max_seq_len=longest,
                        decode_windows=windows, page_size=a.page_size, **sizes)  # fmt: skip
    return cfg, paged, dense, params


def step_ms(fn, steps: int) -> float:
    """Median ms of ``fn()`` (blocked) over ``steps`` calls after one warm-up (the compile)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def dense_decode_ms(dense, params, live: int, steps: int) -> float:
    """The dense engine's decode step with one active slot (the others free) growing to ``live`` tokens over the
    warm-up and the ``steps`` timed steps, attending over the window that holds ``live`` (as the paged slot)."""
    import dataclasses

    state = dense.init_decode_state()
    start = live - steps - 1
    box = [dataclasses.replace(state, lengths=state.lengths.at[0].set(start), active=state.active.at[0].set(True))]

    def one():
        box[0], _ = dense.generate(params, box[0], max_length=live - 1, slot_limit=1, wait=False)
        return box[0].tokens

    return step_ms(one, steps)


def paged_section(a) -> None:
    from gyre_jax.serving.sampling import key_for_seed
    from gyre_jax.serving.types import SamplingParams

    cfg, paged, dense, params = paged_setup(a)
    greedy, rng, key = SamplingParams(temperature=0.0), np.random.default_rng(0), key_for_seed(0)
    token_bytes = paged.page_bytes // a.page_size
    dense_kv = jax.tree.leaves(jax.eval_shape(dense.init_decode_state).cache)
    dense_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in dense_kv)
    rows = []
    print(f"\npaged decoding: one session, pages of {a.page_size}, prefill chunks of {a.paged_chunk}")
    print(f"{'live':>7} {'prefill s':>10} {'held/live':>10} {'dense/live':>11} {'paged ms':>9} {'dense ms':>9}")
    for target in sorted(a.paged_lengths):
        kept = paged.release(0, keep=paged.slot_length(0))
        if kept is not None:  # the session's next turn: its pages, in place
            paged.attach(0, kept)
        grow = target - a.paged_steps - 1 - paged.slot_length(0)  # decoding then stays within ``target``
        t0 = time.perf_counter()
        paged.prefill(params, 0, rng.integers(0, cfg.vocab_size, grow).tolist(), greedy, key)
        prefill_s = time.perf_counter() - t0
        paged.start([0])
        ms = step_ms(lambda: paged.generate(params, wait=False)._ints, a.paged_steps)
        live = paged.slot_length(0)
        row = {"target": target, "live_tokens": live, "prefilled_tokens": grow, "prefill_s": prefill_s,
               "kv_bytes_held": paged.kv_bytes_held(), "live_kv_bytes": live * token_bytes,
               "held_over_live": paged.kv_bytes_held() / (live * token_bytes), "dense_kv_bytes": dense_bytes,
               "dense_over_live": dense_bytes / (live * token_bytes), "paged_decode_ms": ms,
               "dense_decode_ms": dense_decode_ms(dense, params, live, a.paged_steps)}  # fmt: skip
        rows.append(row)
        print(f"{live:>7} {prefill_s:>10.1f} {row['held_over_live']:>10.3f} {row['dense_over_live']:>11.1f} "
              f"{ms:>9.2f} {row['dense_decode_ms']:>9.2f}")  # fmt: skip
    first, last = rows[0], rows[-1]
    print(f"decode step at {last['live_tokens']} / at {first['live_tokens']} tokens: paged "
          f"{last['paged_decode_ms'] / first['paged_decode_ms']:.1f}x, dense {last['dense_decode_ms'] / first['dense_decode_ms']:.1f}x")  # fmt: skip
    meta = {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
            "load_avg": os.getloadavg(), "model": dict(CP_MODEL, remat_policy="none", dtype="float32"),
            "page_size": a.page_size, "prefill_chunk": a.paged_chunk, "decode_steps_timed": a.paged_steps,
            "dense_slots": a.dense_slots, "measure": "held: pages in use x page bytes (every layer's K and V); live: "
            "tokens in the slot x token bytes; dense: the decode state's KV of an Engine with max_seq_len = the "
            "longest session; decode ms: median of one-step generate calls (blocked) after a warm-up", "time": time.time()}  # fmt: skip
    write(a.paged_out, {"meta": meta, "baseline": "dense Engine (slots x max_seq_len)", "rows": rows})


def write(path: str, payload: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--section", choices=("attention", "cp", "paged", "all"), default="attention")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 65536])
    ap.add_argument("--block", type=int, default=128, help="block_q = block_k")
    ap.add_argument("--time-max", type=int, default=4096, help="time fwd+bwd only at T <= this (0: no times)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_context.json"))
    ap.add_argument("--cp-budget-mib", type=float, default=64.0, help="per-device memory budget of the CP section")
    ap.add_argument("--cp-devices", type=int, default=8)
    ap.add_argument("--cp-step", type=int, default=1024, help="row lengths searched in multiples of this")
    ap.add_argument("--cp-block", type=int, default=128)
    ap.add_argument("--cp-time", type=int, default=1, help="1: time both at the 1-device length; 0: memory only")
    ap.add_argument("--cp-out", default=str(ROOT / "benchmarks" / "results" / "long_context_cp.json"))
    ap.add_argument("--paged-lengths", type=int, nargs="+", default=[8192, 131072], help="session lengths (tokens)")
    ap.add_argument("--paged-steps", type=int, default=16, help="decode steps timed at each length")
    ap.add_argument("--paged-chunk", type=int, default=4096, help="prefill chunk (max_prefill_length)")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--dense-slots", type=int, default=8, help="the dense baseline's slots (a cell's sessions)")
    ap.add_argument("--paged-out", default=str(ROOT / "benchmarks" / "results" / "long_context_paged.json"))
    a = ap.parse_args(argv)
    if a.section in ("attention", "all"):
        attention_section(a)
    if a.section in ("cp", "all"):
        cp_section(a)
    if a.section in ("paged", "all"):
        paged_section(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
