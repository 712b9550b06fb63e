"""Prologues fused into the FP8 GEMM's input (``lhs_prologue``: a norm, or bias + activation): the same
numbers as prologue-then-GEMM, and used by the modules."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import fp8, ops
from mtjax.config import override
from mtjax.flax import LayerNormDenseGeneral, LayerNormMLP
from mtjax.fp8 import dot_general
from mtjax.ops import normalization

pytestmark = pytest.mark.usefixtures("fast_compiles")

activation_ops = importlib.import_module("mtjax.ops.activation")  # the module (mtjax.ops.activation is also a function)

DENSE = (((1,), (0,)), ((), ()))
DELAYED = fp8.DelayedScaling(amax_history_len=4)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def inputs(layernorm_type, m=64, k=96, n=80, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32) * 2 + 0.5)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) * k**-0.5)
    dy = jnp.asarray(rng.standard_normal((m, n), np.float32) * 1e-2)
    gamma = jnp.asarray(1 + 0.1 * rng.standard_normal(k, np.float32))
    beta = None if layernorm_type == "rmsnorm" else jnp.asarray(0.1 * rng.standard_normal(k, np.float32))
    return x, w, dy, ops.Norm(gamma, beta, layernorm_type=layernorm_type)


@functools.partial(jax.jit, static_argnames=("fused",))
def fwd_bwd(x, w, dy, prologue, meta, fused):
    """(y, dx, dprologue, dw, next meta) of the FP8 dense of prologue(x): fused, or the prologue first."""
    if fused:
        def f(x, prologue, w, meta):
            return fp8.fp8_dot_general(x, w, DENSE, meta, recipe=DELAYED, lhs_prologue=prologue)
    else:
        def f(x, prologue, w, meta):
            return fp8.fp8_dot_general(prologue(x), w, DENSE, meta, recipe=DELAYED)
    y, vjp = jax.vjp(f, x, prologue, w, meta)
    return (y, *vjp(dy))


def run_both(x, w, dy, prologue):
    """Two steps (the second with calibrated scales) fused and unfused: ``{fused: (y, dx, dp, dw, meta)}``."""
    results = {}
    for fused in (True, False):
        meta = fp8.init_meta(4)
        for _ in range(2):
            y, dx, dprologue, dw, meta = fwd_bwd(x, w, dy, prologue, meta, fused)
        results[fused] = y, dx, dprologue, dw, meta
    return results


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
@pytest.mark.parametrize("layernorm_type", ["layernorm", "rmsnorm"])
def test_fused_norm_gemm_matches_norm_then_gemm(layernorm_type, implementation, interpret):
    """In float32 both quantize the same float32 normalized values with the same scale, so they agree
    to the last bits of the norm's statistics (an element on a rounding boundary may round the
    other way: hence 1e-4, not exact); the meta, amaxes included, is the same."""
    x, w, dy, norm = inputs(layernorm_type)
    with override(implementations={"norm_fp8": implementation, "layernorm": implementation,
                                   "rmsnorm": implementation}):
        results = run_both(x, w, dy, norm)
    (y, dx, dnorm, dw, meta), (y_ref, dx_ref, dnorm_ref, dw_ref, meta_ref) = results[True], results[False]
    assert rel_err(y, y_ref) < 1e-4 and rel_err(dw, dw_ref) < 1e-4
    assert rel_err(dx, dx_ref) < 1e-4
    assert rel_err(dnorm.gamma, dnorm_ref.gamma) < 1e-4
    if layernorm_type == "layernorm":
        assert rel_err(dnorm.beta, dnorm_ref.beta) < 1e-4
    else:
        assert dnorm.beta is None
    for key in meta:
        np.testing.assert_allclose(meta[key], meta_ref[key], rtol=1e-6, err_msg=key)
    assert float(meta["input_amax_history"][0]) > 1.0  # the normalized input's amax was recorded


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_fused_activation_gemm_matches_activation_then_gemm(activation, implementation, interpret):
    """Bias + activation as the prologue (fc2's input): the same float32 activations quantized with
    the same scale either way, so outputs, all gradients and the meta agree to 1e-4."""
    rng = np.random.default_rng(2)
    m, k, n = 64, 96, 80
    gated = ops.is_gated(activation)
    in_shape = (m, 2, k) if gated else (m, k)
    x = jnp.asarray(rng.standard_normal(in_shape, np.float32))
    bias = jnp.asarray(0.1 * rng.standard_normal(in_shape[1:], np.float32))
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) * k**-0.5)
    dy = jnp.asarray(rng.standard_normal((m, n), np.float32) * 1e-2)
    with override(implementations={"activation_fp8": implementation, "activation": implementation}):
        results = run_both(x, w, dy, ops.Activation(bias, activation))
    (y, dx, dact, dw, meta), (y_ref, dx_ref, dact_ref, dw_ref, meta_ref) = results[True], results[False]
    assert y.shape == (m, n) and dx.shape == in_shape
    for got, want in ((y, y_ref), (dx, dx_ref), (dact.bias, dact_ref.bias), (dw, dw_ref)):
        assert rel_err(got, want) < 1e-4
    for key in meta:
        np.testing.assert_allclose(meta[key], meta_ref[key], rtol=1e-6, err_msg=key)


def test_lhs_prologue_validation():
    x, w, _, norm = inputs("layernorm", m=8, k=16, n=4)
    with pytest.raises(ValueError, match="lhs_prologue.*last axis"):
        fp8.fp8_dot_general(x, w.T, (((0,), (1,)), ((), ())), fp8.init_meta(4), recipe=DELAYED, lhs_prologue=norm)
    with pytest.raises(TypeError, match="lhs_prologue"):
        fp8.fp8_dot_general(x, w, DENSE, fp8.init_meta(4), recipe=DELAYED, lhs_prologue=norm.gamma)
    with pytest.raises(ValueError, match="beta must be None"):
        ops.Norm(norm.gamma, norm.beta, layernorm_type="rmsnorm")(x)
    with pytest.raises(ValueError, match="activation_type='nope'"):
        fp8.fp8_dot_general(x, w, DENSE, fp8.init_meta(4), recipe=DELAYED, lhs_prologue=ops.Activation(None, "nope"))
    with pytest.raises(ValueError, match="bias"):  # a gated activation's bias is [2, hidden]
        ops.Activation(jnp.zeros((16,)), "swiglu")(jnp.ones((8, 2, 16)))


@pytest.fixture
def fused_calls(spy):
    """Counts the calls of the fused norm + FP8 cast op while the modules are traced."""
    return spy(normalization, "norm_fp8", lambda args, kwargs: kwargs.get("layernorm_type"))


X = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8, 32), np.float32))


@pytest.mark.parametrize("recipe, fused", [(DELAYED, True), (fp8.CurrentScaling(), False)], ids=["delayed", "current"])
def test_layernorm_dense_general_feeds_the_gemm_from_the_fused_norm(fused_calls, recipe, fused):
    """Under delayed scaling the norm writes the GEMM's FP8 input; with ``return_layernorm_output``
    (the normalized input is needed in bf16 anyway) or current scaling the norm runs first. Both give
    the same outputs and gradients from the same variables, which have the same tree either way."""

    def run(return_layernorm_output):
        model = LayerNormDenseGeneral(features=(3, 16), layernorm_type="rmsnorm",
                                      return_layernorm_output=return_layernorm_output)
        with fp8.fp8_autocast(recipe=recipe):
            variables = model.init(jax.random.key(0), X)
            loss = lambda v: jnp.sum(jnp.sin(model.apply(v, X)[0]))
            for _ in range(2):
                grads = jax.grad(loss)(variables)
                variables = {**variables, **({fp8.FP8_COLLECTION: grads[fp8.FP8_COLLECTION]} if fused else {})}
            return model.apply(variables, X)[0], grads

    y, grads = run(False)
    assert fused_calls == (["rmsnorm"] * 4 if fused else [])  # init, two gradients, the last apply
    y_ref, grads_ref = run(True)
    assert jax.tree.structure(grads) == jax.tree.structure(grads_ref)
    assert rel_err(y, y_ref) < 1e-4
    errors = jax.tree.leaves(jax.tree.map(rel_err, grads["params"], grads_ref["params"]))
    assert max(errors) < 1e-4, errors


def test_layernorm_mlp_fc1_uses_the_fused_norm(fused_calls):
    """fc1 takes its FP8 input from the fused norm; the numbers are those of norm-then-fc1 (the
    ``return_layernorm_output`` path), after a calibrating step."""

    def run(return_layernorm_output):
        model = LayerNormMLP(intermediate_dim=64, activations=("silu", "linear"), intermediate_dropout_rate=0.0,
                             return_layernorm_output=return_layernorm_output)
        with fp8.fp8_autocast(recipe=DELAYED):
            variables = model.init(jax.random.key(0), X)
            grads = jax.grad(lambda v: jnp.sum(model.apply(v, X, deterministic=True)[0]))(variables)
            variables = {**variables, fp8.FP8_COLLECTION: grads[fp8.FP8_COLLECTION]}
            return model.apply(variables, X, deterministic=True)

    out, ln_out = run(False)
    assert fused_calls == ["layernorm"] * 3 and ln_out is None  # init, gradient, apply
    out_ref, ln_out_ref = run(True)
    assert fused_calls == ["layernorm"] * 3 and ln_out_ref.shape == X.shape
    assert rel_err(out, out_ref) < 1e-4


def test_layernorm_mlp_fc2_takes_its_input_from_the_fused_activation(spy, monkeypatch):
    """Without active dropout fc2 applies the activation as its prologue (under delayed scaling:
    `activation_fp8` writes its FP8 input); the numbers are those of activation-then-FP8-GEMM through
    the same module. With dropout active the activation runs on its own, then dropout, then fc2."""
    calls = spy(activation_ops, "activation_fp8", lambda args, kwargs: args[1])
    model = LayerNormMLP(intermediate_dim=64, activations=("silu", "linear"), intermediate_dropout_rate=0.1)

    def run():
        with fp8.fp8_autocast(recipe=DELAYED):
            variables = model.init(jax.random.key(0), X, deterministic=True)
            grads = jax.grad(lambda v: jnp.sum(model.apply(v, X, deterministic=True)[0]))(variables)
            variables = {**variables, fp8.FP8_COLLECTION: grads[fp8.FP8_COLLECTION]}
            return model.apply(variables, X, deterministic=True)[0], variables

    out, variables = run()
    assert calls == ["swiglu"] * 3  # init, gradient, apply
    with monkeypatch.context() as patch:  # the same module, one GEMM at a time, each prologue applied first
        patch.setattr(fp8, "fuses_mlp", lambda *arrays: False)
        patch.setattr(dot_general, "_fp8_prologue_matmul",
                      lambda x, p, w, meta, spec: dot_general._fp8_matmul(p(x), w, meta, spec))
        out_ref, _ = run()
    assert rel_err(out, out_ref) < 1e-4
    calls.clear()
    with fp8.fp8_autocast(recipe=DELAYED):
        model.apply(variables, X, deterministic=False, rngs={"dropout": jax.random.key(1)})
    assert calls == []
