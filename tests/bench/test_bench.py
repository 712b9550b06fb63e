"""`mtjax bench --quick` runs on the CPU and reports every field; the harness rejects bad input.

Speed is never asserted here: only that the pieces run, fit together and report complete rows.
"""

import argparse
import importlib
import json

import jax
import jax.numpy as jnp
import optax
import pytest

from mtjax.bench import cli, peers, profile, report, timing, train, variants

# The suites this test runs end to end (the kernel suites are tested by their owners).
OWN_SUITES = ["layer", "train"]


# XLA's CPU optimizations double the compile time of these toy steps and matter for no assertion here.
pytestmark = pytest.mark.usefixtures("fast_compiles")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, fast_compiles):
    out = tmp_path_factory.mktemp("bench")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([*OWN_SUITES, "--quick", "--json", str(out / "b.json"), "--plot", str(out / "b.png"),
                              "--profile", str(out / "profile")])
    # The profiled steps' options (no CUDA graphs) change nothing on the CPU: without them the second
    # compilation of each step returns the first one (jax caches the compilation of a lowering).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "PROFILE_XLA_OPTIONS", {})
        assert cli.run(args) == 0
    return json.loads((out / "b.json").read_text()), out


def test_json_has_every_field(quick_run):
    data, _ = quick_run
    for key in ("date", "device", "platform", "jax", "command", "quick", "peak_tflops", "ceilings", "suites"):
        assert key in data["meta"], key
    assert set(data["meta"]["ceilings"]) == set(timing.CEILING_KEYS)
    assert all(v > 0 for v in data["meta"]["ceilings"].values())
    rows = data["results"]
    assert {r["suite"] for r in rows} == {"ceiling", *OWN_SUITES}
    for r in rows:
        assert list(r) == list(timing.ROW_FIELDS), r["name"]
        assert r["time_ms"] > 0 and r["time_ms_min"] <= r["time_ms"] <= r["time_ms_max"]
        assert r["tflops"] is not None or r["gbps"] is not None
        assert r["fraction_of_ceiling"] is not None and r["fraction_of_ceiling"] > 0
        assert (r["speedup_vs_peer"] is None) == (r["peer"] is None)


def test_every_variant_is_compared(quick_run):
    data, _ = quick_run
    for suite in OWN_SUITES:
        rows = [r for r in data["results"] if r["suite"] == suite]
        assert [r["implementation"] for r in rows] == ["mtjax", "flax", "mtjax fp8", "flax fp8"]
        assert {r["implementation"]: r["peer"] for r in rows} == {
            "mtjax": "flax", "mtjax fp8": "flax fp8", "flax": None, "flax fp8": "flax"}
        assert all(r["mfu"] > 0 for r in rows)


def test_train_rows_report_throughput_and_finite_loss(quick_run):
    data, out = quick_run
    for r in (r for r in data["results"] if r["suite"] == "train"):
        extra = r["extra"]
        assert extra["tokens_per_s"] > 0 and extra["params"] > 0
        assert jnp.isfinite(extra["loss"]), r["implementation"]
        assert "profile_ms" in extra, extra.get("profile_error")
        assert isinstance(extra["custom_calls"], list)
    fp8_row = next(r for r in data["results"] if r["suite"] == "train" and r["implementation"] == "mtjax fp8")
    assert fp8_row["extra"]["speedup_vs_mtjax_bf16"] > 0
    assert fp8_row["extra"]["xla_options"] == {}  # mtjax.fp8.compiler_options(): none on the CPU
    assert (out / "b.png").stat().st_size > 0
    assert any(p.name.endswith(".trace.json.gz") for p in (out / "profile").iterdir())


def test_custom_call_targets():
    hlo = ('%a = f32[2] custom-call(%x), custom_call_target="mosaic_gpu", api_version=API_VERSION_TYPED_FFI\n'
           '%b = f32[2] custom-call(%a), custom_call_target="__cublas$lt$matmul$f8"\n'
           '%c = f32[2] custom-call(%b), custom_call_target="mosaic_gpu"')
    assert train.custom_call_targets(hlo) == ["__cublas$lt$matmul$f8", "mosaic_gpu"]
    assert train.custom_call_targets("%d = f32[2] add(%a, %b)") == []


def test_cli_rejects_unknown_suite(capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["gemmm", "--quick"])) == 2
    assert "gemmm" in capsys.readouterr().err


def test_row_and_report_validate_input():
    t = timing.Timing(1e-3, 1e-3, 1e-3, 1)
    with pytest.raises(ValueError, match="ceiling"):
        timing.row("x", "case", "impl", t, ceiling="tflops")
    bad = timing.row("x", "case", "impl", t, flops=1e9)
    del bad["mfu"]
    with pytest.raises(ValueError, match="mfu"):
        report.complete([bad], {}, 989.0)
    with pytest.raises(ValueError, match="input_sets"):
        timing.measure(lambda: None, [])
    with pytest.raises(ValueError, match="warmup"):
        timing.measure(lambda: None, [()], warmup=0)


