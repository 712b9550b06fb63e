"""The block-scaled FP8 kernels (kernels/block_quantize.py, kernels/block_fp8_gemm.py) against their
jax.numpy references in `mtjax.ops`: bit-exact casts and scales in interpret mode (both share the
scale math and round once from float32), masked tails at odd shapes, the casts fused with a norm or an
activation, the GEMM with padded tiles and both kinds of scales; their Triton lowering for an H200;
and on the GPU."""

from __future__ import annotations

import collections
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import backend, fp8, ops
from mtjax import flax as mtflax
from mtjax.dtypes import fp8_max
from mtjax.kernels import block_fp8_gemm as gemm_kernel
from mtjax.kernels import block_quantize as quantize_kernels
from mtjax.kernels import cublaslt

# Interpret mode and the references run as XLA programs on the CPU: their compilation dominates, and
# XLA's optimizations (twice the compile time) matter for no assertion here unless a test says so.
pytestmark = pytest.mark.usefixtures("fast_compiles")

SMALL = gemm_kernel.GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=2)


def _x(seed, shape, dtype=jnp.float32, scale=3.0):
    """Random values whose rows span several decades, so tiles get different scales."""
    key_x, key_r = jax.random.split(jax.random.key(seed))
    rows = 10.0 ** jax.random.uniform(key_r, shape[:1] + (1,), minval=-3, maxval=2)
    return (jax.random.normal(key_x, shape, jnp.float32) * scale * rows).astype(dtype)


def _assert_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


# Few shapes (each compiles the interpreter anew): exact tiles, and masked tails in both axes.
@pytest.mark.parametrize("m, k, transpose, dtype, out_dtype, power_of_two", [
    (200, 300, True, jnp.bfloat16, jnp.float8_e4m3fn, False),
    (5, 130, False, jnp.float32, jnp.float8_e5m2, True),
    (128, 128, True, jnp.float32, jnp.float8_e4m3fn, True),
])
def test_tile_quantize_kernel_matches_reference(interpret, m, k, transpose, dtype, out_dtype, power_of_two):
    x = _x(m + k, (m, k), dtype)
    kwargs = dict(transpose=transpose, power_of_two=power_of_two)
    _assert_equal(ops.tile_quantize(x, out_dtype, implementation="pallas_triton", **kwargs),
                  ops.tile_quantize(x, out_dtype, implementation="xla", **kwargs))


