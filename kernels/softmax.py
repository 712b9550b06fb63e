"""Scaled, masked and causal softmax over the last axis as Pallas Triton kernels, forward and backward.

Logits ``[..., q_len, kv_len]`` are processed as rows of ``kv_len``; each program keeps
``block_m`` whole rows in registers (one read, one write). The causal mask (bottom-right aligned:
query ``i`` sees key ``j <= i + kv_len - q_len``) is computed from the row index; a keep-mask is
read as int8 rows, shared by consecutive logits rows when it broadcasts over trailing leading axes
(e.g. a padding mask ``[batch, 1, 1, kv_len]`` against ``[batch, heads, q_len, kv_len]``).
Fully masked rows give zeros. Backward: ``dx = scale * y * (dy - sum(dy * y))`` from the saved output.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mtjax.kernels.common import (
    Launchers,
    check_size,
    interpret,
    next_power_of_2,
    pallas_call,
    unsupported_array,
    vary_together,
)
from mtjax.kernels.common import pallas_triton as plgpu


@dataclasses.dataclass(frozen=True)
class SoftmaxSpec:
    """Static description of a launch.

    Attributes:
      m, n: rows and row length (``kv_len``).
      q_len: rows per causal block (``logits.shape[-2]``), used when ``causal``.
      scale: multiplies the logits.
      causal: apply the bottom-right causal mask.
      mask_rows_per: consecutive logits rows sharing one mask row (0: no mask).
      block_m, n_pad, num_warps: the tile.
    """

    m: int
    n: int
    q_len: int
    scale: float
    causal: bool
    mask_rows_per: int
    block_m: int
    n_pad: int
    num_warps: int


def tile(n: int) -> tuple[int, int]:
    """``(block_m, num_warps)``: about 4096 elements per program."""
    n_pad = next_power_of_2(n)
    block_m = max(1, 4096 // n_pad)
    return block_m, min(16, max(4, block_m * n_pad // 512))


def mask_layout(mask_shape, logits_shape) -> int | None:
    """Logits rows per mask row if the kernel can read ``mask`` as rows, else ``None``.

    The mask must equal the logits' leading shape on a prefix of axes and be 1 on the rest (the
    last axis may be 1 or ``kv_len``).
    """
    lead_l = tuple(logits_shape[:-1])
    mask_shape = (1,) * (len(logits_shape) - len(mask_shape)) + tuple(mask_shape)
    lead_m = mask_shape[:-1]
    if mask_shape[-1] not in (1, logits_shape[-1]):
        return None
    k = 0
    while k < len(lead_l) and lead_m[k] == lead_l[k]:
        k += 1
    if any(d != 1 for d in lead_m[k:]):
        return None
    return max(1, math.prod(lead_l[k:]))


def _spec(logits_shape, scale, causal, mask_rows_per, tile_override) -> SoftmaxSpec:
    n = logits_shape[-1]
    block_m, num_warps = tile_override or tile(n)
    return SoftmaxSpec(
        m=math.prod(logits_shape[:-1]), n=n, q_len=logits_shape[-2] if len(logits_shape) > 1 else 1,
        scale=scale, causal=causal, mask_rows_per=mask_rows_per, block_m=block_m,
        n_pad=next_power_of_2(n), num_warps=num_warps,
    )


def _indices(spec: SoftmaxSpec):
    rows = pl.program_id(0) * spec.block_m + jnp.arange(spec.block_m)
    cols = jnp.arange(spec.n_pad)
    mask = (rows < spec.m)[:, None] & (cols < spec.n)[None, :]
    return rows, cols, mask


def _forward_kernel(*refs, spec: SoftmaxSpec):
    x_ref, mask_ref, y_ref = refs if spec.mask_rows_per else (refs[0], None, refs[1])
    rows, cols, valid = _indices(spec)
    x = plgpu.load(x_ref.at[rows[:, None], cols[None, :]], mask=valid, other=0.0).astype(jnp.float32)
    keep = valid
    if spec.causal:
        last_key = rows % spec.q_len + (spec.n - spec.q_len)
        keep = keep & (cols[None, :] <= last_key[:, None])
    if mask_ref is not None:
        mask_rows = rows // spec.mask_rows_per
        keep = keep & (plgpu.load(mask_ref.at[mask_rows[:, None], cols[None, :]], mask=valid, other=0) != 0)
    z = jnp.where(keep, x * spec.scale, -jnp.inf)
    row_max = jnp.max(z, axis=1, keepdims=True)
    row_max = jnp.where(row_max == -jnp.inf, 0.0, row_max)  # fully masked row: no NaN from inf - inf
    e = jnp.where(keep, jnp.exp(z - row_max), 0.0)
    denom = jnp.sum(e, axis=1, keepdims=True)
    y = e / jnp.where(denom == 0.0, 1.0, denom)
    plgpu.store(y_ref.at[rows[:, None], cols[None, :]], y.astype(y_ref.dtype), mask=valid)


def mask_rows(mask, logits_shape) -> tuple[int, jax.Array | None]:
    """``(logits rows per mask row, the mask as int8 rows [mask_rows, kv_len])`` of a mask accepted
    by `mask_layout`; ``(0, None)`` without a mask."""
    if mask is None:
        return 0, None
    rows_per = mask_layout(mask.shape, logits_shape)
    if rows_per is None:
        raise ValueError(f"softmax kernel: mask of shape {mask.shape} is not row-shared with logits {logits_shape}")
    count = math.prod(logits_shape[:-1]) // rows_per
    full_rank = mask.reshape((1,) * (len(logits_shape) - mask.ndim) + mask.shape)
    compact = full_rank.reshape(count, mask.shape[-1]).astype(jnp.int8)
    return rows_per, jnp.broadcast_to(compact, (count, logits_shape[-1]))


def forward(logits, mask, *, scale: float, causal: bool, tile_override=None):
    """Softmax of ``logits [..., kv_len]`` (any rank) with a mask accepted by `mask_layout`."""
    check_size("softmax forward", logits)
    rows_per, compact = mask_rows(mask, logits.shape)
    inputs = [logits.reshape(-1, logits.shape[-1])] + ([] if compact is None else [compact])
    spec = _spec(logits.shape, scale, causal, rows_per, tile_override)
    y = pallas_call(
        functools.partial(_forward_kernel, spec=spec),
        out_shape=jax.ShapeDtypeStruct(inputs[0].shape, logits.dtype),
        grid=(pl.cdiv(spec.m, spec.block_m),),
        compiler_params=plgpu.CompilerParams(num_warps=spec.num_warps, num_stages=1),
        interpret=interpret(),
        name="mtjax_softmax_fwd",
    )(*inputs)
    return y.reshape(logits.shape)


def _backward_kernel(y_ref, dy_ref, dx_ref, *, spec: SoftmaxSpec):
    rows, cols, valid = _indices(spec)
    y = plgpu.load(y_ref.at[rows[:, None], cols[None, :]], mask=valid, other=0.0).astype(jnp.float32)
    dy = plgpu.load(dy_ref.at[rows[:, None], cols[None, :]], mask=valid, other=0.0).astype(jnp.float32)
    dx = spec.scale * y * (dy - jnp.sum(dy * y, axis=1, keepdims=True))
    plgpu.store(dx_ref.at[rows[:, None], cols[None, :]], dx.astype(dx_ref.dtype), mask=valid)


def backward(y, dy, *, scale: float, tile_override=None):
    """Gradient of the logits from the softmax output ``y`` and its cotangent ``dy``."""
    spec = _spec(y.shape, scale, False, 0, tile_override)
    dx = pallas_call(
        functools.partial(_backward_kernel, spec=spec),
        out_shape=jax.ShapeDtypeStruct((spec.m, spec.n), y.dtype),
        grid=(pl.cdiv(spec.m, spec.block_m),),
        compiler_params=plgpu.CompilerParams(num_warps=spec.num_warps, num_stages=1),
        interpret=interpret(),
        name="mtjax_softmax_bwd",
    )(y.reshape(-1, spec.n), dy.reshape(-1, spec.n))
    return dx.reshape(y.shape)


def unsupported(logits_shape, logits_dtype, mask_shape) -> str | None:
    """``None`` if the kernels take this call, else why not (for the op's ``unsupported=``)."""
    reason = unsupported_array(logits_shape, logits_dtype)
    if reason is None and mask_shape is not None and mask_layout(mask_shape, logits_shape) is None:
        reason = f"mask {tuple(mask_shape)} must match a prefix of the logits' leading axes and be 1 elsewhere"
    return reason


# forward(logits, mask, *, scale, causal) and backward(y, dy, *, scale), as above.
PALLAS = Launchers(forward=forward, backward=backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _softmax(logits, mask, scale, causal, launchers):
    return launchers.forward(logits, mask, scale=scale, causal=causal)


def _softmax_fwd(logits, mask, scale, causal, launchers):
    y = launchers.forward(logits, mask, scale=scale, causal=causal)
    return y, y


def _softmax_bwd(scale, causal, launchers, y, dy):
    return launchers.backward(y, dy, scale=scale), None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def softmax(logits: jax.Array, mask: jax.Array | None, *, scale: float, causal: bool,
            launchers: Launchers = PALLAS) -> jax.Array:
    """``softmax(scale * logits)`` over the last axis, in ``logits.dtype``; ``mask`` True keeps.
    ``launchers``: these Pallas kernels or the native Triton ones (`mtjax.kernels.triton.softmax.NATIVE`)."""
    logits, mask = vary_together(logits, mask)
    return _softmax(logits, mask, float(scale), bool(causal), launchers)
