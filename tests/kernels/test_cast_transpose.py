"""The FP8 cast + transpose + amax kernel (kernels/quantize.py) against `mtjax.fp8.cast_transpose`'s
reference: bit-exact casts (both compute ``clip(x * scale)`` in float32 and round once), the same amax,
masked tails at odd shapes, saturation; its Triton lowering for an H200; and on the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtjax import backend, fp8
from mtjax.kernels import quantize as quantize_kernels

# Interpret mode and the references run as XLA programs on the CPU: their compilation dominates, and
# XLA's optimizations (twice the compile time) matter for no assertion here unless a test says so.
pytestmark = pytest.mark.usefixtures("fast_compiles")

FP8 = st.sampled_from([jnp.float8_e4m3fn, jnp.float8_e5m2])


def _x(seed, shape, dtype, scale=3.0):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


def _assert_same(got, want):
    (q, q_t, amax), (q_ref, q_t_ref, amax_ref) = got, want
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and q_t.shape == q_t_ref.shape
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(q_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(q_t, np.float32), np.asarray(q_t_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(amax), np.asarray(amax_ref))


@given(m=st.sampled_from([1, 5, 64, 100]), k=st.sampled_from([1, 33, 64, 130]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), out_dtype=FP8, seed=st.integers(0, 3))
def test_kernel_matches_reference(interpret, m, k, dtype, out_dtype, seed):
    x = _x(seed, (m, k), dtype)
    scale = jnp.float32(40.0)  # pushes the tails of a 3-sigma normal past E4M3's 448: saturation is covered
    _assert_same(fp8.cast_transpose(x, scale, out_dtype, implementation="pallas_triton"),
                 fp8.cast_transpose(x, scale, out_dtype, implementation="xla"))


def test_reference_saturates_and_reports_amax_before_scaling():
    x = jnp.array([[1.0, -1000.0], [jnp.inf, 2.0]], jnp.float32)
    q, q_t, amax = fp8.cast_transpose(x, jnp.float32(2.0), jnp.float8_e4m3fn, implementation="xla")
    np.testing.assert_array_equal(np.asarray(q, np.float32), [[2.0, -448.0], [448.0, 4.0]])
    np.testing.assert_array_equal(np.asarray(q_t, np.float32), np.asarray(q, np.float32).T)
    assert amax == jnp.inf


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="cast_transpose"):
        fp8.cast_transpose(jnp.ones((4, 4)), 1.0, jnp.bfloat16)
    with pytest.raises(ValueError, match="at least 2 axes"):
        fp8.cast_transpose(jnp.ones((4,)), 1.0, jnp.float8_e4m3fn)
    assert "rank 3" in quantize_kernels.unsupported((2, 3, 4), jnp.bfloat16, jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="unsupported input"):
        quantize_kernels.cast_transpose(jnp.ones((2, 3, 4)), jnp.float32(1.0), jnp.float8_e4m3fn)


def test_dense_fp8_with_the_kernel_matches_the_reference(interpret):
    """fp8_dot_general forward and gradients are the same whichever implementation casts."""
    from mtjax.config import override

    dims = (((1,), (0,)), ((), ()))
    x, w = _x(0, (70, 96), jnp.float32, 1.0), _x(1, (96, 40), jnp.float32, 0.1)
    meta = fp8.init_meta(4)

    def loss(x, w, meta):
        y = fp8.fp8_dot_general(x, w, dims, meta, recipe=fp8.DelayedScaling(amax_history_len=4))
        return jnp.sum(y * jnp.cos(y))

    results = {}
    for impl in ("xla", "pallas_triton"):
        with override(implementations={"cast_transpose": impl}):
            results[impl] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w, meta)
    for got, want in zip(jax.tree.leaves(results["pallas_triton"]), jax.tree.leaves(results["xla"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_kernel_lowers_for_cuda():
    def fn(x, scale):
        return fp8.cast_transpose(x, scale, jnp.float8_e4m3fn)

    for shape in ((4096, 2048), (4000, 2050)):  # exact tiles and masked tails
        with backend.abstract_gpu():
            traced = jax.jit(fn).trace(jax.ShapeDtypeStruct(shape, jnp.bfloat16), jax.ShapeDtypeStruct((), jnp.float32))
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 2048), (999, 4097)])
def test_kernel_on_gpu(shape):
    x = _x(0, shape, jnp.bfloat16)
    for out_dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        _assert_same(fp8.cast_transpose(x, jnp.float32(40.0), out_dtype, implementation="pallas_triton"),
                     fp8.cast_transpose(x, jnp.float32(40.0), out_dtype, implementation="xla"))
