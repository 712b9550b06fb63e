"""FP8 weights: the GEMMs found in every layer, kernels stored as E4M3, and the logits' error against
the unquantized model bounded (and printed, for the record)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax.inference import fp8_weights
from mtjax.models import GPT, gpt_config

pytestmark = pytest.mark.usefixtures("fast_compiles")


def tiny(scan_layers=False, **overrides):
    model = GPT(gpt_config("tiny", scan_layers=scan_layers, **overrides))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
    params = model.init(jax.random.key(0), tokens)["params"]
    return model, params, tokens


def relative_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_finds_every_projection(scan_layers):
    model = GPT(gpt_config("tiny", scan_layers=scan_layers))
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]  # shapes suffice
    gemms = fp8_weights.find_gemms(model, params)
    names = sorted({g.kernel_path[-2:] if g.kernel_path[-1] == "kernel" else g.kernel_path[-1:] for g in gemms})
    assert names == [("kv", "kernel"), ("out", "kernel"), ("query", "kernel"), ("wi_kernel",), ("wo_kernel",)]
    assert len(gemms) == (5 if scan_layers else 10)
    assert {g.layer_axes for g in gemms} == {1 if scan_layers else 0}
    assert {g.in_axes for g in gemms if g.kernel_path[-2] == "out"} == {2}  # [heads, head_dim, embed]


# Relative L2 error of the logits (random-init tiny model). E4M3 keeps 3 mantissa bits: each weight and
# (fp8_gemm) each input rounds by up to 2**-4 relative, ~2 % RMS per GEMM, which the residual stream
# averages down; 6 % bounds what we measure (about 3 %) with margin.
@pytest.mark.parametrize("mode,granularity,scan_layers", [("fp8_gemm", "channel", False),
                                                          ("dequantize", "tensor", True)])
def test_logits_error_against_unquantized(mode, granularity, scan_layers, capsys):
    model, params, tokens = tiny(scan_layers)
    model8, params8 = fp8_weights.quantize_weights(model, params, granularity=granularity, mode=mode)
    assert isinstance(model8, GPT) and model8.config == model.config
    want = model.apply({"params": params}, tokens)
    got = model8.apply({"params": params8}, tokens)
    err = relative_error(want, got)
    with capsys.disabled():
        print(f"\nFP8 weights ({mode}, {granularity} scales, scan_layers={scan_layers}): "
              f"relative logits error {err:.4f}")
    assert 0 < err < 0.06
    np.testing.assert_array_less(np.abs(np.asarray(want - got)).max(), 0.1 * np.abs(np.asarray(want)).max())


def test_auto_mode_runs_few_rows_weight_only_and_many_on_fp8_gemms():
    """The default ``mode="auto"``: a call of at most `WEIGHT_ONLY_MAX_ROWS` tokens gives the weight-only
    logits exactly, a larger one the FP8 GEMMs' (which differ from weight-only: inputs rounded to E4M3)."""
    model, params, tokens = tiny()
    assert fp8_weights.WEIGHT_ONLY_MAX_ROWS < tokens.size
    quantized = {mode: fp8_weights.quantize_weights(model, params, mode=mode) for mode in fp8_weights.MODES}
    assert quantized["auto"][0].fp8_weights_mode == "auto"

    def logits(mode, x):
        model8, params8 = quantized[mode]
        return np.asarray(jax.jit(lambda p, x: model8.apply({"params": p}, x))(params8, x))

    few = tokens[:1, :fp8_weights.WEIGHT_ONLY_MAX_ROWS]
    np.testing.assert_array_equal(logits("auto", few), logits("dequantize", few))
    np.testing.assert_array_equal(logits("auto", tokens), logits("fp8_gemm", tokens))
    assert not np.array_equal(logits("fp8_gemm", tokens), logits("dequantize", tokens))
    with pytest.raises(ValueError, match="mode='fast'.*auto, fp8_gemm, dequantize"):
        fp8_weights.quantize_weights(model, params, mode="fast")


def test_kernels_are_fp8_and_scales_fit():
    model, params, _ = tiny()
    _, params8 = fp8_weights.quantize_weights(model, params)
    layer = params8["layers_0"]
    assert jax.tree.leaves(layer["mlp"]["wi_kernel"])[0].dtype == jnp.float8_e4m3fn
    assert layer["self_attention"]["out"]["dot_general"]["weight_scale"].shape == (64,)
    assert layer["self_attention"]["kv"]["dot_general"]["weight_scale"].shape == (2, 2, 16)
    assert jax.tree.leaves(params8["token_embed"])[0].dtype == jnp.float32  # embeddings untouched
    # Stored output axes first: wo [mlp, hidden] as [hidden, mlp], out [heads, head_dim, embed] as
    # [embed, heads, head_dim].
    w = jax.tree.leaves(params["layers_0"]["mlp"]["wo_kernel"])[0]
    w8 = jax.tree.leaves(layer["mlp"]["wo_kernel"])[0]
    assert w8.shape == w.shape[::-1]
    assert jax.tree.leaves(layer["self_attention"]["out"]["kernel"])[0].shape == (64, 4, 16)
    w8 = w8.T
    # Dequantized kernels are within E4M3 rounding (2**-4 relative) of the originals.
    s = layer["mlp"]["wo_dot_general"]["weight_scale"]
    np.testing.assert_allclose(np.asarray(w8.astype(jnp.float32) * s), np.asarray(w), rtol=2**-4,
                               atol=float(s.max()) * 2**-9)


