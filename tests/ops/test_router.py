"""mtjax.ops.route, load_balancing_loss and router_z_loss against float64 numpy formulations
(token by token), forward and gradients; argument errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtjax import ops

pytestmark = pytest.mark.usefixtures("fast_compiles")


def np_route(logits, top_k, score_function="softmax", num_groups=None, group_top_k=None, bias=None,
             normalize=True, scaling=1.0):
    """One token at a time in float64: ``(weights, experts, probs)``."""
    logits = np.asarray(logits, np.float64)
    tokens, experts = logits.shape
    if score_function == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
        probs = scores
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
        probs = scores / scores.sum(-1, keepdims=True)
    weights, chosen = np.zeros((tokens, top_k)), np.zeros((tokens, top_k), np.int64)
    for t in range(tokens):
        sel = scores[t] + (0.0 if bias is None else np.asarray(bias, np.float64))
        allowed = np.ones(experts, bool)
        if num_groups is not None:
            size = experts // num_groups
            per_group = max(top_k // group_top_k, 1)
            group_score = [np.sort(sel[g * size:(g + 1) * size])[::-1][:per_group].sum() for g in range(num_groups)]
            best = np.argsort(group_score)[::-1][:group_top_k]
            allowed[:] = False
            for g in best:
                allowed[g * size:(g + 1) * size] = True
        order = [e for e in np.argsort(-sel, kind="stable") if allowed[e]][:top_k]
        chosen[t] = order
        w = scores[t, order]
        weights[t] = (w / w.sum() if normalize else w) * scaling
    return weights, chosen, probs


CASES = [
    {"top_k": 2},
    {"top_k": 1, "normalize_weights": False},
    {"top_k": 3, "score_function": "sigmoid", "scaling_factor": 2.5},
    {"top_k": 4, "score_function": "sigmoid", "num_groups": 4, "group_top_k": 2},
    {"top_k": 2, "score_function": "softmax", "num_groups": 2, "group_top_k": 1, "normalize_weights": False},
]


def _np_kwargs(case):
    return {"top_k": case["top_k"], "score_function": case.get("score_function", "softmax"),
                "num_groups": case.get("num_groups"), "group_top_k": case.get("group_top_k"),
                "normalize": case.get("normalize_weights", True), "scaling": case.get("scaling_factor", 1.0)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_route_matches_numpy(case, with_bias):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 8)).astype(np.float32)
    bias = (rng.normal(size=8) * 0.3).astype(np.float32) if with_bias else None
    out = ops.route(jnp.asarray(logits), expert_bias=None if bias is None else jnp.asarray(bias), **case)
    weights, experts, probs = np_route(logits, bias=bias, **_np_kwargs(case))
    np.testing.assert_array_equal(out.experts, experts)
    np.testing.assert_allclose(out.weights, weights, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out.probs, probs, rtol=1e-5, atol=1e-7)
    assert out.experts.dtype == jnp.int32 and out.weights.dtype == jnp.float32


def test_bias_steers_selection_not_weights():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(8, 6)), jnp.float32)
    bias = jnp.zeros(6).at[5].set(100.0)
    plain = ops.route(logits, top_k=2, score_function="sigmoid", normalize_weights=False)
    biased = ops.route(logits, top_k=2, score_function="sigmoid", expert_bias=bias, normalize_weights=False)
    assert np.all(np.asarray(biased.experts)[:, 0] == 5)
    np.testing.assert_allclose(biased.weights[:, 0], jax.nn.sigmoid(logits[:, 5]), rtol=1e-6)
    np.testing.assert_array_equal(biased.probs, plain.probs)
    g = jax.grad(lambda b: jnp.sum(ops.route(logits, top_k=2, score_function="sigmoid", expert_bias=b).weights))(bias)
    assert np.all(np.asarray(g) == 0)


@pytest.mark.parametrize("case", CASES)
def test_route_weight_gradient_matches_numpy_difference(case):
    """<d weights / d logits, v> against a float64 central difference of the numpy formulation."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(6, 8))
    w_out = rng.normal(size=(6, case["top_k"]))
    v = rng.normal(size=logits.shape)
    g = jax.grad(lambda x: jnp.sum(ops.route(x, **case).weights * w_out.astype(np.float32)))(
        jnp.asarray(logits, jnp.float32))
    eps = 1e-6
    kw = _np_kwargs(case)
    up = np.sum(np_route(logits + eps * v, **kw)[0] * w_out)
    down = np.sum(np_route(logits - eps * v, **kw)[0] * w_out)
    diff = (up - down) / (2 * eps)
    np.testing.assert_allclose(np.sum(np.asarray(g, np.float64) * v), diff, rtol=1e-3, atol=1e-5)


