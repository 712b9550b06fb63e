"""LayerNorm / RMSNorm as Pallas Triton kernels: forward, backward, FP8 output, residual + dropout input.

One forward kernel and one backward kernel serve every variant (static flags pick the inputs). Both
are persistent: a fixed number of programs (two per SM) each walk a strided set of row blocks, and
while one block is computed the next one's loads are already in flight (a register prefetch
carried through the loop). Without it a program holds one block at a time and the SM idles between
its loads and its row reductions; with it the forward runs close to a plain copy of the same bytes
(docs/kernels.md).

- forward: each block is ``block_m`` whole rows held in registers (one read of ``x``, one write of
  ``y``), statistics in float32. Optional inputs: ``beta``; a ``residual`` added to ``dropout(x)``
  first (the sum is written out as the new residual stream and is what gets normalized); an FP8
  ``scale``, in which case ``y * scale`` is saturate-cast to FP8 and each program also writes the
  amax of ``|y|`` (before scaling) over its blocks.
- backward: recomputes the statistics from the saved input (so nothing but the inputs is kept for
  the backward pass), writes ``dx`` and accumulates ``dgamma``/``dbeta`` in registers; the
  per-program partial sums are added by XLA afterwards (a few MB at most).

`layer_norm` and `rms_norm` are the differentiable entry points; `norm_fp8` is forward-only (its
output is quantized: the FP8 GEMM that consumes it owns the backward, which is `layer_norm`'s).
The residual variant's custom_vjp lives in ``residual_norm.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mtjax.kernels.common import (
    Launchers,
    check_kernel_fp8_dtype,
    check_size,
    dropout_keep,
    interpret,
    next_power_of_2,
    pallas_call,
    reduce_tile_maxima,
    saturate_cast,
    vary_together,
)
from mtjax.kernels.common import (
    pallas_triton as plgpu,
)

# Programs of both kernels: two per SM of an H100/H200 (132 SMs), so each SM interleaves two
# programs' loads and reductions; few enough that the backward's [programs, hidden] partial
# dgamma/dbeta sums stay small.
PROGRAMS = 264
# A kernel prefetches its next row block only while the prefetched tiles hold at most this many
# elements per program (tensors x block_m x n_pad), beyond which they spill registers and the
# prefetch costs more than it hides: the backward of LayerNorm at hidden 12288 (h and dy, 2 x 16384)
# and residual + dropout + LayerNorm at hidden 8192 (2 x 2 x 8192 forward, 3 x 8192 backward) were
# slower with it, the plain norms at 16384 elements (hidden 8192) fastest (`mtjax bench norm --sweep`).
PREFETCH_MAX_ELEMENTS = 16384


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """Static description of one norm kernel launch.

    Attributes:
      m, n: rows and hidden size of the 2-D input.
      rms: RMSNorm (no mean, no beta) instead of LayerNorm.
      epsilon: added to the variance.
      zero_centered_gamma: the scale applied is ``1 + gamma``.
      has_beta: LayerNorm with a shift.
      residual: the input is ``dropout(x) + residual`` (written out as the new residual).
      dropout_rate: probability of dropping an element of ``x`` (with ``residual`` only).
      block_m, n_pad, num_warps: the tile (``n_pad`` = next power of two of ``n``).
    """

    m: int
    n: int
    rms: bool
    epsilon: float
    zero_centered_gamma: bool
    has_beta: bool
    residual: bool = False
    dropout_rate: float = 0.0
    block_m: int = 1
    n_pad: int = 1
    num_warps: int = 4

    @property
    def num_blocks(self) -> int:
        return pl.cdiv(self.m, self.block_m)

    def prefetch(self, tensors: int) -> bool:
        """Whether a kernel loading ``tensors`` row blocks per step should prefetch the next ones."""
        return tensors * self.block_m * self.n_pad <= PREFETCH_MAX_ELEMENTS

    @property
    def exact(self) -> bool:
        """Tiles cover the array exactly (power-of-two hidden, whole row blocks): no masks needed."""
        return self.n == self.n_pad and self.m % self.block_m == 0


def forward_tile(n: int) -> tuple[int, int]:
    """``(block_m, num_warps)`` of the forward kernel for rows of ``n`` elements.

    From sweeps on Hopper (``mtjax bench norm --sweep``, bf16, persistent with prefetch): 2048 and
    8192 wide, 2 rows x 16 warps was the best of 1-2 rows x 4/8/16 warps. Narrow rows keep 4096
    elements per block on 4 warps; rows of 16384 (hidden 12288) fit one per block. RMSNorm uses the
    same tiles.
    """
    n_pad = next_power_of_2(n)
    if n_pad <= 1024:
        return 4096 // n_pad, 4
    return (1, 16) if n_pad >= 16384 else (2, 16)


def backward_tile(n: int) -> tuple[int, int]:
    """``(block_m, num_warps)`` of the backward kernel (it keeps ~6 row-sized f32 tensors live).

    From sweeps on Hopper (bf16, 264 or 528 programs): 1024 wide, 8 rows x 8 warps was best; 2048
    wide, 2 rows x 4 warps (2 x 8 close behind); 8192 and 12288 wide, one row x 16 warps was the best
    of 8/16/32.
    """
    n_pad = next_power_of_2(n)
    if n_pad <= 1024:
        return 8192 // n_pad, 8
    if n_pad == 2048:
        return 2, 4
    return 1, 16


def _spec(m, n, *, tile, **flags) -> NormSpec:
    block_m, num_warps = tile
    return NormSpec(m=m, n=n, block_m=block_m, n_pad=next_power_of_2(n), num_warps=num_warps, **flags)


def _tile_indices(spec: NormSpec, block):
    """Rows and columns of a row block, and its mask (``None`` when tiles fit exactly: unmasked
    loads and stores vectorize without the bounds arithmetic)."""
    rows = block * spec.block_m + jnp.arange(spec.block_m)
    cols = jnp.arange(spec.n_pad)
    mask = None if spec.exact else (rows < spec.m)[:, None] & (cols < spec.n)[None, :]
    return rows, cols, mask


def _masked(mask, value):
    return value if mask is None else jnp.where(mask, value, 0.0)


def _load(ref, spec: NormSpec, block):
    """A row block of ``ref`` in its own dtype (zeros outside the array)."""
    rows, cols, mask = _tile_indices(spec, block)
    other = None if mask is None else 0
    return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=mask, other=other)


def _store(ref, spec: NormSpec, block, value):
    rows, cols, mask = _tile_indices(spec, block)
    plgpu.store(ref.at[rows[:, None], cols[None, :]], value.astype(ref.dtype), mask=mask)


def _for_row_blocks(spec: NormSpec, programs: int, load, body, carry, *, prefetch: bool):
    """Run ``carry = body(block, load(block), carry)`` over this program's row blocks (``program``,
    ``program + programs``, ...); with ``prefetch``, ``load`` of the next block is issued before
    ``body`` of this one.

    The prefetch past the last block reloads the last block (clamped index) instead of masking, so
    exact tiles keep their unmasked loads.
    """
    program = pl.program_id(0)
    trips = pl.cdiv(spec.num_blocks - program, programs)
    if not prefetch:
        def step(i, carry):
            block = program + i * programs
            return body(block, load(block), carry)

        return jax.lax.fori_loop(0, trips, step, carry)
    last = spec.num_blocks - 1

    def prefetching_step(i, state):
        tiles, carry = state
        block = program + i * programs
        prefetched = load(jnp.minimum(block + programs, last))
        return prefetched, body(block, tiles, carry)

    return jax.lax.fori_loop(0, trips, prefetching_step, (load(program), carry))[1]


def _load_vector(ref, cols, n):
    if cols.shape[0] == n:
        return plgpu.load(ref.at[cols]).astype(jnp.float32)
    return plgpu.load(ref.at[cols], mask=cols < n, other=0.0).astype(jnp.float32)


def _normalize(spec: NormSpec, h, mask):
    """``(x_hat, rstd)`` of the f32 tile ``h`` (zeros outside ``mask``)."""
    if spec.rms:
        centered = h
    else:
        mean = jnp.sum(h, axis=1, keepdims=True) / spec.n
        centered = _masked(mask, h - mean)
    var = jnp.sum(centered * centered, axis=1, keepdims=True) / spec.n
    rstd = jax.lax.rsqrt(var + spec.epsilon)
    return centered * rstd, rstd


def _gamma(spec: NormSpec, gamma_ref, cols):
    gamma = _load_vector(gamma_ref, cols, spec.n)
    return gamma + 1.0 if spec.zero_centered_gamma else gamma


def _forward_kernel(*refs, spec: NormSpec, out_fp8, programs: int):
    refs = list(refs)
    x_ref, gamma_ref = refs.pop(0), refs.pop(0)
    beta_ref = refs.pop(0) if spec.has_beta else None
    residual_ref = refs.pop(0) if spec.residual else None
    seed_ref = refs.pop(0) if spec.dropout_rate > 0.0 else None
    scale_ref = refs.pop(0) if out_fp8 is not None else None
    y_ref = refs.pop(0)
    residual_out_ref = refs.pop(0) if spec.residual else None
    amax_ref = refs.pop(0) if out_fp8 is not None else None

    cols = jnp.arange(spec.n_pad)
    gamma = _gamma(spec, gamma_ref, cols)[None, :]
    beta = None if beta_ref is None else _load_vector(beta_ref, cols, spec.n)[None, :]

    def load(block):
        return _load(x_ref, spec, block), (None if residual_ref is None else _load(residual_ref, spec, block))

    def body(block, tiles, amax):
        rows, _, mask = _tile_indices(spec, block)
        x, residual = tiles
        h = x.astype(jnp.float32)
        if residual is not None:
            if seed_ref is not None:
                keep = dropout_keep(seed_ref[0], rows[:, None], cols[None, :], spec.dropout_rate)
                h = jnp.where(keep, h * (1.0 / (1.0 - spec.dropout_rate)), 0.0)
            # Normalize the residual as stored (rounded to its dtype): the backward pass recomputes
            # the statistics from that stored tensor and must see the same values.
            h = (h + residual.astype(jnp.float32)).astype(residual_out_ref.dtype)
            _store(residual_out_ref, spec, block, h)
            h = h.astype(jnp.float32)
        x_hat, _ = _normalize(spec, h, mask)
        y = x_hat * gamma
        if beta is not None:
            y = y + beta
        if out_fp8 is not None:
            amax = jnp.maximum(amax, jnp.max(_masked(mask, jnp.abs(y))))
            y = saturate_cast(y * scale_ref[0], out_fp8)
        _store(y_ref, spec, block, y)
        return amax

    amax = _for_row_blocks(spec, programs, load, body, jnp.zeros((), jnp.float32),
                           prefetch=spec.prefetch(2 if spec.residual else 1))
    if amax_ref is not None:
        amax_ref[pl.program_id(0)] = amax


def forward(x, gamma, beta, residual=None, seed=None, scale=None, *, rms: bool, epsilon: float,
            zero_centered_gamma: bool, dropout_rate: float = 0.0, out_dtype=None, tile=None, programs=None):
    """Launch the forward kernel on 2-D ``x [m, n]``.

    Returns ``y`` (``out_dtype``, default ``x.dtype``), then the new residual (``residual.dtype``)
    if ``residual`` is given, then the amax of ``|y|`` before scaling if ``scale`` is given.
    ``tile=(block_m, num_warps)`` overrides `forward_tile` and ``programs`` `PROGRAMS` (benchmark sweeps).
    """
    m, n = x.shape
    check_size("norm forward", x)
    out_fp8 = None if scale is None else jnp.dtype(out_dtype)
    spec = _spec(
        m, n, tile=tile or forward_tile(n), rms=rms, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, has_beta=beta is not None, residual=residual is not None,
        dropout_rate=dropout_rate if residual is not None else 0.0,
    )
    programs = min(spec.num_blocks, programs or PROGRAMS)
    inputs = [x, gamma] + [a for a in (beta, residual) if a is not None]
    if spec.dropout_rate > 0.0:
        inputs.append(seed.reshape(1))
    out_shape = [jax.ShapeDtypeStruct((m, n), out_dtype or x.dtype)]
    if residual is not None:
        out_shape.append(jax.ShapeDtypeStruct((m, n), residual.dtype))
    if scale is not None:
        inputs.append(scale.astype(jnp.float32).reshape(1))
        out_shape.append(jax.ShapeDtypeStruct((programs,), jnp.float32))
    outs = list(pallas_call(
        functools.partial(_forward_kernel, spec=spec, out_fp8=out_fp8, programs=programs),
        out_shape=out_shape,
        grid=(programs,),
        compiler_params=plgpu.CompilerParams(num_warps=spec.num_warps, num_stages=1),
        interpret=interpret(),
        name="mtjax_rms_norm_fwd" if rms else "mtjax_layer_norm_fwd",
    )(*inputs))
    if scale is not None:
        outs[-1] = reduce_tile_maxima(outs[-1])
    return tuple(outs)


def _backward_kernel(*refs, spec: NormSpec, programs: int, split_dx: bool):
    refs = list(refs)
    h_ref, gamma_ref, dy_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    dres_ref = refs.pop(0) if spec.residual else None
    seed_ref = refs.pop(0) if spec.dropout_rate > 0.0 else None
    dh_ref = refs.pop(0)
    dx_ref = refs.pop(0) if split_dx else None
    dgamma_ref = refs.pop(0)
    dbeta_ref = refs.pop(0) if spec.has_beta else None

    cols = jnp.arange(spec.n_pad)
    gamma = _gamma(spec, gamma_ref, cols)[None, :]

    def load(block):
        return (_load(h_ref, spec, block), _load(dy_ref, spec, block),
                None if dres_ref is None else _load(dres_ref, spec, block))

    def body(block, tiles, sums):
        dgamma, dbeta = sums
        rows, _, mask = _tile_indices(spec, block)
        h, dy, dres = (None if t is None else t.astype(jnp.float32) for t in tiles)
        x_hat, rstd = _normalize(spec, h, mask)
        g_dy = dy * gamma
        proj = jnp.sum(g_dy * x_hat, axis=1, keepdims=True) / spec.n
        if spec.rms:
            dh = (g_dy - x_hat * proj) * rstd
        else:
            dh = (g_dy - jnp.sum(g_dy, axis=1, keepdims=True) / spec.n - x_hat * proj) * rstd
            dh = _masked(mask, dh)
        if dres is not None:
            dh = dh + dres
        _store(dh_ref, spec, block, dh)
        if dx_ref is not None:
            if seed_ref is not None:
                keep = dropout_keep(seed_ref[0], rows[:, None], cols[None, :], spec.dropout_rate)
                dh = jnp.where(keep, dh * (1.0 / (1.0 - spec.dropout_rate)), 0.0)
            _store(dx_ref, spec, block, dh)
        return dgamma + jnp.sum(dy * x_hat, axis=0), dbeta + jnp.sum(dy, axis=0)

    zeros = jnp.zeros((spec.n_pad,), jnp.float32)
    dgamma, dbeta = _for_row_blocks(spec, programs, load, body, (zeros, zeros),
                                    prefetch=spec.prefetch(3 if spec.residual else 2))
    program = pl.program_id(0)
    col_mask = None if spec.n == spec.n_pad else cols < spec.n
    plgpu.store(dgamma_ref.at[program, cols], dgamma, mask=col_mask)
    if dbeta_ref is not None:
        plgpu.store(dbeta_ref.at[program, cols], dbeta, mask=col_mask)


def backward(h, gamma, dy, dresidual=None, seed=None, *, rms: bool, epsilon: float, zero_centered_gamma: bool,
             has_beta: bool, dropout_rate: float = 0.0, dx_dtype=None, tile=None, programs=None):
    """Launch the backward kernel on the normalized input ``h [m, n]`` and the output cotangent ``dy``.

    With ``dresidual`` (the cotangent of the new residual) the kernel adds it to the gradient of
    ``h``. Returns ``(dh, dx, dgamma, dbeta)``: ``dh`` in ``h.dtype``; ``dx`` = ``dh`` through the
    dropout mask, in ``dx_dtype`` (the same array as ``dh`` when no dropout and equal dtypes);
    ``dgamma``/``dbeta`` (``None`` without beta) in float32.
    """
    m, n = h.shape
    check_size("norm backward", h)
    spec = _spec(
        m, n, tile=tile or backward_tile(n), rms=rms, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, has_beta=has_beta, residual=dresidual is not None,
        dropout_rate=dropout_rate if dresidual is not None else 0.0,
    )
    dx_dtype = jnp.dtype(dx_dtype or h.dtype)
    split_dx = spec.dropout_rate > 0.0 or dx_dtype != h.dtype
    programs = min(spec.num_blocks, programs or PROGRAMS)
    inputs = [h, gamma, dy] + ([dresidual] if dresidual is not None else [])
    if spec.dropout_rate > 0.0:
        inputs.append(seed.reshape(1))
    out_shape = [jax.ShapeDtypeStruct((m, n), h.dtype)]
    if split_dx:
        out_shape.append(jax.ShapeDtypeStruct((m, n), dx_dtype))
    out_shape += [jax.ShapeDtypeStruct((programs, n), jnp.float32)] * (2 if has_beta else 1)
    outs = list(pallas_call(
        functools.partial(_backward_kernel, spec=spec, programs=programs, split_dx=split_dx),
        out_shape=out_shape,
        grid=(programs,),
        compiler_params=plgpu.CompilerParams(num_warps=spec.num_warps, num_stages=1),
        interpret=interpret(),
        name="mtjax_rms_norm_bwd" if rms else "mtjax_layer_norm_bwd",
    )(*inputs))
    dh = outs.pop(0)
    dx = outs.pop(0) if split_dx else dh
    dgamma = jnp.sum(outs.pop(0), axis=0)
    dbeta = jnp.sum(outs.pop(0), axis=0) if has_beta else None
    return dh, dx, dgamma, dbeta


# --------------------------------------------------------------------------------------------------
# Differentiable entry points (arrays of any rank; the last axis is normalized)
# --------------------------------------------------------------------------------------------------


# forward(x, gamma, beta, residual=None, seed=None, scale=None, *, rms, epsilon, zero_centered_gamma,
# dropout_rate=0.0, out_dtype=None) and backward(h, gamma, dy, dresidual=None, seed=None, *, rms, epsilon,
# zero_centered_gamma, has_beta, dropout_rate=0.0, dx_dtype=None), as above.
PALLAS = Launchers(forward=forward, backward=backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _norm(x, gamma, beta, rms, epsilon, zero_centered_gamma, launchers):
    return _norm_fwd(x, gamma, beta, rms, epsilon, zero_centered_gamma, launchers)[0]


def _norm_fwd(x, gamma, beta, rms, epsilon, zero_centered_gamma, launchers):
    (y,) = launchers.forward(x.reshape(-1, x.shape[-1]), gamma, beta, rms=rms, epsilon=epsilon,
                             zero_centered_gamma=zero_centered_gamma)
    return y.reshape(x.shape), (x, gamma, beta)


def _norm_bwd(rms, epsilon, zero_centered_gamma, launchers, saved, dy):
    x, gamma, beta = saved
    n = x.shape[-1]
    dx, _, dgamma, dbeta = launchers.backward(
        x.reshape(-1, n), gamma, dy.reshape(-1, n), rms=rms, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, has_beta=beta is not None,
    )
    dbeta = None if beta is None else dbeta.astype(beta.dtype)
    return dx.reshape(x.shape), dgamma.astype(gamma.dtype), dbeta


_norm.defvjp(_norm_fwd, _norm_bwd)


def layer_norm(x: jax.Array, gamma: jax.Array, beta: jax.Array | None, *, epsilon: float,
               zero_centered_gamma: bool, launchers: Launchers = PALLAS) -> jax.Array:
    """LayerNorm over the last axis of ``x [..., hidden]``; ``gamma``/``beta`` ``[hidden]``; returns x.dtype.
    ``launchers``: the kernels (these Pallas ones, or `mtjax.kernels.triton.layer_norm.NATIVE`)."""
    x, gamma, beta = vary_together(x, gamma, beta)
    return _norm(x, gamma, beta, False, epsilon, zero_centered_gamma, launchers)


def rms_norm(x: jax.Array, gamma: jax.Array, *, epsilon: float, zero_centered_gamma: bool,
             launchers: Launchers = PALLAS) -> jax.Array:
    """RMSNorm over the last axis of ``x [..., hidden]``; ``gamma`` ``[hidden]``; returns x.dtype."""
    x, gamma = vary_together(x, gamma)
    return _norm(x, gamma, None, True, epsilon, zero_centered_gamma, launchers)


def norm_fp8(x: jax.Array, gamma: jax.Array, beta: jax.Array | None, scale: jax.Array, *, rms: bool,
             epsilon: float, zero_centered_gamma: bool, out_dtype,
             launchers: Launchers = PALLAS) -> tuple[jax.Array, jax.Array]:
    """Normalize, multiply by ``scale`` and saturate-cast to ``out_dtype`` (FP8) in one pass.

    Returns ``(y_fp8 [..., hidden], amax)`` with ``amax = max |y|`` of the normalized output
    before scaling (float32 scalar). Forward only.
    """
    check_kernel_fp8_dtype("norm_fp8", out_dtype)
    y, amax = launchers.forward(x.reshape(-1, x.shape[-1]), gamma, beta, scale=scale, rms=rms, epsilon=epsilon,
                                zero_centered_gamma=zero_centered_gamma, out_dtype=out_dtype)
    return y.reshape(x.shape), amax
