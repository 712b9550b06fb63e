# Ported from NVIDIA TransformerEngine's examples/jax/mnist/test_single_gpu_mnist.py
# (Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES; Apache License 2.0,
# https://github.com/NVIDIA/TransformerEngine). The model, the training and evaluation steps and
# the FP8 context are TransformerEngine's with the imports changed (transformer_engine.jax -> mtjax)
# and one line: the dtype of the TE dense layers (see `Net`). The data is made here: procedurally
# drawn seven-segment digits stand in for MNIST (which the original downloads with `datasets`); the
# unittest class is left out (tests/examples runs this).
"""MNIST-style training on a single device (TransformerEngine's example, on mtjax)."""

import argparse
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state

import mtjax as te
import mtjax.flax as te_flax

DIR = str(Path(__file__).resolve().parents[1])
sys.path.append(str(DIR))
from encoder.common import get_quantization_recipe_from_name_string  # noqa: E402

IMAGE_H = 28
IMAGE_W = 28
IMAGE_C = 1
PARAMS_KEY = "params"
DROPOUT_KEY = "dropout"
INPUT_KEY = "input_rng"


class Net(nn.Module):
    """CNN model for MNIST."""

    use_te: bool = False

    @nn.compact
    def __call__(self, x, disable_dropout=False):
        nn_Dense = te_flax.DenseGeneral if self.use_te else nn.Dense
        # The one change beyond the imports: TransformerEngine's `dtype` is the parameter dtype and its
        # layers compute in the input's dtype, so the original passes float32 to its layers and bfloat16
        # to Flax's. mtjax's `dtype` is the compute dtype, as Flax's (parameters stay float32 through
        # `param_dtype`), so both get bfloat16.
        dtype = jnp.bfloat16

        x = nn.Conv(features=32, kernel_size=(3, 3), strides=1, dtype=jnp.bfloat16)(x)
        x = nn.relu(x)
        x = nn.Conv(features=64, kernel_size=(3, 3), strides=1, dtype=jnp.bfloat16)(x)
        x = nn.relu(x)
        x = nn.max_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Dropout(rate=0.25)(x, deterministic=disable_dropout)
        x = x.reshape(x.shape[0], -1)
        assert x.dtype == jnp.bfloat16
        x = nn_Dense(features=128, dtype=dtype)(x)
        x = nn.relu(x)
        x = nn.Dropout(rate=0.5)(x, deterministic=disable_dropout)
        x = nn_Dense(features=32, dtype=dtype)(x)
        x = nn_Dense(features=32, dtype=dtype)(x)
        assert x.dtype == jnp.bfloat16
        return x


@jax.jit
def apply_model(state, images, labels, var_collect, rngs=None):
    """Computes gradients, loss and accuracy for a single batch (no gradients without ``rngs``)."""

    def loss_fn(var_collect, disable_dropout=False):
        logits = state.apply_fn(var_collect, images, disable_dropout, rngs=rngs)
        loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=jax.nn.one_hot(labels, 32)))
        return loss, logits

    var_collect = {**var_collect, PARAMS_KEY: state.params}
    if rngs is None:
        (loss, logits), grads = loss_fn(var_collect, disable_dropout=True), None
    else:
        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(var_collect)
    return grads, loss, jnp.mean(jnp.argmax(logits, -1) == labels)


@partial(jax.jit)
def update_model(state, grads):
    """Update model params and FP8 meta: the "gradient" of the FP8 collection is its next value."""
    return state.apply_gradients(grads=grads[PARAMS_KEY]), grads


def train_epoch(state, train_ds, batch_size, rngs, var_collect):
    """Train for a single epoch."""
    train_ds_size = len(train_ds["image"])
    steps_per_epoch = train_ds_size // batch_size
    perms = jax.random.permutation(rngs[INPUT_KEY], train_ds_size)
    perms = perms[: steps_per_epoch * batch_size].reshape((steps_per_epoch, batch_size))  # whole batches
    epoch_loss, epoch_accuracy = [], []
    for perm in perms:
        grads, loss, accuracy = apply_model(state, train_ds["image"][perm], train_ds["label"][perm], var_collect,
                                            rngs)
        state, var_collect = update_model(state, grads)
        epoch_loss.append(loss)
        epoch_accuracy.append(accuracy)
    return state, np.mean(epoch_loss), np.mean(epoch_accuracy), var_collect


