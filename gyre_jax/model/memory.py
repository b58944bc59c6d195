"""Memory per device of a training step and a serving session, from the model config (no JAX).

The model is first principles, per token, and ``benchmarks/bench_memory_model.py`` checks it against XLA's
compiled memory analysis of the real learner micro-step on CPU (the table in docs/long_context.md). Terms:

- **weights, gradients, optimizer state**: per parameter, ``param_dtype`` bytes each for the weights and the
  gradients, two float32 AdamW moments; divided over the ``fsdp`` shards.
- **saved** (``saved_bytes``): what the backward keeps, per token and layer by ``remat_policy``: every
  intermediate of the block (``"none"``, ``_layer_values``), its matmul outputs (``"dots"``), or its input
  (``"full"``); the embedding, final norm and the float32 logits (or, with ``logits_chunk``, nothing more);
  and attention's quadratic residuals (a dense mask without remat; "dots" with the blockwise kernel).
- **working** (``working_bytes``): live beyond that at the peak: the logits' float32 working set (the whole
  row or one chunk, ``model/logprobs.py``), one block's intermediates recomputed (with remat), and one layer's
  attention scores (dense ``[H, T, S]``, or blockwise's blocks).
- Context parallelism (``context`` shards) divides the tokens of the row; ring attention holds one shard's
  keys at a time.
- **KV cache** (serving): keys and values of every layer, ``compute dtype`` bytes each.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_jax.model.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LOGIT_COPIES = 3  # float32 [T, V] beyond the saved logits: log-softmax and two gradient buffers
ADAM_BYTES = 8  # two float32 moments per parameter


@dataclass(frozen=True)
class TrainMemory:
    """Bytes per device of one training micro-step (a row of ``tokens`` tokens, B = 1)."""

    weights: float
    gradients: float
    optimizer: float
    saved: float  # what the backward keeps (``saved_bytes``)
    working: float  # live beyond it at the peak (``working_bytes``)

    @property
    def state(self) -> float:
        """What stays between steps: weights, gradients, optimizer state."""
        return self.weights + self.gradients + self.optimizer

    @property
    def per_token(self) -> float:
        """What grows with the tokens of the row."""
        return self.saved + self.working

    @property
    def total(self) -> float:
        return self.state + self.per_token


def _act_bytes(cfg: ModelConfig) -> int:
    return DTYPE_BYTES[cfg.dtype]


def _mlp_values(cfg: ModelConfig, layer: int) -> float:
    """Per token, elements the MLP keeps for the backward: gate and up projections, SiLU's three, their product
    (SwiGLU: 6 x hidden). MoE: that per chosen expert, plus the router's logits and the expert outputs."""
    if cfg.is_moe_layer(layer):
        return cfg.num_experts_per_tok * (6 * cfg.moe_mlp_dim + cfg.embed_dim) + cfg.num_experts
    return 6 * cfg.mlp_dim


def _layer_values(cfg: ModelConfig, layer: int) -> float:
    """Per token, elements one block keeps for the backward without remat (counted from JAX's saved residuals,
    ``benchmarks/bench_memory_model.py``): two RMSNorms (2E + 2 each), the residual sums (2E), q and k with their
    norms (2 x heads x D + 2 x heads), v, blockwise's padded q/k/v copies and per-head log-sum-exp, the
    attention output, RoPE's cos/sin (4D), the mask descriptors (5), and the MLP's."""
    e, d = cfg.embed_dim, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    attention = 4 * q + 3 * cfg.num_heads + 4 * kv + 2 * cfg.num_kv_heads + 4 * d + 5
    return 6 * e + 4 + attention + _mlp_values(cfg, layer)


def _layer_dots(cfg: ModelConfig, layer: int) -> float:
    """Per token, elements of one block's matmul outputs (what the "dots" remat policies save), the block input."""
    e, q, kv = cfg.embed_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if cfg.is_moe_layer(layer):
        mlp = cfg.num_experts_per_tok * (2 * cfg.moe_mlp_dim + e) + cfg.num_experts
    else:
        mlp = 2 * cfg.mlp_dim + e
    return e + q + 2 * kv + e + mlp


def _outside_layers(cfg: ModelConfig) -> float:
    """Per token, elements kept outside the blocks: the embedding (E + its index) and the final norm (2E + 2),
    whose output is also what logits chunks recompute their logits from."""
    return 3 * cfg.embed_dim + 3


def _chunked(cfg: ModelConfig, tokens: int) -> bool:
    """Whether ``model/logprobs.py`` splits a row of ``tokens`` into logits chunks (a row within one is whole)."""
    return 0 < cfg.logits_chunk < tokens


# Per token, what the backward of the vocabulary projection keeps: the learner's head is a ``LinearHead``
# (``model/logprobs.py``), whose own backward recomputes the logits and keeps only each token's float32 log-sum-exp,
# chunked or not.
HEAD_SAVED_BYTES = 4.0


