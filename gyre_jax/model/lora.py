"""LoRA adapters on the decoder's projections: the adapter module, the split of a model state into the trainable
adapter and the frozen base, the merge into plain weights, and the PEFT adapter format.

``ModelConfig.lora`` (``LoraConfig``: rank, alpha, targets) puts a ``LoraAdapter`` beside each adapted weight W of
the model (attention q/k/v/o, a dense MLP's gate/up/down, a MoE layer's experts): ``y = x W + (alpha / rank)
(x A) B`` with A ``[in..., r]`` and B ``[r, out...]``, both ``nnx.LoRAParam`` (a subclass of ``nnx.Param``), their
axes carrying W's logical names (the rank axis none), so the same sharding rules place them. B starts at zero: the
adapted model starts as the base. A is drawn after every base weight, from its own key, so the base weights of a
seed are the same with and without an adapter. The adapter is applied beside W, never merged into it, in training
and in serving alike.

A model state then holds two kinds of leaves: ``split(state) -> (adapter, base)`` and ``combine(base, adapter)``
(the same tree again). What trains, is checkpointed and moves between cells is the adapter; the base is frozen,
loaded once per cell (``docs/learner.md``, "LoRA"). ``merged_params`` folds an adapter into plain weights (a model
without LoRA: the Hugging Face save of the merged model); ``save_peft_adapter`` writes a PEFT adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads on top of the
transformers model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from gyre_jax.model.config import ModelConfig

LORA_KEY = "lora"  # the attribute name of an adapter beside its weight (``Einsum.lora``, ``MoEBlock.<proj>_lora``)
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


def enabled(cfg: Any) -> bool:
    """Whether ``cfg`` (a ModelConfig, or anything without ``lora``) carries a LoRA adapter."""
    lora = getattr(cfg, "lora", None)
    return bool(lora is not None and lora.enabled)


def base_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` without its adapter (the base model's config)."""
    return dataclasses.replace(cfg, lora=type(cfg.lora)()) if enabled(cfg) else cfg


