"""The cuBLASLt GEMMs (`mtjax.kernels.cublaslt`, implementation ``"cublaslt"``): the block-scaled FP8
GEMM's lowering to its FFI call with the scale layouts cuBLASLt reads, the grouped GEMMs' lowering and
selection, what they decline, the build of the FFI library where this machine has cuBLASLt and its
headers, and their numbers on the GPU."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import backend, ops
from mtjax.kernels import cublaslt
from tests.kernels.test_block_fp8 import _operands, assert_fp8_gemm_close, fp8_gemm_bound
from tests.ops.test_grouped_gemm import assert_close, np_gmm, np_tgmm, random_case


def _lowered(m, k, n, b_blocks, b_dtype=jnp.float8_e4m3fn, batch=()):
    kb = -(-k // 128)
    sb_rows = -(-n // 128) if b_blocks else n
    shapes = [jax.ShapeDtypeStruct(batch + s, dtype) for s, dtype in (
        ((m, k), jnp.float8_e4m3fn), ((m, kb), jnp.float32), ((n, k), b_dtype), ((sb_rows, kb), jnp.float32))]
    fn = functools.partial(cublaslt.block_fp8_gemm, out_dtype=jnp.bfloat16)
    for _ in batch:
        fn = jax.vmap(fn)
    with backend.abstract_gpu():
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def _library_built():
    if cublaslt.load() is not None:
        cublaslt.build()
        cublaslt.load.cache_clear()


@pytest.fixture
def registered(monkeypatch):
    """The FFI targets taken as registered (lowering does not need the library)."""
    monkeypatch.setattr(cublaslt, "load", lambda: None)
    monkeypatch.setattr(cublaslt, "block_modes_problem", lambda: None)


@pytest.mark.parametrize("b_blocks", [True, False], ids=["blocks", "tiles"])
def test_lowers_to_the_ffi_call_with_cublas_layouts(registered, b_blocks):
    """Odd shapes: rows padded to 16, K to whole blocks; a's scales K-block-major with the rows
    contiguous, b's blocks with their K blocks contiguous (padded to 4), b's tiles as a's."""
    text = _lowered(1000, 2050, 700, b_blocks)
    [call] = [line for line in text.splitlines() if cublaslt.TARGET in line]
    operands = re.findall(r"tensor<([0-9x]+)x(f8E4M3FN|f32)>", call.split("->")[0])
    b_scale = ("6x20", "f32") if b_blocks else ("17x704", "f32")
    assert operands == [("1008x2176", "f8E4M3FN"), ("17x1008", "f32"), ("704x2176", "f8E4M3FN"), b_scale], call
    assert "tensor<1008x704xbf16>" in call.split("->")[1]
    assert f"b_blocks = {int(b_blocks)} : i32" in call


def test_batch_axes_run_one_call_per_entry(registered):
    """`BlockScaling`'s matmul vmaps batch axes; the handler takes 2-D operands, so a loop of calls."""
    text = _lowered(256, 256, 128, True, batch=(3,))
    assert text.count(cublaslt.TARGET) == 1 and "stablehlo.while" in text


def test_what_it_declines(monkeypatch, tmp_path):
    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    assert "E5M2" in cublaslt.unsupported(e5m2, e5m2, jnp.bfloat16)
    assert cublaslt.unsupported(e4m3, e5m2, jnp.float32) is None
    assert "out_dtype" in cublaslt.unsupported(e4m3, e4m3, jnp.int8)
    with pytest.raises(ValueError, match="E5M2"):
        x = jnp.zeros((16, 128), e5m2)
        cublaslt.block_fp8_gemm(x, jnp.ones((16, 1)), x, jnp.ones((16, 1)), jnp.bfloat16)
    # without its library the op's implementation says how to build it, and selection passes it by
    monkeypatch.setenv("MTJAX_CUBLASLT_LIBRARY", str(tmp_path / "missing.so"))
    cublaslt.load.cache_clear()
    try:
        impl = backend.get_implementation("block_fp8_gemm", "cublaslt")
        a = jax.ShapeDtypeStruct((128, 128), e4m3)
        scale = jax.ShapeDtypeStruct((128, 1), jnp.float32)
        assert "python -m mtjax.kernels.cublaslt" in impl.unsupported(a, scale, a, scale, out_dtype=jnp.bfloat16)
        grouped = backend.get_implementation("grouped_gemm", "cublaslt")
        why = grouped.unsupported(a, jax.ShapeDtypeStruct((2, 128, 128), e4m3), jax.ShapeDtypeStruct((2,), jnp.int32),
                                  None, transpose_rhs=True, out_dtype=jnp.bfloat16, tiles=None)
        assert "python -m mtjax.kernels.cublaslt" in why
        with pytest.raises(RuntimeError, match="python -m mtjax.kernels.cublaslt"):  # called directly
            x = jnp.zeros((16, 128), e4m3)
            cublaslt.block_fp8_gemm(x, jnp.ones((16, 1)), x, jnp.ones((16, 1)), jnp.bfloat16)
    finally:
        cublaslt.load.cache_clear()


