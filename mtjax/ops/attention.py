"""Dot-product attention: the reference every attention kernel is checked against.

Layout: ``query [batch, q_len, heads, head_dim]``, ``key``/``value [batch, kv_len, kv_heads, head_dim]``
(``jax.nn.dot_product_attention``'s BTNH). ``heads`` must be a multiple of ``kv_heads`` (GQA; MQA when
``kv_heads == 1``); K and V are never repeated in memory.

Masks combine (a position is attended only if every one keeps it):
- ``mask_type``: ``"no_mask"``, ``"padding"``, ``"causal"`` or ``"padding_causal"``; causal is
  aligned bottom-right (query ``i`` sees key ``j <= i + kv_len - q_len``);
- padding: ``q_segment_ids``/``kv_segment_ids`` ``[batch, len]`` int (a query attends keys of its own
  segment; id 0 marks padding) or ``q_seqlens``/``kv_seqlens`` ``[batch]`` (positions past the length
  are padding);
- ``mask``: bool ``[batch|1, heads|1, q_len, kv_len]``, True keeps;
- ``window_size=(left, right)``: query ``i`` sees keys ``i - left .. i + right`` (``-1``: unbounded).
A query with nothing left to attend returns zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mtjax import backend
from mtjax.kernels import flash_attention
from mtjax.kernels.common import dropout_keep
from mtjax.kernels.common import interpret as kernel_interpret
from mtjax.ops.checks import check_choice, check_float, check_rank
from mtjax.ops.softmax import causal_mask, masked_softmax

MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal")


def combined_mask(q_len, kv_len, *, mask, q_segment_ids, kv_segment_ids, mask_type, window_size):
    """The boolean keep-mask ``[batch|1, 1|heads, q_len, kv_len]`` of all mask inputs, or ``None``."""
    keep = None

    def conj(a, b):
        return b if a is None else jnp.logical_and(a, b)

    if mask is not None:
        keep = conj(keep, mask)
    if q_segment_ids is not None:
        same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
        real = (q_segment_ids[:, :, None] != 0) & (kv_segment_ids[:, None, :] != 0)
        keep = conj(keep, (same & real)[:, None])
    if mask_type in ("causal", "padding_causal"):
        keep = conj(keep, causal_mask(q_len, kv_len)[None, None])
    if window_size is not None:
        left, right = window_size
        q_pos = jnp.arange(q_len)[:, None] + (kv_len - q_len)
        k_pos = jnp.arange(kv_len)[None, :]
        win = jnp.ones((q_len, kv_len), bool)
        if left >= 0:
            win &= k_pos >= q_pos - left
        if right >= 0:
            win &= k_pos <= q_pos + right
        keep = conj(keep, win[None, None])
    return keep


def dropout_rows(batch: int, heads: int, q_len: int) -> jax.Array:
    """``[batch, heads, q_len, 1]`` row counters of the dropout hash: ``(b * heads + h) * q_len + i``.

    With the key index as column, `mtjax.kernels.common.dropout_keep` of these draws the attention
    dropout mask; kernels recompute it tile by tile instead of storing it.
    """
    b = jnp.arange(batch, dtype=jnp.uint32)[:, None, None, None]
    h = jnp.arange(heads, dtype=jnp.uint32)[None, :, None, None]
    i = jnp.arange(q_len, dtype=jnp.uint32)[None, None, :, None]
    return (b * heads + h) * q_len + i


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_f32(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """``einsum(spec, x, y)`` accumulated and returned in float32, whose backward runs its two GEMMs
    in the operands' dtype: the float32 cotangent (a softmax's) is rounded to it first, as flash
    attention kernels round their score gradients. Differentiated as is, a bf16 einsum with a
    float32 result would transpose into float32 x float32 GEMMs."""
    return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)


def _einsum_f32_fwd(spec, x, y):
    return _einsum_f32(spec, x, y), (x, y)


def _einsum_f32_bwd(spec, residuals, cotangent):
    x, y = residuals
    _, vjp = jax.vjp(functools.partial(jnp.einsum, spec), x, y)
    return vjp(cotangent.astype(jnp.result_type(x, y)))


_einsum_f32.defvjp(_einsum_f32_fwd, _einsum_f32_bwd)


@backend.register("attention", backend.REFERENCE)
def attention_reference(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
                        mask: jax.Array | None, q_segment_ids: jax.Array | None, kv_segment_ids: jax.Array | None,
                        dropout_seed: jax.Array | None, *, mask_type: str, scale: float, dropout_rate: float,
                        window_size: tuple[int, int] | None, logits_soft_cap: float | None) -> jax.Array:
    """The ``"xla"`` implementation of `attention` (BTNH arrays; seqlens already turned into segment
    ids, ``dropout_seed`` the uint32 scalar drawn from ``dropout_rng``)."""
    batch, q_len, heads, head_dim = query.shape
    kv_len, kv_heads = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = query.reshape(batch, q_len, kv_heads, groups, head_dim)
    logits = _einsum_f32("btkgd,bskd->bkgts", q, key) * scale
    logits = logits.reshape(batch, heads, q_len, kv_len)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    keep = combined_mask(q_len, kv_len, mask=mask, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                         mask_type=mask_type, window_size=window_size)
    probs = masked_softmax(logits, keep)
    if dropout_rate > 0.0:
        kept = dropout_keep(dropout_seed, dropout_rows(batch, heads, q_len), jnp.arange(kv_len)[None, None, None, :],
                            dropout_rate)
        probs = jnp.where(kept, probs / (1.0 - dropout_rate), 0.0)
    probs = probs.astype(value.dtype).reshape(batch, kv_heads, groups, q_len, kv_len)
    out = _einsum_f32("bkgts,bskd->btkgd", probs, value)
    return out.reshape(batch, q_len, heads, value.shape[-1]).astype(query.dtype)


def _seqlens_to_segment_ids(seqlens, length):
    return (jnp.arange(length)[None, :] < seqlens[:, None]).astype(jnp.int32)


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    mask_type: str = "no_mask",
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_seqlens: jax.Array | None = None,
    kv_seqlens: jax.Array | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    window_size: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """Softmax attention (module docstring: layout and masks).

    Args:
      bias: float, broadcastable to ``[batch, heads, q_len, kv_len]``, added to the scaled logits.
      scale: logit scale, default ``1 / sqrt(head_dim)``.
      dropout_rate: attention-probability dropout; needs ``dropout_rng``. The mask is a counter-based
        hash of (a 32-bit seed drawn from the key, batch, head, query, key position), the same in
        every implementation, so kernels never store it.
      logits_soft_cap: ``cap * tanh(logits / cap)`` after scale and bias.
    Returns:
      ``[batch, q_len, heads, head_dim]`` in ``query.dtype``.
    """
    op = "attention"
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_float(op, name, x)
        check_rank(op, name, x, 4)
    batch, q_len, heads, head_dim = query.shape
    if key.shape != value.shape[:3] + (key.shape[3],) or key.shape[0] != batch:
        raise ValueError(f"{op}: key {key.shape} and value {value.shape} must share [batch, kv_len, kv_heads] with "
                         f"batch {batch}")
    if key.shape[3] != head_dim:
        raise ValueError(f"{op}: key head_dim {key.shape[3]} differs from query head_dim {head_dim}")
    kv_len, kv_heads = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{op}: query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    check_choice(op, "mask_type", mask_type, MASK_TYPES)
    if (q_seqlens is None) != (kv_seqlens is None) or (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(f"{op}: pass q_ and kv_ segment ids (or seqlens) together")
    if q_seqlens is not None:
        if q_segment_ids is not None:
            raise ValueError(f"{op}: pass segment ids or seqlens, not both")
        q_segment_ids = _seqlens_to_segment_ids(q_seqlens, q_len)
        kv_segment_ids = _seqlens_to_segment_ids(kv_seqlens, kv_len)
    if q_segment_ids is not None:
        if q_segment_ids.shape != (batch, q_len) or kv_segment_ids.shape != (batch, kv_len):
            raise ValueError(
                f"{op}: q_segment_ids {q_segment_ids.shape} / kv_segment_ids {kv_segment_ids.shape}; "
                f"expected ({batch}, {q_len}) / ({batch}, {kv_len})"
            )
        if not all(jnp.issubdtype(ids.dtype, jnp.integer) for ids in (q_segment_ids, kv_segment_ids)):
            raise TypeError(f"{op}: segment ids must be integers")
    if mask_type in ("padding", "padding_causal") and q_segment_ids is None and mask is None:
        raise ValueError(f"{op}: mask_type={mask_type!r} needs q/kv_segment_ids, q/kv_seqlens or mask")
    if mask is not None:
        if jnp.result_type(mask) != jnp.bool_ or jnp.ndim(mask) != 4:
            raise ValueError(f"{op}: mask must be bool [batch|1, heads|1, q_len, kv_len]; got {jnp.result_type(mask)} "
                             f"{jnp.shape(mask)}")
        try:
            jnp.broadcast_shapes(mask.shape, (batch, heads, q_len, kv_len))
        except ValueError:
            raise ValueError(f"{op}: mask has shape {tuple(mask.shape)}, which does not broadcast to "
                             f"[batch, heads, q_len, kv_len] = {(batch, heads, q_len, kv_len)}; expected "
                             f"[{batch}|1, {heads}|1, {q_len}, {kv_len}]") from None
    if bias is not None:
        check_float(op, "bias", bias)
        try:
            jnp.broadcast_shapes(jnp.shape(bias), (batch, heads, q_len, kv_len))
        except ValueError:
            raise ValueError(f"{op}: bias of shape {jnp.shape(bias)} does not broadcast to "
                             f"{(batch, heads, q_len, kv_len)}") from None
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"{op}: dropout_rate={dropout_rate}; expected 0 <= dropout_rate < 1")
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError(f"{op}: dropout_rate={dropout_rate} needs dropout_rng")
    if window_size is not None:
        window_size = tuple(int(w) for w in window_size)
        if len(window_size) != 2 or min(window_size) < -1:
            raise ValueError(f"{op}: window_size={window_size}; expected (left, right) with -1 for unbounded")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"{op}: logits_soft_cap={logits_soft_cap}; expected a positive float or None")
    scale = float(head_dim ** -0.5 if scale is None else scale)
    return backend.dispatch(
        op, query, key, value, bias, mask, q_segment_ids, kv_segment_ids,
        jax.random.bits(dropout_rng, (), jnp.uint32) if dropout_rate > 0.0 else None,
        implementation=implementation, mask_type=mask_type, scale=scale, dropout_rate=float(dropout_rate),
        window_size=window_size, logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
    )


# --------------------------------------------------------------------------------------------------
# Kernels. Priorities follow the attention benchmark (`mtjax bench attention`, docs/performance.md):
# cuDNN was faster than the Triton kernel at every benchmarked shape, so cuDNN (20) goes first where
# it applies; the Pallas kernel (10) takes what cuDNN declines and every Triton-capable plugin
# platform; its native Triton port (9) takes over where the jax in use has no Pallas Triton backend.
# --------------------------------------------------------------------------------------------------


def _is_causal(mask_type: str) -> bool:
    return mask_type in ("causal", "padding_causal")


def _pallas_triton_unsupported(query, key, value, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *,
                               mask_type, scale, dropout_rate, window_size, logits_soft_cap) -> str | None:
    if bias is not None:
        return "bias (a [q_len, kv_len] operand; the kernel never reads one)"
    if mask is not None:
        return "an explicit mask (pass segment ids or seqlens instead)"
    if not jnp.result_type(query) == jnp.result_type(key) == jnp.result_type(value):
        return "query, key and value of different dtypes"
    return flash_attention.unsupported(jnp.shape(query), jnp.shape(key), jnp.result_type(query))


@backend.register("attention", "pallas_triton", requires=(backend.PALLAS_TRITON,),
                  unsupported=_pallas_triton_unsupported, priority=10, single_device=True)
def _attention_pallas_triton(query, key, value, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *,
                             mask_type, scale, dropout_rate, window_size, logits_soft_cap):
    return flash_attention.flash_attention(
        query, key, value, q_segment_ids, kv_segment_ids, scale=scale, causal=_is_causal(mask_type),
        window_size=window_size, logits_soft_cap=logits_soft_cap, dropout_rate=dropout_rate, dropout_seed=dropout_seed,
        interpret=kernel_interpret(),
    )


@backend.register("attention", "triton", requires=(backend.TRITON,), unsupported=_pallas_triton_unsupported,
                  priority=9, single_device=True)
def _attention_triton(query, key, value, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *,
                      mask_type, scale, dropout_rate, window_size, logits_soft_cap):
    from mtjax.kernels.triton import flash_attention as native

    return native.flash_attention(
        query, key, value, q_segment_ids, kv_segment_ids, scale=scale, causal=_is_causal(mask_type),
        window_size=window_size, logits_soft_cap=logits_soft_cap, dropout_rate=dropout_rate, dropout_seed=dropout_seed,
    )


def _mosaic_gpu_unsupported(query, key, value, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *,
                            mask_type, scale, dropout_rate, window_size, logits_soft_cap) -> str | None:
    from mtjax.kernels.mosaic_gpu import flash_attention as mosaic

    return _pallas_triton_unsupported(
        query, key, value, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, mask_type=mask_type, scale=scale,
        dropout_rate=dropout_rate, window_size=window_size, logits_soft_cap=logits_soft_cap,
    ) or mosaic.unsupported(jnp.shape(query), jnp.shape(key), jnp.result_type(query))


# Warp-specialised Mosaic GPU kernels for Hopper: below the Triton kernels until the attention
# benchmark has compared them on the GPU.
@backend.register("attention", "mosaic_gpu", requires=(backend.PALLAS_MOSAIC_GPU,),
                  unsupported=_mosaic_gpu_unsupported, priority=8, single_device=True)
def _attention_mosaic_gpu(query, key, value, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *,
                          mask_type, scale, dropout_rate, window_size, logits_soft_cap):
    from mtjax.kernels.mosaic_gpu import flash_attention as mosaic

    return flash_attention.flash_attention(
        query, key, value, q_segment_ids, kv_segment_ids, scale=scale, causal=_is_causal(mask_type),
        window_size=window_size, logits_soft_cap=logits_soft_cap, dropout_rate=dropout_rate,
        dropout_seed=dropout_seed, ptx_exp2=False, launchers=mosaic.MOSAIC,
    )


def _cudnn_max_head_dim() -> int:
    """cuDNN's flash attention takes head_dim up to 256 from Hopper on, 128 before."""
    return 256 if backend.cuda_compute_capability() >= (9, 0) else 128