def assert_same_tiles(got, want):
    """Fused casts against their references: the norm or activation is computed in float32 by both, but
    not always with the same rounding in the last bits (a different order of operations; Triton's tanh
    is built from exp, which loses relative precision where GELU's output nears 0), so a scale may
    differ by an ulp and a value by one FP8 step, or by 2**-9 of the largest value (its tile's scale
    makes that about 1 in FP8 units: values that small are below E4M3's normal range anyway)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(w), 1e-30))) - 2)  # one E5M2 step (E4M3's is half)
        allowed = np.maximum(step, 2.0**-9 * np.max(np.abs(w)))
        assert np.all(np.abs(g - w) <= allowed), np.max(np.abs(g - w) / allowed)
        assert np.mean(g != w) <= 0.01 or g.size < 1000, np.mean(g != w)  # scales: a few ulps apart at most


def assert_same_dequantized(got, want):
    """Tile casts ``(q, scale_inv, q_t, scale_inv_t)`` against their reference, compared as the values
    they stand for: one FP8 step (in the tile's FP8 units: a rounding tie may go either way), or 2**-9
    of the largest value. Where a whole tile is about 0 (a GELU gradient far in the negative tail:
    Triton's exp-built tanh leaves 1e-9 where XLA's gives 0), the two scales differ by orders of
    magnitude while the values agree."""
    assert len(got) == len(want) == 4
    for i in (0, 2):
        assert got[i].dtype == want[i].dtype and got[i].shape == want[i].shape
        g, w = (np.asarray(ops.tile_dequantize(t[i], t[i + 1])) for t in (got, want))
        q = np.maximum(*(np.abs(np.asarray(t[i], np.float32)) for t in (got, want)))
        scale = np.maximum(*(np.repeat(np.asarray(t[i + 1]), 128, axis=1)[:, :q.shape[1]] for t in (got, want)))
        step = 2.0 ** (np.floor(np.log2(np.maximum(q, 1e-30))) - 2) * scale * (1 + 1e-5)  # E5M2's (E4M3's: half)
        allowed = np.maximum(step, 2.0**-9 * np.max(np.abs(w)))
        assert np.all(np.abs(g - w) <= allowed), np.max(np.abs(g - w) / allowed)


def _norm_inputs(seed, m, k, dtype=jnp.bfloat16):
    """Rows spanning decades with a non-zero mean, and a gamma and beta away from 1 and 0."""
    x = _x(seed, (m, k), jnp.float32) + 10.0 ** jax.random.uniform(jax.random.key(seed + 1), (m, 1), minval=-2,
                                                                    maxval=1)
    gamma = 1.0 + 0.3 * jax.random.normal(jax.random.key(seed + 2), (k,))
    beta = 0.1 * jax.random.normal(jax.random.key(seed + 3), (k,))
    return x.astype(dtype), gamma, beta


@pytest.mark.parametrize("m, k, layernorm_type, zero_centered_gamma, transpose, out_dtype", [
    (200, 300, "layernorm", False, True, jnp.float8_e4m3fn),
    (5, 130, "rmsnorm", True, False, jnp.float8_e5m2),
    (128, 256, "layernorm", True, True, jnp.float8_e4m3fn),
])
def test_norm_tile_kernel_matches_reference(interpret, m, k, layernorm_type, zero_centered_gamma, transpose,
                                            out_dtype):
    x, gamma, beta = _norm_inputs(m + k, m, k)
    beta = beta if layernorm_type == "layernorm" else None
    kwargs = dict(layernorm_type=layernorm_type, zero_centered_gamma=zero_centered_gamma, transpose=transpose,
                  out_dtype=out_dtype)
    assert_same_tiles(ops.norm_tile_fp8(x, gamma, beta, implementation="pallas_triton", **kwargs),
                      ops.norm_tile_fp8(x, gamma, beta, implementation="xla", **kwargs))


@pytest.mark.parametrize("m, k, activation, has_bias, transpose", [
    (200, 300, "swiglu", True, True), (70, 130, "gelu", True, False), (128, 128, "clamped_swiglu", False, True),
    (33, 200, "glu", True, True),
])
def test_activation_tile_kernel_matches_reference(interpret, m, k, activation, has_bias, transpose, request):
    if activation == "gelu":  # `assert_same_tiles`' bounds were measured with XLA's optimizations
        request.getfixturevalue("optimized_compiles")
    shape = (m, 2, k) if ops.is_gated(activation) else (m, k)
    x = _x(m + k, (m, math.prod(shape[1:])), jnp.bfloat16, 1.0).reshape(shape)
    bias = 0.5 * jax.random.normal(jax.random.key(3), shape[1:]) if has_bias else None
    assert_same_tiles(ops.activation_tile_fp8(x, activation, bias, transpose=transpose, implementation="pallas_triton"),
                      ops.activation_tile_fp8(x, activation, bias, transpose=transpose, implementation="xla"))


def grad_tiles(kernel, x, dy, activation, bias=None, out_dtype=jnp.float8_e4m3fn):
    """What ``activation_grad_tile_fp8`` returns, from a kernel called directly (automatic selection
    gives it whole tiles only; these tests check its masked tails too)."""
    *tiles, dbias = kernel(x, bias, dy, out_dtype, activation=activation, fp8_max=fp8_max(out_dtype))
    return (*tiles, None if dbias is None else dbias.reshape(bias.shape))


@pytest.mark.parametrize("m, hidden, activation, has_bias, out_dtype", [
    (200, 300, "gelu", True, jnp.float8_e4m3fn), (130, 256, "swiglu", True, jnp.float8_e4m3fn),
    (128, 128, "clamped_swiglu", False, jnp.float8_e5m2),
])
def test_activation_grad_tile_kernel_matches_reference(interpret, m, hidden, activation, has_bias, out_dtype):
    """The activation's backward writing fc1's output gradient in 1x128 tiles, both layouts, and the bias
    gradient: masked tails in both axes, gated halves each cut in their own tiles."""
    shape = (m, 2, hidden) if ops.is_gated(activation) else (m, hidden)
    x = _x(m + hidden, (m, math.prod(shape[1:])), jnp.bfloat16, 1.0).reshape(shape)
    dy = _x(m, (m, hidden), jnp.bfloat16)
    bias = 0.5 * jax.random.normal(jax.random.key(3), shape[1:]) if has_bias else None
    got = grad_tiles(quantize_kernels.activation_grad_tile_quantize, x, dy, activation, bias, out_dtype)
    want = ops.activation_grad_tile_fp8(x, dy, activation, bias, out_dtype=out_dtype, implementation="xla")
    # the derivative is computed in another order than autodiff's (and GELU's tanh from exp): scales a few
    # float32 ulps apart
    assert_same_tiles(got[0:4:2], want[0:4:2])
    for g, w in zip(got[1:4:2], want[1:4:2]):
        np.testing.assert_allclose(g, w, rtol=1e-5)
    if has_bias:
        assert got[4].shape == bias.shape and got[4].dtype == jnp.float32
        np.testing.assert_allclose(got[4], want[4], rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want[4]))))
    else:
        assert got[4] is None and want[4] is None


def test_fused_tile_references_are_the_cast_of_the_float32_op():
    x, gamma, beta = _norm_inputs(0, 64, 256, jnp.float32)
    _assert_equal(ops.norm_tile_fp8(x, gamma, beta, transpose=True, implementation="xla"),
                  ops.tile_quantize(ops.layernorm(x, gamma, beta, implementation="xla"), jnp.float8_e4m3fn,
                                    transpose=True, implementation="xla"))
    h = _x(1, (64, 512), jnp.float32, 1.0).reshape(64, 2, 256)
    _assert_equal(ops.activation_tile_fp8(h, "swiglu", implementation="xla"),
                  ops.tile_quantize(ops.activation(h, "swiglu", implementation="xla"), jnp.float8_e4m3fn,
                                    implementation="xla"))
    # the backward: the float32 gradient of the activation (and of its bias), cast with its transpose
    dy = _x(2, (64, 256), jnp.float32)
    bias = jnp.linspace(-0.5, 0.5, 512).reshape(2, 256)
    dh, dbias = jax.vjp(lambda h, b: ops.activation(h, "swiglu", b, implementation="xla"), h, bias)[1](dy)
    *tiles, got_dbias = ops.activation_grad_tile_fp8(h, dy, "swiglu", bias, implementation="xla")
    _assert_equal(tiles, ops.tile_quantize(dh.reshape(64, 512), jnp.float8_e4m3fn, transpose=True,
                                           implementation="xla"))
    np.testing.assert_allclose(got_dbias, dbias, rtol=1e-6)


@pytest.mark.parametrize("k, n, out_dtype, power_of_two, amax_epsilon", [
    (300, 260, jnp.float8_e4m3fn, False, 1e-2), (128, 3, jnp.float8_e5m2, True, 0.0)])
def test_block_quantize_kernel_matches_reference(interpret, k, n, out_dtype, power_of_two, amax_epsilon):
    w = _x(k + n, (k, n), jnp.bfloat16, 0.05)
    kwargs = dict(power_of_two=power_of_two, amax_epsilon=amax_epsilon)
    _assert_equal(ops.block_quantize(w, out_dtype, implementation="pallas_triton", **kwargs),
                  ops.block_quantize(w, out_dtype, implementation="xla", **kwargs))


def _operands(seed, m, k, n, b_blocks, b_dtype=jnp.float8_e4m3fn):
    a, a_s = ops.tile_quantize(_x(seed, (m, k)), jnp.float8_e4m3fn)
    if b_blocks:
        b, _, b_s = ops.block_quantize(_x(seed + 1, (n, k), scale=0.1), b_dtype)
    else:
        b, b_s = ops.tile_quantize(_x(seed + 1, (n, k), scale=0.1), b_dtype)
    return a, a_s, b, b_s


def assert_fp8_gemm_close(got, want, bound):
    """``got`` (a GPU kernel's product of FP8 operands) against ``want`` (the float32 reference).

    Hopper's FP8 tensor cores add a K block's products in an accumulator narrower than float32
    (about 14 mantissa bits) before the kernel promotes the block's sum, so a result may differ from
    the float32 sum by a small fraction of ``bound``, the sum of its products' magnitudes
    (``|a| @ |b|^T``). Allowed: 2^-10 of it (a wrong scale, tile or mask moves a result by its
    share of the bound over a whole K block) plus ``got``'s own rounding (bf16: 2^-8 relative)."""
    rounding = 0.0 if jnp.dtype(got.dtype) == jnp.float32 else 2.0 ** -8
    got, want, bound = (np.asarray(x, np.float32) for x in (got, want, bound))
    err = np.abs(got - want)
    allowed = 2.0 ** -10 * bound + rounding * np.abs(want) + 1e-30
    worst = np.unravel_index(np.argmax(err / allowed), err.shape)
    assert np.all(err <= allowed), (f"{int(np.sum(err > allowed))} of {err.size} elements off; worst at {worst}: "
                                    f"got {got[worst]}, want {want[worst]}, bound {bound[worst]}")


def fp8_gemm_bound(a, a_s, b, b_s):
    """``|a| @ |b|^T`` of the dequantized operands (``b_s`` per 128x128 block or per 1x128 tile)."""
    deq_b = ops.block_dequantize(b, b_s) if b_s.shape[0] != b.shape[0] else ops.tile_dequantize(b, b_s)
    return jnp.matmul(jnp.abs(ops.tile_dequantize(a, a_s)), jnp.abs(deq_b).T, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("m, k, n, b_blocks, b_dtype", [
    (64, 256, 128, True, jnp.float8_e4m3fn), (37, 300, 70, False, jnp.float8_e5m2)], ids=["blocks", "rows-mixed"])
def test_gemm_kernel_matches_reference(interpret, m, k, n, b_blocks, b_dtype):
    a, a_s, b, b_s = _operands(0, m, k, n, b_blocks, b_dtype)
    want = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, implementation="xla")
    got = gemm_kernel.block_fp8_gemm(a, a_s, b, jnp.repeat(b_s, 128, axis=0)[:n] if b_blocks else b_s, jnp.float32,
                                     config=SMALL)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(want))))
    # The dispatched op (default tiles) gives the same; bf16 output rounds once from float32.
    got = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.bfloat16, implementation="pallas_triton")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32))