def eval_model(state, test_ds, batch_size, var_collect):
    """Evaluation loop."""
    num_steps = len(test_ds["image"]) // batch_size
    all_loss, all_accuracy = [], []
    for start in range(0, num_steps * batch_size, batch_size):
        batch = slice(start, start + batch_size)
        _, loss, accuracy = apply_model(state, test_ds["image"][batch], test_ds["label"][batch], var_collect)
        all_loss.append(loss)
        all_accuracy.append(accuracy)
    return np.mean(all_loss), np.mean(all_accuracy)


# The seven segments of a digit as (row0, col0, row1, col1) in a 20x12 box, and the segments each digit lights.
SEGMENTS = {"top": (0, 0, 2, 12), "upper_left": (0, 0, 10, 2), "upper_right": (0, 10, 10, 12),
            "middle": (9, 0, 11, 12), "lower_left": (10, 0, 20, 2), "lower_right": (10, 10, 20, 12),
            "bottom": (18, 0, 20, 12)}
DIGITS = ["top upper_left upper_right lower_left lower_right bottom", "upper_right lower_right",
          "top upper_right middle lower_left bottom", "top upper_right middle lower_right bottom",
          "upper_left upper_right middle lower_right", "top upper_left middle lower_right bottom",
          "top upper_left middle lower_left lower_right bottom", "top upper_right lower_right",
          "top upper_left upper_right middle lower_left lower_right bottom",
          "top upper_left upper_right middle lower_right bottom"]


def draw_digits(rng, size):
    """``size`` 28x28 grey images of seven-segment digits, shifted, dimmed and noised at random, and their labels."""
    labels = rng.integers(0, 10, size)
    images = np.zeros((size, IMAGE_H, IMAGE_W), np.float32)
    for image, label in zip(images, labels):
        top, left = rng.integers(0, IMAGE_H - 20), rng.integers(0, IMAGE_W - 12)
        for segment in DIGITS[label].split():
            r0, c0, r1, c1 = SEGMENTS[segment]
            image[top + r0: top + r1, left + c0: left + c1] = rng.uniform(0.6, 1.0)
    images = np.clip(images + rng.normal(0.0, 0.15, images.shape), 0.0, 1.0)
    return images.reshape(size, IMAGE_H, IMAGE_W, IMAGE_C).astype(np.float32), labels.astype(np.int32)


def get_datasets(train_size=8192, test_size=1024, seed=0):
    """Synthetic train and test sets in memory, as MNIST's: float images in [0, 1] and int labels."""
    rng = np.random.default_rng(seed)
    train_images, train_labels = draw_digits(rng, train_size)
    test_images, test_labels = draw_digits(rng, test_size)
    return {"image": train_images, "label": train_labels}, {"image": test_images, "label": test_labels}


def check_fp8(state, var_collect, input_shape, label_shape):
    "Check if model includes FP8."
    func_jaxpr = str(
        jax.make_jaxpr(apply_model)(
            state, jnp.empty(input_shape, dtype=jnp.bfloat16), jnp.empty(label_shape, dtype=jnp.int32), var_collect
        )
    )
    assert "f8_e5m2" in func_jaxpr or "f8_e4m3" in func_jaxpr


