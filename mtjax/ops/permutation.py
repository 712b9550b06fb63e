"""Token permutation for mixtures of experts: sort (token, choice) assignments by expert and back.

`permute` gathers each token's row once per chosen expert into a buffer sorted by expert (stable:
within an expert, assignments keep token order), the layout `mtjax.ops.grouped_gemm` takes, and
returns the rows per expert. `unpermute` gathers the expert outputs back and combines each token's
``top_k`` rows with its router weights.

Dropless by default: the buffer has ``tokens * top_k`` rows and every assignment gets one. With
``capacity`` each expert keeps at most that many assignments (the first in token order); the rest
are dropped (they contribute zero to their token's output, so the residual stream carries the token
on) and counted in `PermuteState.num_dropped`. The buffer then has ``min(tokens * top_k,
num_experts * capacity)`` rows, the kept ones packed by expert and zeros after them.

With ``align`` each expert's group starts at a multiple of ``align`` rows and its size (the
returned ``group_sizes``) is rounded up to one, the gap filled with zero rows that feed no token
(TransformerEngine's FP8 padding): FP8 GEMM libraries take groups in whole blocks of 16 rows. The
buffer grows by at most ``num_experts * (align - 1)`` rows.

Both ops are differentiable with `jax.custom_vjp`s whose backward passes are gathers through the
inverse index as well (never scatter-adds, which GPUs run with atomics).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mtjax.ops.checks import check_float, check_rank


class PermuteState(NamedTuple):
    """The index `unpermute` needs (a pytree of int32 arrays).

    Attributes:
      row_assignment: ``[rows]``: the assignment ``token * top_k + choice`` each buffer row holds;
        ``tokens * top_k`` for rows holding none (past the kept assignments).
      assignment_row: ``[tokens * top_k]``: the buffer row of each assignment; ``rows`` if dropped.
      num_dropped: ``[]`` assignments dropped for capacity (0 when dropless).
    """

    row_assignment: jax.Array
    assignment_row: jax.Array
    num_dropped: jax.Array


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments per expert for a capacity factor: ``ceil(capacity_factor * tokens * top_k / experts)``."""
    if not capacity_factor > 0:
        raise ValueError(f"expert_capacity: capacity_factor={capacity_factor!r}; expected a positive float")
    # Rounded before the ceiling: 1.1 * 100 / 10 is 11.000000000000002 in floating point.
    return max(1, math.ceil(round(capacity_factor * num_tokens * top_k / num_experts, 9)))


