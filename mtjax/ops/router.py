"""Mixture-of-experts routing: scores, (group-limited) top-k, combine weights and the auxiliary losses.

`route` turns router logits ``[tokens, experts]`` into each token's ``top_k`` experts and their
combine weights:

1. scores: ``softmax`` over the experts (Switch, Mixtral, Qwen-MoE) or an elementwise ``sigmoid``
   (DeepSeek-V3);
2. selection scores: the scores plus ``expert_bias`` (DeepSeek-V3's auxiliary-loss-free balancing:
   the bias steers which experts are picked, never the weights);
3. with ``num_groups``: group-limited routing (DeepSeek-V3's node-limited routing). The experts form
   ``num_groups`` equal groups; a group's score is the sum of its ``top_k // group_top_k`` best
   selection scores; only experts of the ``group_top_k`` best groups may be picked;
4. top-k of the selection scores; the weights are the *scores* (without bias) of the picked
   experts, divided by their sum when ``normalize_weights`` (Mixtral's softmax over the top-k,
   DeepSeek-V3's normalized sigmoid), then multiplied by ``scaling_factor``.

`load_balancing_loss` (Switch/GShard) and `router_z_loss` (ST-MoE) are the auxiliary losses a train
step adds with its own coefficients; `update_expert_bias` is the auxiliary-loss-free alternative's
per-step bias update from `expert_counts`. All arithmetic is float32; everything here is plain
jax.numpy (XLA fuses it; the router is a small fraction of an MoE layer).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.ops.checks import check_choice, check_float, check_rank, check_shape, is_finite_number

SCORE_FUNCTIONS = ("softmax", "sigmoid")


class RouterOutput(NamedTuple):
    """What `route` returns.

    Attributes:
      weights: float32 ``[tokens, top_k]`` combine weights of the chosen experts.
      experts: int32 ``[tokens, top_k]`` chosen expert ids, best first.
      probs: float32 ``[tokens, experts]`` routing probabilities for `load_balancing_loss`: the
        softmax, or the sigmoid scores normalized to sum to one per token. No bias.
    """

    weights: jax.Array
    experts: jax.Array
    probs: jax.Array


def _check_int(op: str, name: str, value, minimum: int, maximum: int | None = None) -> None:
    not_int = isinstance(value, bool) or not isinstance(value, int)
    if not_int or value < minimum or (maximum is not None and value > maximum):
        bound = f"an int in {minimum}..{maximum}" if maximum is not None else f"an int >= {minimum}"
        raise ValueError(f"{op}: {name}={value!r}; expected {bound}")


def _group_mask(selection: jax.Array, num_groups: int, group_top_k: int, top_k: int) -> jax.Array:
    """Bool ``[tokens, experts]``: the experts of each token's ``group_top_k`` best groups."""
    tokens, experts = selection.shape
    grouped = selection.reshape(tokens, num_groups, experts // num_groups)
    per_group = max(top_k // group_top_k, 1)
    group_scores = jnp.sum(lax.top_k(grouped, per_group)[0], axis=-1)  # [tokens, num_groups]
    _, best_groups = lax.top_k(group_scores, group_top_k)
    chosen = jnp.zeros((tokens, num_groups), bool).at[jnp.arange(tokens)[:, None], best_groups].set(True)
    return jnp.repeat(chosen, experts // num_groups, axis=1)


def route(logits: jax.Array, *, top_k: int, score_function: str = "softmax", num_groups: int | None = None,
          group_top_k: int | None = None, expert_bias: jax.Array | None = None, normalize_weights: bool = True,
          scaling_factor: float = 1.0) -> RouterOutput:
    """Pick ``top_k`` experts per token and their combine weights (module docstring).

    Args:
      logits: ``[tokens, experts]`` float router logits.
      top_k: experts per token, ``1 <= top_k <= experts``.
      score_function: ``"softmax"`` or ``"sigmoid"``.
      num_groups: split the experts into this many equal groups for group-limited routing (``None``: off).
      group_top_k: how many groups a token may use (needed with ``num_groups``).
      expert_bias: float ``[experts]`` added to the scores for selection only (aux-loss-free balancing;
        not differentiated: it is updated from expert loads, not by gradients).
      normalize_weights: divide the chosen scores by their sum. With ``top_k=1`` that makes every
        weight 1 and gives the router no gradient through the weights: Switch-style top-1 routing
        passes ``False``.
      scaling_factor: multiplies the weights (DeepSeek-V3's ``routed_scaling_factor``).
    Returns:
      `RouterOutput`; ``weights`` are differentiable in ``logits``.
    """
    op = "route"
    check_float(op, "logits", logits)
    check_rank(op, "logits", logits, 2)
    experts = logits.shape[1]
    _check_int(op, "top_k", top_k, 1, experts)
    check_choice(op, "score_function", score_function, SCORE_FUNCTIONS)
    if (num_groups is None) != (group_top_k is None):
        raise ValueError(f"{op}: pass num_groups and group_top_k together (got {num_groups!r}, {group_top_k!r})")
    if num_groups is not None:
        _check_int(op, "num_groups", num_groups, 1, experts)
        if experts % num_groups:
            raise ValueError(f"{op}: num_groups={num_groups} must divide the number of experts ({experts})")
        _check_int(op, "group_top_k", group_top_k, 1, num_groups)
        if group_top_k * (experts // num_groups) < top_k:
            raise ValueError(f"{op}: group_top_k={group_top_k} groups of {experts // num_groups} experts cannot hold "
                             f"top_k={top_k} experts")
    if expert_bias is not None:
        check_float(op, "expert_bias", expert_bias)
        check_shape(op, "expert_bias", expert_bias, (experts,))
    if not isinstance(normalize_weights, bool):
        raise TypeError(f"{op}: normalize_weights={normalize_weights!r}; expected True or False")
    if not is_finite_number(scaling_factor, 0.0, exclusive=True):
        raise ValueError(f"{op}: scaling_factor={scaling_factor!r}; expected a finite number > 0")

    logits = logits.astype(jnp.float32)
    if score_function == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    selection = lax.stop_gradient(scores)
    if expert_bias is not None:
        selection = selection + lax.stop_gradient(expert_bias.astype(jnp.float32))
    if num_groups is not None:
        selection = jnp.where(_group_mask(selection, num_groups, group_top_k, top_k), selection, -jnp.inf)
    _, chosen = lax.top_k(selection, top_k)
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    if normalize_weights:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return RouterOutput(weights * jnp.float32(scaling_factor), chosen.astype(jnp.int32), probs)


def expert_counts(experts: jax.Array, num_experts: int) -> jax.Array:
    """int32 ``[num_experts]``: how many (token, choice) assignments each expert received."""
    ids = experts.reshape(-1)
    # mode="drop" alone would wrap a negative id onto the last experts
    return jnp.zeros((num_experts,), jnp.int32).at[jnp.where(ids >= 0, ids, num_experts)].add(1, mode="drop")


def update_expert_bias(expert_bias: jax.Array, counts: jax.Array, update_rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing step: ``bias + rate * sign(mean load - load)``.

    Experts that received more than the mean number of assignments get their selection bias lowered
    by ``update_rate``, the others raised; call it once per step with the step's `expert_counts`
    (summed over devices and micro-batches) and keep the bias out of the optimizer.

    Args:
      expert_bias: float ``[experts]``; counts: ``[experts]`` assignments per expert.
      update_rate: the bias step (DeepSeek-V3: 1e-3).
    Returns:
      the new bias, float32.
    """
    op = "update_expert_bias"
    check_float(op, "expert_bias", expert_bias)
    check_rank(op, "expert_bias", expert_bias, 1)
    check_shape(op, "counts", counts, expert_bias.shape)
    if not update_rate >= 0:
        raise ValueError(f"{op}: update_rate={update_rate!r}; expected a float >= 0")
    load = counts.astype(jnp.float32)
    return expert_bias.astype(jnp.float32) + jnp.float32(update_rate) * jnp.sign(jnp.mean(load) - load)


def load_balancing_loss(probs: jax.Array, experts: jax.Array, num_experts: int) -> jax.Array:
    """The Switch/GShard auxiliary loss ``num_experts * sum_e f_e * P_e``.

    ``f_e`` is the fraction of the ``tokens * top_k`` assignments routed to expert ``e`` (a count,
    not differentiated), ``P_e`` the mean routing probability of ``e``. It is 1 for a uniform router
    with balanced loads and grows as load concentrates.

    Args:
      probs: float ``[tokens, num_experts]`` (`RouterOutput.probs`).
      experts: int ``[tokens, top_k]`` (`RouterOutput.experts`).
      num_experts: the number of experts.
    Returns:
      float32 scalar.
    """
    op = "load_balancing_loss"
    check_float(op, "probs", probs)
    check_rank(op, "probs", probs, 2)
    _check_int(op, "num_experts", num_experts, 1)
    check_shape(op, "probs", probs, (None, num_experts))
    check_rank(op, "experts", experts, 2)
    if experts.shape[0] != probs.shape[0] or not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(f"{op}: experts must be integer [tokens={probs.shape[0]}, top_k]; "
                         f"got {experts.dtype} {experts.shape}")
    fraction = expert_counts(experts, num_experts).astype(jnp.float32) / experts.size
    mean_prob = jnp.mean(probs.astype(jnp.float32), axis=0)
    return num_experts * jnp.sum(fraction * mean_prob)


def router_z_loss(logits: jax.Array) -> jax.Array:
    """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits)**2`` (float32 scalar)."""
    op = "router_z_loss"
    check_float(op, "logits", logits)
    check_rank(op, "logits", logits, 2)
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))
