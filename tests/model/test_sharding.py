"""Logical-axis sharding: rule lookup, mesh-independent init and logits, resharding between submeshes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec
from layouts import EIGHT_DEVICES

from gyre_jax.config import load_config
from gyre_jax.model.attention import segment_causal_mask
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import (
    MESH_AXES,
    abstract_model,
    init_params,
    logical_to_spec,
    make_mesh,
    param_shardings,
    reshard,
)

CFG = ModelConfig(
    vocab_size=272,
    num_layers=2,
    embed_dim=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    mlp_dim=128,
    rope_theta=10000.0,
)
RULES = tuple((k, v) for k, v in load_config([]).sharding_rules)
P = PartitionSpec


def mesh_222():
    return make_mesh(jax.devices(), dict(data=2, fsdp=2, tensor=2))


# -- make_mesh / logical_to_spec -------------------------------------------------------------------


def test_make_mesh_orders_axes_and_checks_the_device_count() -> None:
    mesh = make_mesh(jax.devices()[4:8], dict(tensor=2, data=2))
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == dict(data=2, fsdp=1, tensor=2)
    assert list(mesh.devices.flat) == jax.devices()[4:8]
    with pytest.raises(ValueError, match="needs 8 devices, got 4"):
        make_mesh(jax.devices()[:4], dict(data=8))


def test_logical_to_spec_follows_the_config_rules() -> None:
    mesh = mesh_222()
    assert logical_to_spec(("batch", None), RULES, mesh, (8, 5)) == P(("data", "fsdp"), None)
    assert logical_to_spec(("vocab", "embed"), RULES, mesh, (272, 64)) == P("tensor", "fsdp")
    assert logical_to_spec(("embed", "heads", "head_dim"), RULES, mesh, (64, 4, 16)) == P("fsdp", "tensor", None)
    assert logical_to_spec(("unknown_axis", None), RULES, mesh, (8, 8)) == P(None, None)
    # batch takes data and fsdp, so a later "embed" (-> fsdp) stays replicated: a mesh axis is used once
    assert logical_to_spec(("batch", None, "embed"), RULES, mesh, (8, 3, 64)) == P(("data", "fsdp"), None, None)
    # heads takes tensor first, kv_heads (-> tensor) then gets nothing
    assert logical_to_spec(("heads", "kv_heads"), RULES, mesh, (4, 2)) == P("tensor", None)


def test_logical_to_spec_drops_axes_that_do_not_divide_the_dimension() -> None:
    mesh = mesh_222()
    assert logical_to_spec(("batch",), RULES, mesh, (2,)) == P("data")  # fsdp dropped: 2 % (2*2) != 0
    assert logical_to_spec(("batch",), RULES, mesh, (3,)) == P(None)
    assert logical_to_spec(("vocab",), RULES, mesh, (271,)) == P(None)
    tensor4 = make_mesh(jax.devices()[4:8], dict(tensor=4))
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), RULES, tensor4, (64, 2, 16)) == P(None, None, None)
    assert logical_to_spec(("embed", "heads", "head_dim"), RULES, tensor4, (64, 4, 16)) == P(None, "tensor", None)
    # size-1 mesh axes are never named
    assert logical_to_spec(("batch", "vocab"), RULES, make_mesh(jax.devices()[:1], {}), (8, 272)) == P(None, None)


_axis_lists = st.lists(st.sampled_from(MESH_AXES), max_size=3, unique=True)
_rules = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.one_of(st.none(), st.sampled_from(MESH_AXES), _axis_lists)),
    max_size=6,
)
_MESHES = {
    "222": lambda: mesh_222(),
    "8": lambda: make_mesh(jax.devices(), dict(data=8)),
    "41": lambda: make_mesh(jax.devices()[:4], dict(fsdp=4)),
    "242": lambda: make_mesh(jax.devices()[4:8], dict(fsdp=2, tensor=2)),
}


@settings(max_examples=200, deadline=None)
@given(
    _rules,
    st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d", None]), st.integers(1, 24)), min_size=1, max_size=4),
    st.sampled_from(sorted(_MESHES)),
)
def test_logical_to_spec_properties(rules, dims, mesh_name) -> None:
    """Each mesh axis at most once; every split divides its dimension; only rule-listed axes are used."""
    mesh = _MESHES[mesh_name]()
    names = tuple(n for n, _ in dims)
    shape = tuple(s for _, s in dims)
    spec = logical_to_spec(names, rules, mesh, shape)
    assert len(spec) == len(names)
    used = []
    for name, size, entry in zip(names, shape, spec):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        used.extend(axes)
        assert size % int(np.prod([mesh.shape[a] for a in axes] or [1])) == 0
        first_rule = next((v for k, v in rules if k == name), None) if name is not None else None
        allowed = () if first_rule is None else (first_rule,) if isinstance(first_rule, str) else tuple(first_rule)
        assert set(axes) <= set(allowed)
        assert all(mesh.shape[a] > 1 for a in axes)
    assert len(used) == len(set(used))
    NamedSharding(mesh, spec)  # a valid sharding for this mesh


def test_logical_to_spec_never_repeats_an_axis_listed_twice_in_one_rule() -> None:
    """The module's promise "a mesh axis is used at most once per array" must also hold for a rule that names
    an axis twice (config validation accepts such a rule)."""
    spec = logical_to_spec(("batch",), (("batch", ("data", "data")),), mesh_222(), (8,))
    assert spec == P("data")


# -- init and forward on different meshes ----------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0,))
def _logits(graphdef, params, tokens, positions, mask):
    return nnx.merge(graphdef, params)(tokens, positions, mask)[0]


_BATCH = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(8, 12)).astype(np.int32)


def _run(graphdef, params):
    b, t = _BATCH.shape
    return np.asarray(
        _logits(
            graphdef,
            params,
            jnp.asarray(_BATCH),
            jnp.broadcast_to(jnp.arange(t), (b, t)),
            segment_causal_mask(jnp.ones((b, t), jnp.int32)),
        )
    )


@pytest.fixture(scope="module")
def single_device_reference():
    graphdef, params = init_params(CFG, make_mesh(jax.devices()[:1], {}), RULES, seed=0)
    return graphdef, jax.device_get(params), _run(graphdef, params)


MESH_CASES = {
    "data8": lambda: make_mesh(jax.devices(), dict(data=8)),
    "data2_fsdp2_tensor2": mesh_222,
    "tensor4_submesh": lambda: make_mesh(jax.devices()[4:8], dict(tensor=4)),
}
# expected specs of a few parameters (checks the meshes really split something)
EXPECTED_SPECS = {
    "data8": {"table": P(None, None), "q": P(None, None, None), "gate": P(None, None)},
    "data2_fsdp2_tensor2": {"table": P("tensor", "fsdp"), "q": P("fsdp", "tensor", None), "gate": P("fsdp", "tensor")},
    "tensor4_submesh": {
        "table": P("tensor", None),
        "q": P(None, "tensor", None),
        "gate": P(None, "tensor"),
        "k": P(None, None, None),
    },  # 2 kv heads do not split over 4
}


@pytest.fixture(scope="module")
def params_on():
    """case -> (mesh, graphdef, params with seed 0), each initialized once."""
    cache = {}

    def get(case):
        if case not in cache:
            mesh = MESH_CASES[case]()
            cache[case] = (mesh, *init_params(CFG, mesh, RULES, seed=0))
        return cache[case]

    return get


@pytest.mark.parametrize("case", sorted(MESH_CASES))
def test_init_and_logits_do_not_depend_on_the_mesh(case, single_device_reference, params_on) -> None:
    _, ref_params, ref_logits = single_device_reference
    mesh, graphdef, params = params_on(case)
    layer = params["layers"][0]
    specs = {
        "table": params["embedder"]["table"],
        "q": layer["attn"]["q_proj"]["w"],
        "gate": layer["mlp"]["gate_proj"]["w"],
        "k": layer["attn"]["k_proj"]["w"],
    }
    for name, spec in EXPECTED_SPECS[case].items():
        assert specs[name].sharding.spec == spec, name
        assert set(specs[name].sharding.device_set) == set(mesh.devices.flat)

    # same seed -> same values, whatever the mesh
    for got, want in zip(jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(_run(graphdef, params), ref_logits, atol=1e-5, rtol=0)


def test_reshard_between_disjoint_submeshes_keeps_values(single_device_reference, params_on) -> None:
    _, params = params_on("tensor4_submesh")[1:]  # on devices 4..7
    dst_mesh = make_mesh(jax.devices()[:4], dict(fsdp=2, tensor=2))
    _, abstract_state = abstract_model(CFG)
    dst_shardings = param_shardings(abstract_state, RULES, dst_mesh)
    moved = reshard(params, dst_shardings)

    src_devices, dst_devices = set(jax.devices()[4:8]), set(jax.devices()[:4])
    for before, after, want in zip(
        jax.tree.leaves(params), jax.tree.leaves(moved), jax.tree.leaves(dst_shardings), strict=True
    ):
        assert set(before.sharding.device_set) == src_devices
        assert set(after.sharding.device_set) == dst_devices
        assert after.sharding == want
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    assert moved["embedder"]["table"].sharding.spec == P("tensor", "fsdp")
    assert moved["layers"][0]["attn"]["k_proj"]["w"].sharding.spec == P("fsdp", "tensor", None)
    # the moved params still compute the same logits on their new mesh
    graphdef = single_device_reference[0]
    np.testing.assert_allclose(_run(graphdef, moved), single_device_reference[2], atol=1e-5, rtol=0)


# -- the expert axis -------------------------------------------------------------------------------


def test_make_mesh_adds_the_expert_axis_only_when_asked() -> None:
    mesh = make_mesh(jax.devices(), dict(fsdp=2, expert=4))
    assert mesh.axis_names == ("data", "fsdp", "tensor", "expert")
    assert dict(mesh.shape) == dict(data=1, fsdp=2, tensor=1, expert=4)
    assert make_mesh(jax.devices()[:2], dict(data=2)).axis_names == MESH_AXES  # meshes without experts are unchanged
    with pytest.raises(ValueError, match="unknown axes \\['pipeline'\\]"):
        make_mesh(jax.devices(), dict(pipeline=8))
    rules = (("exp", "expert"), ("embed", "fsdp"), ("mlp", "tensor"))
    assert logical_to_spec(("exp", "embed", "mlp"), rules, mesh, (8, 64, 32)) == P("expert", "fsdp", None)
    # on a mesh without the expert axis the same rules leave experts replicated
    assert logical_to_spec(("exp", "embed", "mlp"), rules, mesh_222(), (8, 64, 32)) == P(None, "fsdp", "tensor")


def test_config_validation_accepts_the_expert_axis_and_checks_moe_keys() -> None:
    from gyre_jax.config import ConfigError, config_from_dict, device_count, validate

    base = load_config(EIGHT_DEVICES)
    moe = {"model.num_experts": 8, "model.num_experts_per_tok": 2, "model.moe_mlp_dim": 64}
    c = config_from_dict(
        base,
        {
            "mesh.data": 2,
            "mesh.expert": 2,
            "sharding_rules": tuple(base.sharding_rules) + (("exp", "expert"),),
            **moe,
        },
    )
    assert device_count(c) == 8 and c.mesh.shape() == dict(data=2, fsdp=2, tensor=1, expert=2)
    validate(c)
    with pytest.raises(ConfigError, match="config.model.num_experts_per_tok=0 must be in \\[1, num_experts=8\\]"):
        config_from_dict(c, {"model.num_experts_per_tok": 0})
    with pytest.raises(ConfigError, match="remat_policy='everything' must be one of"):
        config_from_dict(c, {"model.remat_policy": "everything"})
