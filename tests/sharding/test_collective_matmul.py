"""Collective matmul on 8 virtual CPU devices: the decomposed all-gather / reduce-scatter GEMMs give
the plain sharded GEMMs' numbers (forward and gradients) and their HLO has collective-permutes
where the plain one has the all-gather."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtjax import ops
from mtjax.sharding import MeshConfig

pytestmark = pytest.mark.usefixtures("fast_compiles")

BATCH, SEQ, HIDDEN, MLP = 4, 16, 8, 32


@pytest.fixture(scope="module")
def arrays():
    k = jax.random.split(jax.random.key(0), 4)
    return (jax.random.normal(k[0], (BATCH, SEQ, HIDDEN)), jax.random.normal(k[1], (HIDDEN, MLP)),
            jax.random.normal(k[2], (MLP, HIDDEN)), jax.random.normal(k[3], (BATCH, SEQ, HIDDEN)))


def mlp(x, w1, w2, *, collective):
    """fc1 (column-parallel) and fc2 (row-parallel) of a sequence-parallel MLP."""
    if collective:
        h = ops.sequence_parallel_matmul(x, w1, kind="all_gather", batch_axes="dp")
        return ops.sequence_parallel_matmul(jnp.tanh(h), w2, kind="reduce_scatter", batch_axes="dp")
    return jnp.tanh(x @ w1) @ w2


@pytest.mark.parametrize("mesh_config", [MeshConfig(dp=2, tp=4), MeshConfig(tp=8)], ids=["dp2-tp4", "tp8"])
def test_collective_matmul_equals_plain(arrays, mesh_config):
    x, w1, w2, dy = arrays
    mesh = mesh_config.make_mesh()
    seq_split = NamedSharding(mesh, P("dp", "tp", None))
    placed = (jax.device_put(x, seq_split), jax.device_put(w1, NamedSharding(mesh, P(None, "tp"))),
              jax.device_put(w2, NamedSharding(mesh, P("tp", None))))

    def value_and_grads(collective):
        def f(x, w1, w2):
            y, vjp = jax.vjp(lambda *a: mlp(*a, collective=collective), x, w1, w2)
            return (y, *vjp(dy))
        with jax.set_mesh(mesh):
            return jax.jit(f)(*placed)

    want = jax.jit(lambda x, w1, w2: (mlp(x, w1, w2, collective=False),
                                      *jax.vjp(lambda *a: mlp(*a, collective=False), x, w1, w2)[1](dy)))(x, w1, w2)
    got = value_and_grads(True)
    for name, a, b in zip(("y", "dx", "dw1", "dw2"), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    assert got[0].sharding.spec == P("dp", "tp", None)  # the output stays sequence-split


def _collectives(hlo):
    return {kind for kind in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
            if re.search(rf"= \S+ {kind}(-start)?\(", hlo)}


def test_hlo_has_collective_permutes_instead_of_the_all_gather(arrays):
    x, w1, w2, _ = arrays
    mesh = MeshConfig(dp=2, tp=4).make_mesh()
    x_spec, w1_spec = NamedSharding(mesh, P("dp", "tp", None)), NamedSharding(mesh, P(None, "tp"))

    def compiled(collective):
        def f(x, w1):
            if collective:
                return ops.sequence_parallel_matmul(x, w1, kind="all_gather", batch_axes="dp")
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("dp", None, None))) @ w1
        with jax.set_mesh(mesh):
            return jax.jit(f, in_shardings=(x_spec, w1_spec)).lower(x, w1).compile().as_text()

    assert "all-gather" in _collectives(compiled(False))
    assert _collectives(compiled(True)) == {"collective-permute"}


def test_errors(arrays):
    x, w1, _, _ = arrays
    with pytest.raises(ValueError, match="kind"):
        ops.sequence_parallel_matmul(x, w1, kind="all_reduce")
    with pytest.raises(ValueError, match="no mesh with a 'tp' axis"):
        ops.sequence_parallel_matmul(x, w1, kind="all_gather")
    with jax.set_mesh(MeshConfig(tp=8).make_mesh()), pytest.raises(ValueError, match=r"must be \[batch, seq, in\]"):
        ops.sequence_parallel_matmul(x[0], w1, kind="all_gather")


def _check_against_single_device(plain, collective, x, config):
    """``collective`` (a module with ``collective_matmul=True``) under ``config``'s mesh: the loss
    and gradients of ``plain`` on one device, and a forward with collective-permutes only."""
    import flax.linen as nn

    from mtjax.axes import BATCH_LENGTH_EMBED
    from mtjax.sharding import jit_sharded, logical_axis_rules, logical_shardings, named_sharding, shard_variables

    cotangent = jax.random.normal(jax.random.key(1), x.shape)

    def grad_fn(module):
        def loss(variables, x):
            return jnp.sum(module.apply(variables, x, deterministic=True)[0] * cotangent)
        return jax.value_and_grad(loss, argnums=(0, 1))

    boxed = jax.jit(lambda k, x: plain.init(k, x, deterministic=True))(jax.random.key(2), x)
    want_loss, (want_grads, want_dx) = jax.jit(grad_fn(plain))(nn.meta.unbox(boxed), x)
    assert jax.jit(grad_fn(collective))(nn.meta.unbox(boxed), x)[0] == pytest.approx(want_loss)  # no mesh: plain

    mesh, rules = config.make_mesh(), logical_axis_rules(config)
    x_sharding = named_sharding(mesh, rules, BATCH_LENGTH_EMBED)
    shardings = logical_shardings(boxed, mesh, rules)
    args = shard_variables(boxed, mesh, rules), jax.device_put(x, x_sharding)
    loss, (grads, dx) = jit_sharded(grad_fn(collective), mesh=mesh, rules=rules,
                                    in_shardings=(shardings, x_sharding))(*args)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    forward = jit_sharded(lambda v, x: collective.apply(v, x, deterministic=True)[0], mesh=mesh, rules=rules,
                          in_shardings=(shardings, x_sharding))
    kinds = _collectives(forward.lower(*args).compile().as_text())
    assert "collective-permute" in kinds and "all-gather" not in kinds and "reduce-scatter" not in kinds


@pytest.mark.parametrize("activations", [("silu", "linear"), ("gelu",)], ids=["swiglu", "gelu"])
def test_layernorm_mlp_with_collective_matmul_equals_single_device(activations):
    from mtjax.flax import LayerNormMLP

    kwargs = dict(intermediate_dim=32, activations=activations, use_bias=True, intermediate_dropout_rate=0.0)
    _check_against_single_device(LayerNormMLP(**kwargs), LayerNormMLP(**kwargs, collective_matmul=True),
                                 jax.random.normal(jax.random.key(0), (4, 8, 16)), MeshConfig(dp=2, tp=4, sp=True))


@pytest.mark.parametrize("gqa", [False, True], ids=["fused-qkv", "gqa-query-kv"])
def test_attention_with_collective_matmul_equals_single_device(gqa):
    """QKV (column-parallel) and out (row-parallel) projections with the decomposed collectives."""
    from mtjax.flax import MultiHeadAttention

    kwargs = dict(head_dim=8, num_attention_heads=4, num_gqa_groups=2 if gqa else None, use_bias=True,
                  layernorm_type="rmsnorm")
    _check_against_single_device(MultiHeadAttention(**kwargs), MultiHeadAttention(**kwargs, collective_matmul=True),
                                 jax.random.normal(jax.random.key(0), (4, 8, 32)),
                                 MeshConfig(dp=4, tp=2, sp=True) if gqa else MeshConfig(dp=2, tp=4, sp=True))
