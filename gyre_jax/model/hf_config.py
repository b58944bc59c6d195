"""Hugging Face ``config.json`` <-> ``ModelConfig`` fields: which HF Qwen3 / Qwen3-MoE / Llama / Qwen2 configs this
implementation computes, and how their keys (transformers 4.x and 5.x spellings, RoPE scaling, MoE) map
onto ours and back. ``ModelConfig.from_hf_config`` / ``to_hf_config`` are the entry points.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gyre_jax.model.config import HF_ARCHITECTURES, ROPE_TYPES, ConfigMismatchError, yarn_mscale

if TYPE_CHECKING:
    from gyre_jax.model.config import ModelConfig


# transformers' defaults for keys a config.json may leave out (configuration_qwen3.py, configuration_qwen3_moe.py,
# configuration_llama.py, configuration_qwen2.py; Qwen3-MoE and Qwen2 have no head_dim field and Llama's is None: their
# modeling code falls back to hidden_size // num_attention_heads; Llama's num_key_value_heads None means
# num_attention_heads, as an absent key does here). The sizes
# that fix every tensor's shape (vocab_size, hidden_size, intermediate_size, num_hidden_layers,
# num_attention_heads, the MoE sizes) are required instead: transformers' defaults for them are one model's
# (Qwen3-8B's, Qwen3-30B-A3B's), which weights whose config lacks them cannot match.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 128, "num_key_value_heads": 32, "max_position_embeddings": 32768},
    "qwen3_moe": {"num_key_value_heads": 4, "max_position_embeddings": 32768},
    "llama": {"max_position_embeddings": 2048},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
}
# Defaulted keys that change tensor shapes: a checkpoint that does not match names them (``defaulted_shape_keys``).
SHAPE_KEYS = ("head_dim", "num_key_value_heads")
_REQUIRED = object()


_KINDS = {int: "an integer", float: "a number", bool: "true or false"}
_SHAPE_KEY = "the weights' shapes depend on it, and transformers' default is another model's size"


def _value(
    hf: Mapping[str, Any], key: str, kind: type, source: str, default: Any = _REQUIRED, where: str = "",
    why: str = _SHAPE_KEY,
) -> Any:  # fmt: skip
    """``hf[key]`` as ``kind``; ``default`` when absent (or null); ConfigMismatchError naming the key and ``source``
    when a required key is absent (``why``: why it has no default) or a value is not a ``kind``. ``where``: the
    enclosing key, e.g. "rope_scaling "."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigMismatchError(
                f"{source} has no {where}{key!r} ({why}): copy it from the model's original config.json"
            )
        return default
    try:
        if kind in (int, float) and isinstance(value, (bool, str)):
            raise TypeError(value)
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigMismatchError(f"{source}: {where}{key}={value!r} is not {_KINDS[kind]}") from None


