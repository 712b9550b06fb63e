"""mtjax.ops.permute / unpermute against numpy (a stable sort by expert, capacity by token order) and
their gradients against autodiff of an independent dense formulation (one-hot dispatch matrices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtjax import ops

pytestmark = pytest.mark.usefixtures("fast_compiles")


def np_permute(x, experts, num_experts, capacity=None, align=1):
    """``(x_sorted, group_sizes, row_of_assignment or -1, num_dropped)``, assignment by assignment."""
    tokens, top_k = experts.shape
    per_expert = [[] for _ in range(num_experts)]
    for t in range(tokens):
        for j in range(top_k):
            if 0 <= experts[t, j] < num_experts:  # another id: dropped
                per_expert[experts[t, j]].append(t * top_k + j)
    kept = [a if capacity is None else a[:capacity] for a in per_expert]
    sizes = [-(-len(a) // align) * align for a in kept]
    rows = tokens * top_k + num_experts * (align - 1)
    if capacity is not None:
        rows = min(rows, num_experts * (-(-capacity // align) * align))
    x_sorted = np.zeros((rows, x.shape[1]), x.dtype)
    row_of = -np.ones(tokens * top_k, np.int64)
    start = 0
    for assignments, size in zip(kept, sizes):
        assert start % align == 0
        for r, a in enumerate(assignments, start):
            x_sorted[r] = x[a // top_k]
            row_of[a] = r
        start += size
    assert start <= rows
    return x_sorted, np.array(sizes), row_of, tokens * top_k - sum(map(len, kept))


def dense_dispatch(row_of, rows, tokens, top_k):
    """float ``[tokens, top_k, rows]``: 1 where assignment (t, j) sits in row r."""
    d = np.zeros((tokens * top_k, rows), np.float32)
    for a, r in enumerate(row_of):
        if r >= 0:
            d[a, r] = 1.0
    return d.reshape(tokens, top_k, rows)


def random_experts(rng, tokens, top_k, num_experts):
    return np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)


@pytest.mark.parametrize("capacity, align", [(None, 1), (1, 1), (2, 1), (100, 1), (None, 4), (2, 16)])
def test_permute_unpermute_match_numpy_and_dense_gradients(capacity, align):
    rng = np.random.default_rng(0)
    tokens, top_k, num_experts, hidden = 9, 2, 4, 5
    x = rng.normal(size=(tokens, hidden)).astype(np.float32)
    experts = random_experts(rng, tokens, top_k, num_experts)
    experts[:6, 0] = 1  # expert 1 overloaded: capacity drops some
    experts[:6, 1] = np.where(experts[:6, 1] == 1, 2, experts[:6, 1])
    weights = rng.uniform(size=(tokens, top_k)).astype(np.float32)
    x_sorted, group_sizes, state = ops.permute(jnp.asarray(x), jnp.asarray(experts), num_experts, capacity=capacity,
                                               align=align)
    exp_sorted, exp_sizes, row_of, dropped = np_permute(x, experts, num_experts, capacity, align)
    np.testing.assert_array_equal(x_sorted, exp_sorted)
    np.testing.assert_array_equal(group_sizes, exp_sizes)
    assert int(state.num_dropped) == dropped
    assert (dropped > 0) == (capacity in (1, 2))

    y = rng.normal(size=x_sorted.shape).astype(np.float32)
    out = ops.unpermute(jnp.asarray(y), jnp.asarray(weights), state)
    d = dense_dispatch(row_of, y.shape[0], tokens, top_k)
    np.testing.assert_allclose(out, np.einsum("tk,tkr,rh->th", weights, d, y), rtol=1e-5, atol=1e-6)

    # Gradients of a loss through permute -> (a row-wise map) -> unpermute, against the dense form.
    cot = rng.normal(size=(tokens, hidden)).astype(np.float32)

    def ours(x, w):
        xs, _, st = ops.permute(x, jnp.asarray(experts), num_experts, capacity=capacity, align=align)
        return jnp.sum(ops.unpermute(jnp.tanh(xs) * 1.5, w, st) * cot)

    def dense(x, w):
        xs = jnp.einsum("tkr,th->rh", d, x)
        return jnp.sum(jnp.einsum("tk,tkr,rh->th", w, d, jnp.tanh(xs) * 1.5) * cot)

    got = jax.grad(ours, (0, 1))(jnp.asarray(x), jnp.asarray(weights))
    want = jax.grad(dense, (0, 1))(jnp.asarray(x), jnp.asarray(weights))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_round_trip_with_normalized_weights_is_identity():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(12, 8)), jnp.bfloat16)
    r = ops.route(jnp.asarray(rng.normal(size=(12, 6)), jnp.float32), top_k=3)
    xs, sizes, st = ops.permute(x, r.experts, 6)
    assert xs.dtype == jnp.bfloat16 and int(sizes.sum()) == 36
    np.testing.assert_allclose(np.asarray(ops.unpermute(xs, r.weights, st), np.float32), np.asarray(x, np.float32),
                               rtol=1e-2)


@given(tokens=st.integers(1, 10), top_k=st.integers(1, 3), num_experts=st.integers(3, 6),
       capacity=st.one_of(st.none(), st.integers(1, 6)), align=st.sampled_from([1, 1, 4, 16]),
       seed=st.integers(0, 99))
def test_permute_hypothesis(tokens, top_k, num_experts, capacity, align, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(tokens, 3)).astype(np.float32)
    experts = random_experts(rng, tokens, top_k, num_experts)
    permute = jax.jit(ops.permute, static_argnums=2, static_argnames=("capacity", "align"))
    x_sorted, group_sizes, state = permute(jnp.asarray(x), jnp.asarray(experts), num_experts, capacity=capacity,
                                           align=align)
    exp_sorted, exp_sizes, row_of, dropped = np_permute(x, experts, num_experts, capacity, align)
    np.testing.assert_array_equal(x_sorted, exp_sorted)
    np.testing.assert_array_equal(group_sizes, exp_sizes)
    assert int(state.num_dropped) == dropped
    weights = rng.uniform(size=(tokens, top_k)).astype(np.float32)
    d = dense_dispatch(row_of, x_sorted.shape[0], tokens, top_k)
    np.testing.assert_allclose(jax.jit(ops.unpermute)(x_sorted, jnp.asarray(weights), state),
                               np.einsum("tk,tkr,rh->th", weights, d, exp_sorted), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("capacity", [None, 2])
def test_expert_ids_outside_the_experts_are_dropped(capacity):
    """An id < 0 or >= num_experts reaches no expert (not the last one, as negative indices would wrap)."""
    experts = np.array([[0], [1], [-1], [2], [3], [1], [4]], np.int32)
    x = np.random.default_rng(0).normal(size=(7, 3)).astype(np.float32)
    x_sorted, sizes, state = ops.permute(jnp.asarray(x), jnp.asarray(experts), 4, capacity=capacity)
    want_sorted, want_sizes, row_of, dropped = np_permute(x, experts, 4, capacity)
    np.testing.assert_array_equal(sizes, want_sizes)
    np.testing.assert_array_equal(sizes, [1, 2, 1, 1])
    np.testing.assert_allclose(x_sorted[:5], want_sorted[:5])
    assert int(state.num_dropped) == dropped == 2
    weights = jnp.ones((7, 1))
    out = np.asarray(ops.unpermute(x_sorted, weights, state))
    np.testing.assert_allclose(out[[2, 6]], 0.0)  # the dropped tokens get nothing back
    np.testing.assert_allclose(out[[0, 1, 3, 4, 5]], x[[0, 1, 3, 4, 5]], rtol=1e-6)
    np.testing.assert_array_equal(ops.expert_counts(jnp.asarray(experts), 4), [1, 2, 1, 1])


def test_aligned_groups_start_at_multiples_and_bad_align_is_refused():
    experts = jnp.asarray(np.random.default_rng(3).integers(0, 5, size=(37, 2)), jnp.int32)
    x = jnp.ones((37, 4))
    xs, sizes, state = ops.permute(x, experts, 5, align=16)
    sizes = np.asarray(sizes)
    assert np.all(sizes % 16 == 0) and xs.shape[0] == 74 + 5 * 15 and int(state.num_dropped) == 0
    counts = np.asarray(ops.expert_counts(experts, 5))
    np.testing.assert_array_equal(sizes, -(-counts // 16) * 16)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for start, count, size in zip(starts, counts, sizes):  # the expert's rows, then zero rows to the boundary
        assert np.all(np.asarray(xs[start:start + count]) == 1)
        assert np.all(np.asarray(xs[start + count:start + size]) == 0)
    for bad in (0, -16, 2.0, True):
        with pytest.raises(ValueError, match="align"):
            ops.permute(x, experts, 5, align=bad)


def test_expert_capacity():
    assert ops.expert_capacity(100, 2, 8, 1.0) == 25
    assert ops.expert_capacity(100, 2, 8, 1.25) == 32
    assert ops.expert_capacity(100, 1, 10, 1.1) == 11  # not 12 from 11.000000000000002
    with pytest.raises(ValueError, match="capacity_factor"):
        ops.expert_capacity(100, 2, 8, 0.0)


def test_argument_errors():
    x, experts = jnp.zeros((4, 3)), jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(ValueError, match="token axis"):
        ops.permute(x, jnp.zeros((5, 2), jnp.int32), 4)
    with pytest.raises(TypeError, match="experts"):
        ops.permute(x, experts.astype(jnp.float32), 4)
    with pytest.raises(ValueError, match="num_experts"):
        ops.permute(x, experts, 0)
    with pytest.raises(ValueError, match="capacity"):
        ops.permute(x, experts, 4, capacity=0)
    xs, _, state = ops.permute(x, experts, 4)
    with pytest.raises(ValueError, match="do not match"):
        ops.unpermute(xs, jnp.zeros((4, 3)), state)
