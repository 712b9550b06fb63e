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
"""

from __future__ import annotations

from collections.abc import Mapping

from mtjax import axes
from mtjax.sharding.mesh import AXES, DP, FSDP, PP, TP, MeshConfig

MeshAxes = str | tuple[str, ...] | None
LogicalRules = tuple[tuple[str, MeshAxes], ...]


def logical_axis_rules(config: MeshConfig, overrides: Mapping[str, MeshAxes] | None = None) -> LogicalRules:
    """The default rules for ``config`` (MaxText / TransformerEngine-JAX conventions), with overrides.

    ========================  ===================  ==========================================
    logical name              mesh axes            why
    ========================  ===================  ==========================================
    activation_batch          (dp, fsdp)           both data-parallel axes split the batch
    activation_heads,         tp                   Megatron: QKV / fc1 column-parallel,
    activation_kv_heads,                           out-projection / fc2 row-parallel,
    activation_mlp,                                logits split over the vocabulary
    activation_vocab
    activation_length         tp if sp else None   sequence parallelism between the blocks
    activation_embed,         None
    activation_head_dim
    embed                     fsdp                 FSDP splits every weight on its model dim
    mlp, heads, kv_heads,     tp                   the tensor-parallel weight dims
    vocab
    layers                    pp                   scanned layers split into pipeline stages
    head_dim, relpos_buckets  None
    ========================  ===================  ==========================================

    Args:
      config: the mesh the rules are for (``sp`` decides ``activation_length``).
      overrides: ``{logical name: mesh axes}`` replacing the default rule of a name (at its place
        in the order) or adding a rule for a new name (at the end); e.g. ``{"embed": None}`` for
        pure data parallelism on the ``fsdp`` axis.
    """
    if not isinstance(config, MeshConfig):
        raise TypeError(f"logical_axis_rules(config=...): expected a MeshConfig, got {type(config).__name__}")
    rules: dict[str, MeshAxes] = {
        axes.ACTIVATION_BATCH: (DP, FSDP),
        axes.ACTIVATION_HEADS: TP,
        axes.ACTIVATION_KV_HEADS: TP,
        axes.ACTIVATION_MLP: TP,
        axes.ACTIVATION_VOCAB: TP,
        # After the names above: where heads / MLP columns hold tp the sequence stays whole.
        axes.ACTIVATION_LENGTH: TP if config.sp else None,
        axes.ACTIVATION_EMBED: None,
        axes.ACTIVATION_HEAD_DIM: None,
        axes.EMBED: FSDP,
        axes.MLP: TP,
        axes.HEADS: TP,
        axes.KV_HEADS: TP,
        axes.VOCAB: TP,
        axes.LAYERS: PP,
        axes.HEAD_DIM: None,
        axes.RELPOS_BUCKETS: None,
    }
    for name, mesh_axes in (overrides or {}).items():
        _check_mesh_axes(name, mesh_axes)
        rules[name] = mesh_axes
    return tuple(rules.items())


def _check_mesh_axes(name: str, axes: MeshAxes) -> None:
    names = (axes,) if isinstance(axes, str) else (axes or ())
    if not isinstance(names, tuple) or any(axis not in AXES for axis in names):
        raise ValueError(
            f"logical_axis_rules(overrides={{{name!r}: {axes!r}}}): expected None, a mesh axis or a "
            f"tuple of mesh axes from {AXES}"
        )
