"""mtjax.ops.grouped_gemm / grouped_gemm_wgrad / grouped_gemm_fp8 (the "xla" references) against
float64 numpy loops over the groups, forward and gradients; argument errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtjax import ops
from mtjax.dtypes import widen_fp8
from mtjax.kernels.grouped_gemm import BlockSizes, GemmTiles

RTOL = 1e-5


def np_gmm(lhs, rhs, group_sizes, transpose_rhs=False):
    """float64 ``out[m] = lhs[m] @ rhs[g(m)]``, zeros past the groups."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    if transpose_rhs:
        rhs = rhs.transpose(0, 2, 1)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        out[start:start + size] = lhs[start:start + size] @ rhs[g]
        start += size
    return out


def np_tgmm(lhs, dy, group_sizes):
    """float64 ``out[g] = lhs[rows of g]^T @ dy[rows of g]``."""
    lhs, dy = np.asarray(lhs, np.float64), np.asarray(dy, np.float64)
    out, start = [], 0
    for size in np.asarray(group_sizes):
        out.append(lhs[start:start + size].T @ dy[start:start + size])
        start += size
    return np.stack(out)


def random_case(seed, m, k, n, group_sizes, dtype=np.float32, transpose_rhs=False):
    rng = np.random.default_rng(seed)
    g = len(group_sizes)
    lhs = rng.normal(size=(m, k)).astype(dtype)
    rhs = rng.normal(size=(g, n, k) if transpose_rhs else (g, k, n)).astype(dtype)
    dy = rng.normal(size=(m, n)).astype(dtype)
    return lhs, rhs, np.asarray(group_sizes, np.int32), dy


def np_grads(lhs, rhs, group_sizes, dy, transpose_rhs=False):
    """float64 ``(d lhs, d rhs)`` of ``sum(grouped_gemm(lhs, rhs) * dy)``."""
    rhs_kn = np.asarray(rhs, np.float64).transpose(0, 2, 1) if transpose_rhs else np.asarray(rhs, np.float64)
    d_lhs = np_gmm(dy, rhs_kn, group_sizes, transpose_rhs=True)
    d_rhs = np_tgmm(lhs, dy, group_sizes)
    return d_lhs, d_rhs.transpose(0, 2, 1) if transpose_rhs else d_rhs


def value_and_grads(fn, lhs, rhs, dy):
    out, vjp = jax.vjp(fn, jnp.asarray(lhs), jnp.asarray(rhs))
    return (out, *vjp(jnp.asarray(dy, out.dtype)))


def assert_close(actual, expected, rtol=RTOL):
    """Elementwise, relative to the largest magnitude of ``expected`` (sums of K products cancel)."""
    actual = np.asarray(actual, np.float64)
    scale = max(float(np.max(np.abs(expected))), 1.0)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


SIZES = [
    [7, 0, 20, 3],   # an empty group, sizes off any tile
    [30, 0, 0, 0],   # everything in one group
    [0, 0, 0, 0],    # no rows at all: zeros
    [1, 2, 3, 4],    # sum < M: the rest are zeros
]


@pytest.mark.parametrize("group_sizes", SIZES)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_reference_matches_numpy(group_sizes, transpose_rhs):
    lhs, rhs, gs, dy = random_case(0, 30, 12, 9, group_sizes, transpose_rhs=transpose_rhs)
    out, d_lhs, d_rhs = value_and_grads(
        lambda a, b: ops.grouped_gemm(a, b, gs, transpose_rhs=transpose_rhs), lhs, rhs, dy)
    assert_close(out, np_gmm(lhs, rhs, gs, transpose_rhs))
    exp_lhs, exp_rhs = np_grads(lhs, rhs, gs, dy, transpose_rhs)
    assert_close(d_lhs, exp_lhs)
    assert_close(d_rhs, exp_rhs)
    assert np.all(np.asarray(out)[int(gs.sum()):] == 0)


