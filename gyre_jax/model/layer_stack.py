"""The two layouts of the decoder layers' parameters, and conversion between them (``ModelConfig.scan_layers``).

- **per-layer** (``scan_layers=False``): ``state["layers"][i][...]``, one subtree per layer (an ``nnx.List``
  of ``Block``s), e.g. ``layers/3/attn/q_proj/w: [E, H, D]``.
- **stacked** (``scan_layers=True``): one ``Block`` whose every parameter has a leading layer axis,
  ``layers/attn/q_proj/w: [L, E, H, D]``, logical axis ``"layers"`` (``LAYER_AXIS``; no sharding rule names
  it, so it is never split over a mesh axis: each device holds its shard of every layer). The forward runs
  it as one ``lax.scan`` body (``modules.Transformer``).

``stack_layers`` / ``unstack_layers`` convert any tree holding model states (params, gradients, an optax state
whose moments mirror the params, a ``TrainState``; leaves may be ``nnx.Variable``s, arrays,
``ShapeDtypeStruct``s or shardings) from one layout to the other; ``to_layout`` picks the direction.
``restore`` reads a run checkpoint saved in either layout into the layout of its target.
The same seed gives the same weights in both layouts (``Transformer`` builds the layers one by one, then
stacks them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

LAYER_AXIS = "layers"  # the logical name of the stacked parameters' leading axis
LAYERS = "layers"  # the model state's key of the decoder layers (either layout)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _raw(x: Mapping) -> Mapping:
    """An ``nnx.State``'s own nested dicts (indexing a State wraps them in new States: another pytree)."""
    return x.raw_mapping if isinstance(x, nnx.State) else x


def _owns_layers(x) -> bool:
    """A model state: a mapping with the decoder layers under ``LAYERS``."""
    return isinstance(x, Mapping) and LAYERS in x and isinstance(_raw(x)[LAYERS], Mapping)


def _is_index(key) -> bool:
    return isinstance(key, int) or (isinstance(key, str) and key.isdigit())


def is_stacked(layers: Mapping) -> bool:
    """``layers``: the subtree under ``LAYERS`` -> whether it is in the stacked layout (else per-layer)."""
    return not all(_is_index(k) for k in layers.keys())


def tree_is_stacked(tree) -> bool | None:
    """Whether the model states in ``tree`` are stacked (None: the tree holds no model state)."""
    found = [is_stacked(_raw(s)[LAYERS]) for s in jax.tree.leaves(tree, is_leaf=_owns_layers) if _owns_layers(s)]
    return found[0] if found else None


# -- one leaf ----------------------------------------------------------------------------------------


