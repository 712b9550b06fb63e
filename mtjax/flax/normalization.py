"""`LayerNorm`: LayerNorm or RMSNorm over the last axis through `mtjax.ops` (so kernels plug in)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax import axes, fp8, ops
from mtjax.flax.params import AxisNames, Dtype, Initializer, param_with_axes
from mtjax.ops import LAYERNORM_TYPES
from mtjax.ops.checks import check_choice, check_shape


def check_layernorm_type(owner: str, layernorm_type: str) -> None:
    check_choice(owner, "layernorm_type", layernorm_type, LAYERNORM_TYPES)


def norm_with_params(module: nn.Module, hidden: int, *, layernorm_type: str, epsilon: float,
                     zero_centered_gamma: bool, scale_init: Initializer | None, scale_axes: AxisNames,
                     ln_bias_init: Initializer, ln_bias_axes: AxisNames, param_dtype: Dtype) -> ops.Norm:
    """Creates ``scale`` (and ``ln_bias`` for LayerNorm) in ``module``; returns the norm they define.

    The parameters live in the calling module (TransformerEngine's layout), so the fused modules
    (`LayerNormDenseGeneral`, `LayerNormMLP`) hold norm and GEMM weights side by side, and can hand
    the norm to their GEMM (``lhs_prologue``) to be fused with its FP8 input.
    """
    check_layernorm_type(type(module).__name__, layernorm_type)
    if scale_init is None:
        scale_init = nn.initializers.zeros if zero_centered_gamma else nn.initializers.ones
    scale = param_with_axes(module, "scale", scale_init, (hidden,), param_dtype, scale_axes)
    ln_bias = None
    if layernorm_type == "layernorm":
        ln_bias = param_with_axes(module, "ln_bias", ln_bias_init, (hidden,), param_dtype, ln_bias_axes)
    return ops.Norm(scale, ln_bias, layernorm_type=layernorm_type, epsilon=epsilon,
                    zero_centered_gamma=zero_centered_gamma)


def input_norm(module: nn.Module, x: jax.Array, residual: jax.Array | None, *, apply_now: bool,
               ) -> tuple[jax.Array, ops.Norm | None, jax.Array | None]:
    """The input norm of a fused module (`LayerNormDenseGeneral`, `LayerNormMLP`: their
    ``enable_layernorm``, ``layernorm_type``, ``epsilon``, ... attributes) on ``x``.

    Returns ``(x, norm, new_residual)``: ``norm`` is left for the module's GEMM to apply (fused with
    its FP8 input under fp8_autocast) unless ``apply_now``, or a ``residual`` is to be added first,
    in which case the norm kernel adds it (`mtjax.ops.residual_norm`), normalizes the sum into ``x``
    and returns the sum as ``new_residual``; outside fp8_autocast a norm that folds into the GEMM
    (`mtjax.ops.Norm.folds_into_gemm`: few rows) is left to it with the sum as ``x``.
    """
    if not module.enable_layernorm:
        if residual is not None:
            raise ValueError(f"{type(module).__name__}: residual= needs enable_layernorm=True "
                             "(it is added in the norm's kernel)")
        return x, None, None
    norm = norm_with_params(
        module, x.shape[-1], layernorm_type=module.layernorm_type, epsilon=module.epsilon,
        zero_centered_gamma=module.zero_centered_gamma, scale_init=module.scale_init, scale_axes=module.scale_axes,
        ln_bias_init=module.ln_bias_init, ln_bias_axes=module.ln_bias_axes, param_dtype=module.param_dtype,
    )
    if residual is not None:
        if not apply_now and norm.folds_into_gemm(x) and fp8.current_autocast() is None:
            check_shape(type(module).__name__, "residual", residual, x.shape)
            new_residual = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(residual.dtype)
            return new_residual.astype(x.dtype), norm, new_residual
        x, new_residual = norm.with_residual(x, residual)
        return x, None, new_residual
    return (norm(x), None, None) if apply_now else (x, norm, None)


class LayerNorm(nn.Module):
    """LayerNorm or RMSNorm over the last axis, statistics in float32.

    Attributes:
      epsilon: added to the variance.
      layernorm_type: ``"layernorm"`` (``scale`` and ``ln_bias`` parameters) or ``"rmsnorm"`` (``scale``).
      zero_centered_gamma: store the scale as ``gamma - 1`` (initialised to 0, applied as ``1 + scale``).
      scale_init: initializer of ``scale``; default ones (zeros with ``zero_centered_gamma``).
      scale_axes: logical axis names of ``scale``.
      bias_init: initializer of ``ln_bias``.
      bias_axes: logical axis names of ``ln_bias``.
      dtype: compute and output dtype.
      param_dtype: parameter dtype.
    """

    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: AxisNames = (axes.EMBED,)
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: AxisNames = (axes.EMBED,)
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
        """``x [..., hidden]`` -> normalized ``[..., hidden]`` in ``dtype``.

        With ``residual`` (a residual stream ``x`` is still to be added to), normalizes ``x + residual``
        with the add in the norm's kernel (`mtjax.ops.residual_norm`) and returns
        ``(normalized, x + residual)``: the output first, as every module with ``residual=`` and
        `mtjax.ops.residual_norm` return it.
        """
        norm = norm_with_params(
            self, x.shape[-1], layernorm_type=self.layernorm_type, epsilon=self.epsilon,
            zero_centered_gamma=self.zero_centered_gamma, scale_init=self.scale_init, scale_axes=self.scale_axes,
            ln_bias_init=self.bias_init, ln_bias_axes=self.bias_axes, param_dtype=self.param_dtype,
        )
        if residual is None:
            return norm(x.astype(self.dtype))
        return norm.with_residual(x.astype(self.dtype), residual)
