"""Helpers shared by the row-wise Pallas Triton kernels: interpret flag, block sizes, FP8 cast, dropout bits.

Triton tensors must have power-of-two shapes, so every kernel here works on a ``[block_m, n_pad]``
tile with ``n_pad = next_power_of_2(hidden)`` and masks the columns (and rows) past the array.
Offsets are int32 inside the kernels: launchers reject arrays of ``2**31`` elements or more.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from mtjax.config import config
from mtjax.dtypes import OCP_FP8_DTYPES, fp8_max

try:  # Pallas' Triton backend (deprecated by jax): without it the Pallas kernels here cannot run,
    from jax.experimental.pallas import triton as pallas_triton  # and `mtjax.backend` offers none of them
except ImportError:
    pallas_triton = None

@dataclasses.dataclass(frozen=True)
class Launchers:
    """The launch functions behind a kernel family's differentiable entry points: the Pallas ones of
    this folder (the default everywhere) or their native Triton ports (`mtjax.kernels.triton`), which
    share the entry points' tiles and custom_vjp glue (and their padding, unless a family's launchers
    take it over). Each family documents the signatures.

    Attributes:
      forward: launches the forward kernel.
      backward: launches the backward kernel(s); ``None`` for forward-only families.
    """

    forward: Callable
    backward: Callable | None = None


MAX_ELEMENTS = 2**31 - 1
# exp(x) = 2^(x * LOG2E): the kernels exponentiate in base 2 (one special-function instruction).
LOG2E = math.log2(math.e)
# The widest row a kernel keeps in registers (f32 elements per row tile).
MAX_ROW = 16384
# The FP8 dtypes the kernels write (`mtjax.dtypes`); the fnuz ones go to the references.
KERNEL_FP8_DTYPES = OCP_FP8_DTYPES


def _out_struct(struct: jax.ShapeDtypeStruct, operands) -> jax.ShapeDtypeStruct:
    types = [t for x in operands if x is not None for t in [getattr(jax.typeof(x), "mat", None)] if t is not None]
    if not types:  # outside shard_map
        return struct
    widest = max(types, key=lambda t: len(t.varying))
    if any(not t.varying <= widest.varying for t in types):
        raise ValueError("kernel call inside shard_map: the operands vary over different mesh axes "
                         f"({[sorted(t.varying) for t in types]}); pcast them to the same ones")
    return jax.ShapeDtypeStruct(struct.shape, struct.dtype, manual_axis_type=widest)


def pallas_call(kernel: Callable[..., None], *, out_shape: Any, **kwargs: Any) -> Callable[..., Any]:
    """`pl.pallas_call` for the kernels here: inside ``shard_map`` (with ``check_vma``) its outputs
    vary over the mesh axes its operands vary over, which a custom call cannot infer and must be told."""

    def call(*operands):
        shapes = jax.tree.map(lambda struct: _out_struct(struct, operands), out_shape)
        return pl.pallas_call(kernel, out_shape=shapes, **kwargs)(*operands)

    return call


def varying_axes(x: Any) -> frozenset[str]:
    """The ``shard_map`` axes ``x`` varies over (empty outside ``shard_map``, for ``None``, or where
    jax does not type them)."""
    if x is None:
        return frozenset()
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def vary_together(*arrays):
    """``arrays`` (``None`` passes through) cast to vary over every ``shard_map`` axis any of them
    varies over; a no-op outside ``shard_map``. Before a ``custom_vjp``: its backward then returns a
    varying gradient for each input, and the cast's transpose sums the gradient of a replicated input
    (a norm's gamma) over the mesh, as autodiff would. After a kernel call whose output type drops the
    axes (Mosaic GPU's ``plgpu.kernel``, an FFI call): its output varies as its operands do."""

    union = frozenset().union(*map(varying_axes, arrays))
    return tuple(x if x is None or not union - varying_axes(x)
                 else jax.lax.pcast(x, tuple(sorted(union - varying_axes(x))), to="varying") for x in arrays)


def interpret() -> bool:
    """Whether launchers run Pallas in interpret mode (CPU tests), read at trace time."""
    return bool(config.pallas_interpret)


def with_ptx(run: Callable[..., Any], *args: Any, interpreted: bool | None = None) -> Any:
    """``run(ptx, *args)``, ``ptx`` True where the lowering platform is ``cuda`` (a Triton that takes
    NVIDIA's inline PTX), False on other platforms (rocm, plugins) and in interpret mode
    (``interpreted``; None: `interpret`), decided per lowering platform as kernel selection is
    (`jax.lax.platform_dependent`): an export for cuda from a CPU host gets the PTX."""
    if interpret() if interpreted is None else interpreted:
        return run(False, *args)
    return jax.lax.platform_dependent(*args, cuda=functools.partial(run, True), default=functools.partial(run, False))


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# Arrays of at most this many elements run as fast through XLA's fusions: their time is launch
# overhead, not memory traffic, so a kernel's single pass gains nothing (`mtjax bench norm`, the
# crossover in docs/performance.md). Automatic selection uses XLA there.
SMALL_ELEMENTS = 2**22


def too_small(x, *_, **__) -> str | None:
    """Why automatic selection should leave the op to XLA, judged by the size of its first array ``x``
    (``None``: use the kernel). Takes an op's arguments, so it serves as the kernels' ``prefer``
    predicate in `mtjax.backend.register`."""
    size = int(np.prod(jnp.shape(x)))
    if size <= SMALL_ELEMENTS:
        return f"{size} elements <= {SMALL_ELEMENTS}: XLA is as fast on arrays this small"
    return None


KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def unsupported_array(shape, dtype, max_row: int | None = MAX_ROW) -> str | None:
    """Why a row-wise kernel cannot take an array of ``shape``/``dtype`` (rows of at most ``max_row``), or ``None``."""
    row = shape[-1] if shape else 0
    if max_row is not None and not 0 < row <= max_row:
        return f"last axis {row} outside 1..{max_row}"
    if jnp.dtype(dtype) not in KERNEL_DTYPES:
        return f"dtype {jnp.dtype(dtype)} (float32, bfloat16, float16 only)"
    size = int(np.prod(shape))
    if not 0 < size <= MAX_ELEMENTS:
        return f"{size} elements (1..{MAX_ELEMENTS})"
    return None


def check_size(name: str, x: jax.Array) -> None:
    if x.size > MAX_ELEMENTS:
        raise ValueError(f"{name}: {x.size} elements; the kernel indexes with int32 and takes at most {MAX_ELEMENTS}")


def reduce_tile_maxima(tile_maxima: jax.Array) -> jax.Array:
    """The max of a kernel's per-tile (or per-program) maxima: an FP8 cast's amax, as its own reduction.

    The barrier keeps XLA from fusing this scalar reduce into its consumer (delayed scaling's amax
    history roll, a concatenate), whose loop emitter then walks every tile maximum in one thread: a
    serial loop per cast, repeated for every FP8 GEMM operand of a step.
    """
    return jax.lax.optimization_barrier(jnp.max(tile_maxima))


def unsupported_fp8_dtype(out_dtype) -> str | None:
    """Why a kernel cannot write ``out_dtype`` (it is not one of `KERNEL_FP8_DTYPES`), or ``None``."""
    if jnp.dtype(out_dtype) not in KERNEL_FP8_DTYPES:
        return f"out_dtype {jnp.dtype(out_dtype)} ({', '.join(d.name for d in KERNEL_FP8_DTYPES)} only)"
    return None


def check_kernel_fp8_dtype(op: str, out_dtype) -> None:
    """Raise ``ValueError`` naming ``op`` unless ``out_dtype`` is one of `KERNEL_FP8_DTYPES`."""
    if unsupported_fp8_dtype(out_dtype) is not None:
        raise ValueError(f"{op}: out_dtype={out_dtype}; accepted: {', '.join(d.name for d in KERNEL_FP8_DTYPES)}")


def saturate_cast(x: jax.Array, dtype) -> jax.Array:
    """Clip to the finite range of the FP8 ``dtype`` and cast (no inf/NaN from overflow)."""
    limit = fp8_max(dtype)
    return jnp.clip(x, -limit, limit).astype(dtype)


def _mix(h: jax.Array) -> jax.Array:
    """A 32-bit integer finalizer (xorshift-multiply): every input bit affects every output bit."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * np.uint32(0x846CA68B)
    return h ^ (h >> 16)


def dropout_keep(seed: jax.Array, rows: jax.Array, cols: jax.Array, rate: float) -> jax.Array:
    """Counter-based dropout mask: ``True`` keeps element (row, col), with probability ``1 - rate``.

    A pure function of ``(seed, row, col)`` in uint32 arithmetic, so the Pallas kernels (forward
    and backward) and the jax.numpy reference draw exactly the same mask without storing it.
    ``seed``: uint32 scalar; ``rows``/``cols``: int32 arrays broadcastable to each other.
    """
    h = _mix(rows.astype(jnp.uint32) ^ seed)
    h = _mix(h + cols.astype(jnp.uint32) * np.uint32(0x9E3779B1))
    threshold = np.uint32(min(int(rate * 2.0**32), 2**32 - 1))
    return h >= threshold
