"""`DenseGeneral` and `LayerNormDenseGeneral`: projections whose GEMM runs in a `mtjax.fp8.DotGeneral`
submodule (a plain dot normally, FP8 with its scaling state under `mtjax.fp8.fp8_autocast`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax import axes, fp8, ops
from mtjax.flax.normalization import input_norm
from mtjax.flax.params import (
    AxisNames,
    Dtype,
    Initializer,
    canonical_tuple,
    contract,
    flat_kernel_init,
    param_with_axes,
)


def _input_axes(owner: str, axis: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    axes = canonical_tuple(axis)
    if any(not -ndim <= a < ndim for a in axes):
        raise ValueError(f"{owner}: axis={axis!r} is out of range for inputs of rank {ndim}")
    return tuple(sorted(a % ndim for a in axes))


def sequence_parallel_axes(owner: str, collective_matmul: bool, x: jax.Array) -> tuple[Any, str] | None:
    """``(the batch's mesh axes, the sequence-parallel mesh axis)`` when ``collective_matmul`` applies:
    the rules in force split the residual stream ``[batch, length, embed]``'s length over one mesh axis
    of size > 1 (sequence parallelism, over whatever the mesh calls it; ``x`` at least 3-D); else None
    and the plain GEMM runs.

    Raises:
      ValueError: it applies under `mtjax.fp8.fp8_autocast` (the decomposed GEMMs are not FP8).
    """
    if not collective_matmul or x.ndim < 3:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    spec = nn.logical_to_mesh_axes(axes.BATCH_LENGTH_EMBED)
    axis = spec[1]
    if mesh.empty or not isinstance(axis, str) or axis not in mesh.axis_names or \
            dict(zip(mesh.axis_names, mesh.axis_sizes))[axis] == 1:
        return None
    if fp8.current_autocast() is not None:
        raise ValueError(f"{owner}: collective_matmul=True does not support FP8 (fp8_autocast)")
    return spec[0], axis


def _collective_project(owner: str, x: jax.Array, kernel: jax.Array, axes_in: tuple[int, ...],
                        kernel_axes: AxisNames, batch_axes: Any, axis_name: str) -> jax.Array:
    """`mtjax.ops.sequence_parallel_matmul` of ``x`` and ``kernel`` over the sequence-parallel mesh axis
    ``axis_name``: column-parallel (the all-gather decomposed) when an output axis of the kernel is
    split over it, row-parallel (the reduce-scatter decomposed) when its first input axis is."""
    mesh_axes = tuple(nn.logical_to_mesh_axes(kernel_axes)) if kernel_axes else ()
    on_axis = [i for i, a in enumerate(mesh_axes) if a == axis_name or (isinstance(a, tuple) and axis_name in a)]
    n_in = len(axes_in)
    if len(on_axis) != 1 or axes_in != tuple(range(x.ndim - n_in, x.ndim)) or x.ndim - n_in != 2:
        raise ValueError(f"{owner}: collective_matmul=True needs [batch, length, ...] inputs contracted over their "
                         f"last axes and a kernel with one axis on {axis_name!r}; got inputs {x.shape}, axis "
                         f"{axes_in}, kernel axes {kernel_axes} -> {mesh_axes}")
    if on_axis[0] >= n_in:  # column-parallel: [b, s / n, in] x [in, ..., split, ...]
        if n_in != 1:
            raise ValueError(f"{owner}: collective_matmul=True with a column-parallel kernel contracts one axis; "
                             f"got {axes_in}")
        return ops.sequence_parallel_matmul(x, kernel, kind="all_gather", batch_axes=batch_axes,
                                            axis_name=axis_name, w_split_axis=on_axis[0])
    if on_axis[0] != 0:
        raise ValueError(f"{owner}: collective_matmul=True with a row-parallel kernel needs its first axis on "
                         f"{axis_name!r}; got kernel axes {kernel_axes} -> {mesh_axes}")
    # Row-parallel: [b, s, (heads split) x ...] flattened to [b, s, in] against [in, out].
    b, s = x.shape[:2]
    out_shape = kernel.shape[n_in:]
    y = ops.sequence_parallel_matmul(x.reshape(b, s, -1), kernel.reshape(math.prod(kernel.shape[:n_in]), -1),
                                     kind="reduce_scatter", batch_axes=batch_axes, axis_name=axis_name)
    return y.reshape(*y.shape[:2], *out_shape)


def project(module: nn.Module, x: jax.Array, *, features: int | Sequence[int], axis: int | Sequence[int],
            kernel_init: Initializer, kernel_axes: AxisNames, use_bias: bool, bias_init: Initializer,
            bias_axes: AxisNames, dtype: Dtype, param_dtype: Dtype, lhs_norm: ops.Norm | None = None,
            collective_matmul: bool = False) -> jax.Array:
    """Creates ``kernel [*x.shape[axis], *features]`` (and ``bias [*features]``) and the ``dot_general``
    submodule in ``module`` and returns ``x`` contracted over ``axis``: ``[*other axes of x, *features]``
    in ``dtype``; ``lhs_norm`` normalizes ``x`` inside the GEMM (``axis`` must be the last axis).
    ``collective_matmul``: under sequence parallelism, the GEMM and its all-gather or reduce-scatter
    as `_collective_project` (``lhs_norm`` then runs on its own first).
    Called from the compact ``__call__`` of `DenseGeneral` and `LayerNormDenseGeneral`."""
    owner = type(module).__name__
    features = canonical_tuple(features)
    axes_in = _input_axes(owner, axis, x.ndim)
    in_shape = tuple(x.shape[a] for a in axes_in)
    kernel = param_with_axes(module, "kernel", flat_kernel_init(kernel_init, len(in_shape)),
                             in_shape + features, param_dtype, kernel_axes)
    collective = sequence_parallel_axes(owner, collective_matmul, x)
    if collective is not None:
        if lhs_norm is not None:
            x = lhs_norm(x)
        y = _collective_project(owner, x.astype(dtype), kernel.astype(dtype), axes_in, kernel_axes, *collective)
    else:
        y = contract(fp8.DotGeneral(name="dot_general"), x.astype(dtype), kernel.astype(dtype), axes_in, lhs_norm)
    if use_bias:
        bias = param_with_axes(module, "bias", bias_init, features, param_dtype, bias_axes)
        y = y + bias.astype(dtype)
    return y


class DenseGeneral(nn.Module):
    """A linear map over one or several input axes to one or several output axes.

    Attributes:
      features: output feature shape (an int or a tuple).
      axis: input axes contracted (an int or a tuple); the output is ``[*remaining axes, *features]``.
      use_bias: add a ``bias [*features]``.
      kernel_init: initializer, applied to the 2-D ``[prod(in), prod(features)]`` view of the kernel.
      bias_init: initializer of the bias.
      kernel_axes: logical axis names of ``kernel [*in, *features]`` (empty: none).
      bias_axes: logical axis names of ``bias``.
      collective_matmul: under sequence parallelism (the rules split the residual stream's length
        over ``tp``), run the GEMM with its collective decomposed into ``ppermute`` steps
        (`mtjax.ops.sequence_parallel_matmul`): the all-gather of a column-parallel kernel (an
        output axis on ``tp``, inputs ``[batch, length / tp, in]``) or the reduce-scatter of a
        row-parallel one (its first input axis on ``tp``; the output comes back with its length on
        ``tp``). Elsewhere the plain GEMM runs. Not with FP8.
      dtype: compute and output dtype.
      param_dtype: parameter dtype.
    """

    features: int | Sequence[int]
    axis: int | Sequence[int] = -1
    use_bias: bool = True
    kernel_init: Initializer = nn.initializers.lecun_normal()
    bias_init: Initializer = nn.initializers.zeros
    kernel_axes: AxisNames = ()
    bias_axes: AxisNames = ()
    collective_matmul: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        return project(
            self, inputs, features=self.features, axis=self.axis, kernel_init=self.kernel_init,
            kernel_axes=self.kernel_axes, use_bias=self.use_bias, bias_init=self.bias_init, bias_axes=self.bias_axes,
            dtype=self.dtype, param_dtype=self.param_dtype, collective_matmul=self.collective_matmul,
        )


class LayerNormDenseGeneral(nn.Module):
    """LayerNorm/RMSNorm of the last axis followed by a `DenseGeneral` (e.g. the QKV projection).

    Under `mtjax.fp8.fp8_autocast` with delayed scaling, the norm writes the FP8 input of the GEMM
    and its amax in one pass (`mtjax.ops.norm_fp8`); with ``return_layernorm_output``, a
    ``residual`` (added in the norm's kernel) or a projection over other axes than the last, the
    norm runs on its own first and writes the compute dtype.

    Returns ``(output, layernorm_output)``; the second is ``None`` unless ``return_layernorm_output``
    (the residual branch of ``apply_residual_connection_post_layernorm`` needs it).

    ``residual``: ``inputs`` is a sublayer's output still to be added to the residual stream
    ``residual``; the norm runs on ``inputs + residual`` with the add in its kernel
    (`mtjax.ops.residual_norm`), and the call returns ``(output, layernorm_output, inputs + residual)``.

    Attributes:
      features, axis, use_bias, kernel_init, bias_init, kernel_axes, bias_axes: as `DenseGeneral`
        (``use_bias`` defaults to False, as TransformerEngine).
      enable_layernorm: apply the norm (False: a plain projection with this module's parameter names).
      layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes, ln_bias_init, ln_bias_axes:
        as `LayerNorm` (its ``bias_*`` are ``ln_bias_*`` here).
      return_layernorm_output: also return the normalized input.
      collective_matmul: as `DenseGeneral` (the norm runs on its own first).
      dtype: compute and output dtype.
      param_dtype: parameter dtype.
    """

    features: int | Sequence[int]
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: AxisNames = (axes.EMBED,)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: AxisNames = (axes.EMBED,)
    kernel_init: Initializer = nn.initializers.lecun_normal()
    kernel_axes: AxisNames = ()
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: AxisNames = ()
    return_layernorm_output: bool = False
    axis: int | Sequence[int] = -1
    collective_matmul: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, inputs: jax.Array, residual: jax.Array | None = None) -> tuple[jax.Array, ...]:
        x = inputs.astype(self.dtype)
        # The GEMM applies the norm itself unless the normalized input is wanted as well or the
        # projection contracts other axes (or a residual is added first, unless the norm folds into the
        # GEMM: `mtjax.flax.normalization.input_norm`).
        apply_now = self.return_layernorm_output or _input_axes(type(self).__name__, self.axis, x.ndim) != (x.ndim - 1,)
        x, norm, new_residual = input_norm(self, x, residual, apply_now=apply_now)
        y = project(
            self, x, features=self.features, axis=self.axis, kernel_init=self.kernel_init,
            kernel_axes=self.kernel_axes, use_bias=self.use_bias, bias_init=self.bias_init, bias_axes=self.bias_axes,
            dtype=self.dtype, param_dtype=self.param_dtype, lhs_norm=norm, collective_matmul=self.collective_matmul,
        )
        ln_out = x if self.return_layernorm_output else None
        return (y, ln_out) if residual is None else (y, ln_out, new_residual)