def test_gemm_reference_is_the_dequantized_product():
    """Promotion per K block is the f32 product of the dequantized operands up to f32 rounding."""
    a, a_s, b, b_s = _operands(1, 48, 384, 160, True, jnp.float8_e5m2)
    got, want = jax.jit(lambda a, a_s, b, b_s: (
        ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, implementation="xla"),
        ops.tile_dequantize(a, a_s) @ ops.block_dequantize(b, b_s).T))(a, a_s, b, b_s)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_errors_name_the_argument():
    a, a_s = jnp.ones((8, 256), jnp.float8_e4m3fn), jnp.ones((8, 2))
    b, b_s = jnp.ones((16, 256), jnp.float8_e4m3fn), jnp.ones((1, 2))
    with pytest.raises(TypeError, match="block_fp8_gemm: a has dtype"):
        ops.block_fp8_gemm(a.astype(jnp.bfloat16), a_s, b, b_s, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"must be \[m, k\] and \[n, k\]"):
        ops.block_fp8_gemm(a, a_s, b[:, :128], b_s, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="a_scale_inv has shape"):
        ops.block_fp8_gemm(a, a_s[:, :1], b, b_s, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="b_scale_inv has shape"):
        ops.block_fp8_gemm(a, a_s, b, jnp.ones((3, 2)), out_dtype=jnp.float32)
    with pytest.raises(TypeError, match="tile_quantize"):
        ops.tile_quantize(jnp.ones((4, 4)), jnp.bfloat16)
    with pytest.raises(ValueError, match="rank"):
        ops.tile_quantize(jnp.ones((2, 4, 4)), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="amax_epsilon"):
        ops.block_quantize(jnp.ones((4, 4)), jnp.float8_e4m3fn, amax_epsilon=-1.0)
    with pytest.raises(TypeError, match="amax_epsilon=True"):
        ops.tile_quantize(jnp.ones((4, 4)), jnp.float8_e4m3fn, amax_epsilon=True)
    ops.tile_quantize(jnp.ones((4, 4)), jnp.float8_e4m3fn, amax_epsilon=np.float32(0.1))  # any real number
    with pytest.raises(ValueError, match="block_m"):
        gemm_kernel.GemmConfig(block_m=48)
    assert "rank 3" in quantize_kernels.unsupported((2, 3, 4), jnp.bfloat16, jnp.float8_e4m3fn)
    gamma = jnp.ones((256,))
    with pytest.raises(ValueError, match="norm_tile_fp8: x has shape"):
        ops.norm_tile_fp8(jnp.ones((2, 4, 256)), gamma, None)
    with pytest.raises(TypeError, match=r"norm_tile_fp8\(transpose='yes'\)"):
        ops.norm_tile_fp8(jnp.ones((4, 256)), gamma, None, transpose="yes")
    with pytest.raises(TypeError, match=r"norm_tile_fp8\(out_dtype=bfloat16\)"):
        ops.norm_tile_fp8(jnp.ones((4, 256)), gamma, None, out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"activation_tile_fp8: x has shape \(2, 4, 256\); expected \[m, hidden\]"):
        ops.activation_tile_fp8(jnp.ones((2, 4, 256)), "gelu")
    with pytest.raises(ValueError, match=r"gated 'swiglu' takes x of shape \[..., 2, hidden\]"):
        ops.activation_tile_fp8(jnp.ones((4, 256)), "swiglu")
    h, dy = jnp.ones((4, 2, 256)), jnp.ones((4, 256))
    with pytest.raises(ValueError, match=r"grad_tile_fp8: x has shape \(2, 4, 256\); expected \[m, hidden\]"):
        ops.activation_grad_tile_fp8(jnp.ones((2, 4, 256)), dy, "gelu")
    with pytest.raises(ValueError, match="activation_grad_tile_fp8: dy has shape"):
        ops.activation_grad_tile_fp8(h, dy[:, :128], "swiglu")
    with pytest.raises(TypeError, match="activation_grad_tile_fp8: dy"):
        ops.activation_grad_tile_fp8(h, dy.astype(jnp.int32), "swiglu")
    with pytest.raises(TypeError, match=r"activation_grad_tile_fp8\(out_dtype=bfloat16\)"):
        ops.activation_grad_tile_fp8(h, dy, "swiglu", out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="amax_epsilon"):
        ops.activation_grad_tile_fp8(h, dy, "swiglu", amax_epsilon=-1.0)
    assert "float8_e4m3fnuz" in gemm_kernel.unsupported((4, 4), jnp.float8_e4m3fnuz, (4, 4), jnp.float8_e4m3fn)


