"""`fp8_autocast`: the context in which every `mtjax.fp8.DotGeneral` traced runs in FP8.

It is read when a function is traced: enter it inside the function you `jax.jit` (or around its
first call); a function traced outside it stays a plain-precision function.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence

from mtjax.fp8.recipes import RECIPE_TYPES, DelayedScaling, Recipe


@dataclasses.dataclass(frozen=True)
class Autocast:
    """What an active `fp8_autocast` set.

    Attributes:
      recipe: the `DelayedScaling` or `CurrentScaling` recipe every FP8 GEMM uses.
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
      recipe: `DelayedScaling` or `CurrentScaling`.
      mesh_axes: mesh axes (e.g. ``("dp", "fsdp")``) over which amaxes are max-reduced with
        ``lax.pmax`` where those axes are bound (inside ``shard_map``). Under plain ``jit`` with
        sharded arrays ``jnp.max`` already is the global max, so nothing needs naming there.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"fp8_autocast(enabled={enabled!r}): expected True or False")
    recipe = DelayedScaling() if recipe is None else recipe
    if not isinstance(recipe, RECIPE_TYPES):
        raise TypeError(f"fp8_autocast(recipe={recipe!r}): expected a DelayedScaling or CurrentScaling")
    state = Autocast(recipe, _check_mesh_axes(mesh_axes)) if enabled else None
    token = _autocast.set(state)
    try:
        yield
    finally:
        _autocast.reset(token)
