"""What the Mosaic GPU kernels share: the warpgroup layout of a CTA, interpret mode, and the shared
memory layout wgmma reads."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from mtjax.kernels.common import interpret

WG_ROWS = 64  # rows of one compute warpgroup (wgmma's M)
COMPUTE_WGS = 2  # compute warpgroups per CTA, beside one memory warpgroup
BLOCK_ROWS = WG_ROWS * COMPUTE_WGS  # the rows one CTA owns
# Registers a thread: the compute warpgroups take what the memory warpgroup (TMA copies only) gives up.
COMPUTE_REGISTERS, MEMORY_REGISTERS = 232, 40


def interpret_params() -> plgpu.InterpretGPUParams | None:
    """Mosaic GPU's interpret mode in interpret mode (`mtjax.config` ``pallas_interpret``), else None."""
    return plgpu.InterpretGPUParams() if interpret() else None


def swizzled(cols: int, dtype: Any) -> tuple:
    """The transforms of shared-memory tiles with ``cols`` values a row, as wgmma reads them: (8, n)
    tiles with the widest swizzle (at most 128 bytes) the rows allow."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, cols * itemsize)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)
