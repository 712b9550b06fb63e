# Ported from NVIDIA TransformerEngine's examples/jax/encoder/test_single_gpu_encoder.py
# (Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES; Apache License 2.0,
# https://github.com/NVIDIA/TransformerEngine). The model, the training and evaluation steps and
# the FP8 context are TransformerEngine's with only the imports changed (transformer_engine.jax ->
# mtjax). The data is made here: a synthetic sentence-classification task stands in for GLUE CoLA
# (which the original downloads with `datasets` and tokenizes with `nltk`), with TransformerEngine's
# uint8 padding masks (1 = masked out); the unittest class is left out (tests/examples runs this).
"""Encoder training on a single device (TransformerEngine's example, on mtjax)."""

import argparse
from functools import partial

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import get_quantization_recipe_from_name_string
from flax import linen as nn
from flax.training import train_state

import mtjax as te
import mtjax.flax as te_flax

PARAMS_KEY = "params"
DROPOUT_KEY = "dropout"
SR_KEY = "sr_rng"
INPUT_KEY = "input_rng"


class Net(nn.Module):
    """NLP Encoder"""

    num_embed: int

    @nn.compact
    def __call__(self, x, mask, disable_dropout=False):
        x = nn.Embed(num_embeddings=self.num_embed, features=256, dtype=jnp.bfloat16)(x)

        te_Encoder = partial(
            te_flax.TransformerLayer,
            hidden_size=256,
            mlp_hidden_size=1024,
            num_attention_heads=8,
            hidden_dropout=0.1,
            attention_dropout=0.1,
            dropout_rng_name=DROPOUT_KEY,
            layer_type=te_flax.TransformerLayerType.ENCODER,
            self_attn_mask_type="padding",
            enable_relative_embedding=False,
        )
        x = te_Encoder()(x, attention_mask=mask, deterministic=disable_dropout)

        x = x.reshape(x.shape[0], -1)

        x = te_flax.DenseGeneral(features=256)(x)

        x = te_flax.DenseGeneral(features=256)(x)

        x = nn.Dense(features=2)(x)
        return x


def loss_and_logits(state, var_collect, inputs, masks, labels, rngs, disable_dropout):
    """Cross-entropy of the two-class logits of a batch."""
    logits = state.apply_fn(var_collect, inputs, masks, disable_dropout, rngs=rngs)
    one_hot = jax.nn.one_hot(labels.astype(jnp.int32), 2)
    return jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot)), logits


@jax.jit
def train_step(state, inputs, masks, labels, var_collect, rngs):
    """Computes gradients, loss and accuracy for a single batch."""
    var_collect = {**var_collect, PARAMS_KEY: state.params}
    loss_fn = partial(loss_and_logits, state, inputs=inputs, masks=masks, labels=labels, rngs=rngs,
                      disable_dropout=False)
    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(var_collect)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    # The "gradient" of every collection but the parameters (the FP8 meta) is its next value.
    var_collect, grads = flax.core.pop(grads, PARAMS_KEY)
    state = state.apply_gradients(grads=grads)
    return state, loss, accuracy, var_collect


def train_epoch(state, train_ds, batch_size, rngs, var_collect):
    """Train for a single epoch."""
    train_ds_size = len(train_ds["sentence"])
    steps_per_epoch = train_ds_size // batch_size
    perms = jax.random.permutation(rngs[INPUT_KEY], train_ds_size)
    perms = perms[: steps_per_epoch * batch_size].reshape((steps_per_epoch, batch_size))  # whole batches
    epoch_loss, epoch_accuracy = [], []
    for perm in perms:
        rngs = {key: jax.random.split(rngs[key])[1] for key in rngs}  # fresh randomness every step
        state, loss, accuracy, var_collect = train_step(
            state, train_ds["sentence"][perm], train_ds["mask"][perm], train_ds["label"][perm], var_collect, rngs
        )
        epoch_loss.append(loss)
        epoch_accuracy.append(accuracy)
    return state, np.mean(epoch_loss), np.mean(epoch_accuracy), var_collect


