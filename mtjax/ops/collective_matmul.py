"""Collective matmul: the tensor-parallel GEMMs of sequence parallelism with their collectives
decomposed into ``ppermute`` steps, each overlapping a partial GEMM (Wang et al., "Overlap
communication with dependent computation via decomposition in large deep learning models").

With sequence parallelism (Megatron-SP) the residual stream is split over the ``tp`` devices along
the sequence. The column-parallel GEMM (QKV, fc1) needs the whole sequence: XLA all-gathers the
input, then multiplies. `all_gather_matmul` instead multiplies the shard it holds while passing it
on round the ring, ``tp`` partial GEMMs and ``tp - 1`` hops, so only the first hop is exposed. The
row-parallel GEMM (out-projection, fc2) produces partial sums to be reduce-scattered over the
sequence: `matmul_reduce_scatter` computes the partial sum of one sequence chunk per step and hands
the running sum to the next device, which adds its own. Same numbers as the plain collectives (up
to the order of a ``tp``-term float sum); the HLO holds collective-permutes instead of the
all-gather / reduce-scatter.

Both are per-shard functions (call them inside ``shard_map`` with the ``tp`` axis manual) on
``[batch, seq, features]`` activations; `sequence_parallel_matmul` wraps either in the ``shard_map``
for global arrays. Differentiable: the backward pass of each is the other's decomposition (autodiff
transposes every ``ppermute`` into one going the other way).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, get_abstract_mesh
from jax.sharding import PartitionSpec as P

from mtjax.ops.checks import check_choice

COLLECTIVE_MATMUL_KINDS = ("all_gather", "reduce_scatter")


def _check(op: str, x: jax.Array, w: jax.Array, max_rank: int = 2) -> None:
    if x.ndim != 3 or not 2 <= w.ndim <= max_rank or x.shape[-1] != w.shape[0]:
        out = "out" if max_rank == 2 else "..., out"
        raise ValueError(f"{op}: x {x.shape} must be [batch, seq, in] and w {w.shape} [in, {out}]")


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [b, s, in] . w [in, ...]`` with float32 accumulation, in the inputs' dtype."""
    out = lax.dot_general(x, w, (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return out.astype(jnp.result_type(x, w))


def all_gather_matmul(x: jax.Array, w: jax.Array, *, axis_name: str = "tp") -> jax.Array:
    """``all_gather(x, seq) @ w`` with the gather as ``tp - 1`` ring hops, each hidden behind a GEMM.

    Args:
      x: this device's sequence shard ``[batch, seq / tp, in]``.
      w: this device's column block ``[in, ...]`` (e.g. a gated MLP's ``[in, 2, mlp / tp]``, a QKV
        projection's ``[in, 3, heads / tp, head_dim]``).
    Returns:
      ``[batch, seq, ...]``: the whole sequence against this device's columns.
    """
    _check("all_gather_matmul", x, w, max_rank=4)
    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    shard = x.shape[1]
    # Shards travel to the previous device: after k hops this device holds device me + k's.
    perm = [(j, (j - 1) % n) for j in range(n)]
    out = jnp.zeros((x.shape[0], n * shard, *w.shape[1:]), jnp.result_type(x, w))
    chunk = x
    for k in range(n):
        nxt = lax.ppermute(chunk, axis_name, perm) if k + 1 < n else None  # in flight during this GEMM
        out = lax.dynamic_update_slice_in_dim(out, _dot(chunk, w), ((me + k) % n) * shard, axis=1)
        chunk = nxt
    return out


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, *, axis_name: str = "tp") -> jax.Array:
    """``reduce_scatter(x @ w, seq)`` over ``axis_name`` with the reduction as ``tp - 1`` ring hops.

    Args:
      x: the whole sequence against this device's rows ``[batch, seq, in / tp]``.
      w: this device's row block ``[in / tp, out]``.
    Returns:
      ``[batch, seq / tp, out]``: this device's sequence shard of the sum over the devices.
    """
    _check("matmul_reduce_scatter", x, w)
    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    if x.shape[1] % n:
        raise ValueError(f"matmul_reduce_scatter: seq {x.shape[1]} does not split over {n} devices of {axis_name!r}")
    shard = x.shape[1] // n

    def partial(chunk):
        return _dot(lax.dynamic_slice_in_dim(x, (chunk % n) * shard, shard, axis=1), w)

    # The running sum for chunk t starts on device t + 1 and goes round to t, each device adding its part.
    perm = [(j, (j + 1) % n) for j in range(n)]
    acc = partial(me - 1)
    for k in range(1, n):
        acc = lax.ppermute(acc, axis_name, perm) + partial(me - 1 - k)
    return acc


def sequence_parallel_matmul(x: jax.Array, w: jax.Array, *, kind: str, batch_axes: str | tuple[str, ...] | None = None,
                             axis_name: str = "tp", w_split_axis: int = -1) -> jax.Array:
    """`all_gather_matmul` (``kind="all_gather"``: column-parallel, ``x`` split on its sequence and
    ``w`` on one output axis over ``axis_name``) or `matmul_reduce_scatter` (``"reduce_scatter"``:
    row-parallel, ``x`` split on its features and ``w`` on its rows; the result split on its
    sequence) of global arrays under the mesh in force (``jax.set_mesh``).

    Args:
      batch_axes: the mesh axes splitting the batch (e.g. ``("dp", "fsdp")``); other axes replicate.
      w_split_axis: with ``"all_gather"``, the output axis of ``w [in, ...]`` split over
        ``axis_name`` (default the last; e.g. 2, the heads, of a QKV kernel ``[in, 3, heads, head_dim]``).
    """
    check_choice("sequence_parallel_matmul", "kind", kind, COLLECTIVE_MATMUL_KINDS)
    _check("sequence_parallel_matmul", x, w, max_rank=4 if kind == "all_gather" else 2)
    mesh = get_abstract_mesh()
    if mesh.empty or axis_name not in mesh.axis_names:
        raise ValueError(f"sequence_parallel_matmul: no mesh with a {axis_name!r} axis in force (use jax.set_mesh)")
    manual = {name for name, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual}
    if kind == "all_gather":
        split = w_split_axis % w.ndim
        if split == 0:
            raise ValueError(f"sequence_parallel_matmul: w_split_axis={w_split_axis} must be an output axis of w "
                             f"{w.shape} (not its input axis 0)")
        w_spec = tuple(axis_name if i == split else None for i in range(1, w.ndim))
        fn, specs = all_gather_matmul, (P(batch_axes, axis_name, None), P(None, *w_spec))
        out = P(batch_axes, None, *w_spec)
    else:
        fn, specs = matmul_reduce_scatter, (P(batch_axes, None, axis_name), P(axis_name, None))
        out = P(batch_axes, axis_name, None)
    return jax.shard_map(lambda a, b: fn(a, b, axis_name=axis_name), axis_names=manual, in_specs=specs,
                         out_specs=out, check_vma=False)(x, w)
