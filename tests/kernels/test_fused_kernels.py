"""The fused Pallas kernels (norms, norm+FP8, residual+norm, activation, softmax) in interpret mode
against their ops' references, forward and gradients, and their Triton lowering for an H200.

Interpret mode is slow on the CPU: shapes stay tiny (rows <= 16, hidden <= 300) and odd, so row
tails and column tails of the power-of-two tiles are masked in every test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtjax import backend, ops
from mtjax.config import override
from mtjax.kernels.activation import ACTIVATIONS as KERNEL_ACTIVATIONS

# Interpret mode and the references run as XLA programs on the CPU: their compilation dominates, and
# XLA's optimizations (twice the compile time) matter for no assertion here unless a test says so.
pytestmark = pytest.mark.usefixtures("fast_compiles")

TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2}
DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16])
ROWS = st.sampled_from([(1,), (5,), (3, 4), (16,)])
HIDDEN = st.sampled_from([1, 7, 64, 100, 257, 300])


def _random(seed, shape, dtype, scale=1.0):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


def _run(fn, args, diff_argnums, implementation):
    """Outputs of ``fn(*args, implementation=...)`` and the gradients of a random projection of them."""

    def loss(*diff):
        full = list(args)
        for i, a in zip(diff_argnums, diff):
            full[i] = a
        out = fn(*full, implementation=implementation)
        total = 0.0
        for k, leaf in enumerate(jax.tree.leaves(out)):
            weights = jax.random.normal(jax.random.key(100 + k), leaf.shape, jnp.float32)
            total = total + jnp.sum(leaf.astype(jnp.float32) * weights)
        return total, out

    if not diff_argnums:
        return fn(*args, implementation=implementation), ()
    grad_fn = jax.value_and_grad(loss, argnums=tuple(range(len(diff_argnums))), has_aux=True)
    (_, out), grads = jax.jit(grad_fn)(*[args[i] for i in diff_argnums])
    return out, grads


def _assert_close(got, want, dtype):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        tol = TOLERANCE[jnp.dtype(dtype)]
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * max(1.0, np.max(np.abs(w))))


def check_kernel(fn, args, diff_argnums, dtype, interpret=True):
    """The Pallas kernel (in interpret mode unless on the GPU) matches the op's reference, forward and gradients."""
    with override(pallas_interpret=interpret):
        got = _run(fn, args, diff_argnums, "pallas_triton")
    want = _run(fn, args, diff_argnums, "xla")
    _assert_close(got, want, dtype)


# --------------------------------------------------------------------------------------------------
# Norms
# --------------------------------------------------------------------------------------------------


@settings(max_examples=4)
@given(rows=ROWS, hidden=HIDDEN, dtype=DTYPES, kind=st.sampled_from(["layernorm", "rmsnorm"]),
       zero_centered=st.booleans(), with_beta=st.booleans(), seed=st.integers(0, 2**16))
def test_norm_kernels_match_reference(rows, hidden, dtype, kind, zero_centered, with_beta, seed):
    x = _random(seed, rows + (hidden,), dtype, 2.0) + 0.5
    gamma = _random(seed + 1, (hidden,), jnp.float32)
    beta = _random(seed + 2, (hidden,), jnp.float32)
    if kind == "layernorm":
        def fn(x, gamma, beta, implementation):
            return ops.layernorm(x, gamma, beta if with_beta else None, zero_centered_gamma=zero_centered,
                                 implementation=implementation)
        check_kernel(fn, (x, gamma, beta), (0, 1, 2) if with_beta else (0, 1), dtype)
    else:
        def fn(x, gamma, implementation):
            return ops.rmsnorm(x, gamma, zero_centered_gamma=zero_centered, implementation=implementation)
        check_kernel(fn, (x, gamma), (0, 1), dtype)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_kernels_on_exact_tiles(kind):
    """Power-of-two hidden and whole row blocks: the unmasked loads/stores path (forward, backward, FP8)."""
    from mtjax.kernels import layer_norm as kernels

    hidden = 128
    rows = 2 * kernels.forward_tile(hidden)[0] * kernels.backward_tile(hidden)[0]
    x = _random(0, (rows, hidden), jnp.float32, 2.0) + 0.5
    gamma, beta = _random(1, (hidden,), jnp.float32), _random(2, (hidden,), jnp.float32)
    if kind == "layernorm":
        check_kernel(lambda x, g, b, implementation: ops.layernorm(x, g, b, implementation=implementation),
                     (x, gamma, beta), (0, 1, 2), jnp.float32)
    else:
        check_kernel(lambda x, g, implementation: ops.rmsnorm(x, g, implementation=implementation),
                     (x, gamma), (0, 1), jnp.float32)
    fp8_args = (x, gamma, beta if kind == "layernorm" else None, jnp.float32(100.0))
    with override(pallas_interpret=True):
        q, amax = ops.norm_fp8(*fp8_args, layernorm_type=kind, implementation="pallas_triton")
    q_ref, amax_ref = ops.norm_fp8(*fp8_args, layernorm_type=kind, implementation="xla")
    np.testing.assert_allclose(amax, amax_ref, rtol=1e-6)
    assert np.mean(np.asarray(q, np.float32) == np.asarray(q_ref, np.float32)) > 0.99


