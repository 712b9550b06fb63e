"""DotGeneral: plain outside fp8_autocast, FP8 with its meta inside; nn.scan; meta across devices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from mtjax import fp8
from tests.fp8.mlp import MLP, Dense

pytestmark = pytest.mark.usefixtures("fast_compiles")

HISTORY = 4
DELAYED = fp8.DelayedScaling(amax_history_len=HISTORY)
X = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16), np.float32))


def test_plain_outside_autocast():
    model = Dense(12, dtype=jnp.float32)
    variables = model.init(jax.random.key(1), X)
    assert set(variables) == {"params"}
    want = lax.dot_general(X, variables["params"]["kernel"], (((1,), (0,)), ((), ())))
    np.testing.assert_array_equal(model.apply(variables, X), want)


def test_meta_variables_created_inside_autocast():
    with fp8.fp8_autocast(recipe=DELAYED):
        variables = MLP(32, 8).init(jax.random.key(1), X)
    meta = variables[fp8.FP8_COLLECTION]
    assert set(meta) == {"Dense_0", "Dense_1"}
    assert jax.tree.map(jnp.shape, meta["Dense_0"]["DotGeneral_0"]) == {
        f"{role}_{field}": shape
        for role in fp8.ROLES for field, shape in (("amax_history", (HISTORY,)), ("scale", ()))}
    # The same variables run outside autocast as a plain bf16 model (the meta is ignored).
    assert MLP(32, 8).apply(variables, X).shape == (8, 8)
    with fp8.fp8_autocast(recipe=fp8.CurrentScaling()):
        assert set(MLP(32, 8).init(jax.random.key(1), X)) == {"params"}  # current scaling: no state


def test_missing_or_mismatched_meta_is_an_error():
    variables = MLP(32, 8).init(jax.random.key(1), X)
    with fp8.fp8_autocast(recipe=DELAYED), pytest.raises(ValueError, match="inside fp8_autocast"):
        MLP(32, 8).apply(variables, X)
    with fp8.fp8_autocast(recipe=DELAYED):
        variables = MLP(32, 8).init(jax.random.key(1), X)
    with (fp8.fp8_autocast(recipe=fp8.DelayedScaling(amax_history_len=8)),
          pytest.raises(ValueError, match="amax_history_len")):
        MLP(32, 8).apply(variables, X)


class ScannedStack(nn.Module):
    """``layers`` residual Dense layers under nn.scan, the way the GPT model scans its blocks."""

    layers: int

    @nn.compact
    def __call__(self, x):
        def body(layer, h, _):
            return h + layer(h), None

        scan = nn.scan(body, variable_axes={"params": 0, fp8.FP8_COLLECTION: 0},
                       split_rngs={"params": True}, length=self.layers)
        x, _ = scan(Dense(x.shape[-1], dtype=jnp.float32), x, None)
        return x


def test_scan_gives_meta_a_leading_layer_axis():
    model = ScannedStack(layers=3)
    with fp8.fp8_autocast(recipe=DELAYED):
        variables = model.init(jax.random.key(2), X)
        grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, X) ** 2)))(variables)
    meta = grads[fp8.FP8_COLLECTION]["Dense_0"]["DotGeneral_0"]
    assert meta["input_amax_history"].shape == (3, HISTORY) and meta["input_scale"].shape == (3,)
    # Layer i saw its own input: layer 0 the model input, later layers the growing residual stream.
    assert float(meta["input_amax_history"][0, 0]) == float(jnp.max(jnp.abs(X)))
    assert len(set(np.asarray(meta["input_amax_history"][:, 0]).tolist())) == 3
    np.testing.assert_array_equal(meta["input_amax_history"][:, 1:], 0.0)


@pytest.mark.parametrize("mesh_axes, check_vma, shared", [
    (("dp",), False, True),   # reduced because fp8_autocast names the axis
    (None, True, True),       # reduced because the meta is replicated and the data is not
    (None, False, False),     # untyped shard_map, nothing named: each shard keeps its own amax
], ids=["mesh_axes", "vma", "local"])
def test_meta_across_data_parallel_shards(mesh_axes, check_vma, shared):
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    model = MLP(32, 8, dtype=jnp.float32)
    rows = np.random.default_rng(3).standard_normal((64, 16), np.float32)
    x = jnp.asarray(rows * np.arange(1, 65)[:, None])  # shards differ
    with fp8.fp8_autocast(recipe=DELAYED):
        variables = model.init(jax.random.key(1), x)

    def per_shard(variables, x):
        with fp8.fp8_autocast(recipe=DELAYED, mesh_axes=mesh_axes):
            grads = jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(variables)
        return jax.tree.map(lambda m: m[None], grads)

    sharded = jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P("dp"), check_vma=check_vma)
    grads = jax.jit(sharded)(variables, jax.device_put(x, jax.NamedSharding(mesh, P("dp"))))
    metas = grads[fp8.FP8_COLLECTION]
    history = np.asarray(metas["Dense_0"]["DotGeneral_0"]["input_amax_history"][:, 0])
    if shared:
        np.testing.assert_array_equal(history, float(jnp.max(jnp.abs(x))))  # the global amax everywhere
        for leaf in jax.tree.leaves(metas):
            np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))
    else:
        assert len(set(history.tolist())) == 8
    if check_vma:  # a replicated kernel's gradient is summed over the shards, as for a plain dot
        with fp8.fp8_autocast(recipe=DELAYED):
            full = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2)))(variables)
        kernel = grads["params"]["Dense_0"]["kernel"]
        np.testing.assert_array_equal(kernel, np.broadcast_to(kernel[:1], kernel.shape))
        want = full["params"]["Dense_0"]["kernel"]
        assert float(jnp.linalg.norm(kernel[0] - want) / jnp.linalg.norm(want)) < 0.1
