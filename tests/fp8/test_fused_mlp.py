"""`fp8.fp8_mlp`: the MLP's two FP8 GEMMs in one custom_vjp, whose activation backward writes fc1's
FP8 output gradient (`ops.activation_grad_fp8` per tensor, `ops.activation_grad_tile_fp8` in 1x128
tiles): the same numbers as the two GEMMs one at a time."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import fp8, ops
from mtjax.config import override
from mtjax.flax import LayerNormMLP

pytestmark = pytest.mark.usefixtures("fast_compiles")

activation_ops = importlib.import_module("mtjax.ops.activation")
DENSE = (((1,), (0,)), ((), ()))
DELAYED = fp8.DelayedScaling(amax_history_len=4)
BLOCK = fp8.BlockScaling()


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def mlp_inputs(activation, with_norm, m=64, hidden=96, mlp=80, out=72, seed=0):
    rng = np.random.default_rng(seed)
    gated = ops.is_gated(activation)

    def normal(shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale)

    x = normal((m, hidden), 2.0) + 0.5
    w1 = normal((hidden, 2, mlp) if gated else (hidden, mlp), hidden**-0.5)
    w2 = normal((mlp, out), mlp**-0.5)
    dy = normal((m, out), 1e-2)
    act = ops.Activation(normal((2, mlp) if gated else (mlp,), 0.1), activation)
    norm = ops.Norm(1 + normal((hidden,), 0.1), normal((hidden,), 0.1)) if with_norm else None
    return x, w1, w2, dy, act, norm


@functools.partial(jax.jit, static_argnames=("fused",))
def fwd_bwd(x, w1, w2, dy, act, norm, metas, fused):
    """(y, and the cotangents of x, norm, w1, act, w2, metas) of the MLP, fused or one GEMM at a time."""
    def mlp(x, norm, w1, act, w2, metas):
        if fused:
            return fp8.fp8_mlp(x, w1, w2, *metas, activation=act, norm=norm, recipe=DELAYED)
        h = fp8.fp8_dot_general(x, w1, DENSE, metas[0], recipe=DELAYED, lhs_prologue=norm)
        return fp8.fp8_dot_general(h, w2, DENSE, metas[1], recipe=DELAYED, lhs_prologue=act)  # act(h) is 2-D
    y, vjp = jax.vjp(mlp, x, norm, w1, act, w2, metas)
    return (y, *vjp(dy))


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
@pytest.mark.parametrize("activation,with_norm", [("gelu", True), ("swiglu", True), ("gelu", False)])
def test_fused_mlp_matches_the_gemms_one_at_a_time(activation, with_norm, implementation, interpret):
    """In float32 both paths quantize the same float32 gradient of the activation with the same scale
    (one at a time it goes through fc1's cast_transpose, fused through the activation's FP8
    backward), so outputs, every cotangent and the next metas agree to float rounding (an element on
    a rounding boundary of FP8 may round the other way: 1e-4, not exact). Two steps, so the second
    quantizes with calibrated scales."""
    x, w1, w2, dy, act, norm = mlp_inputs(activation, with_norm)
    results = {}
    kernels = ("activation", "activation_fp8", "activation_grad_fp8", "layernorm", "norm_fp8")
    with override(implementations={op: implementation for op in kernels}):
        for fused in (True, False):
            metas = (fp8.init_meta(4), fp8.init_meta(4))
            for _ in range(2):
                y, dx, dnorm, dw1, dact, dw2, metas = fwd_bwd(x, w1, w2, dy, act, norm, metas, fused)
            results[fused] = (y, dx, dnorm, dw1, dact, dw2, metas)
    got, want = results[True], results[False]
    for name, a, b in zip(("y", "dx", "dw1", "dw2", "dbias"), (got[0], got[1], got[3], got[5], got[4].bias),
                          (want[0], want[1], want[3], want[5], want[4].bias)):
        assert a.shape == b.shape and rel_err(a, b) < 1e-4, name
    if with_norm:
        assert rel_err(got[2].gamma, want[2].gamma) < 1e-4 and rel_err(got[2].beta, want[2].beta) < 1e-4
    for meta, meta_ref in zip(got[6], want[6]):
        for key in meta:
            np.testing.assert_allclose(meta[key], meta_ref[key], rtol=1e-5, err_msg=key)
    assert float(got[6][0]["output_grad_amax_history"][0]) > 0  # fc1's gradient amax came from the fused backward


def test_layernorm_mlp_runs_the_fused_op_without_dropout(spy):
    """Under delayed scaling without active dropout the module runs `fp8_mlp` (the activation's FP8
    backward is traced once per gradient); its variables are the same `wi_dot_general`/`wo_dot_general`
    metas as the unfused path's, which dropout takes, so one checkpoint serves both."""
    calls = spy(activation_ops, "activation_grad_fp8", lambda args, kwargs: args[2])
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    model = LayerNormMLP(intermediate_dim=48, activations=("gelu",), intermediate_dropout_rate=0.1, use_bias=True)
    with fp8.fp8_autocast(recipe=DELAYED):
        variables = jax.jit(functools.partial(model.init, deterministic=True))(jax.random.key(1), x)

        def loss(v, deterministic):
            return jnp.sum(model.apply(v, x, deterministic=deterministic, rngs={"dropout": jax.random.key(2)})[0])

        grads = jax.jit(jax.grad(loss), static_argnums=1)(variables, True)
        assert calls == ["gelu"]
        grads_dropout = jax.jit(jax.grad(loss), static_argnums=1)(variables, False)
    assert calls == ["gelu"]  # active dropout: one GEMM at a time
    assert jax.tree.structure(grads) == jax.tree.structure(grads_dropout) == jax.tree.structure(variables)
    meta = grads[fp8.FP8_COLLECTION]["wi_dot_general"]
    assert float(meta["output_grad_amax_history"][0]) > 0 and float(meta["input_amax_history"][0]) > 0