@pytest.mark.parametrize("hidden", [128, 100, 9000])
def test_norm_kernels_walk_several_row_blocks_per_program(hidden):
    """Persistent programs: 2 programs over 5 row blocks (3 and 2 trips, the prefetch past the last
    block clamped) give what one block per program gives, on exact (128) and masked (100) tiles; at
    9000 (rows padded to 16384, over `PREFETCH_MAX_ELEMENTS`) without the prefetch."""
    from mtjax.kernels import layer_norm as kernels

    tile = (2, 4)
    x, residual, dy = (_random(i, (9, hidden), jnp.float32, 2.0) for i in range(3))
    gamma, beta = _random(3, (hidden,), jnp.float32), _random(4, (hidden,), jnp.float32)
    seed = jnp.uint32(7)
    flags = dict(rms=False, epsilon=1e-6, zero_centered_gamma=False)
    with override(pallas_interpret=True):
        def both(programs):
            fwd = kernels.forward(x, gamma, beta, residual, seed, jnp.float32(10.0), dropout_rate=0.25,
                                  out_dtype=jnp.float8_e4m3fn, tile=tile, programs=programs, **flags)
            bwd = kernels.backward(x, gamma, dy, residual, seed, has_beta=True, dropout_rate=0.25,
                                   tile=tile, programs=programs, **flags)
            return fwd, bwd
        (fwd, bwd), (fwd_ref, bwd_ref) = both(2), both(None)
    for got, want in zip(jax.tree.leaves(fwd), jax.tree.leaves(fwd_ref)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    for got, want in zip(jax.tree.leaves(bwd), jax.tree.leaves(bwd_ref)):  # dgamma/dbeta: another summation order
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-5, atol=1e-5)


def test_fp8_kernel_entry_points_reject_a_non_fp8_out_dtype():
    from mtjax.kernels import activation as act_kernels
    from mtjax.kernels import layer_norm as norm_kernels

    x, one = jnp.ones((2, 8), jnp.bfloat16), jnp.float32(1.0)
    calls = {
        "norm_fp8": lambda: norm_kernels.norm_fp8(x, jnp.ones(8), None, one, rms=True, epsilon=1e-6,
                                                  zero_centered_gamma=False, out_dtype=jnp.bfloat16),
        "activation_fp8": lambda: act_kernels.activation_fp8(x, None, one, activation="gelu", out_dtype=jnp.int8),
        "activation_grad_fp8": lambda: act_kernels.activation_grad_fp8(x, None, x, one, activation="gelu",
                                                                       out_dtype=jnp.int8),
    }
    for op, call in calls.items():
        with pytest.raises(ValueError, match=f"{op}: out_dtype=.*accepted: float8_e4m3fn, float8_e5m2"):
            call()