# -------------------------------------------------------------------------------------------------- grouped


def _lowered_for_cuda(fn, *shapes):
    with backend.abstract_gpu():
        return jax.jit(fn).trace(*(jax.ShapeDtypeStruct(*s) for s in shapes)).lower(
            lowering_platforms=("cuda",)).as_text()


def _calls(text, target):
    return [line for line in text.splitlines() if f"@{target}(" in line]


def _operand_types(call):
    return re.findall(r"tensor<([0-9x]+)x(\w+)>", call.split("->")[0].rsplit(" : (", 1)[1])


def test_grouped_fp8_lowers_to_ffi_calls(registered):
    """With the library, automatic selection puts the FP8 grouped GEMM on cuBLASLt: the forward multiplies
    E4M3 operands (rhs [G, N, K], fast accumulation), ``d lhs`` the E5M2 gradient by the E4M3 weights as
    they are ([G, K, N] is K-major for it; cuBLASLt's promotion), both with their group scales."""
    def f(lhs, rhs, group_sizes):
        out, vjp = jax.vjp(lambda a, b: ops.grouped_gemm_fp8(a, b, group_sizes), lhs, rhs)
        return out, vjp(out)

    text = _lowered_for_cuda(f, ((1000, 256), jnp.bfloat16), ((8, 256, 512), jnp.bfloat16), ((8,), jnp.int32))
    calls = _calls(text, cublaslt.GROUPED_TARGET)
    assert len(calls) == 2, calls
    by_lhs = {_operand_types(call)[0][1]: call for call in calls}
    assert _operand_types(by_lhs["f8E4M3FN"])[:2] == [("1000x256", "f8E4M3FN"), ("8x512x256", "f8E4M3FN")]
    assert _operand_types(by_lhs["f8E5M2"])[:2] == [("1000x512", "f8E5M2"), ("8x256x512", "f8E4M3FN")]
    assert "fast_accum = 1 : i32" in by_lhs["f8E4M3FN"] and "fast_accum = 0 : i32" in by_lhs["f8E5M2"]
    assert all("has_scale = 1 : i32" in c and "transpose_rhs = 1 : i32" in c for c in calls)


def test_grouped_bf16_lowers_with_rhs_as_given(registered):
    """16-bit operands: rhs [G, K, N] as it is (cuBLASLt's non-transposed A), no scale; the weight
    gradient one call into [G, K, N]."""
    def f(lhs, rhs, group_sizes, dy):
        return (cublaslt.grouped_gemm(lhs, rhs, group_sizes, None, transpose_rhs=False, out_dtype=jnp.bfloat16),
                cublaslt.grouped_gemm_wgrad(lhs, dy, group_sizes, out_dtype=jnp.float32))

    text = _lowered_for_cuda(f, ((1000, 256), jnp.bfloat16), ((8, 256, 512), jnp.bfloat16), ((8,), jnp.int32),
                             ((1000, 512), jnp.bfloat16))
    [call] = _calls(text, cublaslt.GROUPED_TARGET)
    assert "transpose_rhs = 0 : i32" in call and "has_scale = 0 : i32" in call and "fast_accum = 0 : i32" in call
    assert "tensor<1000x512xbf16>" in call.split("->")[1]
    [wgrad] = _calls(text, cublaslt.GROUPED_WGRAD_TARGET)
    assert _operand_types(wgrad)[:2] == [("1000x256", "bf16"), ("1000x512", "bf16")]
    assert "tensor<8x256x512xf32>" in wgrad.split("->")[1]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="assumes no local GPU (the cuda device comes from config)")
