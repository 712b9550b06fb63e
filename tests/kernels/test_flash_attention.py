"""The Pallas Triton flash attention against the op's reference: interpret mode on the CPU, the cuda
lowering on an abstract H200, dispatch rules, and real sizes on a GPU (``gpu`` marker)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax._src.pallas.triton import lowering as triton_lowering

from mtjax import backend, ops
from mtjax.config import override
from mtjax.kernels import flash_attention as fa

# Interpret mode and the references run as XLA programs on the CPU: their compilation dominates, and
# XLA's optimizations (twice the compile time) matter for no assertion here unless a test says so.
pytestmark = pytest.mark.usefixtures("fast_compiles")


def _inputs(seed, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (batch, q_len, heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
    do = jax.random.normal(keys[3], (batch, q_len, heads, head_dim), jnp.float32).astype(dtype)
    return q, k, v, do


def _segments(seed, batch, length, num_segments=3):
    """Sorted ids in ``0..num_segments-1`` (packed sequences; 0 is padding)."""
    ids = jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, num_segments)
    return jnp.sort(ids, axis=1).astype(jnp.int32)


# Interpret-mode kernels are large CPU programs: the tests need them compiled, not optimised.
_CPU_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _out_and_grads(implementation, q, k, v, do, **options):
    def f(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: ops.attention(q, k, v, implementation=implementation, **options), q, k, v)
        return (out, *vjp(do))

    compile_options = _CPU_COMPILE_OPTIONS if jax.default_backend() == "cpu" else None
    return jax.jit(f).lower(q, k, v, do).compile(compile_options)(q, k, v, do)


def assert_matches_reference(q, k, v, do, rtol=1e-5, **options):
    """Forward and all three gradients of the kernel against the reference, relative to the largest entry."""
    got = _out_and_grads("pallas_triton", q, k, v, do, **options)
    want = _out_and_grads("xla", q, k, v, do, **options)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), name
        np.testing.assert_allclose(a, b, rtol=0, atol=rtol * max(1.0, np.abs(b).max()), err_msg=name)


# -------------------------------------------------------------------------------------------------- CPU, interpret


CASES = {
    # name: (batch, q_len, kv_len, heads, kv_heads, head_dim, options); lengths off the 16-row blocks
    "causal_mqa_q_shorter": (1, 20, 37, 4, 1, 16, {"mask_type": "causal"}),
    "causal_q_longer_fully_masked_rows": (1, 37, 20, 4, 2, 16, {"mask_type": "causal"}),
    "window_soft_cap": (1, 40, 40, 2, 2, 16, {"window_size": (5, 3), "logits_soft_cap": 2.0}),
    "causal_window_head_dim_64": (1, 24, 24, 2, 2, 64, {"mask_type": "causal", "window_size": (7, -1), "scale": 0.3}),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference(interpret, case):
    batch, q_len, kv_len, heads, kv_heads, head_dim, options = CASES[case]
    q, k, v, do = _inputs(len(case), batch, q_len, kv_len, heads, kv_heads, head_dim)
    assert_matches_reference(q, k, v, do, **options)


def test_segment_ids_gqa(interpret):
    q, k, v, do = _inputs(3, 2, 24, 40, 4, 2, 16)
    options = dict(q_segment_ids=_segments(1, 2, 24), kv_segment_ids=_segments(2, 2, 40), mask_type="padding_causal")
    assert_matches_reference(q, k, v, do, **options)


def test_fully_masked_rows_are_zero(interpret):
    q, k, v, do = _inputs(5, 1, 16, 16, 2, 2, 16)
    q_ids = jnp.concatenate([jnp.ones((1, 8), jnp.int32), jnp.full((1, 8), 2, jnp.int32)], axis=1)
    kv_ids = jnp.ones((1, 16), jnp.int32)  # no key of segment 2: its queries see nothing
    out, dq, dk, dv = _out_and_grads("pallas_triton", q, k, v, do, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                     mask_type="padding")
    assert np.all(np.asarray(out[:, 8:]) == 0) and np.all(np.asarray(dq[:, 8:]) == 0)
    assert np.isfinite(np.asarray(dk)).all() and np.abs(np.asarray(out[:, :8])).max() > 0


def test_dropout_matches_reference(interpret):
    """The kernels redraw the reference's counter-based mask tile by tile: same output, same gradients."""
    q, k, v, do = _inputs(9, 2, 24, 40, 4, 2, 16)
    assert_matches_reference(q, k, v, do, mask_type="causal", dropout_rate=0.3, dropout_rng=jax.random.key(1))


