"""Where each of our parameters lives in a Hugging Face checkpoint (Qwen3, Qwen3-MoE, Llama, Qwen2: one naming
scheme, ``model.layers.{i}.self_attn.q_proj.weight`` ...), and how its layout differs.

Pure mapping, no I/O. For every parameter of ``Transformer(cfg)`` (a path in its ``nnx.State``)
``param_specs(cfg)`` gives a ``ParamSpec``: the HF tensor name(s) and a layout. Layouts:

- ``linear``: a PyTorch ``nn.Linear`` weight ``[out, in]`` (flattened dims); ours is its transpose,
  reshaped to ``in_dims + out_dims`` (e.g. q_proj ``[H*D, E]`` -> ``[E, H, D]``).
- ``reshape``: same element order: ours is the HF tensor as is (embedding ``[V, E]``, norm scales) or
  its 1-D form reshaped (biases ``[H*D]`` -> ``[H, D]``).
- ``stacked``: one HF ``linear`` tensor per expert, stacked on our leading expert axis.

With ``cfg.scan_layers`` our decoder layers are stacked (``model/layer_stack.py``): ``model_specs(cfg)`` maps each
stacked parameter (``("layers", "attn", "q_proj", "w")``, ``[L, ...]``) to a ``LayerStack`` of the per-layer
specs, read layer by layer into its leading axis. ``param_specs`` is always per layer (HF's own layout).

``read_block`` computes one block (a shard) of our array from lazily sliced HF tensors, reading
only the rows and columns that block needs; ``to_hf`` converts a whole host array back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gyre_jax.model.config import ModelConfig

Path = tuple[str, ...]
# reader(hf_name, index) -> np.ndarray: index is a tuple of slices over the HF tensor's own shape
SliceReader = Callable[[str, tuple[slice, ...]], np.ndarray]


@dataclass(frozen=True)
class ParamSpec:
    path: Path  # our nnx.State path, e.g. ("layers", "0", "attn", "q_proj", "w")
    hf_names: tuple[str, ...]  # one name, or one per expert for "stacked"
    layout: str  # "linear" | "reshape" | "stacked"
    in_dims: tuple[int, ...] = ()  # linear / stacked: our leading dims, flattened into HF's second dim
    out_dims: tuple[int, ...] = ()  # our trailing dims, flattened into HF's first dim (reshape: all dims)
    same_shape: bool = False  # reshape: the HF tensor has our shape (else it is 1-D)

    @property
    def shape(self) -> tuple[int, ...]:
        """Our array's shape."""
        lead = (len(self.hf_names),) if self.layout == "stacked" else ()
        return lead + self.in_dims + self.out_dims

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape of each HF tensor."""
        if self.layout == "reshape":
            return self.out_dims if self.same_shape else (int(np.prod(self.out_dims)),)
        return (int(np.prod(self.out_dims)), int(np.prod(self.in_dims)))


def param_specs(cfg: ModelConfig) -> dict[Path, ParamSpec]:
    """Every parameter of ``Transformer(cfg)`` -> its ParamSpec (our paths use string keys: "layers", "3", ...)."""
    e, d, v = cfg.embed_dim, cfg.head_dim, cfg.vocab_size
    specs: list[ParamSpec] = [
        ParamSpec(("embedder", "table"), ("model.embed_tokens.weight",), "reshape", out_dims=(v, e), same_shape=True),
        ParamSpec(("final_norm", "scale"), ("model.norm.weight",), "reshape", out_dims=(e,)),
    ]
    if not cfg.tie_embeddings:
        specs.append(ParamSpec(("lm_head", "w"), ("lm_head.weight",), "linear", in_dims=(e,), out_dims=(v,)))
    for i in range(cfg.num_layers):
        ours = ("layers", str(i))
        hf = f"model.layers.{i}"
        specs += _attention_specs(cfg, ours, hf)
        if cfg.qk_norm:
            specs += [
                ParamSpec(ours + ("attn", n, "scale"), (f"{hf}.self_attn.{n}.weight",), "reshape", out_dims=(d,))
                for n in ("q_norm", "k_norm")
            ]
        specs += [
            ParamSpec(ours + ("input_norm", "scale"), (f"{hf}.input_layernorm.weight",), "reshape", out_dims=(e,)),
            ParamSpec(
                ours + ("post_attn_norm", "scale"), (f"{hf}.post_attention_layernorm.weight",), "reshape", out_dims=(e,)
            ),
        ]
        if cfg.is_moe_layer(i):
            x, m = cfg.num_experts, cfg.moe_mlp_dim
            specs.append(
                ParamSpec(ours + ("moe", "router"), (f"{hf}.mlp.gate.weight",), "linear", in_dims=(e,), out_dims=(x,))
            )
            for name, in_dims, out_dims in (
                ("gate_proj", (e,), (m,)),
                ("up_proj", (e,), (m,)),
                ("down_proj", (m,), (e,)),
            ):
                names = tuple(f"{hf}.mlp.experts.{j}.{name}.weight" for j in range(x))
                specs.append(ParamSpec(ours + ("moe", name), names, "stacked", in_dims, out_dims))
        else:
            m = cfg.mlp_dim
            for name, in_dims, out_dims in (
                ("gate_proj", (e,), (m,)),
                ("up_proj", (e,), (m,)),
                ("down_proj", (m,), (e,)),
            ):
                specs.append(
                    ParamSpec(ours + ("mlp", name, "w"), (f"{hf}.mlp.{name}.weight",), "linear", in_dims, out_dims)
                )
    return {s.path: s for s in specs}


def _attention_specs(cfg: ModelConfig, ours: Path, hf: str) -> list[ParamSpec]:
    """Layer ``ours``'s q/k/v/o projections and the biases its family has (``hf``: the layer's HF prefix)."""
    e, h, k, d = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    specs = []
    for name, in_dims, out_dims in (
        ("q_proj", (e,), (h, d)),
        ("k_proj", (e,), (k, d)),
        ("v_proj", (e,), (k, d)),
        ("o_proj", (h, d), (e,)),
    ):
        specs.append(
            ParamSpec(ours + ("attn", name, "w"), (f"{hf}.self_attn.{name}.weight",), "linear", in_dims, out_dims)
        )
        if cfg.o_bias if name == "o_proj" else cfg.qkv_bias:
            specs.append(
                ParamSpec(ours + ("attn", name, "b"), (f"{hf}.self_attn.{name}.bias",), "reshape", out_dims=out_dims)
            )
    return specs


@dataclass(frozen=True)
class LayerStack:
    """One parameter of the stacked layer layout ``[L, ...]``: layer ``i`` is ``layers[i]`` (a ParamSpec)."""

    path: Path  # our nnx.State path without a layer index, e.g. ("layers", "attn", "q_proj", "w")
    layers: tuple[ParamSpec, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.layers),) + self.layers[0].shape


def model_specs(cfg: ModelConfig) -> dict[Path, ParamSpec | LayerStack]:
    """Every parameter of ``Transformer(cfg)`` in its own layout -> its spec: ``param_specs``, or with
    ``cfg.scan_layers`` a ``LayerStack`` for each stacked layer parameter."""
    specs = param_specs(cfg)
    if not cfg.scan_layers:
        return specs
    out: dict[Path, ParamSpec | LayerStack] = {p: s for p, s in specs.items() if p[0] != "layers"}
    per_layer = [s for p, s in specs.items() if p[0] == "layers" and p[1] == "0"]
    for first in per_layer:
        rest = first.path[2:]
        out[("layers",) + rest] = LayerStack(
            ("layers",) + rest, tuple(specs[("layers", str(i)) + rest] for i in range(cfg.num_layers))
        )
    return out


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor a checkpoint of ``cfg`` must hold."""
    return {name: spec.hf_shape for spec in param_specs(cfg).values() for name in spec.hf_names}


