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
from mtjax.sharding.mesh import AXES, CP, DP, EP, FSDP, PP, TP, MeshConfig

MeshAxes = str | tuple[str, ...] | None
LogicalRules = tuple[tuple[str, MeshAxes], ...]


def logical_axis_rules(config: MeshConfig, overrides: Mapping[str, MeshAxes] | None = None) -> LogicalRules:
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
      config: the mesh the rules are for (``sp`` decides ``activation_length``, ``ep > 1`` adds
        ``ep`` to ``activation_batch``).
      overrides: ``{logical name: mesh axes}`` replacing the default rule of a name (at its place
        in the order) or adding a rule for a new name (at the end); e.g. ``{"embed": None}`` for
        pure data parallelism on the ``fsdp`` axis.
    """
    if not isinstance(config, MeshConfig):
        raise TypeError(f"logical_axis_rules(config=...): expected a MeshConfig, got {type(config).__name__}")
    rules: dict[str, MeshAxes] = {
        axes.ACTIVATION_BATCH: (DP, FSDP, EP) if config.ep > 1 else (DP, FSDP),
        axes.ACTIVATION_HEADS: TP,
        axes.ACTIVATION_KV_HEADS: TP,
        axes.ACTIVATION_MLP: TP,
        axes.ACTIVATION_VOCAB: TP,
        # After the names above: where heads / MLP columns hold tp the sequence stays whole.
        axes.ACTIVATION_LENGTH: _sequence_axes(config),
        axes.ACTIVATION_EMBED: None,
        axes.ACTIVATION_HEAD_DIM: None,
        axes.EMBED: FSDP,
        axes.MLP: TP,
        axes.HEADS: TP,
        axes.KV_HEADS: TP,
        axes.VOCAB: TP,
        axes.EXPERT: EP,
        axes.LAYERS: PP,
        axes.HEAD_DIM: None,
        axes.RELPOS_BUCKETS: None,
    }
    for name, mesh_axes in (overrides or {}).items():
        _check_mesh_axes(name, mesh_axes)
        rules[name] = mesh_axes
    ordered = []
    for name, mesh_axes in rules.items():
        ordered.append((name, mesh_axes))
        if name == axes.ACTIVATION_LENGTH and config.cp > 1 and config.sp and mesh_axes == _sequence_axes(config):
            # Flax takes a rule only if all its mesh axes are free: inside attention and the MLP
            # (tp on heads / columns) the sequence falls back to cp alone.
            ordered.append((name, CP))
    return tuple(ordered)


def _sequence_axes(config: MeshConfig) -> MeshAxes:
    names = ((CP,) if config.cp > 1 else ()) + ((TP,) if config.sp else ())
    return names[0] if len(names) == 1 else (names or None)


def _check_mesh_axes(name: str, axes: MeshAxes) -> None:
    names = (axes,) if isinstance(axes, str) else (axes or ())
    if not isinstance(names, tuple) or any(axis not in AXES for axis in names):
        raise ValueError(
            f"logical_axis_rules(overrides={{{name!r}: {axes!r}}}): expected None, a mesh axis or a "
            f"tuple of mesh axes from {AXES}"
        )