def test_bfloat16(interpret):
    q, k, v, do = _inputs(6, 1, 32, 48, 2, 1, 32, jnp.bfloat16)
    assert_matches_reference(q, k, v, do, rtol=2e-2, mask_type="causal")


# Tiles far smaller than the sequences, so every program loops over several masked and unmasked
# blocks (the clamp above leaves the tests' short sequences one tile long otherwise).
MULTI_BLOCK = fa.BlockSizes(block_q=32, block_k=16, dkdv_block_q=16, dkdv_block_k=32, dq_block_q=32, dq_block_k=16)
MULTI_BLOCK_CASES = {
    # name: (q_len, kv_len, heads, kv_heads, kernel options, segments)
    "causal_key_tail": (70, 70, 2, 2, {"causal": True}, False),
    "causal_q_shorter": (40, 90, 2, 1, {"causal": True}, False),
    "causal_q_longer": (90, 40, 2, 2, {"causal": True}, False),
    "window_both_edges": (80, 80, 2, 2, {"window_size": (20, 10)}, False),
    "segments_window_gqa": (64, 75, 4, 2, {"causal": True, "window_size": (24, -1)}, True),
    "no_mask_key_tail": (33, 75, 2, 2, {}, False),
}


@pytest.mark.parametrize("case", MULTI_BLOCK_CASES)
def test_multi_block_matches_reference(case):
    q_len, kv_len, heads, kv_heads, options, segments = MULTI_BLOCK_CASES[case]
    q, k, v, do = _inputs(len(case) + 11, 1, q_len, kv_len, heads, kv_heads, 16)
    ids = (_segments(4, 1, q_len), _segments(5, 1, kv_len)) if segments else (None, None)
    causal = options.get("causal", False)
    reference_mask = ("padding_causal" if causal else "padding") if segments else ("causal" if causal else "no_mask")

    def kernel(q, k, v):
        return fa.flash_attention(q, k, v, *ids, scale=0.25, block_sizes=MULTI_BLOCK, interpret=True, **options)

    def reference(q, k, v):
        return ops.attention(q, k, v, q_segment_ids=ids[0], kv_segment_ids=ids[1], scale=0.25,
                             mask_type=reference_mask, window_size=options.get("window_size"), implementation="xla")

    def out_and_grads(f):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(do))

    got = jax.jit(lambda: out_and_grads(kernel)).lower().compile(_CPU_COMPILE_OPTIONS)()
    want = out_and_grads(reference)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(1.0, np.abs(b).max()), err_msg=name)


@settings(max_examples=4)
@given(
    batch=st.integers(1, 2), q_len=st.integers(1, 40), kv_len=st.integers(1, 40), kv_heads=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2]), mask_type=st.sampled_from(["no_mask", "causal"]),
    window=st.sampled_from([None, (4, 0), (-1, 6), (3, 3)]), seed=st.integers(0, 2**16),
)
def test_hypothesis_small_shapes(interpret, batch, q_len, kv_len, kv_heads, groups, mask_type, window, seed):
    q, k, v, do = _inputs(seed, batch, q_len, kv_len, kv_heads * groups, kv_heads, 16)
    assert_matches_reference(q, k, v, do, mask_type=mask_type, window_size=window)


# -------------------------------------------------------------------------------------------------- cuda lowering