# -- block reads (loading) -------------------------------------------------------------------------


def _norm(index: Sequence[slice], shape: Sequence[int]) -> list[slice]:
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {index} is not supported")
        out.append(slice(start, stop))
    return out


def _flat_range(dims: Sequence[int], index: Sequence[slice]) -> tuple[slice, tuple[int, ...], tuple[slice, ...]]:
    """For dims flattened row-major into one HF dim: the contiguous HF range covering ``index``, the shape to
    reshape that range to, and the slices to apply after the reshape."""
    rest = int(np.prod(dims[1:]))
    first = index[0]
    block_shape = (first.stop - first.start,) + tuple(dims[1:])
    return slice(first.start * rest, first.stop * rest), block_shape, (slice(None),) + tuple(index[1:])


def _read_linear(read: SliceReader, name: str, in_dims, out_dims, index: Sequence[slice]) -> np.ndarray:
    n_in = len(in_dims)
    in_idx, out_idx = index[:n_in], index[n_in:]
    out_rng, out_shape, out_post = _flat_range(out_dims, out_idx)
    in_rng, in_shape, in_post = _flat_range(in_dims, in_idx)
    block = read(name, (out_rng, in_rng))  # [out_range, in_range]
    block = block.reshape(out_shape + in_shape)[out_post + in_post]
    n_out = len(out_dims)
    return np.transpose(block, tuple(range(n_out, n_out + n_in)) + tuple(range(n_out)))


def read_block(spec: ParamSpec | LayerStack, read: SliceReader, index: Sequence[slice]) -> np.ndarray:
    """The block ``ours[index]`` of the parameter ``spec`` describes, read through ``read``."""
    index = _norm(index, spec.shape)
    if isinstance(spec, LayerStack):
        blocks = [read_block(spec.layers[i], read, index[1:]) for i in range(index[0].start, index[0].stop)]
        if not blocks:
            return np.zeros((0,) + tuple(s.stop - s.start for s in index[1:]))
        return np.stack(blocks)
    if spec.layout == "reshape" and spec.same_shape:
        return read(spec.hf_names[0], tuple(index))
    if spec.layout == "reshape":
        rng, shape, post = _flat_range(spec.out_dims, index)
        return read(spec.hf_names[0], (rng,)).reshape(shape)[post]
    if spec.layout == "linear":
        return _read_linear(read, spec.hf_names[0], spec.in_dims, spec.out_dims, index)
    experts = range(index[0].start, index[0].stop)
    blocks = [_read_linear(read, spec.hf_names[j], spec.in_dims, spec.out_dims, index[1:]) for j in experts]
    if not blocks:
        return np.zeros((0,) + tuple(s.stop - s.start for s in index[1:]))
    return np.stack(blocks)


# -- whole-array conversion (saving) ---------------------------------------------------------------


def to_hf(spec: ParamSpec, ours: np.ndarray) -> np.ndarray:
    """Our full array (one expert's slice ``ours[j]`` for "stacked") -> the HF tensor."""
    if spec.layout == "reshape":
        return ours.reshape(spec.hf_shape)
    flat = ours.reshape(int(np.prod(spec.in_dims)), int(np.prod(spec.out_dims)))  # [in, out]
    return np.ascontiguousarray(flat.T)  # [out, in]
