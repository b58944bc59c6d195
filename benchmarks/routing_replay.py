"""Train/serve log-prob gap of a tiny MoE with and without routing replay, against the dense path.

One run per setting: the serving engine (``record_experts=True``) samples completions of a few prompts,
all slots decoding together (temperature 1); the completions become TITO records (expert ids encoded
with ``encode_experts``, through their JSON form), then branches, a prefix tree (or plain rows) and a
packed micro-batch (``MicroBatchPacker(experts=...)``), exactly as the trajectory pipeline lays them out;
the learner's forward (``rl.micro_step.token_logprobs``) recomputes each completion token's log-prob.
Gap = |log pi_train - log pi_serve| over the completion tokens (mean and max). ``flips`` = fraction of
(completion token, MoE layer) whose top-k set in the training forward differs from the one serving used.

Settings: ``fp32`` (CPU float32: the two forwards differ only by rounding), ``fp32-near-tie`` (router
columns made nearly equal, so rounding differences flip the top-k), ``bf16`` (bfloat16 compute on fp32
weights). Rows: the dense model (no routing: the gap floor of the two code paths), the MoE without replay
and the MoE with replay (``expert_ids`` in the micro-batch).

    python benchmarks/routing_replay.py              # prints a table, writes benchmarks/results/routing_replay.json
    python benchmarks/routing_replay.py --out x.json --tokens 24
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gyre_jax.model.attention import tree_mask  # noqa: E402
from gyre_jax.model.config import TINY_MOE, ModelConfig  # noqa: E402
from gyre_jax.model.rules import RULES_DATA  # noqa: E402
from gyre_jax.model.sharding import init_params, make_mesh  # noqa: E402
from gyre_jax.proxy.records import TitoRecord, encode_experts  # noqa: E402
from gyre_jax.rl.micro_step import token_logprobs  # noqa: E402
from gyre_jax.serving.dense import DenseSlots  # noqa: E402
from gyre_jax.serving.sampling import key_for_seed  # noqa: E402
from gyre_jax.serving.types import SamplingParams  # noqa: E402
from gyre_jax.trajectory.branches import build_branches  # noqa: E402
from gyre_jax.trajectory.packing import MicroBatchPacker  # noqa: E402
from gyre_jax.trajectory.select import select  # noqa: E402
from gyre_jax.trajectory.tree import plain_chunks, tree_chunks  # noqa: E402

MOE = dataclasses.replace(
    TINY_MOE, num_layers=2, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=48, moe_mlp_dim=16,
    vocab_size=64, num_experts=8, num_experts_per_tok=2,
)  # fmt: skip
SLOTS, MAX_SEQ = 4, 64
PROMPTS = ([3, 9, 17, 4, 22, 5, 31, 8], [3, 9, 17, 4, 22, 5, 31, 8], [40, 2, 11, 7, 19], [12, 60, 33])


def build(cfg: ModelConfig, near_tie: float = 0.0, seed: int = 0):
    """(graphdef, params) on one device; ``near_tie`` > 0 makes every router column equal to the first plus
    ``near_tie`` x noise, so the experts' logits nearly tie."""
    mesh = make_mesh(jax.devices()[:1], {"data": 1})
    graphdef, params = init_params(cfg, mesh, RULES_DATA, seed)
    if near_tie > 0 and cfg.is_moe:
        rng = np.random.default_rng(seed)
        model = nnx.merge(graphdef, params)
        for layer in model.layers:
            w = np.asarray(layer.moe.router[...])
            layer.moe.router[...] = jnp.asarray(w[:, :1] + near_tie * rng.normal(size=w.shape), w.dtype)
        graphdef, params = nnx.split(model)
    return mesh, graphdef, params


def serve(cfg: ModelConfig, mesh, graphdef, params, tokens: int, seed: int = 0) -> list[TitoRecord]:
    """Samples ``tokens`` tokens for every prompt, all slots decoding together; one record per prompt (one
    execution), expert ids encoded as the proxy writes them, through JSON."""
    engine = DenseSlots(
        cfg, graphdef, mesh, RULES_DATA, max_concurrent_decodes=SLOTS, max_seq_len=MAX_SEQ,
        max_prefill_length=16, prefill_buckets=(16,), record_experts=cfg.is_moe,
    )  # fmt: skip
    sp = SamplingParams(temperature=1.0)
    state = engine.init_decode_state()
    out = []
    for slot, prompt in enumerate(PROMPTS):
        prefix = engine.prefill(params=params, tokens=prompt, sampling_params=sp, key=key_for_seed(seed + slot))
        state = engine.insert(prefix, state, slot, sp)
        prompt_experts = None if prefix.experts is None else np.asarray(prefix.experts)[: len(prompt)]
        out.append({"ids": [int(prefix.token)], "logprobs": [float(prefix.logprob)], "experts": [],
                    "prompt_experts": prompt_experts})  # fmt: skip
    for _ in range(tokens - 1):
        state, result = engine.generate(params, state)
        for slot, rec in enumerate(out):
            if result.experts is not None:
                rec["experts"].append(result.experts[slot])  # the experts of rec["ids"][-1], the step's input
            rec["ids"].append(int(result.tokens[slot]))
            rec["logprobs"].append(float(result.logprobs[slot]))
    records = []
    for i, (prompt, rec) in enumerate(zip(PROMPTS, out)):
        experts = prompt_experts = None
        if cfg.is_moe:
            last = np.full_like(rec["experts"][0], -1)  # the last token is never fed back within its call
            experts = encode_experts(np.stack([*rec["experts"], last]))
            prompt_experts = encode_experts(rec["prompt_experts"])
        r = TitoRecord(
            execution_id="e0", call_index=i, thread_id="main", request_id=f"r{i}", prompt_ids=list(prompt),
            completion_ids=rec["ids"], completion_logprobs=rec["logprobs"], policy_versions=[0] * tokens,
            finish_reason="length", temperature=1.0, reused_prefix_len=0, t_start=0.0, t_end=0.0,
            completion_experts=experts, prompt_experts=prompt_experts,
        )  # fmt: skip
        records.append(TitoRecord.from_json(r.to_json()))
    return records


