"""LayerNormMLP with SwiGLU under tensor parallelism on the 8 virtual CPU devices.

fc1's kernel is ``[embed, 2, mlp]`` with ``mlp`` split over ``tp`` and its output ``[..., 2, mlp]``
goes to the activation as is, so each device computes ``silu(a) * gate`` on its own columns: the
compiled step has no all-to-all and no collective-permute (a ``[..., 2 * mlp]`` layout, split in
halves, made XLA reshuffle the sharded axis), and it gives the single-device output and gradients.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax.axes import BATCH_LENGTH_EMBED
from mtjax.flax import LayerNormMLP
from mtjax.sharding import (
    MeshConfig,
    jit_sharded,
    logical_axis_rules,
    logical_shardings,
    named_sharding,
    shard_variables,
)

pytestmark = pytest.mark.usefixtures("fast_compiles")

MLP = LayerNormMLP(intermediate_dim=32, activations=("silu", "linear"), use_bias=True, intermediate_dropout_rate=0.0)
X = jax.random.normal(jax.random.key(0), (4, 8, 16))
COTANGENT = jax.random.normal(jax.random.key(1), (4, 8, 16))


def loss_fn(variables, x):
    y, _ = MLP.apply(variables, x, deterministic=True)
    return jnp.sum(y * COTANGENT), y


grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)


@pytest.fixture(scope="module")
def boxed():
    return jax.jit(functools.partial(MLP.init, deterministic=True))(jax.random.key(2), X)


@pytest.fixture(scope="module")
def reference(boxed):
    """Single-device output and gradients."""
    return jax.jit(grad_fn)(nn.meta.unbox(boxed), X)


@pytest.mark.parametrize("mesh_config", [MeshConfig(dp=2, tp=4), MeshConfig(dp=2, tp=4, sp=True)],
                         ids=["dp2-tp4", "dp2-tp4-sp"])
def test_swiglu_mlp_is_local_under_tensor_parallelism(boxed, reference, mesh_config):
    mesh, rules = mesh_config.make_mesh(), logical_axis_rules(mesh_config)
    shardings = logical_shardings(boxed, mesh, rules)
    assert tuple(shardings["params"]["wi_kernel"].spec)[1:] == (None, "tp")  # [embed, 2, mlp]: mlp over tp
    assert tuple(shardings["params"]["wi_bias"].spec) == (None, "tp")
    x_sharding = named_sharding(mesh, rules, BATCH_LENGTH_EMBED)
    step = jit_sharded(grad_fn, mesh=mesh, rules=rules, in_shardings=(shardings, x_sharding))
    variables, x = shard_variables(boxed, mesh, rules), jax.device_put(X, x_sharding)

    hlo = step.lower(variables, x).compile().as_text()
    assert "all-to-all" not in hlo and "collective-permute" not in hlo
    assert "all-reduce" in hlo or "reduce-scatter" in hlo  # fc2's row-parallel sum: tp is in effect

    (loss, y), (grads, dx) = step(variables, x)
    (want_loss, want_y), (want_grads, want_dx) = reference
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        want = functools.reduce(lambda tree, key: tree[key.key], path, want_grads)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