class LoraAdapter(nnx.Module):
    """The adapter of one weight of ``shape`` (logical ``axes``): ``batch_dims`` leading dims shared by A and B (a MoE
    layer's expert axis), then ``in_dims`` input dims, then the output dims. A ``[*batch, *in, rank]`` and B
    ``[*batch, rank, *out]`` (zeros; A is zeros until ``init_adapters`` draws it: ``Transformer`` does, after the
    base weights)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        axes: tuple[str | None, ...],
        in_dims: int,
        rank: int,
        scale: float,
        *,
        batch_dims: int = 0,
        param_dtype,
    ):
        nb = batch_dims
        self.rank, self.scale, self.in_dims, self.batch_dims = rank, float(scale), in_dims, batch_dims
        self.fan_in = math.prod(shape[nb : nb + in_dims])
        a_shape = shape[: nb + in_dims] + (rank,)
        b_shape = shape[:nb] + (rank,) + shape[nb + in_dims :]
        a_axes = tuple(axes[: nb + in_dims]) + (None,)
        b_axes = tuple(axes[:nb]) + (None,) + tuple(axes[nb + in_dims :])
        zeros = nnx.initializers.zeros
        self.a = nnx.LoRAParam(nnx.with_partitioning(zeros, a_axes)(jax.random.key(0), a_shape, param_dtype))
        self.b = nnx.LoRAParam(nnx.with_partitioning(zeros, b_axes)(jax.random.key(0), b_shape, param_dtype))

    def init(self, key: jax.Array) -> None:
        """Draws A as PEFT does (Kaiming-uniform with a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))); B stays 0."""
        bound = 1.0 / math.sqrt(self.fan_in)
        a = self.a[...]
        self.a[...] = jax.random.uniform(key, a.shape, jnp.float32, -bound, bound).astype(a.dtype)

    def __call__(self, eqn: str, x: jax.Array, weight_shape: tuple[int, ...]) -> jax.Array:
        """The adapter's term of ``einsum(eqn, x, W)`` where W is viewed as ``weight_shape`` (``Einsum``'s weight,
        possibly reshaped with merged input dims): ``scale * einsum(einsum(x, A), B)`` in x's dtype. The weight's
        subscripts must list its contracted (input) letters first."""
        lhs, rest = eqn.split(",")
        ws, out = rest.split("->")
        w_in = "".join(c for c in ws if c in lhs)
        if ws[: len(w_in)] != w_in:
            raise ValueError(
                f"a LoRA adapter needs the weight's input dims first; {eqn!r} contracts {w_in!r} of {ws!r}"
            )
        w_out = ws[len(w_in) :]
        r = next(c for c in "zyxwvutsrqponmlkjihgfedcba" if c not in eqn)
        mid = "".join(c for c in lhs if c not in w_in)
        a = self.a[...].astype(x.dtype).reshape(tuple(weight_shape[: len(w_in)]) + (self.rank,))
        b = self.b[...].astype(x.dtype).reshape((self.rank,) + tuple(weight_shape[len(w_in) :]))
        h = jnp.einsum(f"{lhs},{w_in}{r}->{mid}{r}", x, a) * jnp.asarray(self.scale, x.dtype)
        return jnp.einsum(f"{mid}{r},{r}{w_out}->{out}", h, b)


def init_adapters(modules, key: jax.Array) -> None:
    """Draws A of every ``LoraAdapter`` in ``modules`` (a module or a list of them; graph order), each from its own
    fold of ``key``."""
    found = [m for _, m in nnx.iter_graph(modules) if isinstance(m, LoraAdapter)]
    for i, adapter in enumerate(found):
        adapter.init(jax.random.fold_in(key, i))


def lora_arg(cfg: ModelConfig, name: str, in_dims: int) -> tuple[int, float, int] | None:
    """``Einsum``'s ``lora=`` for projection ``name``: (rank, scale, in_dims), or None when it is not adapted."""
    if not cfg.lora.adapts(name):
        return None
    return (cfg.lora.rank, cfg.lora.scale, in_dims)


