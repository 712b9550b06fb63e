"""`mtjax.bench.gemm` runs (tiny shapes on the CPU) and gives full rows; speed is never asserted."""

from mtjax.bench import gemm, timing


def test_quick_rows():
    rows = gemm.run(quick=True)
    assert [r["implementation"] for r in rows] == ["xla bf16", "mtjax fp8"]
    for r in rows:
        assert set(r) == set(timing.ROW_FIELDS) and r["time_ms"] > 0
        assert set(r["extra"]) == {"shape", "dtype", "fp8_gemms", "other_gemms", "triton_gemms"}
    assert rows[1]["peer"] == "xla bf16" and rows[1]["ceiling"] == "fp8_gemm_tflops"


def test_gemm_calls_counts_cublas_and_triton_gemms():
    hlo = ('custom_call_target="__cublas$lt$matmul$f8" custom_call_target="__cublas$gemm" '
           'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}} '
           'backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}')
    assert gemm.gemm_calls(hlo) == {"fp8_gemms": 1, "other_gemms": 1, "triton_gemms": 2}
