"""Logical-axis rules: which mesh axis splits each logical axis name the modules annotate.

The modules name the axes of every parameter (``"embed"``, ``"mlp"``, ``"heads"``, ...) and of the
activations they constrain (``"activation_batch"``, ``"activation_length"``, ...); a rule maps a
name to a mesh axis, a tuple of mesh axes, or ``None`` (replicated). Flax resolves an array's
names in rule order: a name takes its mesh axis only if no earlier-resolved dimension of the same
array already took it. That ordering is how one rule set expresses the Megatron layout with
sequence parallelism: ``activation_heads``/``activation_mlp`` come before ``activation_length``,
so inside attention and the MLP the ``tp`` axis splits heads or MLP columns and the sequence is
whole, while the residual stream (batch, length, embed) has the sequence split over ``tp``.
XLA then inserts the all-gather before the column-parallel GEMM and the reduce-scatter after the
row-parallel one.

The rules name mesh axes through a `MeshResource` (which axis is data-, tensor-, pipeline-parallel...):
`MeshConfig`'s own axes (``dp``, ``fsdp``, ``tp``, ...) or the axes of a mesh you built yourself, as
TransformerEngine-JAX's ``MeshResource`` does; the rules then name no axis the resource leaves out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh

from mtjax import axes
from mtjax.axes import MeshResource, current_mesh_resource
from mtjax.sharding.mesh import AXES, MeshConfig

MeshAxes = str | tuple[str, ...] | None
LogicalRules = tuple[tuple[str, MeshAxes], ...]


def logical_axis_rules(config: MeshConfig | MeshResource, overrides: Mapping[str, MeshAxes] | None = None, *,
                       mesh: Mesh | None = None) -> LogicalRules:
    """The default rules for ``config`` (MaxText / TransformerEngine-JAX conventions), with overrides.

    ========================  ===================  ==========================================
    logical name              mesh axes            why
    ========================  ===================  ==========================================
    activation_batch          (dp, fsdp)           both data-parallel axes split the batch
                              (+ ep if ep > 1)     (and the expert-parallel one, when used)
    activation_heads,         tp                   Megatron: QKV / fc1 column-parallel,
    activation_kv_heads,                           out-projection / fc2 row-parallel,
    activation_mlp,                                logits split over the vocabulary
    activation_vocab
    activation_length         (cp, tp) if sp       sequence parallelism between the blocks;
                              else cp              cp splits it everywhere (then cp alone where
                                                   tp holds the heads / MLP columns)
    activation_embed,         None
    activation_head_dim
    embed                     fsdp                 FSDP splits every weight on its model dim
    mlp, heads, kv_heads,     tp                   the tensor-parallel weight dims
    vocab
    expert                    ep                   a mixture-of-experts layer's experts
    layers                    pp                   scanned layers split into pipeline stages
    head_dim, relpos_buckets  None
    ========================  ===================  ==========================================

    Args:
      config: a `MeshConfig` (the rules name its axes ``dp``, ``fsdp``, ``tp``...; ``sp`` decides
        ``activation_length``, ``ep > 1`` adds ``ep`` to ``activation_batch``, ``cp > 1`` splits the
        sequence), or a `MeshResource` naming the axes of your own mesh: each role above maps to the
        axis the resource names for it (``tpsp_resource`` is ``tp`` with ``sp``; a role left
        ``None`` maps to None), so the rules name only those axes.
      overrides: ``{logical name: mesh axes}`` replacing the default rule of a name (at its place
        in the order) or adding a rule for a new name (at the end); e.g. ``{"embed": None}`` for
        pure data parallelism on the ``fsdp`` axis.
      mesh: the mesh the rules are for, if you have it: a rule naming an axis the mesh lacks is a
        ValueError here (naming the axis, the logical names and the mesh's axes) instead of flax's
        ``Resource axis ... is not found in mesh`` when a function is traced.
    """
    if isinstance(config, MeshConfig):
        resource = config.mesh_resource()
        sp, batch_ep, split_sequence = config.sp, config.ep > 1, config.cp > 1
        allowed = AXES
    elif isinstance(config, MeshResource):
        resource = config
        sp, batch_ep, split_sequence = config.tpsp_resource is not None, True, True
        allowed = config.axis_names
    else:
        raise TypeError(f"logical_axis_rules(config=...): expected a MeshConfig or a MeshResource, got "
                        f"{type(config).__name__}")
    tp, cp = resource.tensor_resource, resource.cp_resource if split_sequence else None
    batch = _axes(resource.dp_resource, resource.fsdp_resource, resource.ep_resource if batch_ep else None)
    sequence = _axes(cp, tp if sp else None)
    rules: dict[str, MeshAxes] = {
        axes.ACTIVATION_BATCH: batch,
        axes.ACTIVATION_HEADS: tp,
        axes.ACTIVATION_KV_HEADS: tp,
        axes.ACTIVATION_MLP: tp,
        axes.ACTIVATION_VOCAB: tp,
        # After the names above: where heads / MLP columns hold tp the sequence stays whole.
        axes.ACTIVATION_LENGTH: sequence,
        axes.ACTIVATION_EMBED: None,
        axes.ACTIVATION_HEAD_DIM: None,
        axes.EMBED: resource.fsdp_resource,
        axes.MLP: tp,
        axes.HEADS: tp,
        axes.KV_HEADS: tp,
        axes.VOCAB: tp,
        axes.EXPERT: resource.ep_resource,
        axes.LAYERS: resource.pp_resource,
        axes.HEAD_DIM: None,
        axes.RELPOS_BUCKETS: None,
    }
    for name, mesh_axes in (overrides or {}).items():
        _check_override(name, mesh_axes, allowed)
        rules[name] = mesh_axes
    ordered = []
    for name, mesh_axes in rules.items():
        ordered.append((name, mesh_axes))
        if name == axes.ACTIVATION_LENGTH and cp is not None and sp and tp is not None and mesh_axes == sequence:
            # Flax takes a rule only if all its mesh axes are free: inside attention and the MLP
            # (tp on heads / columns) the sequence falls back to cp alone.
            ordered.append((name, cp))
    ordered = tuple(ordered)
    if mesh is not None:
        check_rules_fit_mesh(ordered, mesh, "logical_axis_rules")
    return ordered


def extend_logical_axis_rules(rules: Sequence[tuple[str, MeshAxes]], *,
                              mesh_resource: MeshResource | None = None) -> LogicalRules:
    """``rules`` followed by mtjax's rules for every logical name ``rules`` does not map
    (TransformerEngine-JAX's ``extend_logical_axis_rules``).

    The mtjax rules are `logical_axis_rules` of ``mesh_resource``, by default the one of the
    enclosing `mtjax.fp8.autocast` (call it inside, as with TransformerEngine). A name ``rules``
    already maps keeps your rule (TransformerEngine instead raises when the two differ).

    Raises:
      ValueError: no ``mesh_resource`` is given nor set by an enclosing ``autocast``, or a rule is
        not a ``(name, mesh axes)`` pair.
    """
    resource = mesh_resource if mesh_resource is not None else current_mesh_resource()
    if resource is None:
        raise ValueError("extend_logical_axis_rules: no MeshResource; call it inside "
                         "mtjax.fp8.autocast(mesh_resource=MeshResource(...)) or pass mesh_resource=")
    given = []
    for rule in rules:
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"extend_logical_axis_rules: rule {rule!r} is not a (logical name, mesh axes) pair")
        given.append((rule[0], tuple(rule[1]) if isinstance(rule[1], list) else rule[1]))
    mapped = {name for name, _ in given}
    return tuple(given) + tuple(rule for rule in logical_axis_rules(resource) if rule[0] not in mapped)


def check_rules_fit_mesh(rules: Sequence[tuple[str, MeshAxes]], mesh: Any, where: str) -> None:
    """ValueError if a rule names a mesh axis ``mesh`` lacks (the message names the axis, the logical
    names mapped to it and the mesh's axes)."""
    missing: dict[str, list[str]] = {}
    for name, mesh_axes in rules:
        for axis in (mesh_axes,) if isinstance(mesh_axes, str) else (mesh_axes or ()):
            if axis not in mesh.axis_names:
                missing.setdefault(axis, []).append(name)
    if missing:
        axis, names = next(iter(missing.items()))
        raise ValueError(
            f"{where}: the rules map {names} to mesh axis {axis!r}, which the mesh (axes {tuple(mesh.axis_names)}) "
            "lacks; describe your mesh's axes with mtjax.sharding.MeshResource(dp_resource=..., tp_resource=..., "
            "...) and pass it instead of a MeshConfig, or override those names")


def _axes(*names: str | None) -> MeshAxes:
    """None, one axis, or a tuple of axes: the names given, in order, without the Nones."""
    present = tuple(n for n in names if n is not None)
    return present[0] if len(present) == 1 else (present or None)


def _check_override(name: str, mesh_axes: MeshAxes, allowed: tuple[str, ...]) -> None:
    names = (mesh_axes,) if isinstance(mesh_axes, str) else (mesh_axes or ())
    if not isinstance(names, tuple) or any(axis not in allowed for axis in names):
        raise ValueError(
            f"logical_axis_rules(overrides={{{name!r}: {mesh_axes!r}}}): expected None, a mesh axis or a "
            f"tuple of mesh axes from {allowed}"
        )
