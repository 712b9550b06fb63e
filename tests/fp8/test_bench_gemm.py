"""`mtjax.bench.gemm` runs (tiny shapes on the CPU) and gives full rows; speed is never asserted."""

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
