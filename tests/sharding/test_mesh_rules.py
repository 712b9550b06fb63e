"""MeshConfig, the logical-axis rules and the helpers that apply them (8 virtual CPU devices)."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from mtjax.sharding import (
    AXES,
    MeshConfig,
    MeshResource,
    extend_logical_axis_rules,
    init_sharded,
    jit_sharded,
    logical_axis_rules,
    logical_shardings,
    named_sharding,
    shard_variables,
)

pytestmark = pytest.mark.usefixtures("fast_compiles")


def test_mesh_axes_order_and_mode():
    mesh = MeshConfig(dp=2, fsdp=2, tp=2).make_mesh()
    assert mesh.axis_names == AXES == ("pp", "dp", "fsdp", "ep", "cp", "tp")
    assert dict(mesh.shape) == {"pp": 1, "dp": 2, "fsdp": 2, "ep": 1, "cp": 1, "tp": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    # tp is innermost: a tp group is a pair of consecutive devices.
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(-1, 2)
    assert (ids[:, 1] - ids[:, 0] == 1).all()


def test_mesh_product_must_match_devices():
    with pytest.raises(ValueError, match=r"pp=1 \* dp=2 \* fsdp=1 \* ep=1 \* cp=1 \* tp=2 = 4 devices, but 8"):
        MeshConfig(dp=2, tp=2).make_mesh()
    assert MeshConfig(dp=2, tp=2).make_mesh(jax.devices()[:4]).size == 4


@pytest.mark.parametrize("kwargs", [dict(dp=0), dict(tp=-1), dict(pp=1.5), dict(fsdp=True)])
def test_mesh_config_rejects_bad_sizes(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"MeshConfig\({name}="):
        MeshConfig(**kwargs)
    with pytest.raises(TypeError, match="sp="):
        MeshConfig(sp=1)


def test_default_rules_megatron_layout():
    rules = logical_axis_rules(MeshConfig(dp=2, fsdp=2, tp=2, sp=True))
    to_mesh = lambda *names: nn.logical_to_mesh_axes(names, rules)
    # Residual stream: batch over both data axes, sequence over tp (sequence parallelism).
    assert to_mesh("activation_batch", "activation_length", "activation_embed") == P(("dp", "fsdp"), "tp", None)
    # Inside attention / the MLP, tp splits heads or columns and the sequence is whole.
    assert to_mesh("activation_batch", "activation_length", "activation_heads", "activation_head_dim") == P(
        ("dp", "fsdp"), None, "tp", None)
    assert to_mesh("activation_batch", "activation_length", "activation_mlp") == P(("dp", "fsdp"), None, "tp")
    assert to_mesh("activation_batch", "activation_length", "activation_vocab") == P(("dp", "fsdp"), None, "tp")
    # Weights: FSDP on the model dim, tp on heads / MLP / vocab, stages on the scanned layers.
    assert to_mesh("layers", "embed", "heads", "head_dim") == P("pp", "fsdp", "tp", None)
    assert to_mesh("layers", "mlp", "embed") == P("pp", "tp", "fsdp")
    assert to_mesh("vocab", "embed") == P("tp", "fsdp")
    no_sp = logical_axis_rules(MeshConfig(dp=2, fsdp=2, tp=2))
    assert nn.logical_to_mesh_axes(("activation_batch", "activation_length", "activation_embed"), no_sp) == P(
        ("dp", "fsdp"), None, None)


def test_rules_overrides():
    rules = dict(logical_axis_rules(MeshConfig(), overrides={"embed": None, "experts": "dp"}))
    assert rules["embed"] is None and rules["experts"] == "dp" and rules["mlp"] == "tp"
    with pytest.raises(ValueError, match="overrides=.*'embed'.*mesh axis"):
        logical_axis_rules(MeshConfig(), overrides={"embed": "model"})
    with pytest.raises(TypeError, match="expected a MeshConfig"):
        logical_axis_rules({"dp": 2})


class _TwoLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
        w1 = self.param("w1", nn.with_logical_partitioning(nn.initializers.normal(1.0), ("embed", "mlp")), (8, 16))
        w2 = self.param("w2", nn.with_logical_partitioning(nn.initializers.normal(1.0), ("mlp", "embed")), (16, 8))
        h = nn.with_logical_constraint(x @ w1, ("activation_batch", "activation_mlp"))
        return h @ w2


def test_sharded_init_and_jit_match_unsharded():
    config = MeshConfig(dp=2, fsdp=2, tp=2)
    mesh, rules = config.make_mesh(), logical_axis_rules(config)
    model, x = _TwoLayer(), jax.random.normal(jax.random.key(1), (8, 8))
    boxed = model.init(jax.random.key(0), x)
    variables = init_sharded(model.init, jax.random.key(0), x, mesh=mesh, rules=rules)
    assert variables["params"]["w1"].sharding.spec == P("fsdp", "tp")
    assert variables["params"]["w2"].sharding.spec == P("tp", "fsdp")
    placed = shard_variables(boxed, mesh, rules)
    np.testing.assert_array_equal(placed["params"]["w1"], variables["params"]["w1"])
    assert jax.tree.map(lambda a: a.spec, logical_shardings(boxed, mesh, rules)) == jax.tree.map(
        lambda a: a.sharding.spec, variables)

    x_sharding = named_sharding(mesh, rules, ("activation_batch", None))
    assert x_sharding.spec == P(("dp", "fsdp"), None)
    step = jit_sharded(lambda v, x: model.apply(v, x), mesh=mesh, rules=rules, in_shardings=(None, x_sharding))
    y = step(variables, jax.device_put(x, x_sharding))
    np.testing.assert_allclose(y, model.apply(nn.meta.unbox(boxed), x), rtol=1e-5, atol=1e-5)
    # The constraint on the hidden activation resolved against the rules: tp splits the MLP columns.
    assert 'sharding_constraint %0 <@mesh, [{"dp", "fsdp"}, {"tp"}]>' in step.lower(variables, x).as_text()


def test_mesh_resource_rules_name_only_the_meshs_axes():
    resource = MeshResource(dp_resource="data", tp_resource="model")
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rules = logical_axis_rules(resource, mesh=mesh)
    named = {a for _, axes in rules for a in ((axes,) if isinstance(axes, str) else (axes or ()))}
    assert named == {"data", "model"}
    to_mesh = lambda *names: nn.logical_to_mesh_axes(names, rules)
    assert to_mesh("activation_batch", "activation_length", "activation_embed") == P("data", None, None)
    assert to_mesh("embed", "heads", "head_dim") == P(None, "model", None)
    assert to_mesh("layers", "mlp", "embed") == P(None, "model", None)
    # tpsp_resource: tensor parallelism plus the sequence split between the blocks.
    sp_rules = logical_axis_rules(MeshResource(dp_resource="data", tpsp_resource="model"))
    assert nn.logical_to_mesh_axes(("activation_batch", "activation_length", "activation_embed"), sp_rules) == P(
        "data", "model", None)
    # MeshConfig's own rules name fsdp, pp...: a clear error for a mesh that lacks them.
    dp_tp = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match=r"\['activation_batch', 'embed'\] to mesh axis 'fsdp'.*\('dp', 'tp'\).*"
                                         "MeshResource"):
        logical_axis_rules(MeshConfig(dp=4, tp=2), mesh=dp_tp)
    with pytest.raises(ValueError, match=r"overrides=.*'embed'.*\('data', 'model'\)"):
        logical_axis_rules(resource, {"embed": "fsdp"})


def test_mesh_config_is_a_mesh_resource_of_its_own_axes():
    assert MeshConfig(sp=True).mesh_resource() == MeshResource(dp_resource="dp", tpsp_resource="tp",
                                                               fsdp_resource="fsdp", pp_resource="pp",
                                                               cp_resource="cp", ep_resource="ep")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(dp_resource=3), TypeError, "dp_resource=3"),
    (dict(tp_resource=""), TypeError, "tp_resource=''"),
    (dict(tp_resource="model", tpsp_resource="model2"), ValueError, "set one of them"),
    (dict(dp_resource="x", fsdp_resource="x"), ValueError, r"'x' is named for \['dp_resource', 'fsdp_resource'\]"),
])
def test_mesh_resource_rejects_bad_axes(kwargs, error, match):
    with pytest.raises(error, match=match):
        MeshResource(**kwargs)


def test_transformer_layer_on_a_two_axis_mesh_matches_one_device():
    """TransformerEngine's 2-axis (dp, tp) mesh: rules from a MeshResource, the layer's weights split
    over tp, its output as on one device."""
    from mtjax.flax import TransformerLayer

    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    rules = logical_axis_rules(MeshResource(dp_resource="dp", tp_resource="tp"), mesh=mesh)
    layer = TransformerLayer(hidden_size=16, mlp_hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                             attention_dropout=0.0)
    x = jax.random.normal(jax.random.key(0), (8, 6, 16))
    variables = init_sharded(lambda k, x: layer.init(k, x, deterministic=True), jax.random.key(1), x, mesh=mesh,
                             rules=rules)
    assert variables["params"]["mlp"]["wi_kernel"].sharding.spec == P(None, None, "tp")
    apply = jit_sharded(lambda v, x: layer.apply(v, x, deterministic=True), mesh=mesh, rules=rules)
    expected = jax.jit(lambda v, x: layer.apply(v, x, deterministic=True))(jax.device_get(variables), x)
    np.testing.assert_allclose(apply(variables, x), expected, rtol=1e-5, atol=1e-5)


def test_extend_logical_axis_rules_adds_mtjax_rules_for_the_autocast_mesh_resource():
    from mtjax import fp8
    from mtjax.flax import extend_logical_axis_rules as flax_extend

    assert flax_extend is extend_logical_axis_rules
    with pytest.raises(ValueError, match="no MeshResource"):
        extend_logical_axis_rules(())
    mine = (("my_broadcast_axis", None), ("my_tp_axis", "model"), ("embed", None))
    with fp8.autocast(enabled=False, mesh_resource=MeshResource(dp_resource="data", tp_resource="model")):
        rules = extend_logical_axis_rules(mine)
    assert rules[:3] == mine and dict(rules)["mlp"] == "model" and dict(rules)["activation_batch"] == "data"
    assert [name for name, _ in rules].count("embed") == 1  # your rule for a name wins
    with pytest.raises(ValueError, match="not a .logical name, mesh axes. pair"):
        extend_logical_axis_rules([("embed",)], mesh_resource=MeshResource())
