"""GGUF metadata and tensor names <-> ``ModelConfig`` and Hugging Face names: which GGUF models this implementation
computes (architectures ``llama``, ``qwen2``, ``qwen3``, dense), how llama.cpp's keys (``llama.block_count`` ...) map
onto our fields and back, and llama.cpp's row permutation of Llama's q/k projections.

Pure mapping, no I/O: ``gguf_checkpoint.py`` reads and writes the files. The names follow llama.cpp's
``convert_hf_to_gguf.py`` (``blk.{i}.attn_q.weight`` <-> ``model.layers.{i}.self_attn.q_proj.weight``); the keys its
``gguf-py`` ``constants.py`` (``{arch}.attention.head_count`` ...).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from gyre_jax.model.config import ConfigMismatchError, ModelConfig

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # general.architecture values loaded here (= our family)
# Architectures whose q/k rows llama.cpp's converter permutes (``LlamaModel.permute``: its rope kernel for them rotates
# adjacent pairs, HF's rotates halves); qwen2 / qwen3 use the "neox" rope, HF's layout, and are stored as they are.
PERMUTED_QK = ("llama",)
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's Llama 3 rope: per-pair frequency divisors [D/2], no parameter of ours

# GGUF tensor name -> HF name, per layer ({i}) and global
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_HF_LAYER = {v: k for k, v in _LAYER.items()}
_HF_GLOBAL = {v: k for k, v in _GLOBAL.items()}
_BLK = re.compile(r"blk\.(\d+)\.(.+)")
_HF_BLK = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor (None for one with no HF counterpart, e.g. an unknown name or ``rope_freqs``)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


def gguf_name(hf: str) -> str:
    """The GGUF name of an HF tensor name (``hf_name``'s inverse); KeyError for a name GGUF has no slot for."""
    if hf in _HF_GLOBAL:
        return _HF_GLOBAL[hf]
    m = _HF_BLK.fullmatch(hf)
    if not m or m.group(2) not in _HF_LAYER:
        raise KeyError(f"no GGUF name for tensor {hf}")
    return f"blk.{m.group(1)}.{_HF_LAYER[m.group(2)]}"


def qk_heads(arch: str, hf: str, cfg: ModelConfig) -> int:
    """How many heads llama.cpp permuted the rows of tensor ``hf`` (HF name) over: ``num_heads`` for q_proj,
    ``num_kv_heads`` for k_proj (weights and biases) of a ``PERMUTED_QK`` architecture; 0 = stored as in HF."""
    if arch not in PERMUTED_QK:
        return 0
    if ".self_attn.q_proj." in hf:
        return cfg.num_heads
    if ".self_attn.k_proj." in hf:
        return cfg.num_kv_heads
    return 0


def gguf_rows(heads: int, rows: int) -> np.ndarray:
    """[rows] int: for each HF row (head h, dim j of D = rows / heads) the row llama.cpp stores it at.

    llama.cpp's ``permute`` views each head's D rows as [2, D/2] (HF's halves) and stores them as [D/2, 2]:
    HF row (h, half, i) is GGUF row h * D + 2 * i + half. Reading GGUF rows ``gguf_rows(...)[r0:r1]`` gives HF rows
    r0..r1 (the un-permutation); writing HF row ``gguf_rows(...).argsort()[g]`` at GGUF row g redoes it."""
    d = rows // heads
    h, half, i = np.meshgrid(np.arange(heads), np.arange(2), np.arange(d // 2), indexing="ij")  # [heads, 2, D/2]
    return (h * d + 2 * i + half).reshape(-1)


def _field(meta: Mapping[str, Any], key: str, kind: type, source: str, default: Any = None) -> Any:
    """``meta[key]`` as ``kind``; ``default`` when absent (None: required, ConfigMismatchError naming the key)."""
    value = meta.get(key)
    if value is None:
        if default is None:
            raise ConfigMismatchError(
                f"{source} has no metadata key {key!r}: the file is not a complete llama.cpp model; convert the model "
                "again with llama.cpp's convert_hf_to_gguf.py"
            )
        return default
    if isinstance(value, (list, tuple, np.ndarray)):
        raise ConfigMismatchError(f"{source}: {key}={list(value)[:8]} is a per-layer array: not supported yet")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigMismatchError(f"{source}: {key}={value!r} is not {kind.__name__}") from None


def model_kwargs(meta: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]], source: str) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments from a GGUF file's metadata (scalar keys) and tensor shapes (GGUF names ->
    HF/numpy order shapes). Raises ConfigMismatchError naming ``source`` for an architecture or feature this
    implementation does not compute, or a required key that is absent."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigMismatchError(
            f"{source}: general.architecture={arch!r} is not supported: expected one of {ARCHITECTURES}"
        )

    def get(key, kind=int, default=None):
        return _field(meta, f"{arch}.{key}", kind, source, default)

    if get("expert_count", int, 0):
        raise ConfigMismatchError(
            f"{source}: {arch}.expert_count > 0: mixture-of-experts GGUF files are not supported yet"
        )
    embed, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", int, embed // max(heads, 1))
    if get("attention.value_length", int, head_dim) != head_dim:
        raise ConfigMismatchError(f"{source}: {arch}.attention.value_length != key_length is not supported")
    if get("rope.dimension_count", int, head_dim) != head_dim:
        raise ConfigMismatchError(
            f"{source}: {arch}.rope.dimension_count={get('rope.dimension_count')} != head_dim {head_dim}: partial "
            "rotary embeddings are not supported yet"
        )
    if get("attention.sliding_window", int, 0):
        raise ConfigMismatchError(
            f"{source}: {arch}.attention.sliding_window: sliding-window attention is not supported"
        )
    embd = tensor_shapes.get("token_embd.weight")
    vocab = get("vocab_size", int, embd[0] if embd else None)
    kw: dict[str, Any] = dict(
        family=arch,
        vocab_size=vocab,
        num_layers=get("block_count"),
        embed_dim=embed,
        num_heads=heads,
        num_kv_heads=get("attention.head_count_kv", int, heads),
        head_dim=head_dim,
        mlp_dim=get("feed_forward_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", float),
        rope_theta=get("rope.freq_base", float, 10000.0),
        tie_embeddings="output.weight" not in tensor_shapes,
        attention_bias=arch != "qwen2" and "blk.0.attn_output.bias" in tensor_shapes,
    )
    kw.update(_rope_kwargs(meta, arch, source))
    return kw