def _kernel_calls(fn, *shapes):
    """How many custom calls of each kind ``fn`` lowers to for an H200."""
    with backend.abstract_gpu():
        text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    return collections.Counter(re.findall(r"custom_call @([\w$.]+)", text))


def _triton_calls(fn, *shapes):
    return _kernel_calls(fn, *shapes)["__gpu$xla.gpu.triton"]


@pytest.mark.parametrize("m, k, n", [(4096, 4096, 2048), (1000, 2050, 700)])
def test_gemm_kernel_lowers_for_cuda(m, k, n):
    kb = -(-k // 128)
    shapes = [jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((m, kb), jnp.float32),
              jax.ShapeDtypeStruct((n, k), jnp.float8_e5m2), jax.ShapeDtypeStruct((-(-n // 128), kb), jnp.float32)]
    # the dispatched op: one kernel call (whichever kernel ranks first for these operands)
    calls = _kernel_calls(lambda *args: ops.block_fp8_gemm(*args, out_dtype=jnp.bfloat16), *shapes)
    assert sum(calls.values()) == 1, calls
    for config in gemm_kernel.SWEEP_CONFIGS:  # every tile the benchmark sweeps lowers
        fn = lambda a, sa, b, sb: gemm_kernel.block_fp8_gemm(a, sa, b, jnp.repeat(sb, 128, 0)[:n], jnp.bfloat16,  # noqa: E731
                                                             config=config)
        assert _triton_calls(fn, *shapes) == 1


@pytest.mark.parametrize("shape", [(4096, 2048), (4000, 2050)])
def test_quantize_kernels_lower_for_cuda(shape):
    gamma, bias = jnp.ones(shape[1:]), jnp.ones((2, shape[1] // 2))

    def fn(x):
        return (ops.tile_quantize(x, jnp.float8_e4m3fn, transpose=True), ops.tile_quantize(x, jnp.float8_e5m2),
                ops.block_quantize(x, jnp.float8_e4m3fn, power_of_two=True),
                ops.norm_tile_fp8(x, gamma, gamma, transpose=True),
                ops.activation_tile_fp8(x.reshape(shape[0], 2, -1), "swiglu", bias, transpose=True))

    assert _triton_calls(fn, jax.ShapeDtypeStruct(shape, jnp.bfloat16)) == 5


def test_gelu_fp8_kernels_lower_with_the_ptx_sigmoid_for_cuda(monkeypatch):
    """The kernels writing GELU's output or gradient in FP8 (per-tensor and 1x128 tiles) compute it as
    ``x * sigmoid(2u)`` by ``ex2.approx.ftz.f32`` and ``rcp.approx.ftz.f32`` when lowered for cuda with
    `GELU_PTX_SIGMOID` on (the default); off, none does."""
    from mtjax.kernels import activation as activation_kernels

    monkeypatch.setattr(activation_kernels, "GELU_PTX_SIGMOID", True)

    x = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
    one = jnp.float32(1.0)

    def lowered():
        def fn(x, dy):  # a new function each time: jit's trace cache does not see the flag
            return (ops.activation_tile_fp8(x, "gelu", transpose=True), ops.activation_grad_tile_fp8(x, dy, "gelu"),
                    ops.activation_fp8(x, "gelu", scale=one), ops.activation_grad_fp8(x, dy, "gelu", scale=one))

        with backend.abstract_gpu():
            return jax.jit(fn).trace(x, x).lower(lowering_platforms=("cuda",)).as_text()

    text = lowered()
    assert text.count("__gpu$xla.gpu.triton") == 4
    assert text.count("rcp.approx.ftz.f32") == text.count("ex2.approx.ftz.f32") == 4
    monkeypatch.setattr(activation_kernels, "GELU_PTX_SIGMOID", False)
    assert "approx.ftz" not in lowered()


def test_block_scaled_dense_lowers_to_kernels_for_cuda():
    """Forward and both backward GEMMs of a block-scaled dense layer, and the large casts, are kernels."""
    dims = (((1,), (0,)), ((), ()))

    def fwd_bwd(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fp8.fp8_dot_general(x, w, dims, recipe=fp8.BlockScaling()), x, w)
        return (y, *vjp(dy))

    x, w, dy = ((4096, 2048), (2048, 4096), (4096, 4096))
    # the casts of x (with x^T) and dy (with dy^T) and w's blocks (8M elements each, above too_small)
    # in Triton; the 3 GEMMs in cuBLASLt where its library is built, else in the Mosaic GPU kernel
    calls = _kernel_calls(fwd_bwd, *(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (x, w, dy)))
    assert calls["__gpu$xla.gpu.triton"] == 3 and calls["mosaic_gpu_v2"] + calls[cublaslt.TARGET] == 3, calls


def test_block_scaled_mlp_lowers_to_fused_casts_for_cuda():
    """A block-scaled LayerNormMLP, forward and backward, for an H200: the norm and the activation write
    their GEMM's FP8 tiles in their own kernels (no separate cast of their outputs), and so does the
    activation's backward for fc1's output gradient."""
    mlp = mtflax.LayerNormMLP(intermediate_dim=4096, activations=("gelu", "linear"), dtype=jnp.bfloat16)
    x = jax.ShapeDtypeStruct((8, 512, 2048), jnp.bfloat16)

    def grads(params, x):
        return jax.grad(lambda p, x: jnp.sum(mlp.apply(p, x, deterministic=True)[0].astype(jnp.float32)),
                        argnums=(0, 1))(params, x)

    with fp8.fp8_autocast(recipe=fp8.BlockScaling()), backend.abstract_gpu():
        params = jax.eval_shape(mlp.init, jax.random.key(0), x)
        text = jax.jit(grads).trace(params, x).lower(lowering_platforms=("cuda",)).as_text()
    kernels = collections.Counter(re.findall(r'name = "(mtjax_[a-z0-9_]+)"', text))
    # one fused cast each for the norm's and the activation's output, and for fc1's output gradient
    # (the activation's backward); tile_quantize only casts fc2's output gradient, block_quantize the
    # two weights
    assert (kernels["mtjax_norm_tile_quantize"], kernels["mtjax_activation_tile_quantize"],
            kernels["mtjax_activation_grad_tile_quantize"]) == (1, 1, 1), kernels
    assert (kernels["mtjax_tile_quantize"], kernels["mtjax_block_quantize"]) == (1, 2), kernels


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2048), (999, 4097)])
def test_quantize_kernels_on_gpu(shape):
    x = _x(0, shape, jnp.bfloat16)
    for out_dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        got = ops.tile_quantize(x, out_dtype, transpose=True, power_of_two=True, implementation="pallas_triton")
        _assert_equal(got, ops.tile_quantize(x, out_dtype, transpose=True, power_of_two=True, implementation="xla"))
        # Without power-of-two scales Triton's float32 division may differ from XLA's in the last bit.
        got = ops.tile_quantize(x, out_dtype, transpose=True, implementation="pallas_triton")
        want = ops.tile_quantize(x, out_dtype, transpose=True, implementation="xla")
        for g, w in zip(got[1::2], want[1::2]):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
        got = ops.block_quantize(x, out_dtype, power_of_two=True, implementation="pallas_triton")
        _assert_equal(got, ops.block_quantize(x, out_dtype, power_of_two=True, implementation="xla"))
        gamma = 1.0 + 0.1 * jax.random.normal(jax.random.key(2), shape[1:])
        assert_same_tiles(ops.norm_tile_fp8(x, gamma, gamma, out_dtype=out_dtype, transpose=True,
                                            implementation="pallas_triton"),
                          ops.norm_tile_fp8(x, gamma, gamma, out_dtype=out_dtype, transpose=True, implementation="xla"))
        if shape[1] % 2 == 0:
            h = x.reshape(shape[0], 2, -1)
            assert_same_tiles(ops.activation_tile_fp8(h, "swiglu", out_dtype=out_dtype, transpose=True,
                                                      implementation="pallas_triton"),
                              ops.activation_tile_fp8(h, "swiglu", out_dtype=out_dtype, transpose=True,
                                                      implementation="xla"))
        # the activation's backward writing its gradient's tiles (gated: halves of whole tiles)
        act = "swiglu" if shape[1] % 256 == 0 else "gelu"
        h = x.reshape(shape[0], 2, -1) if act == "swiglu" else x
        dy = _x(1, (shape[0], h.shape[-1]), jnp.bfloat16)
        got = grad_tiles(quantize_kernels.activation_grad_tile_quantize, h, dy, act, out_dtype=out_dtype)
        want = ops.activation_grad_tile_fp8(h, dy, act, out_dtype=out_dtype, implementation="xla")
        assert_same_dequantized(got[:4], want[:4])


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n", [(1024, 2048, 1024), (1000, 2050, 700)])
@pytest.mark.parametrize("config", [gemm_kernel.DEFAULT_CONFIG, *gemm_kernel.SWEEP_CONFIGS], ids=lambda c: c.label())
def test_gemm_kernel_on_gpu(m, k, n, config):
    a, a_s, b, b_s = _operands(0, m, k, n, True)
    want = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, implementation="xla")
    got = gemm_kernel.block_fp8_gemm(a, a_s, b, jnp.repeat(b_s, 128, axis=0)[:n], jnp.float32, config=config)
    assert_fp8_gemm_close(got, want, fp8_gemm_bound(a, a_s, b, b_s))