@pytest.mark.parametrize("activation,with_norm,mlp,implementation", [
    ("swiglu", True, 256, "xla"), ("swiglu", True, 256, "pallas_triton"), ("swiglu", False, 200, "pallas_triton")])
def test_block_scaled_fused_mlp_matches_the_gemms_one_at_a_time(activation, with_norm, mlp, implementation,
                                                                 interpret):
    """Under `BlockScaling` both paths cast the same float32 gradient of the activation in the same
    tiles (one at a time through fc1's `tile_quantize`, fused through the activation's tile-cast
    backward; a gated ``mlp`` off the 128-wide tiles takes the two kernels the fused one replaces).
    With the XLA references the numbers are identical; with the kernels the derivative rounds in
    another order, so an element on an FP8 rounding boundary may round the other way."""
    x, w1, w2, dy, act, norm = mlp_inputs(activation, with_norm, m=256, hidden=128, mlp=mlp, out=136)

    def fused(x, norm, w1, act, w2):
        return fp8.fp8_mlp(x, w1, w2, None, None, activation=act, norm=norm, recipe=BLOCK)

    def one_at_a_time(x, norm, w1, act, w2):
        h = fp8.fp8_dot_general(x, w1, DENSE, recipe=BLOCK, lhs_prologue=norm)
        return fp8.fp8_dot_general(h, w2, DENSE, recipe=BLOCK, lhs_prologue=act)

    kernels = ("activation", "activation_tile_fp8", "activation_grad_tile_fp8", "norm_tile_fp8", "layernorm")
    results = []
    # Both paths' GEMMs on XLA: interpreted, the block-scaled GEMM kernel (tests/kernels) took most of the time.
    with override(implementations={op: implementation for op in kernels} | {"block_fp8_gemm": "xla"}):
        for mlp in (fused, one_at_a_time):
            y, vjp = jax.vjp(jax.jit(mlp), x, norm, w1, act, w2)
            results.append((y, *vjp(dy)))
    bound = 0.0 if implementation == "xla" else 1e-3
    for got, want in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        assert got.shape == want.shape and rel_err(got, want) <= bound


def test_layernorm_mlp_runs_the_block_scaled_fused_op(spy):
    calls = spy(activation_ops, "activation_grad_tile_fp8", lambda args, kwargs: args[2])
    x = jax.random.normal(jax.random.key(0), (2, 64, 128))
    model = LayerNormMLP(intermediate_dim=256, activations=("silu", "linear"), use_bias=True)
    with fp8.fp8_autocast(recipe=BLOCK):
        variables = jax.jit(functools.partial(model.init, deterministic=True))(jax.random.key(1), x)
        grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x, deterministic=True)[0])))(variables)
    assert calls == ["swiglu"] and set(grads) == {"params"}
    assert all(np.all(np.isfinite(g)) and np.any(g != 0) for g in jax.tree.leaves(grads))


def test_fp8_mlp_rejects_bad_operands():
    x, w1, w2, _, act, norm = mlp_inputs("gelu", True)
    metas = (fp8.init_meta(4), fp8.init_meta(4))
    with pytest.raises(ValueError, match=r"w1 of shape .* expected \[hidden, mlp\]"):
        fp8.fp8_mlp(x, w1[None], w2, *metas, activation=act, norm=norm, recipe=DELAYED)
    with pytest.raises(ValueError, match=r"w2 of shape .* \[mlp, out\]"):
        fp8.fp8_mlp(x, w1, w2.T, *metas, activation=act, norm=norm, recipe=DELAYED)
    with pytest.raises(TypeError, match="activation must be a mtjax.ops.Activation"):
        fp8.fp8_mlp(x, w1, w2, *metas, activation="gelu", norm=norm, recipe=DELAYED)
    with pytest.raises(TypeError, match="DelayedScaling"):
        fp8.fp8_mlp(x, w1, w2, None, None, activation=act, recipe=fp8.CurrentScaling())
    with pytest.raises(ValueError, match="keeps no state"):
        fp8.fp8_mlp(x, w1, w2, *metas, activation=act, norm=norm, recipe=BLOCK)
    with pytest.raises(ValueError, match="amax_history"):
        fp8.fp8_mlp(x, w1, w2, fp8.init_meta(8), metas[1], activation=act, recipe=DELAYED)