def micro_batch(records: list[TitoRecord], replay: tuple[int, int] | None, packing: str = "tree", prompt=True):
    """The records' one micro-batch, laid out as the trajectory pipeline does (every branch selected);
    ``prompt``: with the prompt tokens' expert ids (``rl.routing_replay_prompt = "replay"``)."""
    sel = select("e0", build_branches(records, prompt_experts=prompt), None)
    chunks = tree_chunks(sel, 128, 16) if packing == "tree" else plain_chunks(sel, 128)
    packer = MicroBatchPacker(rows=2, row_length=128, max_sequences=16, open_micro_batches=1, experts=replay)
    out = [p for c in chunks for p in packer.add(c, 1.0, [1.0] * sel.num_selected, ["main"] * sel.num_selected)]
    out += packer.flush()
    assert len(out) == 1, "the benchmark's records must fit one micro-batch"
    return out[0].micro_batch


def gap(cfg: ModelConfig, graphdef, params, records: list[TitoRecord], replay: str, packing: str = "tree") -> dict:
    """{"mean", "max"} of |log pi_train - log pi_serve| over completion tokens, and ``flips``. ``replay``:
    "off" | "completion" (generated tokens' experts) | "all" (prompt tokens' too)."""
    shape = (cfg.num_moe_layers, cfg.num_experts_per_tok) if replay != "off" else None
    mb = micro_batch(records, shape, packing, prompt=replay == "all")
    logp = np.asarray(token_logprobs(graphdef, params, jax.tree.map(jnp.asarray, mb)))
    on = mb.loss_mask > 0
    diff = np.abs(logp[on] - mb.old_logprobs[on])
    row = {"mean": float(diff.mean()), "max": float(diff.max()), "tokens": int(on.sum())}
    if cfg.is_moe:
        row["flips"] = flips(cfg, graphdef, params, records, packing)
    return row


def flips(
    cfg: ModelConfig, graphdef, params, records: list[TitoRecord], packing: str = "tree", part: str = "all"
) -> float:
    """Fraction of (token with recorded experts, MoE layer) whose top-k set the training forward chooses itself
    differs from the set serving used. ``part``: "all" (prompt and completion tokens), "prompt" or "completion"."""
    shape = (cfg.num_moe_layers, cfg.num_experts_per_tok)
    mb = micro_batch(records, shape, packing)
    model = nnx.merge(graphdef, params)
    mask = tree_mask(cfg, jnp.asarray(mb.segment_ids), jnp.asarray(mb.subtree_end))
    _, _, aux = model(jnp.asarray(mb.tokens), jnp.asarray(mb.positions), mask, return_aux=True)
    own = np.sort(np.asarray(aux.expert_ids), -1)  # [L, B*T, K]

    def given_of(batch):
        return np.sort(batch.expert_ids.reshape(-1, *batch.expert_ids.shape[2:]).transpose(1, 0, 2), -1)

    given = given_of(mb)
    known = given[..., 0] >= 0  # [L, B*T]
    if part != "all":
        completion = given_of(micro_batch(records, shape, packing, prompt=False))[..., 0] >= 0  # same layout
        known = known & completion if part == "completion" else known & ~completion
    return float(np.mean(np.any(own != given, -1)[known])) if known.any() else 0.0


def run(tokens: int = 16, seed: int = 0) -> list[dict]:
    settings = {"fp32": ("float32", 0.0), "fp32-near-tie": ("float32", 1e-6), "bf16": ("bfloat16", 0.0)}
    rows = []
    for name, (dtype, near_tie) in settings.items():
        moe = dataclasses.replace(MOE, dtype=dtype)
        dense = dataclasses.replace(moe, num_experts=0, num_experts_per_tok=0)
        mesh, g, p = build(dense, seed=seed)
        rows.append(
            {"setting": name, "model": "dense", **gap(dense, g, p, serve(dense, mesh, g, p, tokens, seed), "off")}
        )
        mesh, g, p = build(moe, near_tie, seed)
        records = serve(moe, mesh, g, p, tokens, seed)
        for replay in ("off", "completion", "all"):
            rows.append({"setting": name, "model": f"moe, replay {replay}", **gap(moe, g, p, records, replay)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16, help="completion tokens per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/routing_replay.json"))
    args = ap.parse_args()
    rows = run(args.tokens, args.seed)
    print(f"{'setting':<15} {'model':<20} {'gap mean':>10} {'gap max':>10} {'flips':>7} {'tokens':>7}")
    for r in rows:
        fl = f"{r['flips']:.3f}" if "flips" in r else "-"
        print(f"{r['setting']:<15} {r['model']:<20} {r['mean']:>10.2e} {r['max']:>10.2e} {fl:>7} {r['tokens']:>7}")
    report = {"platform": jax.devices()[0].platform, "tokens_per_prompt": args.tokens, "prompts": len(PROMPTS),
              "seed": args.seed, "rows": rows}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