def test_grouped_selection(registered, monkeypatch):
    """With the library: grouped GEMMs go to cuBLASLt first (bf16, FP8, ``d lhs`` of two FP8 formats, the
    16-bit weight gradient). Without it, the Triton kernels, which take ``d lhs`` dequantized."""
    monkeypatch.setattr(backend, "native_triton_problem", lambda: None)
    S = jax.ShapeDtypeStruct
    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    static = {"transpose_rhs": True, "out_dtype": jnp.dtype(jnp.bfloat16), "tiles": None}
    forward = (S((4096, 1024), e4m3), S((8, 512, 1024), e4m3), S((8,), jnp.int32), S((8,), jnp.float32))
    bf16 = (S((4096, 1024), jnp.bfloat16), S((8, 512, 1024), jnp.bfloat16), S((8,), jnp.int32), None)
    dlhs = (S((4096, 512), e5m2), S((), jnp.float32), S((8, 1024, 512), e4m3), S((8,), jnp.float32), S((8,), jnp.int32))
    dlhs_static = {"out_dtype": jnp.dtype(jnp.bfloat16), "tiles": None}

    def chosen(op, args, static):
        return backend.select(op, platform_name="cuda", args=args, static=static)[0].name

    assert chosen("grouped_gemm", forward, static) == "cublaslt"
    assert chosen("grouped_gemm", bf16, static) == "cublaslt"
    assert chosen("grouped_gemm_tensor_scaled", dlhs, dlhs_static) == "cublaslt"
    wgrad = (S((4096, 1024), jnp.bfloat16), S((4096, 512), jnp.bfloat16), S((8,), jnp.int32), None)
    wgrad_static = {"out_dtype": jnp.dtype(jnp.bfloat16), "tiles": None}
    assert chosen("grouped_gemm_wgrad", wgrad, wgrad_static) == "cublaslt"
    monkeypatch.setattr(cublaslt, "load", lambda: "no library")
    assert chosen("grouped_gemm", bf16, static) == "triton"
    assert chosen("grouped_gemm_tensor_scaled", dlhs, dlhs_static) == "triton"


def test_grouped_declines():
    e4m3, e5m2, bf16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16

    def why(lhs_dtype, rhs_dtype, transpose_rhs=True, k=256, n=512, out=bf16):
        rhs_shape = (4, n, k) if transpose_rhs else (4, k, n)
        return cublaslt.grouped_unsupported((64, k), rhs_shape, lhs_dtype, rhs_dtype, out,
                                            transpose_rhs=transpose_rhs)

    assert why(e4m3, e4m3) is None and why(e5m2, e4m3) is None and why(bf16, bf16, False) is None
    assert "E5M2" in why(e5m2, e5m2)
    assert "K-major" in why(e4m3, e4m3, transpose_rhs=False)
    assert "operands" in why(jnp.float32, jnp.float32) and "operands" in why(bf16, e4m3)
    assert "multiples of 16" in why(bf16, bf16, k=100)
    assert "out_dtype" in why(e4m3, e4m3, out=jnp.int8)
    assert "rows" in cublaslt.grouped_wgrad_unsupported((64, 256), (64, 512), e4m3, e5m2, bf16, scaled=False)
    assert "group scale" in cublaslt.grouped_wgrad_unsupported((64, 256), (64, 512), bf16, bf16, bf16, scaled=True)
    assert cublaslt.grouped_wgrad_unsupported((64, 256), (64, 512), bf16, bf16, jnp.float32, scaled=False) is None
    with pytest.raises(ValueError, match="K-major"):
        x = jnp.zeros((16, 32), e4m3)
        cublaslt.grouped_gemm(x, jnp.zeros((2, 32, 32), e4m3), jnp.array([8, 8]), None, transpose_rhs=False,
                              out_dtype=bf16)