@pytest.mark.parametrize("kind, out_dtype", [("layernorm", jnp.float8_e4m3fn), ("rmsnorm", jnp.float8_e5m2)])
def test_norm_fp8_matches_reference(kind, out_dtype):
    x = _random(0, (13, 300), jnp.bfloat16, 3.0)
    gamma = _random(1, (300,), jnp.float32)
    beta = _random(2, (300,), jnp.float32) if kind == "layernorm" else None
    scale = jnp.float32(jnp.finfo(out_dtype).max / 2)  # the largest |y| (> 2) saturate

    def fn(*args, implementation):
        return ops.norm_fp8(*args, layernorm_type=kind, out_dtype=out_dtype, implementation=implementation)

    with override(pallas_interpret=True):
        q, amax = fn(x, gamma, beta, scale, implementation="pallas_triton")
    q_ref, amax_ref = fn(x, gamma, beta, scale, implementation="xla")
    assert q.dtype == out_dtype and amax.shape == () and amax.dtype == jnp.float32
    np.testing.assert_allclose(amax, amax_ref, rtol=1e-6)
    # Same f32 value before the cast: the FP8 codes agree except for rare ties one code apart.
    q, q_ref = np.asarray(q, np.float32), np.asarray(q_ref, np.float32)
    assert np.all(np.isfinite(q)) and np.max(np.abs(q)) == float(jnp.finfo(out_dtype).max)
    assert np.mean(q == q_ref) > 0.99
    np.testing.assert_allclose(q, q_ref, rtol=0.13)


@pytest.mark.parametrize("kind, x_dtype, residual_dtype, dropout_rate", [
    ("layernorm", jnp.float32, jnp.float32, 0.0),
    ("layernorm", jnp.bfloat16, jnp.float32, 0.25),
    ("rmsnorm", jnp.bfloat16, jnp.bfloat16, 0.5),
])
def test_residual_norm_matches_reference(kind, x_dtype, residual_dtype, dropout_rate):
    shape = (3, 5, 257)
    x = _random(0, shape, x_dtype)
    residual = _random(1, shape, residual_dtype, 2.0)
    gamma = _random(2, (257,), jnp.float32)
    beta = _random(3, (257,), jnp.float32) if kind == "layernorm" else None
    rng = jax.random.key(4)

    def fn(x, residual, gamma, beta, implementation):
        return ops.residual_norm(x, residual, gamma, beta, layernorm_type=kind, dropout_rate=dropout_rate,
                                 dropout_rng=rng, implementation=implementation)

    check_kernel(fn, (x, residual, gamma, beta), (0, 1, 2, 3) if beta is not None else (0, 1, 2), x_dtype)
    if dropout_rate:
        _, new_residual = fn(x, residual, gamma, beta, implementation="xla")
        dropped = np.mean(np.asarray(new_residual == residual.astype(residual_dtype)))
        assert abs(dropped - dropout_rate) < 0.05


# --------------------------------------------------------------------------------------------------
# Activation and softmax
# --------------------------------------------------------------------------------------------------


@settings(max_examples=4)
@given(rows=ROWS, hidden=st.sampled_from([1, 37, 150]), dtype=DTYPES, with_bias=st.booleans(),
       activation=st.sampled_from(sorted(KERNEL_ACTIVATIONS)), seed=st.integers(0, 2**16))
def test_activation_kernel_matches_reference(rows, hidden, dtype, with_bias, activation, seed):
    shape = (2, hidden) if ops.is_gated(activation) else (hidden,)
    x = _random(seed, rows + shape, dtype, 2.0)
    bias = _random(seed + 1, shape, dtype)

    def fn(x, bias, implementation):
        return ops.activation(x, activation, bias if with_bias else None, implementation=implementation)

    check_kernel(fn, (x, bias), (0, 1) if with_bias else (0,), dtype)


