"""The Pallas Triton grouped GEMM kernels (gmm, tgmm) against float64 numpy and the ops' references:
interpret mode on the CPU with 16-row tiles (many tiles, group boundaries inside tiles, K and N
tails), the cuda lowering on an abstract H200, dispatch rules, and real sizes on a GPU (``gpu`` marker)."""

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax._src.pallas.triton import lowering as triton_lowering

from mtjax import backend, ops
from mtjax.config import override
from mtjax.kernels import grouped_gemm as gg
from tests.ops.test_grouped_gemm import (
    assert_close,
    np_gmm,
    np_grads,
    np_quantize,
    np_tgmm,
    random_case,
    value_and_grads,
)

# Interpret mode and the references run as XLA programs on the CPU: their compilation dominates, and
# XLA's optimizations (twice the compile time) matter for no assertion here unless a test says so.
pytestmark = pytest.mark.usefixtures("fast_compiles")

SMALL = gg.GemmTiles(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1, group_m=2)
SMALL_BLOCKS = gg.BlockSizes(forward=SMALL, dlhs=SMALL, wgrad=SMALL)
S = jax.ShapeDtypeStruct

# M = 70 rows (4 full 16-row tiles and a tail), K = 40 and N = 24 (tails in both).
SIZES = [
    [7, 0, 20, 3, 40],   # boundaries inside tiles, an empty group, a group spanning three tiles
    [0, 70, 0, 0, 0],    # one group holds every row
    [16, 16, 0, 16, 22],  # boundaries on tile edges
    [1, 2, 0, 4, 5],     # sum < M: the rest are zeros
    [0, 0, 0, 0, 0],     # no group rows at all
]


# -------------------------------------------------------------------------------------------------- the scheduler


@pytest.mark.parametrize("group_sizes", SIZES)
def test_visits_cover_every_row_once(group_sizes):
    m, block_m = 70, 16
    group, tile, lo, hi = (np.asarray(a) for a in gg.visits(jnp.asarray(group_sizes, jnp.int32), m, block_m))
    assert len(group) == gg.num_visits(m, len(group_sizes), block_m)
    owner = -np.ones(m, int)
    ends = np.cumsum(group_sizes)
    for g, t, a, b in zip(group, tile, lo, hi):
        if a == b:
            continue
        assert t * block_m <= a < b <= (t + 1) * block_m
        assert np.all(owner[a:b] == -1)
        owner[a:b] = g
    expected = np.searchsorted(ends, np.arange(m), side="right")  # len(group_sizes) past the groups
    np.testing.assert_array_equal(owner, expected)


# -------------------------------------------------------------------------------------------------- CPU, interpret


def _kernel_case(group_sizes, transpose_rhs=False, seed=0, dtype=np.float32):
    return random_case(seed, 70, 40, 24, group_sizes, dtype=dtype, transpose_rhs=transpose_rhs)


@pytest.mark.parametrize("group_sizes", SIZES)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_matches_numpy(group_sizes, transpose_rhs):
    lhs, rhs, gs, _ = _kernel_case(group_sizes, transpose_rhs)
    out = gg.gmm(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(gs), transpose_rhs=transpose_rhs, tiles=SMALL,
                 interpret=True)
    assert_close(out, np_gmm(lhs, rhs, gs, transpose_rhs))
    assert np.all(np.asarray(out)[int(np.sum(group_sizes)):] == 0)


@pytest.mark.parametrize("num_programs", [3, 1000])
def test_persistent_gmm_matches_numpy(num_programs):
    """A few persistent programs walking every tile (and more programs than tiles)."""
    lhs, rhs, gs, _ = _kernel_case(SIZES[0], seed=6)
    tiles = gg.GemmTiles(block_m=16, block_n=16, block_k=16, group_m=2, num_programs=num_programs)
    out = gg.gmm(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(gs), tiles=tiles, interpret=True)
    assert_close(out, np_gmm(lhs, rhs, gs))


