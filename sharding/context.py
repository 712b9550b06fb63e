"""The load-balanced sequence layout of causal context parallelism.

Under a causal mask, query ``i`` attends ``i + 1`` keys, so contiguous sequence shards give the
last ``cp`` device the most work. The load-balanced layout cuts the sequence into ``2 * cp``
equal chunks and gives device ``d`` chunks ``d`` and ``2 * cp - 1 - d`` (one early, one late),
so every device attends the same number of (query, key) pairs. `reorder_causal_load_balancing`
permutes a natural-order array into that layout (whose contiguous ``cp`` shards are then the
devices' pieces) and `inverse_reorder_causal_load_balancing` restores the natural order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import get_abstract_mesh

from mtjax.sharding.mesh import CP


def load_balanced_chunks(cp: int) -> tuple[int, ...]:
    """The natural-order chunk indices in load-balanced order: ``(0, 2cp-1, 1, 2cp-2, ..., cp-1, cp)``."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"load_balanced_chunks(cp={cp!r}): expected a positive int")
    return tuple(c for d in range(cp) for c in (d, 2 * cp - 1 - d))


def _permute_chunks(x: jax.Array, order, cp: int, axis: int, owner: str) -> jax.Array:
    axis = axis % x.ndim
    length = x.shape[axis]
    if length % (2 * cp):
        raise ValueError(f"{owner}: the sequence axis {axis} has length {length}, which must be a multiple of "
                         f"2 * cp = {2 * cp}")
    chunks = x.reshape(x.shape[:axis] + (2 * cp, length // (2 * cp)) + x.shape[axis + 1:])
    chunks = jnp.take(chunks, np.asarray(order), axis=axis)
    return chunks.reshape(x.shape)


def reorder_causal_load_balancing(x: jax.Array, cp: int, axis: int = 1) -> jax.Array:
    """``x`` with its sequence ``axis`` permuted into the load-balanced layout for ``cp`` devices."""
    return _permute_chunks(x, load_balanced_chunks(cp), cp, axis, "reorder_causal_load_balancing")


def inverse_reorder_causal_load_balancing(x: jax.Array, cp: int, axis: int = 1) -> jax.Array:
    """The inverse of `reorder_causal_load_balancing`: the natural order back."""
    return _permute_chunks(x, np.argsort(load_balanced_chunks(cp)), cp, axis, "inverse_reorder_causal_load_balancing")


def context_parallel_size() -> int:
    """The size of the ``cp`` axis of the mesh in force (``jax.set_mesh`` / `use_mesh`), 1 without one."""
    mesh = get_abstract_mesh()
    if mesh.empty or CP not in mesh.axis_names:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes))[CP]
