"""mtjax.sharding: device meshes, logical-axis rules and pipeline schedules (no model code).

`MeshConfig` builds the mesh (``pp``, ``dp``, ``fsdp``, ``ep``, ``cp``, ``tp``), `logical_axis_rules`
maps the modules' logical axis names to its axes (or, through a `MeshResource`, to the axes of a mesh
you built; `extend_logical_axis_rules` adds them to rules of your own), `init_sharded` /
`shard_variables` / `jit_sharded` apply them, and `mtjax.sharding.pipeline` pipelines a stack of
layers over the ``pp`` axis.
"""

from mtjax.axes import MeshResource, current_mesh_resource
from mtjax.sharding.context import (
    context_parallel_size,
    inverse_reorder_causal_load_balancing,
    load_balanced_chunks,
    reorder_causal_load_balancing,
)
from mtjax.sharding.mesh import AXES, BATCH_AXES, CP, DP, EP, FSDP, PP, TP, MeshConfig, use_mesh
from mtjax.sharding.partition import (
    init_sharded,
    jit_sharded,
    logical_shardings,
    named_sharding,
    shard_variables,
    tree_shardings,
)
from mtjax.sharding.pipeline import (
    SIMULATED_SCHEDULES,
    Circular,
    DualPipeV,
    GPipe,
    OneFOneB,
    Schedule,
    Segment,
    Simulation,
    ZeroBubbleH1,
    pipeline_loss,
    simulate,
)
from mtjax.sharding.rules import LogicalRules, extend_logical_axis_rules, logical_axis_rules

__all__ = [
    "AXES", "BATCH_AXES", "CP", "DP", "EP", "FSDP", "PP", "TP", "MeshConfig", "use_mesh",
    "context_parallel_size", "inverse_reorder_causal_load_balancing", "load_balanced_chunks",
    "reorder_causal_load_balancing",
    "LogicalRules", "MeshResource", "current_mesh_resource", "extend_logical_axis_rules", "logical_axis_rules",
    "init_sharded", "jit_sharded", "logical_shardings", "named_sharding", "shard_variables", "tree_shardings",
    "Schedule", "Segment", "GPipe", "Circular", "OneFOneB", "ZeroBubbleH1", "DualPipeV", "pipeline_loss",
    "SIMULATED_SCHEDULES", "Simulation", "simulate",
]
