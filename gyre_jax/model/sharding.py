"""Logical-axis sharding: map parameter/activation logical axes to mesh axes by rules from the config.

MaxText style: model code names axes (``embed``, ``heads``, ``mlp``, ``vocab``, ``exp``, ``batch`` ...); the
config's ``sharding_rules`` say which mesh axes each one is split over. A mesh axis is used at most
once per array, and a dimension is only split over the mesh axes whose product divides it (others
are dropped, left replicated), so one rule set works for every cell shape.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.model.config import ModelConfig
from gyre_jax.model.modules import Transformer
from gyre_jax.model.rules import ALL_MESH_AXES, CONTEXT_AXIS, MESH_AXES, Rules
from gyre_jax.model.rules import EXPERT_AXIS as EXPERT_AXIS  # re-exported: the names and rule sets live in rules.py
from gyre_jax.model.rules import RULE_SETS as RULE_SETS
from gyre_jax.model.rules import RULES_DATA as RULES_DATA
from gyre_jax.model.rules import RULES_EXPERT as RULES_EXPERT
from gyre_jax.model.rules import RULES_FSDP_TENSOR as RULES_FSDP_TENSOR


def make_mesh(devices: Sequence[jax.Device], shape: dict[str, int]) -> Mesh:
    """A mesh over ``devices`` (in order) with axes ``data, fsdp, tensor`` (+ ``expert``, + ``context`` when
    ``shape`` has them; ``context`` is innermost: a row's context shards are neighbouring devices)."""
    known = ALL_MESH_AXES + (CONTEXT_AXIS,)
    unknown = set(shape) - set(known)
    if unknown:
        raise ValueError(f"mesh shape {dict(shape)} names unknown axes {sorted(unknown)}; mesh axes are {known}")
    axes = tuple(a for a in known if a in MESH_AXES or a in shape)
    sizes = tuple(int(shape.get(a, 1)) for a in axes)
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh shape {dict(zip(axes, sizes))} needs {int(np.prod(sizes))} devices, got {len(devices)}")
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), axes)


def _lookup(rules: Rules, name: str | None) -> tuple[str, ...]:
    if name is None:
        return ()
    for logical, mesh_axes in rules:
        if logical == name:
            if mesh_axes is None:
                return ()
            return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    return ()


def logical_to_spec(
    logical_axes: Sequence[str | None], rules: Rules, mesh: Mesh, shape: Sequence[int] | None = None
) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry ``logical_axes``."""
    used: set[str] = set()
    entries = []
    for dim, name in enumerate(logical_axes):
        chosen: list[str] = []
        size = 1
        for axis in _lookup(rules, name):
            if axis not in mesh.shape or axis in used or axis in chosen or mesh.shape[axis] == 1:
                continue
            if shape is not None and shape[dim] % (size * mesh.shape[axis]) != 0:
                continue
            chosen.append(axis)
            size *= mesh.shape[axis]
        used.update(chosen)
        entries.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*entries)


def logical_sharding(
    logical_axes: Sequence[str | None], rules: Rules, mesh: Mesh, shape: Sequence[int] | None = None
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules, mesh, shape))


def param_shardings(abstract_state: nnx.State, rules: Rules, mesh: Mesh) -> nnx.State:
    """NamedSharding for every parameter of an (abstract) model state, from its logical axis metadata."""

    def one(var):
        logical = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        return var.replace(logical_sharding(logical, rules, mesh, var.shape))

    return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_model(cfg: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and its state as shapes and dtypes (no arrays): a fresh state per call, traced once per
    (config, seed) in a process (a run asks for it from the loader, the cells, the learner and the planner)."""
    graphdef, state = _traced_model(cfg, seed)
    return graphdef, jax.tree.map(lambda x: x, state)  # new Variables: callers may replace their metadata


@functools.lru_cache(maxsize=8)
def _traced_model(cfg: ModelConfig, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    # Tracing is quadratic in the model's size here: every RNG draw sets a traced counter, and flax's set_value reads
    # the tracer's `sharding`, whose AttributeError message walks the whole trace so far (jax 0.10.2, flax 0.12.8):
    # 20 s for the 94 layers of Qwen3-235B-A22B on this CPU, once instead of at each call.
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
    return nnx.split(model)


def init_params(cfg: ModelConfig, mesh: Mesh, rules: Rules, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """Initializes the model's parameters directly with their target shardings (no host copy)."""
    graphdef, abstract_state = abstract_model(cfg, seed)
    shardings = param_shardings(abstract_state, rules, mesh)

    def init():
        with nnx.use_eager_sharding(False):
            return nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))[1]

    params = jax.jit(init, out_shardings=shardings)()
    return graphdef, params


def reshard(tree, shardings):
    """Moves a pytree onto ``shardings`` (possibly on another mesh: device-to-device, Tunix-style ``reshard``)."""
    return jax.device_put(tree, shardings)
