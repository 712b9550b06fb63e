"""`mtjax bench decode --quick` on the CPU: every kind of row is there, complete, and rows that cannot
run here (cuDNN, HF transformers) are recorded, not raised. Speed is never asserted."""

from __future__ import annotations

import argparse
import json

import jax
import pytest

from mtjax.bench import cli, decode, report, timing


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_decode") / "decode.json"
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["decode", "--quick", "--json", str(out), "--variant", "fold_into_gemm=true"])
    saved = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)  # compile time of toy shapes; nothing here is timed
    try:
        assert cli.run(args) == 0
    finally:
        jax.config.update("jax_disable_most_optimizations", saved)
    return json.loads(out.read_text())["results"]


def test_every_kind_of_row(quick_run):
    rows = [r for r in quick_run if r["suite"] == "decode"]
    assert all(set(r) == set(timing.ROW_FIELDS) for r in rows)
    timed = {(r["name"].split()[0], r["implementation"]) for r in rows if r["time_ms"] is not None}
    for kind, impl in [("prefill", "mtjax"), ("engine", "mtjax engine"), ("engine", "mtjax engine penalties"),
                       ("decode", "mtjax bf16"),
                       ("decode", "mtjax fp8 weights"), ("decode", "mtjax fp8 kv"), ("decode", "old loop"),
                       ("decode", "mtjax bf16 model layout"),
                       ("paged_attention", "pallas_triton"), ("paged_attention", "xla")]:
        assert (kind, impl) in timed, (kind, impl)
    # a --variant adds rows of both weight formats, each against the same weights without the setting
    for impl, peer in (("mtjax bf16 [fold_into_gemm=true]", "mtjax bf16"),
                       ("mtjax fp8 weights [fold_into_gemm=true]", "mtjax fp8 weights")):
        row = next(r for r in rows if r["implementation"] == impl and r["time_ms"] is not None)
        assert row["peer"] == peer and row["speedup_vs_peer"] is not None
    penalized = next(r for r in rows if r["implementation"] == "mtjax engine penalties")
    assert penalized["peer"] == "mtjax engine" and penalized["speedup_vs_peer"] is not None
    prefill = next(r for r in rows if r["name"].startswith("prefill"))
    assert prefill["mfu"] is not None and prefill["extra"]["tokens_per_s"] > 0
    for r in rows:
        if r["name"].startswith("decode") and r["implementation"].startswith("mtjax") and r["time_ms"] is not None:
            assert r["ceiling"] == "copy_gbps" and r["fraction_of_ceiling"] is not None  # of the memory roofline
            assert r["extra"]["weight_bytes"] > 0 and r["extra"]["kv_bytes_read"] > 0


def test_failures_are_rows(quick_run):
    failed = [r for r in quick_run if r["time_ms"] is None]
    for r in failed:
        assert "FAILED" in r["implementation"] or "skipped" in r["implementation"]
        assert r["peer"] is None
        assert r["extra"].get("error") or r["extra"].get("skipped")
    assert any(r["implementation"].startswith("cudnn") for r in failed)  # no cuDNN on the CPU


def test_guarded_turns_an_exception_into_a_row():
    def boom():
        raise RuntimeError("out of memory")

    [row] = decode.guarded("decode x", "mtjax bf16", boom)
    assert row["time_ms"] is None and "out of memory" in row["implementation"]
    report.table(report.complete([row], {"copy_gbps": 1.0}, 1.0))  # renders


def test_grid_parts_and_variants_are_checked():
    with pytest.raises(ValueError, match="parts=.*accepted"):
        decode.run(True, parts=["decoding"])
    with pytest.raises(ValueError, match="batches=.*positive"):
        decode.run(True, batches=[0])
    from mtjax.bench import variants

    with pytest.raises(ValueError, match="only op=implementation, switches and xla_"):
        decode.run(True, parts=["decode"], settings=[variants.parse("scan_layers=false")])
