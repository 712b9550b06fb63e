"""Apply logical-axis rules: shardings of variable trees, sharded initialisation, jit under a mesh.

Typical use (see the README's Parallelism section)::

    config = MeshConfig(dp=2, fsdp=2, tp=2, sp=True)
    mesh, rules = config.make_mesh(), logical_axis_rules(config)
    variables = init_sharded(model.init, rng, tokens, mesh=mesh, rules=rules)
    step = jit_sharded(train_step, mesh=mesh, rules=rules,
                       in_shardings=(tree_shardings(variables),
                                     named_sharding(mesh, rules, ("activation_batch", None))),
                       out_shardings=...)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding

from mtjax.sharding.mesh import use_mesh
from mtjax.sharding.rules import LogicalRules


def named_sharding(mesh: Mesh, rules: LogicalRules, logical_axes: Sequence[str | None]) -> NamedSharding:
    """The sharding of an array whose dimensions have the logical names ``logical_axes``."""
    return NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(logical_axes), rules))


def logical_shardings(variables: Any, mesh: Mesh, rules: LogicalRules) -> Any:
    """`NamedSharding` of every leaf of a (possibly abstract) variables tree, from its annotations.

    ``variables`` holds ``nn.LogicallyPartitioned`` boxes where the modules annotated a parameter
    (``nn.with_logical_partitioning``); other leaves (e.g. the FP8 meta) are replicated. The result
    has the structure of the *unboxed* tree (``nn.meta.unbox(variables)``).
    """
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh, rules)


def tree_shardings(tree: Any) -> Any:
    """The shardings of the arrays of ``tree`` (e.g. to pass a sharded tree's layout as ``in_shardings``)."""
    return jax.tree.map(lambda x: x.sharding, tree)


def shard_variables(variables: Any, mesh: Mesh, rules: LogicalRules) -> Any:
    """Unbox ``variables`` and place each array as its logical annotations say."""
    return jax.device_put(nn.meta.unbox(variables), logical_shardings(variables, mesh, rules))


def init_sharded(init_fn: Callable[..., Any], *args: Any, mesh: Mesh, rules: LogicalRules) -> Any:
    """Run ``init_fn(*args)`` (e.g. ``model.init``) so that every variable is created already sharded.

    The initialiser is compiled with the variables' shardings as ``out_shardings``, so no device
    ever holds a whole unsharded weight. Returns the unboxed variables.
    """
    with use_mesh(mesh, rules):
        abstract = jax.eval_shape(init_fn, *args)
        shardings = logical_shardings(abstract, mesh, rules)
        return jax.jit(lambda *a: nn.meta.unbox(init_fn(*a)), out_shardings=shardings)(*args)


class jit_sharded:
    """``jax.jit(fn, **jit_kwargs)`` whose tracing happens under ``mesh`` and the logical ``rules``.

    The modules' ``nn.with_logical_constraint`` calls resolve against the rules and the mesh in
    force at trace time; this wrapper puts them in force on every call and ``lower``, so a step
    function cannot be traced without them by accident. ``in_shardings``/``out_shardings`` (in
    ``jit_kwargs``) take `NamedSharding` trees, e.g. from `logical_shardings`.
    """

    def __init__(self, fn: Callable[..., Any], *, mesh: Mesh, rules: LogicalRules, **jit_kwargs: Any):
        self.mesh, self.rules = mesh, rules
        self._jitted = jax.jit(fn, **jit_kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with use_mesh(self.mesh, self.rules):
            return self._jitted(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        with use_mesh(self.mesh, self.rules):
            return self._jitted.lower(*args, **kwargs)