# -- the two kinds of leaves -------------------------------------------------------------------------------------


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def split(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """A model state (params, shardings, abstract arrays: any tree of its ``nnx.Variable``s) -> (adapter: the
    ``nnx.LoRAParam`` leaves, base: every other leaf), each with the state's nesting. Either may be empty."""
    adapter, base = nnx.split_state(state, nnx.LoRAParam, ...)
    return adapter, base


def combine(base: nnx.State, adapter: nnx.State) -> nnx.State:
    """``split``'s inverse: the whole model state of ``base`` and ``adapter`` (no array is copied). The merge of a
    pair of tree structures is worked out once (``nnx.merge_state`` over leaf indices) and then only replayed: a
    cell combines its base with every adapter it receives (~14 ms for SmolLM2-135M's 1,000 leaves through
    ``nnx.merge_state`` each time on a busy 2-core CPU)."""
    return combine_flat(*jax.tree.flatten(base), adapter)


def combine_flat(base_leaves: list, base_def, adapter: nnx.State) -> nnx.State:
    """``combine`` of a base already flattened (``jax.tree.flatten(base)``: a cell keeps its base so)."""
    return combine_leaves(base_leaves, base_def, *jax.tree.flatten(adapter))


def combine_leaves(base_leaves: list, base_def, adapter_leaves: list, adapter_def) -> nnx.State:
    """``combine`` of a base and an adapter both flattened."""
    leaves, full_def = merged_leaves(base_leaves, base_def, adapter_leaves, adapter_def)
    return jax.tree.unflatten(full_def, leaves)


def merged_leaves(base_leaves: list, base_def, adapter_leaves: list, adapter_def) -> tuple[list, Any]:
    """(the leaves of ``combine``'s model state, its structure) from a base and an adapter both flattened, without
    building the state: a serving cell's weights as flat leaves (``serving.programs.Flattened``)."""
    full_def, order = _merge_plan(base_def, adapter_def)
    source = list(base_leaves) + list(adapter_leaves)
    return [source[i] for i in order], full_def


@functools.lru_cache(maxsize=64)
def _merge_plan(base_def, adapter_def) -> tuple[Any, tuple[int, ...]]:
    """(the merged tree's structure, for each of its leaves the index into base leaves + adapter leaves)."""
    nb = base_def.num_leaves
    merged = nnx.merge_state(
        jax.tree.unflatten(base_def, list(range(nb))),
        jax.tree.unflatten(adapter_def, list(range(nb, nb + adapter_def.num_leaves))),
    )
    order, full_def = jax.tree.flatten(merged)
    return full_def, tuple(order)


def put(tree: Any, shardings: Any, put_fn=jax.device_put, **kw) -> Any:
    """``tree`` (an adapter: many small arrays of one dtype on one mesh) onto ``shardings`` as ONE array: packed into a
    flat buffer on its mesh, moved by ``put_fn(buffer, sharding, **kw)`` (``jax.device_put``, ``runtime.transfer``),
    unpacked onto ``shardings`` there (each a jitted program, compiled once per layout). Moving the leaves one by one
    costs a fixed host overhead per array that dominates an adapter's move (SmolLM2-135M's rank-8 adapter: 420
    arrays, ~80 ms of host time on a busy 2-core CPU, about 10 MB of data). Trees of mixed dtypes or meshes move
    leaf by leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, put_leaves(leaves, treedef.flatten_up_to(shardings), put_fn, **kw))


def put_leaves(leaves: list, targets: list, put_fn=jax.device_put, **kw) -> list:
    """``put`` of a tree already flattened (``leaves``, and its ``targets``: one sharding per leaf): a caller that
    holds the flat form (a cell's switch) spares the Variables' flatten and unflatten, which cost as much as the
    move for an adapter of hundreds of arrays."""
    meshes = {getattr(t, "mesh", None) for t in targets}
    packed = pack_leaves(leaves, None) if len(meshes) == 1 and None not in meshes else None
    if packed is None:  # mixed dtypes or meshes: leaf by leaf
        return list(put_fn(list(leaves), list(targets), **kw))
    return unpack_onto(packed, targets, put_fn, **kw)


# -- an adapter held as one array: what a role switch moves ---------------------------------------------------------


class PackedLayout:
    """Where each leaf of a tree of same-dtype arrays (an adapter) lies in one flat buffer: the tree's ``treedef`` and
    each leaf's shape, in leaf order. Static and hashable (its hash computed once): a program that takes a ``Packed``
    compiles once per layout."""

    def __init__(self, treedef: Any, shapes: tuple[tuple[int, ...], ...]):
        self.treedef, self.shapes = treedef, tuple(tuple(s) for s in shapes)
        self.sizes = tuple(math.prod(s) for s in self.shapes)
        self.size = sum(self.sizes)
        self._key = (treedef, self.shapes)
        self._hash = hash(self._key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, PackedLayout) and self._key == other._key)

    def leaves(self, flat: jax.Array) -> list:
        """The leaves held in ``flat`` [size]: inside a program, slices of it (no array per leaf is ever made)."""
        offsets = np.cumsum((0,) + self.sizes[:-1]).tolist()
        return [flat[o : o + n].reshape(s) for o, n, s in zip(offsets, self.sizes, self.shapes)]

    def unflatten(self, flat: jax.Array) -> Any:
        """The tree held in ``flat`` (inside a program)."""
        return jax.tree.unflatten(self.treedef, self.leaves(flat))


@jax.tree_util.register_pytree_node_class
class Packed:
    """A tree of arrays (an adapter) held as ONE flat array ``buffer`` ``[layout.size]`` (replicated on its mesh) with
    its static ``layout``: a role switch or a satellite snapshot moves this one array. ``GradWorker``'s micro-step
    slices it inside its program (one program per micro-step shape); a serving cell unpacks it once on arrival
    (``put_leaves``), since slices inside the serving programs would add ~42 memory maps per layer to each of the
    dozens of shapes a cell compiles (XLA:CPU maps each kernel, and a slice feeding a dot is a kernel of its own):
    SmolLM2-135M's serving programs went from ~235 to ~1,500 maps each, and a run reached the kernel's
    ``vm.max_map_count`` (65,530) within 45 minutes. A pytree (the buffer its one leaf), so a jitted function takes
    it as an argument. ``source``: the tree it was packed from, when a sender packs once for many receivers
    (``publication``): a receiver that cannot take the packed form (a cell on another process) sends that; not part
    of the pytree (a program never sees it)."""

    def __init__(self, buffer: jax.Array, layout: PackedLayout, source: Any = None):
        self.buffer, self.layout, self.source = buffer, layout, source

    def tree_flatten(self):
        return (self.buffer,), self.layout

    @classmethod
    def tree_unflatten(cls, layout: PackedLayout, children) -> Packed:
        return cls(children[0], layout)

    def to(self, sharding: NamedSharding, put_fn=jax.device_put, **kw) -> Packed:
        """The same tree with its buffer moved by ``put_fn(buffer, sharding, **kw)`` (one array)."""
        return Packed(put_fn(self.buffer, sharding, **kw), self.layout)


def publication(params: Any) -> Any:
    """What a trainer hands every receiver of one policy version (the serving cells of a publish or a role switch,
    the satellites' snapshots): an adapter packed once (``Packed``, its ``source`` the tree), so each receiver moves
    and unpacks one array instead of flattening and packing the tree again; ``params`` itself when it does not pack
    (mixed dtypes or meshes)."""
    packed = pack_leaves(*jax.tree.flatten(params))
    if packed is None:
        return params
    packed.source = params
    return packed


def source_of(params: Any) -> Any:
    """The tree a ``publication`` was packed from (for a receiver that takes trees), else ``params``."""
    if isinstance(params, Packed):
        if params.source is None:
            raise ValueError("a packed adapter without its source tree: this receiver takes the tree; pass the tree")
        return params.source
    return params


def unpack_onto(packed: Packed, targets: list, put_fn=jax.device_put, **kw) -> list:
    """The leaves of ``packed`` on ``targets`` (one sharding per leaf, all on one mesh): its one buffer moved there
    by ``put_fn`` and unpacked there by one program (``put_leaves`` without the packing)."""
    meshes = {getattr(t, "mesh", None) for t in targets}
    if len(meshes) != 1 or None in meshes:
        raise ValueError("unpack_onto: the targets must be NamedShardings of one mesh")
    moved = put_fn(packed.buffer, NamedSharding(meshes.pop(), PartitionSpec()), **kw)
    return _unpacker(packed.layout.shapes, tuple(targets))(moved)


def pack_leaves(leaves: list, treedef: Any) -> Packed | None:
    """The tree ``treedef`` of ``leaves`` as one ``Packed`` array on the leaves' mesh (a jitted concatenation,
    compiled once per layout), or None when they are not all of one dtype on one mesh of this process's devices (move
    those leaf by leaf)."""
    sources = {getattr(x.sharding, "mesh", None) for x in leaves}
    if not leaves or len({x.dtype for x in leaves}) != 1 or len(sources) != 1 or None in sources:
        return None
    if next(iter(sources)).is_multi_process:  # a program there would have to run on every process at once
        return None
    shapes = tuple(tuple(x.shape) for x in leaves)
    buffer = _packer(shapes, NamedSharding(sources.pop(), PartitionSpec()))(leaves)
    return Packed(buffer, PackedLayout(treedef, shapes))


def unpacked(x: Any) -> Any:
    """``x``'s tree if it is ``Packed`` (inside a program: slices of its buffer), else ``x``."""
    return x.layout.unflatten(x.buffer) if isinstance(x, Packed) else x


@functools.lru_cache(maxsize=32)
def _packer(shapes: tuple, out: NamedSharding):
    return jax.jit(lambda leaves: jnp.concatenate([x.reshape(-1) for x in leaves]), out_shardings=out)


@functools.lru_cache(maxsize=32)
def _unpacker(shapes: tuple, targets: tuple):
    sizes = [math.prod(s) for s in shapes]
    offsets = np.cumsum([0] + sizes[:-1]).tolist()

    def unpack(flat):
        return [flat[o : o + n].reshape(s) for o, n, s in zip(offsets, sizes, shapes)]

    return jax.jit(unpack, out_shardings=list(targets))


def num_leaves(state: Any) -> int:
    return len(jax.tree.leaves(state, is_leaf=_is_var))


def nbytes(state: Any) -> int:
    """Bytes of a tree of arrays / ``ShapeDtypeStruct``s (what moving it copies)."""
    leaves = jax.tree.leaves(state, is_leaf=_is_var)
    values = [leaf.get_value() if _is_var(leaf) else leaf for leaf in leaves]
    return int(sum(math.prod(v.shape) * jnp.dtype(v.dtype).itemsize for v in values))


def attach(cfg: ModelConfig, base: nnx.State, mesh, rules, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """A base model's params (of ``base_config(cfg)``, e.g. read from a checkpoint) with a new adapter of ``cfg``
    (A drawn as ``Transformer(cfg, rngs=nnx.Rngs(seed))`` draws it, B zero) on the target shardings."""
    from gyre_jax.model.modules import Transformer
    from gyre_jax.model.sharding import abstract_model, param_shardings

    graphdef, abstract = abstract_model(cfg, seed)
    adapter_shardings = split(param_shardings(abstract, rules, mesh))[0]

    def init():
        with nnx.use_eager_sharding(False):
            return split(nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))[1])[0]  # XLA drops the unused base init

    adapter = jax.jit(init, out_shardings=adapter_shardings)()
    return graphdef, combine(base, adapter)