@given(tokens=st.integers(1, 12), experts_per_group=st.integers(1, 4), num_groups=st.integers(1, 4),
       seed=st.integers(0, 99), sigmoid=st.booleans())
def test_route_hypothesis(tokens, experts_per_group, num_groups, seed, sigmoid):
    experts = experts_per_group * num_groups
    rng = np.random.default_rng(seed)
    group_top_k = int(rng.integers(1, num_groups + 1))
    top_k = int(rng.integers(1, group_top_k * experts_per_group + 1))
    logits = rng.normal(size=(tokens, experts)).astype(np.float32)
    kw = {"top_k": top_k, "score_function": "sigmoid" if sigmoid else "softmax", "num_groups": num_groups,
              "group_top_k": group_top_k}
    out = jax.jit(functools.partial(ops.route, **kw))(jnp.asarray(logits))
    weights, chosen, _ = np_route(logits, **{**kw, "normalize": True})
    np.testing.assert_array_equal(out.experts, chosen)
    np.testing.assert_allclose(out.weights, weights, rtol=1e-5, atol=1e-6)


def test_load_balancing_loss_matches_numpy_and_gradient():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(20, 5)).astype(np.float32)
    r = ops.route(jnp.asarray(logits), top_k=2)
    counts = np.bincount(np.asarray(r.experts).ravel(), minlength=5)
    expected = 5 * np.sum(counts / r.experts.size * np.asarray(r.probs, np.float64).mean(0))
    np.testing.assert_allclose(ops.load_balancing_loss(r.probs, r.experts, 5), expected, rtol=1e-6)
    g = jax.grad(ops.load_balancing_loss)(r.probs, r.experts, 5)
    np.testing.assert_allclose(g, np.broadcast_to(5 * counts / r.experts.size / 20, (20, 5)), rtol=1e-6)
    np.testing.assert_array_equal(ops.expert_counts(r.experts, 5), counts)
    uniform = jnp.full((4, 4), 0.25)
    balanced = jnp.array([[0], [1], [2], [3]], jnp.int32)
    np.testing.assert_allclose(ops.load_balancing_loss(uniform, balanced, 4), 1.0, rtol=1e-6)


def test_router_z_loss_matches_numpy_and_gradient():
    logits = np.random.default_rng(4).normal(size=(10, 6)) * 3
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(ops.router_z_loss(jnp.asarray(logits, jnp.float32)), np.mean(lse ** 2), rtol=1e-5)
    g = jax.grad(ops.router_z_loss)(jnp.asarray(logits, jnp.float32))
    softmax = np.exp(logits - lse[:, None])
    np.testing.assert_allclose(g, 2 * lse[:, None] * softmax / 10, rtol=1e-4, atol=1e-7)


def test_update_expert_bias():
    bias = jnp.array([0.0, 0.5, -0.5, 0.0])
    new = ops.update_expert_bias(bias, jnp.array([10, 2, 4, 4], jnp.int32), 0.01)  # mean load 5
    np.testing.assert_allclose(new, [-0.01, 0.51, -0.49, 0.01], rtol=1e-6)
    with pytest.raises(ValueError, match="counts"):
        ops.update_expert_bias(bias, jnp.zeros(3, jnp.int32), 0.01)
    with pytest.raises(ValueError, match="update_rate"):
        ops.update_expert_bias(bias, jnp.zeros(4, jnp.int32), -1.0)


def test_argument_errors():
    logits = jnp.zeros((4, 8))
    with pytest.raises(ValueError, match="top_k"):
        ops.route(logits, top_k=9)
    with pytest.raises(ValueError, match="score_function"):
        ops.route(logits, top_k=2, score_function="relu")
    with pytest.raises(ValueError, match="together"):
        ops.route(logits, top_k=2, num_groups=2)
    with pytest.raises(ValueError, match="divide"):
        ops.route(logits, top_k=2, num_groups=3, group_top_k=1)
    with pytest.raises(ValueError, match="cannot hold"):
        ops.route(logits, top_k=5, num_groups=4, group_top_k=2)
    with pytest.raises(ValueError, match="expert_bias"):
        ops.route(logits, top_k=2, expert_bias=jnp.zeros(7))
    with pytest.raises(TypeError, match="logits"):
        ops.route(logits.astype(jnp.int32), top_k=2)
    for factor in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="scaling_factor"):
            ops.route(logits, top_k=2, scaling_factor=factor)
    with pytest.raises(ValueError, match="probs"):
        ops.load_balancing_loss(jnp.zeros((4, 7)), jnp.zeros((4, 2), jnp.int32), 8)
    with pytest.raises(ValueError, match="experts"):
        ops.load_balancing_loss(jnp.zeros((4, 8)), jnp.zeros((3, 2), jnp.int32), 8)
