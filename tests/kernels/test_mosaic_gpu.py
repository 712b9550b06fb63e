"""The Mosaic GPU kernels (`mtjax.kernels.mosaic_gpu`, implementation ``"mosaic_gpu"``: the
block-scaled FP8 GEMM, the grouped GEMM and flash attention) against the references: on the CPU in Mosaic GPU's
interpret mode (shared memory, TMA, barriers and the warp specialised pipelines simulated), lowered
for an H200 (Pallas' Mosaic GPU lowering, layouts included), and on the GPU (``gpu`` marker)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import backend, ops
from mtjax.kernels import flash_attention as portable_attention
from mtjax.kernels.mosaic_gpu import block_fp8_gemm as mosaic
from mtjax.kernels.mosaic_gpu import flash_attention as mosaic_attention
from mtjax.kernels.mosaic_gpu import grouped_gemm as mosaic_grouped
from tests.kernels.test_block_fp8 import _operands, assert_fp8_gemm_close, fp8_gemm_bound

# Interpret mode and the references run as XLA programs on the CPU: their compilation dominates, and
# XLA's optimizations (twice the compile time) matter for no assertion here unless a test says so.
pytestmark = pytest.mark.usefixtures("fast_compiles")


def _expanded(b_s, n, b_blocks):
    return jnp.repeat(b_s, 128, axis=0)[:n] if b_blocks else b_s


# Padded tails in every axis, both kinds of b scales, three tiles and ring depths.
GEMM_CASES = {
    "blocks": (64, 256, 128, True, mosaic.MosaicGemmConfig(128, 2)),
    "rows-odd": (200, 384, 70, False, mosaic.MosaicGemmConfig(64, 3)),
    "wide-n": (130, 130, 300, True, mosaic.MosaicGemmConfig(192, 2)),
}


@pytest.mark.parametrize("m, k, n, b_blocks, config", GEMM_CASES.values(), ids=list(GEMM_CASES))
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
                              config=mosaic.MosaicGemmConfig(256, 2))


@pytest.mark.parametrize("m, k, n", [(8192, 8192, 8192), (1000, 2050, 700)])
def test_block_gemm_lowers_for_cuda(m, k, n):
    kb = -(-k // 128)
    shapes = [jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((m, kb), jnp.float32),
              jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((-(-n // 128), kb), jnp.float32)]
    # the default and every config the benchmark sweeps (bf16 out), the interpret tests' (float32 out):
    # Mosaic GPU's lowering checks that the shared memory `MosaicGemmConfig.smem_bytes` counts fits
    configs = [(config, jnp.bfloat16) for config in (mosaic.DEFAULT_CONFIG, *mosaic.SWEEP_CONFIGS)]
    configs += [(case[-1], jnp.float32) for case in GEMM_CASES.values()]
    for config, out_dtype in configs:
        with backend.abstract_gpu():
            text = jax.jit(lambda a, sa, b, sb: mosaic.block_fp8_gemm(  # noqa: B023 (used at once)
                a, sa, b, jnp.repeat(sb, 128, axis=0)[:n], out_dtype, config=config)).trace(
                *shapes).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n", [(1024, 2048, 1024), (1000, 2050, 700)])
@pytest.mark.parametrize("config", [mosaic.DEFAULT_CONFIG, *mosaic.SWEEP_CONFIGS], ids=lambda c: c.label())
def test_block_gemm_on_gpu(m, k, n, config):
    a, a_s, b, b_s = _operands(0, m, k, n, True)
    want = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, implementation="xla")
    got = mosaic.block_fp8_gemm(a, a_s, b, _expanded(b_s, n, True), jnp.bfloat16, config=config)
    assert_fp8_gemm_close(got, want, fp8_gemm_bound(a, a_s, b, b_s))


# -------------------------------------------------------------------------------------------------- grouped GEMM


def _grouped_reference(lhs, rhs, sizes, scale, transpose_rhs):
    """float32 `lax.ragged_dot` of the same operands, group scales applied, zeros past the groups."""
    r = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    out = jax.lax.ragged_dot(lhs.astype(jnp.float32), r.astype(jnp.float32), sizes)
    if scale is not None:
        out = out * scale[jnp.repeat(jnp.arange(len(sizes)), sizes, total_repeat_length=lhs.shape[0])][:, None]
    return jnp.where(jnp.arange(lhs.shape[0])[:, None] < jnp.sum(sizes), out, 0.0)


def _grouped_operands(seed, m, k, n, sizes, dtype, transpose_rhs):
    keys = jax.random.split(jax.random.key(seed), 2)
    lhs = jax.random.normal(keys[0], (m, k)).astype(dtype)
    g = len(sizes)
    rhs = (jax.random.normal(keys[1], (g, n, k) if transpose_rhs else (g, k, n)) * 0.1).astype(dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


# Empty groups, a group inside one tile, tiles shared by two groups, rows past the groups (NaN there
# must not leak), a partial last M-tile and N-tile; bf16 in both rhs layouts, FP8 (K-major) with
# per-group scales. Shapes the TMA tiles take (`unsupported`), lowered for an H200 as well.
GROUPED_CASES = {
    "bf16-kmajor": (304, 256, 192, [100, 0, 150, 30], jnp.bfloat16, True, False, mosaic_grouped.GroupedConfig(128, 2)),
    "bf16-nmajor-scaled": (264, 192, 192, [70, 130, 50], jnp.bfloat16, False, True,
                           mosaic_grouped.GroupedConfig(64, 3)),
    "fp8-scaled": (304, 384, 128, [5, 200, 60], jnp.float8_e4m3fn, True, True, mosaic_grouped.GroupedConfig(128, 2)),
}


@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_grouped_gemm_matches_reference(interpret, case):
    m, k, n, sizes, dtype, transpose_rhs, scaled, config = GROUPED_CASES[case]
    lhs, rhs, sizes = _grouped_operands(m, m, k, n, sizes, dtype, transpose_rhs)
    lhs = lhs.at[-2:].set(jnp.nan)  # rows past the groups
    scale = jax.random.uniform(jax.random.key(1), (len(sizes),)) + 0.5 if scaled else None
    got = mosaic_grouped.gmm(lhs, rhs, sizes, scale, transpose_rhs=transpose_rhs, out_dtype=jnp.float32,
                             config=config)
    want = _grouped_reference(lhs.at[-2:].set(0), rhs, sizes, scale, transpose_rhs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_grouped_gemm_cases_lower_for_cuda(case):
    m, k, n, sizes, dtype, transpose_rhs, scaled, config = GROUPED_CASES[case]
    shapes = [jax.ShapeDtypeStruct((m, k), dtype),
              jax.ShapeDtypeStruct((len(sizes), n, k) if transpose_rhs else (len(sizes), k, n), dtype),
              jax.ShapeDtypeStruct((len(sizes),), jnp.int32), jax.ShapeDtypeStruct((len(sizes),), jnp.float32)]
    with backend.abstract_gpu():
        jax.jit(lambda a, b, s, sc: mosaic_grouped.gmm(a, b, s, sc if scaled else None, transpose_rhs=transpose_rhs,
                                                       out_dtype=jnp.float32, config=config)).trace(
            *shapes).lower(lowering_platforms=("cuda",))


def test_grouped_gemm_ops_take_it_where_it_applies(interpret, monkeypatch):
    """``implementation="mosaic_gpu"`` for the differentiable ops: forward and ``d lhs`` on the
    Mosaic GPU kernel (FP8's ``d lhs`` on the dequantized bfloat16 operands), the weight gradient on
    the default, the results those of the Triton kernels."""
    lhs, rhs, sizes = _grouped_operands(5, 200, 128, 128, [60, 0, 100], jnp.bfloat16, False)
    dy = jax.random.normal(jax.random.key(6), (200, 128)).astype(jnp.bfloat16)
    calls = []
    original = mosaic_grouped.gmm
    monkeypatch.setattr(mosaic_grouped, "gmm", lambda lhs, *a, **kw: calls.append(lhs.dtype) or original(lhs, *a, **kw))
    for op, mosaic_calls in ((ops.grouped_gemm, [jnp.bfloat16] * 2),
                             (ops.grouped_gemm_fp8, [jnp.float8_e4m3fn, jnp.bfloat16])):
        calls.clear()
        outs = {}
        for implementation in ("mosaic_gpu", "pallas_triton"):
            out, vjp = jax.vjp(lambda x, w, op=op, impl=implementation: op(x, w, sizes, implementation=impl), lhs, rhs)
            outs[implementation] = (out, *vjp(dy))
        assert calls == mosaic_calls, calls
        for got, want in zip(outs["mosaic_gpu"], outs["pallas_triton"]):
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2,
                                       atol=1e-2 * float(jnp.max(jnp.abs(want.astype(jnp.float32)))))


def test_block_scaled_grouped_gemm(interpret, monkeypatch):
    """`grouped_gemm_block_fp8(implementation="mosaic_gpu")`: forward and ``d lhs`` on FP8 tensor cores
    with per-K-block promotion, equal to the reference (the same FP8 values dequantized, then a bf16
    grouped GEMM) up to bf16 rounding; the weight gradient is the dequantized one in both."""
    lhs, rhs, sizes = _grouped_operands(7, 264, 256, 256, [60, 0, 130, 40], jnp.bfloat16, False)
    dy = jax.random.normal(jax.random.key(8), (264, 256)).astype(jnp.bfloat16)
    calls = []
    original = mosaic_grouped.gmm
    monkeypatch.setattr(mosaic_grouped, "gmm", lambda *a, **kw: calls.append(kw["block_scales"] is not None)
                        or original(*a, **kw))
    results = {}
    for implementation in ("mosaic_gpu", "xla"):
        out, vjp = jax.vjp(lambda x, w, impl=implementation: ops.grouped_gemm_block_fp8(x, w, sizes,
                                                                                         implementation=impl), lhs, rhs)
        results[implementation] = (out, *vjp(dy))
    assert calls == [True, True], calls  # forward and d lhs
    for got, want in zip(results["mosaic_gpu"], results["xla"]):
        want = np.asarray(want, np.float32)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=1e-2 * np.abs(want).max())


def test_grouped_gemm_declines():
    e4m3, e5m2, bf16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16
    assert "one dtype" in mosaic_grouped.unsupported((128, 128), (2, 128, 128), e5m2, e4m3, True)
    assert "K-major" in mosaic_grouped.unsupported((128, 128), (2, 128, 128), e4m3, e4m3, False)
    assert "float32" in mosaic_grouped.unsupported((128, 128), (2, 128, 128), jnp.float32, jnp.float32, True)
    assert "M=300" in mosaic_grouped.unsupported((300, 128), (2, 128, 128), bf16, bf16, True)
    assert "empty" in mosaic_grouped.unsupported((0, 128), (2, 128, 128), bf16, bf16, True)
    assert "K=192" in mosaic_grouped.unsupported((128, 192), (2, 128, 192), e4m3, e4m3, True)
    assert "N=200" in mosaic_grouped.unsupported((128, 128), (2, 200, 128), bf16, bf16, True)
    assert mosaic_grouped.unsupported((128, 128), (2, 128, 128), bf16, bf16, False) is None
    with pytest.raises(ValueError, match="block_n"):
        mosaic_grouped.GroupedConfig(block_n=100)


@pytest.mark.parametrize("m, k, n, g, dtype, transpose_rhs", [
    (32768, 2048, 8192, 8, jnp.bfloat16, True), (98304, 2048, 1408, 64, jnp.bfloat16, False),
    (65536, 4096, 2048, 128, jnp.float8_e4m3fn, True)])
def test_grouped_gemm_lowers_for_cuda(m, k, n, g, dtype, transpose_rhs):
    shapes = [jax.ShapeDtypeStruct((m, k), dtype),
              jax.ShapeDtypeStruct((g, n, k) if transpose_rhs else (g, k, n), dtype),
              jax.ShapeDtypeStruct((g,), jnp.int32), jax.ShapeDtypeStruct((g,), jnp.float32)]
    with backend.abstract_gpu():
        text = jax.jit(lambda a, b, s, sc: mosaic_grouped.gmm(a, b, s, sc, transpose_rhs=transpose_rhs,
                                                              out_dtype=jnp.bfloat16)).trace(
            *shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_grouped_gemm_on_gpu(dtype):
    sizes = [3000, 0, 5000, 100, 8000]
    lhs, rhs, sizes = _grouped_operands(0, 16384, 2048, 1408, sizes, dtype, True)
    scale = jnp.linspace(0.5, 2.0, 5)
    got = mosaic_grouped.gmm(lhs, rhs, sizes, scale, transpose_rhs=True, out_dtype=jnp.float32)
    want = _grouped_reference(lhs, rhs, sizes, scale, True)
    if dtype == jnp.bfloat16:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                                   atol=1e-4 * float(jnp.max(jnp.abs(want))))
    else:
        assert_fp8_gemm_close(got, want, _grouped_reference(abs(lhs.astype(jnp.float32)),
                                                            abs(rhs.astype(jnp.float32)), sizes, scale, True))


# -------------------------------------------------------------------------------------------------- attention


def _attention_inputs(seed, batch, q_len, kv_len, heads, kv_heads, head_dim):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, q_len, heads, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (batch, kv_len, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (batch, kv_len, kv_heads, head_dim), jnp.float32)
    do = jax.random.normal(keys[3], (batch, q_len, heads, head_dim), jnp.float32)
    return tuple(x.astype(jnp.bfloat16) for x in (q, k, v, do))


def _out_and_grads(implementation, q, k, v, do, **options):
    def f(q, k, v):
        return ops.attention(q, k, v, implementation=implementation, **options)

    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(do))


# (batch, q_len, kv_len, heads, kv_heads, head_dim, options): full and causal, GQA, a window with a
# right side, q_len != kv_len (bottom-right alignment) and lengths off the 64/128-row tiles.
ATTENTION_CASES = {
    "full": (1, 128, 128, 1, 1, 64, {}),
    "causal-gqa-tails": (1, 136, 200, 2, 1, 64, {"mask_type": "causal"}),
    "window-both-sides": (1, 130, 200, 1, 1, 64, {"window_size": (50, 20)}),
    # the first queries see no key (bottom-right alignment); in dK/dV, key blocks no query sees
    "causal-more-queries": (1, 300, 130, 1, 1, 64, {"mask_type": "causal"}),
    "window-unseen-keys-d128": (1, 128, 512, 1, 1, 128, {"mask_type": "causal", "window_size": (16, 0)}),
    # batch and kv head > 0, so every term of dropout's row counter counts (one query block: the
    # cases above have the tails)
    "softcap-dropout-gqa": (2, 128, 128, 2, 1, 64, {"mask_type": "causal", "logits_soft_cap": 5.0, "dropout": 0.2}),
    # head_dim 256: fixed tiles, and dK/dV with the head dimension split between the warpgroups
    "d256-gqa-segments-dropout": (1, 80, 140, 2, 1, 256, {"mask_type": "causal", "segments": True, "dropout": 0.2}),
}


def _options(options, batch, q_len, kv_len):
    """The case's options, ``segments`` replaced by packed segment ids (three or four sorted segments
    per row, the last few positions padding: id 0) and ``dropout`` by a rate and a key."""
    options = dict(options)
    if "dropout" in options:  # the same mask in every implementation: a seed drawn from this key
        options.update(dropout_rate=options.pop("dropout"), dropout_rng=jax.random.key(3))
    if options.pop("segments", False):
        for name, length, seed in (("q_segment_ids", q_len, 1), ("kv_segment_ids", kv_len, 2)):
            ids = jnp.sort(jax.random.randint(jax.random.key(seed), (batch, length), 1, 5), axis=1)
            options[name] = jnp.where(jnp.arange(length) < length - 7, ids, 0).astype(jnp.int32)
    return options


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_matches_reference(interpret, case):
    """Forward and backward against the float32 reference on the same bf16 inputs: bf16 rounding of
    the probabilities and of the outputs, well under 2 % of each array's largest value."""
    *shape, options = ATTENTION_CASES[case]
    options = _options(options, *shape[:3])
    q, k, v, do = _attention_inputs(len(case), *shape)
    got = _out_and_grads("mosaic_gpu", q, k, v, do, **options)
    # The reference as one XLA program (op by op it took 1-3 s a case).
    reference = jax.jit(lambda *args: _out_and_grads("xla", *args, **options))
    want = reference(*(x.astype(jnp.float32) for x in (q, k, v, do)))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == jnp.bfloat16
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=0, atol=2e-2 * np.abs(w).max(), err_msg=name)


