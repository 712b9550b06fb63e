"""The native Triton kernels (`mtjax.kernels.triton`, implementation ``"triton"``) against the references.

- CPU, interpret mode: Triton's interpreter runs each kernel on host arrays (`runtime.launch`), forward
  and backward, at small odd shapes.
- CPU, compile: every launch of each op, recorded at real sizes, compiled for an H200 (sm_90) with
  ``triton.compile`` (ptxas included); its shared memory must fit an SM. With jax-triton importable,
  `jax.export` for ``cuda`` carries the kernels as custom calls.
- GPU (``gpu`` marker, ``JAX_PLATFORMS=cuda``): the compiled kernels at real sizes.

Skipped where the ``triton`` package is missing (it comes with the ``gpu`` extra).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import backend, ops
from mtjax.kernels.activation import ACTIVATIONS

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402 (needs triton)

from mtjax.kernels.triton import runtime  # noqa: E402

# Interpret mode and the references run as XLA programs on the CPU: their compilation dominates, and
# XLA's optimizations (twice the compile time) matter for no assertion here unless a test says so.
pytestmark = pytest.mark.usefixtures("fast_compiles")

# The most shared memory one program may use on an H100/H200 (227 KiB, the opt-in maximum).
HOPPER_SHARED_MEMORY = 232448


def _tree_allclose(got, want, rtol, names):
    for name, a, b in zip(names, got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), f"{name}: not finite (an element the kernel did not write?)"
        np.testing.assert_allclose(a, b, rtol=0, atol=rtol * max(1.0, np.abs(b).max()), err_msg=name)


def _inputs(seed, *shapes, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def _compile_all(fn, *args, capability=90):
    """Record the kernel launches of ``fn(*args)`` (abstract arrays) and compile each for ``capability``;
    returns ``{launch name: shared memory bytes}``."""
    with runtime.record_launches() as launches:
        jax.eval_shape(fn, *args)
    assert launches, "no Triton kernel was launched"
    return {r.name: runtime.compile_launch(r, capability).metadata.shared for r in launches}


# -------------------------------------------------------------------------------------------------- attention


def _attention_out_and_grads(implementation, q, k, v, do, **options):
    def f(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: ops.attention(q, k, v, implementation=implementation, **options), q, k, v)
        return (out, *vjp(do))

    return jax.jit(f)(q, k, v, do)


def _segments(seed, batch, length, num_segments=3):
    ids = jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, num_segments)
    return jnp.sort(ids, axis=1).astype(jnp.int32)


ATTENTION_CASES = {
    # name: (batch, q_len, kv_len, heads, kv_heads, head_dim, options); lengths off the 16-row blocks
    "causal_gqa_q_shorter": (1, 20, 37, 4, 2, 16, {"mask_type": "causal"}),
    "window_soft_cap": (1, 40, 40, 2, 2, 16, {"window_size": (5, 3), "logits_soft_cap": 2.0}),
    "segments_dropout": (1, 24, 40, 2, 1, 16, {"mask_type": "padding_causal", "dropout_rate": 0.3,
                                                "dropout_rng": jax.random.key(1)}),
}


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_matches_reference(interpret, case):
    batch, q_len, kv_len, heads, kv_heads, head_dim, options = ATTENTION_CASES[case]
    q, k, v, do = _inputs(len(case), (batch, q_len, heads, head_dim), (batch, kv_len, kv_heads, head_dim),
                          (batch, kv_len, kv_heads, head_dim), (batch, q_len, heads, head_dim))
    if options.get("mask_type") == "padding_causal":
        options = dict(options, q_segment_ids=_segments(1, batch, q_len), kv_segment_ids=_segments(2, batch, kv_len))
    got = _attention_out_and_grads("triton", q, k, v, do, **options)
    want = _attention_out_and_grads("xla", q, k, v, do, **options)
    _tree_allclose(got, want, 1e-5, ("out", "dq", "dk", "dv"))


def test_attention_multi_block_bfloat16(interpret):
    """Tiles far smaller than the sequences: every program loops over masked and unmasked blocks."""
    from mtjax.kernels import flash_attention as fa
    from mtjax.kernels.triton import flash_attention as native

    q, k, v, do = _inputs(3, (1, 40, 2, 32), (1, 56, 1, 32), (1, 56, 1, 32), (1, 40, 2, 32), dtype=jnp.bfloat16)
    blocks = fa.BlockSizes(block_q=32, block_k=16, dkdv_block_q=16, dkdv_block_k=32, dq_block_q=32, dq_block_k=16)

    def out_and_grads(f):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(do))

    got = out_and_grads(lambda q, k, v: native.flash_attention(q, k, v, scale=0.25, causal=True,
                                                                window_size=(20, -1), block_sizes=blocks))
    want = out_and_grads(lambda q, k, v: ops.attention(q, k, v, scale=0.25, mask_type="causal", window_size=(20, -1),
                                                       implementation="xla"))
    _tree_allclose(got, want, 2e-2, ("out", "dq", "dk", "dv"))


def test_attention_with_lse_matches_reference(interpret):
    """The forward and backward kernels alone (ring attention's per-block calls)."""
    q, k, v, do = _inputs(4, (1, 20, 2, 16), (1, 30, 1, 16), (1, 30, 1, 16), (1, 20, 2, 16))
    got = ops.attention_with_lse(q, k, v, causal=True, scale=0.3, implementation="triton")
    want = ops.attention_with_lse(q, k, v, causal=True, scale=0.3, implementation="xla")
    _tree_allclose(got, want, 1e-5, ("out", "lse"))
    out, lse = want
    got = ops.attention_with_lse_backward(q, k, v, None, None, out, lse, do, causal=True, scale=0.3,
                                          implementation="triton")
    want = ops.attention_with_lse_backward(q, k, v, None, None, out, lse, do, causal=True, scale=0.3,
                                           implementation="xla")
    _tree_allclose(got, want, 1e-5, ("dq", "dk", "dv"))


@pytest.mark.parametrize("head_dim", [128, 256])
def test_attention_compiles_for_hopper(head_dim):
    """The three kernels at the default tiles, with every mask feature on, compile for sm_90 and fit
    in an SM's shared memory."""
    from mtjax.kernels.triton import flash_attention as native

    q = jax.ShapeDtypeStruct((2, 300, 8, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 520, 2, head_dim), jnp.bfloat16)
    ids = (jax.ShapeDtypeStruct((2, 300), jnp.int32), jax.ShapeDtypeStruct((2, 520), jnp.int32))

    def f(q, k, v, q_ids, kv_ids):
        out, vjp = jax.vjp(lambda q, k, v: native.flash_attention(
            q, k, v, q_ids, kv_ids, scale=0.1, causal=True, window_size=(128, -1), logits_soft_cap=30.0,
            dropout_rate=0.1, dropout_seed=jnp.uint32(7)), q, k, v)
        return out, vjp(out)

    shared = _compile_all(f, q, k, k, *ids)
    assert set(shared) == {f"mtjax_triton_flash_attention_{k}" for k in ("fwd", "dkdv", "dq")}
    assert max(shared.values()) <= HOPPER_SHARED_MEMORY, shared


TMA_CASES = {
    # name: (q_len, kv_len, kv_heads, options): lengths off the 128-row tiles, head_dim 128
    "causal_gqa_q_shorter": (200, 330, 1, {"mask_type": "causal"}),
    "causal_q_longer": (300, 250, 2, {"mask_type": "causal"}),  # the first rows see no key
    "window": (256, 256, 2, {"window_size": (100, 20)}),
    "full_kv_tail": (130, 70, 2, {}),
    # several key blocks a row block: row limits at k0 > 0, a left-only window with a key tail
    "causal_long": (512, 512, 1, {"mask_type": "causal"}),
    "window_left_kv_tail": (256, 330, 2, {"window_size": (100, -1)}),
}


@pytest.mark.parametrize("case", TMA_CASES)
def test_attention_tma_forward_matches_reference(interpret, monkeypatch, case):
    """The warp-specialized TMA forward (16-bit inputs without segments, soft-cap or dropout): output
    and gradients (the backward kernels reading its log-sum-exp) against the reference, the
    log-sum-exp against `_fwd_kernel`'s."""
    from mtjax.kernels.triton import flash_attention as native

    q_len, kv_len, kv_heads, options = TMA_CASES[case]
    q, k, v, do = _inputs(7, (2, q_len, 2, 128), (2, kv_len, kv_heads, 128), (2, kv_len, kv_heads, 128),
                          (2, q_len, 2, 128), dtype=jnp.bfloat16)
    with runtime.record_launches() as launches:
        got = _attention_out_and_grads("triton", q, k, v, do, scale=0.2, **options)
    assert "mtjax_triton_flash_attention_fwd_tma" in {r.name for r in launches}
    want = _attention_out_and_grads("xla", q, k, v, do, scale=0.2, **options)
    _tree_allclose(got, want, 2e-2, ("out", "dq", "dk", "dv"))
    if "window_size" not in options:  # flash_attention_forward takes no window
        causal = options.get("mask_type") == "causal"
        _, lse = native.flash_attention_forward(q, k, v, scale=0.2, causal=causal)
        monkeypatch.setattr(native, "TMA_FORWARD_TILES", {})
        _, want_lse = native.flash_attention_forward(q, k, v, scale=0.2, causal=causal)
        # Rows that see no key have an infinite log-sum-exp in both.
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("case", ["causal_long", "window_left_kv_tail", "full_kv_tail"])
def test_attention_tma_forward_row_limits_are_the_keep_mask(interpret, monkeypatch, case):
    """The TMA forward's per-row column limits (`TMA_ROW_LIMITS`) and `_keep` give the same output, to
    the bit."""
    from mtjax.kernels.triton import flash_attention as native

    q_len, kv_len, kv_heads, options = TMA_CASES[case]
    q, k, v = _inputs(8, (1, q_len, 2, 128), (1, kv_len, kv_heads, 128), (1, kv_len, kv_heads, 128),
                      dtype=jnp.bfloat16)
    outs = []
    for row_limits in (True, False):
        monkeypatch.setattr(native, "TMA_ROW_LIMITS", row_limits)
        with runtime.record_launches() as launches:
            outs.append(jax.jit(lambda q, k, v: ops.attention(q, k, v, scale=0.2, implementation="triton",
                                                              **options))(q, k, v))
        assert "mtjax_triton_flash_attention_fwd_tma" in {r.name for r in launches}
    np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))