# -- merging into plain weights -----------------------------------------------------------------------------------


def _flat(state: nnx.State) -> dict[tuple, Any]:
    return {tuple(str(getattr(k, "key", k)) for k in path): v for path, v in nnx.to_flat_state(state)}


def deltas(cfg: ModelConfig, params: nnx.State) -> dict[tuple, jax.Array]:
    """Each adapted weight's path (in ``params``' layout: the base weight's path) -> its adapter's update
    ``scale * A B`` in the weight's shape and dtype (a batch dim such as the layers of ``scan_layers`` or a MoE
    layer's experts handled as a batch)."""
    flat = _flat(params)
    out = {}
    for path, var in flat.items():
        if path[-1] != "a" or len(path) < 2 or not path[-2].endswith(LORA_KEY):
            continue
        owner, key = path[:-2], path[-2]
        weight_path = owner + ("w",) if key == LORA_KEY else owner + (key[: -len(LORA_KEY) - 1],)
        w = flat[weight_path].get_value()
        a, b = var.get_value(), flat[path[:-1] + ("b",)].get_value()
        stacked = len(a.shape) + len(b.shape) - 2 - len(w.shape)  # leading batch dims: layers (and experts)
        rank = a.shape[-1]
        lead = w.shape[:stacked]
        a2 = a.reshape(lead + (-1, rank)).astype(jnp.float32)
        b2 = b.reshape(lead + (rank, -1)).astype(jnp.float32)
        scale = cfg.lora.scale
        out[weight_path] = (scale * jnp.matmul(a2, b2)).reshape(w.shape).astype(w.dtype)
    return out