def test_attention_declines_what_it_lacks():
    impl = backend.get_implementation("attention", "mosaic_gpu")
    q = jax.ShapeDtypeStruct((1, 128, 2, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 128), jnp.int32)
    base = dict(mask_type="causal", scale=0.1, dropout_rate=0.0, window_size=None, logits_soft_cap=None)
    assert impl.unsupported(q, q, q, None, None, None, None, None, **base) is None
    # segment ids, dropout and soft-capping: taken
    seed = jax.ShapeDtypeStruct((), jnp.uint32)
    assert impl.unsupported(q, q, q, None, None, ids, ids, seed, **{**base, "dropout_rate": 0.1,
                                                                    "logits_soft_cap": 30.0}) is None
    for shape, dtype, reason in [((1, 128, 2, 96), jnp.bfloat16, "head_dim 96"),
                                 ((1, 128, 2, 128), jnp.float32, "float32")]:
        x = jax.ShapeDtypeStruct(shape, dtype)
        assert reason in impl.unsupported(x, x, x, None, None, None, None, None, **base)
    with pytest.raises(ValueError, match="block_kv"):
        mosaic_attention.AttentionConfig(block_kv=32)


@pytest.mark.parametrize("head_dim, config, segments", [
    (64, mosaic_attention.DEFAULT_CONFIG, False), (128, mosaic_attention.DEFAULT_CONFIG, False),
    (256, mosaic_attention.DEFAULT_CONFIG, True),
    (256, dataclasses.replace(mosaic_attention.DEFAULT_CONFIG, p_in_registers=False), True),
    *((128, config, True) for config in mosaic_attention.SWEEP_CONFIGS)], ids=str)