@pytest.mark.parametrize("group_sizes", SIZES)
def test_tgmm_matches_numpy(group_sizes):
    lhs, _, gs, dy = _kernel_case(group_sizes)
    out = gg.tgmm(jnp.asarray(lhs), jnp.asarray(dy), jnp.asarray(gs), tiles=SMALL, interpret=True)
    assert_close(out, np_tgmm(lhs, dy, gs))


def test_group_scale_multiplies_each_group():
    lhs, rhs, gs, dy = _kernel_case(SIZES[0], seed=5)
    scale = np.array([0.5, 3.0, -2.0, 0.25, 1e-3], np.float32)
    row_scale = np.concatenate([np.repeat(scale, gs), np.ones(70 - gs.sum())])[:, None]
    out = gg.gmm(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(gs), jnp.asarray(scale), tiles=SMALL, interpret=True)
    assert_close(out, np_gmm(lhs, rhs, gs) * row_scale)
    out = gg.tgmm(jnp.asarray(lhs), jnp.asarray(dy), jnp.asarray(gs), jnp.asarray(scale), tiles=SMALL, interpret=True)
    assert_close(out, np_tgmm(lhs, dy, gs) * scale[:, None, None])


def test_default_block_sizes():
    bf16 = gg.BlockSizes.default(32768, 2048, 8192, 8, jnp.bfloat16)
    assert (bf16.forward.block_m, bf16.forward.block_n, bf16.forward.block_k) == (128, 256, 64)
    narrow = gg.BlockSizes.default(98304, 2048, 1408, 64, jnp.bfloat16)
    assert narrow.forward.block_n == 128 and narrow.dlhs.block_n == 256  # 1408 = 11 x 128
    assert gg.BlockSizes.default(4096, 2048, 8192, 8, jnp.float8_e4m3fn).forward.block_k == 128
    assert gg.BlockSizes.default(64 * 8, 2048, 1408, 64, jnp.bfloat16).forward.block_m == 16  # 8 rows per expert
    assert gg.BlockSizes.default(64 * 100, 2048, 1408, 64, jnp.bfloat16).dlhs.block_m == 128
    assert gg.GemmTiles().clamp(m=20, n=300, k=8) == gg.GemmTiles(block_m=32, block_n=256, block_k=16)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_op_forward_and_gradients(interpret, transpose_rhs):
    """The differentiable op on the kernels (forward, d lhs, d rhs), f32 against float64 numpy."""
    lhs, rhs, gs, dy = _kernel_case(SIZES[0], transpose_rhs, seed=1)
    out, d_lhs, d_rhs = value_and_grads(
        lambda a, b: ops.grouped_gemm(a, b, jnp.asarray(gs), transpose_rhs=transpose_rhs, block_sizes=SMALL_BLOCKS,
                                      implementation="pallas_triton"), lhs, rhs, dy)
    assert_close(out, np_gmm(lhs, rhs, gs, transpose_rhs))
    exp_lhs, exp_rhs = np_grads(lhs, rhs, gs, dy, transpose_rhs)
    assert_close(d_lhs, exp_lhs)
    assert_close(d_rhs, exp_rhs)


@jax.jit
def _op_value_and_grads(lhs, rhs, group_sizes, dy):
    return value_and_grads(lambda a, b: ops.grouped_gemm(a, b, group_sizes, block_sizes=SMALL_BLOCKS,
                                                         implementation="pallas_triton"), lhs, rhs, dy)


@given(sizes=st.lists(st.integers(0, 40), min_size=4, max_size=4), seed=st.integers(0, 99))
def test_hypothesis_group_sizes(sizes, seed):
    """Random, skewed and empty groups, sums below M, against numpy (forward and both gradients).
    The shapes are fixed (M = 64, 4 groups) so one compilation serves every example."""
    m = 64
    while sum(sizes) > m:
        sizes[int(np.argmax(sizes))] //= 2
    lhs, rhs, gs, dy = random_case(seed, m, 24, 20, sizes)
    with override(pallas_interpret=True):
        out, d_lhs, d_rhs = _op_value_and_grads(lhs, rhs, gs, dy)
    assert_close(out, np_gmm(lhs, rhs, gs))
    exp_lhs, exp_rhs = np_grads(lhs, rhs, gs, dy)
    assert_close(d_lhs, exp_lhs)
    assert_close(d_rhs, exp_rhs)