def test_complete_fills_ratios():
    rows = [timing.row("s", "c", "a", timing.Timing(2e-3, 2e-3, 2e-3, 1), flops=2e12, peer="b",
                       ceiling="bf16_gemm_tflops"),
            timing.row("s", "c", "b", timing.Timing(4e-3, 4e-3, 4e-3, 1), flops=2e12, ceiling="bf16_gemm_tflops")]
    a, b = report.complete(rows, {"bf16_gemm_tflops": 2000.0}, 1000.0)
    assert a["speedup_vs_peer"] == pytest.approx(2.0) and b["speedup_vs_peer"] is None
    assert a["tflops"] == pytest.approx(1000.0) and a["fraction_of_ceiling"] == pytest.approx(0.5)
    assert a["mfu"] == pytest.approx(1.0) and b["mfu"] == pytest.approx(0.5)


def test_profile_summary_of_a_gpu_trace():
    """The parser reads kernel lanes (CUDA streams) of the device process, per step, by HLO op; an op
    is named after its first kernel that is not a memset (cuBLAS clears its workspace first)."""
    trace = {"traceEvents": [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "sm90_xmma_gemm_bf16", "dur": 3000.0, "args": {"hlo_op": "dot.1"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "loop_add_fusion", "dur": 1000.0, "args": {"hlo_op": "add_fusion"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "cudnn_fmha_fwd", "dur": 2000.0, "args": {}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "Memset 3", "dur": 200.0, "args": {"hlo_op": "custom-call.2"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "nvjet_sm90_tst_256x128", "dur": 800.0,
         "args": {"hlo_op": "custom-call.2"}},
        {"ph": "X", "pid": 1, "tid": 8, "name": "dot.1", "dur": 3000.0, "args": {}},
        {"ph": "X", "pid": 2, "tid": 1, "name": "host work", "dur": 9000.0, "args": {}},
    ]}
    summary = profile.summarize(trace, steps=2)
    assert summary["device_ms_per_step"] == pytest.approx(3.5)
    assert summary["by_category_ms"] == pytest.approx({"gemm": 1.9, "attention": 1.0, "fusion": 0.5, "copy": 0.1})
    assert summary["top_ops_ms"][0]["op"] == "dot.1"
    assert [(t["op"], t["category"]) for t in summary["top_ops_ms"] if t["op"] == "custom-call.2"] == [
        ("custom-call.2", "gemm")]


def test_profile_by_source_folds_layers():
    """With the optimized HLO, time adds up per emitting JAX operation across layers."""
    hlo = (
        '  %fusion.1 = bf16[4,8]{1,0} fusion(%p0), kind=kLoop, metadata={op_name="jit(step)/layers_0/mlp/add"}\n'
        '  ROOT %fusion.2 = bf16[4,8]{1,0} fusion(%p1), kind=kLoop, metadata={op_name="jit(step)/layers_11/mlp/add"}\n'
        '  %dot.3 = bf16[4,4]{1,0} dot(%a, %b), metadata={op_name="jit(step)/head/dot_general"}\n'
    )
    sources = profile.op_sources(hlo)
    assert sources == {"fusion.1": "jit(step)/layers_*/mlp/add", "fusion.2": "jit(step)/layers_*/mlp/add",
                       "dot.3": "jit(step)/head/dot_general"}
    trace = {"traceEvents": [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "loop_add_fusion", "dur": 1000.0, "args": {"hlo_op": "fusion.1"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "loop_add_fusion", "dur": 3000.0, "args": {"hlo_op": "fusion.2"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "nvjet_sm90", "dur": 2000.0, "args": {"hlo_op": "dot.3"}},
    ]}
    summary = profile.summarize(trace, steps=1, sources=sources)
    assert summary["by_source_ms"] == pytest.approx({"jit(step)/layers_*/mlp/add": 4.0,
                                                     "jit(step)/head/dot_general": 2.0})
    assert list(summary["by_source_ms"]) == ["jit(step)/layers_*/mlp/add", "jit(step)/head/dot_general"]
    assert "layers_*/mlp/add" in profile.format_summary("step", summary)


def test_flax_fp8_peer_updates_its_scaling_state():
    model = peers.FlaxGPT(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, mlp_dim=64, fp8=True)
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 64)
    params, fp8_state = peers.init(model, tokens)
    opt = optax.adamw(1e-3)
    step = peers.train_step(model, opt)
    (_, new_fp8_state, _), metrics = step((params, fp8_state, opt.init(params)), {"inputs": tokens, "targets": tokens})
    history = new_fp8_state[peers.FP8_COLLECTION]["layers"]["qkv"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"]
    assert history.shape == (2, 1024) and float(history[:, 0].min()) > 0
    assert jnp.isfinite(metrics["loss"])


def test_variant_settings_are_checked_and_labelled():
    setting = variants.parse("layernorm=xla, activation=xla,xla_gpu_enable_triton_gemm=false")
    assert setting.kernels == {"layernorm": "xla", "activation": "xla"}
    assert setting.xla_options == {"xla_gpu_enable_triton_gemm": False}
    assert variants.label(True, setting) == "mtjax fp8 [activation=xla,layernorm=xla,xla_gpu_enable_triton_gemm=false]"
    assert variants.label(False, variants.DEFAULT) == "mtjax"
    assert variants.mtjax_variants([setting])[2:] == [(False, setting), (True, setting)]
    model = variants.parse("scan_layers=false,remat_policy=dots")
    assert model.model == {"scan_layers": False, "remat_policy": "dots"} and not model.kernels
    assert variants.label(False, model) == "mtjax [remat_policy=dots,scan_layers=false]"
    train = variants.parse("compute_params=false")
    assert train.train == {"compute_params": False} and variants.label(False, train) == "mtjax [compute_params=false]"
    for bad in ("layernorm=nope", "nope=xla", "layernorm", "xla_gpu_x=", "", "compute_params=no", "fold_into_gemm=1"):
        with pytest.raises(ValueError, match="--variant"):
            variants.parse(bad)


def test_variant_switches_are_set_while_tracing_and_restored():
    from mtjax.kernels import activation
    from mtjax.ops import normalization

    setting = variants.parse("fold_into_gemm=true,gelu_ptx_sigmoid=true")
    assert setting.switches == {"fold_into_gemm": True, "gelu_ptx_sigmoid": True}
    assert variants.label(False, setting) == "mtjax [fold_into_gemm=true,gelu_ptx_sigmoid=true]"
    before = normalization.FOLD_INTO_GEMM, activation.GELU_PTX_SIGMOID
    with variants.mtjax_context(False, setting):
        assert normalization.FOLD_INTO_GEMM is True and activation.GELU_PTX_SIGMOID is True
    assert (normalization.FOLD_INTO_GEMM, activation.GELU_PTX_SIGMOID) == before
    for name, (module, attribute) in variants.SWITCHES.items():  # every switch names a real flag
        if module.startswith("mtjax.kernels.triton"):
            pytest.importorskip("triton")
        assert isinstance(getattr(importlib.import_module(module), attribute), bool), name


def test_measure_steps_threads_the_state_through_back_to_back_steps():
    """Each sample dispatches ``steps_per_sample`` steps, threading the state, and blocks once."""
    calls = []

    def step(state, batch):
        calls.append(batch)
        return state + 1, {"loss": state}

    t, (state, aux) = timing.measure_steps(step, 0, [10, 20], warmup=2, runs=3, steps_per_sample=2)
    assert state == 8 and aux == {"loss": 7} and t.runs == 3
    assert calls == [10, 20, 10, 20, 10, 20, 10, 20]  # 2 warm-ups, then 3 samples of 2 steps
    with pytest.raises(ValueError, match="steps_per_sample=0"):
        timing.measure_steps(step, 0, [1], steps_per_sample=0)


def test_recipe_variant_runs_fp8_only_under_that_recipe():
    block = variants.parse("recipe=block")
    assert block.recipe == "block" and variants.label(True, block) == "mtjax fp8 [recipe=block]"
    assert variants.mtjax_variants([block])[2:] == [(True, block)]  # its bf16 row is the default one
    assert variants.bf16_label(block) == "mtjax"
    with variants.mtjax_context(True, block):
        from mtjax import fp8

        assert isinstance(fp8.current_autocast().recipe, fp8.BlockScaling)
    with pytest.raises(ValueError, match=r"recipe='blocks'; accepted: \('delayed', 'current', 'block'\)"):
        variants.parse("recipe=blocks")


def test_rows_are_reported_as_they_are_made(tmp_path):
    """`--progress-jsonl`: each row is appended the moment `timing.row` makes it (a run cut short keeps them)."""
    import io

    stream, path = io.StringIO(), tmp_path / "rows.jsonl"
    timing.set_progress(stream, str(path))
    try:
        timing.row("gemm", "case a", "xla", timing.Timing(1e-3, 1e-3, 1e-3, 1))
        timing.row("gemm", "case b", "mtjax", timing.Timing(2e-3, 2e-3, 2e-3, 1))
    finally:
        timing.set_progress()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["name"] for r in lines] == ["case a", "case b"] and lines[1]["time_ms"] == pytest.approx(2.0)
    assert "gemm | case b | mtjax | 2.000 ms" in stream.getvalue()
