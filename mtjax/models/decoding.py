"""Greedy decoding on a dense key/value cache (the ``"cache"`` collection) for the models the paged
engine (`mtjax.inference`, decoder-only `GPT`) does not serve: `T5` and `VLM`.

Every function here is pure and traceable: wrap it in `jax.jit` with the integer arguments static, as
`jitted_t5_generate` and `jitted_vlm_generate` are (one compile per model and length, shared by the
training log's samples and ``mtjax generate``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtjax.flax.attention import CACHE_COLLECTION
from mtjax.models.t5 import T5
from mtjax.models.vlm import VLM

StepFn = Callable[[Any, jax.Array], tuple[jax.Array, Any]]


def greedy_decode(step: StepFn, cache: Any, logits: jax.Array, num_steps: int, eos_id: int | None = None) -> jax.Array:
    """``num_steps`` tokens, each the argmax of the logits before it: the first from ``logits``, each
    later one from a decoder step on the one before (``num_steps - 1`` steps: the last token is not fed
    back, so a cache needs room for ``num_steps - 1`` tokens after the prompt).

    Args:
      step: ``step(cache, tokens [batch, 1]) -> (logits [batch, 1, vocab], cache)``, one decoder step.
      cache: the cache after the prompt.
      logits: ``[batch, vocab]``, the prompt's last logits (they pick the first token).
      num_steps: tokens to emit.
      eos_id: once a row emits it, the row's later tokens are ``eos_id`` too.

    Returns:
      int32 ``[batch, num_steps]``.
    """
    if logits.ndim != 2:
        raise ValueError(f"greedy_decode: logits has shape {logits.shape}; expected [batch, vocab]")
    if num_steps < 1:
        raise ValueError(f"greedy_decode: num_steps={num_steps}; expected a positive int")

    def pick(logits, done):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if eos_id is None:
            return token, done
        token = jnp.where(done, eos_id, token)
        return token, done | (token == eos_id)

    def body(carry, _):
        cache, token, done = carry
        logits, cache = step(cache, token[:, None])
        token, done = pick(logits[:, -1], done)
        return (cache, token, done), token

    first, done = pick(logits, jnp.zeros(logits.shape[:1], bool))
    _, rest = jax.lax.scan(body, (cache, first, done), None, length=num_steps - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def t5_generate(model: T5, variables: Any, encoder_tokens: jax.Array, *, max_new_tokens: int, start_id: int,
                eos_id: int | None = None, encoder_segment_ids: jax.Array | None = None) -> jax.Array:
    """Greedy output ``[batch, max_new_tokens]`` of a `T5` (``variables``: its ``"params"``, and
    ``"fp8_metas"``, `mtjax.fp8.FP8_COLLECTION`, to decode under `mtjax.fp8.fp8_autocast`) for
    ``encoder_tokens`` (the decoder starts from ``start_id``; ``encoder_segment_ids`` mark padding as
    in `T5`).

    Raises:
      ValueError: ``encoder_tokens`` is not ``[batch, length]``, ``max_new_tokens`` < 1, or ``start_id``
        or ``eos_id`` outside the vocabulary.
    """
    _check_generate("t5_generate", "encoder_tokens", encoder_tokens, max_new_tokens)
    _check_token_ids("t5_generate", model.config.vocab_size, start_id=start_id, eos_id=eos_id)
    encoded = model.apply(variables, encoder_tokens, encoder_segment_ids=encoder_segment_ids, method=T5.encode)
    batch = encoder_tokens.shape[0]

    def run(cache, tokens):
        logits, mutated = model.apply({**variables, CACHE_COLLECTION: cache}, tokens, encoded,
                                      encoder_segment_ids=encoder_segment_ids, decode=True, method=T5.decode,
                                      mutable=[CACHE_COLLECTION])
        return logits, mutated[CACHE_COLLECTION]

    # The start token, then the emitted tokens but the last: max_new_tokens in all.
    cache = _new_cache(model, variables, T5.decode, jnp.zeros((batch, max_new_tokens), jnp.int32), encoded,
                       encoder_segment_ids=encoder_segment_ids)
    logits, cache = run(cache, jnp.full((batch, 1), start_id, jnp.int32))
    return greedy_decode(run, cache, logits[:, -1], max_new_tokens, eos_id)


def vlm_generate(model: VLM, variables: Any, images: jax.Array, prompt: jax.Array, *, max_new_tokens: int,
                 eos_id: int | None = None) -> jax.Array:
    """Greedy continuation ``[batch, max_new_tokens]`` of ``prompt [batch, prompt_len]`` (e.g. the start
    token alone) about ``images``: captions. ``variables`` as `t5_generate`'s.

    Raises:
      ValueError: ``prompt`` is not ``[batch, prompt_len]`` with ``prompt_len`` >= 1, ``max_new_tokens`` < 1,
        or ``eos_id`` outside the vocabulary.
    """
    _check_generate("vlm_generate", "prompt", prompt, max_new_tokens)
    _check_token_ids("vlm_generate", model.config.text.vocab_size, eos_id=eos_id)
    image_tokens = model.apply(variables, images, method=VLM.encode_images)
    prefix = model.config.fusion == "prefix"

    def run(cache, tokens, first=False):
        logits, mutated = model.apply({**variables, CACHE_COLLECTION: cache}, tokens,
                                      image_tokens if first or not prefix else None, decode=True, method=VLM.decode,
                                      mutable=[CACHE_COLLECTION])
        return logits, mutated[CACHE_COLLECTION]

    batch, prompt_len = prompt.shape
    # The prompt, then the emitted tokens but the last (`greedy_decode` does not feed it back).
    cache = _new_cache(model, variables, VLM.decode,
                       jnp.zeros((batch, prompt_len + max_new_tokens - 1), jnp.int32), image_tokens)
    logits, cache = run(cache, prompt, first=True)
    return greedy_decode(run, cache, logits[:, -1], max_new_tokens, eos_id)


# `t5_generate` and `vlm_generate` jitted, the model and the integer arguments static.
jitted_t5_generate = jax.jit(t5_generate, static_argnums=0, static_argnames=("max_new_tokens", "start_id", "eos_id"))
jitted_vlm_generate = jax.jit(vlm_generate, static_argnums=0, static_argnames=("max_new_tokens", "eos_id"))


def until_eos(ids: Any, eos_id: int) -> np.ndarray:
    """The tokens of one row of greedy output ``ids`` up to (not including) its first ``eos_id``."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"until_eos: ids has shape {ids.shape}; expected one row [length]")
    ends = np.flatnonzero(ids == eos_id)
    return ids[:ends[0]] if len(ends) else ids


def _check_generate(fn: str, name: str, tokens: Any, max_new_tokens: Any) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 1:
        raise ValueError(f"{fn}: max_new_tokens={max_new_tokens!r}; expected an int >= 1")
    shape = getattr(tokens, "shape", None)
    if shape is None or len(shape) != 2 or shape[1] < 1:
        raise ValueError(f"{fn}: {name} has shape {shape}; expected [batch, length] with length >= 1")


def _check_token_ids(fn: str, vocab_size: int, **ids: int | None) -> None:
    for name, token in ids.items():
        if token is not None and not 0 <= token < vocab_size:
            raise ValueError(f"{fn}: {name}={token!r}; expected a token id in [0, {vocab_size})")


def _new_cache(model: Any, variables: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
    """The empty cache of ``method`` called (with ``decode=True``) on full-length inputs."""
    _, mutated = model.apply(variables, *args, decode=True, method=method, mutable=[CACHE_COLLECTION], **kwargs)
    return mutated[CACHE_COLLECTION]