def _take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x[index]`` with zeros for out-of-range indices."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _permute_rows(x: jax.Array, state: PermuteState, top_k: int) -> jax.Array:
    return _permute_rows_vjp(x, state.row_assignment, state.assignment_row, top_k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _permute_rows_vjp(x, row_assignment, assignment_row, top_k):
    return _take_rows(x, row_assignment // top_k)


def _permute_rows_fwd(x, row_assignment, assignment_row, top_k):
    return _take_rows(x, row_assignment // top_k), assignment_row


def _permute_rows_bwd(top_k, residuals, grad):
    assignment_row = residuals
    tokens = assignment_row.shape[0] // top_k
    # Each token's gradient: the sum of its top_k rows' gradients (dropped ones read zeros).
    d_x = _take_rows(grad, assignment_row).reshape(tokens, top_k, -1)
    return jnp.sum(d_x.astype(jnp.float32), axis=1).astype(grad.dtype), None, None


_permute_rows_vjp.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def permute(x: jax.Array, experts: jax.Array, num_experts: int, *, capacity: int | None = None,
            align: int = 1) -> tuple[jax.Array, jax.Array, PermuteState]:
    """Sort each token's rows by the experts it chose (module docstring).

    Args:
      x: ``[tokens, hidden]``.
      experts: int ``[tokens, top_k]`` expert ids in ``0 .. num_experts - 1`` (`RouterOutput.experts`);
        another id sends its assignment to no expert (dropped, counted in ``num_dropped``).
      num_experts: the number of experts.
      capacity: at most this many assignments per expert (`expert_capacity` derives it from a
        capacity factor); ``None``: dropless.
      align: each expert's rows start at a multiple of this and its group size is rounded up to one
        (zero rows after its assignments); 1: packed.
    Returns:
      ``(x_sorted [rows, hidden], group_sizes int32 [num_experts], state)``; ``x_sorted`` holds
      ``group_sizes[e]`` rows for expert ``e`` in expert order (its assignments, then zero rows up to
      the alignment), then zero rows.
    """
    op = "permute"
    check_rank(op, "x", x, 2)
    check_rank(op, "experts", experts, 2)
    if not jnp.issubdtype(experts.dtype, jnp.integer):
        raise TypeError(f"{op}: experts has dtype {experts.dtype}; expected an integer dtype")
    if experts.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: x {x.shape} and experts {experts.shape} must share the token axis")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{op}: num_experts={num_experts!r}; expected a positive int")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"{op}: capacity={capacity!r}; expected None (dropless) or a positive int")
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"{op}: align={align!r}; expected a positive int (1: packed groups)")
    tokens, top_k = experts.shape
    assignments = tokens * top_k
    flat = experts.reshape(-1).astype(jnp.int32)
    # An id outside 0 .. num_experts - 1 goes to no expert: it sorts last and counts as dropped.
    flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # assignments sorted by expert
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1, mode="drop")
    position = jnp.arange(assignments, dtype=jnp.int32)
    if capacity is None and align == 1:  # each assignment's row is its place in the sorted order
        rows = assignments
        destination = jnp.where(position < jnp.sum(counts), position, rows)  # rows: dropped
        row_assignment = jnp.where(destination < rows, order, assignments)
        group_sizes = counts
    else:
        kept_sizes = counts if capacity is None else jnp.minimum(counts, capacity)
        group_sizes = -(-kept_sizes // align) * align
        rows = assignments + num_experts * (align - 1)
        if capacity is not None:
            rows = min(rows, num_experts * -(-capacity // align) * align)
        sorted_expert = flat[order]
        expert = jnp.minimum(sorted_expert, num_experts - 1)  # an index for the dropped ones too
        starts = jnp.cumsum(counts) - counts
        group_starts = jnp.cumsum(group_sizes) - group_sizes
        rank = position - starts[expert]
        kept = (sorted_expert < num_experts) & (rank < kept_sizes[expert])
        destination = jnp.where(kept, group_starts[expert] + rank, rows)
        row_assignment = jnp.full((rows,), assignments, jnp.int32).at[destination].set(order, mode="drop")
    assignment_row = jnp.zeros((assignments,), jnp.int32).at[order].set(destination)
    num_dropped = jnp.sum(destination >= rows, dtype=jnp.int32)  # rows: no row for the assignment
    state = PermuteState(row_assignment, assignment_row, num_dropped)
    return _permute_rows(x, state, top_k), group_sizes, state


@jax.custom_vjp
def _combine(y_sorted, weights, row_assignment, assignment_row):
    return _combine_fwd(y_sorted, weights, row_assignment, assignment_row)[0]


def _combine_fwd(y_sorted, weights, row_assignment, assignment_row):
    tokens, top_k = weights.shape
    rows = _take_rows(y_sorted, assignment_row).reshape(tokens, top_k, -1)
    out = jnp.einsum("tk,tkh->th", weights.astype(jnp.float32), rows.astype(jnp.float32))
    return out.astype(y_sorted.dtype), (y_sorted, weights, row_assignment, assignment_row)


def _combine_bwd(residuals, grad):
    y_sorted, weights, row_assignment, assignment_row = residuals
    tokens, top_k = weights.shape
    grad32 = grad.astype(jnp.float32)
    # Row r of y_sorted fed token a // top_k with weight w[a] (a = its assignment; none: zero).
    w_rows = _take_rows(weights.reshape(-1).astype(jnp.float32), row_assignment)
    d_y = (_take_rows(grad32, row_assignment // top_k) * w_rows[:, None]).astype(y_sorted.dtype)
    rows = _take_rows(y_sorted, assignment_row).reshape(tokens, top_k, -1)
    d_w = jnp.einsum("th,tkh->tk", grad32, rows.astype(jnp.float32)).astype(weights.dtype)
    return d_y, d_w, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def unpermute(y_sorted: jax.Array, weights: jax.Array, state: PermuteState) -> jax.Array:
    """Combine expert outputs back per token: ``out[t] = sum_j weights[t, j] * y[row of (t, j)]``.

    Args:
      y_sorted: ``[rows, hidden]`` in `permute`'s order (e.g. the expert MLP of ``x_sorted``).
      weights: float ``[tokens, top_k]`` (`RouterOutput.weights`); dropped assignments add nothing.
      state: `permute`'s `PermuteState`.
    Returns:
      ``[tokens, hidden]`` in ``y_sorted.dtype``, summed in float32.
    """
    op = "unpermute"
    check_rank(op, "y_sorted", y_sorted, 2)
    check_float(op, "weights", weights)
    check_rank(op, "weights", weights, 2)
    if state.assignment_row.shape != (weights.size,) or state.row_assignment.shape != (y_sorted.shape[0],):
        raise ValueError(f"{op}: y_sorted {y_sorted.shape} and weights {weights.shape} do not match the state "
                         f"(rows {state.row_assignment.shape[0]}, assignments {state.assignment_row.shape[0]})")
    return _combine(y_sorted, weights, state.row_assignment, state.assignment_row)
