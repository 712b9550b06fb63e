"""`MoEBlock`: a mixture-of-experts MLP (router, token permutation, grouped-GEMM experts, shared
experts, weighted combine), with expert parallelism over the mesh axis the ``"expert"`` rule names."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import FrozenDict
from jax.sharding import PartitionSpec

from mtjax import axes, fp8, ops
from mtjax.dtypes import check_fp8_dtype
from mtjax.flax.mlp import LayerNormMLP
from mtjax.flax.normalization import input_norm
from mtjax.flax.params import AxisNames, Dtype, Initializer, param_with_axes
from mtjax.flax.transformer import TransformerLayer
from mtjax.kernels.common import vary_together
from mtjax.ops.checks import is_finite_number
from mtjax.sharding import expert as expert_parallel

# Flax collections the block sows into (``model.apply(..., mutable=[MOE_LOSSES, MOE_METRICS])``):
# MOE_LOSSES holds the auxiliary losses already multiplied by their coefficients (a train step adds
# the sum of every leaf to its loss); MOE_METRICS the unweighted losses and the expert-load figures.
MOE_LOSSES = "moe_losses"
MOE_METRICS = "moe_metrics"

TOKEN_AXES: AxisNames = axes.BATCH_LENGTH_EMBED


def expert_kernel_init(init: Initializer) -> Initializer:
    """``init`` applied to each expert's ``[in, prod(out)]`` matrix of a ``[experts, in, *out]`` kernel,
    so fan-in and fan-out are those of one expert."""

    def kernel_init(key, shape, dtype=jnp.float32):
        num_experts, fan_in = shape[0], shape[1]
        keys = jax.random.split(key, num_experts)
        kernels = jax.vmap(lambda k: init(k, (fan_in, math.prod(shape[2:])), dtype))(keys)
        return kernels.reshape(shape)

    return kernel_init


def _mesh_axes_of(name: str | None) -> tuple[str, ...]:
    """The mesh axes the current logical-axis rules give ``name`` (empty: replicated)."""
    if name is None:
        return ()
    resolved = nn.logical_to_mesh_axes((name,))[0]
    if resolved is None:
        return ()
    return (resolved,) if isinstance(resolved, str) else tuple(resolved)


def _meta_specs(meta: Mapping[str, jax.Array], ep_spec: str | None) -> dict[str, PartitionSpec]:
    """The ``shard_map`` specs of a grouped GEMM's delayed-scaling state: the ``kernel`` role's entries
    (a leading ``[experts]`` axis) live with their experts, the others are replicated."""
    return {k: PartitionSpec(ep_spec) if k.startswith("kernel_") else PartitionSpec() for k in meta}


def _expert_gemm(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array, meta: Mapping[str, jax.Array] | None,
                 ) -> jax.Array:
    """``ops.grouped_gemm``, or under `mtjax.fp8.fp8_autocast` `mtjax.fp8.fp8_grouped_gemm` with the
    recipe (``meta``: its delayed-scaling state, else None)."""
    autocast = fp8.current_autocast()
    if autocast is None:
        # Inside a shard_map a custom_vjp's cotangents must vary as its inputs do: the kernels vary
        # over ep/tp only, the rows over the batch axes too; the cast's transpose sums the kernels'
        # gradient over the batch axes.
        return ops.grouped_gemm(*vary_together(x, kernel), group_sizes)
    return fp8.fp8_grouped_gemm(x, kernel, group_sizes, meta, recipe=autocast.recipe, mesh_axes=autocast.mesh_axes)


def expert_mlp(x: jax.Array, group_sizes: jax.Array, wi: jax.Array, wo: jax.Array, activation: str,
               metas: tuple[Mapping[str, jax.Array] | None, Mapping[str, jax.Array] | None] = (None, None),
               ) -> jax.Array:
    """The experts' MLPs on rows sorted by expert: ``act(x @ wi[e]) @ wo[e]`` as two grouped GEMMs.

    ``x [rows, hidden]``, ``group_sizes [experts]``, ``wi [experts, hidden, num_activations, ffn]``
    (the pair axis of a gated activation: slot 0 activated, slot 1 the gate), ``wo [experts, ffn,
    hidden]``; rows past ``sum(group_sizes)`` give zeros. ``metas``: the two GEMMs' delayed-scaling
    states under `mtjax.fp8.fp8_autocast` with `mtjax.fp8.DelayedScaling` (`mtjax.fp8.GroupedGemmMeta`).
    """
    experts, hidden, num_activations, ffn = wi.shape
    h = _expert_gemm(x, wi.reshape(experts, hidden, num_activations * ffn), group_sizes, metas[0])
    h = ops.activation(h.reshape(-1, 2, ffn) if num_activations == 2 else h, activation)
    return _expert_gemm(h, wo, group_sizes, metas[1])


class MoEBlock(nn.Module):
    """A mixture-of-experts MLP: norm, router, top-k, permute, expert MLPs (grouped GEMMs), unpermute,
    plus optional shared experts.

    Each token's router scores (``softmax`` or ``sigmoid`` of ``x @ router_kernel``, float32) pick
    ``experts_per_token`` of ``num_experts`` experts (`mtjax.ops.route`: optionally group-limited,
    DeepSeek-V3's expert groups, and biased by ``expert_bias`` for auxiliary-loss-free balancing);
    the tokens are sorted by expert (`mtjax.ops.permute`), each expert's MLP runs on its rows as one
    grouped GEMM per layer (`mtjax.ops.grouped_gemm`; under `mtjax.fp8.fp8_autocast`
    `mtjax.fp8.fp8_grouped_gemm` with the recipe: under `DelayedScaling` each keeps its state in
    ``fp8_metas`` as ``wi_fp8`` / ``wo_fp8``, an amax history per expert for the kernel) and the
    results are combined back with the top-k
    weights (`mtjax.ops.unpermute`). Shared experts are one dense `LayerNormMLP` every token passes
    through, added to the routed result (DeepSeek's shared experts).

    Kernels: ``router_kernel [hidden, num_experts]`` (axes ``("embed", None)``), ``wi_kernel
    [num_experts, hidden, num_activations, expert_dim]`` (``("expert", "embed", None, "mlp")``),
    ``wo_kernel [num_experts, expert_dim, hidden]`` (``("expert", "mlp", "embed")``); with
    ``use_expert_bias`` an ``expert_bias [num_experts]`` that the gradient does not reach (a train
    step moves it towards balance: `mtjax.train.make_train_step`'s ``expert_bias_update_rate``).

    Sharding: under a mesh (``jax.set_mesh`` / `mtjax.sharding.use_mesh`) the expert computation runs
    in a ``shard_map``: each device permutes its own tokens (those of its ``activation_batch``
    share); when the ``"expert"`` rule names a mesh axis of size > 1 the rows travel to their
    experts' devices and back with all-to-alls (`mtjax.sharding.expert`); the ``"mlp"`` axis of the
    expert kernels (``tp``) splits each expert's columns, the second GEMM's partial sums added with
    a ``psum``. Without a mesh everything runs on one device.

    Auxiliary losses and metrics are sown (`flax.linen.Module.sow`), so a caller collects them with
    ``mutable=[MOE_LOSSES, MOE_METRICS]``: ``MOE_LOSSES`` holds ``load_balancing_loss`` and
    ``router_z_loss`` times their coefficients (what a train step adds to its loss), ``MOE_METRICS``
    the unweighted losses, ``expert_load`` (``[num_experts]``, each expert's fraction of the routed
    token slots) and ``dropped_fraction`` (slots dropped for lack of capacity).

    ``__call__(inputs, deterministic=False, residual=None)`` as `LayerNormMLP`: ``inputs [batch,
    length, hidden]``; returns ``(output, layernorm_output)`` (the second ``None`` unless
    ``return_layernorm_output``), or with ``residual`` (added to ``inputs`` in the norm's kernel)
    ``(output, layernorm_output, inputs + residual)``.

    Example::

        block = MoEBlock(num_experts=8, experts_per_token=2, expert_dim=256, activations=("silu", "linear"))
        variables = block.init(jax.random.PRNGKey(0), x, deterministic=True)      # x [batch, length, hidden]
        (y, _), aux = block.apply(variables, x, deterministic=True, mutable=[MOE_LOSSES, MOE_METRICS])
        loss = task_loss(y) + sum(jax.tree.leaves(aux[MOE_LOSSES]))

    Attributes:
      num_experts: routed experts.
      experts_per_token: experts each token goes to (top-k).
      expert_dim: hidden width of each routed expert's MLP.
      num_shared_experts: shared experts (0: none); they form one dense MLP of width
        ``num_shared_experts * shared_expert_dim``.
      shared_expert_dim: width of one shared expert (None: ``expert_dim``).
      activations: TransformerEngine-style tuple or a name accepted by `mtjax.ops.activation`
        (gated: ``("silu", "linear")`` = SwiGLU).
      score_function: ``"softmax"`` or ``"sigmoid"`` router scores.
      num_expert_groups, expert_group_top_k: group-limited routing (experts split into
        ``num_expert_groups`` groups, tokens choose among the best ``expert_group_top_k`` groups);
        None: plain top-k.
      normalize_weights: renormalize the top-k weights to sum to 1.
      routed_scaling_factor: multiplies the top-k weights.
      use_expert_bias: add the (not gradient-trained) ``expert_bias`` to the scores for the choice
        of experts only (DeepSeek-V3's auxiliary-loss-free balancing).
      load_balancing_loss_weight: coefficient of `mtjax.ops.load_balancing_loss` in ``MOE_LOSSES``.
      router_z_loss_weight: coefficient of `mtjax.ops.router_z_loss` in ``MOE_LOSSES``.
      capacity_factor: None: dropless; else each expert takes at most ``ceil(capacity_factor *
        tokens * experts_per_token / num_experts)`` of a device's rows, the rest is dropped (counted in
        ``dropped_fraction``; the residual stream carries the token on).
      expert_row_alignment: each expert's rows padded with zero rows to a multiple of this
        (`mtjax.ops.permute`'s ``align``; TransformerEngine's FP8 padding): 16 gives FP8 grouped GEMMs
        on cuBLASLt whole 16-row blocks. 1: packed.
      dispatch_dtype: None: tokens travel to their experts' devices in ``dtype``; an FP8 dtype
        (``jnp.float8_e4m3fn``): the expert-parallel dispatch sends them in it, scaled per 1x128 tile
        (`mtjax.sharding.expert.dispatch`'s ``payload_dtype``, DeepEP's FP8 dispatch). The combine and
        the gradients stay in ``dtype``. Used only on a mesh with an ``ep`` axis.
      intermediate_dropout_rate: dropout after the shared experts' activation (the routed experts
        have none).
      intermediate_dropout_rng_name: its rng collection.
      enable_layernorm, layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes,
        ln_bias_init, ln_bias_axes: the input norm, as `LayerNormMLP`.
      kernel_init: initializer of the expert and shared kernels (per expert).
      router_kernel_init: initializer of the router kernel (None: ``kernel_init``).
      router_kernel_axes, wi_kernel_axes, wo_kernel_axes: logical axes of the kernels.
      return_layernorm_output: also return the normalized input.
      dtype: compute and output dtype (the router computes in float32).
      param_dtype: parameter dtype.
    """

    num_experts: int = 8
    experts_per_token: int = 2
    expert_dim: int = 2048
    num_shared_experts: int = 0
    shared_expert_dim: int | None = None
    activations: str | Sequence[str] = ("silu", "linear")
    score_function: str = "softmax"
    num_expert_groups: int | None = None
    expert_group_top_k: int | None = None
    normalize_weights: bool = True
    routed_scaling_factor: float = 1.0
    use_expert_bias: bool = False
    load_balancing_loss_weight: float = 0.01
    router_z_loss_weight: float = 0.0
    capacity_factor: float | None = None
    expert_row_alignment: int = 1
    dispatch_dtype: Dtype | None = None
    intermediate_dropout_rate: float = 0.0
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
    router_kernel_init: Initializer | None = None
    router_kernel_axes: AxisNames = (axes.EMBED, None)
    wi_kernel_axes: AxisNames = (axes.EXPERT, axes.EMBED, None, axes.MLP)
    wo_kernel_axes: AxisNames = (axes.EXPERT, axes.MLP, axes.EMBED)
    return_layernorm_output: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def _validate(self) -> str:
        owner = "MoEBlock"
        for name in ("num_experts", "experts_per_token", "expert_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{owner}: {name}={value!r}; expected a positive int")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"{owner}: experts_per_token={self.experts_per_token} exceeds "
                             f"num_experts={self.num_experts}")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(f"{owner}: num_shared_experts={self.num_shared_experts!r}; expected an int >= 0")
        if self.shared_expert_dim is not None and (not isinstance(self.shared_expert_dim, int)
                                                   or self.shared_expert_dim < 1):
            raise ValueError(f"{owner}: shared_expert_dim={self.shared_expert_dim!r}; expected None or a positive int")
        if self.score_function not in ops.SCORE_FUNCTIONS:
            raise ValueError(f"{owner}: score_function={self.score_function!r}; accepted: "
                             f"{', '.join(ops.SCORE_FUNCTIONS)}")
        for name in ("num_expert_groups", "expert_group_top_k"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{owner}: {name}={value!r}; expected None or a positive int")
        if (self.num_expert_groups is None) != (self.expert_group_top_k is None):
            raise ValueError(f"{owner}: set num_expert_groups and expert_group_top_k together (or neither)")
        groups, group_top_k = self.num_expert_groups, self.expert_group_top_k
        if groups is not None and (self.num_experts % groups or not 1 <= group_top_k <= groups):
            raise ValueError(f"{owner}: num_expert_groups={self.num_expert_groups} must divide num_experts="
                             f"{self.num_experts} and 1 <= expert_group_top_k={self.expert_group_top_k} <= it")
        for name in ("load_balancing_loss_weight", "router_z_loss_weight"):
            value = getattr(self, name)
            if not is_finite_number(value, 0.0):
                raise ValueError(f"{owner}: {name}={value!r}; expected a finite number >= 0")
        capacity = self.capacity_factor
        if capacity is not None and not is_finite_number(capacity, 0.0, exclusive=True):
            raise ValueError(f"{owner}: capacity_factor={capacity!r}; expected None or a finite number > 0")
        if isinstance(self.expert_row_alignment, bool) or not isinstance(self.expert_row_alignment, int) \
                or self.expert_row_alignment < 1:
            raise ValueError(f"{owner}: expert_row_alignment={self.expert_row_alignment!r}; expected a positive int")
        if self.dispatch_dtype is not None:
            check_fp8_dtype(owner, self.dispatch_dtype, "dispatch_dtype")
        if not 0.0 <= self.intermediate_dropout_rate < 1.0:
            raise ValueError(f"{owner}: intermediate_dropout_rate={self.intermediate_dropout_rate}; "
                             "expected 0 <= rate < 1")
        return ops.canonical_activation(self.activations)

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool = False, residual: jax.Array | None = None,
                 ) -> tuple[jax.Array, ...]:
        activation = self._validate()
        if inputs.ndim != 3:
            raise ValueError(f"MoEBlock: inputs has shape {inputs.shape}; expected [batch, length, hidden]")
        batch, length, hidden = inputs.shape
        num_activations = 2 if ops.is_gated(activation) else 1
        x, _, new_residual = input_norm(self, inputs.astype(self.dtype), residual, apply_now=True)
        x = nn.with_logical_constraint(x, TOKEN_AXES)

        router_kernel = param_with_axes(self, "router_kernel", self.router_kernel_init or self.kernel_init,
                                        (hidden, self.num_experts), self.param_dtype, self.router_kernel_axes)
        logits = jnp.einsum("blh,he->ble", x.astype(jnp.float32), router_kernel.astype(jnp.float32))
        logits = logits.reshape(batch * length, self.num_experts)
        expert_bias = None
        if self.use_expert_bias:
            expert_bias = jax.lax.stop_gradient(param_with_axes(
                self, "expert_bias", nn.initializers.zeros, (self.num_experts,), jnp.float32, (None,)))
        routing = ops.route(logits, top_k=self.experts_per_token, score_function=self.score_function,
                            num_groups=self.num_expert_groups, group_top_k=self.expert_group_top_k,
                            expert_bias=expert_bias, normalize_weights=self.normalize_weights,
                            scaling_factor=self.routed_scaling_factor)
        self._sow_aux(logits, routing)

        wi = param_with_axes(self, "wi_kernel", expert_kernel_init(self.kernel_init),
                             (self.num_experts, hidden, num_activations, self.expert_dim), self.param_dtype,
                             self.wi_kernel_axes).astype(self.dtype)
        wo = param_with_axes(self, "wo_kernel", expert_kernel_init(self.kernel_init),
                             (self.num_experts, self.expert_dim, hidden), self.param_dtype,
                             self.wo_kernel_axes).astype(self.dtype)
        weights = routing.weights.reshape(batch, length, self.experts_per_token)
        experts = routing.experts.reshape(batch, length, self.experts_per_token)
        metas = (fp8.GroupedGemmMeta(self.num_experts, name="wi_fp8")(),
                 fp8.GroupedGemmMeta(self.num_experts, name="wo_fp8")())
        y, dropped = self._routed(x, experts, weights, wi, wo, metas, activation)
        self.sow(MOE_METRICS, "dropped_fraction", dropped / (batch * length * self.experts_per_token))

        if self.num_shared_experts:
            shared_dim = self.num_shared_experts * (self.shared_expert_dim or self.expert_dim)
            shared, _ = LayerNormMLP(
                intermediate_dim=shared_dim, activations=self.activations, enable_layernorm=False,
                intermediate_dropout_rate=self.intermediate_dropout_rate,
                intermediate_dropout_rng_name=self.intermediate_dropout_rng_name, kernel_init=self.kernel_init,
                dtype=self.dtype, param_dtype=self.param_dtype, name="shared_experts",
            )(x, deterministic=deterministic)
            y = y + shared
        y = nn.with_logical_constraint(y.astype(self.dtype), TOKEN_AXES)
        ln_out = x if self.return_layernorm_output else None
        return (y, ln_out) if residual is None else (y, ln_out, new_residual)

    def _sow_aux(self, logits: jax.Array, routing: Any) -> None:
        load_balancing = ops.load_balancing_loss(routing.probs, routing.experts, self.num_experts)
        z_loss = ops.router_z_loss(logits)
        slots = routing.experts.size
        load = ops.expert_counts(routing.experts, self.num_experts).astype(jnp.float32) / slots
        self.sow(MOE_METRICS, "load_balancing_loss", load_balancing)
        self.sow(MOE_METRICS, "router_z_loss", z_loss)
        self.sow(MOE_METRICS, "expert_load", load)
        if self.load_balancing_loss_weight:
            self.sow(MOE_LOSSES, "load_balancing_loss", self.load_balancing_loss_weight * load_balancing)
        if self.router_z_loss_weight:
            self.sow(MOE_LOSSES, "router_z_loss", self.router_z_loss_weight * z_loss)

    def _expert_capacity(self, tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return ops.expert_capacity(tokens, self.experts_per_token, self.num_experts, self.capacity_factor)

    def _routed(self, x: jax.Array, experts: jax.Array, weights: jax.Array, wi: jax.Array, wo: jax.Array,
                metas: tuple[Any, Any], activation: str) -> tuple[jax.Array, jax.Array]:
        """The routed experts' output ``[batch, length, hidden]`` and the number of dropped slots."""
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mesh.size == 1:
            return self._local(x, experts, weights, wi, wo, metas, activation, ep_axis=None, mlp_axes=())
        batch_axes = _mesh_axes_of(axes.ACTIVATION_BATCH)
        ep_axes = _mesh_axes_of(self.wi_kernel_axes[0])
        mlp_axes = _mesh_axes_of(self.wi_kernel_axes[3])
        if len(ep_axes) > 1:
            raise ValueError(f"MoEBlock: the {self.wi_kernel_axes[0]!r} rule maps to several mesh axes {ep_axes}; "
                             "expert parallelism takes one")
        manual = frozenset(a for a in mesh.axis_names if a not in mesh.manual_axes)
        ep_axis = ep_axes[0] if ep_axes and mesh.shape[ep_axes[0]] > 1 else None
        if ep_axis is not None and self.num_experts % mesh.shape[ep_axis]:
            raise ValueError(f"MoEBlock: num_experts={self.num_experts} is not divisible by the {ep_axis!r} "
                             f"mesh axis size {mesh.shape[ep_axis]}")
        tokens = PartitionSpec(batch_axes or None, None, None)
        ep_spec = ep_axis  # expert kernels outside the ep axis are gathered (e.g. over fsdp)
        mlp_spec = mlp_axes or None

        def local(x, experts, weights, wi, wo, metas):
            metas = tuple(m or None for m in metas)
            y, dropped = self._local(x, experts, weights, wi, wo, metas, activation, ep_axis=ep_axis,
                                     mlp_axes=mlp_axes)
            return y, jax.lax.psum(dropped, batch_axes) if batch_axes else dropped

        metas = tuple({} if m is None else m for m in metas)  # no state: an empty tree crosses
        return jax.shard_map(
            local, mesh=mesh, axis_names=manual,
            in_specs=(tokens, tokens, tokens, PartitionSpec(ep_spec, None, None, mlp_spec),
                      PartitionSpec(ep_spec, mlp_spec, None), tuple(_meta_specs(m, ep_spec) for m in metas)),
            out_specs=(tokens, PartitionSpec()),
        )(x, experts, weights, wi, wo, metas)

    def _local(self, x: jax.Array, experts: jax.Array, weights: jax.Array, wi: jax.Array, wo: jax.Array,
               metas: tuple[Any, Any], activation: str, *, ep_axis: str | None,
               mlp_axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
        """One device's share (or the whole computation without a mesh)."""
        batch, length, hidden = x.shape
        tokens = batch * length
        x = x.reshape(tokens, hidden)
        experts = experts.reshape(tokens, -1)
        weights = weights.reshape(tokens, -1)
        x_sorted, group_sizes, state = ops.permute(x, experts, self.num_experts, capacity=self._expert_capacity(tokens),
                                                   align=self.expert_row_alignment)
        dropped = state.num_dropped
        if ep_axis is None:
            y_sorted = expert_mlp(x_sorted, group_sizes, wi, wo, activation, metas)
        else:
            rows = x_sorted.shape[0]
            ep = jax.lax.axis_size(ep_axis)
            local_experts = self.num_experts // ep
            capacity = expert_parallel.capacity(rows, ep)
            expert_capacity = self._expert_capacity(tokens)
            if expert_capacity is not None:  # a chunk holds at most local_experts * expert_capacity rows
                align = self.expert_row_alignment  # each expert's rows padded to a multiple of it
                capacity = min(capacity, local_experts * -(-expert_capacity // align) * align)
            x_local, local_sizes, dispatch_state = expert_parallel.dispatch(
                x_sorted, group_sizes, axis_name=ep_axis, capacity=capacity, payload_dtype=self.dispatch_dtype)
            y_local = expert_mlp(x_local, local_sizes, wi, wo, activation, metas)
            y_sorted = expert_parallel.combine(y_local, dispatch_state, axis_name=ep_axis, rows=rows)
        if mlp_axes:  # partial sums of the second GEMM over the split expert columns
            y_sorted = jax.lax.psum(y_sorted, mlp_axes)
        y = ops.unpermute(*vary_together(y_sorted, weights), state)
        return y.reshape(batch, length, hidden).astype(self.dtype), dropped.astype(jnp.int32)



class MoETransformerLayer(TransformerLayer):
    """A `TransformerLayer` whose MLP is a `MoEBlock` (a mixture-of-experts Transformer block).

    Attributes (besides `TransformerLayer`'s; ``mlp_hidden_size``, ``intermediate_dropout_dims`` and
    ``use_bias`` do not apply to the MoE MLP):
      moe: keyword arguments of the `MoEBlock` (``num_experts``, ``experts_per_token``,
        ``expert_dim``, ...); the norm, ``kernel_init``, ``activations``, ``intermediate_dropout``
        and dtypes come from the layer.
    """

    moe: Mapping[str, Any] = FrozenDict()

    def make_mlp(self) -> nn.Module:  # noqa: D102
        return MoEBlock(**self.mlp_norm_kwargs(), activations=self.mlp_activations,
                        intermediate_dropout_rate=self.intermediate_dropout,
                        intermediate_dropout_rng_name=self.dropout_rng_name, **self.moe, name="mlp")


def _sown(collection: Mapping[str, Any], name: str) -> list[jax.Array]:
    """Every value sown under ``name`` anywhere in ``collection`` (a tuple per module call)."""
    found: list[jax.Array] = []
    for key, value in collection.items():
        if isinstance(value, Mapping):
            found += _sown(value, name)
        elif key == name:
            found += list(value)
    return found


def moe_metrics(metrics: Mapping[str, Any], losses: Mapping[str, Any] | None = None) -> dict[str, jax.Array]:
    """Summarizes the ``MOE_METRICS`` (and ``MOE_LOSSES``) collections of a forward pass over all
    MoE layers (a scanned stack's stacked values included); ``{}`` when there is no MoE layer.

    Returns ``moe_expert_load [num_experts]`` (each expert's fraction of the routed slots, averaged
    over the layers), ``moe_max_load`` / ``moe_min_load`` (the largest / smallest load of any expert
    in any layer relative to an even split: 1 is balanced), ``moe_dropped_fraction``,
    ``moe_load_balancing_loss`` and ``moe_router_z_loss`` (unweighted, averaged over the layers) and,
    with ``losses``, ``moe_aux_loss`` (the weighted sum a train step adds to its loss).
    """
    loads = _sown(metrics, "expert_load")
    if not loads:
        return {}
    num_experts = loads[0].shape[-1]
    load = jnp.concatenate([x.reshape(-1, num_experts) for x in loads])
    mean = lambda name: jnp.concatenate([x.reshape(-1) for x in _sown(metrics, name)]).mean()
    out = {"moe_expert_load": load.mean(axis=0), "moe_max_load": load.max() * num_experts,
           "moe_min_load": load.min() * num_experts, "moe_dropped_fraction": mean("dropped_fraction"),
           "moe_load_balancing_loss": mean("load_balancing_loss"), "moe_router_z_loss": mean("router_z_loss")}
    if losses is not None:
        out["moe_aux_loss"] = moe_aux_loss(losses)
    return out


def moe_aux_loss(losses: Mapping[str, Any]) -> jax.Array:
    """The sum of every value in a ``MOE_LOSSES`` collection (0 when empty): what a train step adds."""
    return sum((jnp.sum(x) for x in jax.tree.leaves(losses)), jnp.zeros((), jnp.float32))