def test_bfloat16_matches_reference(interpret):
    lhs, rhs, gs, dy = _kernel_case(SIZES[0], seed=2)
    args = [jnp.asarray(a, jnp.bfloat16) for a in (lhs, rhs, dy)]

    def run(implementation):
        return value_and_grads(lambda a, b: ops.grouped_gemm(a, b, jnp.asarray(gs), block_sizes=SMALL_BLOCKS,
                                                             implementation=implementation), *args)

    for got, want in zip(run("pallas_triton"), run("xla")):
        assert got.dtype == want.dtype == jnp.bfloat16
        assert_close(np.asarray(got, np.float32), np.asarray(want, np.float64), rtol=1e-2)


def test_default_tiles_clamp_to_small_shapes(interpret):
    lhs, rhs, gs, dy = _kernel_case(SIZES[0], seed=3)
    out, d_lhs, d_rhs = value_and_grads(
        lambda a, b: ops.grouped_gemm(a, b, jnp.asarray(gs), implementation="pallas_triton"), lhs, rhs, dy)
    assert_close(out, np_gmm(lhs, rhs, gs))
    exp_lhs, exp_rhs = np_grads(lhs, rhs, gs, dy)
    assert_close(d_lhs, exp_lhs)
    assert_close(d_rhs, exp_rhs)


def test_fp8_kernel_matches_fp8_reference(interpret):
    """Same quantized operands on both sides: only float32 accumulation order differs (~1e-5). The
    E5M2 x E4M3 d lhs GEMM runs on bfloat16-upcast operands in the kernel, exactly."""
    lhs, rhs, gs, dy = _kernel_case(SIZES[0], seed=4)

    @functools.partial(jax.jit, static_argnums=0)
    def run(implementation, lhs, rhs, dy):
        return value_and_grads(lambda a, b: ops.grouped_gemm_fp8(a, b, jnp.asarray(gs), block_sizes=SMALL_BLOCKS,
                                                                 implementation=implementation), lhs, rhs, dy)

    for got, want in zip(run("pallas_triton", lhs, rhs, dy), run("xla", lhs, rhs, dy)):
        assert_close(got, np.asarray(want, np.float64))


# -------------------------------------------------------------------------------------------------- cuda lowering


@pytest.mark.parametrize("dtype, fp8, persistent", [(jnp.bfloat16, False, False), (jnp.float32, False, False),
                                                    (jnp.bfloat16, True, False), (jnp.bfloat16, False, True)])
