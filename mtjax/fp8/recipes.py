"""FP8 recipes: which dtypes and which scales the FP8 GEMMs use.

`DelayedScaling` (scales from past steps' amaxes, TransformerEngine's default) and `CurrentScaling`
(each tensor's own amax) are per-tensor recipes; `BlockScaling` gives each 1x128 tile of an
activation or gradient and each 128x128 block of a weight its own scale. A recipe is a frozen
dataclass checked on construction; `RECIPE_TYPES` lists them, so a new recipe is added here and
where `mtjax.fp8.dot_general` dispatches on the recipe type.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import jax.numpy as jnp

AMAX_COMPUTE_ALGOS = ("max", "most_recent")


class Format(enum.Enum):
    """Which FP8 dtypes a recipe uses: forward operands (input, kernel) and output gradients."""

    E4M3 = "E4M3"  # both E4M3 (3 mantissa bits, |x| <= 448)
    E5M2 = "E5M2"  # both E5M2 (2 mantissa bits, |x| <= 57344); E5M2 x E5M2 has no FP8 tensor-core GEMM
    HYBRID = "HYBRID"  # E4M3 forward, E5M2 gradients (which need range more than precision)

    def dtypes(self, fnuz: bool = False) -> tuple[Any, Any]:
        """``(forward dtype, gradient dtype)``; ``fnuz=True`` gives the variants ROCm MI300 computes in."""
        e4m3 = jnp.float8_e4m3fnuz if fnuz else jnp.float8_e4m3fn
        e5m2 = jnp.float8_e5m2fnuz if fnuz else jnp.float8_e5m2
        return {Format.E4M3: (e4m3, e4m3), Format.E5M2: (e5m2, e5m2), Format.HYBRID: (e4m3, e5m2)}[self]


def max_margin(fp8_format: Format) -> int:
    """The largest ``DelayedScaling.margin`` that keeps every scaled tensor of ``fp8_format`` representable.

    A margin of ``m`` maps a tensor's amax to ``fp8_max / 2**m``; beyond the number of binades
    between the format's largest value and its smallest normal one, every value would quantize to
    zero or a subnormal and the GEMM output to (almost) zero. The bound holds for the OCP and the
    fnuz variants of the format's dtypes.
    """
    dtypes = (*fp8_format.dtypes(), *fp8_format.dtypes(fnuz=True))
    return min(int(math.floor(math.log2(float(jnp.finfo(d).max) / float(jnp.finfo(d).tiny)))) for d in dtypes)


def _check_int(owner: str, field: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}({field}={value!r}): expected an int >= {minimum}")
    if value < minimum:
        raise ValueError(f"{owner}({field}={value!r}): expected an int >= {minimum}")


def _check_format(owner: str, value: Any) -> None:
    if not isinstance(value, Format):
        raise TypeError(f"{owner}(fp8_format={value!r}): expected one of {[f'Format.{f.name}' for f in Format]}")


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor scales from the amaxes of past steps (TransformerEngine's delayed scaling).

    Attributes:
      margin: ``scale = (fp8_max / amax) / 2**margin``; each unit halves the scale, leaving headroom.
        At most `max_margin` of the format (14 for E4M3 and HYBRID, 29 for E5M2).
      amax_history_len: how many steps' amaxes each tensor keeps.
      amax_compute_algo: ``"max"`` of the history or its ``"most_recent"`` entry.
      fp8_format: a `Format`; ``HYBRID`` is E4M3 forward and E5M2 gradients.
      reduce_amax: max-reduce each amax over `fp8_autocast`'s ``mesh_axes`` so replicas share a scale.
        (Inside ``shard_map`` amaxes are always reduced over the axes the data varies over and the meta
        does not: replicated meta must stay replicated.)
    """

    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    fp8_format: Format = Format.HYBRID
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        _check_int("DelayedScaling", "margin", self.margin, 0)
        _check_int("DelayedScaling", "amax_history_len", self.amax_history_len, 1)
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"DelayedScaling(amax_compute_algo={self.amax_compute_algo!r}): accepted: {AMAX_COMPUTE_ALGOS}"
            )
        _check_format("DelayedScaling", self.fp8_format)
        limit = max_margin(self.fp8_format)
        if self.margin > limit:
            raise ValueError(f"DelayedScaling(margin={self.margin}): expected an int in [0, {limit}] for "
                             f"fp8_format=Format.{self.fp8_format.name}: a larger margin scales the largest value "
                             "below the format's smallest normal number, so the GEMM outputs would be zeros")
        if not isinstance(self.reduce_amax, bool):
            raise TypeError(f"DelayedScaling(reduce_amax={self.reduce_amax!r}): expected True or False")


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Per-tensor scales from each tensor's own amax in the same step (no state, one extra pass).

    Attributes:
      fp8_format: a `Format`.
    """

    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        _check_format("CurrentScaling", self.fp8_format)


# The side of the square weight blocks and the width of the activation/gradient tiles of `BlockScaling`.
BLOCK_SIZE = 128
# The formats block scaling accepts: every GEMM has an E4M3 operand (E5M2 x E5M2 has no tensor-core GEMM).
BLOCK_FORMATS = (Format.E4M3, Format.HYBRID)


@dataclasses.dataclass(frozen=True)
class BlockScaling:
    """Fine-grained scales from each tensor's own values (DeepSeek-V3's FP8 recipe; no state).

    Activations and output gradients get one scale per ``1 x 128`` tile of a row (128 consecutive
    values along the contracted axis), weights one per ``128 x 128`` block; the GEMMs apply the
    scales per 128-wide block of the contraction in float32 (`mtjax.ops.block_fp8_gemm`). An
    outlier then costs precision only to the 127 values that share its tile, not to the tensor.
    Scales are computed from the current tensor in the step, so the recipe keeps no amax state.

    Attributes:
      fp8_format: ``Format.E4M3`` (everything in E4M3, as DeepSeek-V3) or ``Format.HYBRID`` (E5M2
        output gradients).
      power_of_two_scales: round each scale down to a power of two, so scaling and unscaling are
        exact (a tile then uses between half and all of the FP8 range).
      amax_epsilon: a floor on each tile's amax (``scale = fp8_max / max(amax, amax_epsilon)``), so
        near-zero tiles do not get huge scales; ``0.0`` disables it.
    """

    fp8_format: Format = Format.E4M3
    power_of_two_scales: bool = False
    amax_epsilon: float = 0.0

    block_size = BLOCK_SIZE  # not a field: the GEMM kernels' K blocks are built for it

    def __post_init__(self) -> None:
        _check_format("BlockScaling", self.fp8_format)
        if self.fp8_format not in BLOCK_FORMATS:
            raise ValueError(f"BlockScaling(fp8_format={self.fp8_format!r}): accepted: "
                             f"{[f'Format.{f.name}' for f in BLOCK_FORMATS]}")
        if not isinstance(self.power_of_two_scales, bool):
            raise TypeError(f"BlockScaling(power_of_two_scales={self.power_of_two_scales!r}): expected True or False")
        epsilon = self.amax_epsilon
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)):
            raise TypeError(f"BlockScaling(amax_epsilon={epsilon!r}): expected a finite float >= 0")
        if not (math.isfinite(epsilon) and epsilon >= 0):
            raise ValueError(f"BlockScaling(amax_epsilon={epsilon!r}): expected a finite float >= 0")


Recipe = DelayedScaling | CurrentScaling | BlockScaling

# Every recipe type `fp8_autocast` and `fp8_dot_general` accept.
RECIPE_TYPES = (DelayedScaling, CurrentScaling, BlockScaling)

# The names a command line gives the recipes (`recipe_by_name`).
RECIPE_NAMES = ("delayed", "current", "block")


def recipe_by_name(name: str) -> Recipe:
    """The recipe ``name`` stands for, with its default fields: ``"delayed"`` (`DelayedScaling`),
    ``"current"`` (`CurrentScaling`) or ``"block"`` (`BlockScaling`).

    Raises:
      ValueError: another name (the message lists `RECIPE_NAMES`).
    """
    recipes = {"delayed": DelayedScaling, "current": CurrentScaling, "block": BlockScaling}
    if name not in recipes:
        raise ValueError(f"FP8 recipe {name!r}: accepted: {', '.join(RECIPE_NAMES)}")
    return recipes[name]()
