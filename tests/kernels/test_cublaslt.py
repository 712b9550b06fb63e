"""The cuBLASLt block-scaled FP8 GEMM (`mtjax.kernels.cublaslt`, implementation ``"cublaslt"``): its
lowering to the FFI call with the scale layouts cuBLASLt reads, what it declines, the build of its
FFI library where this machine has cuBLASLt and its headers, and its numbers on the GPU."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from mtjax import backend, ops
from mtjax.kernels import cublaslt
from tests.kernels.test_block_fp8 import _operands, assert_fp8_gemm_close, fp8_gemm_bound


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


@pytest.fixture
def registered(monkeypatch):
    """The FFI target taken as registered: lowering does not need the library."""
    monkeypatch.setattr(cublaslt, "load", lambda: None)


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
        with pytest.raises(RuntimeError, match="python -m mtjax.kernels.cublaslt"):  # called directly
            x = jnp.zeros((16, 128), e4m3)
            cublaslt.block_fp8_gemm(x, jnp.ones((16, 1)), x, jnp.ones((16, 1)), jnp.bfloat16)
    finally:
        cublaslt.load.cache_clear()


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
    if cublaslt.load() is not None:
        cublaslt.build()
        cublaslt.load.cache_clear()
    a, a_s, b, b_s = _operands(0, m, k, n, b_blocks, b_dtype)
    want = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, implementation="xla")
    got = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.bfloat16, implementation="cublaslt")
    assert_fp8_gemm_close(got, want, fp8_gemm_bound(a, a_s, b, b_s))