def merged_params(cfg: ModelConfig, params: nnx.State) -> tuple[ModelConfig, nnx.State]:
    """(``base_config(cfg)``, its params with every adapter folded in: W + scale A B, in W's dtype): a plain model
    that computes what base + adapter computes (to rounding), e.g. for ``save_hf_checkpoint``."""
    if not enabled(cfg):
        return cfg, params
    updates = deltas(cfg, params)
    _, base = split(params)

    def fold(path, var):
        key = tuple(str(getattr(k, "key", k)) for k in path)
        return var.replace(var.get_value() + updates[key]) if key in updates else var

    merged = jax.tree_util.tree_map_with_path(fold, base, is_leaf=_is_var)
    return base_config(cfg), merged


# -- the PEFT adapter format ---------------------------------------------------------------------------------------

PEFT_PREFIX = "base_model.model."


def peft_tensors(cfg: ModelConfig, params: nnx.State) -> dict[str, np.ndarray]:
    """The adapter of ``params`` as PEFT names it: ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
    ``[r, in]`` and ``...lora_B.weight`` ``[out, r]`` (PyTorch ``nn.Linear`` layouts, in and out flattened as HF
    flattens the weight), float32 host arrays. MoE experts are not written (not supported yet: PEFT adapts a
    transformers MoE's experts only through ``target_parameters``)."""
    flat = _flat(params)
    out: dict[str, np.ndarray] = {}
    for path, var in flat.items():
        if path[-1] != "a" or path[-2] != LORA_KEY:
            if path[-1] == "a" and path[-2].endswith(LORA_KEY):
                raise NotImplementedError(
                    "not supported yet: a PEFT adapter of MoE experts (lora.targets has 'experts'); save the merged "
                    "model instead"
                )
            continue
        owner = path[:-2]  # ("layers", "3", "attn", "q_proj") or ("layers", "attn", "q_proj") when stacked
        a = np.asarray(jax.device_get(var.get_value()), np.float32)
        b = np.asarray(jax.device_get(flat[path[:-1] + ("b",)].get_value()), np.float32)
        layers = [(owner[1], a, b)] if owner[1].isdigit() else [(str(i), a[i], b[i]) for i in range(a.shape[0])]
        for i, ai, bi in layers:
            part, proj = owner[-2], owner[-1]
            module = {"attn": "self_attn", "mlp": "mlp"}[part]
            name = f"{PEFT_PREFIX}model.layers.{i}.{module}.{proj}"
            rank = ai.shape[-1]
            out[f"{name}.lora_A.weight"] = np.ascontiguousarray(ai.reshape(-1, rank).T)
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(bi.reshape(rank, -1).T)
    return out