@pytest.mark.parametrize("activation", ["sreglu", "glu", "clamped_swiglu"])
def test_transformer_engine_activation_kernels_match_reference(activation):
    """The activation functions TransformerEngine has beyond the GELU/SiLU/ReLU families (squared ReLU,
    sigmoid, the clamps; quick_gelu's is swiglu's with another slope), forward and backward; inputs up
    to about +-15, so clamped_swiglu's clamps at +-7 are crossed."""
    shape = (2, 37) if ops.is_gated(activation) else (37,)
    x = _random(0, (3,) + shape, jnp.float32, 6.0)
    bias = _random(1, shape, jnp.float32)
    check_kernel(lambda x, bias, implementation: ops.activation(x, activation, bias, implementation=implementation),
                 (x, bias), (0, 1), jnp.float32)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_activation_fp8_matches_reference(activation):
    shape = (2, 100) if ops.is_gated(activation) else (200,)
    x = _random(0, (2, 7) + shape, jnp.bfloat16, 2.0)
    bias = _random(1, shape, jnp.bfloat16)

    def fn(implementation):
        return ops.activation_fp8(x, activation, bias, scale=jnp.float32(100.0), implementation=implementation)

    with override(pallas_interpret=True):
        q, amax = fn("pallas_triton")
    q_ref, amax_ref = fn("xla")
    np.testing.assert_allclose(amax, amax_ref, rtol=1e-6)
    q, q_ref = np.asarray(q, np.float32), np.asarray(q_ref, np.float32)
    assert np.mean(q == q_ref) > 0.99 and np.max(np.abs(q)) == 448.0


@pytest.mark.parametrize("activation", ["gelu", "swiglu", "clamped_swiglu"])
@pytest.mark.parametrize("rows,hidden", [((2, 64), 128), ((3, 7), 100)])  # whole 64x64 tiles, then partial ones
def test_activation_grad_fp8_matches_reference(activation, rows, hidden, request):
    """The FP8 backward against autodiff of the reference then the cast: the kernel's float32 gradient
    formulas differ from autodiff's in the last bits, so a value on an FP8 rounding boundary may round
    the other way (>99 % identical); its transpose is exactly its own output transposed."""
    if activation == "gelu":  # its 99 % was measured with XLA's optimizations (without them: about 98 %)
        request.getfixturevalue("optimized_compiles")
    shape = (2, hidden) if ops.is_gated(activation) else (hidden,)
    x = _random(0, rows + shape, jnp.bfloat16, 2.0)
    bias = _random(1, shape, jnp.bfloat16)
    dy = _random(2, rows + (hidden,), jnp.bfloat16)

    def fn(implementation):
        return ops.activation_grad_fp8(x, dy, activation, bias, scale=jnp.float32(1000.0),
                                       implementation=implementation)

    with override(pallas_interpret=True):
        q, q_t, amax, dbias = fn("pallas_triton")
    q_ref, q_t_ref, amax_ref, dbias_ref = fn("xla")
    q, q_ref = np.asarray(q, np.float32), np.asarray(q_ref, np.float32)
    assert q.shape == x.shape and np.mean(q == q_ref) > 0.99
    np.testing.assert_array_equal(np.asarray(q_t, np.float32), q.reshape(q_t.shape[1], -1).T)
    np.testing.assert_array_equal(np.asarray(q_t_ref, np.float32), q_ref.reshape(q_t.shape[1], -1).T)
    np.testing.assert_allclose(amax, amax_ref, rtol=1e-5)
    np.testing.assert_allclose(dbias, dbias_ref, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(dbias_ref))))


@settings(max_examples=3)
@given(lead=st.sampled_from([(1,), (2, 3), (3,)]), q_len=st.sampled_from([1, 5, 8]), kv_len=st.sampled_from([1, 6, 37]),
       mask_kind=st.sampled_from([None, "full", "per_batch", "shared"]), causal=st.booleans(), dtype=DTYPES,
       seed=st.integers(0, 2**16))
def test_softmax_kernel_matches_reference(lead, q_len, kv_len, mask_kind, causal, dtype, seed):
    shape = lead + (q_len, kv_len)
    logits = _random(seed, shape, dtype, 3.0)
    mask_shape = {None: None, "full": shape, "per_batch": lead[:1] + (1,) * (len(lead) - 1) + (1, kv_len),
                  "shared": (kv_len,)}[mask_kind]
    mask = None
    if mask_shape is not None:
        mask = jax.random.bernoulli(jax.random.key(seed + 1), 0.7, mask_shape)
        mask = mask.at[(0,) * (len(mask_shape) - 1)].set(False)  # a fully masked row

    def fn(logits, implementation):
        return ops.softmax(logits, mask, scale=0.7, causal=causal, implementation=implementation)

    check_kernel(fn, (logits,), (0,), dtype)


