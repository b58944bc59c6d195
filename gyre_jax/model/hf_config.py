"""Hugging Face ``config.json`` <-> ``ModelConfig`` fields: which HF Qwen3 / Qwen3-MoE configs this
implementation computes, and how their keys (transformers 4.x and 5.x spellings, RoPE scaling, MoE) map
onto ours and back. ``ModelConfig.from_hf_config`` / ``to_hf_config`` are the entry points.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gyre_jax.model.config import HF_ARCHITECTURES, ROPE_TYPES, ConfigMismatchError, yarn_mscale

if TYPE_CHECKING:
    from gyre_jax.model.config import ModelConfig


def model_kwargs(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments from a Hugging Face config dict (not yet validated by ``ModelConfig``).

    Raises ConfigMismatchError for a model type or feature this implementation does not compute."""
    model_type = _check_supported(hf)
    num_heads = int(hf["num_attention_heads"])
    kw: dict[str, Any] = dict(
        vocab_size=int(hf["vocab_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        embed_dim=int(hf["hidden_size"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // num_heads),
        mlp_dim=int(hf["intermediate_size"]),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        **_rope_kwargs(hf),
    )
    if model_type == "qwen3_moe":
        kw.update(
            num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 0))),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_mlp_dim=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        )
    return kw


def _check_supported(hf: Mapping[str, Any]) -> str:
    """The config's ``model_type``; raises ConfigMismatchError for what this implementation does not compute."""
    model_type = hf.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise ConfigMismatchError(
            f"config.json model_type={model_type!r} is not supported: expected one of {tuple(HF_ARCHITECTURES)} "
            f"({', '.join(HF_ARCHITECTURES.values())})"
        )
    archs = hf.get("architectures") or [HF_ARCHITECTURES[model_type]]
    if archs[0] != HF_ARCHITECTURES[model_type]:
        raise ConfigMismatchError(
            f"config.json architectures={archs} is not supported: expected "
            f"[{HF_ARCHITECTURES[model_type]!r}] (a causal LM) for model_type {model_type!r}"
        )
    if hf.get("use_sliding_window"):
        raise ConfigMismatchError("config.json use_sliding_window=true: sliding-window attention is not supported yet")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigMismatchError(f"config.json hidden_act={hf.get('hidden_act')!r}: only 'silu' (SwiGLU) is supported")
    return model_type


def _rope_kwargs(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The ``rope_*`` fields, from ``rope_parameters`` (transformers >= 5) over the legacy ``rope_scaling``."""
    rope = {**(hf.get("rope_scaling") or {}), **dict(hf.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigMismatchError(f"config.json rope type {rope_type!r} is not supported yet; supported: {ROPE_TYPES}")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigMismatchError("config.json partial_rotary_factor != 1 is not supported yet")
    kw: dict[str, Any] = {
        "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "rope_type": rope_type,
    }
    if rope_type != "default":
        kw["rope_factor"] = float(rope["factor"])
    if rope_type == "yarn":
        factor = kw["rope_factor"]
        kw["rope_original_max_position"] = int(rope["original_max_position_embeddings"])
        kw["rope_beta_fast"] = float(rope.get("beta_fast") or 32.0)
        kw["rope_beta_slow"] = float(rope.get("beta_slow") or 1.0)
        kw["rope_truncate"] = bool(rope.get("truncate", True))
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
            attention_factor = (
                yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                if mscale and mscale_all
                else yarn_mscale(factor)
            )
        kw["rope_attention_factor"] = float(attention_factor)
    return kw


def hf_config(cfg: ModelConfig, torch_dtype: str | None = None) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict for ``cfg`` (transformers 4.x and 5.x both read it)."""
    model_type = "qwen3_moe" if cfg.is_moe else "qwen3"
    out: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.embed_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "torch_dtype": torch_dtype or cfg.param_dtype,
    }
    if cfg.rope_type == "yarn":
        out["max_position_embeddings"] = int(cfg.rope_original_max_position * cfg.rope_factor)
    if cfg.is_moe:
        out.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_mlp_dim,
            norm_topk_prob=cfg.norm_topk_prob,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
        )
    return out


def _rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    """HF ``rope_scaling`` of ``cfg`` (None for plain RoPE)."""
    if cfg.rope_type == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_factor}
    if cfg.rope_type == "yarn":
        return {
            "rope_type": "yarn",
            "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position,
            "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow,
            "attention_factor": cfg.yarn_attention_factor,
            "truncate": cfg.rope_truncate,
        }
    return None
