"""Grouped GEMM kernels in Pallas with the Triton lowering: ``gmm`` (forward and ``d lhs``) and
``tgmm`` (the weight gradient).

``gmm``: ``out[m] = lhs[m] @ rhs[g(m)]`` for ``lhs [M, K]`` sorted by group, ``rhs [G, K, N]`` (or
``[G, N, K]`` with ``transpose_rhs``). One launch covers every group. A tile scheduler, computed in
jax.numpy from ``group_sizes`` before the launch (`visits`), lists the *visits*: one per (group,
M-tile) pair the group's rows touch, in group order. A tile that holds the end of one group and the
start of the next is visited twice, once per group, and each visit stores only its own group's rows
(a masked store), so tiles stay aligned to ``block_m`` rows and no row is ever padded or copied.
Rows past ``sum(group_sizes)`` form one more pseudo-group whose visits store zeros without a GEMM.
There are at most ``cdiv(M, block_m) + G`` visits; the grid has that many (times the N-tiles) and
programs without a visit return at once, or (``GemmTiles.num_programs``) a fixed number of
persistent programs walks the same tile list. Programs walk the (visit, N-tile) plane in bands of
``group_m`` visits (the Triton matmul tutorial's grouped order), so programs running together
share ``rhs`` tiles of one group and ``lhs`` tiles of a few M-tiles in L2.

``tgmm``: ``out[g] = lhs[rows of g]^T @ dy[rows of g]`` into ``[G, K, N]``. One program per
(N-tile, K-tile, group) loops over its group's rows in steps of ``block_m`` from the group's first
row (masked past its last), so neighbouring groups never mix; an empty group stores zeros.

Both take float32/bfloat16/float16 or FP8 operands, accumulate in float32 (``tl.dot``), pipeline the
K loop (``gmm``) or the row loop (``tgmm``) over ``num_stages`` stages, and mask the K and N tails.
Offsets are int32: arrays of ``2**31`` elements or more are declined (`unsupported`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mtjax.kernels import common
from mtjax.kernels.common import MAX_ELEMENTS
from mtjax.kernels.common import pallas_triton as pltriton

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16,
          jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz)
FP8_DTYPES = DTYPES[3:]
MIN_BLOCK = 16  # the smallest tile tl.dot accepts


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """The tiles and Triton launch parameters of one grouped GEMM kernel.

    Attributes:
      block_m: rows per tile (``gmm``) or rows per step of the row loop (``tgmm``).
      block_n: output columns per tile.
      block_k: the contraction step of ``gmm``'s K loop; output rows per tile of ``tgmm``.
      num_warps: warps per program.
      num_stages: software-pipelining depth of the inner loop (shared memory grows with it).
      group_m: ``gmm`` only: M-tiles per band of the grouped program order (L2 reuse).
      num_programs: ``gmm`` only: ``None`` launches one program per output tile; an int launches
        that many persistent programs (e.g. a multiple of the SM count) that walk the tiles.
    All blocks are powers of two, at least 16; tiles larger than the array shrink to fit; with FP8
    operands the contraction block (``gmm``'s ``block_k``, ``tgmm``'s ``block_m``) is at least 32.
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    num_programs: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < MIN_BLOCK or value & (value - 1):
                raise ValueError(f"GemmTiles({name}={value!r}): expected a power of two >= {MIN_BLOCK}")
        for name in ("num_warps", "num_stages", "group_m"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GemmTiles({name}={value!r}): expected a positive int")
        if self.num_programs is not None and (not isinstance(self.num_programs, int) or self.num_programs < 1):
            raise ValueError(f"GemmTiles(num_programs={self.num_programs!r}): expected None or a positive int")

    def clamp(self, **dims: int) -> GemmTiles:
        """Shrink ``block_<name>`` to the power of two covering ``dims[name]`` where the tile is larger."""
        def fit(block, length):
            return max(MIN_BLOCK, min(block, pl.next_power_of_2(max(length, 1))))

        return dataclasses.replace(self, **{f"block_{d}": fit(getattr(self, f"block_{d}"), n) for d, n in dims.items()})


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the three kernels behind one differentiable grouped GEMM.

    Attributes:
      forward: ``gmm`` computing the output.
      dlhs: ``gmm`` with ``rhs`` transposed computing ``d lhs``.
      wgrad: ``tgmm`` computing ``d rhs``.
    """

    forward: GemmTiles = GemmTiles()
    dlhs: GemmTiles = GemmTiles()
    wgrad: GemmTiles = GemmTiles(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)

    @classmethod
    def default(cls, m: int, k: int, n: int, num_groups: int, dtype: Any = jnp.bfloat16) -> BlockSizes:
        """Starting tiles for ``lhs [m, k]``, ``rhs [num_groups, k, n]`` of ``dtype`` (not yet tuned
        on a GPU; docs/moe-kernels.md says how to sweep them).

        Forward and ``d lhs``: 128 x 256 output tiles on 8 warps with 3 stages (the Triton matmul
        tutorial's best Hopper configuration), 128-column tiles where the output width is a multiple
        of 128 but not of 256 (no half-empty last tile); FP8 doubles ``block_k`` (same bytes per
        stage) and takes 128-column tiles (room in registers for the promoted accumulator). Groups
        of fewer than 128 rows on average (decoding, many small experts) get ``block_m`` of the
        power of two covering the mean group (at least 16), so boundary tiles waste fewer rows.
        The weight gradient: 128 x 128 output tiles, 64 rows per step.
        """
        mean_rows = m // max(num_groups, 1)
        block_m = 128 if mean_rows >= 128 else max(MIN_BLOCK, pl.next_power_of_2(max(mean_rows, 1)))

        fp8 = jnp.dtype(dtype) in [jnp.dtype(d) for d in FP8_DTYPES]

        def tiles(width: int) -> GemmTiles:
            # FP8 keeps a second (promoted) accumulator in registers beside the MMA's: 128-wide tiles.
            block_n = 128 if fp8 or (width % 256 and not width % 128) else 256
            return GemmTiles(block_m=block_m, block_n=block_n, block_k=128 if fp8 else 64)

        return cls(forward=tiles(n), dlhs=tiles(k))


def _cdiv(a, b: int):
    return lax.div(a + b - 1, b)


def unsupported(lhs_shape, rhs_shape, lhs_dtype, rhs_dtype) -> str | None:
    """Why the kernels cannot take ``lhs [M, K]`` and ``rhs [G, *, *]``, or ``None`` if they can."""
    for name, dtype in (("lhs", lhs_dtype), ("rhs", rhs_dtype)):
        if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
            return f"{name} dtype {jnp.dtype(dtype)} (supported: {', '.join(jnp.dtype(d).name for d in DTYPES)})"
    fp8 = [jnp.dtype(d) for d in FP8_DTYPES]
    both_fp8 = jnp.dtype(lhs_dtype) in fp8 and jnp.dtype(rhs_dtype) in fp8
    if jnp.dtype(lhs_dtype) != jnp.dtype(rhs_dtype) and not both_fp8:
        return f"mixed dtypes {jnp.dtype(lhs_dtype)} and {jnp.dtype(rhs_dtype)}"
    if min(lhs_shape) == 0 or min(rhs_shape) == 0:
        return "an empty array"
    if max(math.prod(lhs_shape), math.prod(rhs_shape), lhs_shape[0] * max(rhs_shape[1:])) > MAX_ELEMENTS:
        return f"arrays of more than {MAX_ELEMENTS} elements (the kernels index with int32)"
    return None


def _check(fn: str, lhs, rhs) -> None:
    reason = unsupported(lhs.shape, rhs.shape, lhs.dtype, rhs.dtype)
    if reason is not None:
        raise ValueError(f"{fn}: unsupported {reason}")


FP8_MIN_CONTRACTION = 32  # an FP8 tensor-core MMA contracts 32 elements at a time


def _fp8_contraction(tiles: GemmTiles, field: str, *dtypes) -> GemmTiles:
    """``tiles`` with the contraction block ``field`` at least `FP8_MIN_CONTRACTION` for FP8 operands."""
    fp8 = [jnp.dtype(d) for d in FP8_DTYPES]
    if all(jnp.dtype(d) in fp8 for d in dtypes) and getattr(tiles, field) < FP8_MIN_CONTRACTION:
        return dataclasses.replace(tiles, **{field: FP8_MIN_CONTRACTION})
    return tiles


def _check_group_scale(fn: str, group_scale, num_groups: int) -> None:
    if group_scale is not None and group_scale.shape != (num_groups,):
        raise ValueError(f"{fn}: group_scale has shape {group_scale.shape}; expected ({num_groups},)")


def _accumulate(a, b, acc, *, contract_lhs: int, contract_rhs: int, scale=None):
    """``acc + dot(a, b) [* scale]``, the product in float32.

    With a ``scale`` (FP8 operands) each K step's product is scaled and added to ``acc`` outside the
    tensor core ("promotion", as DeepGEMM does): Hopper's FP8 MMA accumulates with fewer mantissa bits
    than float32, so over a long K its own accumulator loses precision (docs/moe-kernels.md). The
    multiplication also keeps Triton from folding the addition back into the MMA's accumulator.
    """
    if a.dtype != b.dtype:
        # Two FP8 formats (E5M2 gradients against E4M3 weights): Pallas's Triton dot takes one
        # element type, so both operands go to bfloat16, which holds every E4M3 and E5M2 value exactly.
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    dims = (((contract_lhs,), (contract_rhs,)), ((), ()))
    product = lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    return acc + (product if scale is None else product * scale)


def _masked_load(ref, mask):
    if mask is None:
        return ref[...]
    return pltriton.load(ref, mask=mask, other=0.0)


def _conj(*masks):
    present = [m for m in masks if m is not None]
    if not present:
        return None
    out = present[0]
    for m in present[1:]:
        out = out & m
    return out


# --------------------------------------------------------------------------------------------------
# The tile scheduler
# --------------------------------------------------------------------------------------------------


def num_visits(m: int, num_groups: int, block_m: int) -> int:
    """The static bound on `visits`: every M-tile once, plus one per boundary inside a tile."""
    return -(-m // block_m) + num_groups


def visits(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The (group, M-tile) visits of ``gmm``, as four int32 ``[num_visits]`` arrays.

    ``(group, tile, row_lo, row_hi)``: visit ``v`` computes rows ``row_lo .. row_hi`` (inside tile
    ``tile``, i.e. rows ``tile * block_m ..``) with ``rhs[group]``; ``group == G`` marks rows past the
    groups (zeros), ``row_lo == row_hi`` a visit with nothing to do (the unused tail of the list).
    """
    g = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])  # G + 1 segments: the groups and the rest
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    first_tile = starts // block_m
    tiles = jnp.where(ends > starts, _cdiv(ends, block_m) - first_tile, 0)
    total = num_visits(m, g, block_m)
    group = jnp.repeat(jnp.arange(g + 1, dtype=jnp.int32), tiles, total_repeat_length=total)
    first_visit = jnp.cumsum(tiles) - tiles
    v = jnp.arange(total, dtype=jnp.int32)
    active = v < jnp.sum(tiles)
    tile = jnp.where(active, first_tile[group] + v - first_visit[group], 0)
    row_lo = jnp.where(active, jnp.maximum(starts[group], tile * block_m), 0)
    row_hi = jnp.where(active, jnp.minimum(ends[group], tile * block_m + block_m), 0)
    return group, tile, row_lo, row_hi