@jax.jit
def _reference_value_and_grads(lhs, rhs, group_sizes, dy):
    return value_and_grads(lambda a, b: ops.grouped_gemm(a, b, group_sizes), lhs, rhs, dy)


@given(sizes=st.lists(st.integers(0, 40), min_size=5, max_size=5), seed=st.integers(0, 99))
def test_reference_hypothesis_group_sizes(sizes, seed):
    """Skewed and empty groups, sums below M; fixed shapes (M = 64, 5 groups): one compilation."""
    m = 64
    while sum(sizes) > m:
        sizes[int(np.argmax(sizes))] //= 2
    lhs, rhs, gs, dy = random_case(seed, m, 8, 5, sizes)
    out, d_lhs, d_rhs = _reference_value_and_grads(lhs, rhs, gs, dy)
    assert_close(out, np_gmm(lhs, rhs, gs))
    exp_lhs, exp_rhs = np_grads(lhs, rhs, gs, dy)
    assert_close(d_lhs, exp_lhs)
    assert_close(d_rhs, exp_rhs)


def test_wgrad_matches_numpy():
    lhs, _, gs, dy = random_case(1, 40, 6, 10, [10, 0, 25])
    assert_close(ops.grouped_gemm_wgrad(jnp.asarray(lhs), jnp.asarray(dy), gs), np_tgmm(lhs, dy, gs))


def test_bfloat16_and_preferred_element_type():
    lhs, rhs, gs, _ = random_case(2, 24, 16, 8, [5, 11, 8])
    lhs16, rhs16 = jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16)
    expected = np_gmm(np.asarray(lhs16, np.float32), np.asarray(rhs16, np.float32), gs)
    out = ops.grouped_gemm(lhs16, rhs16, gs)
    assert out.dtype == jnp.bfloat16
    assert_close(out, expected, rtol=1e-2)
    out32 = ops.grouped_gemm(lhs16, rhs16, gs, preferred_element_type=jnp.float32)
    assert out32.dtype == jnp.float32
    assert_close(out32, expected)  # f32 accumulation of exact bf16 products
    d_lhs, d_rhs = jax.grad(lambda a, b: jnp.sum(ops.grouped_gemm(a, b, gs).astype(jnp.float32)), (0, 1))(lhs16, rhs16)
    assert d_lhs.dtype == d_rhs.dtype == jnp.bfloat16


# -------------------------------------------------------------------------------------------------- FP8


def np_quantize(x, axes, dtype):
    """float64 current scaling: ``(dequantized x, scale_inv)`` with the amax over ``axes``."""
    x = np.asarray(x, np.float64)
    amax = np.max(np.abs(x), axis=axes, keepdims=True)
    fp8_max = float(ml_dtypes.finfo(dtype).max)
    scale = np.where(amax > 0, fp8_max / np.where(amax > 0, amax, 1.0), 1.0).astype(np.float32)
    q = np.clip(x * scale, -fp8_max, fp8_max).astype(np.float32).astype(dtype).astype(np.float64)
    return q / scale.astype(np.float64)


def test_fp8_matches_numpy_quantized_product():
    """Against numpy on the same quantized operands: only f32 accumulation error remains (~1e-5)."""
    lhs, rhs, gs, dy = random_case(3, 40, 32, 16, [9, 0, 24, 4])
    e4m3, e5m2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    lhs_q, rhs_q, dy_q = np_quantize(lhs, None, e4m3), np_quantize(rhs, (1, 2), e4m3), np_quantize(dy, None, e5m2)
    out, d_lhs, d_rhs = value_and_grads(lambda a, b: ops.grouped_gemm_fp8(a, b, gs), lhs, rhs, dy)
    assert_close(out, np_gmm(lhs_q, rhs_q, gs))
    assert_close(d_lhs, np_gmm(dy_q, rhs_q, gs, transpose_rhs=True))
    assert_close(d_rhs, np_tgmm(lhs_q, dy_q, gs))


