"""The jax.numpy references of mtjax.ops against float64 numpy formulas, forward and gradients."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtjax import ops
from tests.ops import numpy_reference as npref

pytestmark = pytest.mark.usefixtures("fast_compiles")

RTOL = 1e-5


def _rand(seed, shape, scale=1.0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale


def directional_derivative_check(f_jax, f_np, args, argnum, seed, rtol=2e-3):
    """<grad f, v> from jax (f32) against a float64 central difference of the numpy formula.

    Both sides contract the output with the same random weights, so every output entry's gradient counts.
    """
    rng = np.random.default_rng(seed)
    out = np.asarray(f_np(*args))
    w = rng.normal(size=out.shape)
    v = rng.normal(size=np.shape(args[argnum]))

    def loss(x):
        new = list(args)
        new[argnum] = x
        return jnp.sum(f_jax(*new).astype(jnp.float32) * w.astype(np.float32))

    g = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(args[argnum])), np.float64)  # one compile, not one per op
    eps = 1e-5

    def np_loss(delta):
        new = [np.asarray(a, np.float64) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a for a in args]
        new[argnum] = new[argnum] + delta * v
        return float(np.sum(f_np(*new) * w))

    fd = (np_loss(eps) - np_loss(-eps)) / (2 * eps)
    np.testing.assert_allclose(np.sum(g * v), fd, rtol=rtol, atol=rtol * (1 + abs(fd)))


shapes = st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 67))


@given(shape=shapes, zero_centered=st.booleans(), with_beta=st.booleans(), seed=st.integers(0, 2**16))
def test_layernorm_matches_numpy(shape, zero_centered, with_beta, seed):
    hidden = shape[-1]
    x, gamma, beta = _rand(seed, shape, 3.0) + 1.0, _rand(seed + 1, (hidden,)), _rand(seed + 2, (hidden,))
    beta = beta if with_beta else None
    y = ops.layernorm(x, gamma, beta, epsilon=1e-5, zero_centered_gamma=zero_centered)
    np.testing.assert_allclose(y, npref.layernorm(x, gamma, beta, 1e-5, zero_centered), rtol=RTOL, atol=RTOL * 10)
    if hidden > 1:
        f = lambda x, g: ops.layernorm(x, g, beta, epsilon=1e-5, zero_centered_gamma=zero_centered)
        fn = lambda x, g: npref.layernorm(x, g, beta, 1e-5, zero_centered)
        directional_derivative_check(f, fn, [x, gamma], 0, seed)
        directional_derivative_check(f, fn, [x, gamma], 1, seed)


@given(shape=shapes, zero_centered=st.booleans(), seed=st.integers(0, 2**16))
def test_rmsnorm_matches_numpy(shape, zero_centered, seed):
    x, gamma = _rand(seed, shape, 2.0), _rand(seed + 1, (shape[-1],))
    y = ops.rmsnorm(x, gamma, epsilon=1e-5, zero_centered_gamma=zero_centered)
    np.testing.assert_allclose(y, npref.rmsnorm(x, gamma, 1e-5, zero_centered), rtol=RTOL, atol=RTOL * 10)
    f = lambda x, g: ops.rmsnorm(x, g, epsilon=1e-5, zero_centered_gamma=zero_centered)
    fn = lambda x, g: npref.rmsnorm(x, g, 1e-5, zero_centered)
    directional_derivative_check(f, fn, [x, gamma], 0, seed)
    directional_derivative_check(f, fn, [x, gamma], 1, seed)


@given(name=st.sampled_from(sorted(ops.ACTIVATIONS)), rows=st.integers(1, 4), half=st.integers(1, 40),
       with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_activation_matches_numpy(name, rows, half, with_bias, seed):
    shape = (2, half) if ops.is_gated(name) else (half,)
    x = _rand(seed, (rows,) + shape, 2.0)
    bias = _rand(seed + 1, shape) if with_bias else None
    y = ops.activation(x, name, bias)
    np.testing.assert_allclose(y, npref.activation(x, name, bias), rtol=RTOL, atol=1e-5)
    f = lambda x: ops.activation(x, name, bias)
    fn = lambda x: npref.activation(x, name, bias)
    directional_derivative_check(f, fn, [x], 0, seed, rtol=5e-3)


@pytest.mark.parametrize("te_tuple,name",
                         [(("silu", "linear"), "swiglu"), (("gelu",), "gelu"), (("gelu", "linear"), "geglu"),
                          (("squared_relu",), "squared_relu"), (("squared_relu", "linear"), "sreglu"),
                          (("quick_gelu", "linear"), "qgeglu"), (("sigmoid", "linear"), "glu"),
                          (("clamped_silu", "clamped_linear"), "clamped_swiglu")])
def test_activation_accepts_te_tuples(te_tuple, name):
    x = _rand(0, (2, 2, 8))
    np.testing.assert_array_equal(ops.activation(x, te_tuple), ops.activation(x, name))


@pytest.mark.parametrize("name", ["squared_relu", "sreglu", "qgeglu", "glu", "clamped_swiglu"])
def test_transformer_engine_activations_match_numpy_past_the_clamp(name):
    """Inputs up to about +-20: clamped_swiglu's clamps (activated input at 7, gate at +-7) are crossed,
    where its gradient is 0."""
    shape = (2, 16) if ops.is_gated(name) else (16,)
    x = _rand(3, (4,) + shape, 8.0)
    np.testing.assert_allclose(ops.activation(x, name), npref.activation(x, name, None), rtol=RTOL, atol=1e-5)
    directional_derivative_check(lambda x: ops.activation(x, name), lambda x: npref.activation(x, name, None),
                                 [x], 0, 3, rtol=5e-3)
    if name == "clamped_swiglu":
        assert np.any(np.abs(np.asarray(x)) > 7.0)
        dx = jax.grad(lambda x: ops.activation(x, name).sum())(x)
        np.testing.assert_array_equal(np.asarray(dx)[..., 0, :][np.asarray(x)[..., 0, :] > 7.0], 0.0)
        np.testing.assert_array_equal(np.asarray(dx)[..., 1, :][np.abs(np.asarray(x)[..., 1, :]) > 7.0], 0.0)


def test_activation_rejects_unknown_names_and_callables():
    x = _rand(0, (2, 8))
    with pytest.raises(ValueError, match="not supported; accepted:.*clamped_swiglu"):
        ops.activation(x, ("tanh", "linear"))
    with pytest.raises(ValueError, match="not supported"):
        ops.activation(x, (jax.nn.relu,))


@given(q=st.integers(1, 6), k=st.integers(1, 9), causal=st.booleans(), masked=st.booleans(),
       scale=st.floats(0.1, 3.0), seed=st.integers(0, 2**16))
def test_softmax_matches_numpy(q, k, causal, masked, scale, seed):
    logits = _rand(seed, (2, q, k), 2.0)
    mask = np.random.default_rng(seed).random((2, q, k)) > 0.4 if masked else None
    keep = np.ones((2, q, k), bool) if mask is None else mask
    if causal:
        keep = keep & npref.causal(q, k)
    y = ops.softmax(logits, None if mask is None else jnp.asarray(mask), scale=scale, causal=causal)
    expected = npref.softmax(logits * scale, keep)
    np.testing.assert_allclose(y, expected, rtol=RTOL, atol=1e-6)
    assert np.all(np.isfinite(np.asarray(y)))
    f = lambda x: ops.softmax(x, None if mask is None else jnp.asarray(mask), scale=scale, causal=causal)
    fn = lambda x: npref.softmax(x * scale, keep)
    directional_derivative_check(f, fn, [logits], 0, seed)


def test_softmax_fully_masked_row_is_zero_with_finite_grad():
    logits = _rand(0, (3, 4))
    mask = jnp.array([[True] * 4, [False] * 4, [True, False, True, False]])
    y = ops.softmax(logits, mask)
    np.testing.assert_array_equal(y[1], 0.0)
    g = jax.grad(lambda x: jnp.sum(ops.softmax(x, mask) ** 2))(logits)
    assert np.all(np.isfinite(np.asarray(g)))


attention_cases = st.fixed_dictionaries({
    "batch": st.integers(1, 2), "q_len": st.integers(1, 7), "kv_len": st.integers(1, 9),
    "kv_heads": st.sampled_from([1, 2]), "groups": st.sampled_from([1, 2, 3]), "head_dim": st.sampled_from([4, 8]),
    "mask_type": st.sampled_from(ops.MASK_TYPES), "window": st.sampled_from([None, (2, 0), (1, 1), (-1, 2)]),
    "soft_cap": st.sampled_from([None, 5.0]), "with_bias": st.booleans(), "seed": st.integers(0, 2**16),
})


@given(case=attention_cases)
def test_attention_matches_numpy(case):
    c = case
    b, t, s, kh, d = c["batch"], c["q_len"], c["kv_len"], c["kv_heads"], c["head_dim"]
    n = kh * c["groups"]
    seed = c["seed"]
    q, k, v = _rand(seed, (b, t, n, d)), _rand(seed + 1, (b, s, kh, d)), _rand(seed + 2, (b, s, kh, d))
    bias = _rand(seed + 3, (1, n, t, s)) if c["with_bias"] else None
    rng = np.random.default_rng(seed)
    kwargs = {}
    keep = np.ones((b, 1, t, s), bool)
    if c["mask_type"] in ("padding", "padding_causal"):
        q_seg = rng.integers(0, 3, size=(b, t)).astype(np.int32)
        kv_seg = rng.integers(0, 3, size=(b, s)).astype(np.int32)
        kwargs.update(q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg))
        same = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] != 0) & (kv_seg[:, None, :] != 0)
        keep &= same[:, None]
    if c["mask_type"] in ("causal", "padding_causal"):
        keep &= npref.causal(t, s)
    if c["window"] is not None:
        left, right = c["window"]
        qp = np.arange(t)[:, None] + (s - t)
        kp = np.arange(s)[None, :]
        win = np.ones((t, s), bool)
        if left >= 0:
            win &= kp >= qp - left
        if right >= 0:
            win &= kp <= qp + right
        keep &= win
    scale = d ** -0.5
    expected = npref.attention(q, k, v, bias=bias, keep=keep, scale=scale, soft_cap=c["soft_cap"])

    def f(q, k, v):
        return ops.attention(q, k, v, bias=None if bias is None else jnp.asarray(bias), mask_type=c["mask_type"],
                             window_size=c["window"], logits_soft_cap=c["soft_cap"], **kwargs)

    out = jax.jit(f)(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    fn = lambda q, k, v: npref.attention(q, k, v, bias=bias, keep=keep, scale=scale, soft_cap=c["soft_cap"])
    for argnum in range(3):
        directional_derivative_check(f, fn, [q, k, v], argnum, seed + argnum)


def test_attention_seqlens_equal_segment_ids():
    q, k = _rand(0, (2, 5, 2, 4)), _rand(1, (2, 6, 2, 4))
    a = ops.attention(q, k, k, mask_type="padding", q_seqlens=jnp.array([5, 3]), kv_seqlens=jnp.array([6, 2]))
    qs = (np.arange(5)[None] < np.array([[5], [3]])).astype(np.int32)
    ks = (np.arange(6)[None] < np.array([[6], [2]])).astype(np.int32)
    b = ops.attention(q, k, k, mask_type="padding", q_segment_ids=jnp.asarray(qs), kv_segment_ids=jnp.asarray(ks))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[1, 3:], 0.0)  # padded queries return zeros


def test_attention_dropout_is_deterministic_per_key_and_scales():
    q = _rand(0, (1, 4, 2, 8))
    key = jax.random.key(3)
    a = ops.attention(q, q[:, :, :1], q[:, :, :1], dropout_rate=0.5, dropout_rng=key)
    b = ops.attention(q, q[:, :, :1], q[:, :, :1], dropout_rate=0.5, dropout_rng=key)
    c = ops.attention(q, q[:, :, :1], q[:, :, :1])
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_gqa_does_not_repeat_kv_in_the_jaxpr():
    q, k = jnp.ones((1, 5, 8, 16)), jnp.ones((1, 7, 1, 16))
    jaxpr = str(jax.make_jaxpr(lambda q, k: ops.attention(q, k, k))(q, k))
    assert "f32[1,7,8,16]" not in jaxpr  # K/V repeated to 8 heads would have this shape


def test_attention_backward_gemms_run_in_the_operand_dtype():
    """bf16 attention with a bias (T5's relative positions take this path on GPUs): every GEMM of the
    backward is bf16 x bf16 (float32 cotangents would make them float32 GEMMs), and the gradients stay
    within bf16 rounding of the float32 ones."""
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (2, 64, 4, 32)) for key in keys[:3])
    bias = jax.random.normal(keys[3], (1, 4, 64, 64))

    def grads(dtype):
        loss = lambda *args: jnp.sum(ops.attention(*(a.astype(dtype) for a in args[:3]), bias=args[3].astype(dtype),  # noqa: E731
                                                   implementation="xla").astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2, 3)), loss

    grad_bf16, _ = grads(jnp.bfloat16)
    text = jax.jit(grad_bf16).lower(q, k, v, bias).as_text()
    operands = re.findall(r"stablehlo\.dot_general.*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)
    assert len(operands) == 6 and all(a.endswith("bf16>") and b.endswith("bf16>") for a, b in operands), operands
    want = grads(jnp.float32)[0](q, k, v, bias)
    for got, ref in zip(grad_bf16(q, k, v, bias), want):
        assert float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)) < 2e-2


@pytest.mark.parametrize("call,match", [
    (lambda: ops.layernorm(jnp.ones((2, 4)), jnp.ones(5)), "gamma"),
    (lambda: ops.layernorm(jnp.ones((2, 4), jnp.int32), jnp.ones(4)), "x has dtype"),
    (lambda: ops.rmsnorm(jnp.ones((2, 4)), jnp.ones(4), epsilon=0.0), "epsilon"),
    (lambda: ops.activation(jnp.ones((2, 4)), "swish"), "activation_type"),
    (lambda: ops.activation(jnp.ones((3, 4)), "swiglu"), r"\[\.\.\., 2, hidden\]"),
    (lambda: ops.activation(jnp.ones((2, 4)), "gelu", jnp.ones((2, 4))), "bias"),
    (lambda: ops.activation(jnp.ones((3, 2, 4)), "geglu", jnp.ones(8)), r"bias.*expected \(2, 4\)"),
    (lambda: ops.softmax(jnp.ones((2, 4)), jnp.ones((2, 4))), "mask"),
    (lambda: ops.attention(jnp.ones((1, 2, 3, 4)), jnp.ones((1, 2, 2, 4)), jnp.ones((1, 2, 2, 4))), "multiple"),
    (lambda: ops.attention(*[jnp.ones((1, 2, 2, 4))] * 3, mask_type="full"), "mask_type"),
    (lambda: ops.attention(*[jnp.ones((1, 2, 2, 4))] * 3, mask_type="padding"), "padding"),
    (lambda: ops.attention(*[jnp.ones((1, 2, 2, 4))] * 3, dropout_rate=0.1), "dropout_rng"),
    (lambda: ops.attention(jnp.ones((2, 4)), jnp.ones((2, 4)), jnp.ones((2, 4))), "rank 4"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("name,fn", [
    ("layernorm", lambda x, g: ops.layernorm(x, g, jnp.zeros_like(g))),
    ("rmsnorm", lambda x, g: ops.rmsnorm(x, g)),
    ("swiglu", lambda x, g: ops.activation(x.reshape(x.shape[0], 2, -1), "swiglu")),
])
def test_references_keep_only_their_inputs_for_the_backward(name, fn):
    from jax._src.ad_checkpoint import saved_residuals

    x, g = jnp.ones((64, 32), jnp.bfloat16), jnp.ones(32)
    saved = saved_residuals(lambda x, g: fn(x, g).astype(jnp.float32).sum(), x, g)
    activation_sized = [r for r, _ in saved if r.size >= x.size]
    assert [r.dtype for r in activation_sized] == [jnp.bfloat16], saved  # x itself, no float32 copies