# --------------------------------------------------------------------------------------------------
# gmm
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _GmmStatic:
    m: int
    k: int
    n: int
    num_groups: int
    num_visits: int
    transpose_rhs: bool
    scaled: bool
    tiles: GemmTiles


def _gmm_kernel(group_ref, tile_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, *refs, st: _GmmStatic):
    scale_ref, out_ref = refs if st.scaled else (None, refs[0])
    tile_refs = (group_ref, tile_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, scale_ref, out_ref)
    programs = st.tiles.num_programs
    if programs is None:
        _gmm_tile(pl.program_id(0), *tile_refs, st=st)
        return
    # Persistent: program p computes tiles p, p + programs, ... of the grouped order (the grid
    # coordinate is read outside the loop: interpret mode cannot read it inside).
    first = pl.program_id(0)
    total = st.num_visits * pl.cdiv(st.n, st.tiles.block_n)

    def step(i, carry):
        _gmm_tile(first + i * programs, *tile_refs, st=st)
        return carry

    lax.fori_loop(0, _cdiv(total - first, programs), step, jnp.int32(0))


def _gmm_tile(pid, group_ref, tile_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, scale_ref, out_ref, *, st: _GmmStatic):
    """Output tile ``pid`` of the grouped order: one visit's rows, ``block_n`` columns."""
    t = st.tiles
    bm, bn, bk = t.block_m, t.block_n, t.block_k
    n_tiles = pl.cdiv(st.n, bn)
    # The grouped order: bands of group_m visits, N-tiles walked down each band.
    band = t.group_m * n_tiles
    first = (pid // band) * t.group_m
    rows_in_band = jnp.minimum(st.num_visits - first, jnp.int32(t.group_m))
    visit = first + (pid % band) % rows_in_band
    n0 = ((pid % band) // rows_in_band) * bn
    group, lo, hi = group_ref[visit], lo_ref[visit], hi_ref[visit]
    row0 = tile_ref[visit] * bm
    rows = row0 + jnp.arange(bm)
    cols = n0 + jnp.arange(bn)

    row_mask = (rows < st.m)[:, None] if st.m % bm else None
    k_cols = jnp.arange(bk)
    col_mask = (cols < st.n)[None, :] if st.n % bn else None

    @pl.when(lo < hi)
    def _():
        # The pseudo-group past the last group has zero rows whatever scale they get.
        scale = None if scale_ref is None else scale_ref[jnp.minimum(group, jnp.int32(st.num_groups - 1))]

        def body(kk, acc):
            k0 = pl.multiple_of(kk * bk, bk)
            k_mask = (k0 + k_cols < st.k) if st.k % bk else None
            lhs_mask = _conj(row_mask, None if k_mask is None else k_mask[None, :])
            a = _masked_load(lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)],
                             None if lhs_mask is None else jnp.broadcast_to(lhs_mask, (bm, bk)))
            if st.transpose_rhs:
                rhs_mask = _conj(None if col_mask is None else col_mask.T,
                                 None if k_mask is None else k_mask[None, :])
                b = _masked_load(rhs_ref.at[group, pl.ds(n0, bn), pl.ds(k0, bk)],
                                 None if rhs_mask is None else jnp.broadcast_to(rhs_mask, (bn, bk)))
                return _accumulate(a, b, acc, contract_lhs=1, contract_rhs=1, scale=scale)
            rhs_mask = _conj(None if k_mask is None else k_mask[:, None], col_mask)
            b = _masked_load(rhs_ref.at[group, pl.ds(k0, bk), pl.ds(n0, bn)],
                             None if rhs_mask is None else jnp.broadcast_to(rhs_mask, (bk, bn)))
            return _accumulate(a, b, acc, contract_lhs=1, contract_rhs=0, scale=scale)

        # The pseudo-group past the last group runs no iteration: its rows are zeros.
        steps = jnp.where(group < st.num_groups, jnp.int32(pl.cdiv(st.k, bk)), jnp.int32(0))
        acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
        store_mask = _conj((rows >= lo)[:, None] & (rows < hi)[:, None], col_mask)
        pltriton.store(out_ref.at[pl.ds(row0, bm), pl.ds(n0, bn)], acc.astype(out_ref.dtype),
                       mask=jnp.broadcast_to(store_mask, (bm, bn)))