def test_softmax_kernel_declines_masks_it_cannot_read_as_rows():
    logits = jax.ShapeDtypeStruct((2, 3, 4, 8), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, 3, 1, 8), jnp.bool_)  # varies along heads but not batch
    impl, why = backend.select("softmax", platform_name="cuda", args=(logits, mask),
                               static={"scale": 1.0, "causal": False})
    assert impl.name == "xla" and "mask" in why


# --------------------------------------------------------------------------------------------------
# Triton lowering for an H200, on the CPU
# --------------------------------------------------------------------------------------------------


def _lower_for_cuda(fn, *args):
    """Triton kernels in ``fn`` lowered for an H200. The ops are called with automatic selection
    (explicitly naming a GPU kernel on a CPU-only host is an error), at shapes where it picks them."""
    with backend.abstract_gpu():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("__gpu$xla.gpu.triton")


def test_every_kernel_lowers_for_cuda():
    f32, bf16 = jnp.float32, jnp.bfloat16
    x = jax.ShapeDtypeStruct((8, 2048, 4000), bf16)
    g = jax.ShapeDtypeStruct((4000,), f32)
    scale = jax.ShapeDtypeStruct((), f32)
    impl = None

    def norms(x, r, g, b, scale, key):
        out = []
        for kind, beta in (("layernorm", b), ("rmsnorm", None)):
            norm = ops.layernorm if kind == "layernorm" else ops.rmsnorm
            args = (x, g, b) if kind == "layernorm" else (x, g)
            y, vjp = jax.vjp(lambda *a: norm(*a, zero_centered_gamma=True, implementation=impl), *args)
            out += [y, vjp(y)]
            out.append(ops.norm_fp8(x, g, beta, scale, layernorm_type=kind, implementation=impl))
            res, vjp = jax.vjp(lambda x, r: ops.residual_norm(x, r, g, beta, layernorm_type=kind, dropout_rate=0.1,
                                                                  dropout_rng=key, implementation=impl), x, r)
            out += [res, vjp(res)]
        return out

    key = jax.random.key(0)
    r = jax.ShapeDtypeStruct(x.shape, f32)
    # per norm kind: fwd, bwd, fp8 fwd, residual fwd, residual bwd
    assert _lower_for_cuda(norms, x, r, g, g, scale, key) == 10
    exact = jax.ShapeDtypeStruct((8, 2048, 4096), bf16)  # unmasked tiles
    g_exact = jax.ShapeDtypeStruct((4096,), f32)
    assert _lower_for_cuda(norms, exact, jax.ShapeDtypeStruct(exact.shape, f32), g_exact, g_exact, scale, key) == 10

    def activations(x, bias, scale):
        out = []
        for act in ("gelu", "silu", "relu", "quick_gelu", "swiglu", "geglu", "reglu"):
            # gated: [..., 2, hidden / 2], bias [2, hidden / 2]
            a, b = (x.reshape(*x.shape[:-1], 2, -1), bias.reshape(2, -1)) if ops.is_gated(act) else (x, bias)
            y, vjp = jax.vjp(lambda a, b: ops.activation(a, act, b, implementation=impl), a, b)
            out += [y, vjp(y), ops.activation_fp8(a, act, b, scale=scale, implementation=impl),
                    ops.activation_grad_fp8(a, y, act, b, scale=scale, implementation=impl)]
        return out

    assert _lower_for_cuda(activations, x, jax.ShapeDtypeStruct((4000,), bf16), scale) == 28

    def softmax(logits, mask):
        y, vjp = jax.vjp(lambda l: ops.softmax(l, mask, scale=0.5, causal=True, implementation=impl), logits)
        return y, vjp(y)

    logits = jax.ShapeDtypeStruct((2, 4, 1000, 3000), bf16)
    assert _lower_for_cuda(softmax, logits, jax.ShapeDtypeStruct((2, 1, 1, 3000), jnp.bool_)) == 2


# --------------------------------------------------------------------------------------------------
# On the GPU (compiled Triton kernels), at sizes with several row blocks and odd hidden sizes
# --------------------------------------------------------------------------------------------------