def train_and_evaluate(args):
    """Execute model training and evaluation loop."""
    print(args)
    if args.use_fp8:
        args.use_te = True

    train_ds, test_ds = get_datasets(args.train_size, args.test_size)
    rng = jax.random.PRNGKey(args.seed)
    rng, params_rng = jax.random.split(rng)
    rng, dropout_rng = jax.random.split(rng)
    init_rngs = {PARAMS_KEY: params_rng, DROPOUT_KEY: dropout_rng}

    input_shape = [args.batch_size, IMAGE_H, IMAGE_W, IMAGE_C]
    label_shape = [args.batch_size]

    fp8_recipe = get_quantization_recipe_from_name_string(args.fp8_recipe) if args.use_fp8 else None

    with te.autocast(enabled=args.use_fp8, recipe=fp8_recipe, mesh_resource=te.sharding.MeshResource()):
        cnn = Net(args.use_te)
        var_collect = cnn.init(init_rngs, jnp.empty(input_shape, dtype=jnp.bfloat16))
        tx = optax.sgd(args.lr, args.momentum)
        state = train_state.TrainState.create(apply_fn=cnn.apply, params=var_collect[PARAMS_KEY], tx=tx)

        if args.use_fp8:
            check_fp8(state, var_collect, input_shape, label_shape)

        if args.dry_run:
            apply_model(state, jnp.empty(input_shape, dtype=jnp.bfloat16), jnp.empty(label_shape, dtype=jnp.bfloat16),
                        var_collect, {DROPOUT_KEY: dropout_rng})
            print("PASSED")
            return None

        train_losses, train_accuracies, test_losses, test_accuracies = [], [], [], []
        for epoch in range(1, args.epochs + 1):
            rng, input_rng = jax.random.split(rng)
            rng, dropout_rng = jax.random.split(rng)
            rngs = {INPUT_KEY: input_rng, DROPOUT_KEY: dropout_rng}

            state, train_loss, train_accuracy, var_collect = train_epoch(
                state, train_ds, args.batch_size, rngs, var_collect
            )
            test_loss, test_accuracy = eval_model(state, test_ds, args.test_batch_size, var_collect)

            train_losses.append(train_loss)
            train_accuracies.append(train_accuracy)
            test_losses.append(test_loss)
            test_accuracies.append(test_accuracy)
            print(
                f"Epoch: {epoch:>2} "
                f"Train Loss: {train_loss:.6f} "
                f"Train Accuracy: {train_accuracy:.6f} "
                f"Test Loss: {test_loss:.6f} "
                f"Test Accuracy: {test_accuracy:.6f} "
            )

    return [train_losses, train_accuracies, test_losses, test_accuracies]


def mnist_parser(args):
    """Training settings."""
    parser = argparse.ArgumentParser(description="JAX MNIST Example")
    parser.add_argument("--batch-size", type=int, default=64, metavar="N",
                        help="input batch size for training (default: 64)")
    parser.add_argument("--test-batch-size", type=int, default=800, metavar="N",
                        help="input batch size for testing (default: 800)")
    parser.add_argument("--epochs", type=int, default=10, metavar="N", help="number of epochs to train (default: 10)")
    parser.add_argument("--lr", type=float, default=0.01, metavar="LR", help="learning rate (default: 0.01)")
    parser.add_argument("--momentum", type=float, default=0.9, metavar="M", help="Momentum (default: 0.9)")
    parser.add_argument("--train-size", type=int, default=8192, metavar="N",
                        help="synthetic training images (default: 8192)")
    parser.add_argument("--test-size", type=int, default=1600, metavar="N",
                        help="synthetic test images (default: 1600)")
    parser.add_argument("--dry-run", action="store_true", default=False, help="quickly check a single pass")
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="random seed (default: 1)")
    parser.add_argument("--use-fp8", action="store_true", default=False,
                        help="Use FP8 for inference and training without recalibration. "
                             "It also enables Transformer Engine implicitly.")
    parser.add_argument("--fp8-recipe", default="DelayedScaling",
                        help="FP8 recipe: DelayedScaling (default), Float8CurrentScaling or Float8BlockScaling")
    parser.add_argument("--use-te", action="store_true", default=False, help="Use Transformer Engine")
    return parser.parse_args(args)


if __name__ == "__main__":
    train_and_evaluate(mnist_parser(None))
