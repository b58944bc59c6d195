"""Routing replay end to end on the tiny MoE: what serving records is what the model routed, and replaying it in
the learner's forward closes the train/serve log-prob gap that a routing-changing perturbation opens.

The gap numbers come from ``benchmarks/routing_replay.py`` (serving engine -> TITO records through JSON ->
branches -> prefix tree -> packed micro-batch -> ``rl.micro_step.token_logprobs``)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timelimits import scaled

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import routing_replay as rr  # noqa: E402

from gyre_jax.model.attention import segment_causal_mask  # noqa: E402
from gyre_jax.model.rules import RULES_DATA  # noqa: E402
from gyre_jax.serving.engine import Engine  # noqa: E402
from gyre_jax.serving.loop import ServingLoop  # noqa: E402
from gyre_jax.serving.types import GenerationRequest, SamplingParams  # noqa: E402


def test_replay_closes_the_gap_that_near_tied_routers_open_down_to_the_dense_paths() -> None:
    """fp32 on CPU, router columns nearly tied (1e-6): rounding differences between the serving and training
    forwards flip some top-k choices. Replaying the recorded experts (prompt and completion) leaves the gap of
    a dense model's two forwards (float rounding); without replay it is orders of magnitude larger."""
    moe = rr.MOE
    dense = dataclasses.replace(moe, num_experts=0, num_experts_per_tok=0)
    mesh, g, p = rr.build(dense)
    floor = rr.gap(dense, g, p, rr.serve(dense, mesh, g, p, 16), "off")
    mesh, g, p = rr.build(moe, near_tie=1e-6)
    records = rr.serve(moe, mesh, g, p, 16)
    off, replay = rr.gap(moe, g, p, records, "off"), rr.gap(moe, g, p, records, "all")
    assert off["flips"] > 0.02  # the perturbation really changed routing
    assert floor["max"] < 1e-5 and replay["max"] <= 2 * floor["max"] + 1e-6  # the dense path's gap
    assert off["mean"] > 1e3 * replay["mean"] and off["max"] > 1e-2
    # completion-only replay: the prompt tokens' routing flips too (ties 1e-8 apart flip on any CPU; at 1e-6 which
    # tokens flip depends on the CPU's float rounding), and the changed context keeps the gap open
    mesh, g, p = rr.build(moe, near_tie=1e-8)
    records = rr.serve(moe, mesh, g, p, 16)
    assert rr.flips(moe, g, p, records, part="prompt") > 0.02
    replay = rr.gap(moe, g, p, records, "all")
    assert replay["max"] <= 2 * floor["max"] + 1e-6
    assert rr.gap(moe, g, p, records, "completion")["mean"] > 100 * replay["mean"]


def _recording_engine(cfg, slots: int) -> tuple:
    """(graphdef, params, an ``Engine`` recording experts: ``slots`` slots x 64 tokens, prefill buckets 8 and 16)."""
    mesh, graphdef, params = rr.build(cfg)
    engine = Engine(
        cfg, graphdef, mesh, RULES_DATA, max_concurrent_decodes=slots, max_seq_len=64, max_prefill_length=16,
        prefill_buckets=(8, 16), record_experts=True,
    )  # fmt: skip
    return graphdef, params, engine


def test_the_serving_loop_reports_the_experts_the_model_routed_each_token_to() -> None:
    """Through the pipelined serving loop (prefill in chunks, decode): the prompt's and the completion's expert
    ids equal the MoE layers' own top-k in one full forward over prompt + completion (fp32, no near ties)."""
    cfg = rr.MOE
    graphdef, params, engine = _recording_engine(cfg, slots=2)
    loop = ServingLoop(engine, params, prefill_chunk=8).start()
    prompt = [3, 9, 17, 4, 22, 5, 31, 8, 40, 2, 11]  # two prefill chunks
    try:
        result = loop.submit(
            GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(temperature=1.0, max_tokens=9, seed=3))
        ).result(timeout=scaled(600))
    finally:
        loop.stop()
    n, layers, k = len(result.token_ids), cfg.num_moe_layers, cfg.num_experts_per_tok
    assert n == 9 and result.expert_ids.shape == (n, layers, k) and result.prompt_expert_ids.shape == (11, layers, k)
    assert (result.expert_ids[-1] == -1).all()  # the last token was never fed back
    tokens = jnp.asarray([prompt + result.token_ids[:-1]], jnp.int32)
    t = tokens.shape[1]
    _, _, aux = nnx.merge(graphdef, params)(
        tokens, jnp.arange(t, dtype=jnp.int32)[None], segment_causal_mask(jnp.ones((1, t), jnp.int32)), return_aux=True
    )
    own = np.sort(np.asarray(jax.device_get(aux.expert_ids)).transpose(1, 0, 2), -1)  # [t, L, K]
    np.testing.assert_array_equal(np.sort(result.prompt_expert_ids, -1), own[: len(prompt)])
    np.testing.assert_array_equal(np.sort(result.expert_ids[:-1], -1), own[len(prompt) :])


def test_prompts_prefilled_packed_record_the_experts_of_each_prompt_alone() -> None:
    """``prefill_many`` packs 3 prompts into 2 rows: each prompt's recorded expert ids (and first token) are those
    ``prefill`` of it alone records, -1 past its length."""
    cfg = rr.MOE
    _, params, engine = _recording_engine(cfg, slots=4)
    prompts = [[3, 9, 17, 4, 22, 5, 31, 8, 40, 2, 11], [7, 1, 30], [12, 6, 25, 14]]  # 11 + 3 | 4 in rows of 16
    greedy, key = SamplingParams(temperature=0.0), jnp.zeros((2,), jnp.uint32)
    many = jax.device_get(
        engine.dense.prefill_many(params=params, prompts=prompts, sampling=[greedy] * 3, keys=[key] * 3)
    )
    assert many.experts.shape == (4, 16, cfg.num_moe_layers, cfg.num_experts_per_tok)
    for i, p in enumerate(prompts):
        alone = jax.device_get(engine.dense.prefill(params=params, tokens=p, sampling_params=greedy, key=key))
        assert int(many.token[i]) == int(alone.token)
        np.testing.assert_array_equal(many.experts[i, : len(p)], alone.experts[: len(p)])
        assert (many.experts[i, len(p) :] == -1).all()
