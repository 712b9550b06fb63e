"""mtjax.sharding: device meshes, logical-axis rules and pipeline schedules (no model code).

`MeshConfig` builds the mesh, `logical_axis_rules` maps the modules' logical axis names to its
axes, `init_sharded` / `shard_variables` / `jit_sharded` apply them, and `mtjax.sharding.pipeline`
pipelines a stack of layers over the ``pp`` axis.
"""

from mtjax.sharding.mesh import AXES, BATCH_AXES, DP, EP, FSDP, PP, TP, MeshConfig, use_mesh
from mtjax.sharding.partition import (
    init_sharded,
    jit_sharded,
    logical_shardings,
    named_sharding,
    shard_variables,
    tree_shardings,
)
from mtjax.sharding.pipeline import Circular, GPipe, OneFOneB, Schedule, pipeline_loss
from mtjax.sharding.rules import LogicalRules, logical_axis_rules

__all__ = [
    "AXES", "BATCH_AXES", "DP", "EP", "FSDP", "PP", "TP", "MeshConfig", "use_mesh",
    "LogicalRules", "logical_axis_rules",
    "init_sharded", "jit_sharded", "logical_shardings", "named_sharding", "shard_variables", "tree_shardings",
    "Schedule", "GPipe", "Circular", "OneFOneB", "pipeline_loss",
]
