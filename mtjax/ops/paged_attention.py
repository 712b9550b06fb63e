"""Attention of new query tokens over a paged KV cache (decode and chunked prefill).

Layout:
- ``q [batch, q_len, heads, head_dim]``: the last ``q_len`` tokens of each sequence (decode: ``q_len == 1``);
- ``k_pages``/``v_pages [kv_heads, num_pages, page_size, head_dim]``: the cache of one layer, in pages of
  ``page_size`` tokens; bfloat16/float16/float32, or FP8 (``float8_e4m3fn``/``float8_e5m2``) with a
  float32 dequantization scale per KV head (``k_scale``/``v_scale [kv_heads]``: stored value times scale
  is the real one);
- ``block_tables [batch, pages_per_seq]`` int32: the page ids of each sequence's tokens in order (token
  ``j`` lives in page ``block_tables[b, j // page_size]`` at row ``j % page_size``); entries past a
  sequence's last page are never read but must be valid page ids (e.g. 0);
- ``lengths [batch]`` int32: tokens of each sequence in the cache, the ``q_len`` new ones included
  (already written to the pages).

Query ``t`` of sequence ``b`` sits at position ``lengths[b] - q_len + t`` and sees the keys ``0 ..`` that
position (causal; with ``window_size=(left, right)`` only the last ``left + 1`` of them). ``heads`` is a
multiple of ``kv_heads`` (GQA): query head ``h`` reads KV head ``h // (heads // kv_heads)``. A query that
sees no key (an empty slot, ``lengths[b] == 0``, or a padding query at a negative position) returns zeros.
Forward only: this is an inference op.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtjax import backend
from mtjax.kernels import paged_attention as paged_attention_kernel
from mtjax.kernels.common import KERNEL_FP8_DTYPES
from mtjax.kernels.common import interpret as kernel_interpret
from mtjax.ops.checks import check_float, check_rank
from mtjax.ops.softmax import masked_softmax

PAGE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)) + tuple(
    jnp.dtype(d) for d in KERNEL_FP8_DTYPES)


def gather_pages(pages: jax.Array, block_tables: jax.Array, page_scale: jax.Array | None) -> jax.Array:
    """``[batch, kv_heads, pages_per_seq * page_size, head_dim]``: each sequence's cache as one contiguous
    array (dequantized to float32 when ``page_scale`` is given)."""
    kv_heads, _, page_size, head_dim = pages.shape
    batch, pages_per_seq = block_tables.shape
    x = jnp.swapaxes(pages[:, block_tables], 0, 1)  # [batch, kv_heads, pages_per_seq, page_size, head_dim]
    x = x.reshape(batch, kv_heads, pages_per_seq * page_size, head_dim)
    if page_scale is not None:
        x = x.astype(jnp.float32) * page_scale[None, :, None, None]
    return x


def visible_keys(lengths: jax.Array, q_len: int, kv_len: int, window_size: tuple[int, int] | None) -> jax.Array:
    """Bool ``[batch, q_len, kv_len]``: which cache positions each new query sees."""
    q_pos = lengths[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)[None, :]  # [batch, q_len]
    k_pos = jnp.arange(kv_len, dtype=jnp.int32)[None, None, :]
    keep = k_pos <= q_pos[:, :, None]
    if window_size is not None and window_size[0] >= 0:
        keep &= k_pos >= q_pos[:, :, None] - window_size[0]
    return keep


@backend.register("paged_attention", backend.REFERENCE)
def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                              lengths: jax.Array, k_scale: jax.Array | None, v_scale: jax.Array | None, *,
                              scale: float, logits_soft_cap: float | None,
                              window_size: tuple[int, int] | None) -> jax.Array:
    """The ``"xla"`` implementation of `paged_attention`: gather the pages, masked softmax in float32
    (scales already shaped ``[kv_heads]`` float32, ``lengths`` int32)."""
    batch, q_len, heads, head_dim = q.shape
    kv_heads = k_pages.shape[0]
    groups = heads // kv_heads
    k = gather_pages(k_pages, block_tables, k_scale)
    v = gather_pages(v_pages, block_tables, v_scale)
    kv_len = k.shape[2]
    qg = q.reshape(batch, q_len, kv_heads, groups, head_dim).astype(jnp.float32)
    # float32 throughout: the reference's precision, and XLA:CPU has no bf16 x bf16 -> f32 dot for these shapes.
    logits = jnp.einsum("btkgd,bksd->bkgts", qg, k.astype(jnp.float32)) * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    keep = visible_keys(lengths, q_len, kv_len, window_size)[:, None, None]  # [batch, 1, 1, q_len, kv_len]
    probs = masked_softmax(logits, keep)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v.astype(jnp.float32))
    return out.reshape(batch, q_len, heads, head_dim).astype(q.dtype)


def _check_page_scale(op: str, name: str, page_scale, pages: jax.Array) -> jax.Array | None:
    is_fp8 = jnp.dtype(pages.dtype) in [jnp.dtype(d) for d in KERNEL_FP8_DTYPES]
    if page_scale is None:
        if is_fp8:
            raise ValueError(f"{op}: FP8 pages ({pages.dtype}) need {name} (float32 [kv_heads] dequantization scales)")
        return None
    if not is_fp8:
        raise ValueError(f"{op}: {name} is given but the pages are {pages.dtype}; scales go with FP8 pages only")
    check_float(op, name, page_scale)
    kv_heads = pages.shape[0]
    if jnp.ndim(page_scale) == 0:
        page_scale = jnp.broadcast_to(page_scale, (kv_heads,))
    if jnp.shape(page_scale) != (kv_heads,):
        raise ValueError(f"{op}: {name} has shape {jnp.shape(page_scale)}; expected ({kv_heads},) (one per KV "
                         "head) or a scalar")
    return jnp.asarray(page_scale, jnp.float32)


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    window_size: tuple[int, int] | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """Attention of the last ``q_len`` tokens of each sequence over its paged cache (module docstring:
    layout and masking).

    Args:
      q: ``[batch, q_len, heads, head_dim]`` float.
      k_pages, v_pages: ``[kv_heads, num_pages, page_size, head_dim]``, one dtype of `PAGE_DTYPES`.
      block_tables: int ``[batch, pages_per_seq]`` page ids.
      lengths: int ``[batch]`` cached tokens per sequence, the new ones included; 0 marks an empty slot.
      scale: logit scale, default ``head_dim ** -0.5``.
      k_scale, v_scale: float32 ``[kv_heads]`` (or scalar) dequantization scales, required with FP8
        pages and rejected without.
      logits_soft_cap: ``cap * tanh(logits / cap)`` after scaling.
      window_size: ``(left, right)`` as in `mtjax.ops.attention`; the cache is causal, so only ``left``
        (``-1``: unbounded) restricts anything.
      implementation: ``"xla"`` (reference), ``"pallas_triton"`` or ``"cudnn"``; default: the best here.
    Returns:
      ``[batch, q_len, heads, head_dim]`` in ``q.dtype``.
    Example:
      >>> out = paged_attention(q, k_pages, v_pages, block_tables, lengths)  # doctest: +SKIP
    """
    op = "paged_attention"
    check_float(op, "q", q)
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        check_rank(op, name, x, 4)
    batch, _, heads, head_dim = q.shape
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"{op}: k_pages {k_pages.shape} and v_pages {v_pages.shape} must have one shape")
    if k_pages.dtype != v_pages.dtype:
        raise TypeError(f"{op}: k_pages ({k_pages.dtype}) and v_pages ({v_pages.dtype}) must have one dtype")
    if jnp.dtype(k_pages.dtype) not in PAGE_DTYPES:
        raise TypeError(f"{op}: pages of dtype {k_pages.dtype}; accepted: {', '.join(str(d) for d in PAGE_DTYPES)}")
    kv_heads, _, page_size, page_head_dim = k_pages.shape
    if page_head_dim != head_dim:
        raise ValueError(f"{op}: pages have head_dim {page_head_dim}, q has {head_dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{op}: q heads ({heads}) must be a multiple of the pages' kv_heads ({kv_heads})")
    if page_size == 0:
        raise ValueError(f"{op}: page_size is 0")
    check_rank(op, "block_tables", block_tables, 2)
    if block_tables.shape[0] != batch:
        raise ValueError(f"{op}: block_tables has shape {block_tables.shape}; expected ({batch}, pages_per_seq)")
    if jnp.shape(lengths) != (batch,):
        raise ValueError(f"{op}: lengths has shape {jnp.shape(lengths)}; expected ({batch},)")
    for name, x in (("block_tables", block_tables), ("lengths", lengths)):
        if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise TypeError(f"{op}: {name} has dtype {jnp.result_type(x)}; expected int32")
    k_scale = _check_page_scale(op, "k_scale", k_scale, k_pages)
    v_scale = _check_page_scale(op, "v_scale", v_scale, v_pages)
    if window_size is not None:
        window_size = tuple(int(w) for w in window_size)
        if len(window_size) != 2 or min(window_size) < -1:
            raise ValueError(f"{op}: window_size={window_size}; expected (left, right) with -1 for unbounded")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"{op}: logits_soft_cap={logits_soft_cap}; expected a positive float or None")
    scale = float(head_dim ** -0.5 if scale is None else scale)
    return backend.dispatch(
        op, q, k_pages, v_pages, jnp.asarray(block_tables, jnp.int32), jnp.asarray(lengths, jnp.int32),
        k_scale, v_scale, implementation=implementation, scale=scale,
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap), window_size=window_size,
    )


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


def _pallas_triton_unsupported(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale, *, scale,
                               logits_soft_cap, window_size) -> str | None:
    return paged_attention_kernel.unsupported(jnp.shape(q), jnp.shape(k_pages), jnp.result_type(q),
                                              jnp.result_type(k_pages))


@backend.register("paged_attention", "pallas_triton", requires=(backend.PALLAS_TRITON,),
                  unsupported=_pallas_triton_unsupported, priority=10, single_device=True)
def _paged_attention_pallas_triton(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale, *, scale,
                                   logits_soft_cap, window_size):
    left = None if window_size is None or window_size[0] < 0 else window_size[0]
    return paged_attention_kernel.paged_attention(
        q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale, scale=scale, logits_soft_cap=logits_soft_cap,
        window_left=left, interpret=kernel_interpret())


# The native Triton kernel ahead of its Pallas twin where jax-triton is installed (faster on an H100:
# docs/performance.md).
@backend.register("paged_attention", "triton", requires=(backend.TRITON,), unsupported=_pallas_triton_unsupported,
                  priority=11, single_device=True)
def _paged_attention_triton(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale, *, scale, logits_soft_cap,
                            window_size):
    from mtjax.kernels.triton import paged_attention as native

    left = None if window_size is None or window_size[0] < 0 else window_size[0]
    return native.paged_attention(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale, scale=scale,
                                  logits_soft_cap=logits_soft_cap, window_left=left)


def cudnn_paged_attention(q: jax.Array, k_blocks: jax.Array, v_blocks: jax.Array, block_tables: jax.Array,
                          lengths: jax.Array, *, scale: float) -> jax.Array:
    """Decode attention (``q_len == 1``) through cuDNN's paged flash attention, in cuDNN's own cache layout.

    ``k_blocks``/``v_blocks [batch * pages_per_seq, page_size, kv_heads, head_dim]`` bfloat16/float16 (jax
    asks for a pool of exactly ``batch * pages_per_seq`` pages); other arguments as `paged_attention`.
    Runs on NVIDIA GPUs with cuDNN 9.5+ only (jax's ``jax._src.cudnn`` paged path, which has no public
    entry point).
    """
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import paged_attention as cudnn_paged

    batch = q.shape[0]
    tables = block_tables.astype(jnp.int32)[:, None, :, None]
    lengths = lengths.astype(jnp.int32)
    out = cudnn_paged(q, k_blocks, v_blocks, jnp.ones((batch,), jnp.int32), lengths, tables, tables, scale=scale,
                      mask_type=MaskType.PADDING, qkv_layout="BTNH")
    return jnp.where((lengths > 0)[:, None, None, None], out, 0).astype(q.dtype)


def _cudnn_unsupported(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale, *, scale, logits_soft_cap,
                       window_size) -> str | None:
    batch, q_len, _, head_dim = jnp.shape(q)
    dtype = jnp.result_type(q)
    if q_len != 1:
        return f"q_len {q_len} (cuDNN aligns causal masks top-left; routed for decode, q_len 1, only)"
    if dtype not in (jnp.bfloat16, jnp.float16) or jnp.result_type(k_pages) != dtype:
        return "dtypes other than bfloat16/float16 q and pages of the same dtype"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim} (cuDNN: a multiple of 8, at most 256)"
    if jnp.shape(k_pages)[1] != batch * jnp.shape(block_tables)[1]:
        return "a page pool of other than batch * pages_per_seq pages (jax's cuDNN paged path requires it)"
    if logits_soft_cap is not None or (window_size is not None and window_size[0] >= 0):
        return "soft-cap or sliding window (not routed to cuDNN)"
    return None


def _cudnn_not_preferred(*args, **static) -> str | None:
    return ("cuDNN wants the cache as [pages, page_size, kv_heads, head_dim]; from mtjax's "
            "[kv_heads, pages, page_size, head_dim] every call would copy the whole cache")


@backend.register("paged_attention", "cudnn", requires=(backend.CUDNN_ATTENTION,), platforms=("cuda",),
                  unsupported=_cudnn_unsupported, prefer=_cudnn_not_preferred, priority=20)
def _paged_attention_cudnn(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale, *, scale, logits_soft_cap,
                           window_size):
    k_blocks, v_blocks = (jnp.transpose(p, (1, 2, 0, 3)) for p in (k_pages, v_pages))
    return cudnn_paged_attention(q, k_blocks, v_blocks, block_tables, lengths, scale=scale)
