"""`mtjax bench attention --quick` on the CPU: rows in the shared format, the default's choice named."""

import pytest

from mtjax.bench import attention, report, variants


def test_quick_rows_are_complete_and_name_the_default():
    rows = report.complete(attention.run(quick=True), {}, report.H200_BF16_PEAK_TFLOPS)
    assert {r["extra"]["direction"] for r in rows} == {"fwd", "fwd+bwd"}
    defaults = [r for r in rows if r["implementation"] == "mtjax"]
    assert len(defaults) == 2 and all(r["extra"]["chosen"] == "xla" for r in defaults)
    assert all(r["tflops"] > 0 and r["time_ms"] > 0 for r in rows)


def test_flops_follow_the_anchors_convention():
    case = attention.Case(batch=2, seq=8, heads=3, kv_heads=1, head_dim=4, causal=True)
    assert case.flops(backward=False) == 4 * 2 * 3 * 8 * 8 * 4 / 2
    assert case.flops(backward=True) == 3.5 * case.flops(backward=False)


def test_a_variant_adds_a_row_traced_under_it():
    setting = variants.parse("attention=xla,tma_row_limits=false")
    rows = attention.run(quick=True, settings=(setting,))
    extra = [r for r in rows if r["implementation"] == "mtjax [attention=xla,tma_row_limits=false]"]
    assert len(extra) == 2 and all(r["time_ms"] > 0 and r["peer"] is None for r in extra)  # no cuDNN on the CPU
    with pytest.raises(ValueError, match="attention suite"):
        attention.run(quick=True, settings=(variants.parse("scan_layers=false"),))