def test_fp8_gemm_mode_multiplies_fp8_operands():
    model, params, tokens = tiny()
    model8, params8 = fp8_weights.quantize_weights(model, params)
    text = jax.jit(lambda p, t: model8.apply({"params": p}, t)).lower(params8, tokens).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    fp8_dots = [line for line in dots if line.count("f8E4M3FN") >= 2]  # both operands FP8
    assert len(fp8_dots) == 10  # 5 projections x 2 layers; the tied output projection stays as it is


def test_bfloat16_model():
    model, params, tokens = tiny(dtype=jnp.bfloat16)
    model8, params8 = fp8_weights.quantize_weights(model, params)
    got = model8.apply({"params": params8}, tokens)
    want = model.apply({"params": params}, tokens)
    assert got.dtype == want.dtype
    assert relative_error(want, got) < 0.08


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_rmsnorm_folds_into_the_weight_only_dot(monkeypatch, dtype, rtol):
    """A decode-sized call (few rows) of an RMSNorm model with FP8 weights: with `FOLD_INTO_GEMM` the
    norm in front of the MLP folds into the weight-only dot (applied as the row scale of its product),
    with the logits of the norm applied first (float32: to rounding; bfloat16: its products round
    before the row scale)."""
    from mtjax import ops
    from mtjax.ops import normalization

    model, params, tokens = tiny(layernorm_type="rmsnorm", dtype=dtype)
    model8, params8 = fp8_weights.quantize_weights(model, params)
    few = tokens[:1, :normalization.FOLD_MAX_ROWS]
    folded = []
    original = ops.Norm.folded_dot
    monkeypatch.setattr(ops.Norm, "folded_dot", lambda self, x, dot: folded.append(x.shape) or original(self, x, dot))
    logits = {}
    for fold in (False, True):
        monkeypatch.setattr(normalization, "FOLD_INTO_GEMM", fold)
        logits[fold] = np.asarray(model8.apply({"params": params8}, few), np.float32)
    # the MLP's norm in each layer; GQA's attention normalizes first (the query and kv projections share it)
    assert len(folded) == model.config.num_layers
    np.testing.assert_allclose(logits[True], logits[False], rtol=rtol, atol=rtol * np.abs(logits[False]).max())


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_weight_only_dot_in_16_bit_inputs(dtype):
    """The weight-only dot of 16-bit inputs against float32: within FP8 rounding, and finite in float16,
    whose range the unscaled kernel's products (channels stretched to the E4M3 range) can exceed."""
    k, n = 2048, 64
    x = 8 * jax.random.normal(jax.random.key(0), (4, k), jnp.float32)  # outputs up to about 25
    w = 0.02 * jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=0) / fp8_weights.E4M3_MAX
    w8 = (w / scale).astype(fp8_weights.WEIGHT_DTYPE)
    want = x @ (w8.astype(jnp.float32) * scale)
    got = fp8_weights.fp8_weight_dot_general(scale, x.astype(dtype), w8, (((1,), (0,)), ((), ())), mode="dequantize")
    assert got.dtype == dtype and bool(jnp.all(jnp.isfinite(got)))
    # The input's rounding (2^-8 relative for bfloat16) and one of the output, over K = 2048 products.
    assert relative_error(want, got) < (0.02 if dtype != jnp.float32 else 1e-5)
    f32 = fp8_weights.fp8_weight_dot_general(scale, x.astype(dtype), w8, (((1,), (0,)), ((), ())),
                                             preferred_element_type=jnp.float32, mode="dequantize")
    assert f32.dtype == jnp.float32 and relative_error(want, f32) < 0.02