def _stacked_sharding(sharding, stack: bool):
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec)
    spec = (None,) + spec if stack else spec[1:]
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def _stack_values(values: Sequence):
    first = values[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        sharding = _stacked_sharding(first.sharding, stack=True)
        return jax.ShapeDtypeStruct((len(values),) + tuple(first.shape), first.dtype, sharding=sharding)
    if isinstance(first, jax.sharding.Sharding):
        return _stacked_sharding(first, stack=True)
    if isinstance(first, np.ndarray):
        return np.stack(values)
    return jnp.stack(values)


def _take_value(value, i: int):
    if isinstance(value, jax.ShapeDtypeStruct):
        sharding = _stacked_sharding(value.sharding, stack=False)
        return jax.ShapeDtypeStruct(tuple(value.shape[1:]), value.dtype, sharding=sharding)
    if isinstance(value, jax.sharding.Sharding):
        return _stacked_sharding(value, stack=False)
    return value[i]


def _axes(var: nnx.Variable):
    return var.get_metadata().get("out_sharding")


def _stack_leaf(leaves: Sequence):
    first = leaves[0]
    if not _is_var(first):
        return _stack_values(leaves)
    value = _stack_values([v.get_value() for v in leaves])
    axes = _axes(first)
    return first.replace(value, **({"out_sharding": (LAYER_AXIS,) + tuple(axes)} if axes else {}))


def _take_leaf(leaf, i: int):
    if not _is_var(leaf):
        return _take_value(leaf, i)
    axes = _axes(leaf)
    if axes and axes[0] != LAYER_AXIS:
        raise ValueError(f"a stacked parameter's first logical axis is {axes[0]!r}, not {LAYER_AXIS!r}")
    return leaf.replace(_take_value(leaf.get_value(), i), **({"out_sharding": tuple(axes[1:])} if axes else {}))


def _num_layers(layers: Mapping) -> int:
    leaf = jax.tree.leaves(layers, is_leaf=_is_var)[0]
    value = leaf.get_value() if _is_var(leaf) else leaf
    if not hasattr(value, "shape"):
        raise ValueError(f"cannot tell the number of layers from a {type(value).__name__}: pass num_layers")
    return int(value.shape[0])


# -- one subtree of layers -----------------------------------------------------------------------------


def stack_subtrees(subtrees: Sequence) -> Any:
    """Per-layer subtrees (one per layer, same structure) -> one stacked subtree."""
    structures = {jax.tree.structure(s, is_leaf=_is_var) for s in subtrees}
    if len(structures) > 1:
        raise ValueError(
            "not supported yet: stacking layers of different kinds (mixed dense/MoE layers); "
            "set scan_layers=False for this model"
        )
    return jax.tree.map(lambda *leaves: _stack_leaf(leaves), *subtrees, is_leaf=_is_var)


def layer_subtree(stacked, i: int) -> Any:
    """Layer ``i``'s subtree of a stacked subtree (values sliced, the layer axis dropped from the metadata)."""
    return jax.tree.map(lambda leaf: _take_leaf(leaf, i), stacked, is_leaf=_is_var)


def _stack_layers_entry(layers: Mapping):
    if is_stacked(layers):
        return layers
    keys = sorted(layers.keys(), key=int)
    if [int(k) for k in keys] != list(range(len(keys))):
        raise ValueError(f"per-layer keys {keys} are not 0..{len(keys) - 1}")
    return stack_subtrees([layers[k] for k in keys])


def _unstack_layers_entry(layers: Mapping, num_layers: int | None = None):
    if not is_stacked(layers):
        return layers
    return {i: layer_subtree(layers, i) for i in range(num_layers or _num_layers(layers))}


def _map_states(tree, fn: Callable[[Mapping], Any]):
    def one(x):
        if not _owns_layers(x):
            return x
        raw = _raw(x)
        items = {**raw, LAYERS: fn(raw[LAYERS])}
        return nnx.State(items) if isinstance(x, nnx.State) else type(x)(items)

    return jax.tree.map(one, tree, is_leaf=_owns_layers)


def stack_layers(tree):
    """Every model state in ``tree`` in the stacked layout (already stacked ones unchanged)."""
    return _map_states(tree, _stack_layers_entry)


def unstack_layers(tree, num_layers: int | None = None):
    """Every model state in ``tree`` in the per-layer layout (already per-layer ones unchanged). ``num_layers``:
    needed only for a tree of shardings (nothing else in it says how many layers the stack holds)."""
    return _map_states(tree, lambda layers: _unstack_layers_entry(layers, num_layers))


def to_layout(tree, stacked: bool, num_layers: int | None = None):
    """``tree``'s model states in the stacked (``scan_layers=True``) or per-layer layout."""
    return stack_layers(tree) if stacked else unstack_layers(tree, num_layers)


def without_layer_axis(subtree):
    """A stacked subtree's per-layer slice as ``lax.scan`` hands it to its body (values already [...] without the
    layer axis) -> the same values with the layer axis dropped from the metadata too."""

    def one(leaf):
        axes = _axes(leaf) if _is_var(leaf) else None
        return leaf.replace(leaf.get_value(), out_sharding=tuple(axes[1:])) if axes else leaf

    return jax.tree.map(one, subtree, is_leaf=_is_var)


def stack_modules(modules: Sequence[nnx.Module]) -> nnx.Module:
    """Modules of one kind (same structure) -> one module of that kind whose parameters are stacked [L, ...]."""
    return nnx.merge(nnx.graphdef(modules[0]), stack_subtrees([nnx.state(m) for m in modules]))


# -- run checkpoints -------------------------------------------------------------------------------------


def _paths_stacked(paths) -> bool | None:
    """Whether saved key paths hold stacked layers (None: no ``LAYERS`` key)."""
    for path in paths:
        for key, child in zip(path, path[1:]):
            if key == LAYERS:
                return not child.isdigit()
    return None


def restore(checkpointer, step: int, abstract_state):
    """``checkpointer.restore(step, abstract_state)`` (a ``gyre_jax.checkpoint.Checkpointer``) into the layer layout
    of ``abstract_state`` (``ShapeDtypeStruct``s with shardings), also from a checkpoint saved in the other layout:
    then it is read as saved (each array on the target's sharding, without or with a replicated layer axis) and
    converted on device, holding both layouts for a moment. Returns (state, meta)."""
    want = tree_is_stacked(abstract_state)
    saved = _paths_stacked(checkpointer.saved_paths(step))
    if want is None or saved is None or saved == want:
        return checkpointer.restore(step, abstract_state)
    state, meta = checkpointer.restore(step, to_layout(abstract_state, saved))

    def convert(x, target):  # one model state (params, an optimizer moment ...) onto its target shardings
        if not _owns_layers(x):
            return x
        shardings = jax.tree.map(lambda a: a.sharding, target)
        return jax.jit(lambda tree: to_layout(tree, want), out_shardings=shardings)(x)

    return jax.tree.map(convert, state, abstract_state, is_leaf=_owns_layers), meta