def test_attention_explicit_tiles_keep_the_forward_kernel():
    """``block_sizes=`` given: the forward runs `_fwd_kernel` on those tiles, not the TMA forward."""
    from mtjax.kernels import flash_attention as fa
    from mtjax.kernels.triton import flash_attention as native

    q = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
    for blocks, name in ((None, "mtjax_triton_flash_attention_fwd_tma"),
                         (fa.BlockSizes(block_q=64, block_k=64), "mtjax_triton_flash_attention_fwd")):
        with runtime.record_launches() as launches:
            jax.eval_shape(lambda q, k, v: native.flash_attention(q, k, v, scale=0.1, block_sizes=blocks), q, q, q)
        assert [r.name for r in launches] == [name]


def test_attention_tma_forward_is_warp_specialized_on_hopper():
    """Compiled for sm_90, the TMA forward splits into producer and consumer partitions (more warps
    than launched with), builds its descriptors in global scratch and fits an SM."""
    from mtjax.kernels.triton import flash_attention as native

    q = jax.ShapeDtypeStruct((2, 4096, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 4096, 2, 128), jnp.bfloat16)
    with runtime.record_launches() as launches:
        jax.eval_shape(lambda q, k, v: native.flash_attention(q, k, v, scale=0.1, causal=True), q, k, k)
    [record] = launches
    assert record.name == "mtjax_triton_flash_attention_fwd_tma"
    compiled = runtime.compile_launch(record, 90)
    assert compiled.metadata.num_warps > record.num_warps
    assert compiled.metadata.global_scratch_size > 0
    assert compiled.metadata.shared <= HOPPER_SHARED_MEMORY
    assert "setmaxnreg" in compiled.asm["ptx"] and "cp.async.bulk.tensor" in compiled.asm["ptx"]