def saved_bytes_per_token(cfg: ModelConfig, tokens: int) -> float:
    """What the backward keeps per token (JAX's saved residuals), for ``cfg.remat_policy``: every intermediate
    ("none"), the matmul outputs ("dots"), or each block's input ("full"). Attention's quadratic part is not
    in it (``saved_bytes`` adds it)."""
    b = _act_bytes(cfg)
    layers = range(cfg.num_layers)
    per_layer = {
        "none": lambda i: _layer_values(cfg, i),
        "full": lambda i: cfg.embed_dim,
    }.get(cfg.remat_policy, lambda i: _layer_dots(cfg, i))
    return b * (sum(per_layer(i) for i in layers) + _outside_layers(cfg)) + HEAD_SAVED_BYTES


def _square_saved(cfg: ModelConfig, tokens: int, keys: int) -> float:
    """Attention's quadratic saved residuals: over a dense mask without remat every layer keeps three float32
    ``[H, T, S]`` score-sized arrays and the bool mask; the "dots" remat policy keeps the blockwise kernel's
    block scores (a matmul output), one ``[H, T, S]`` per layer, so "dots" with "blockwise" is quadratic again;
    the "pallas" kernel's block scores live inside its pallas_call (no matmul output to save): nothing."""
    h, n, square = cfg.num_heads, cfg.num_layers, float(tokens) * keys
    if cfg.attention_impl == "pallas":
        return 0.0
    if cfg.attention_impl == "blockwise":
        return n * 4.0 * h * square if cfg.remat_policy in ("dots", "dots_no_batch") else 0.0
    if cfg.remat_policy != "none":
        return 0.0
    return n * (square if cfg.attention_impl == "cudnn" else 3 * 4.0 * h * square + square)


def saved_bytes(cfg: ModelConfig, tokens: int, keys: int | None = None) -> float:
    """What the backward keeps for a row of ``tokens`` queries over ``keys`` keys (default: the same tokens)."""
    return saved_bytes_per_token(cfg, tokens) * tokens + _square_saved(cfg, tokens, tokens if keys is None else keys)


def working_bytes(cfg: ModelConfig, tokens: int, keys: int | None = None) -> float:
    """Live beyond what is saved, at the peak: the logits' float32 working set (the whole row or one chunk), one
    block's intermediates recomputed (with remat), and one layer's attention scores (dense: three float32
    ``[H, T, S]`` and the mask; cuDNN: the mask; blockwise: three blocks; pallas: its backward's f32 gradients)."""
    s = tokens if keys is None else keys
    live = cfg.logits_chunk if _chunked(cfg, tokens) else tokens
    logits = LOGIT_COPIES * 4.0 * cfg.vocab_size * live
    recompute = 0.0
    if cfg.remat_policy != "none":
        recompute = _act_bytes(cfg) * tokens * max(_layer_values(cfg, i) for i in range(cfg.num_layers))
    square = float(tokens) * s
    attention = {
        "blockwise": 4.0 * cfg.num_heads * 3 * cfg.attention_block_q * cfg.attention_block_k,
        # pallas: blocks stay in the kernel; its backward's f32 dQ and per-query-head dK, dV are linear in T
        "pallas": 4.0 * cfg.num_heads * cfg.head_dim * (tokens + 2 * s),
        "cudnn": square,
    }.get(cfg.attention_impl, 3 * 4.0 * cfg.num_heads * square + square)
    return logits + recompute + attention


def train_memory(cfg: ModelConfig, tokens: int, *, context: int = 1, fsdp: int = 1) -> TrainMemory:
    """Bytes per device of a micro-step on one row of ``tokens`` tokens, its tokens over ``context`` shards
    (ring attention: each shard's queries meet one shard's key block at a time) and the parameters, gradients
    and optimizer state over ``fsdp`` shards."""
    if context < 1 or fsdp < 1:
        raise ValueError(f"context={context} and fsdp={fsdp} must be >= 1 (shard counts)")
    local = -(-tokens // context)
    n = cfg.num_params
    return TrainMemory(
        weights=n * DTYPE_BYTES[cfg.param_dtype] / fsdp,
        gradients=n * DTYPE_BYTES[cfg.param_dtype] / fsdp,
        optimizer=n * ADAM_BYTES / fsdp,
        saved=saved_bytes(cfg, local, local),
        working=working_bytes(cfg, local, local),
    )


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    """Serving: keys and values of every layer for one token, in the compute dtype."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * _act_bytes(cfg)


def min_context_shards(cfg: ModelConfig, tokens: int, budget: float, *, fsdp: int = 1, limit: int = 1024) -> int:
    """The fewest context shards (a power of two) whose micro-step fits ``budget`` bytes per device; 0 when even
    ``limit`` shards do not (the weights and optimizer state alone exceed the budget: raise ``fsdp``)."""
    c = 1
    while c <= limit:
        if train_memory(cfg, tokens, context=c, fsdp=fsdp).total <= budget:
            return c
        c *= 2
    return 0
