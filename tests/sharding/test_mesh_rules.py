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
    init_sharded,
    jit_sharded,
    logical_axis_rules,
    logical_shardings,
    named_sharding,
    shard_variables,
)


def test_mesh_axes_order_and_mode():
    mesh = MeshConfig(dp=2, fsdp=2, tp=2).make_mesh()
    assert mesh.axis_names == AXES == ("pp", "dp", "fsdp", "tp")
    assert dict(mesh.shape) == {"pp": 1, "dp": 2, "fsdp": 2, "tp": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    # tp is innermost: a tp group is a pair of consecutive devices.
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(-1, 2)
    assert (ids[:, 1] - ids[:, 0] == 1).all()


def test_mesh_product_must_match_devices():
    with pytest.raises(ValueError, match=r"pp=1 \* dp=2 \* fsdp=1 \* tp=2 = 4 devices, but 8"):
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