def test_errors():
    model, params, _ = tiny()
    with pytest.raises(ValueError, match="granularity"):
        fp8_weights.quantize_weights(model, params, granularity="row")
    with pytest.raises(ValueError, match="mode"):
        fp8_weights.quantize_weights(model, params, mode="int8")
    model8, params8 = fp8_weights.quantize_weights(model, params)
    with pytest.raises(ValueError, match="already"):
        fp8_weights.quantize_weights(model8, params8)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_output_first_weights_give_the_same_logits(scan_layers):
    """Kernels stored output axes first (transposed, not quantized): the model's logits; an engine on
    them decodes what one given the model as trained (which stores it so itself) decodes."""
    from mtjax.inference import Engine, SamplingParams

    model, params, tokens = tiny(scan_layers)
    model_t, params_t = fp8_weights.output_first_weights(model, params)
    assert isinstance(model_t, GPT) and model_t.config == model.config
    gemms = fp8_weights.find_gemms(model, params)
    assert len(gemms) == 5 * (1 if scan_layers else 2)  # query, kv, out, fc1, fc2 (scanned: stacked)
    for gemm in gemms:
        before = fp8_weights._unbox(fp8_weights._get(params, gemm.kernel_path))
        after = fp8_weights._unbox(fp8_weights._get(params_t, gemm.kernel_path))
        assert after.shape == tuple(before.shape[i] for i in gemm.stored_order(before.ndim))
        np.testing.assert_array_equal(np.transpose(after, gemm.model_order(after.ndim)), before)
    np.testing.assert_allclose(model_t.apply({"params": params_t}, tokens), model.apply({"params": params}, tokens),
                               rtol=1e-5, atol=1e-5)
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9]]
    if scan_layers:  # the engine unrolls a scanned stack, which it cannot do to stored kernels
        with pytest.raises(ValueError, match="cannot be unstacked"):
            Engine(model_t, params_t, max_slots=2)
    else:
        want = Engine(model, params, max_slots=2).generate(prompts, SamplingParams(max_tokens=4))
        assert Engine(model_t, params_t, max_slots=2).generate(prompts, SamplingParams(max_tokens=4)) == want
        with pytest.raises(ValueError, match="stored output first already"):
            Engine(model_t, params_t, max_slots=2, weights="fp8")
        as_given = Engine(model, params, max_slots=2, output_first=False)
        assert as_given.model is model and as_given.generate(prompts, SamplingParams(max_tokens=4)) == want
        with pytest.raises(ValueError, match="output_first=False"):
            Engine(model, params, max_slots=2, weights="fp8", output_first=False)
        with pytest.raises(TypeError, match="output_first"):
            Engine(model, params, max_slots=2, output_first="no")
    with pytest.raises(ValueError, match="already"):
        fp8_weights.quantize_weights(model_t, params_t)


def test_engine_option():
    from mtjax.inference import Engine, SamplingParams

    model, params, _ = tiny()
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9]]
    want = Engine(model, params, max_slots=2).generate(prompts, SamplingParams(max_tokens=4))
    got = Engine(model, params, max_slots=2, weights="fp8").generate(prompts, SamplingParams(max_tokens=4))
    assert got == want  # greedy tokens of this model are far from ties: FP8 rounding does not change them


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2 * fp8_weights.WEIGHT_ONLY_MAX_ROWS])
def test_gpu_fp8_gemms_read_the_stored_kernels_without_copies(rows):
    """On the GPU the GEMMs take the stored (output-axes-first) FP8 kernels as they are, weight-only
    (few rows) and FP8 GEMMs alike: the compiled step has no transpose or copy of an FP8 parameter.
    The layers are not scanned, as `mtjax.inference.Engine` runs them: a scanned stack's kernels are
    moved as a whole around XLA's loop."""
    model = GPT(gpt_config("tiny", hidden_size=256, mlp_dim=1024, num_heads=4, num_kv_heads=2, dtype=jnp.bfloat16,
                           scan_layers=False))
    tokens = jnp.zeros((rows, 1), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]
    model8, params8 = fp8_weights.quantize_weights(model, params)
    text = jax.jit(lambda p, t: model8.apply({"params": p}, t)).lower(params8, tokens).compile().as_text()
    lines = text.splitlines()
    # Compiled HLO prints operands by name only: find the FP8 values, then the kernels that read them.
    fp8_values = set(re.findall(r"(%[\w.\-]+) = f8e4m3fn\[", text))
    readers = [line for line in lines if re.search(r" = .* (fusion|custom-call)\(", line)
               and any(name in re.findall(r"%[\w.\-]+", line.split("(", 1)[1]) for name in fp8_values)]
    assert readers, "no fusion or custom call reads an FP8 parameter"
    copies = [line for line in lines if "f8e4m3fn[" in line and (" transpose(" in line or " copy(" in line)]
    assert not copies, "\n".join(copies[:10])


def test_a_prologue_needs_its_output_contracted_over_the_last_axis():
    from mtjax import ops

    norm = ops.Norm(jnp.ones((4,)), layernorm_type="rmsnorm")
    with pytest.raises(ValueError, match="lhs_prologue needs its output contracted over its last axis"):
        fp8_weights.fp8_weight_dot_general(jnp.ones((4,)), jnp.ones((4, 4)), jnp.ones((4, 4)),
                                           (((0,), (0,)), ((), ())), lhs_prologue=norm)