@pytest.mark.parametrize("head_dim,kv_heads,options", [
    (64, 2, {"causal": True, "segments": True}),  # ptx_exp2=None: PTX, since the lowering is for cuda
    (128, 8, {"dropout_rate": 0.1, "dropout_seed": jnp.uint32(7), "ptx_exp2": False}),
    (256, 1, {"window_size": (64, 16), "logits_soft_cap": 30.0, "ptx_exp2": True}),
])
def test_lowers_for_cuda(head_dim, kv_heads, options, monkeypatch):
    """The Triton lowering of all three kernels (forward, dk/dv, dq) for an H200, on the CPU, with the
    Triton modules run through the MLIR verifier (which XLA otherwise runs first on the GPU)."""
    lower_module = triton_lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower_module(*args, **kwargs)
        result.module.operation.verify()
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    options = dict(options)
    batch, q_len, kv_len, heads = 2, 300, 520, 8
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim), jnp.bfloat16)
    segments = options.pop("segments", False)
    ids = (jax.ShapeDtypeStruct((batch, q_len), jnp.int32), jax.ShapeDtypeStruct((batch, kv_len), jnp.int32))

    def f(q, k, v, q_ids, kv_ids):
        ids = (q_ids, kv_ids) if segments else (None, None)
        out, vjp = jax.vjp(lambda q, k, v: fa.flash_attention(q, k, v, *ids, scale=0.1, **options), q, k, v)
        return out, vjp(out)

    with backend.abstract_gpu():
        text = jax.jit(f).trace(q, k, k, *ids).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("mtjax_flash_attention_fwd", "mtjax_flash_attention_dkdv", "mtjax_flash_attention_dq"):
        assert name in text
    assert ("ex2.approx.ftz.f32" in text) == options.get("ptx_exp2", True)


# -------------------------------------------------------------------------------------------------- dispatch


def _abstract(q_len=128, kv_len=128, head_dim=128, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((2, q_len, 8, head_dim), dtype), jax.ShapeDtypeStruct((2, kv_len, 2, head_dim), dtype),
            jax.ShapeDtypeStruct((2, kv_len, 2, head_dim), dtype), None, None, None, None, None)


def _static(**changes):
    static = dict(mask_type="causal", scale=0.1, dropout_rate=0.0, window_size=None, logits_soft_cap=None)
    return {**static, **changes}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="assumes no local GPU (the cuda device comes from config)")
def test_selection_on_cuda():
    def chosen(args, **changes):
        return backend.select("attention", platform_name="cuda", args=args, static=_static(**changes))[0].name

    assert chosen(_abstract()) == "cudnn"
    # What cuDNN cannot do (as mtjax defines it) goes to the kernel.
    assert chosen(_abstract(q_len=64)) == "pallas_triton"  # causal, q_len != kv_len
    assert chosen(_abstract(q_len=197, kv_len=197), mask_type="no_mask") == "pallas_triton"  # ViT: odd lengths
    assert chosen(_abstract(), logits_soft_cap=5.0) == "pallas_triton"
    assert chosen(_abstract(), window_size=(16, 0)) == "pallas_triton"
    assert chosen(_abstract(dtype=jnp.float32)) == "pallas_triton"
    assert chosen(_abstract(head_dim=48)) == "cudnn"
    assert chosen(_abstract(head_dim=48, dtype=jnp.float32)) == "xla"
    assert chosen(_abstract(head_dim=256)) == "cudnn"
    with override(cuda_compute_capability="8.0"):  # cuDNN takes head_dim <= 128 before Hopper
        assert chosen(_abstract(head_dim=256)) == "pallas_triton"
    assert chosen(_abstract(), dropout_rate=0.1) == "pallas_triton"
    # A bias shared by the batch (T5's relative position biases) goes to cuDNN; others to the reference.
    q, k, v, _, *rest = _abstract()

    def with_bias(*shape):
        return (q, k, v, jax.ShapeDtypeStruct(shape, jnp.float32), *rest)

    for shape in ((1, 8, 128, 128), (8, 128, 128), (1, 1, 128, 128), (128, 128)):
        assert chosen(with_bias(*shape)) == "cudnn", shape
    for shape in ((2, 8, 128, 128), (1, 8, 1, 128)):
        assert chosen(with_bias(*shape)) == "xla", shape