def peft_config(cfg: ModelConfig, base_model_name_or_path: str = "") -> dict[str, Any]:
    """``adapter_config.json`` of ``cfg``'s adapter (peft's ``LoraConfig`` fields)."""
    modules = sorted(m for m in cfg.lora.modules if m != "experts")
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.alpha,
        "lora_dropout": cfg.lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_peft_adapter(
    path: str | os.PathLike, cfg: ModelConfig, params: nnx.State, *, base_model_name_or_path: str = ""
) -> Path:
    """Writes ``params``' adapter as a PEFT adapter directory at ``path`` (``adapter_config.json`` +
    ``adapter_model.safetensors``, each replaced whole); returns the directory. ``peft.PeftModel.from_pretrained(
    transformers_model, path)`` loads it on top of the base model ``save_hf_checkpoint`` writes (or the checkpoint
    the run started from)."""
    from safetensors.numpy import save

    from gyre_jax.disk import write_whole

    if not enabled(cfg):
        raise ValueError("the model has no LoRA adapter (model.lora.rank = 0): save the model itself")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = peft_tensors(cfg, params)
    write_whole(out / PEFT_WEIGHTS_FILE, save(tensors, metadata={"format": "pt"}))
    text = json.dumps(peft_config(cfg, base_model_name_or_path), indent=2) + "\n"
    write_whole(out / PEFT_CONFIG_FILE, text.encode("utf-8"))
    return out