def test_export_for_cuda_carries_the_triton_kernels():
    """`jax.export` for cuda on this CPU-only host: jax-triton compiles the kernels for
    ``config.cuda_compute_capability`` while lowering and embeds them as custom calls."""
    if backend.native_triton_problem() is not None:
        pytest.skip(backend.native_triton_problem())
    from mtjax.kernels.triton import flash_attention as native

    q = jax.ShapeDtypeStruct((1, 128, 4, 64), jnp.bfloat16)

    def f(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: native.flash_attention(q, k, v, scale=0.125, causal=True), q, k, v)
        return out, vjp(out)

    checks = [jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call"),
              jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call_ffi")]
    exported = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(q, q, q)
    assert exported.mlir_module().count("stablehlo.custom_call @triton_kernel_call") == 3


# -------------------------------------------------------------------------------------------------- norms


def _vjp_outputs(f, primals, cotangent):
    out, vjp = jax.vjp(f, *primals)
    return (*jax.tree.leaves(out), *jax.tree.leaves(vjp(cotangent)))


NORM_CASES = {
    # name: (shape, dtype, op, options)
    "layernorm_masked_tail": ((6, 100), jnp.float32, "layernorm", {}),
    "rmsnorm_zero_centered_bf16": ((8, 64), jnp.bfloat16, "rmsnorm", {"zero_centered_gamma": True}),
}


@pytest.mark.parametrize("case", NORM_CASES)
def test_norm_matches_reference(interpret, case):
    shape, dtype, op, options = NORM_CASES[case]
    x, dy = _inputs(1, shape, shape, dtype=dtype)
    gamma, beta = _inputs(2, shape[-1:], shape[-1:])

    def norm(implementation):
        if op == "layernorm":
            return lambda x, g, b: ops.layernorm(x, g, b, implementation=implementation, **options)
        return lambda x, g, b: ops.rmsnorm(x, g, implementation=implementation, **options)

    rtol = 1e-5 if dtype == jnp.float32 else 1e-2
    _tree_allclose(_vjp_outputs(norm("triton"), (x, gamma, beta), dy),
                   _vjp_outputs(norm("xla"), (x, gamma, beta), dy), rtol, ("y", "dx", "dgamma", "dbeta"))


def test_residual_norm_with_dropout_matches_reference(interpret):
    x, residual, dy, d_residual = _inputs(3, (6, 100), (6, 100), (6, 100), (6, 100))
    gamma, beta = _inputs(4, (100,), (100,))

    def residual_norm(implementation):
        return lambda x, r, g, b: ops.residual_norm(x, r, g, b, dropout_rate=0.25, dropout_rng=jax.random.key(2),
                                                    implementation=implementation)

    primals = (x, residual, gamma, beta)
    _tree_allclose(_vjp_outputs(residual_norm("triton"), primals, (dy, d_residual)),
                   _vjp_outputs(residual_norm("xla"), primals, (dy, d_residual)), 1e-5,
                   ("normalized", "new_residual", "dx", "dresidual", "dgamma", "dbeta"))


@pytest.mark.parametrize("layernorm_type,out_dtype", [("layernorm", jnp.float8_e4m3fn), ("rmsnorm", jnp.float8_e5m2)])
def test_norm_fp8_matches_reference(interpret, layernorm_type, out_dtype):
    x, = _inputs(5, (8, 100), dtype=jnp.bfloat16)
    gamma, beta = _inputs(6, (100,), (100,))
    beta = beta if layernorm_type == "layernorm" else None
    scale = jnp.float32(float(jnp.finfo(out_dtype).max) * 4)  # large enough that some values saturate
    q, amax = ops.norm_fp8(x, gamma, beta, scale, layernorm_type=layernorm_type, out_dtype=out_dtype,
                           implementation="triton")
    q_ref, amax_ref = ops.norm_fp8(x, gamma, beta, scale, layernorm_type=layernorm_type, out_dtype=out_dtype,
                                   implementation="xla")
    np.testing.assert_allclose(amax, amax_ref, rtol=1e-6)
    q, q_ref = np.asarray(q, np.float32), np.asarray(q_ref, np.float32)
    assert np.all(np.isfinite(q)) and np.max(np.abs(q)) == float(jnp.finfo(out_dtype).max)
    assert np.mean(q == q_ref) > 0.99  # a float32 rounding apart can flip an FP8 rounding


def test_norm_kernels_walk_several_row_blocks_per_program(interpret):
    """2 persistent programs over 5 row blocks (the prefetch past the last block clamped) give what
    one block per program gives; every input (beta, residual, dropout, FP8 output) on."""
    from mtjax.kernels.triton import layer_norm as native

    x, residual, dy = _inputs(7, (9, 100), (9, 100), (9, 100))
    gamma, beta = _inputs(8, (100,), (100,))
    flags = dict(rms=False, epsilon=1e-6, zero_centered_gamma=False)

    def both(programs):
        fwd = native.forward(x, gamma, beta, residual, jnp.uint32(7), jnp.float32(10.0), dropout_rate=0.25,
                             out_dtype=jnp.float8_e4m3fn, tile=(2, 4), programs=programs, **flags)
        bwd = native.backward(x, gamma, dy, residual, jnp.uint32(7), has_beta=True, dropout_rate=0.25, tile=(2, 4),
                              programs=programs, **flags)
        return fwd + bwd

    _tree_allclose(both(2), both(None), 1e-6, ("y", "new_residual", "amax", "dh", "dx", "dgamma", "dbeta"))


def test_norms_compile_for_hopper():
    """Forward and backward of LayerNorm with residual, dropout and FP8 output, at the main shape of
    the norm benchmark and at hidden 12288 (no prefetch), compile for sm_90."""
    from mtjax.kernels.triton import layer_norm as native

    def f(x, r, g, b):
        y, new_residual, amax = native.forward(x, g, b, r, jnp.uint32(1), jnp.float32(2.0), rms=False, epsilon=1e-6,
                                               zero_centered_gamma=False, dropout_rate=0.1,
                                               out_dtype=jnp.float8_e4m3fn)
        return y, native.backward(new_residual, g, x, r, jnp.uint32(1), rms=False, epsilon=1e-6,
                                  zero_centered_gamma=False, has_beta=True, dropout_rate=0.1, dx_dtype=jnp.bfloat16)

    for hidden in (8192, 12288):
        x = jax.ShapeDtypeStruct((16384, hidden), jnp.bfloat16)
        r = jax.ShapeDtypeStruct((16384, hidden), jnp.float32)
        g = jax.ShapeDtypeStruct((hidden,), jnp.float32)
        shared = _compile_all(f, x, r, g, g)
        assert set(shared) == {"mtjax_triton_layer_norm_fwd", "mtjax_triton_layer_norm_bwd"}
        assert max(shared.values()) <= HOPPER_SHARED_MEMORY, shared


# -------------------------------------------------------------------------------------------------- activations


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_activation_matches_reference(interpret, activation):
    gated = ACTIVATIONS[activation][1] is not None
    shape = (6, 2, 100) if gated else (6, 100)
    x, dy = _inputs(9, shape, (6, 100))
    bias, = _inputs(10, shape[1:])
    x = 3.0 * x  # both tails of the activations

    def act(implementation):
        return lambda x, b: ops.activation(x, activation, b, implementation=implementation)

    _tree_allclose(_vjp_outputs(act("triton"), (x, bias), dy), _vjp_outputs(act("xla"), (x, bias), dy), 1e-5,
                   ("y", "dx", "dbias"))


@pytest.mark.parametrize("activation,out_dtype", [("gelu", jnp.float8_e4m3fn), ("swiglu", jnp.float8_e5m2)])
def test_activation_fp8_and_grad_fp8_match_reference(interpret, activation, out_dtype):
    gated = activation == "swiglu"
    shape = (70, 2, 100) if gated else (70, 100)
    x, dy = _inputs(11, shape, (70, 100), dtype=jnp.bfloat16)
    bias, = _inputs(12, shape[1:])
    scale = jnp.float32(float(jnp.finfo(out_dtype).max) / 4)
    for op, names in ((ops.activation_fp8, ("y", "amax")), (ops.activation_grad_fp8, ("dx", "dx_t", "amax", "dbias"))):
        args = (x, activation, bias) if op is ops.activation_fp8 else (x, dy, activation, bias)
        got = op(*args, scale=scale, out_dtype=out_dtype, implementation="triton")
        want = op(*args, scale=scale, out_dtype=out_dtype, implementation="xla")
        for name, a, b in zip(names, got, want):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert a.shape == b.shape and np.isfinite(a).all(), name
            if name in ("y", "dx", "dx_t"):  # FP8: a float32 rounding apart can flip a rounding
                assert np.mean(a == b) > 0.99, name
            else:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(), err_msg=name)