def test_build_links_cublaslt(tmp_path):
    """Where this machine has cuBLASLt and the headers (jax's CUDA plugin wheels, a CUDA toolkit, or
    ``CUDA_HOME``), the handler compiles and links against it."""
    if cublaslt.find_cublaslt() is None:
        pytest.skip("no libcublasLt.so.N here (set CUDA_HOME or install nvidia-cublas)")
    try:
        path = cublaslt.build(tmp_path / "libmtjax_cublaslt.so")
    except RuntimeError as err:
        if "failed" in str(err):  # the compiler ran and failed: a real error
            raise
        pytest.skip(str(err))  # a header or the compiler is missing here
    assert cublaslt.version(path) >= 120900  # block-scaled modes: cuBLAS 12.9 and newer


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n, b_blocks, b_dtype", [
    (1024, 2048, 1024, True, jnp.float8_e4m3fn), (1000, 2050, 700, True, jnp.float8_e4m3fn),
    (1000, 2050, 700, False, jnp.float8_e4m3fn), (512, 1024, 384, False, jnp.float8_e5m2)])
def test_matches_reference_on_gpu(m, k, n, b_blocks, b_dtype):
    """Forward/dgrad (b in 128x128 blocks) and wgrad (b in 1x128 tiles, HYBRID's E5M2 gradient)
    against the float32 reference of the same FP8 operands."""
    _library_built()
    a, a_s, b, b_s = _operands(0, m, k, n, b_blocks, b_dtype)
    want = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, implementation="xla")
    got = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.bfloat16, implementation="cublaslt")
    assert_fp8_gemm_close(got, want, fp8_gemm_bound(a, a_s, b, b_s))



@pytest.mark.gpu
@pytest.mark.parametrize("operands", ["bf16", "e4m3", "e5m2 x e4m3"])
def test_grouped_matches_numpy_on_gpu(operands):
    """Empty groups, sizes off any tile, rows past the groups (zeros), group scales: against
    float64 numpy of the same operands; the weight gradient (16-bit only) likewise."""
    _library_built()
    sizes = [300, 0, 1, 17, 500, 0, 100, 0]
    lhs, rhs, gs, dy = random_case(0, 1000, 256, 512, sizes, transpose_rhs=True)
    lhs_dtype, rhs_dtype = {"bf16": (jnp.bfloat16,) * 2, "e4m3": (jnp.float8_e4m3fn,) * 2,
                            "e5m2 x e4m3": (jnp.float8_e5m2, jnp.float8_e4m3fn)}[operands]
    a, b = jnp.asarray(lhs, lhs_dtype), jnp.asarray(rhs * 4, rhs_dtype)
    fp8 = operands != "bf16"
    scale = jnp.linspace(0.5, 2.0, len(sizes), dtype=jnp.float32)
    got = jax.jit(functools.partial(cublaslt.grouped_gemm, transpose_rhs=True, out_dtype=jnp.float32))(
        a, b, jnp.asarray(gs), scale)
    want = np_gmm(np.asarray(a, np.float64), np.asarray(b, np.float64), gs, transpose_rhs=True)
    want = want * np.repeat(np.append(np.asarray(scale), 1.0), np.append(gs, 1000 - gs.sum()))[:, None]
    if fp8:  # the FP8 tensor cores' narrower accumulator (test_block_fp8.assert_fp8_gemm_close)
        bound = np_gmm(np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64)), gs, transpose_rhs=True)
        bound = bound * np.repeat(np.append(np.asarray(scale), 1.0), np.append(gs, 1000 - gs.sum()))[:, None]
        assert_fp8_gemm_close(got, want, bound)
    else:
        assert_close(got, want, rtol=1e-2)
    assert not np.any(np.asarray(got)[gs.sum():])
    if not fp8:
        d = jnp.asarray(dy, jnp.bfloat16)
        got_w = jax.jit(functools.partial(cublaslt.grouped_gemm_wgrad, out_dtype=jnp.float32))(a, d, jnp.asarray(gs))
        assert_close(got_w, np_tgmm(np.asarray(a, np.float64), np.asarray(d, np.float64), gs), rtol=1e-5)
