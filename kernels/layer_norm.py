"""LayerNorm / RMSNorm as Pallas Triton kernels: forward, backward, FP8 output, residual + dropout input.

One forward kernel and one backward kernel serve every variant (static flags pick the inputs):

- forward: each program normalizes ``block_m`` whole rows held in registers (one read of ``x``, one
  write of ``y``), statistics in float32. Optional inputs: ``beta``; a ``residual`` added to
  ``dropout(x)`` first (the sum is written out as the new residual stream and is what gets
  normalized); an FP8 ``scale``, in which case ``y * scale`` is saturate-cast to FP8 and the
  kernel also writes the per-program amax of ``|y|`` (before scaling).
- backward: a fixed number of programs each walk a strided set of row blocks, recompute the
  statistics from the saved input (so nothing but the inputs is kept for the backward pass), write
  ``dx`` and accumulate ``dgamma``/``dbeta`` in registers; the per-program partial sums are added
  by XLA afterwards (a few MB at most).

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
from jax.experimental.pallas import triton as plgpu

from mtjax.kernels._common import (
    FP8_DTYPES, check_size, dropout_keep, interpret, next_power_of_2, saturate_cast,
)

# Programs of the backward kernel: enough to fill an H100/H200 (132 SMs) a few times over, few
# enough that the [programs, hidden] partial dgamma/dbeta sums stay small.
BACKWARD_PROGRAMS = 264


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

    @property
    def exact(self) -> bool:
        """Tiles cover the array exactly (power-of-two hidden, whole row blocks): no masks needed."""
        return self.n == self.n_pad and self.m % self.block_m == 0


def forward_tile(n: int, rms: bool) -> tuple[int, int]:
    """``(block_m, num_warps)`` of the forward kernel for rows of ``n`` elements.

    From H200 sweeps (``python -m mtjax.bench.norm --sweep``, 16384 rows, bf16). LayerNorm's two
    dependent row reductions (mean, then variance) want several rows per program so their latencies
    overlap: 1024 wide, 4 rows x 4 warps ran 0.037 ms against 0.046 ms for 8 x 16; 8192 wide,
    2 rows x 8 warps 0.247 ms against 0.326 ms for 1 x 16. Rows of 16384 (hidden 12288) fit one per
    program (16 warps best of 4/8/16). RMSNorm's single reduction ran best with the older rule
    (``8192 // n_pad`` rows, ~16 values per thread): 0.179 ms at 8192, ahead of XLA's 0.188 ms.
    Hidden sizes 2048 and 4096 keep that older rule for both (the benchmark table's measurement).
    """
    n_pad = next_power_of_2(n)
    if rms or n_pad in (2048, 4096):
        block_m = max(1, 8192 // n_pad)
        return block_m, min(16, max(4, block_m * n_pad // 512))
    if n_pad <= 1024:
        return 4096 // n_pad, 4
    return (2, 8) if n_pad == 8192 else (1, 16)


def backward_tile(n: int) -> tuple[int, int]:
    """``(block_m, num_warps)`` of the backward kernel (it keeps ~6 row-sized f32 tensors live).

    H200 sweep (16384 rows, bf16, 264 or 528 programs): 1024 wide, 8 rows x 8 warps ran 0.104 ms
    against 0.158 ms for 4 x 16; 8192 and 12288 wide, one row x 16 warps was best of 8/16/32.
    """
    n_pad = next_power_of_2(n)
    if n_pad <= 1024:
        return 8192 // n_pad, 8
    block_m = max(1, 4096 // n_pad)
    return block_m, min(16, max(4, block_m * n_pad // 256))


def _spec(m, n, *, tile, **flags) -> NormSpec:
    block_m, num_warps = tile
    return NormSpec(m=m, n=n, block_m=block_m, n_pad=next_power_of_2(n), num_warps=num_warps, **flags)


def _tile_indices(spec: NormSpec, block):
    """Rows and columns of a program's tile, and its mask (``None`` when tiles fit exactly: unmasked
    loads and stores vectorize without the bounds arithmetic)."""
    rows = block * spec.block_m + jnp.arange(spec.block_m)
    cols = jnp.arange(spec.n_pad)
    mask = None if spec.exact else (rows < spec.m)[:, None] & (cols < spec.n)[None, :]
    return rows, cols, mask


def _masked(mask, value):
    return value if mask is None else jnp.where(mask, value, 0.0)


def _load(ref, rows, cols, mask):
    other = None if mask is None else 0.0
    return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=mask, other=other).astype(jnp.float32)


def _store(ref, rows, cols, mask, value):
    plgpu.store(ref.at[rows[:, None], cols[None, :]], value.astype(ref.dtype), mask=mask)


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


def _forward_kernel(*refs, spec: NormSpec, out_fp8):
    refs = list(refs)
    x_ref, gamma_ref = refs.pop(0), refs.pop(0)
    beta_ref = refs.pop(0) if spec.has_beta else None
    residual_ref = refs.pop(0) if spec.residual else None
    seed_ref = refs.pop(0) if spec.dropout_rate > 0.0 else None
    scale_ref = refs.pop(0) if out_fp8 is not None else None
    y_ref = refs.pop(0)
    residual_out_ref = refs.pop(0) if spec.residual else None
    amax_ref = refs.pop(0) if out_fp8 is not None else None

    block = pl.program_id(0)
    rows, cols, mask = _tile_indices(spec, block)
    h = _load(x_ref, rows, cols, mask)
    if spec.residual:
        if seed_ref is not None:
            keep = dropout_keep(seed_ref[0], rows[:, None], cols[None, :], spec.dropout_rate)
            h = jnp.where(keep, h * (1.0 / (1.0 - spec.dropout_rate)), 0.0)
        # Normalize the residual as stored (rounded to its dtype): the backward pass recomputes
        # the statistics from that stored tensor and must see the same values.
        h = (h + _load(residual_ref, rows, cols, mask)).astype(residual_out_ref.dtype)
        _store(residual_out_ref, rows, cols, mask, h)
        h = h.astype(jnp.float32)
    x_hat, _ = _normalize(spec, h, mask)
    y = x_hat * _gamma(spec, gamma_ref, cols)[None, :]
    if beta_ref is not None:
        y = y + _load_vector(beta_ref, cols, spec.n)[None, :]
    if out_fp8 is not None:
        amax_ref[block] = jnp.max(_masked(mask, jnp.abs(y)))
        y = saturate_cast(y * scale_ref[0], out_fp8)
    _store(y_ref, rows, cols, mask, y)


def forward(x, gamma, beta, residual=None, seed=None, scale=None, *, rms: bool, epsilon: float,
            zero_centered_gamma: bool, dropout_rate: float = 0.0, out_dtype=None, tile=None):
    """Launch the forward kernel on 2-D ``x [m, n]``.

    Returns ``y`` (``out_dtype``, default ``x.dtype``), then the new residual (``residual.dtype``)
    if ``residual`` is given, then the amax of ``|y|`` before scaling if ``scale`` is given.
    ``tile=(block_m, num_warps)`` overrides `forward_tile` (benchmark sweeps).
    """
    m, n = x.shape
    check_size("norm forward", x)
    out_fp8 = None if scale is None else jnp.dtype(out_dtype)
    spec = _spec(
        m, n, tile=tile or forward_tile(n, rms), rms=rms, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, has_beta=beta is not None, residual=residual is not None,
        dropout_rate=dropout_rate if residual is not None else 0.0,
    )
    inputs = [x, gamma] + [a for a in (beta, residual) if a is not None]
    if spec.dropout_rate > 0.0:
        inputs.append(seed.reshape(1))
    out_shape = [jax.ShapeDtypeStruct((m, n), out_dtype or x.dtype)]
    if residual is not None:
        out_shape.append(jax.ShapeDtypeStruct((m, n), residual.dtype))
    if scale is not None:
        inputs.append(scale.astype(jnp.float32).reshape(1))
        out_shape.append(jax.ShapeDtypeStruct((spec.num_blocks,), jnp.float32))
    outs = list(pl.pallas_call(
        functools.partial(_forward_kernel, spec=spec, out_fp8=out_fp8),
        out_shape=out_shape,
        grid=(spec.num_blocks,),
        compiler_params=plgpu.CompilerParams(num_warps=spec.num_warps, num_stages=1),
        interpret=interpret(),
        name="mtjax_rms_norm_fwd" if rms else "mtjax_layer_norm_fwd",
    )(*inputs))
    if scale is not None:
        outs[-1] = jnp.max(outs[-1])
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

    program = pl.program_id(0)
    cols = jnp.arange(spec.n_pad)
    gamma = _gamma(spec, gamma_ref, cols)[None, :]

    def body(i, sums):
        dgamma, dbeta = sums
        rows, _, mask = _tile_indices(spec, program + i * programs)
        h = _load(h_ref, rows, cols, mask)
        dy = _load(dy_ref, rows, cols, mask)
        x_hat, rstd = _normalize(spec, h, mask)
        g_dy = dy * gamma
        proj = jnp.sum(g_dy * x_hat, axis=1, keepdims=True) / spec.n
        if spec.rms:
            dh = (g_dy - x_hat * proj) * rstd
        else:
            dh = (g_dy - jnp.sum(g_dy, axis=1, keepdims=True) / spec.n - x_hat * proj) * rstd
            dh = _masked(mask, dh)
        if dres_ref is not None:
            dh = dh + _load(dres_ref, rows, cols, mask)
        _store(dh_ref, rows, cols, mask, dh)
        if dx_ref is not None:
            if seed_ref is not None:
                keep = dropout_keep(seed_ref[0], rows[:, None], cols[None, :], spec.dropout_rate)
                dh = jnp.where(keep, dh * (1.0 / (1.0 - spec.dropout_rate)), 0.0)
            _store(dx_ref, rows, cols, mask, dh)
        return dgamma + jnp.sum(dy * x_hat, axis=0), dbeta + jnp.sum(dy, axis=0)

    trips = pl.cdiv(spec.num_blocks - program, programs)
    zeros = jnp.zeros((spec.n_pad,), jnp.float32)
    dgamma, dbeta = jax.lax.fori_loop(0, trips, body, (zeros, zeros))
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
    programs = min(spec.num_blocks, programs or BACKWARD_PROGRAMS)
    inputs = [h, gamma, dy] + ([dresidual] if dresidual is not None else [])
    if spec.dropout_rate > 0.0:
        inputs.append(seed.reshape(1))
    out_shape = [jax.ShapeDtypeStruct((m, n), h.dtype)]
    if split_dx:
        out_shape.append(jax.ShapeDtypeStruct((m, n), dx_dtype))
    out_shape += [jax.ShapeDtypeStruct((programs, n), jnp.float32)] * (2 if has_beta else 1)
    outs = list(pl.pallas_call(
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm(x, gamma, beta, rms, epsilon, zero_centered_gamma):
    return _norm_fwd(x, gamma, beta, rms, epsilon, zero_centered_gamma)[0]


def _norm_fwd(x, gamma, beta, rms, epsilon, zero_centered_gamma):
    (y,) = forward(x.reshape(-1, x.shape[-1]), gamma, beta, rms=rms, epsilon=epsilon,
                   zero_centered_gamma=zero_centered_gamma)
    return y.reshape(x.shape), (x, gamma, beta)


def _norm_bwd(rms, epsilon, zero_centered_gamma, saved, dy):
    x, gamma, beta = saved
    n = x.shape[-1]
    dx, _, dgamma, dbeta = backward(
        x.reshape(-1, n), gamma, dy.reshape(-1, n), rms=rms, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, has_beta=beta is not None,
    )
    dbeta = None if beta is None else dbeta.astype(beta.dtype)
    return dx.reshape(x.shape), dgamma.astype(gamma.dtype), dbeta


_norm.defvjp(_norm_fwd, _norm_bwd)


def layer_norm(x: jax.Array, gamma: jax.Array, beta: jax.Array | None, *, epsilon: float,
               zero_centered_gamma: bool) -> jax.Array:
    """LayerNorm over the last axis of ``x [..., hidden]``; ``gamma``/``beta`` ``[hidden]``; returns x.dtype."""
    return _norm(x, gamma, beta, False, epsilon, zero_centered_gamma)


def rms_norm(x: jax.Array, gamma: jax.Array, *, epsilon: float, zero_centered_gamma: bool) -> jax.Array:
    """RMSNorm over the last axis of ``x [..., hidden]``; ``gamma`` ``[hidden]``; returns x.dtype."""
    return _norm(x, gamma, None, True, epsilon, zero_centered_gamma)


def norm_fp8(x: jax.Array, gamma: jax.Array, beta: jax.Array | None, scale: jax.Array, *, rms: bool,
             epsilon: float, zero_centered_gamma: bool, out_dtype) -> tuple[jax.Array, jax.Array]:
    """Normalize, multiply by ``scale`` and saturate-cast to ``out_dtype`` (FP8) in one pass.

    Returns ``(y_fp8 [..., hidden], amax)`` with ``amax = max |y|`` of the normalized output
    before scaling (float32 scalar). Forward only.
    """
    if jnp.dtype(out_dtype) not in [jnp.dtype(d) for d in FP8_DTYPES]:
        raise ValueError(f"norm_fp8: out_dtype={out_dtype}; accepted: float8_e4m3fn, float8_e5m2")
    y, amax = forward(x.reshape(-1, x.shape[-1]), gamma, beta, scale=scale, rms=rms, epsilon=epsilon,
                      zero_centered_gamma=zero_centered_gamma, out_dtype=out_dtype)
    return y.reshape(x.shape), amax