def prepare_gmm(lhs, rhs, group_sizes, group_scale, transpose_rhs: bool, out_dtype, tiles: GemmTiles | None):
    """Check `gmm`'s arguments; ``(m, k, n, num_groups, tiles, out_dtype)`` with the tiles clamped to
    the shapes (and FP8's contraction block)."""
    _check("gmm", lhs, rhs)
    m, k = lhs.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if (rhs.shape[2] if transpose_rhs else rhs.shape[1]) != k:
        raise ValueError(f"gmm: lhs {lhs.shape} and rhs {rhs.shape} (transpose_rhs={transpose_rhs}) disagree on K")
    if group_sizes.shape != (g,):
        raise ValueError(f"gmm: group_sizes has shape {group_sizes.shape}; expected ({g},)")
    _check_group_scale("gmm", group_scale, g)
    tiles = _fp8_contraction((tiles or GemmTiles()).clamp(m=m, n=n, k=k), "block_k", lhs.dtype, rhs.dtype)
    return m, k, n, g, tiles, jnp.dtype(out_dtype or lhs.dtype)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, group_scale: jax.Array | None = None, *,
        transpose_rhs: bool = False, out_dtype: Any = None, tiles: GemmTiles | None = None,
        interpret: bool = False) -> jax.Array:
    """``out[m] = lhs[m] @ rhs[g(m)]`` (module docstring); not differentiable (see `mtjax.ops.grouped_gemm`).

    Args:
      lhs: ``[M, K]``, rows sorted by group; rhs: ``[G, K, N]`` (``[G, N, K]`` with ``transpose_rhs``).
      group_sizes: ``[G]`` int, non-negative, ``sum <= M`` (clipped at ``M``).
      group_scale: optional float32 ``[G]``: group ``g``'s float32 accumulator is multiplied by
        ``group_scale[g]`` before the cast to ``out_dtype`` (FP8 dequantization in the epilogue).
      out_dtype: default ``lhs.dtype``; accumulation is float32.
      tiles: default `GemmTiles()`, clamped to the shapes.
      interpret: run in Pallas interpret mode (CPU tests).
    Returns:
      ``[M, N]``, zeros past ``sum(group_sizes)``.
    """
    m, k, n, g, tiles, out_dtype = prepare_gmm(lhs, rhs, group_sizes, group_scale, transpose_rhs, out_dtype, tiles)
    st = _GmmStatic(m=m, k=k, n=n, num_groups=g, num_visits=num_visits(m, g, tiles.block_m),
                    transpose_rhs=transpose_rhs, scaled=group_scale is not None, tiles=tiles)
    schedule = visits(group_sizes, m, tiles.block_m)
    scale = () if group_scale is None else (group_scale.astype(jnp.float32),)
    num_tiles = st.num_visits * pl.cdiv(n, tiles.block_n)
    return common.pallas_call(
        functools.partial(_gmm_kernel, st=st),
        grid=(num_tiles if tiles.num_programs is None else min(tiles.num_programs, num_tiles),),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="mtjax_grouped_gemm",
    )(*schedule, lhs, rhs, *scale)


