"""Sampling options of a request (`SamplingParams`) and the on-device sampler over a batch of slots.

Every slot has its own temperature, top-k, top-p and random key: one compiled `sample` serves any
mix of greedy and sampled requests. The ``i``-th new token of a request is drawn with
``fold_in(PRNGKey(seed), i)``, so a request's tokens depend only on its prompt and options, not on
which other requests share its batch, its slot, or a preemption that recomputed it.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt.

    Attributes:
      max_tokens: new tokens to produce at most (the stop token included).
      temperature: 0 picks the likeliest token (greedy); above 0 samples from ``softmax(logits / temperature)``.
      top_k: sample among the ``top_k`` likeliest tokens only (0: all).
      top_p: then among the smallest set of likeliest tokens whose probability reaches ``top_p``
        (nucleus sampling; 1.0: all).
      seed: the request's random seed (a request with the same prompt, options and seed produces the
        same tokens).
      presence_penalty: subtracted from the logit of every token the request has generated (OpenAI's,
        in [-2, 2]; 0: none).
      frequency_penalty: subtracted once per time a token was generated (OpenAI's, in [-2, 2]; 0: none).
      repetition_penalty: a token seen in the prompt or generated has its logit divided by this where
        positive and multiplied where negative (> 1 discourages repeats; 1: none). The penalties apply
        before temperature, top-k and top-p, and to greedy decoding too; the repetition penalty first.
      stop: token ids that end the request; the stop token is the last of the returned tokens.
      logprobs: None, or return each new token's log-probability under the model (``log_softmax`` of
        its logits, before temperature and filtering) with the ``logprobs`` likeliest alternatives
        (0: none; at most the engine's ``max_logprobs``).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: Sequence[int] = ()
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_tokens, (int, np.integer)) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams: max_tokens={self.max_tokens!r}; expected an int >= 1")
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams: temperature={self.temperature!r}; expected >= 0 (0: greedy)")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"SamplingParams: top_k={self.top_k!r}; expected an int >= 0 (0: all tokens)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams: top_p={self.top_p!r}; expected 0 < top_p <= 1")
        if not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"SamplingParams: seed={self.seed!r}; expected an int in [0, 2**32)")
        for token in self.stop:
            if not isinstance(token, (int, np.integer)) or token < 0:
                raise ValueError(f"SamplingParams: stop={self.stop!r}; expected non-negative token ids")
        if self.logprobs is not None and (not isinstance(self.logprobs, (int, np.integer)) or self.logprobs < 0):
            raise ValueError(f"SamplingParams: logprobs={self.logprobs!r}; expected None or an int >= 0")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not isinstance(getattr(self, name), numbers.Real):
                raise TypeError(f"SamplingParams: {name}={getattr(self, name)!r}; expected a number")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"SamplingParams: {name}={getattr(self, name)!r}; expected a number in [-2, 2]")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"SamplingParams: repetition_penalty={self.repetition_penalty!r}; expected a finite "
                             "number > 0 (1: none)")

    @property
    def penalized(self) -> bool:
        """Whether any penalty applies (the engine then tracks the request's token counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """A new token's log-probability and the likeliest alternatives at its position.

    Attributes:
      logprob: the token's log-probability.
      top: ``(token id, log-probability)`` of the likeliest tokens, likeliest first (as many as the
        request's ``logprobs``).
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_arrays(cls, logprob: Any, top_ids: Any, top_logprobs: Any, count: int) -> TokenLogprobs:
        """From one row of `token_logprobs`' outputs, keeping the ``count`` likeliest alternatives."""
        top = tuple((int(t), float(v)) for t, v in zip(top_ids[:count], top_logprobs[:count]))
        return cls(float(logprob), top)


def token_logprobs(logits: jax.Array, tokens: jax.Array, num_top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(logprob [slots], top_ids [slots, num_top], top_logprobs [slots, num_top])`` of ``tokens
    [slots]`` under ``log_softmax(logits [slots, vocab])`` (float32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logp, num_top)
    return chosen, top_ids.astype(jnp.int32), top_logprobs


def apply_penalties(logits: jax.Array, counts: jax.Array, prompt_seen: jax.Array, presence: jax.Array,
                    frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """``logits [slots, vocab]`` (float32) with `SamplingParams`' penalties applied per row.

    Args:
      counts: ``[slots, vocab]`` int, how often each token was generated by the row's request.
      prompt_seen: ``[slots, vocab]`` bool, the tokens of its prompt.
      presence, frequency, repetition: ``[slots]`` float32 penalties (0, 0, 1: none).
    """
    logits = logits.astype(jnp.float32)
    seen = (counts > 0) | prompt_seen
    r = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


@functools.lru_cache(maxsize=4096)
def request_key(seed: int) -> np.ndarray:
    """The raw ``uint32[2]`` random key of a request with this seed."""
    return np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)), np.uint32)


def sample(logits: jax.Array, *, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, keys: jax.Array,
           index: jax.Array) -> jax.Array:
    """One token per row of ``logits [slots, vocab]``.

    Args:
      temperature, top_k, top_p: ``[slots]`` as `SamplingParams` (temperature 0: argmax).
      keys: ``[slots, 2]`` uint32 raw keys (`request_key`).
      index: ``[slots]`` int32, which new token of its request each row draws (the key is folded with it).
    Returns:
      ``[slots]`` int32 token ids. Top-k and top-p keep every token tied with the last one kept.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature > 0.0

    def filtered(scaled):
        ordered = -jnp.sort(-scaled, axis=-1)  # descending
        rank = jnp.arange(vocab)[None, :]
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        ordered = jnp.where(rank < k[:, None], ordered, -jnp.inf)
        probs = jax.nn.softmax(ordered, axis=-1)
        # A token stays when the likelier ones before it hold less than top_p (the first always stays).
        kept = jnp.sum((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None], axis=-1)
        kept = jnp.clip(jnp.minimum(kept, k), 1, vocab)
        threshold = jnp.take_along_axis(ordered, (kept - 1)[:, None], axis=-1)
        # Rows that do not filter keep every token whatever the others do (a request's draws must
        # not depend on its batch).
        return jnp.where((scaled >= threshold) | ~filters[:, None], scaled, -jnp.inf)

    filters = (top_k > 0) | (top_p < 1.0)

    def draw():
        scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
        # The sort over the vocabulary only runs when some sampled row filters.
        masked = jax.lax.cond(jnp.any(sampled & filters), filtered, lambda x: x, scaled)
        row_keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(keys), index)
        drawn = jax.vmap(jax.random.categorical)(row_keys, masked).astype(jnp.int32)
        return jnp.where(sampled, drawn, greedy)

    return jax.lax.cond(jnp.any(sampled), draw, lambda: greedy)