def test_lowers_for_cuda(dtype, fp8, persistent, monkeypatch):
    """Automatic selection stages the kernels for cuda; their Triton modules (forward, d lhs with rhs
    transposed, weight gradient) pass the MLIR verifier, on the CPU, for an H200."""
    lower_module = triton_lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower_module(*args, **kwargs)
        result.module.operation.verify()
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    gemm = ops.grouped_gemm_fp8 if fp8 else ops.grouped_gemm
    tiles = gg.GemmTiles(num_programs=264) if persistent else gg.GemmTiles()
    blocks = gg.BlockSizes(forward=tiles, dlhs=tiles)

    def f(lhs, rhs, group_sizes):
        out, vjp = jax.vjp(lambda a, b: gemm(a, b, group_sizes, block_sizes=blocks), lhs, rhs)
        return out, vjp(out)

    with backend.abstract_gpu():
        text = jax.jit(f).trace(S((1000, 256), dtype), S((8, 256, 200), dtype), S((8,), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("mtjax_grouped_gemm_wgrad") >= 1
    assert text.count("mtjax_grouped_gemm") >= 3  # forward, d lhs, and the weight gradient's name


def test_fp8_with_e4m3_gradients_lowers_for_cuda():
    """E4M3 gradients (DeepSeek-V3's format): the forward contracts K-major FP8 operands on the Mosaic GPU
    kernel; ``d lhs`` and the weight gradient take the dequantized operands on the Triton kernels."""
    def f(lhs, rhs, group_sizes):
        out, vjp = jax.vjp(lambda a, b: ops.grouped_gemm_fp8(a, b, group_sizes, gradient_dtype=jnp.float8_e4m3fn),
                           lhs, rhs)
        return out, vjp(out)

    with backend.abstract_gpu():
        text = jax.jit(f).trace(S((4096, 2048), jnp.bfloat16), S((8, 2048, 1024), jnp.bfloat16),
                                S((8,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    calls = collections.Counter(re.findall(r"custom_call @([\w$.]+)", text))
    assert calls["mosaic_gpu_v2"] == 1 and "mtjax_grouped_gemm_wgrad" in text


def test_block_fp8_lowers_to_kernels_for_cuda():
    """The block-scaled grouped GEMM on a Hopper GPU: the forward and ``d lhs`` GEMMs are the Mosaic GPU
    kernel on FP8 operands, the weight gradient the grouped GEMM kernel, and the casts of lhs (with
    lhs^T), of the gradient (with its transpose) and of rhs's blocks are kernels (each cast above
    `mtjax.kernels.common.SMALL_ELEMENTS`: smaller ones are left to XLA)."""
    def f(lhs, rhs, group_sizes):
        out, vjp = jax.vjp(lambda a, b: ops.grouped_gemm_block_fp8(a, b, group_sizes), lhs, rhs)
        return out, vjp(out)

    with backend.abstract_gpu():
        text = jax.jit(f).trace(S((4096, 2048), jnp.bfloat16), S((8, 2048, 2048), jnp.bfloat16),
                                S((8,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    calls = collections.Counter(re.findall(r"custom_call @([\w$.]+)", text))
    assert calls["mosaic_gpu_v2"] == 2 and "mtjax_grouped_gemm_wgrad" in text
    assert calls["__gpu$xla.gpu.triton"] >= 4  # the weight gradient and the three casts


def test_lowers_for_cuda_inside_shard_map():
    """Inside ``shard_map(check_vma=True)`` (MoEBlock's per-device experts) the kernels are staged
    too: their outputs vary over the mesh axes their operands vary over."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding, PartitionSpec, use_abstract_mesh

    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = AbstractMesh((4,), ("ep",), (AxisType.Explicit,), abstract_device=device)

    def per_device(lhs, rhs, group_sizes):
        rhs, group_sizes = (jax.lax.pcast(a, ("ep",), to="varying") for a in (rhs, group_sizes))
        out, vjp = jax.vjp(lambda a, b: ops.grouped_gemm(a, b, group_sizes), lhs, rhs)
        return out, vjp(out)[1]

    def spec(shape, dtype, *axes):
        return S(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*axes)))

    with use_abstract_mesh(mesh):
        fn = jax.shard_map(per_device, mesh=mesh, in_specs=(PartitionSpec("ep"), PartitionSpec(), PartitionSpec()),
                           out_specs=(PartitionSpec("ep"), PartitionSpec("ep")), check_vma=True)
        text = jax.jit(fn).trace(spec((4 * 256, 128), jnp.bfloat16, "ep"), spec((2, 128, 64), jnp.bfloat16),
                                 spec((2,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mtjax_grouped_gemm_wgrad" in text


# -------------------------------------------------------------------------------------------------- dispatch


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="assumes no local GPU (the cuda device comes from config)")
def test_selection_per_platform(monkeypatch):
    monkeypatch.setattr(backend, "native_triton_problem", lambda: "jax_triton cannot be imported")
    args = (S((4096, 1024), jnp.bfloat16), S((8, 1024, 512), jnp.bfloat16), S((8,), jnp.int32), None)
    static = {"transpose_rhs": False, "out_dtype": jnp.dtype(jnp.bfloat16), "tiles": None}
    assert backend.select("grouped_gemm", platform_name="cuda", args=args, static=static)[0].name == "pallas_triton"
    assert backend.select("grouped_gemm", platform_name="rocm", args=args, static=static)[0].name == "pallas_triton"
    assert backend.select("grouped_gemm", platform_name="cpu", args=args, static=static)[0].name == "xla"
    wgrad_args = (S((4096, 1024), jnp.bfloat16), S((4096, 512), jnp.bfloat16), S((8,), jnp.int32), None)
    wgrad_static = {"out_dtype": jnp.dtype(jnp.bfloat16), "tiles": None}
    assert backend.select("grouped_gemm_wgrad", platform_name="cuda", args=wgrad_args,
                          static=wgrad_static)[0].name == "pallas_triton"
    big = (S((2**20, 4096), jnp.bfloat16), S((8, 4096, 512), jnp.bfloat16), S((8,), jnp.int32), None)
    impl, why = backend.select("grouped_gemm", platform_name="cuda", args=big, static=static)
    assert impl.name == "xla" and "int32" in why


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="assumes no local GPU (the cuda device comes from config)")
def test_selection_per_operand_dtype(monkeypatch):
    """With jax-triton: the native Triton kernels take bf16 operands, the Mosaic GPU kernel FP8 ones of
    one dtype with K-major rhs (block-scaled too); the native Triton kernels the mixed-FP8 backward."""
    monkeypatch.setattr(backend, "native_triton_problem", lambda: None)
    bf16 = (S((4096, 1024), jnp.bfloat16), S((8, 1024, 512), jnp.bfloat16), S((8,), jnp.int32), None)
    static = {"transpose_rhs": False, "out_dtype": jnp.dtype(jnp.bfloat16), "tiles": None}
    assert backend.select("grouped_gemm", platform_name="cuda", args=bf16, static=static)[0].name == "triton"
    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    forward = (S((4096, 1024), e4m3), S((8, 512, 1024), e4m3), S((8,), jnp.int32), S((8,), jnp.float32))
    transposed = {**static, "transpose_rhs": True}
    assert backend.select("grouped_gemm", platform_name="cuda", args=forward, static=transposed)[0].name == "mosaic_gpu"
    dgrad = (S((4096, 512), e5m2), S((8, 512, 1024), e4m3), S((8,), jnp.int32), S((8,), jnp.float32))
    assert backend.select("grouped_gemm", platform_name="cuda", args=dgrad, static=static)[0].name == "triton"
    # FP8 operands of one format with rhs K-major (E4M3 against E4M3): the Mosaic GPU kernel
    dgrad_e4m3 = (S((4096, 512), e4m3), S((8, 1024, 512), e4m3), S((8,), jnp.int32), S((8,), jnp.float32))
    assert backend.select("grouped_gemm", platform_name="cuda", args=dgrad_e4m3,
                          static=transposed)[0].name == "mosaic_gpu"
    block = (S((4096, 1024), e4m3), S((4096, 8), jnp.float32), S((8, 512, 1024), e4m3), S((8, 8, 4), jnp.float32),
             S((8,), jnp.int32))
    block_static = {"out_dtype": jnp.dtype(jnp.bfloat16), "tiles": None}
    assert backend.select("grouped_gemm_block_scaled", platform_name="cuda", args=block,
                          static=block_static)[0].name == "mosaic_gpu"
    mixed = (block[0], block[1], S((8, 512, 1024), e5m2), *block[3:])  # the kernel takes one FP8 dtype
    assert backend.select("grouped_gemm_block_scaled", platform_name="cuda", args=mixed,
                          static=block_static)[0].name == "triton"
    wgrad = (S((4096, 1024), e4m3), S((4096, 512), e5m2), S((8,), jnp.int32), S((8,), jnp.float32))
    wgrad_static = {"out_dtype": jnp.dtype(jnp.bfloat16), "tiles": None}
    assert backend.select("grouped_gemm_wgrad", platform_name="cuda", args=wgrad,
                          static=wgrad_static)[0].name == "triton"


def test_kernel_argument_errors():
    lhs, rhs, gs = jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([3, 5], jnp.int32)
    with pytest.raises(ValueError, match="disagree on K"):
        gg.gmm(lhs, rhs, gs, transpose_rhs=True, interpret=True)
    with pytest.raises(ValueError, match="group_sizes"):
        gg.gmm(lhs, rhs, gs[:1], interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        gg.gmm(lhs.astype(jnp.int32), rhs.astype(jnp.int32), gs)
    with pytest.raises(ValueError, match="share M"):
        gg.tgmm(lhs, jnp.ones((7, 3)), gs, interpret=True)
    with pytest.raises(ValueError, match="positive int"):
        gg.GemmTiles(num_stages=0)
    with pytest.raises(ValueError, match="num_programs"):
        gg.GemmTiles(num_programs=0)


# -------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["pallas_triton", "triton", "cublaslt"])
@pytest.mark.parametrize("sizes", ["balanced", "skewed"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_gpu_real_sizes(implementation, sizes, fp8, persistent):
    """16 experts, 8192 rows, hidden 2048, expert ffn 1408: the Pallas and native Triton kernels
    (default tiles, or the forward and d lhs as 264 persistent programs) and cuBLASLt (its FP8 ``d lhs``
    on the E5M2 gradient and E4M3 weights as they are) against ragged_dot (bf16), or
    for FP8 against float64 numpy on the same quantized operands (the backward widens them behind
    `mtjax.dtypes.widen_fp8`, whose barrier keeps XLA's GPU compiler from folding the quantize and
    dequantize conversions away)."""
    if implementation == "triton" and backend.native_triton_problem() is not None:
        pytest.skip(backend.native_triton_problem())
    if implementation == "cublaslt":
        if persistent:
            pytest.skip("cuBLASLt has no tiles of ours")
        from mtjax.kernels import cublaslt

        if cublaslt.load() is not None:
            cublaslt.build()
            cublaslt.load.cache_clear()
    m, k, n, g = 8192, 2048, 1408, 16
    group_sizes = np.full(g, m // g) if sizes == "balanced" else np.array([m - 15 * 37] + [37] * 14 + [0])
    lhs, rhs, gs, dy = random_case(0, m, k, n, group_sizes, dtype=np.float32)
    args = [jnp.asarray(a, jnp.bfloat16) for a in (lhs, rhs, dy)]
    gemm = ops.grouped_gemm_fp8 if fp8 else ops.grouped_gemm
    blocks = gg.BlockSizes.default(m, k, n, g, jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    if persistent:
        blocks = gg.BlockSizes(forward=dataclasses.replace(blocks.forward, num_programs=264),
                               dlhs=dataclasses.replace(blocks.dlhs, num_programs=264), wgrad=blocks.wgrad)

    def run(implementation):
        return jax.jit(lambda a, b, c: value_and_grads(
            lambda a, b: gemm(a, b, jnp.asarray(gs), block_sizes=blocks, implementation=implementation),
            a, b, c))(*args)

    if fp8:
        e4m3, e5m2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
        operands = ((args[0], None, e4m3), (args[1], (1, 2), e4m3), (args[2], None, e5m2))
        lhs_q, rhs_q, dy_q = (np_quantize(np.asarray(x, np.float32), axes, dtype) for x, axes, dtype in operands)
        want = (np_gmm(lhs_q, rhs_q, gs), np_gmm(dy_q, rhs_q, gs, transpose_rhs=True), np_tgmm(lhs_q, dy_q, gs))
    else:
        want = run("xla")
    for got, expected in zip(run(implementation), want):
        assert_close(np.asarray(got, np.float32), np.asarray(expected, np.float64), rtol=2e-2)