# --------------------------------------------------------------------------------------------------
# tgmm
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _TgmmStatic:
    m: int
    k: int
    n: int
    scaled: bool
    tiles: GemmTiles


def _tgmm_kernel(offsets_ref, lhs_ref, dy_ref, *refs, st: _TgmmStatic):
    scale_ref, out_ref = refs if st.scaled else (None, refs[0])
    t = st.tiles
    bm, bn, bk = t.block_m, t.block_n, t.block_k
    n0 = pl.program_id(0) * bn
    k0 = pl.program_id(1) * bk
    g = pl.program_id(2)
    start, end = offsets_ref[g], offsets_ref[g + 1]
    k_mask = (k0 + jnp.arange(bk) < st.k)[None, :] if st.k % bk else None
    n_mask = (n0 + jnp.arange(bn) < st.n)[None, :] if st.n % bn else None
    row_ids = jnp.arange(bm)
    scale = None if scale_ref is None else scale_ref[g]

    def body(i, acc):
        m0 = start + i * bm
        rows = (m0 + row_ids < end)[:, None]
        a = pltriton.load(lhs_ref.at[pl.ds(m0, bm), pl.ds(k0, bk)],
                          mask=jnp.broadcast_to(_conj(rows, k_mask), (bm, bk)), other=0.0)
        b = pltriton.load(dy_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)],
                          mask=jnp.broadcast_to(_conj(rows, n_mask), (bm, bn)), other=0.0)
        return _accumulate(a, b, acc, contract_lhs=0, contract_rhs=0, scale=scale)

    acc = lax.fori_loop(0, _cdiv(end - start, bm), body, jnp.zeros((bk, bn), jnp.float32))
    out_mask = _conj(None if k_mask is None else k_mask.T, n_mask)
    out = out_ref.at[g, pl.ds(k0, bk), pl.ds(n0, bn)]
    if out_mask is None:
        out[...] = acc.astype(out_ref.dtype)
    else:
        pltriton.store(out, acc.astype(out_ref.dtype), mask=jnp.broadcast_to(out_mask, (bk, bn)))