@jax.jit
def eval_step(state, inputs, masks, labels, var_collect, rngs):
    """Computes loss and accuracy for a single batch."""
    var_collect = {**var_collect, PARAMS_KEY: state.params}
    loss, logits = loss_and_logits(state, var_collect, inputs, masks, labels, rngs, disable_dropout=True)
    return loss, jnp.mean(jnp.argmax(logits, -1) == labels)


def eval_model(state, test_ds, batch_size, var_collect, rngs):
    """Evaluation loop."""
    num_steps = len(test_ds["sentence"]) // batch_size
    all_loss, all_accuracy = [], []
    for start in range(0, num_steps * batch_size, batch_size):
        rngs = {key: jax.random.split(rngs[key])[1] for key in rngs}
        batch = slice(start, start + batch_size)
        loss, accuracy = eval_step(state, test_ds["sentence"][batch], test_ds["mask"][batch],
                                   test_ds["label"][batch], var_collect, rngs)
        all_loss.append(loss)
        all_accuracy.append(accuracy)
    return np.mean(all_loss), np.mean(all_accuracy)


def make_sentences(rng, size, vocab_size, max_seq_len):
    """Random sentences of 4..max_seq_len words and a label the model has to read them all for:
    whether the words of the upper half of the vocabulary outnumber those of the lower half."""
    lengths = rng.integers(4, max_seq_len + 1, size)
    words = rng.integers(1, vocab_size, (size, max_seq_len))
    words[np.arange(max_seq_len)[None, :] >= lengths[:, None]] = 0  # padding
    upper = np.sum((words >= vocab_size // 2) & (words > 0), axis=1)
    labels = (2 * upper > lengths).astype(np.float32)
    return words.astype(np.int32), lengths, labels


def data_preprocess(words, lengths, labels, max_seq_len):
    """TransformerEngine's layout: int32 sentences, float labels and uint8 masks [n, 1, len, len] that
    are 0 where a token may attend (both inside the sentence) and 1 elsewhere."""
    mask_3d = np.ones((len(words), max_seq_len, max_seq_len), dtype=np.uint8)
    for mask_2d, seq_len in zip(mask_3d, lengths):
        mask_2d[:seq_len, :seq_len] = 0
    return {"sentence": words, "label": labels, "mask": mask_3d.reshape((len(words), 1, max_seq_len, max_seq_len))}


def get_datasets(max_seq_len, train_size=8192, test_size=1024, vocab_size=64, seed=0):
    """Synthetic train and test sets in memory, and the vocabulary size."""
    rng = np.random.default_rng(seed)
    train_ds = data_preprocess(*make_sentences(rng, train_size, vocab_size, max_seq_len), max_seq_len)
    test_ds = data_preprocess(*make_sentences(rng, test_size, vocab_size, max_seq_len), max_seq_len)
    return train_ds, test_ds, vocab_size


def check_fp8(state, var_collect, inputs, masks, labels):
    "Check if model includes FP8."
    rngs = {DROPOUT_KEY: jax.random.PRNGKey(0), SR_KEY: jax.random.PRNGKey(0)}
    func_jaxpr = str(jax.make_jaxpr(train_step)(state, inputs, masks, labels, var_collect, rngs))
    assert "f8_e5m2" in func_jaxpr or "f8_e4m3" in func_jaxpr


def train_and_evaluate(args):
    """Execute model training and evaluation loop."""
    print(args)
    train_ds, test_ds, num_embed = get_datasets(args.max_seq_len, args.train_size, args.test_size)

    rng = jax.random.PRNGKey(args.seed)
    rng, params_rng = jax.random.split(rng)
    rng, dropout_rng = jax.random.split(rng)
    rng, sr_rng = jax.random.split(rng)
    init_rngs = {PARAMS_KEY: params_rng, DROPOUT_KEY: dropout_rng, SR_KEY: sr_rng}

    input_shape = [args.batch_size, args.max_seq_len]
    mask_shape = [args.batch_size, 1, args.max_seq_len, args.max_seq_len]
    label_shape = [args.batch_size]

    fp8_recipe = get_quantization_recipe_from_name_string(args.fp8_recipe) if args.use_fp8 else None

    with te.autocast(enabled=args.use_fp8, recipe=fp8_recipe, mesh_resource=te.sharding.MeshResource()):
        encoder = Net(num_embed)
        # We use nn.Embed, thus inputs need to be in int
        inputs = jnp.zeros(input_shape, dtype=jnp.int32)
        masks = jnp.zeros(mask_shape, dtype=jnp.uint8)
        var_collect = encoder.init(init_rngs, inputs, masks)
        tx = optax.adamw(args.lr)
        state = train_state.TrainState.create(apply_fn=encoder.apply, params=var_collect[PARAMS_KEY], tx=tx)

        if args.use_fp8:
            check_fp8(state, var_collect, inputs, masks, jnp.zeros(label_shape, dtype=jnp.bfloat16))

        if args.dry_run:
            labels = jnp.zeros(label_shape, dtype=jnp.bfloat16)
            train_step(state, inputs, masks, labels, var_collect, {DROPOUT_KEY: dropout_rng, SR_KEY: sr_rng})
            print("PASSED")
            return None

        for epoch in range(1, args.epochs + 1):
            rng, input_rng = jax.random.split(rng)
            rng, dropout_rng = jax.random.split(rng)
            rng, sr_rng = jax.random.split(rng)
            rngs = {INPUT_KEY: input_rng, DROPOUT_KEY: dropout_rng, SR_KEY: sr_rng}

            state, train_loss, train_accuracy, var_collect = train_epoch(
                state, train_ds, args.batch_size, rngs, var_collect
            )
            test_loss, test_accuracy = eval_model(state, test_ds, args.test_batch_size, var_collect, rngs)

            print(
                f"Epoch: {epoch:>2} "
                f"Train Loss: {train_loss:.6f} "
                f"Train Accuracy: {train_accuracy:.6f} "
                f"Test Loss: {test_loss:.6f} "
                f"Test Accuracy: {test_accuracy:.6f} "
            )

    return [train_loss, train_accuracy, test_loss, test_accuracy]


def encoder_parser(args):
    """Training settings."""
    parser = argparse.ArgumentParser(description="JAX Encoder Example")
    parser.add_argument("--batch-size", type=int, default=64, metavar="N",
                        help="input batch size for training (default: 64)")
    parser.add_argument("--test-batch-size", type=int, default=64, metavar="N",
                        help="input batch size for testing (default: 64)")
    parser.add_argument("--max-seq-len", type=int, default=32, metavar="N",
                        help="maximum sequence length (default: 32)")
    parser.add_argument("--epochs", type=int, default=3, metavar="N", help="number of epochs to train (default: 3)")
    parser.add_argument("--lr", type=float, default=0.0001, metavar="LR", help="learning rate (default: 0.0001)")
    parser.add_argument("--train-size", type=int, default=8192, metavar="N",
                        help="synthetic training sentences (default: 8192)")
    parser.add_argument("--test-size", type=int, default=1024, metavar="N",
                        help="synthetic test sentences (default: 1024)")
    parser.add_argument("--dry-run", action="store_true", default=False, help="quickly check a single pass")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default: 0)")
    parser.add_argument("--use-fp8", action="store_true", default=False,
                        help="Use FP8 for inference and training without recalibration")
    parser.add_argument("--fp8-recipe", default="DelayedScaling",
                        help="FP8 recipe: DelayedScaling (default), Float8CurrentScaling or Float8BlockScaling")
    return parser.parse_args(args)


if __name__ == "__main__":
    train_and_evaluate(encoder_parser(None))
