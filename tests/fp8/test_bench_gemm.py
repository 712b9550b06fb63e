"""`mtjax.bench.gemm` runs (tiny shapes on the CPU) and gives full rows; speed is never asserted."""

import jax
import jax.numpy as jnp
import numpy as np

from mtjax.bench import gemm, timing


def test_quick_rows():
    rows = gemm.run(quick=True)
    implementations = ["xla bf16", "mtjax fp8", "mtjax fp8 block"]
    assert [(r["name"].split(" 256")[0], r["implementation"]) for r in rows] == [
        *(("dense fwd+bwd", i) for i in implementations), *(("dense fwd", i) for i in implementations),
        ("block fp8 gemm", "mtjax block kernel")]
    for r in rows:
        assert set(r) == set(timing.ROW_FIELDS) and r["time_ms"] > 0
        assert set(r["extra"]) == {"shape", "dtype", "fp8_gemms", "other_gemms", "triton_gemms", "pallas_kernels"}
    assert rows[1]["peer"] == "xla bf16" and rows[1]["ceiling"] == "fp8_gemm_tflops"
    assert rows[2]["peer"] == "xla bf16" and rows[-1]["ceiling"] == "fp8_gemm_tflops"
    assert rows[0]["flops"] == 3 * rows[3]["flops"] == 3 * rows[-1]["flops"]


def test_gemm_calls_counts_cublas_and_triton_gemms():
    hlo = ('custom_call_target="__cublas$lt$matmul$f8" custom_call_target="__cublas$gemm" '
           'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}} '
           'backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}')
    assert gemm.gemm_calls(hlo) == {"fp8_gemms": 1, "other_gemms": 1, "triton_gemms": 2, "pallas_kernels": 0}
    assert gemm.gemm_calls('custom_call_target="__gpu$xla.gpu.triton"')["pallas_kernels"] == 1


def test_layout_rows_compare_block_scaled_gemms_with_per_tensor_fp8():
    rows = gemm._layout_rows("t", 256, 128, 384, seed=0, quick=True)
    implementations = list(gemm.LAYOUT_VARIANTS)
    assert [(r["name"], r["implementation"]) for r in rows] == [
        (f"gemm layout {layout} t ({shape})", i)
        for layout, shape in (("fwd", "256x128x384"), ("dgrad", "256x384x128"), ("wgrad", "128x256x384"))
        for i in implementations]
    for r in rows:
        assert set(r) == set(timing.ROW_FIELDS) and r["time_ms"] > 0 and r["flops"] == 2 * 256 * 128 * 384
        assert r["peer"] == (None if r["implementation"] in ("xla bf16", "per-tensor fp8") else "per-tensor fp8")


def test_layout_variants_compute_the_same_product():
    """Each variant multiplies the operands it is given (``a @ b^T``) to FP8 accuracy. ``b``'s 128x128
    blocks span four orders of magnitude, so a block scale applied to the wrong block shows (a relative
    error near 2). E4M3 keeps 3 mantissa bits: each element of an operand is off by up to 2^-4 relative,
    and a column of the product by about 0.05 at worst here."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (64, 256), jnp.float32)
    magnitude = jnp.array([[1.0, 1e-2], [1e2, 1e-1], [1e-2, 10.0]])  # per 128x128 block of b [384, 256]
    b = jax.random.normal(kb, (384, 256), jnp.float32) * jnp.repeat(jnp.repeat(magnitude, 128, 0), 128, 1)
    operands = gemm.layout_operands(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
    want = np.asarray(operands[0], np.float32) @ np.asarray(operands[1], np.float32).T
    for implementation, (fn, picks) in gemm.LAYOUT_VARIANTS.items():
        got = np.asarray(fn(*(operands[i] for i in picks)), np.float32)
        # Per output column: each row of b (one output column) has its own magnitude.
        error = np.linalg.norm(got - want, axis=0) / np.linalg.norm(want, axis=0)
        if implementation == "per-tensor fp8":  # unscaled E4M3: b's 1e-2 blocks lose precision, still finite
            assert np.isfinite(got).all()
            continue
        assert error.max() < (1e-2 if implementation == "xla bf16" else 8e-2), (implementation, error.max())