GPU_NORM_SHAPES = [((4, 333, 1000), jnp.bfloat16), ((999, 4097), jnp.float32), ((2048, 12288), jnp.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype", GPU_NORM_SHAPES)
def test_norm_kernels_on_gpu(shape, dtype):
    hidden = shape[-1]
    x = _random(0, shape, dtype, 2.0)
    gamma, beta = _random(1, (hidden,), jnp.float32), _random(2, (hidden,), jnp.float32)
    residual = _random(3, shape, jnp.float32)
    check_kernel(lambda x, g, b, implementation: ops.layernorm(x, g, b, implementation=implementation),
                 (x, gamma, beta), (0, 1, 2), dtype, interpret=False)
    check_kernel(lambda x, g, implementation: ops.rmsnorm(x, g, zero_centered_gamma=True,
                                                          implementation=implementation),
                 (x, gamma), (0, 1), dtype, interpret=False)
    check_kernel(lambda x, r, g, b, implementation: ops.residual_norm(
        x, r, g, b, dropout_rate=0.1, dropout_rng=jax.random.key(5), implementation=implementation),
        (x, residual, gamma, beta), (0, 1, 2, 3), dtype, interpret=False)
    scale = jnp.float32(100.0)
    q, amax = ops.norm_fp8(x, gamma, beta, scale, implementation="pallas_triton")
    q_ref, amax_ref = ops.norm_fp8(x, gamma, beta, scale, implementation="xla")
    np.testing.assert_allclose(amax, amax_ref, rtol=1e-5)
    assert np.mean(np.asarray(q, np.float32) == np.asarray(q_ref, np.float32)) > 0.99


def test_gelu_sigmoid_form_is_the_tanh_form_without_its_cancellation():
    """``x * sigmoid(2u)``, the form the FP8 kernels compute GELU in on cuda (`GELU_PTX_SIGMOID`), and its
    derivative equal the tanh form in float32 within float32 rounding of float64 GELU; in the negative
    tail, where ``1 + tanh(u)`` cancels, the sigmoid form keeps each value's relative error to that of
    the exponential's argument rounded to float32 (about ``|2u| * 2^-24``), as `_sigmoid_ptx` does."""
    from mtjax.kernels.activation import _gelu
    from mtjax.kernels.common import LOG2E

    x = jnp.concatenate([jnp.linspace(-12.0, 12.0, 20001, dtype=jnp.float32), jnp.float32([-30.0, 0.0, 30.0])])
    # ex2.approx(z * -log2 e) with its argument rounded to float32, then an exact reciprocal
    sigmoid = lambda z: 1.0 / (1.0 + jnp.exp2((z * -LOG2E).astype(jnp.float32)))
    y_s, dy_s = _gelu(x, sigmoid=sigmoid)
    y_t, dy_t = _gelu(x)
    x64 = np.asarray(x, np.float64)
    u = np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)
    with np.errstate(over="ignore"):  # exp overflowing to inf gives sigmoid 0, as in float32
        s = 1 / (1 + np.exp(-2 * u))
    y64 = x64 * s
    dy64 = s + 2 * x64 * s * (1 - s) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x64 ** 2)
    scale = np.maximum(np.abs(x64), 1.0)
    for got in (y_s, y_t):  # both within float32 rounding of the output's scale
        np.testing.assert_allclose(np.asarray(got), y64, rtol=0, atol=4e-7 * scale.max())
    np.testing.assert_allclose(np.asarray(dy_s), dy64, rtol=1e-6, atol=1e-6)
    tail = (x64 < -3) & (np.abs(y64) > 1e-30)
    rel_s = np.abs(np.asarray(y_s, np.float64)[tail] / y64[tail] - 1)
    rel_t = np.abs(np.asarray(y_t, np.float64)[tail] / y64[tail] - 1)
    assert rel_s.max() < 3e-5 and rel_t.max() > 1e-4
    # As an FP8 GEMM's output gradient (E5M2, scaled): the sigmoid form's codes are float64's, while
    # about 1 % of the tanh form's (the XLA reference's) are a step away.
    dy = jax.random.normal(jax.random.PRNGKey(0), x.shape)

    def e5m2(g):
        return np.asarray(jnp.asarray(np.asarray(g, np.float64) * 1e3, jnp.float32).astype(jnp.float8_e5m2), np.float32)

    want = e5m2(np.asarray(dy, np.float64) * dy64)
    assert np.mean(e5m2(dy * dy_s) == want) > 0.9999
    assert np.mean(e5m2(dy * dy_t) == want) < 0.995