def np_quantize_with(x, scale, dtype):
    """float64 model of a cast with a given scale (broadcast against ``x``): ``saturate(x * scale) / scale``."""
    fp8_max = float(ml_dtypes.finfo(dtype).max)
    scale = np.asarray(scale, np.float32)
    q = np.clip(np.asarray(x, np.float32) * scale, -fp8_max, fp8_max).astype(dtype).astype(np.float64)
    return q / scale.astype(np.float64)


def test_fp8_with_given_scales_quantizes_with_them_and_reports_amaxes():
    """Delayed scaling's path: the casts use the caller's scales (some saturate, some waste range), and
    the cotangent of the scales is the amaxes of lhs, of each group of rhs and of the output gradient."""
    lhs, rhs, gs, dy = random_case(6, 40, 32, 16, [9, 0, 24, 4])
    rhs = rhs * np.array([1.0, 3.0, 0.01, 50.0], np.float32)[:, None, None]
    e4m3, e5m2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    scales = ops.GroupedFP8Scales(jnp.float32(200.0), jnp.asarray([40.0, 100.0, 9000.0, 1.0], jnp.float32),
                                  jnp.float32(2000.0))
    out, vjp = jax.vjp(lambda a, b, s: ops.grouped_gemm_fp8(a, b, gs, scales=s), jnp.asarray(lhs), jnp.asarray(rhs),
                       scales)
    d_lhs, d_rhs, d_scales = vjp(jnp.asarray(dy))
    lhs_q = np_quantize_with(lhs, 200.0, e4m3)
    rhs_q = np_quantize_with(rhs, np.asarray(scales.rhs)[:, None, None], e4m3)
    dy_q = np_quantize_with(dy, 2000.0, e5m2)
    assert_close(out, np_gmm(lhs_q, rhs_q, gs))
    assert_close(d_lhs, np_gmm(dy_q, rhs_q, gs, transpose_rhs=True))
    assert_close(d_rhs, np_tgmm(lhs_q, dy_q, gs))
    assert isinstance(d_scales, ops.GroupedFP8Scales)
    np.testing.assert_array_equal(d_scales.lhs, np.abs(lhs).max())
    np.testing.assert_array_equal(d_scales.rhs, np.abs(rhs).max(axis=(1, 2)))
    np.testing.assert_array_equal(d_scales.grad, np.abs(dy).max())


