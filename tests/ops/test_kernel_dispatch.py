"""Which implementation the fused ops pick (per lowering platform and shape), and their argument errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import backend, ops
from mtjax.kernels.common import dropout_keep

S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32
NORM_STATIC = {"epsilon": 1e-6, "zero_centered_gamma": False}


def _choice(op, *args, **static):
    return backend.select(op, platform_name="cuda", args=args, static=static)


@pytest.mark.parametrize("op", ["layernorm", "rmsnorm", "norm_fp8", "residual_norm", "activation",
                                "activation_fp8", "softmax"])
def test_every_fused_op_has_a_pallas_triton_kernel_ahead_of_the_reference(op):
    names = backend.implementations(op)
    assert names.index("pallas_triton") < names.index("xla")


def test_cuda_picks_the_kernel_where_it_is_faster_and_cpu_the_reference():
    x, g = S((16384, 4096), BF16), S((4096,), F32)
    assert _choice("layernorm", x, g, g, **NORM_STATIC)[0].name == "pallas_triton"
    assert _choice("rmsnorm", x, g, **NORM_STATIC)[0].name == "pallas_triton"
    assert _choice("activation", S((16384, 2, 8192), BF16), None, activation_type="swiglu")[0].name == "pallas_triton"
    assert _choice("softmax", S((4, 16, 2048, 2048), BF16), None, scale=1.0, causal=True)[0].name == "pallas_triton"
    assert backend.select("layernorm", platform_name="cpu", args=(x, g, g), static=NORM_STATIC)[0].name == "xla"


@pytest.mark.parametrize("op, args, static", [
    ("layernorm", (S((2048, 2048), BF16), S((2048,), F32), None), NORM_STATIC),  # small: XLA as fast
    ("rmsnorm", (S((16384, 12288), BF16), S((12288,), F32)), NORM_STATIC),  # XLA's RMSNorm fusion faster
    ("softmax", (S((4, 8, 128, 128), BF16), None), {"scale": 1.0, "causal": True}),
])
def test_cuda_leaves_shapes_where_xla_is_as_fast_to_xla(op, args, static, interpret):
    impl, why = _choice(op, *args, **static)
    assert impl.name == "xla" and re.search(r"XLA('s fusion)? is (as fast|faster)", why), why
    # an explicit choice still runs the kernel there
    chosen = backend.select(op, "pallas_triton", platform_name="cuda", args=args, static=static)[0]
    assert chosen.name == "pallas_triton"


def test_explicit_kernel_choice_runs_where_automatic_selection_prefers_xla(interpret):
    x = jax.random.normal(jax.random.key(0), (3, 40))
    g = jnp.full((40,), 1.5)
    np.testing.assert_allclose(ops.rmsnorm(x, g, implementation="pallas_triton"), ops.rmsnorm(x, g),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op, args, static, reason", [
    ("layernorm", (S((8, 20000), BF16), S((20000,), F32), None), NORM_STATIC, "last axis"),
    ("layernorm", (S((8, 1024), jnp.float8_e4m3fn), S((1024,), F32), None), NORM_STATIC, "dtype"),
    ("activation", (S((8, 1024), BF16), None), {"activation_type": "gelu_exact"}, "activation"),
    ("softmax", (S((8, 2, 4, 32), F32), S((1, 2, 1, 32), jnp.bool_)), {"scale": 1.0, "causal": False}, "mask"),
])
def test_kernels_decline_what_they_cannot_compute(op, args, static, reason):
    impl, why = _choice(op, *args, **static)
    assert impl.name == "xla" and reason in why
    with pytest.raises(ValueError, match="pallas_triton"):
        backend.select(op, "pallas_triton", platform_name="cuda", args=args, static=static)


def test_explicit_kernel_on_a_cpu_without_interpret_mode_names_the_op():
    with pytest.raises(ValueError, match="norm_fp8.*pallas_triton"):
        ops.norm_fp8(jnp.ones((2, 8)), jnp.ones((8,)), None, jnp.float32(1.0), layernorm_type="rmsnorm",
                          implementation="pallas_triton")


def test_dropout_mask_is_a_deterministic_function_of_seed_row_and_column():
    rows, cols = jnp.arange(512)[:, None], jnp.arange(300)[None, :]
    keep = dropout_keep(jnp.uint32(7), rows, cols, 0.25)
    assert abs(float(jnp.mean(keep)) - 0.75) < 0.01
    assert bool(jnp.all(keep == dropout_keep(jnp.uint32(7), rows, cols, 0.25)))
    assert float(jnp.mean(keep == dropout_keep(jnp.uint32(8), rows, cols, 0.25))) < 0.7
    assert bool(jnp.any(keep[:, :150] != keep[:, 150:]))  # columns get different bits


def test_residual_norm_and_fp8_ops_run_their_references():
    x = jax.random.normal(jax.random.key(0), (4, 16))
    r = jax.random.normal(jax.random.key(1), (4, 16))
    g, b = jnp.ones(16), jnp.zeros(16)
    normalized, new_residual = ops.residual_norm(x, r, g, b)
    np.testing.assert_allclose(new_residual, x + r, rtol=1e-6)
    np.testing.assert_allclose(normalized, ops.layernorm(x + r, g, b), rtol=1e-5, atol=1e-6)
    q, amax = ops.norm_fp8(x, g, b, jnp.float32(2.0))
    y = ops.layernorm(x, g, b)
    assert q.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(amax, jnp.max(jnp.abs(y)), rtol=1e-6)
    np.testing.assert_allclose(q.astype(F32), (y * 2.0).astype(jnp.float8_e4m3fn).astype(F32))
    q, amax = ops.activation_fp8(x, "relu", scale=jnp.float32(1e5), out_dtype=jnp.float8_e5m2)
    assert q.dtype == jnp.float8_e5m2 and float(jnp.max(q.astype(F32))) == 57344.0
    np.testing.assert_allclose(amax, jnp.max(jnp.abs(jax.nn.relu(x))))


@pytest.mark.parametrize("call, error, match", [
    (lambda x, g: ops.norm_fp8(x, g, None, jnp.float32(1.0), out_dtype=jnp.bfloat16), ValueError, "out_dtype"),
    (lambda x, g: ops.norm_fp8(x, g, None, jnp.ones(2)), ValueError, "scale"),
    (lambda x, g: ops.norm_fp8(x, g, g, jnp.float32(1.0), layernorm_type="rmsnorm"), ValueError, "beta"),
    (lambda x, g: ops.norm_fp8(x, g, None, jnp.float32(1.0), layernorm_type="batchnorm"), ValueError,
     "layernorm_type.*'layernorm', 'rmsnorm'"),
    (lambda x, g: ops.residual_norm(x, x[:, :4], g), ValueError, "residual"),
    (lambda x, g: ops.residual_norm(x, x, g, dropout_rate=0.1), ValueError, "dropout_rng"),
    (lambda x, g: ops.residual_norm(x, x, g, dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError,
     "dropout_rate"),
    (lambda x, g: ops.residual_norm(x, x.astype(jnp.int32), g), TypeError, "residual"),
    (lambda x, g: ops.activation_fp8(x, "gelu", scale=jnp.float32(1.0), out_dtype=F32), ValueError, "out_dtype"),
    (lambda x, g: ops.activation_fp8(x, "swish", scale=jnp.float32(1.0)), ValueError, "activation_type"),
    (lambda x, g: ops.activation_fp8(x[:, None], "swiglu", scale=jnp.float32(1.0)), ValueError, r"x .*\[\.\.\., 2, "
                                                                                                r"hidden\]"),
    (lambda x, g: ops.activation_grad_fp8(x, x[:, :4], "gelu", scale=jnp.float32(1.0)), ValueError, "dy"),
    (lambda x, g: ops.activation_grad_fp8(x, x.astype(jnp.int32), "gelu", scale=jnp.float32(1.0)), TypeError, "dy"),
    (lambda x, g: ops.activation_grad_fp8(x, x, "gelu", scale=jnp.float32(1.0), out_dtype=F32), ValueError,
     "out_dtype"),
    (lambda x, g: ops.activation_grad_fp8(x, x, "gelu", scale=jnp.ones(2)), ValueError, "scale"),
    (lambda x, g: ops.activation_grad_fp8(x, x, "gelu", g[:4], scale=jnp.float32(1.0)), ValueError, "bias"),
])
def test_bad_arguments_raise_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(jnp.ones((2, 8)), jnp.ones((8,)))