# -------------------------------------------------------------------------------------------------- softmax, casts


@pytest.mark.parametrize("masked,causal", [(False, True), (True, True)])
def test_softmax_matches_reference(interpret, masked, causal):
    x, dy = _inputs(13, (2, 3, 5, 37), (2, 3, 5, 37))
    mask = jax.random.bernoulli(jax.random.key(4), 0.7, (2, 1, 1, 37)) if masked else None

    def softmax(implementation):
        return lambda x: ops.softmax(x, mask, scale=0.3, causal=causal, implementation=implementation)

    _tree_allclose(_vjp_outputs(softmax("triton"), (x,), dy), _vjp_outputs(softmax("xla"), (x,), dy), 1e-5,
                   ("y", "dx"))


@pytest.mark.parametrize("out_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_cast_transpose_is_bit_identical(interpret, out_dtype):
    x, = _inputs(14, (70, 130), dtype=jnp.bfloat16)
    x = x * 50.0  # saturates at the scale below
    got = ops.cast_transpose(x, jnp.float32(20.0), out_dtype, implementation="triton")
    want = ops.cast_transpose(x, jnp.float32(20.0), out_dtype, implementation="xla")
    for name, a, b in zip(("q", "q_t", "amax"), got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


def test_row_kernels_compile_for_hopper():
    """Activations (forward with FP8 output, backward, FP8 backward), softmax and cast+transpose at
    the benchmark's shapes compile for sm_90."""
    from mtjax.kernels.triton import activation, quantize, softmax

    x = jax.ShapeDtypeStruct((16384, 2, 8192), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((16384, 8192), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((2, 8192), jnp.bfloat16)
    logits = jax.ShapeDtypeStruct((4, 16, 2048, 2048), jnp.bfloat16)

    def f(x, y, bias, logits):
        scale = jnp.float32(2.0)
        fwd = activation.activation_fp8(x, bias, scale, activation="swiglu", out_dtype=jnp.float8_e4m3fn)
        grads = jax.vjp(lambda x, bias: activation.activation(x, bias, activation="clamped_swiglu"), x, bias)[1](y)
        grad_fp8 = activation.activation_grad_fp8(x, bias, y, scale, activation="swiglu", out_dtype=jnp.float8_e5m2)
        probs, vjp = jax.vjp(lambda z: softmax.softmax(z, None, scale=0.1, causal=True), logits)
        return fwd, grads, grad_fp8, vjp(probs), quantize.cast_transpose(y, scale, jnp.float8_e4m3fn)

    shared = _compile_all(f, x, y, bias, logits)
    assert len(shared) == 7, shared
    assert max(shared.values()) <= HOPPER_SHARED_MEMORY, shared


# -------------------------------------------------------------------------------------------------- grouped GEMM


def _grouped_case(group_sizes, seed, transpose_rhs=False):
    from tests.ops.test_grouped_gemm import random_case

    return random_case(seed, 70, 40, 24, group_sizes, transpose_rhs=transpose_rhs)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_grouped_gemm_forward_and_gradients(interpret, transpose_rhs):
    """gmm (forward, d lhs) and tgmm (d rhs) on 16-row tiles: boundaries inside tiles, an empty group,
    rows past the groups, K and N tails; float32 against float64 numpy."""
    from mtjax.kernels import grouped_gemm as gg
    from tests.ops.test_grouped_gemm import assert_close, np_gmm, np_grads, value_and_grads

    tiles = gg.GemmTiles(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1, group_m=2)
    lhs, rhs, gs, dy = _grouped_case([7, 0, 20, 3, 30], 1, transpose_rhs)
    out, d_lhs, d_rhs = value_and_grads(
        lambda a, b: ops.grouped_gemm(a, b, jnp.asarray(gs), transpose_rhs=transpose_rhs,
                                      block_sizes=gg.BlockSizes(forward=tiles, dlhs=tiles, wgrad=tiles),
                                      implementation="triton"), lhs, rhs, dy)
    assert_close(out, np_gmm(lhs, rhs, gs, transpose_rhs))
    assert np.all(np.asarray(out)[60:] == 0)
    exp_lhs, exp_rhs = np_grads(lhs, rhs, gs, dy, transpose_rhs)
    assert_close(d_lhs, exp_lhs)
    assert_close(d_rhs, exp_rhs)


def test_grouped_gemm_persistent_and_scaled(interpret):
    from mtjax.kernels import grouped_gemm as gg
    from mtjax.kernels.triton import grouped_gemm as native
    from tests.ops.test_grouped_gemm import assert_close, np_gmm, np_tgmm

    lhs, rhs, gs, dy = _grouped_case([16, 16, 0, 16, 22], 2)
    scale = np.array([0.5, 3.0, -2.0, 0.25, 1e-3], np.float32)
    row_scale = np.concatenate([np.repeat(scale, gs), np.ones(70 - gs.sum())])[:, None]
    tiles = gg.GemmTiles(block_m=16, block_n=16, block_k=16, group_m=2, num_programs=3)
    out = native.gmm(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(gs), jnp.asarray(scale), tiles=tiles)
    assert_close(out, np_gmm(lhs, rhs, gs) * row_scale)
    out = native.tgmm(jnp.asarray(lhs), jnp.asarray(dy), jnp.asarray(gs), jnp.asarray(scale), tiles=tiles)
    assert_close(out, np_tgmm(lhs, dy, gs) * scale[:, None, None])


def test_grouped_gemm_fp8_matches_reference(interpret):
    """E4M3 operands, E5M2 output gradient (its d lhs GEMM mixes the formats: bfloat16 in the kernel)."""
    from mtjax.kernels import grouped_gemm as gg
    from tests.ops.test_grouped_gemm import assert_close, value_and_grads

    tiles = gg.GemmTiles(block_m=32, block_n=16, block_k=32, num_warps=1, num_stages=1, group_m=2)
    lhs, rhs, gs, dy = _grouped_case([7, 0, 20, 3, 30], 3)

    def run(implementation):
        return value_and_grads(lambda a, b: ops.grouped_gemm_fp8(
            a, b, jnp.asarray(gs), block_sizes=gg.BlockSizes(forward=tiles, dlhs=tiles, wgrad=tiles),
            implementation=implementation), lhs, rhs, dy)

    for got, want in zip(run("triton"), run("xla")):
        assert_close(got, np.asarray(want, np.float64))


def test_grouped_gemm_compiles_for_hopper():
    """The default tiles of a bf16 MoE layer (forward, d lhs, weight gradient), FP8 and persistent
    variants, compile for sm_90."""
    from mtjax.kernels import grouped_gemm as gg
    from mtjax.kernels.triton import grouped_gemm as native

    lhs = jax.ShapeDtypeStruct((32768, 2048), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((8, 2048, 8192), jnp.bfloat16)
    dy = jax.ShapeDtypeStruct((32768, 8192), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((8,), jnp.int32)
    blocks = gg.BlockSizes.default(32768, 2048, 8192, 8, jnp.bfloat16)

    def f(lhs, rhs, dy, gs):
        fp8 = jnp.float8_e4m3fn
        return (native.gmm(lhs, rhs, gs, tiles=blocks.forward),
                native.gmm(dy, rhs, gs, transpose_rhs=True, tiles=blocks.dlhs),
                native.tgmm(lhs, dy, gs, tiles=blocks.wgrad),
                native.gmm(lhs.astype(fp8), rhs.astype(fp8), gs, jnp.ones((8,)), out_dtype=jnp.bfloat16,
                           tiles=dataclasses.replace(blocks.forward, block_k=128, num_programs=264)),
                native.tgmm(lhs.astype(fp8), dy.astype(jnp.float8_e5m2), gs, out_dtype=jnp.bfloat16))

    shared = _compile_all(f, lhs, rhs, dy, gs)
    assert max(shared.values()) <= HOPPER_SHARED_MEMORY, shared


# -------------------------------------------------------------------------------------------------- paged attention


@pytest.mark.parametrize("lengths,q_len,groups,page_size,options", [
    ([5, 1, 12, 0], 1, 2, 4, {}),  # an empty slot; the context split over several programs
    ([37, 12], 3, 8, 8, {"window_size": (9, 0), "logits_soft_cap": 3.0}),  # two row blocks of 16
])
def test_paged_attention_matches_reference(interpret, lengths, q_len, groups, page_size, options):
    from tests.kernels.test_paged_attention import make_case

    args = make_case(4, lengths=lengths, q_len=q_len, kv_heads=2 if groups == 2 else 1, groups=groups,
                     page_size=page_size)
    got = ops.paged_attention(*args, implementation="triton", **options)
    want = ops.paged_attention(*args, implementation="xla", **options)
    _tree_allclose((got,), (want,), 1e-5, ("out",))


def test_paged_attention_fp8_pages(interpret):
    from tests.kernels.test_paged_attention import make_case

    q, k, v, tables, lengths = make_case(6, lengths=[21, 50, 0], kv_heads=2, groups=2, page_size=16,
                                         dtype=jnp.bfloat16)
    k_scale, v_scale = jnp.asarray([0.02, 0.05], jnp.float32), jnp.asarray([0.03, 0.01], jnp.float32)
    k8 = (k.astype(jnp.float32) / k_scale[:, None, None, None]).astype(jnp.float8_e4m3fn)
    v8 = (v.astype(jnp.float32) / v_scale[:, None, None, None]).astype(jnp.float8_e4m3fn)
    got, want = (ops.paged_attention(q, k8, v8, tables, lengths, k_scale=k_scale, v_scale=v_scale, implementation=impl)
                 for impl in ("triton", "xla"))
    _tree_allclose((got,), (want,), 2e-2, ("out",))


def test_paged_attention_compiles_for_hopper():
    from mtjax.kernels.triton import paged_attention as native

    q = jax.ShapeDtypeStruct((64, 1, 32, 128), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((8, 4096, 16, 128), jnp.bfloat16)
    pages8 = jax.ShapeDtypeStruct((8, 4096, 16, 128), jnp.float8_e4m3fn)
    tables = jax.ShapeDtypeStruct((64, 64), jnp.int32)
    lengths = jax.ShapeDtypeStruct((64,), jnp.int32)
    scales = jax.ShapeDtypeStruct((8,), jnp.float32)

    def f(q, pages, pages8, tables, lengths, scales):
        return (native.paged_attention(q, pages, pages, tables, lengths, scale=0.1),
                native.paged_attention(q, pages8, pages8, tables, lengths, scales, scales, scale=0.1,
                                       logits_soft_cap=30.0, window_left=512))

    shared = _compile_all(f, q, pages, pages8, tables, lengths, scales)
    assert max(shared.values()) <= HOPPER_SHARED_MEMORY, shared


# -------------------------------------------------------------------------------------------------- block-scaled FP8


@pytest.mark.parametrize("m,k,transpose,dtype,out_dtype,power_of_two", [
    (130, 140, True, jnp.bfloat16, jnp.float8_e4m3fn, False),
    (5, 130, False, jnp.float32, jnp.float8_e5m2, True),
])
def test_tile_quantize_is_bit_identical(interpret, m, k, transpose, dtype, out_dtype, power_of_two):
    from tests.kernels.test_block_fp8 import _assert_equal, _x

    x = _x(m + k, (m, k), dtype)
    options = dict(transpose=transpose, power_of_two=power_of_two)
    _assert_equal(ops.tile_quantize(x, out_dtype, implementation="triton", **options),
                      ops.tile_quantize(x, out_dtype, implementation="xla", **options))


def test_block_quantize_is_bit_identical(interpret):
    from tests.kernels.test_block_fp8 import _assert_equal, _x

    w = _x(5, (100, 130), jnp.bfloat16, 0.05)
    options = dict(power_of_two=False, amax_epsilon=1e-2)
    _assert_equal(ops.block_quantize(w, jnp.float8_e4m3fn, implementation="triton", **options),
                      ops.block_quantize(w, jnp.float8_e4m3fn, implementation="xla", **options))


@pytest.mark.parametrize("prologue", ["layernorm", "rmsnorm", "swiglu", "gelu"])
def test_fused_tile_casts_match_reference(interpret, prologue):
    """`norm_tile_fp8` / `activation_tile_fp8`: the tile cast with the norm or activation applied to each
    loaded tile, at odd shapes (masked tails), with and without the transposed cast."""
    from tests.kernels.test_block_fp8 import _norm_inputs, _x, assert_same_tiles

    m, k = 130, 200
    for transpose in (True, False):
        if prologue in ("layernorm", "rmsnorm"):
            x, gamma, beta = _norm_inputs(3, m, k)
            kwargs = dict(layernorm_type=prologue, zero_centered_gamma=prologue == "rmsnorm", transpose=transpose)
            beta = beta if prologue == "layernorm" else None
            got = ops.norm_tile_fp8(x, gamma, beta, implementation="triton", **kwargs)
            want = ops.norm_tile_fp8(x, gamma, beta, implementation="xla", **kwargs)
        else:
            shape = (m, 2, k) if ops.is_gated(prologue) else (m, k)
            x = _x(4, (m, int(np.prod(shape[1:]))), jnp.bfloat16, 1.0).reshape(shape)
            bias = 0.5 * jax.random.normal(jax.random.key(5), shape[1:])
            got = ops.activation_tile_fp8(x, prologue, bias, transpose=transpose, implementation="triton")
            want = ops.activation_tile_fp8(x, prologue, bias, transpose=transpose, implementation="xla")
        assert_same_tiles(got, want)


@pytest.mark.parametrize("activation,m,hidden", [("gelu", 130, 200), ("clamped_swiglu", 130, 256)])
def test_activation_grad_tile_cast_matches_reference(interpret, activation, m, hidden):
    """`activation_grad_tile_fp8`: the activation's backward writing its gradient's tiles in both layouts
    and the bias gradient, at odd shapes (masked tails)."""
    from mtjax.kernels.triton import block_fp8 as native
    from tests.kernels.test_block_fp8 import _x, assert_same_tiles, grad_tiles

    shape = (m, 2, hidden) if ops.is_gated(activation) else (m, hidden)
    x = _x(4, (m, int(np.prod(shape[1:]))), jnp.bfloat16, 1.0).reshape(shape)
    dy = _x(6, (m, hidden), jnp.bfloat16)
    bias = 0.5 * jax.random.normal(jax.random.key(5), shape[1:])
    got = grad_tiles(native.activation_grad_tile_quantize, x, dy, activation, bias)
    want = ops.activation_grad_tile_fp8(x, dy, activation, bias, implementation="xla")
    assert_same_tiles(got[0:4:2], want[0:4:2])
    _tree_allclose(got[1:4:2] + got[4:], want[1:4:2] + want[4:], 1e-5, ("scale_inv", "scale_inv_t", "dbias"))


def test_a_nan_tile_gets_scale_one(interpret):
    """`block_quantize.tile_scales`: a tile whose amax is NaN keeps scale 1 and its NaN (the reference on
    the CPU cannot show this: XLA's CPU max drops NaNs)."""
    from mtjax.kernels.triton import block_fp8 as native

    x = jnp.ones((4, 256), jnp.float32).at[1, 5].set(jnp.nan).at[2, 200].set(3.0)
    q, scale_inv = native.tile_quantize(x, jnp.float8_e4m3fn, fp8_max=448.0)
    assert np.isnan(np.asarray(q[1, 5], np.float32)) and float(scale_inv[1, 0]) == 1.0
    f32 = np.float32
    assert scale_inv[1, 1] == f32(1) / (f32(448) / f32(1)) and scale_inv[2, 1] == f32(1) / (f32(448) / f32(3))


@pytest.mark.parametrize("b_blocks,b_dtype", [(True, jnp.float8_e4m3fn), (False, jnp.float8_e5m2)])
def test_block_fp8_gemm_matches_reference(interpret, b_blocks, b_dtype):
    """Per-row and per-128x128-block scales of b; E4M3 x E5M2 mixes the formats (bfloat16 dots)."""
    from tests.kernels.test_block_fp8 import _operands

    a, a_s, b, b_s = _operands(0, 37, 200, 40, b_blocks, b_dtype)
    got = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, implementation="triton")
    want = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, implementation="xla")
    _tree_allclose((got,), (want,), 1e-6, ("out",))


def test_block_fp8_compiles_for_hopper():
    from mtjax.kernels.triton import block_fp8 as native

    x = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16)

    def f(x):
        a, a_s, a_t, a_t_s = native.tile_quantize(x, jnp.float8_e4m3fn, transpose=True, fp8_max=448.0)
        b, b_t, b_s = native.block_quantize(x[:2048], jnp.float8_e4m3fn, fp8_max=448.0, power_of_two=True)
        g, g_s = native.tile_quantize(x, jnp.float8_e5m2, fp8_max=57344.0)
        b_rows = jnp.repeat(b_s, 128, axis=0)
        gamma = jnp.ones((4096,), jnp.bfloat16)
        norm = native.norm_tile_quantize(x, gamma, gamma, jnp.float8_e4m3fn, rms=False, epsilon=1e-6,
                                         zero_centered_gamma=True, transpose=True, fp8_max=448.0)
        act = native.activation_tile_quantize(x.reshape(8192, 2, 2048), gamma.reshape(2, 2048), jnp.float8_e4m3fn,
                                              activation="clamped_swiglu", transpose=True, fp8_max=448.0)
        act_grad = native.activation_grad_tile_quantize(x.reshape(8192, 2, 2048), gamma.reshape(2, 2048),
                                                        x[:, :2048], jnp.float8_e4m3fn, activation="clamped_swiglu",
                                                        fp8_max=448.0)
        return (native.block_fp8_gemm(a, a_s, b, b_rows, jnp.bfloat16),
                native.block_fp8_gemm(g, g_s, b, b_rows, jnp.bfloat16), a_t, a_t_s, b_t, norm, act, act_grad)

    shared = _compile_all(f, x)
    assert max(shared.values()) <= HOPPER_SHARED_MEMORY, shared


def test_gelu_fp8_kernels_compile_the_ptx_sigmoid_for_cuda(monkeypatch):
    """Not interpreted, the kernels writing GELU's output or gradient in FP8 (tile casts and per-tensor)
    are traced for both platform branches: the one with ``PTX_SIGMOID`` (cuda's) compiles to
    ``ex2.approx.ftz.f32`` and ``rcp.approx.ftz.f32``, the other keeps the exact form."""
    from mtjax.config import config
    from mtjax.kernels import activation as activation_kernels
    from mtjax.kernels.triton import activation as native_activation
    from mtjax.kernels.triton import block_fp8 as native

    monkeypatch.setattr(config, "pallas_interpret", False)
    monkeypatch.setattr(activation_kernels, "GELU_PTX_SIGMOID", True)
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    f8, one = jnp.float8_e4m3fn, jnp.float32(1.0)
    with runtime.record_launches() as launches:
        jax.eval_shape(lambda x: (
            native.activation_tile_quantize(x, x[0], f8, activation="gelu", transpose=True, fp8_max=448.0),
            native.activation_grad_tile_quantize(x, None, x, f8, activation="gelu", fp8_max=448.0),
            native_activation.forward(x, None, one, activation="gelu", out_dtype=f8),
            native_activation.backward_fp8(x, None, x, one, activation="gelu", out_dtype=f8)), x)
    names = ("mtjax_triton_activation_grad_tile_quantize", "mtjax_triton_activation_tile_quantize",
             "mtjax_triton_gelu_bwd_fp8", "mtjax_triton_gelu_fwd")
    assert sorted((r.name, r.constexprs["PTX_SIGMOID"]) for r in launches) == [
        (name, approx) for name in names for approx in (False, True)]
    for record in launches:
        ptx = runtime.compile_launch(record, 90).asm["ptx"]
        assert ("rcp.approx.ftz.f32" in ptx) == record.constexprs["PTX_SIGMOID"], record.name
        assert ("ex2.approx.ftz.f32" in ptx) == record.constexprs["PTX_SIGMOID"], record.name


# -------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,kv_heads,options", [
    (64, 8, {"mask_type": "causal"}),
    (128, 2, {"mask_type": "no_mask"}),
    (128, 8, {"mask_type": "causal", "window_size": (256, 0), "logits_soft_cap": 30.0}),
    (128, 4, {"mask_type": "causal", "window_size": (300, 0)}),  # the TMA forward with a band
    (256, 8, {"mask_type": "causal"}),
])
def test_attention_on_gpu(head_dim, kv_heads, options):
    q, k, v, do = _inputs(0, (2, 1000, 8, head_dim), (2, 1000, kv_heads, head_dim), (2, 1000, kv_heads, head_dim),
                          (2, 1000, 8, head_dim), dtype=jnp.bfloat16)
    got = _attention_out_and_grads("triton", q, k, v, do, **options)
    want = _attention_out_and_grads("xla", q, k, v, do, **options)
    _tree_allclose(got, want, 2e-2, ("out", "dq", "dk", "dv"))


@pytest.mark.gpu
def test_attention_segments_and_tails_on_gpu():
    q, k, v, do = _inputs(1, (2, 300, 8, 128), (2, 9000, 2, 128), (2, 9000, 2, 128), (2, 300, 8, 128),
                          dtype=jnp.bfloat16)
    options = dict(mask_type="padding_causal", q_segment_ids=_segments(1, 2, 300, 4),
                   kv_segment_ids=_segments(2, 2, 9000, 4), dropout_rate=0.1, dropout_rng=jax.random.key(3))
    got = _attention_out_and_grads("triton", q, k, v, do, **options)
    want = _attention_out_and_grads("xla", q, k, v, do, **options)
    _tree_allclose(got, want, 2e-2, ("out", "dq", "dk", "dv"))


@pytest.mark.gpu
@pytest.mark.parametrize("op,shape", [("layernorm", (16384, 8192)), ("rmsnorm", (4096, 12288)),
                                      ("layernorm", (3000, 1000))])
def test_norm_on_gpu(op, shape):
    x, dy = _inputs(0, shape, shape, dtype=jnp.bfloat16)
    gamma, beta = _inputs(1, shape[-1:], shape[-1:])

    def norm(implementation):
        if op == "layernorm":
            return lambda x, g, b: ops.layernorm(x, g, b, implementation=implementation)
        return lambda x, g, b: ops.rmsnorm(x, g, implementation=implementation)

    got = jax.jit(lambda *a: _vjp_outputs(norm("triton"), a[:3], a[3]))(x, gamma, beta, dy)
    want = jax.jit(lambda *a: _vjp_outputs(norm("xla"), a[:3], a[3]))(x, gamma, beta, dy)
    _tree_allclose(got, want, 2e-2, ("y", "dx", "dgamma", "dbeta"))


@pytest.mark.gpu
def test_residual_norm_and_fp8_on_gpu():
    x, dy, d_residual = _inputs(2, (8192, 4096), (8192, 4096), (8192, 4096), dtype=jnp.bfloat16)
    residual, = _inputs(3, (8192, 4096))
    gamma, beta = _inputs(4, (4096,), (4096,))

    def residual_norm(implementation):
        return lambda x, r, g, b: ops.residual_norm(x, r, g, b, dropout_rate=0.1, dropout_rng=jax.random.key(2),
                                                    implementation=implementation)

    run = jax.jit(lambda impl, *a: _vjp_outputs(residual_norm(impl), a[:4], (a[4], a[5])), static_argnums=0)
    _tree_allclose(run("triton", x, residual, gamma, beta, dy, d_residual),
                   run("xla", x, residual, gamma, beta, dy, d_residual), 2e-2,
                   ("normalized", "new_residual", "dx", "dresidual", "dgamma", "dbeta"))
    q, amax = ops.norm_fp8(x, gamma, beta, jnp.float32(8.0), implementation="triton")
    q_ref, amax_ref = ops.norm_fp8(x, gamma, beta, jnp.float32(8.0), implementation="xla")
    np.testing.assert_allclose(amax, amax_ref, rtol=1e-5)
    assert np.mean(np.asarray(q, np.float32) == np.asarray(q_ref, np.float32)) > 0.99


@pytest.mark.gpu
def test_activations_softmax_and_casts_on_gpu():
    x, dy = _inputs(5, (8192, 2, 4096), (8192, 4096), dtype=jnp.bfloat16)
    bias, = _inputs(6, (2, 4096), dtype=jnp.bfloat16)

    def act(implementation):
        return lambda x, b: ops.activation(x, "swiglu", b, implementation=implementation)

    run = jax.jit(lambda impl, x, b, dy: _vjp_outputs(act(impl), (x, b), dy), static_argnums=0)
    _tree_allclose(run("triton", x, bias, dy), run("xla", x, bias, dy), 2e-2, ("y", "dx", "dbias"))
    got = ops.activation_grad_fp8(x, dy, "swiglu", bias, scale=jnp.float32(100.0), implementation="triton")
    want = ops.activation_grad_fp8(x, dy, "swiglu", bias, scale=jnp.float32(100.0), implementation="xla")
    assert np.mean(np.asarray(got[0], np.float32) == np.asarray(want[0], np.float32)) > 0.99
    np.testing.assert_allclose(got[2], want[2], rtol=1e-3)
    # GELU's FP8 kernels: x * sigmoid(2u) by ex2.approx and rcp.approx (relative error about |2u| * 2^-24)
    h = x[:, 0]
    for op, args in ((ops.activation_fp8, (h, "gelu")), (ops.activation_grad_fp8, (h, dy, "gelu"))):
        got = op(*args, scale=jnp.float32(50.0), implementation="triton")
        want = op(*args, scale=jnp.float32(50.0), implementation="xla")
        assert np.mean(np.asarray(got[0], np.float32) == np.asarray(want[0], np.float32)) > 0.99
        amax = 1 if op is ops.activation_fp8 else 2
        np.testing.assert_allclose(got[amax], want[amax], rtol=1e-5)
    logits, dl = _inputs(7, (4, 8, 1024, 1024), (4, 8, 1024, 1024), dtype=jnp.bfloat16)

    def softmax(implementation):
        return lambda z: ops.softmax(z, scale=0.125, causal=True, implementation=implementation)

    run = jax.jit(lambda impl, z, dz: _vjp_outputs(softmax(impl), (z,), dz), static_argnums=0)
    _tree_allclose(run("triton", logits, dl), run("xla", logits, dl), 2e-2, ("y", "dx"))
    got = ops.cast_transpose(dy, jnp.float32(50.0), jnp.float8_e4m3fn, implementation="triton")
    want = ops.cast_transpose(dy, jnp.float32(50.0), jnp.float8_e4m3fn, implementation="xla")
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
def test_grouped_gemm_on_gpu():
    from tests.ops.test_grouped_gemm import assert_close, value_and_grads

    rng = np.random.default_rng(0)
    sizes = np.asarray([1000, 0, 3000, 517, 2500, 1000, 0, 1100], np.int32)
    lhs = rng.normal(size=(sizes.sum() + 100, 1024)).astype(jnp.bfloat16)
    rhs = rng.normal(size=(8, 1024, 1408)).astype(jnp.bfloat16)
    dy = rng.normal(size=(lhs.shape[0], 1408)).astype(jnp.bfloat16)

    def run(implementation):
        return jax.jit(lambda a, b, d: value_and_grads(lambda a, b: ops.grouped_gemm(
            a, b, jnp.asarray(sizes), implementation=implementation), a, b, d))(lhs, rhs, dy)

    for got, want in zip(run("triton"), run("xla")):
        assert_close(np.asarray(got, np.float32), np.asarray(want, np.float64), rtol=2e-2)


@pytest.mark.gpu
def test_paged_attention_on_gpu():
    from tests.kernels.test_paged_attention import make_case

    args = make_case(0, lengths=[4000, 17, 0, 2048] * 4, q_len=1, kv_heads=8, groups=4, head_dim=128, page_size=16,
                     dtype=jnp.bfloat16)
    got = ops.paged_attention(*args, implementation="triton")
    want = ops.paged_attention(*args, implementation="xla")
    _tree_allclose((got,), (want,), 2e-2, ("out",))


@pytest.mark.gpu
def test_block_fp8_on_gpu():
    from tests.kernels.test_block_fp8 import _assert_equal, _x, assert_same_dequantized, assert_same_tiles

    x = _x(0, (4096, 2048), jnp.bfloat16)
    w = _x(1, (1024, 2048), jnp.bfloat16, 0.05)
    _assert_equal(ops.tile_quantize(x, jnp.float8_e4m3fn, transpose=True, implementation="triton"),
                      ops.tile_quantize(x, jnp.float8_e4m3fn, transpose=True, implementation="xla"))
    _assert_equal(ops.block_quantize(w, jnp.float8_e4m3fn, implementation="triton"),
                      ops.block_quantize(w, jnp.float8_e4m3fn, implementation="xla"))
    gamma = 1.0 + 0.1 * jax.random.normal(jax.random.key(2), (2048,))
    assert_same_tiles(ops.norm_tile_fp8(x, gamma, gamma, transpose=True, implementation="triton"),
                      ops.norm_tile_fp8(x, gamma, gamma, transpose=True, implementation="xla"))
    h = x.reshape(4096, 2, 1024)
    assert_same_tiles(ops.activation_tile_fp8(h, "swiglu", transpose=True, implementation="triton"),
                      ops.activation_tile_fp8(h, "swiglu", transpose=True, implementation="xla"))
    # GELU's tanh by the approximate instruction: within the tile casts' rounding of the reference
    g, dy = x[:, :1024], _x(3, (4096, 1024), jnp.bfloat16)
    assert_same_dequantized(ops.activation_tile_fp8(g, "gelu", transpose=True, implementation="triton"),
                            ops.activation_tile_fp8(g, "gelu", transpose=True, implementation="xla"))
    assert_same_dequantized(ops.activation_grad_tile_fp8(g, dy, "gelu", implementation="triton")[:4],
                            ops.activation_grad_tile_fp8(g, dy, "gelu", implementation="xla")[:4])
    a, a_s = ops.tile_quantize(x, jnp.float8_e4m3fn, implementation="xla")
    b, _, b_s = ops.block_quantize(w, jnp.float8_e4m3fn, implementation="xla")
    got = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, implementation="triton")
    want = ops.block_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, implementation="xla")
    _tree_allclose((got,), (want,), 1e-5, ("out",))