def _rope_kwargs(meta: Mapping[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The ``rope_*`` fields from ``{arch}.rope.scaling.*`` (``rope_freqs`` is checked against them at load)."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return {}
    factor = _field(meta, f"{arch}.rope.scaling.factor", float, source)
    if kind == "linear":
        return {"rope_type": "linear", "rope_factor": factor}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "rope_factor": factor,
            "rope_original_max_position": _field(meta, f"{arch}.rope.scaling.original_context_length", int, source),
            "rope_beta_fast": _field(meta, f"{arch}.rope.scaling.yarn_beta_fast", float, source, 32.0),
            "rope_beta_slow": _field(meta, f"{arch}.rope.scaling.yarn_beta_slow", float, source, 1.0),
        }
    raise ConfigMismatchError(f"{source}: {arch}.rope.scaling.type={kind!r} is not supported (none, linear, yarn)")


# Llama 3.1's rope_scaling, the one llama.cpp's converter writes as a rope_freqs tensor (its metadata keeps no
# parameters): a rope_freqs tensor is accepted when it equals the divisors these give, with factor = its maximum.
LLAMA3_ROPE = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "rope_original_max_position": 8192}


def llama3_divisors(cfg: ModelConfig) -> np.ndarray:
    """[D/2] float32: what llama.cpp's ``rope_freqs`` holds for a ``rope_type="llama3"`` config (the default
    frequencies divided by these give Llama 3's, as ``generate_extra_tensors`` in convert_hf_to_gguf.py)."""
    from gyre_jax.model.positional_embeddings import default_inv_freq, llama3_inv_freq

    return (default_inv_freq(cfg.head_dim, cfg.rope_theta) / llama3_inv_freq(cfg)).astype(np.float32)