def _cudnn_unsupported(query, key, value, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *,
                       mask_type, scale, dropout_rate, window_size, logits_soft_cap) -> str | None:
    dtype = jnp.result_type(query)
    if dtype not in (jnp.bfloat16, jnp.float16) or not dtype == jnp.result_type(key) == jnp.result_type(value):
        return f"dtype {dtype} (cuDNN flash attention takes bfloat16 or float16 q, k, v)"
    head_dim = jnp.shape(query)[-1]
    max_head_dim = _cudnn_max_head_dim()
    if head_dim % 8 or head_dim > max_head_dim:
        return f"head_dim {head_dim} (cuDNN here: a multiple of 8, at most {max_head_dim})"
    if _is_causal(mask_type) and jnp.shape(query)[1] != jnp.shape(key)[1]:
        return "causal with q_len != kv_len (cuDNN aligns causal top-left, mtjax bottom-right)"
    if jnp.shape(query)[1] % 2 or jnp.shape(key)[1] % 2:
        # jax's cuDNN check rejects the training pass (forward with residuals) at odd lengths, and
        # this choice is made before anyone knows whether a gradient will be taken.
        return f"odd q_len or kv_len ({jnp.shape(query)[1]}, {jnp.shape(key)[1]}: cuDNN training needs even ones)"
    if bias is not None:
        q_len, heads = jnp.shape(query)[1:3]
        shape = (1,) * (4 - jnp.ndim(bias)) + tuple(jnp.shape(bias))
        # cuDNN's bias gradient sums over a batch-1 bias only; the sequence axes must be whole.
        if shape[0] != 1 or shape[1] not in (1, heads) or shape[2:] != (q_len, jnp.shape(key)[1]):
            return f"bias of shape {jnp.shape(bias)} (cuDNN here: [1, heads|1, q_len, kv_len], shared by the batch)"
    for name, present in (("explicit mask", mask is not None),
                          ("segment ids", q_segment_ids is not None), ("dropout", dropout_rate > 0.0),
                          ("sliding window", window_size is not None), ("soft-cap", logits_soft_cap is not None)):
        if present:
            return f"{name} (not routed to cuDNN)"
    return None


@backend.register("attention", "cudnn", requires=(backend.CUDNN_ATTENTION,), platforms=("cuda",),
                  unsupported=_cudnn_unsupported, priority=20)
def _attention_cudnn(query, key, value, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *,
                     mask_type, scale, dropout_rate, window_size, logits_soft_cap):
    if bias is not None:  # [1, heads, q_len, kv_len] in the inputs' dtype
        q_len, heads = query.shape[1:3]
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
        bias = jnp.broadcast_to(bias, (1, heads, q_len, key.shape[1])).astype(query.dtype)
    return jax.nn.dot_product_attention(query, key, value, bias, scale=scale, is_causal=_is_causal(mask_type),
                                        implementation="cudnn")
