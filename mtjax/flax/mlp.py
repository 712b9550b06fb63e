"""`LayerNormMLP`: norm, fc1, activation (gated or not, through `mtjax.ops.activation`), dropout, fc2."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax import axes, fp8, ops
from mtjax.flax.dense import sequence_parallel_axes
from mtjax.flax.normalization import input_norm
from mtjax.flax.params import AxisNames, Dtype, Initializer, contract, flat_kernel_init, param_with_axes

MLP_HIDDEN_AXES: AxisNames = (axes.ACTIVATION_BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_MLP)
# fc1's output [batch, length, num_activations, mlp]: the pair axis of a gated activation stays whole
# on every device, so with "mlp" split over "tp" each device holds both halves of its own columns.
FC1_OUTPUT_AXES: AxisNames = (axes.ACTIVATION_BATCH, axes.ACTIVATION_LENGTH, None, axes.ACTIVATION_MLP)


class LayerNormMLP(nn.Module):
    """Norm + ``fc1`` + activation + dropout + ``fc2``, on the last axis.

    Gated activations (``("silu", "linear")`` = SwiGLU, ``("gelu", "linear")`` = GeGLU, ...) use a
    ``wi_kernel [hidden, 2, intermediate_dim]``: slot 0 goes through the activation, slot 1 is the gate
    (TransformerEngine's layout; fc1's ``[..., 2, intermediate_dim]`` output goes to
    `mtjax.ops.activation` as is, so tensor parallelism on ``intermediate_dim`` needs no reshuffle).
    Other activations use ``wi_kernel [hidden, 1, intermediate_dim]``.
    Returns ``(output, layernorm_output)``; the second is ``None`` unless ``return_layernorm_output``.

    ``residual``: ``inputs`` is a sublayer's output still to be added to the residual stream
    ``residual``; the norm then runs on ``inputs + residual``, the add and the norm in one kernel
    (`mtjax.ops.residual_norm`: one pass over the stream instead of an add and a norm, forward and
    backward), and the call returns ``(output, layernorm_output, inputs + residual)``.

    Attributes:
      intermediate_dim: width of the hidden layer.
      activations: TransformerEngine-style tuple or a name accepted by `mtjax.ops.activation`.
      intermediate_dropout_rate: dropout on the activation output (skipped when ``deterministic``).
      intermediate_hidden_dropout_dims: axes sharing one dropout mask.
      intermediate_dropout_rng_name: rng collection of that dropout.
      enable_layernorm, layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes,
        ln_bias_init, ln_bias_axes: the input norm, as `LayerNormDenseGeneral`.
      kernel_init: initializer of both kernels.
      kernel_axes_1: logical axes of ``wi_kernel [hidden, num_activations, intermediate_dim]``.
      kernel_axes_2: logical axes of ``wo_kernel [intermediate_dim, hidden]``.
      use_bias: add ``wi_bias [num_activations, intermediate_dim]`` and ``wo_bias [hidden]``.
      bias_init, bias_axes_1, bias_axes_2: their initializer and logical axes.
      return_layernorm_output: also return the normalized input.
      collective_matmul: under sequence parallelism (the logical rules split the ``[batch, length,
        embed]`` input's length over one mesh axis, ``tp`` with `MeshConfig`), run fc1 and fc2 as
        `mtjax.ops.sequence_parallel_matmul`: the all-gather before fc1 and the reduce-scatter after
        fc2 become ``ppermute`` steps overlapped with partial GEMMs. Elsewhere (no split of the
        sequence) the plain path runs. Not with FP8 (``fp8_autocast``).
      dtype: compute and output dtype.
      param_dtype: parameter dtype.
    """

    intermediate_dim: int = 2048
    activations: str | Sequence[str] = ("gelu",)
    intermediate_dropout_rate: float = 0.0
    intermediate_hidden_dropout_dims: Sequence[int] = ()
    intermediate_dropout_rng_name: str = "dropout"
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: AxisNames = (axes.EMBED,)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: AxisNames = (axes.EMBED,)
    kernel_init: Initializer = nn.initializers.lecun_normal()
    kernel_axes_1: AxisNames = (axes.EMBED, None, axes.MLP)
    kernel_axes_2: AxisNames = (axes.MLP, axes.EMBED)
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    bias_axes_1: AxisNames = (None, axes.MLP)
    bias_axes_2: AxisNames = (axes.EMBED,)
    return_layernorm_output: bool = False
    collective_matmul: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool = False, residual: jax.Array | None = None,
                 ) -> tuple[jax.Array, ...]:
        activation = ops.canonical_activation(self.activations)
        num_activations = 2 if ops.is_gated(activation) else 1
        if self.intermediate_dim < 1:
            raise ValueError(f"LayerNormMLP: intermediate_dim={self.intermediate_dim}; expected a positive int")
        hidden = inputs.shape[-1]
        # fc1 applies the norm unless the normalized input is returned too (or a residual is added first,
        # unless the norm folds into fc1: `mtjax.flax.normalization.input_norm`).
        collective = sequence_parallel_axes("LayerNormMLP", self.collective_matmul, inputs)
        x, norm, new_residual = input_norm(self, inputs.astype(self.dtype), residual,
                                           apply_now=self.return_layernorm_output or collective is not None)
        wi = param_with_axes(self, "wi_kernel", flat_kernel_init(self.kernel_init, 1),
                             (hidden, num_activations, self.intermediate_dim), self.param_dtype, self.kernel_axes_1)
        wi = wi.astype(self.dtype)
        if num_activations == 1:
            # Drop the unit axis before the GEMM (ops.activation takes [..., mlp] for plain activations).
            # Why not after: autodiff writes the kernel's gradient as a GEMM plus a transpose, which XLA
            # folds into the GEMM for a 2-D kernel only; with [hidden, 1, mlp] the transpose landed in
            # the optimizer's update, an extra pass over the kernel every step.
            wi = wi[:, 0, :]
        wi_dot, wo_dot = fp8.DotGeneral(name="wi_dot_general"), fp8.DotGeneral(name="wo_dot_general")
        wi_bias = None
        if self.use_bias:
            wi_bias = param_with_axes(self, "wi_bias", self.bias_init, (num_activations, self.intermediate_dim),
                                      self.param_dtype, self.bias_axes_1).astype(self.dtype)
            wi_bias = wi_bias[0] if num_activations == 1 else wi_bias
        # The bias rides into the fused activation ([mlp], or [2, mlp] when gated).
        act = ops.Activation(wi_bias, activation)
        wo = param_with_axes(self, "wo_kernel", flat_kernel_init(self.kernel_init, 1),
                             (self.intermediate_dim, hidden), self.param_dtype, self.kernel_axes_2).astype(self.dtype)
        no_dropout = deterministic or self.intermediate_dropout_rate == 0.0
        if collective is not None:
            batch_axes, axis_name = collective
            h = act(ops.sequence_parallel_matmul(x, wi, kind="all_gather", batch_axes=batch_axes, axis_name=axis_name))
            if not no_dropout:
                h = nn.Dropout(rate=self.intermediate_dropout_rate,
                               broadcast_dims=tuple(self.intermediate_hidden_dropout_dims),
                               rng_collection=self.intermediate_dropout_rng_name)(h, deterministic=deterministic)
            y = ops.sequence_parallel_matmul(h, wo, kind="reduce_scatter", batch_axes=batch_axes, axis_name=axis_name)
        elif no_dropout and fp8.fuses_mlp(x, wi, wo):
            # Both GEMMs in one FP8 op: the activation's backward writes fc1's FP8 output gradient.
            autocast = fp8.current_autocast()
            y = fp8.fp8_mlp(x, wi, wo, wi_dot.fp8_meta(), wo_dot.fp8_meta(), activation=act, norm=norm,
                            recipe=autocast.recipe, mesh_axes=autocast.mesh_axes)
        else:
            h = contract(wi_dot, x, wi, (x.ndim - 1,), norm)
            if x.ndim == 3:  # [batch, length, hidden] in: the activations' logical axes are known
                h = nn.with_logical_constraint(h, FC1_OUTPUT_AXES if num_activations == 2 else MLP_HIDDEN_AXES)
            if no_dropout:
                # fc2 applies the activation (fused with its FP8 input under fp8_autocast).
                y = contract(wo_dot, h, wo, (h.ndim - 1 - (num_activations == 2),), act)
            else:
                h = act(h)
                if h.ndim == 3:
                    h = nn.with_logical_constraint(h, MLP_HIDDEN_AXES)
                h = nn.Dropout(rate=self.intermediate_dropout_rate,
                               broadcast_dims=tuple(self.intermediate_hidden_dropout_dims),
                               rng_collection=self.intermediate_dropout_rng_name)(h, deterministic=deterministic)
                y = contract(wo_dot, h, wo, (h.ndim - 1,))
        if self.use_bias:
            wo_bias = param_with_axes(self, "wo_bias", self.bias_init, (hidden,), self.param_dtype, self.bias_axes_2)
            y = y + wo_bias.astype(self.dtype)
        ln_out = x if self.return_layernorm_output else None
        return (y, ln_out) if residual is None else (y, ln_out, new_residual)