@triton.jit
def _write_first_half(x_ptr, o_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N // 2)
    tl.store(o_ptr + offsets, tl.load(x_ptr + offsets) * 2.0)


def test_interpret_mode_catches_unwritten_outputs(interpret):
    """Outputs start as NaN in interpret mode, so an element a kernel never writes fails the tests."""
    [out] = runtime.launch(_write_first_half, jnp.ones((8,), jnp.float32),
                           out_shape=[jax.ShapeDtypeStruct((8,), jnp.float32)], grid=(1,), name="half", N=8)
    assert np.isnan(np.asarray(out[4:])).all() and (np.asarray(out[:4]) == 2.0).all()


def test_jax_triton_kernels_are_made_as_compiled(monkeypatch):
    """jax-triton 0.3 makes each kernel with the warp count and global scratch Triton's compiler
    recorded (a warp-specialized kernel runs more warps than launched with; TMA descriptors built on
    the device need scratch); other kernels pass through unchanged, and jax-triton 0.4 is left alone."""
    import types

    from triton.backends.nvidia import compiler as nvidia

    made = []
    lib = types.SimpleNamespace(TritonKernel=lambda *args: made.append(args), get_compute_capability=lambda d: 90)
    jax_triton = types.SimpleNamespace(__version__="0.3.1",
                                       triton_lib=types.SimpleNamespace(triton_kernel_call_lib=lib))
    monkeypatch.setattr(nvidia.CUDABackend, "make_llir", lambda self, src, metadata, *args: metadata.update(src))
    runtime._launch_as_compiled(jax_triton)
    runtime._launch_as_compiled(jax_triton)  # once only
    patched = jax_triton.triton_lib.triton_kernel_call_lib
    assert patched.get_compute_capability(0) == 90

    metadata = {}
    nvidia.CUDABackend.make_llir(None, {"num_warps": 12, "global_scratch_size": 640, "global_scratch_align": 128},
                                 metadata, None, 90)
    metadata["name"] = "ws_kernel"  # make_ptx names the kernel
    patched.TritonKernel("ws_kernel", 4, 1, 1024, "ptx", "ttir", 90)
    patched.TritonKernel("other_kernel", 4, 1, 1024, "ptx", "ttir", 90)
    assert made == [("ws_kernel", 12, 1, 1024, "ptx", "ttir", 90, 640, 128),
                    ("other_kernel", 4, 1, 1024, "ptx", "ttir", 90)]

    newer = types.SimpleNamespace(__version__="0.4.1", triton_lib=types.SimpleNamespace(triton_kernel_call_lib=lib))
    runtime._launch_as_compiled(newer)
    assert newer.triton_lib.triton_kernel_call_lib is lib


def test_launch_rejects_an_empty_grid():
    x = jnp.ones((4,), jnp.float32)
    with pytest.raises(ValueError, match="empty launch grid"):
        runtime.launch(None, x, out_shape=[jax.ShapeDtypeStruct((4,), jnp.float32)], grid=(0,), name="k")
