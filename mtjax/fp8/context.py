"""`fp8_autocast`: the context in which every `mtjax.fp8.DotGeneral` traced runs in FP8, and
`autocast`, the same with TransformerEngine-JAX's signature and defaults.

It is read when a function is traced: enter it inside the function you `jax.jit` (or around its
first call); a function traced outside it stays a plain-precision function.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence

from mtjax.axes import MeshResource, mesh_resource_scope
from mtjax.fp8.recipes import RECIPE_TYPES, DelayedScaling, Recipe


@dataclasses.dataclass(frozen=True)
class Autocast:
    """What an active `fp8_autocast` set.

    Attributes:
      recipe: the `DelayedScaling`, `CurrentScaling` or `BlockScaling` recipe every FP8 GEMM uses.
      mesh_axes: mesh axis names amaxes are max-reduced over (where bound, e.g. inside shard_map).
    """

    recipe: Recipe
    mesh_axes: tuple[str, ...]


_autocast: contextvars.ContextVar[Autocast | None] = contextvars.ContextVar("mtjax_fp8_autocast", default=None)


def current_autocast() -> Autocast | None:
    """The active `fp8_autocast` settings, or ``None`` outside it (or inside ``enabled=False``)."""
    return _autocast.get()


def _check_mesh_axes(mesh_axes: str | Sequence[str] | None) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    if not all(isinstance(a, str) and a for a in axes):
        raise TypeError(f"fp8_autocast(mesh_axes={mesh_axes!r}): expected None, an axis name or a sequence of them")
    return axes


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, recipe: Recipe | None = None,
                 mesh_axes: str | Sequence[str] | None = None) -> Iterator[None]:
    """Run every `DotGeneral` traced inside in FP8 with ``recipe`` (default `DelayedScaling()`).

    Args:
      enabled: ``False`` turns FP8 off inside (also inside an enclosing ``fp8_autocast``).
      recipe: `DelayedScaling`, `CurrentScaling` or `BlockScaling`.
      mesh_axes: mesh axes (e.g. ``("dp", "fsdp")``) over which amaxes are max-reduced with
        ``lax.pmax`` where those axes are bound (inside ``shard_map``). Under plain ``jit`` with
        sharded arrays ``jnp.max`` already is the global max, so nothing needs naming there.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"fp8_autocast(enabled={enabled!r}): expected True or False")
    recipe = DelayedScaling() if recipe is None else recipe
    if not isinstance(recipe, RECIPE_TYPES):
        raise TypeError(f"fp8_autocast(recipe={recipe!r}): expected a DelayedScaling, CurrentScaling or "
                        "BlockScaling")
    state = Autocast(recipe, _check_mesh_axes(mesh_axes)) if enabled else None
    token = _autocast.set(state)
    try:
        yield
    finally:
        _autocast.reset(token)


@contextlib.contextmanager
def autocast(enabled: bool = False, recipe: Recipe | None = None,
             mesh_resource: MeshResource | None = None) -> Iterator[None]:
    """TransformerEngine-JAX's ``autocast``: FP8 GEMMs with ``recipe`` when ``enabled``, and the mesh's roles.

    The signature and defaults of ``transformer_engine.jax.autocast``: FP8 is **off** unless
    ``enabled=True`` (`fp8_autocast`, mtjax's own context, is on by default), the recipe defaults to
    `DelayedScaling()`, and ``mesh_resource`` (a `mtjax.sharding.MeshResource`, in force inside
    even when FP8 is off) names the mesh axes: `mtjax.sharding.extend_logical_axis_rules` reads it,
    and amaxes are max-reduced over its axes but the pipeline's where they are bound (inside
    ``shard_map``; under ``jit`` a sharded amax is global already).

    Example::

        with autocast(enabled=True, recipe=DelayedScaling(), mesh_resource=MeshResource("dp", "tp")):
            variables = model.init(key, x)
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"autocast(enabled={enabled!r}): expected True or False")
    if mesh_resource is not None and not isinstance(mesh_resource, MeshResource):
        raise TypeError(f"autocast(mesh_resource={mesh_resource!r}): expected a mtjax.sharding.MeshResource or None")
    mesh_axes = None
    if mesh_resource is not None:
        mesh_axes = tuple(a for a in mesh_resource.axis_names if a != mesh_resource.pp_resource)
    with mesh_resource_scope(mesh_resource), fp8_autocast(enabled, recipe, mesh_axes):
        yield