def rope_from_freqs(divisors: np.ndarray, kw: dict[str, Any], source: str) -> dict[str, Any]:
    """The Llama 3 ``rope_*`` fields a ``rope_freqs`` tensor ([D/2] divisors) stands for; ConfigMismatchError when it
    is not Llama 3.1's scaling (``LLAMA3_ROPE``) with some factor."""
    factor = float(np.max(divisors))
    if factor == 1.0 and np.all(divisors == 1.0):
        return {}
    rope = dict(LLAMA3_ROPE, rope_type="llama3", rope_factor=factor)
    cfg = ModelConfig(**{**kw, **rope})
    expected = llama3_divisors(cfg)
    if divisors.shape != expected.shape or not np.allclose(divisors, expected, rtol=1e-5):
        raise ConfigMismatchError(
            f"{source}: tensor {ROPE_FREQS} is not Llama 3.1's rope scaling (factor {factor}, low/high frequency "
            f"factors 1 and 4, original context 8192): other per-frequency rope factors are not supported yet"
        )
    return rope


# -- export ------------------------------------------------------------------------------------------------------


def gguf_metadata(cfg: ModelConfig, context_length: int) -> dict[str, Any]:
    """The architecture keys (``{arch}.*``) of a GGUF file for ``cfg`` (llama.cpp's converter's; values as Python
    ints / floats, typed by the writer). ``context_length``: the model's trained context (``max_position_embeddings``)."""
    if cfg.is_moe or cfg.family not in ARCHITECTURES:
        raise ValueError(f"not supported yet: GGUF export of a {cfg.hf_model_type} model (dense {ARCHITECTURES} only)")
    a = cfg.family
    meta: dict[str, Any] = {
        f"{a}.context_length": int(context_length),
        f"{a}.embedding_length": cfg.embed_dim,
        f"{a}.block_count": cfg.num_layers,
        f"{a}.feed_forward_length": cfg.mlp_dim,
        f"{a}.attention.head_count": cfg.num_heads,
        f"{a}.attention.head_count_kv": cfg.num_kv_heads,
        f"{a}.rope.freq_base": float(cfg.rope_theta),
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{a}.vocab_size": cfg.vocab_size,
        f"{a}.rope.dimension_count": cfg.head_dim,
    }
    if cfg.head_dim * cfg.num_heads != cfg.embed_dim:
        meta[f"{a}.attention.key_length"] = cfg.head_dim
        meta[f"{a}.attention.value_length"] = cfg.head_dim
    if cfg.rope_type == "linear":
        meta[f"{a}.rope.scaling.type"] = "linear"
        meta[f"{a}.rope.scaling.factor"] = float(cfg.rope_factor)
    elif cfg.rope_type == "yarn":
        if not math.isclose(cfg.yarn_attention_factor, 0.1 * math.log(cfg.rope_factor) + 1.0) or not cfg.rope_truncate:
            raise ValueError("not supported yet: GGUF export of YaRN with a custom attention factor or truncate=False")
        meta.update({
            f"{a}.rope.scaling.type": "yarn",
            f"{a}.rope.scaling.factor": float(cfg.rope_factor),
            f"{a}.rope.scaling.original_context_length": cfg.rope_original_max_position,
            f"{a}.rope.scaling.yarn_beta_fast": float(cfg.rope_beta_fast),
            f"{a}.rope.scaling.yarn_beta_slow": float(cfg.rope_beta_slow),
        })  # fmt: skip
    return meta  # llama3 rope: the rope_freqs tensor (``llama3_divisors``), no keys
