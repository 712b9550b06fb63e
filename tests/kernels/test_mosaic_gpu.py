"""The Mosaic GPU kernels (`mtjax.kernels.mosaic_gpu`, implementation ``"mosaic_gpu"``) against the
references: on the CPU in Mosaic GPU's interpret mode (shared memory, TMA, barriers and the warp
specialised pipeline simulated), lowered for an H200 (Pallas' Mosaic GPU lowering, layouts included),
and on the GPU (``gpu`` marker)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import backend, ops
from mtjax.kernels.mosaic_gpu import block_fp8_gemm as mosaic
from tests.kernels.test_block_fp8 import _operands


def _expanded(b_s, n, b_blocks):
    return jnp.repeat(b_s, 128, axis=0)[:n] if b_blocks else b_s


# Padded tails in every axis, both kinds of b scales, two tiles and ring depths.
@pytest.mark.parametrize("m, k, n, b_blocks, config", [
    (64, 256, 128, True, mosaic.MosaicGemmConfig(128, 2)),
    (200, 384, 70, False, mosaic.MosaicGemmConfig(64, 3)),
    (130, 130, 300, True, mosaic.MosaicGemmConfig(256, 2)),
], ids=["blocks", "rows-odd", "wide-n"])
def test_block_gemm_matches_reference(interpret, m, k, n, b_blocks, config):
    a, a_s, b, b_s = _operands(m + n, m, k, n, b_blocks)
    want = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, implementation="xla")
    got = mosaic.block_fp8_gemm(a, a_s, b, _expanded(b_s, n, b_blocks), jnp.float32, config=config)
    # float32 sums of the same products, in another order
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(want))))


def test_dispatched_op_and_bf16_output(interpret):
    a, a_s, b, b_s = _operands(3, 96, 256, 160, True)
    want = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, implementation="xla")
    got = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.bfloat16, implementation="mosaic_gpu")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32),
                               rtol=1e-2, atol=1e-6 * float(jnp.max(jnp.abs(want))))


def test_what_it_declines():
    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    assert "one FP8 dtype" in mosaic.unsupported((128, 128), e4m3, (128, 128), e5m2)
    assert mosaic.unsupported((128, 128), e5m2, (128, 128), e5m2) is None
    impl = backend.get_implementation("block_fp8_gemm", "mosaic_gpu")
    a = jax.ShapeDtypeStruct((128, 128), e4m3)
    assert impl.unsupported(a, None, jax.ShapeDtypeStruct((128, 128), e5m2), None, out_dtype=jnp.float32)
    assert impl.unsupported(a, None, a, None, out_dtype=jnp.float32) is None
    with pytest.raises(ValueError, match="block_n"):
        mosaic.MosaicGemmConfig(block_n=96)
    with pytest.raises(ValueError, match="stages"):
        mosaic.MosaicGemmConfig(stages=1)
    with pytest.raises(ValueError, match="shared memory"):
        x = jnp.zeros((128, 128), e4m3)
        mosaic.block_fp8_gemm(x, jnp.ones((128, 1)), x, jnp.ones((128, 1)), jnp.float32,
                              config=mosaic.MosaicGemmConfig(256, 3))


@pytest.mark.parametrize("m, k, n", [(8192, 8192, 8192), (1000, 2050, 700)])
def test_block_gemm_lowers_for_cuda(m, k, n):
    kb = -(-k // 128)
    shapes = [jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((m, kb), jnp.float32),
              jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((-(-n // 128), kb), jnp.float32)]
    for config in (mosaic.DEFAULT_CONFIG, *mosaic.SWEEP_CONFIGS):  # every config the benchmark sweeps lowers
        with backend.abstract_gpu():
            text = jax.jit(lambda a, sa, b, sb: mosaic.block_fp8_gemm(  # noqa: B023 (used at once)
                a, sa, b, jnp.repeat(sb, 128, axis=0)[:n], jnp.bfloat16, config=config)).trace(
                *shapes).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n", [(1024, 2048, 1024), (1000, 2050, 700)])
@pytest.mark.parametrize("config", [mosaic.DEFAULT_CONFIG, *mosaic.SWEEP_CONFIGS], ids=lambda c: c.label())
def test_block_gemm_on_gpu(m, k, n, config):
    a, a_s, b, b_s = _operands(0, m, k, n, True)
    want = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, implementation="xla")
    got = mosaic.block_fp8_gemm(a, a_s, b, _expanded(b_s, n, True), jnp.bfloat16, config=config)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32),
                               rtol=1e-2, atol=1e-5 * float(jnp.max(jnp.abs(want))))