@pytest.mark.gpu
@pytest.mark.parametrize("activation", sorted(KERNEL_ACTIVATIONS))
def test_activation_kernels_on_gpu(activation):
    shape = (2, 1500) if ops.is_gated(activation) else (1500,)
    x = _random(0, (777,) + shape, jnp.bfloat16, 2.0)
    bias = _random(1, shape, jnp.bfloat16)
    check_kernel(lambda x, b, implementation: ops.activation(x, activation, b, implementation=implementation),
                 (x, bias), (0, 1), jnp.bfloat16, interpret=False)
    # GELU's FP8 kernels compute x * sigmoid(2u) by ex2.approx and rcp.approx: relative error about
    # |2u| * 2^-24, and the amax is taken where GELU is nearly x.
    amax_rtol = 1e-5
    q, amax = ops.activation_fp8(x, activation, bias, scale=jnp.float32(50.0), implementation="pallas_triton")
    q_ref, amax_ref = ops.activation_fp8(x, activation, bias, scale=jnp.float32(50.0), implementation="xla")
    np.testing.assert_allclose(amax, amax_ref, rtol=amax_rtol)
    assert np.mean(np.asarray(q, np.float32) == np.asarray(q_ref, np.float32)) > 0.99
    for rows, hidden in ((777, 1500), (1024, 1536)):  # partial, then whole 64x64 tiles of the FP8 backward
        x = _random(3, (rows, 2, hidden) if ops.is_gated(activation) else (rows, hidden), jnp.bfloat16, 2.0)
        bias = _random(4, x.shape[1:], jnp.bfloat16)
        dy = _random(5, (rows, hidden), jnp.bfloat16)
        got = ops.activation_grad_fp8(x, dy, activation, bias, scale=jnp.float32(1e3), implementation="pallas_triton")
        want = ops.activation_grad_fp8(x, dy, activation, bias, scale=jnp.float32(1e3), implementation="xla")
        # GELU's reference gradient, in tanh form, loses digits where 1 + tanh and 1 - tanh^2 cancel: about
        # 1 % of its E5M2 codes are a step from float64's, which the sigmoid form matches (the CPU test
        # test_gelu_sigmoid_form_is_the_tanh_form_without_its_cancellation).
        agree = 0.98 if activation in ("gelu", "geglu") else 0.99
        assert np.mean(np.asarray(got[0], np.float32) == np.asarray(want[0], np.float32)) > agree
        np.testing.assert_array_equal(np.asarray(got[1], np.float32),
                                      np.asarray(got[0], np.float32).reshape(rows, -1).T)
        np.testing.assert_allclose(got[2], want[2], rtol=amax_rtol)
        np.testing.assert_allclose(got[3], want[3], rtol=1e-3, atol=1e-3 * float(np.max(np.abs(want[3]))))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_softmax_kernel_on_gpu(dtype):
    logits = _random(0, (2, 4, 100, 1000), dtype, 3.0)
    mask = jax.random.bernoulli(jax.random.key(1), 0.8, (2, 1, 1, 1000))
    check_kernel(lambda l, implementation: ops.softmax(l, mask, scale=0.3, causal=True, implementation=implementation),
                 (logits,), (0,), dtype, interpret=False)


def test_bench_norm_rows_fit_the_report():
    """`mtjax bench norm` rows (one tiny case, kernels in interpret mode) have the report's fields."""
    from mtjax.bench import norm as norm_bench
    from mtjax.bench import report

    rows: list[dict] = []
    norm_bench._softmax_case(rows, quick=True)
    rows = report.complete(rows, {"copy_gbps": 1.0}, 989.0)
    native = ["triton"] if backend.triton_problem() is None else []  # the native kernels need the triton package
    assert [r["implementation"] for r in rows] == ["mtjax", *native, "xla"]
    assert all(r["speedup_vs_peer"] > 0 for r in rows[:-1]) and rows[0]["extra"]["auto"]