def prepare_tgmm(lhs, dy, group_sizes, group_scale, out_dtype, tiles: GemmTiles | None):
    """Check `tgmm`'s arguments; ``(m, k, n, num_groups, tiles, out_dtype, offsets)`` with the tiles
    clamped and ``offsets [G + 1]`` the groups' first rows (and the end)."""
    # The arrays the kernel indexes: lhs [M, K], dy [M, N] and the output [G, K, N].
    _check("tgmm", lhs, jax.ShapeDtypeStruct((group_sizes.shape[0], lhs.shape[-1], dy.shape[-1]), dy.dtype))
    m, k = lhs.shape
    if dy.ndim != 2 or dy.shape[0] != m:
        raise ValueError(f"tgmm: lhs {lhs.shape} and dy {dy.shape} must share M")
    n = dy.shape[1]
    g = group_sizes.shape[0]
    _check_group_scale("tgmm", group_scale, g)
    tiles = _fp8_contraction((tiles or BlockSizes().wgrad).clamp(m=m, n=n, k=k), "block_m", lhs.dtype, dy.dtype)
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    return m, k, n, g, tiles, jnp.dtype(out_dtype or lhs.dtype), offsets


def tgmm(lhs: jax.Array, dy: jax.Array, group_sizes: jax.Array, group_scale: jax.Array | None = None, *,
         out_dtype: Any = None, tiles: GemmTiles | None = None, interpret: bool = False) -> jax.Array:
    """``out[g] = lhs[rows of g]^T @ dy[rows of g]`` into ``[G, K, N]`` (module docstring).

    Args:
      lhs: ``[M, K]``; dy: ``[M, N]``, rows sorted by group as for `gmm`.
      group_sizes: ``[G]`` int, non-negative, ``sum <= M`` (clipped at ``M``).
      group_scale: optional float32 ``[G]`` multiplying group ``g``'s accumulator (as in `gmm`).
      out_dtype: default ``lhs.dtype``; accumulation is float32.
      tiles: default ``BlockSizes().wgrad``, clamped to the shapes.
      interpret: run in Pallas interpret mode.
    """
    m, k, n, g, tiles, out_dtype, offsets = prepare_tgmm(lhs, dy, group_sizes, group_scale, out_dtype, tiles)
    st = _TgmmStatic(m=m, k=k, n=n, scaled=group_scale is not None, tiles=tiles)
    scale = () if group_scale is None else (group_scale.astype(jnp.float32),)
    return common.pallas_call(
        functools.partial(_tgmm_kernel, st=st),
        grid=(pl.cdiv(n, tiles.block_n), pl.cdiv(k, tiles.block_k), g),
        out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="mtjax_grouped_gemm_wgrad",
    )(offsets, lhs, dy, *scale)