def test_fp8_given_the_current_scales_is_current_scaling():
    lhs, rhs, gs, dy = map(jnp.asarray, random_case(7, 24, 16, 8, [10, 14]))
    fp8_scale = lambda amax, dtype: jnp.float32(jnp.finfo(dtype).max) / amax
    scales = ops.GroupedFP8Scales(fp8_scale(jnp.max(jnp.abs(lhs)), jnp.float8_e4m3fn),
                                  fp8_scale(jnp.max(jnp.abs(rhs), axis=(1, 2)), jnp.float8_e4m3fn),
                                  fp8_scale(jnp.max(jnp.abs(dy)), jnp.float8_e5m2))
    given, vjp_given = jax.vjp(lambda a, b: ops.grouped_gemm_fp8(a, b, gs, scales=scales), lhs, rhs)
    current, vjp_current = jax.vjp(lambda a, b: ops.grouped_gemm_fp8(a, b, gs), lhs, rhs)
    np.testing.assert_array_equal(given, current)
    for a, b in zip(vjp_given(dy), vjp_current(dy)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("scales,match", [
    ((1.0, jnp.ones(2), 1.0), "GroupedFP8Scales"),
    (ops.GroupedFP8Scales(jnp.float32(1), jnp.ones(3, jnp.float32), jnp.float32(1)), r"scales.rhs .*\[2\]"),
    (ops.GroupedFP8Scales(jnp.ones(1, jnp.float32), jnp.ones(2, jnp.float32), jnp.float32(1)), "scales.lhs"),
    (ops.GroupedFP8Scales(jnp.float32(1), jnp.ones(2, jnp.float32), jnp.bfloat16(1)), "scales.grad is bfloat16"),
])
def test_fp8_scales_are_checked(scales, match):
    lhs, rhs, gs, _ = map(jnp.asarray, random_case(8, 8, 4, 4, [3, 5]))
    with pytest.raises((TypeError, ValueError), match=match):
        ops.grouped_gemm_fp8(lhs, rhs, gs, scales=scales)


def test_fp8_backward_runs_the_grouped_gemm_on_dequantized_operands():
    """bfloat16 inputs: the backward GEMMs are `grouped_gemm` / `grouped_gemm_wgrad` of the quantized
    values dequantized to bfloat16 (the scales folded in), the same numbers to the last bit."""
    lhs, rhs, gs, dy = random_case(5, 48, 32, 24, [10, 0, 30, 5], dtype=ml_dtypes.bfloat16)
    _, d_lhs, d_rhs = value_and_grads(lambda a, b: ops.grouped_gemm_fp8(a, b, gs), lhs, rhs, dy)
    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2

    def dequantized(x, axes, dtype):
        fp8_max = float(jnp.finfo(dtype).max)
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes, keepdims=axes is not None)
        scale = jnp.float32(fp8_max) / amax
        q = jnp.clip(x.astype(jnp.float32) * scale, -fp8_max, fp8_max).astype(dtype)
        return (q.astype(jnp.float32) * (1.0 / scale)).astype(jnp.bfloat16)

    lhs, rhs, dy = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(dy)
    dy_dq = dequantized(dy, None, e5m2)
    want_lhs = ops.grouped_gemm(dy_dq, dequantized(rhs, (1, 2), e4m3), gs, transpose_rhs=True)
    want_rhs = ops.grouped_gemm_wgrad(dequantized(lhs, None, e4m3), dy_dq, gs)
    np.testing.assert_array_equal(np.asarray(d_lhs, np.float32), np.asarray(want_lhs, np.float32))
    np.testing.assert_array_equal(np.asarray(d_rhs, np.float32), np.asarray(want_rhs, np.float32))


def test_fp8_close_to_full_precision():
    """Against the unquantized product. E4M3 rounds to 3 mantissa bits: a relative error of at most
    2**-4 per operand, about 2**-4 / sqrt(3) rms for uniform rounding; two operands give ~5 % of the
    output's rms, so 8 % (10 % for the E5M2 gradient, 2 mantissa bits, in d lhs) bounds it on these
    random normal inputs, while any mis-scaled group (a factor of 2 or more) fails it."""
    lhs, rhs, gs, dy = random_case(4, 64, 64, 32, [20, 0, 30, 10])
    rhs = rhs * np.array([1.0, 3.0, 0.01, 50.0], np.float32)[:, None, None]  # per-group scales differ
    out, d_lhs, d_rhs = value_and_grads(lambda a, b: ops.grouped_gemm_fp8(a, b, gs), lhs, rhs, dy)
    exp_out = np_gmm(lhs, rhs, gs)
    exp_lhs, exp_rhs = np_grads(lhs, rhs, gs, dy)
    start = 0
    for g, size in enumerate(gs):
        rows = slice(start, start + size)
        start += size
        if size == 0:
            continue
        def rel(a, b):
            return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)
        assert rel(np.asarray(out)[rows], exp_out[rows]) < 0.08
        assert rel(np.asarray(d_lhs)[rows], exp_lhs[rows]) < 0.10
        assert rel(np.asarray(d_rhs)[g], exp_rhs[g]) < 0.10
    assert np.all(np.asarray(out)[int(gs.sum()):] == 0)


# -------------------------------------------------------------------------------------------------- block FP8


