"""Gradients of models with FP8 meta: the next meta rides on the gradient; optimizers never see it.

Differentiating a loss with respect to the model's variables gives, under ``FP8_COLLECTION``, the
next delayed-scaling state rather than a gradient. These helpers separate it (`split_gradients`),
combine it across micro-batches (`accumulate_gradients`, `finalize_accumulated`) and keep it away
from the optimizer (`Optimizer`). `mtjax.train` and `mtjax.sharding.pipeline_loss` use them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from mtjax.fp8.recipes import _check_int
from mtjax.fp8.scaling import FP8_COLLECTION


def split_gradients(grads: Any) -> tuple[Any, Any]:
    """``(param_grads, new_fp8_meta)``: ``grads`` without its ``FP8_COLLECTION`` entry, and that
    entry (``{}`` when there is none, e.g. outside `fp8_autocast`)."""
    if not isinstance(grads, Mapping) or FP8_COLLECTION not in grads:
        return grads, {}
    return {k: v for k, v in grads.items() if k != FP8_COLLECTION}, grads[FP8_COLLECTION]


def _with_meta(tree: Any, meta: Any) -> Any:
    return {**tree, FP8_COLLECTION: meta} if meta else tree


def map_param_gradients(fn: Callable[[jax.Array], jax.Array], grads: Any) -> Any:
    """``grads`` with ``fn`` applied to every parameter gradient, the FP8 meta left as it is (it is
    the next state, not a derivative: scaling a loss scales its gradients, never the meta)."""
    params, meta = split_gradients(grads)
    return _with_meta(jax.tree.map(fn, params), meta)


def accumulate_gradients(acc: Any | None, grads: Any) -> Any:
    """Add one micro-batch's gradients to ``acc`` (``None`` for the first): parameter gradients are
    summed, FP8 meta combined by elementwise max, which gives the meta one batch of all the
    micro-batches would give: every micro-batch rolled the same history and used the same scale,
    and the amax of a union is the max of the amaxes."""
    if acc is None:
        return grads
    acc_params, acc_meta = split_gradients(acc)
    params, meta = split_gradients(grads)
    summed = jax.tree.map(jnp.add, acc_params, params)
    return _with_meta(summed, jax.tree.map(jnp.maximum, acc_meta, meta))


def finalize_accumulated(acc: Any, num_micro_batches: int) -> Any:
    """Average the parameter gradients of ``num_micro_batches`` accumulated micro-batches (for losses
    that are means over each micro-batch); the meta is already final."""
    _check_int("finalize_accumulated", "num_micro_batches", num_micro_batches, 1)
    return map_param_gradients(lambda g: (g / num_micro_batches).astype(g.dtype), acc)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An optax transformation applied to everything but the FP8 meta; the meta is replaced.

    ``tx`` sees only the non-meta part of the variables and gradients, so clipping, global norms,
    Adam moments and weight decay never touch the meta; the new meta from the gradients replaces
    the old one (adding an update could not reproduce it exactly).

    Attributes:
      tx: any ``optax.GradientTransformation``.
      collection: ``None``: ``tx`` updates every collection but the meta; a collection's name (e.g.
        ``"params"``): ``tx`` updates that collection alone and its state is ``tx.init(variables[collection])``
        (what `mtjax.train` keeps), other collections pass through unchanged.
    """

    tx: optax.GradientTransformation
    collection: str | None = None

    def _updated(self, tree: Any) -> Any:
        return tree if self.collection is None else tree[self.collection]

    def init(self, variables: Any) -> optax.OptState:
        """The optimizer state for the part of ``variables`` that ``tx`` updates."""
        return self.tx.init(self._updated(split_gradients(variables)[0]))

    def apply_gradients(self, variables: Any, grads: Any, opt_state: optax.OptState) -> tuple[Any, optax.OptState]:
        """``(new_variables, new_opt_state)``; the meta of ``grads`` (else of ``variables``) is kept."""
        params, old_meta = split_gradients(variables)
        param_grads, new_meta = split_gradients(grads)
        updates, opt_state = self.tx.update(self._updated(param_grads), opt_state, self._updated(params))
        new_params = optax.apply_updates(self._updated(params), updates)
        if self.collection is not None:
            new_params = {**params, self.collection: new_params}
        return _with_meta(new_params, new_meta or old_meta), opt_state
