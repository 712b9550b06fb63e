"""Logical axis names: what the modules call each axis of their parameters and activations.

`mtjax.flax` annotates every parameter (``nn.with_logical_partitioning``) and every
``[batch, length, ...]`` activation (``nn.with_logical_constraint``) with these names;
`mtjax.sharding.logical_axis_rules` maps each to mesh axes. Defined once here, so a module, a model,
a rule and the training state cannot disagree on a spelling. `MeshResource` names the *mesh* axes
that play each role (data, tensor, pipeline... parallelism). This module imports nothing from mtjax.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

# Parameter axes.
EMBED = "embed"  # the model (hidden) dimension
MLP = "mlp"  # the MLP's inner dimension
HEADS = "heads"  # query heads
KV_HEADS = "kv_heads"  # key/value heads (fewer than HEADS under grouped-query attention)
HEAD_DIM = "head_dim"
VOCAB = "vocab"
RELPOS_BUCKETS = "relpos_buckets"  # relative-position buckets of T5-style attention biases
LAYERS = "layers"  # the leading axis of a scanned stack's parameters
EXPERT = "expert"  # the experts of a mixture-of-experts layer (its kernels' leading axis)

# Activation axes.
ACTIVATION_BATCH = "activation_batch"
ACTIVATION_LENGTH = "activation_length"
ACTIVATION_EMBED = "activation_embed"
ACTIVATION_MLP = "activation_mlp"
ACTIVATION_HEADS = "activation_heads"
ACTIVATION_KV_HEADS = "activation_kv_heads"
ACTIVATION_HEAD_DIM = "activation_head_dim"
ACTIVATION_VOCAB = "activation_vocab"

# The [batch, length, embed] activations every layer reads and writes.
BATCH_LENGTH_EMBED = (ACTIVATION_BATCH, ACTIVATION_LENGTH, ACTIVATION_EMBED)


# Which mesh axis plays which role: TransformerEngine-JAX's `MeshResource`.
@dataclasses.dataclass(frozen=True)
class MeshResource:
    """The names *your* mesh gives to each kind of parallelism (TransformerEngine-JAX's ``MeshResource``,
    same fields in the same order).

    `mtjax.sharding.logical_axis_rules` turns it into rules that name only these axes, so a mesh with
    any axis names (``("data", "model")``, or just ``("dp", "tp")``) works; `mtjax.fp8.autocast`
    takes it as ``mesh_resource=`` (amaxes are max-reduced over its axes, pipeline stages excepted) and
    makes it the one `mtjax.sharding.extend_logical_axis_rules` reads. A role left ``None`` is not
    split over any axis.

    Attributes:
      dp_resource: the data-parallel axis (splits the batch).
      tp_resource: the tensor-parallel axis (Megatron: heads, MLP columns, vocabulary).
      tpsp_resource: a tensor-parallel axis that also splits the sequence between the blocks
        (sequence parallelism); set this *or* ``tp_resource``.
      fsdp_resource: the fully-sharded data-parallel axis (splits the batch and the weights' model
        dimension).
      pp_resource: the pipeline axis (the ``layers`` axis of stacked layer parameters).
      cp_resource: the context-parallel axis (splits the sequence everywhere).
      ep_resource: the expert-parallel axis (a mixture-of-experts layer's experts; splits the batch too).

    Example::

        mesh = jax.make_mesh((4, 2), ("data", "model"))
        resource = MeshResource(dp_resource="data", tp_resource="model")
        rules = mtjax.sharding.logical_axis_rules(resource, mesh=mesh)   # names only "data" and "model"
    """

    dp_resource: str | None = None
    tp_resource: str | None = None
    tpsp_resource: str | None = None
    fsdp_resource: str | None = None
    pp_resource: str | None = None
    cp_resource: str | None = None
    ep_resource: str | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"MeshResource({field.name}={value!r}): expected None or a mesh axis name")
        if self.tp_resource is not None and self.tpsp_resource is not None:
            raise ValueError(f"MeshResource(tp_resource={self.tp_resource!r}, tpsp_resource={self.tpsp_resource!r}): "
                             "set one of them (tpsp_resource is tensor parallelism plus sequence parallelism)")
        named = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if getattr(self, f.name)]
        axes = [axis for _, axis in named]
        repeated = sorted({axis for axis in axes if axes.count(axis) > 1})
        if repeated:
            roles = {axis: [name for name, a in named if a == axis] for axis in repeated}
            raise ValueError(f"MeshResource: mesh axis {repeated[0]!r} is named for {roles[repeated[0]]}; each axis "
                             "can play one role")

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The mesh axes named, in field order."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None)

    @property
    def tensor_resource(self) -> str | None:
        """The tensor-parallel axis, with or without sequence parallelism."""
        return self.tpsp_resource or self.tp_resource


_mesh_resource: contextvars.ContextVar[MeshResource | None] = contextvars.ContextVar("mtjax_mesh_resource",
                                                                                      default=None)


def current_mesh_resource() -> MeshResource | None:
    """The `MeshResource` of the innermost `mtjax.fp8.autocast` (or `mesh_resource_scope`), or None."""
    return _mesh_resource.get()


@contextlib.contextmanager
def mesh_resource_scope(resource: MeshResource | None) -> Iterator[MeshResource | None]:
    """Make ``resource`` the `current_mesh_resource` inside (TransformerEngine's ``global_shard_guard``)."""
    if resource is not None and not isinstance(resource, MeshResource):
        raise TypeError(f"mesh_resource={resource!r}: expected a MeshResource or None")
    token = _mesh_resource.set(resource)
    try:
        yield resource
    finally:
        _mesh_resource.reset(token)