def np_tile_dequantized(x, dtype=ml_dtypes.float8_e4m3fn):
    """``x [rows, cols]`` through E4M3 in 1x128 tiles along ``cols`` (float32 scales, as the op), float64."""
    x = np.asarray(x, np.float32)
    out = np.empty(x.shape, np.float64)
    fp8_max = np.float32(ml_dtypes.finfo(dtype).max)
    for start in range(0, x.shape[1], 128):
        tile = x[:, start:start + 128]
        amax = np.abs(tile).max(axis=1, keepdims=True)
        scale = np.where(amax > 0, fp8_max / np.where(amax > 0, amax, 1), 1).astype(np.float32)
        q = np.clip(tile * scale, -fp8_max, fp8_max).astype(dtype).astype(np.float32)
        out[:, start:start + 128] = q * (np.float32(1) / scale)
    return out


def np_block_dequantized(w, dtype=ml_dtypes.float8_e4m3fn):
    """``w [k, n]`` through E4M3 in 128x128 blocks, float64."""
    w = np.asarray(w, np.float32)
    out = np.empty(w.shape, np.float64)
    fp8_max = np.float32(ml_dtypes.finfo(dtype).max)
    for r in range(0, w.shape[0], 128):
        for c in range(0, w.shape[1], 128):
            block = w[r:r + 128, c:c + 128]
            amax = np.abs(block).max()
            scale = np.float32(fp8_max / amax) if amax > 0 else np.float32(1)
            q = np.clip(block * scale, -fp8_max, fp8_max).astype(dtype).astype(np.float32)
            out[r:r + 128, c:c + 128] = q * (np.float32(1) / scale)
    return out


def test_block_fp8_matches_numpy_block_quantized_products():
    """Each GEMM against float64 numpy on operands cast as the recipe casts them: lhs tiles along K,
    rhs blocks per group (K not a multiple of 128: short last tiles and blocks), the gradient tiles
    along N for d lhs, and lhs and the gradient re-cut along M for d rhs. Only f32 accumulation error remains."""
    lhs, rhs, gs, dy = random_case(5, 200, 200, 136, [90, 0, 70, 30])   # 10 rows past the groups
    lhs[::7] *= 300.0                                                      # rows of other magnitudes
    out, d_lhs, d_rhs = value_and_grads(lambda a, b: ops.grouped_gemm_block_fp8(a, b, gs), lhs, rhs, dy)
    rhs_q = np.stack([np_block_dequantized(r) for r in rhs])
    assert_close(out, np_gmm(np_tile_dequantized(lhs), rhs_q, gs))
    assert_close(d_lhs, np_gmm(np_tile_dequantized(dy), rhs_q, gs, transpose_rhs=True))
    assert_close(d_rhs, np_tgmm(np_tile_dequantized(lhs.T).T, np_tile_dequantized(dy.T).T, gs))
    assert np.all(np.asarray(out)[int(gs.sum()):] == 0)


def test_block_fp8_keeps_the_precision_of_small_rows():
    """Rows spanning six orders of magnitude (an activation's outliers): per-tensor scaling flushes the
    small rows towards zero, 1x128 tiles keep E4M3's relative precision in every row (issue's bound:
    a third of per-tensor's mean per-row error)."""
    lhs, rhs, gs, _ = random_case(6, 256, 256, 128, [100, 156])
    lhs = lhs * (10.0 ** np.random.default_rng(7).uniform(-4, 2, (256, 1))).astype(np.float32)
    exact = np_gmm(lhs, rhs, gs)

    def row_error(out):
        return np.mean(np.linalg.norm(np.asarray(out, np.float64) - exact, axis=1) / np.linalg.norm(exact, axis=1))

    block = row_error(ops.grouped_gemm_block_fp8(jnp.asarray(lhs), jnp.asarray(rhs), gs))
    per_tensor = row_error(ops.grouped_gemm_fp8(jnp.asarray(lhs), jnp.asarray(rhs), gs,
                                                gradient_dtype=jnp.float8_e4m3fn))
    assert block < per_tensor / 3 and block < 0.05, (block, per_tensor)