def test_attention_lowers_for_cuda(head_dim, config, segments):
    """Forward and both backward kernels for an H200 (Mosaic GPU's lowering checks the layouts and
    that the shared memory fits an SM): the default, and every config the benchmark sweeps (the
    probabilities through shared memory among them, as the interpret-mode tests run) at the largest
    footprint, head_dim 128 with segment ids (and soft-capping and dropout)."""
    launchers = mosaic_attention.launchers(config)
    extras = dict(logits_soft_cap=30.0, dropout_rate=0.1, dropout_seed=jnp.uint32(5)) if segments else {}
    q = jax.ShapeDtypeStruct((2, 4096, 32, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 4096, 8, head_dim), jnp.bfloat16)
    ids = (jax.ShapeDtypeStruct((2, 4096), jnp.int32),) * 2 if segments else ()

    def fwd_bwd(q, k, v, *ids):
        out, vjp = jax.vjp(lambda q, k, v: portable_attention.flash_attention(
            q, k, v, *ids, scale=0.1, causal=True, window_size=(1024, 0), ptx_exp2=False, launchers=launchers,
            **extras), q, k, v)
        return vjp(out)

    with backend.abstract_gpu():
        text = jax.jit(fwd_bwd).trace(q, k, k, *ids).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 3


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(ATTENTION_CASES) + ["causal-4k"])
def test_attention_on_gpu(case):
    """On the GPU against cuDNN where it applies (else the float32 reference), forward and backward."""
    *shape, options = ATTENTION_CASES.get(case, (2, 4096, 4096, 16, 4, 128, {"mask_type": "causal"}))
    options = _options(options, *shape[:3])
    q, k, v, do = _attention_inputs(len(case), *shape)
    got = _out_and_grads("mosaic_gpu", q, k, v, do, **options)
    want = _out_and_grads("xla", *(x.astype(jnp.float32) for x in (q, k, v, do)), **options)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=0, atol=2e-2 * np.abs(w).max(), err_msg=name)
