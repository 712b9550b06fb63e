"""``mtjax generate``: continue a prompt with a model trained by ``mtjax train``.

    mtjax generate --checkpoint runs/tiny --prompt "def main(" --max-new-tokens 200

The checkpoint's meta names the model preset and tokenizer, so nothing else is needed. Decoding
feeds one token at a time through the model's key/value cache (``decode=True``) with temperature
and top-k sampling: simple and exact, not fast (the inference work makes it fast).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from mtjax.cli_args import non_negative_int, positive_int

if TYPE_CHECKING:  # jax and the models are imported when a command runs
    from mtjax.models import GPT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="the --workdir of a training run (or its checkpoints/ folder)")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 picks the most likely token (default 0.8)")
    parser.add_argument("--top-k", type=non_negative_int, default=40, help="sample among the k likeliest (0: all)")
    parser.add_argument("--seed", type=int, default=0)


def sample(model: GPT, params: Any, prompt: np.ndarray, *, max_new_tokens: int, temperature: float = 0.8,
           top_k: int = 40, seed: int = 0) -> np.ndarray:
    """``max_new_tokens`` token ids continuing the 1-D ``prompt`` (a `mtjax.models.GPT` and its params).

    Raises:
      ValueError: the prompt plus the new tokens exceed the model's ``max_seq_len``, or bad sampling options.
    """
    import jax
    import jax.numpy as jnp

    max_length = model.config.max_seq_len
    if len(prompt) < 1:
        raise ValueError("--prompt: expected some text to continue")
    if len(prompt) + max_new_tokens > max_length:
        raise ValueError(f"the prompt ({len(prompt)} tokens) plus --max-new-tokens {max_new_tokens} exceed the "
                         f"model's max_seq_len={max_length}: ask for at most {max(max_length - len(prompt), 0)}")
    if temperature < 0:
        raise ValueError(f"--temperature {temperature}: expected >= 0")
    abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, max_length), jnp.int32),
                                                 decode=True))
    cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract["cache"])

    @jax.jit
    def step(cache, token, rng):
        logits, mutated = model.apply({"params": params, "cache": cache}, token.reshape(1, 1), decode=True,
                                      mutable=["cache"])
        logits = logits[0, -1].astype(jnp.float32)
        if temperature == 0:
            return jnp.argmax(logits), mutated["cache"]
        if top_k:
            kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][-1]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        return jax.random.categorical(rng, logits / temperature), mutated["cache"]

    rngs = jax.random.split(jax.random.PRNGKey(seed), len(prompt) + max_new_tokens)
    token = None
    for i, prompt_token in enumerate(prompt):  # the prompt goes through the cache one token at a time
        token, cache = step(cache, jnp.asarray(prompt_token, jnp.int32), rngs[i])
    generated = []
    for i in range(max_new_tokens):
        generated.append(token)
        if i + 1 < max_new_tokens:
            token, cache = step(cache, token, rngs[len(prompt) + i])
    return np.asarray(jax.device_get(generated), dtype=np.int32)


def run(args: argparse.Namespace) -> int:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from mtjax.models import GPT
    from mtjax.train.checkpoint import Checkpointer, CheckpointError
    from mtjax.train.cli import RunConfig
    from mtjax.train.tokenizer import load_tokenizer

    directory = args.checkpoint
    if os.path.isdir(os.path.join(directory, "checkpoints")):
        directory = os.path.join(directory, "checkpoints")
    if not os.path.isdir(directory):
        print(f"mtjax generate: error: --checkpoint {args.checkpoint!r}: no such folder", file=sys.stderr)
        return 2
    with Checkpointer(directory) as checkpointer:
        try:
            meta = checkpointer.restore_meta(args.step)
            run_config = RunConfig(**meta["run"])
        except (FileNotFoundError, CheckpointError) as err:
            print(f"mtjax generate: error: {err}", file=sys.stderr)
            return 2
        except (KeyError, TypeError):
            print(f"mtjax generate: error: the checkpoint in {directory} holds no run configuration", file=sys.stderr)
            return 2
        model = GPT(run_config.model_config())
        tokenizer = load_tokenizer(run_config.tokenizer)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
        abstract_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                                       nn.meta.unbox(shapes["params"]))
        try:
            params = checkpointer.restore_params(abstract_params, args.step)
        except CheckpointError as err:
            print(f"mtjax generate: error: {err}", file=sys.stderr)
            return 2
    if not all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(params)):
        print(f"mtjax generate: error: the checkpoint in {directory} holds NaN or Inf parameters", file=sys.stderr)
        return 2
    try:
        ids = sample(model, params, tokenizer.encode(args.prompt), max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    except ValueError as err:
        print(f"mtjax generate: error: {err}", file=sys.stderr)
        return 2
    print(args.prompt + tokenizer.decode(ids))
    return 0
