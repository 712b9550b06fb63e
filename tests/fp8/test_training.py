"""Gradients carry the meta: split, optimizer wrapper, micro-batch accumulation, and a short FP8 training run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from mtjax import fp8
from tests.fp8.mlp import MLP

pytestmark = pytest.mark.usefixtures("fast_compiles")

HISTORY = 16
DELAYED = fp8.DelayedScaling(amax_history_len=HISTORY)


def squared_error_sum(model, variables, x, y, total):
    """This micro-batch's share of the mean squared error over a batch of ``total`` examples."""
    return jnp.sum((model.apply(variables, x).astype(jnp.float32) - y) ** 2) / total


def test_split_gradients():
    assert fp8.split_gradients({"params": 1}) == ({"params": 1}, {})
    assert fp8.split_gradients({"params": 1, fp8.FP8_COLLECTION: 2}) == ({"params": 1}, 2)
    assert fp8.split_gradients([1, 2]) == ([1, 2], {})


def test_optimizer_never_sees_the_meta():
    model = MLP(32, 4, dtype=jnp.float32)
    x, y = jnp.asarray(np.random.default_rng(0).standard_normal((16, 8), np.float32)), jnp.ones((16, 4))
    with fp8.fp8_autocast(recipe=DELAYED):
        variables = model.init(jax.random.key(1), x)
        grads = jax.jit(jax.grad(functools.partial(squared_error_sum, model)))(variables, x, y, 16)
    # A meta far from anything a gradient holds: clipping and Adam would be thrown off if they saw it.
    grads[fp8.FP8_COLLECTION] = jax.tree.map(lambda m: m + 1e30, grads[fp8.FP8_COLLECTION])
    tx = optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(1e-2, weight_decay=0.1))
    opt = fp8.Optimizer(tx)

    @jax.jit  # one compilation for both ways of stepping (the CPU is shared)
    def steps(variables, grads):
        opt_state = opt.init(variables)
        new_variables, new_state = opt.apply_gradients(variables, grads, opt_state)
        params = {"params": variables["params"]}
        updates, _ = tx.update({"params": grads["params"]}, tx.init(params), params)
        plain, _ = opt.apply_gradients(params, {"params": grads["params"]}, opt_state)
        return new_variables, new_state, optax.apply_updates(params, updates)["params"], plain

    new_variables, opt_state, want, plain = steps(variables, grads)
    jax.tree.map(np.testing.assert_array_equal, new_variables["params"], want)
    jax.tree.map(np.testing.assert_array_equal, new_variables[fp8.FP8_COLLECTION], grads[fp8.FP8_COLLECTION])
    assert max(float(jnp.max(jnp.abs(leaf))) for leaf in jax.tree.leaves(opt_state)) < 1e29
    # Without FP8 state (outside fp8_autocast) the wrapper is just the optimizer.
    assert set(plain) == {"params"}
    jax.tree.map(np.testing.assert_array_equal, plain["params"], want)


def test_four_micro_batches_equal_one_batch_of_four_times():
    model = MLP(32, 4, dtype=jnp.float32)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((64, 8), np.float32) * np.linspace(0.5, 3.0, 64, dtype=np.float32)[:, None])
    y = jnp.asarray(rng.standard_normal((64, 4), np.float32))  # (x: micro-batch amaxes differ)
    grad_fn = jax.jit(jax.grad(functools.partial(squared_error_sum, model), argnums=0))
    with fp8.fp8_autocast(recipe=DELAYED):
        variables = model.init(jax.random.key(1), x)
        variables[fp8.FP8_COLLECTION] = grad_fn(variables, x, y, 64)[fp8.FP8_COLLECTION]  # calibrate scales
        big = grad_fn(variables, x, y, 64)
        acc = None
        for i in range(4):
            acc = fp8.accumulate_gradients(acc, grad_fn(variables, x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)], 64))

    # Same meta: amax histories combined by max, and every micro-batch used the same scales.
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6), acc[fp8.FP8_COLLECTION],
                 big[fp8.FP8_COLLECTION])
    summed = jax.tree.map(lambda *g: sum(g), *[acc[fp8.FP8_COLLECTION]] * 4)
    # a sum would not do
    assert not np.allclose(jax.tree.leaves(summed)[0], jax.tree.leaves(big[fp8.FP8_COLLECTION])[0])
    for got, want in zip(jax.tree.leaves(acc["params"]), jax.tree.leaves(big["params"])):
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5

    averaged = fp8.finalize_accumulated(acc, 4)
    jax.tree.map(np.testing.assert_array_equal, averaged[fp8.FP8_COLLECTION], acc[fp8.FP8_COLLECTION])
    jax.tree.map(lambda a, s: np.testing.assert_allclose(a, s / 4, rtol=1e-7), averaged["params"], acc["params"])
    with pytest.raises(ValueError, match="num_micro_batches"):
        fp8.finalize_accumulated(acc, 0)


def teacher_batches(steps, batch=64, features=16, outputs=8, noise=0.3):
    """Regression on a random tanh teacher with label noise: the loss floor is noise**2 = 0.09."""
    rng = np.random.default_rng(7)
    w1 = rng.standard_normal((features, 32), np.float32) / features**0.5
    w2 = rng.standard_normal((32, outputs), np.float32) / 32**0.5
    x = rng.standard_normal((steps, batch, features), np.float32)
    y = np.tanh(x @ w1) @ w2 * 2.0
    return jnp.asarray(x), jnp.asarray(y + noise * rng.standard_normal(y.shape, np.float32))


def train_losses(enabled, x, y):
    model = MLP(64, y.shape[-1])  # bf16 compute, f32 params
    opt = fp8.Optimizer(optax.adam(3e-3))

    @jax.jit
    def run(x, y):
        with fp8.fp8_autocast(enabled=enabled, recipe=DELAYED):
            variables = model.init(jax.random.key(0), x[0])

            def step(carry, batch):
                variables, opt_state = carry
                loss, grads = jax.value_and_grad(squared_error_sum, argnums=1)(model, variables, *batch,
                                                                              y.shape[1] * y.shape[2])
                return opt.apply_gradients(variables, grads, opt_state), loss

            return lax.scan(step, (variables, opt.init(variables)), (x, y))[1]

    return np.asarray(run(x, y))


def test_fp8_training_matches_bf16():
    x, y = teacher_batches(200)
    bf16, fp8_run = train_losses(False, x, y), train_losses(True, x, y)
    assert bf16[-20:].mean() < 0.5 * bf16[:20].mean()  # it learned
    assert abs(fp8_run[-20:].mean() / bf16[-20:].mean() - 1) < 0.02, (fp8_run[-20:].mean(), bf16[-20:].mean())