def test_plugin_platform_with_triton_gets_the_kernel(monkeypatch):
    monkeypatch.setattr(backend, "_registered_platforms", dict(backend._registered_platforms))
    monkeypatch.setattr(backend, "_lower_pallas_triton_on", lambda name: None)
    backend.register_platform("fakegpu", capabilities=(backend.PALLAS_TRITON,))
    impl, _ = backend.select("attention", platform_name="fakegpu", args=_abstract(), static=_static())
    assert impl.name == "pallas_triton"


def test_rejects_unsupported_explicit_choice():
    q = jnp.ones((1, 8, 2, 48))
    with override(pallas_interpret=True), pytest.raises(ValueError, match="head_dim 48"):
        ops.attention(q, q, q, implementation="pallas_triton")


def test_declines_int32_overflowing_arrays():
    huge = (64, 8192, 32, 128)  # 2**31 elements
    assert "int32" in fa.unsupported(huge, huge, jnp.bfloat16)
    assert fa.unsupported((64, 8192, 32, 64), (64, 8192, 32, 64), jnp.bfloat16) is None


def test_kernel_argument_errors():
    q = jnp.ones((1, 8, 2, 16))
    with pytest.raises(ValueError, match="head_dim"):
        fa.flash_attention(jnp.ones((1, 8, 2, 24)), jnp.ones((1, 8, 2, 24)), jnp.ones((1, 8, 2, 24)), scale=1.0)
    with pytest.raises(TypeError, match="share a dtype"):
        fa.flash_attention(q, q.astype(jnp.bfloat16), q, scale=1.0)
    with pytest.raises(ValueError, match="together"):
        fa.flash_attention(q, q, q, jnp.ones((1, 8), jnp.int32), None, scale=1.0)
    with pytest.raises(ValueError, match="ptx_exp2"):
        fa.flash_attention(q, q, q, scale=1.0, interpret=True, ptx_exp2=True)


# -------------------------------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,options", [
    (64, {"mask_type": "causal"}),
    (128, {"mask_type": "no_mask"}),
    (128, {"mask_type": "padding_causal", "segments": True, "window_size": (200, 0), "logits_soft_cap": 20.0}),
    (128, {"mask_type": "causal", "dropout_rate": 0.2, "dropout_rng": jax.random.key(2)}),
    (128, {"mask_type": "no_mask", "lengths": (300, 9000)}),  # a long row with a masked key tail
    (256, {"mask_type": "causal"}),
])
def test_gpu_real_sizes(head_dim, options):
    options = dict(options)
    batch, heads, kv_heads = 2, 8, 2
    q_len, kv_len = options.pop("lengths", (1000, 1000))
    q, k, v, do = _inputs(7, batch, q_len, kv_len, heads, kv_heads, head_dim, jnp.bfloat16)
    if options.pop("segments", False):
        ids = _segments(8, batch, q_len, 4)
        options.update(q_segment_ids=ids, kv_segment_ids=ids)
    assert_matches_reference(q, k, v, do, rtol=2e-2, **options)
    if options.get("mask_type") in ("causal", "no_mask") and "dropout_rate" not in options:
        got = _out_and_grads("cudnn", q, k, v, do, **options)
        want = _out_and_grads("xla", q, k, v, do, **options)
        for a, b in zip(got, want):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-2 * max(1.0, np.abs(b).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type,bias_shape", [("no_mask", (1, 8, 512, 512)), ("causal", (8, 512, 512)),
                                                  ("causal", (1, 1, 512, 512))])
def test_gpu_cudnn_with_a_shared_bias(mask_type, bias_shape):
    """T5's case: a bias shared by the batch, its gradient too, against the reference."""
    q, k, v, do = _inputs(9, 2, 512, 512, 8, 2, 64, jnp.bfloat16)
    bias = jnp.asarray(np.random.default_rng(3).normal(size=bias_shape), jnp.float32)

    def out_and_grads(implementation):
        def f(q, k, v, bias):
            out, vjp = jax.vjp(lambda *a: ops.attention(*a[:3], bias=a[3], mask_type=mask_type, scale=0.125,
                                                        implementation=implementation), q, k, v, bias)
            return (out, *vjp(do))
        return jax.jit(f)(q, k, v, bias)

    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), out_and_grads("cudnn"), out_and_grads("xla")):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-2 * max(1.0, np.abs(b).max()), err_msg=name)
