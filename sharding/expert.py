"""Expert parallelism: send each token to the device holding its expert and its result back.

The DeepEP pattern, written with `jax.lax.all_to_all` inside a `jax.shard_map` that is manual over
the expert-parallel mesh axis (``ep``). On every device the tokens are first sorted by expert
(`mtjax.ops.permute`), giving ``x_sorted [rows, hidden]`` and ``group_sizes [num_experts]``; with
``ep`` devices each holds ``num_experts / ep`` consecutive experts, so the sorted rows form ``ep``
consecutive chunks, one per destination device. `dispatch` then

1. exchanges the per-expert row counts (``[ep, local experts]`` int32, one all-to-all): each device
   learns how many rows every source sends to each of its experts;
2. exchanges the payload: the chunks padded to ``capacity`` rows, ``[ep, capacity, hidden]`` (one
   all-to-all);
3. regroups the received rows by local expert (stable: by source device, then source order), so
   the expert MLP is one grouped GEMM over the local experts.

`combine` runs the three steps backwards (the results return to their source devices and their
sorted order). Both are differentiable: the transpose of an all-to-all is the reverse all-to-all.

Why padded rather than `jax.lax.ragged_all_to_all`: XLA:CPU cannot run ``ragged-all-to-all``
(jax 0.11.2: "UNIMPLEMENTED: HLO opcode ragged-all-to-all is not supported by XLA:CPU"), so it
could not be tested here. The padded exchange moves ``capacity`` rows per device pair whatever the
counts are. `capacity` gives the dropless bound by default (every row of a device could go to one
expert's device: ``capacity = rows``, i.e. ``ep`` times the rows of an even split) and, with a
capacity factor, ``ceil(factor * rows / ep)``; rows past the capacity of a chunk are dropped (their
combine result is zero) and counted by `DispatchState.dropped`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mtjax.dtypes import check_fp8_dtype
from mtjax.ops import tile_dequantize, tile_quantize


class DispatchState(NamedTuple):
    """What `combine` needs to undo a `dispatch` (all arrays are per device, inside the shard_map).

    Attributes:
      order: ``[ep * capacity]`` int32, received slot of each regrouped row.
      chunk_starts: ``[ep]`` int32, first sorted row of each destination's chunk.
      sent: ``[ep]`` int32, rows actually sent to each destination (at most ``capacity``).
      dropped: scalar int32, rows of this device dropped for lack of capacity.
    """

    order: jax.Array
    chunk_starts: jax.Array
    sent: jax.Array
    dropped: jax.Array


def capacity(rows: int, ep: int, capacity_factor: float | None = None) -> int:
    """Rows each device sends to each other device: ``rows`` (dropless) when ``capacity_factor`` is
    None, else ``ceil(capacity_factor * rows / ep)`` rounded up to a multiple of 8 (at most ``rows``)."""
    if not isinstance(rows, int) or rows < 1 or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"capacity(rows={rows!r}, ep={ep!r}): expected positive ints")
    if capacity_factor is None:
        return rows
    if not capacity_factor > 0:
        raise ValueError(f"capacity(capacity_factor={capacity_factor!r}): expected None or a positive number")
    return min(rows, -(-math.ceil(round(capacity_factor * rows / ep, 9)) // 8) * 8)


def dispatch(x_sorted: jax.Array, group_sizes: jax.Array, *, axis_name: str, capacity: int,
             payload_dtype: Any = None) -> tuple[jax.Array, jax.Array, DispatchState]:
    """Sends rows sorted by (global) expert to their experts' devices; call inside a shard_map
    that is manual over ``axis_name``.

    Args:
      x_sorted: ``[rows, hidden]``, this device's rows sorted by expert (rows past
        ``sum(group_sizes)`` are ignored).
      group_sizes: ``[num_experts]`` int32, rows per expert; ``num_experts`` must be a multiple of
        the size of ``axis_name``; device ``i`` holds experts ``i * local, ..., (i + 1) * local - 1``.
      axis_name: the expert-parallel mesh axis.
      capacity: rows per (source, destination) pair (see `capacity`).
      payload_dtype: None: the rows travel in their own dtype; an FP8 dtype: they travel cast to it,
        scaled per 1x128 tile of features (`mtjax.ops.tile_quantize`; a row's last tile is shorter
        when ``hidden`` is not a multiple of 128) with float32 scales, and arrive dequantized to
        ``x_sorted``'s dtype (DeepEP's FP8 dispatch: about half the bytes of bf16). The gradient goes
        back unquantized, in the cotangent's dtype.

    Returns:
      ``(x_local [ep * capacity, hidden], local_group_sizes [local experts] int32, state)``: the rows
      this device's experts compute, sorted by local expert (padding rows last, zero), and the state
      for `combine`.
    """
    if x_sorted.ndim != 2 or group_sizes.ndim != 1:
        raise ValueError(f"dispatch: x_sorted {x_sorted.shape} must be [rows, hidden] and group_sizes "
                         f"{group_sizes.shape} [num_experts]")
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"dispatch: capacity={capacity!r}; expected a positive int")
    if payload_dtype is not None:
        payload_dtype = check_fp8_dtype("dispatch", payload_dtype, "payload_dtype")
    ep = jax.lax.axis_size(axis_name)
    num_experts = group_sizes.shape[0]
    if num_experts % ep:
        raise ValueError(f"dispatch: num_experts={num_experts} is not divisible by the {axis_name!r} axis size {ep}")
    rows, hidden = x_sorted.shape
    local = num_experts // ep
    counts = group_sizes.astype(jnp.int32).reshape(ep, local)          # [destination, local expert]
    per_destination = counts.sum(axis=1)
    chunk_starts = jnp.cumsum(per_destination) - per_destination
    # A chunk keeps its first `capacity` rows: the tail experts of the chunk lose rows first.
    expert_starts = jnp.cumsum(counts, axis=1) - counts
    kept = jnp.clip(capacity - expert_starts, 0, counts)
    sent = kept.sum(axis=1)
    dropped = per_destination.sum() - sent.sum()

    # 1. the counts: received[source, local expert].
    received = jax.lax.all_to_all(kept, axis_name, 0, 0, tiled=True)
    # 2. the payload, padded to `capacity` rows per destination.
    slot = jnp.arange(capacity, dtype=jnp.int32)
    source_rows = jnp.clip(chunk_starts[:, None] + slot[None, :], 0, rows - 1)
    valid = slot[None, :] < sent[:, None]
    send = jnp.where(valid[..., None], x_sorted[source_rows], jnp.zeros((), x_sorted.dtype))
    if payload_dtype is None:
        recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)  # [source, capacity, hidden]
    else:
        recv = _quantized_all_to_all(send, axis_name, payload_dtype)
    # 3. regroup by local expert; a slot past its source's rows gets expert `local` (sorted last).
    ends = jnp.cumsum(received, axis=1)                                # [source, local]
    expert_of_slot = (slot[None, :, None] >= ends[:, None, :]).sum(axis=-1).reshape(-1)
    order = jnp.argsort(expert_of_slot, stable=True).astype(jnp.int32)
    x_local = recv.reshape(ep * capacity, hidden)[order]
    local_group_sizes = received.sum(axis=0).astype(jnp.int32)
    return x_local, local_group_sizes, DispatchState(order, chunk_starts.astype(jnp.int32), sent.astype(jnp.int32),
                                                     dropped.astype(jnp.int32))


def combine(y_local: jax.Array, state: DispatchState, *, axis_name: str, rows: int) -> jax.Array:
    """The inverse of `dispatch`: ``y_local [ep * capacity, features]`` (the experts' outputs in
    `dispatch`'s order) back to this device's sorted rows ``[rows, features]`` (dropped and padding
    rows zero); call inside the same shard_map."""
    ep = state.sent.shape[0]
    if y_local.ndim != 2 or y_local.shape[0] != state.order.shape[0]:
        raise ValueError(f"combine: y_local {y_local.shape} must be [{state.order.shape[0]}, features]")
    capacity = y_local.shape[0] // ep
    features = y_local.shape[1]
    inverse = jnp.zeros_like(state.order).at[state.order].set(jnp.arange(state.order.shape[0], dtype=jnp.int32))
    back = y_local[inverse].reshape(ep, capacity, features)
    returned = jax.lax.all_to_all(back, axis_name, 0, 0, tiled=True)  # [destination, capacity, features]
    row = jnp.arange(rows, dtype=jnp.int32)
    # A row's destination: the last chunk starting at or before it (empty chunks start where the next does).
    destination = (row[:, None] >= state.chunk_starts[None, 1:]).sum(axis=1)
    position = row - state.chunk_starts[destination]
    valid = row < state.chunk_starts[destination] + state.sent[destination]
    out = returned[destination, jnp.clip(position, 0, capacity - 1)]
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _quantized_all_to_all(x: jax.Array, axis_name: str, dtype: Any) -> jax.Array:
    """``all_to_all(x)`` over ``axis_name`` (``x [ep, capacity, hidden]``) with the payload in FP8
    ``dtype``, each row cast in 1x128 tiles (`mtjax.ops.tile_quantize`)."""
    q, scale_inv = tile_quantize(x.reshape(-1, x.shape[-1]), dtype)
    q = jax.lax.all_to_all(q.reshape(x.shape), axis_name, 0, 0, tiled=True)
    scale_inv = jax.lax.all_to_all(scale_inv.reshape(*x.shape[:-1], -1), axis_name, 0, 0, tiled=True)
    rows = q.reshape(-1, x.shape[-1])
    return tile_dequantize(rows, scale_inv.reshape(rows.shape[0], -1), x.dtype).reshape(x.shape)


def _quantized_all_to_all_fwd(x, axis_name, dtype):
    return _quantized_all_to_all(x, axis_name, dtype), None


def _quantized_all_to_all_bwd(axis_name, dtype, _, cotangent):
    # Straight through the cast: the reverse exchange of the cotangent, unquantized.
    return (jax.lax.all_to_all(cotangent, axis_name, 0, 0, tiled=True),)


_quantized_all_to_all.defvjp(_quantized_all_to_all_fwd, _quantized_all_to_all_bwd)