def test_block_fp8_argument_errors():
    lhs, rhs, gs = jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([4, 4])
    with pytest.raises(TypeError, match="forward_dtype"):
        ops.grouped_gemm_block_fp8(lhs, rhs, gs, forward_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="amax_epsilon"):
        ops.grouped_gemm_block_fp8(lhs, rhs, gs, amax_epsilon=-1.0)


# -------------------------------------------------------------------------------------------------- errors


def test_argument_errors():
    lhs, rhs, gs = jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([3, 5], jnp.int32)
    with pytest.raises(ValueError, match="disagree on K"):
        ops.grouped_gemm(lhs, jnp.ones((2, 5, 3)), gs)
    with pytest.raises(ValueError, match="disagree on K"):
        ops.grouped_gemm(lhs, rhs, gs, transpose_rhs=True)
    with pytest.raises(TypeError, match="share a dtype"):
        ops.grouped_gemm(lhs, rhs.astype(jnp.bfloat16), gs)
    with pytest.raises(ValueError, match="group_sizes has shape"):
        ops.grouped_gemm(lhs, rhs, jnp.array([8], jnp.int32))
    with pytest.raises(TypeError, match="group_sizes has dtype"):
        ops.grouped_gemm(lhs, rhs, jnp.array([3.0, 5.0]))
    with pytest.raises(ValueError, match="rank"):
        ops.grouped_gemm(lhs[None], rhs, gs)
    with pytest.raises(TypeError, match="lhs has dtype"):
        ops.grouped_gemm(lhs.astype(jnp.int32), rhs.astype(jnp.int32), gs)
    with pytest.raises(TypeError, match="preferred_element_type"):
        ops.grouped_gemm(lhs, rhs, gs, preferred_element_type=jnp.int8)
    with pytest.raises(TypeError, match="block_sizes"):
        ops.grouped_gemm(lhs, rhs, gs, block_sizes=GemmTiles())
    with pytest.raises(TypeError, match="block_sizes"):
        ops.grouped_gemm_wgrad(lhs, jnp.ones((8, 3)), gs, block_sizes=BlockSizes())
    with pytest.raises(ValueError, match="share M"):
        ops.grouped_gemm_wgrad(lhs, jnp.ones((7, 3)), gs)
    with pytest.raises(ValueError, match="forward_dtype"):
        ops.grouped_gemm_fp8(lhs, rhs, gs, forward_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="unknown implementation"):
        ops.grouped_gemm(lhs, rhs, gs, implementation="cublas")
    with pytest.raises(ValueError, match="power of two"):
        GemmTiles(block_m=48)


def test_dequantized_backward_keeps_the_fp8_rounding_on_gpus():
    """XLA's GPU compiler folds ``float32 -> FP8 -> float32`` conversions into the identity: the backward
    widens the quantized values behind an optimization barrier (`mtjax.dtypes.widen_fp8`), so the GEMMs
    on dequantized operands see the FP8 values, not the unquantized ones."""
    def f(lhs, rhs, group_sizes):
        out, vjp = jax.vjp(lambda a, b: ops.grouped_gemm_fp8(a, b, group_sizes, implementation="xla"), lhs, rhs)
        return vjp(out)

    S = jax.ShapeDtypeStruct
    text = jax.jit(f).trace(S((64, 32), jnp.bfloat16), S((4, 32, 48), jnp.bfloat16), S((4,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("optimization_barrier") >= 3  # lhs, rhs and the gradient
    q = jnp.asarray([1.0, -2.5, 448.0], jnp.float8_e4m3fn)
    np.testing.assert_array_equal(widen_fp8(q), q.astype(jnp.float32))
    with pytest.raises(TypeError, match="widen_fp8"):
        widen_fp8(jnp.ones(3, jnp.bfloat16))