def model_kwargs(hf: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """``ModelConfig`` keyword arguments from a Hugging Face config dict (not yet validated by ``ModelConfig``).

    Absent keys take transformers' defaults (``HF_DEFAULTS``) where it has usable ones. Raises
    ConfigMismatchError, naming ``source`` (the file), for a model type or feature this implementation does not
    compute, a required key that is absent or a value of the wrong type."""
    model_type = _check_supported(hf, source)
    defaults = HF_DEFAULTS[model_type]

    def get(key, kind=int, default=_REQUIRED):
        return _value(hf, key, kind, source, defaults.get(key, default))

    num_heads, hidden = get("num_attention_heads"), get("hidden_size")
    head_dim = get("head_dim", int, hidden // max(num_heads, 1))
    kv_heads = num_heads if "num_key_value_heads" in hf and hf["num_key_value_heads"] is None else None
    if model_type == "llama" and hf.get("num_key_value_heads") is None:
        kv_heads = num_heads  # LlamaConfig: None (or absent) = multi-head attention
    kw: dict[str, Any] = dict(
        family="qwen3" if model_type == "qwen3_moe" else model_type,
        vocab_size=get("vocab_size"),
        num_layers=get("num_hidden_layers"),
        embed_dim=hidden,
        num_heads=num_heads,
        num_kv_heads=kv_heads or get("num_key_value_heads"),
        head_dim=head_dim,
        mlp_dim=get("intermediate_size"),
        rms_norm_eps=get("rms_norm_eps", float, 1e-6),
        tie_embeddings=get("tie_word_embeddings", bool, False),
        attention_bias=model_type != "qwen2" and get("attention_bias", bool, False),
        **_rope_kwargs(hf, source, get("max_position_embeddings")),
    )
    if model_type == "qwen3_moe":
        experts = hf.get("num_experts") if hf.get("num_experts") is not None else hf.get("num_local_experts")
        kw.update(
            num_experts=_value({"num_experts": experts}, "num_experts", int, source),
            num_experts_per_tok=get("num_experts_per_tok"),
            moe_mlp_dim=get("moe_intermediate_size"),
            norm_topk_prob=get("norm_topk_prob", bool, False),
            router_aux_loss_coef=get("router_aux_loss_coef", float, 0.001),
            decoder_sparse_step=get("decoder_sparse_step", int, 1),
            mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        )
    return kw


def defaulted_shape_keys(hf: Mapping[str, Any]) -> list[str]:
    """``key=value`` for each shape-changing key (``SHAPE_KEYS``) absent from ``hf`` and taken from transformers'
    defaults: what to name when the weights do not match (e.g. a dense config without head_dim: 128)."""
    model_type = hf.get("model_type")
    defaults = HF_DEFAULTS.get(model_type, {})
    return [f"{k}={defaults[k]}" for k in SHAPE_KEYS if k not in hf and k in defaults]


def _check_supported(hf: Mapping[str, Any], source: str) -> str:
    """The config's ``model_type``; raises ConfigMismatchError for what this implementation does not compute."""
    model_type = hf.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise ConfigMismatchError(
            f"{source}: model_type={model_type!r} is not supported: expected one of {tuple(HF_ARCHITECTURES)} "
            f"({', '.join(HF_ARCHITECTURES.values())})"
        )
    archs = hf.get("architectures") or [HF_ARCHITECTURES[model_type]]
    if archs[0] != HF_ARCHITECTURES[model_type]:
        raise ConfigMismatchError(
            f"{source}: architectures={archs} is not supported: expected "
            f"[{HF_ARCHITECTURES[model_type]!r}] (a causal LM) for model_type {model_type!r}"
        )
    if hf.get("use_sliding_window"):
        raise ConfigMismatchError(f"{source}: use_sliding_window=true: sliding-window attention is not supported yet")
    if hf.get("mlp_bias"):
        raise ConfigMismatchError(f"{source}: mlp_bias=true: MLP biases are not supported yet")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigMismatchError(f"{source}: hidden_act={hf.get('hidden_act')!r}: only 'silu' (SwiGLU) is supported")
    return model_type


def _rope_kwargs(hf: Mapping[str, Any], source: str, max_position: int) -> dict[str, Any]:
    """The ``rope_*`` fields, from ``rope_parameters`` (transformers >= 5) over the legacy ``rope_scaling``.
    ``max_position``: ``max_position_embeddings``, YaRN's pre-scaling length when the config has no
    ``original_max_position_embeddings`` (as transformers does)."""
    rope = {**(hf.get("rope_scaling") or {}), **dict(hf.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigMismatchError(f"{source}: rope type {rope_type!r} is not supported yet; supported: {ROPE_TYPES}")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigMismatchError(f"{source}: partial_rotary_factor != 1 is not supported yet")
    where = f"rope_scaling (rope_type {rope_type!r}) "
    kw: dict[str, Any] = {
        "rope_theta": _value(rope, "rope_theta", float, source, _value(hf, "rope_theta", float, source, 10000.0)),
        "rope_type": rope_type,
    }
    if rope_type != "default":
        kw["rope_factor"] = _value(rope, "factor", float, source, where=where, why="transformers requires it too")
    if rope_type == "llama3":
        kw["rope_original_max_position"] = _value(
            rope, "original_max_position_embeddings", int, source, max_position, where=where
        )
        kw["rope_low_freq_factor"] = _value(rope, "low_freq_factor", float, source, where=where, why="transformers "
                                            "requires it too")  # fmt: skip
        kw["rope_high_freq_factor"] = _value(rope, "high_freq_factor", float, source, where=where, why="transformers "
                                             "requires it too")  # fmt: skip
    if rope_type == "yarn":
        factor = kw["rope_factor"]
        kw["rope_original_max_position"] = _value(rope, "original_max_position_embeddings", int, source, max_position)
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
    model_type = cfg.hf_model_type
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
    if cfg.family == "llama":
        del out["use_sliding_window"]
        out["mlp_bias"] = False
    if cfg.family == "qwen2":
        del out["attention_bias"]  # Qwen2's q/k/v biases are not optional
    if cfg.rope_type in ("yarn", "llama3"):
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
    if cfg.rope_type == "llama3":
        return {
            "rope_type": "llama3",
            "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
        }
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
