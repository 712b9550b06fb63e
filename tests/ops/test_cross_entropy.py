"""`mtjax.ops.softmax_cross_entropy` against optax: values and gradients, f32 and bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtjax import ops

pytestmark = pytest.mark.usefixtures("fast_compiles")


@settings(deadline=None, max_examples=10)
@given(batch=st.integers(1, 3), length=st.integers(1, 5), vocab=st.integers(2, 70),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), seed=st.integers(0, 2**16))
def test_matches_optax_values_and_gradients(batch, length, vocab, dtype, seed):
    rng = np.random.default_rng(seed)  # numpy inputs: no jax program compiled per drawn shape
    logits = jnp.asarray(3.0 * rng.standard_normal((batch, length, vocab), np.float32), dtype)
    labels = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.5, 1.5, (batch, length)), jnp.float32)  # a non-uniform cotangent

    def ours(x):
        return jnp.sum(ops.softmax_cross_entropy(x, labels) * weights)

    def theirs(x):
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), labels) * weights)

    both = jax.jit(lambda x: (jax.value_and_grad(ours)(x), jax.value_and_grad(theirs)(x)))  # one compile per shape
    (ours_value, ours_grad), (theirs_value, theirs_grad) = both(logits)
    np.testing.assert_allclose(ours_value, theirs_value, rtol=1e-5)
    assert ours_grad.dtype == dtype
    # f32: same formula up to rounding; bf16: both round the f32 gradient to bf16 once.
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(ours_grad.astype(jnp.float32), theirs_grad.astype(jnp.float32), rtol=tol, atol=tol)


def test_backward_has_no_scatter():
    logits = jnp.ones((4, 8, 64), jnp.bfloat16)
    labels = jnp.zeros((4, 8), jnp.int32)
    hlo = jax.jit(jax.grad(lambda x: ops.softmax_cross_entropy(x, labels).mean())).lower(logits).as_text()
    assert "scatter" not in hlo


@pytest.mark.parametrize("logits, labels, error, match", [
    (jnp.ones((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32), TypeError, "logits.dtype"),
    (jnp.ones((2, 3)), jnp.zeros((2,), jnp.float32), TypeError, "labels.dtype"),
    (jnp.ones((2, 3)), jnp.zeros((3,), jnp.int32), ValueError, "labels.shape"),
])
def test_bad_input(logits, labels, error, match):
    with pytest.raises(error, match=match):
        ops.softmax_cross_entropy(logits, labels)


def test_labels_outside_the_vocabulary_give_nan():
    """Issue 27 defect 5: label -1 returned the last class's loss; labels >= vocab must not pass silently."""
    logits = jax.random.normal(jax.random.key(0), (2, 5))
    losses = ops.softmax_cross_entropy(logits, jnp.array([-1, 2]))
    assert np.isnan(losses[0]) and np.isfinite(losses[1])
    assert np.isnan(ops.softmax_cross_entropy(logits, jnp.array([1, 5]))[1])
