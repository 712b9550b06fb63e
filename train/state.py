"""`TrainState`: everything a training run carries from step to step, as one pytree.

Parameters are kept in ``param_dtype`` (f32 master weights); the model computes in its ``dtype``
(bf16 on GPUs). With ``compute_dtype`` the state also carries ``compute_params``, the master weights'
matrices already cast to the model's compute dtype (Megatron's and TransformerEngine's bf16 model
weights beside f32 main weights): the forward pass then reads 2 bytes per weight instead of
casting 4 to 2 every step, the weight gradients stay in that dtype until the optimizer's fused
update reads them, and that update writes the next copy. The model sees the same values either
way (its modules cast every matrix to their compute dtype before using it); what can move is
rounding: a weight used twice (a tied embedding) has its two bf16 gradient terms summed in bf16
rather than float32, and XLA may round a GEMM's float32 gradient at another point. With a mesh,
every leaf is laid out by the logical-axis annotations of the model (``nn.with_logical_partitioning``)
mapped through the logical rules; optimizer moments inherit their parameter's layout.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding

from mtjax import axes, fp8
from mtjax.fp8 import FP8_COLLECTION
from mtjax.sharding import LogicalRules, logical_shardings, named_sharding, tree_shardings, use_mesh


@struct.dataclass
class TrainState:
    """The state of a training run.

    Attributes:
      step: int32 scalar, the number of optimizer updates done.
      params: the model's ``"params"`` collection (f32 master weights).
      compute_params: ``params`` with its matrices in the compute dtype (`compute_copy`), the leaves
        the model computes with; ``None``: the model reads ``params``. Not checkpointed: a restore
        rebuilds it from ``params``.
      fp8_meta: the model's ``"fp8_meta"`` collection (FP8 delayed-scaling state); ``{}`` without FP8.
      opt_state: the optax optimizer state.
      rng: a raw ``uint32[2]`` PRNG key, split every step (dropout).
    """

    step: jax.Array
    params: Any
    fp8_meta: Any
    opt_state: Any
    rng: jax.Array
    compute_params: Any = None

    def variables(self) -> dict[str, Any]:
        """The variables to ``model.apply`` with."""
        variables = {"params": self.params if self.compute_params is None else self.compute_params}
        if self.fp8_meta:
            variables[FP8_COLLECTION] = self.fp8_meta
        return variables


def compute_copy(params: Any, dtype: Any) -> Any:
    """``params`` with every floating leaf of two or more dimensions (kernels, embeddings, bias tables,
    multi-axis biases such as ``[heads, head_dim]``) cast to ``dtype``, which `mtjax.flax` modules
    cast to their compute dtype before use anyway; vectors (norm scales, 1-D biases) stay as they
    are, since the norms use their scales in float32.

    Pass the boxed parameters (``nn.Partitioned``, as ``model.init`` returns them): the boxes are
    kept, hence the logical axes, and a scanned stack's leading `mtjax.axes.LAYERS` does not
    count, so stacked norm scales stay vectors. Unboxed leaves count every dimension.
    """
    def cast(leaf: Any) -> Any:
        boxed = isinstance(leaf, nn.Partitioned)
        value = leaf.value if boxed else leaf
        names = leaf.names if boxed else (None,) * value.ndim
        if sum(name != axes.LAYERS for name in names) >= 2 and jnp.issubdtype(value.dtype, jnp.floating):
            value = value.astype(dtype)
        return leaf.replace_boxed(value) if boxed else value

    return jax.tree.map(cast, params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def cast_like(params: Any, copy: Any) -> Any:
    """``params`` cast leaf by leaf to the dtypes of ``copy`` (a `compute_copy` of the same tree, or
    its abstract shapes): the copy brought up to date with ``params``."""
    return jax.tree.map(lambda p, c: p.astype(c.dtype), params, copy)


def compute_dtype_for(dtype: Any, param_dtype: Any) -> Any:
    """The ``compute_dtype`` `mtjax train` and the train bench use: the model's ``dtype`` when it is
    narrower than its ``param_dtype`` (bf16 compute of f32 weights), else ``None`` (no copy)."""
    return dtype if jnp.dtype(dtype).itemsize < jnp.dtype(param_dtype).itemsize else None


def _check_compute_dtype(model: nn.Module, compute_dtype: Any) -> None:
    """A copy in another dtype than the model computes in would change what it computes."""
    if compute_dtype is None:
        return
    model_dtype = getattr(getattr(model, "config", model), "dtype", None)  # GPT(config) or a module's dtype
    if not jnp.issubdtype(compute_dtype, jnp.floating) or (
            model_dtype is not None and jnp.dtype(model_dtype) != jnp.dtype(compute_dtype)):
        raise ValueError(f"compute_dtype={jnp.dtype(compute_dtype).name}: expected the model's compute dtype "
                         f"({'a floating dtype' if model_dtype is None else jnp.dtype(model_dtype).name}) or None")


def _init_fn(model: nn.Module, optimizer: optax.GradientTransformation, batch_shape: tuple[int, int],
             compute_dtype: Any):
    _check_compute_dtype(model, compute_dtype)

    def init(rng: jax.Array, params: Any = None) -> TrainState:
        params_rng, dropout_rng, state_rng = jax.random.split(rng, 3)
        variables = model.init({"params": params_rng, "dropout": dropout_rng},
                               jnp.zeros(batch_shape, jnp.int32))
        if params is not None:  # given parameters replace the initial ones (whose computation XLA drops)
            variables = {**variables, "params": params}
        params = variables["params"]
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          fp8_meta=variables.get(FP8_COLLECTION, {}),
                          opt_state=fp8.Optimizer(optimizer, collection="params").init(variables),
                          rng=state_rng,
                          compute_params=None if compute_dtype is None else compute_copy(params, compute_dtype))

    return init


def batch_sharding(mesh: Mesh, rules: LogicalRules) -> NamedSharding:
    """Token batches ``[batch, seq]``: split over the data-parallel axes (``activation_batch``)."""
    return named_sharding(mesh, rules, (axes.ACTIVATION_BATCH, None))


def abstract_train_state(model: nn.Module, optimizer: optax.GradientTransformation,
                         batch_shape: tuple[int, int], *, mesh: Mesh | None = None,
                         rules: LogicalRules | None = None, compute_dtype: Any = None,
                         rng_seed: int = 0) -> TrainState:
    """The `TrainState` as ``jax.ShapeDtypeStruct`` leaves with their ``.sharding``.

    Without ``mesh`` every leaf is on the first device. ``compute_dtype`` as `init_train_state`.

    What `init_train_state` creates and what `mtjax.train.checkpoint.Checkpointer.restore` restores
    into (which is how a checkpoint moves to another mesh or device count).
    """
    boxed = jax.eval_shape(_init_fn(model, optimizer, batch_shape, compute_dtype), jax.random.PRNGKey(rng_seed))
    abstract = nn.meta.unbox(boxed)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
    if rules is None:
        raise ValueError("abstract_train_state(mesh=...) needs rules=[(logical_axis, mesh_axes), ...]")
    shardings = logical_shardings(boxed, mesh, rules)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def init_train_state(model: nn.Module, optimizer: optax.GradientTransformation, rng: jax.Array,
                     batch_shape: tuple[int, int], *, mesh: Mesh | None = None,
                     rules: LogicalRules | None = None, compute_dtype: Any = None, params: Any = None) -> TrainState:
    """A fresh `TrainState`, each leaf created directly in its sharding.

    Args:
      model: a linen module called as ``model(tokens [batch, seq] int32, deterministic=...)``.
      optimizer: the optax transformation.
      rng: a raw PRNG key (``jax.random.PRNGKey(seed)``).
      batch_shape: ``(batch, seq)`` of the token batches (only the shape matters).
      mesh, rules: lay the state out on ``mesh`` by the logical-axis ``rules``.
      compute_dtype: also keep ``compute_params``, the matrices in this dtype (the model's ``dtype``,
        e.g. bf16; any other would change what the model computes). ``None``: no copy.
      params: start from these parameters (the unboxed ``"params"`` tree, e.g. a pretrained model's,
        best already in the state's shardings) instead of initial ones; the optimizer state is fresh.
        They are cast to the state's parameter dtypes and donated.

    Raises:
      ValueError: ``params`` do not have the model's parameter names and shapes.
    """
    init = _init_fn(model, optimizer, batch_shape, compute_dtype)
    abstract = abstract_train_state(model, optimizer, batch_shape, mesh=mesh, rules=rules,
                                    compute_dtype=compute_dtype)
    if params is not None:
        if jax.tree.structure(params) != jax.tree.structure(abstract.params) or any(
                p.shape != a.shape for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(abstract.params))):
            raise ValueError("init_train_state: params do not have the model's parameter names and shapes")
        params = jax.tree.map(lambda p, a: p.astype(a.dtype), params, abstract.params)
    shardings = tree_shardings(abstract)
    make = jax.jit(lambda r, p: nn.meta.unbox(init(r, p)), out_shardings=shardings, donate_argnums=1)
    if mesh is None:
        return make(rng, params)
    with use_mesh(mesh, rules):
        return make(rng, params)
