"""`DenseGeneral` and `LayerNormDenseGeneral`: projections whose GEMM runs in a `mtjax.fp8.DotGeneral`
submodule (a plain dot normally, FP8 with its scaling state under `mtjax.fp8.fp8_autocast`)."""

from __future__ import annotations

from collections.abc import Sequence

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


def project(module: nn.Module, x: jax.Array, *, features: int | Sequence[int], axis: int | Sequence[int],
            kernel_init: Initializer, kernel_axes: AxisNames, use_bias: bool, bias_init: Initializer,
            bias_axes: AxisNames, dtype: Dtype, param_dtype: Dtype, lhs_norm: ops.Norm | None = None) -> jax.Array:
    """Creates ``kernel [*x.shape[axis], *features]`` (and ``bias [*features]``) and the ``dot_general``
    submodule in ``module`` and returns ``x`` contracted over ``axis``: ``[*other axes of x, *features]``
    in ``dtype``; ``lhs_norm`` normalizes ``x`` inside the GEMM (``axis`` must be the last axis).
    Called from the compact ``__call__`` of `DenseGeneral` and `LayerNormDenseGeneral`."""
    owner = type(module).__name__
    features = canonical_tuple(features)
    axes = _input_axes(owner, axis, x.ndim)
    in_shape = tuple(x.shape[a] for a in axes)
    kernel = param_with_axes(module, "kernel", flat_kernel_init(kernel_init, len(in_shape)),
                             in_shape + features, param_dtype, kernel_axes)
    y = contract(fp8.DotGeneral(name="dot_general"), x.astype(dtype), kernel.astype(dtype), axes, lhs_norm)
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
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        return project(
            self, inputs, features=self.features, axis=self.axis, kernel_init=self.kernel_init,
            kernel_axes=self.kernel_axes, use_bias=self.use_bias, bias_init=self.bias_init, bias_axes=self.bias_axes,
            dtype=self.dtype, param_dtype=self.param_dtype,
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
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, inputs: jax.Array, residual: jax.Array | None = None) -> tuple[jax.Array, ...]:
        x = inputs.astype(self.dtype)
        # The GEMM applies the norm itself unless the normalized input is wanted as well or the
        # projection contracts other axes (or a residual is added first).
        apply_now = self.return_layernorm_output or _input_axes(type(self).__name__, self.axis, x.ndim) != (x.ndim - 1,)
        x, norm, new_residual = input_norm(self, x, residual, apply_now=apply_now)
        y = project(
            self, x, features=self.features, axis=self.axis, kernel_init=self.kernel_init,
            kernel_axes=self.kernel_axes, use_bias=self.use_bias, bias_init=self.bias_init, bias_axes=self.bias_axes,
            dtype=self.dtype, param_dtype=self.param_dtype, lhs_norm=norm,
        )
        ln_out = x if self.return_layernorm_output else None
        return (y, ln_out) if residual is None else (y, ln_out, new_residual)
