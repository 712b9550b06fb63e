"""Context parallelism: attention over a sequence split across the devices of a mesh axis (``cp``).

Queries stay where they are; the keys and values travel. Two strategies (TransformerEngine-JAX's
``CPStrategy``):

- ``"ring"``: the key/value shards go around the ring of ``cp`` devices with ``lax.ppermute``, one
  hop per step, the transfer of the next block overlapping the attention of the current one; each
  block goes through `attention_with_lse` (the flash kernel where it runs) and the partial results
  are merged by their log-sum-exp. The backward pass is a ring too: the key/value gradients travel
  with their blocks and arrive home after the last hop.
- ``"all_gather"``: the key/value shards are all-gathered once (and their gradients
  reduce-scattered); the blocks are then attended and merged as in the ring.

Causal masks and load balancing: with the sequence cut into ``cp`` contiguous shards, shard ``i``
sees ``i + 1`` key shards and the last device does ``cp`` times the first one's work. The
load-balanced layout (`mtjax.sharding.reorder_causal_load_balancing`) cuts the sequence into
``2 * cp`` chunks and gives device ``i`` chunks ``i`` and ``2 * cp - 1 - i``: every device then
attends the same number of (query, key) chunk pairs. Against the key shard of device ``j`` the
queries of device ``i`` need: ``j == i``: causal attention of the local shard; ``j < i``: every
query against the first key chunk; ``j > i``: the second query chunk against every key. All three
are unmasked or plainly causal blocks, so the kernel skips nothing it computes.

`ring_attention` and `all_gather_attention` are per-shard functions (call them inside
``shard_map`` with the ``cp`` axis manual); `context_parallel_attention` wraps one in the
``shard_map`` for arrays laid out by the logical-axis rules.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, get_abstract_mesh
from jax.sharding import PartitionSpec as P

from mtjax import backend
from mtjax.kernels import flash_attention
from mtjax.kernels.common import dropout_keep
from mtjax.kernels.common import interpret as kernel_interpret
from mtjax.ops.attention import combined_mask
from mtjax.ops.checks import check_choice

CONTEXT_PARALLEL_STRATEGIES = ("ring", "all_gather")
CONTEXT_PARALLEL_MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal")


# --------------------------------------------------------------------------------------------------
# One block: attention with its log-sum-exp, and the block's gradients given the merged result
# --------------------------------------------------------------------------------------------------


def _grouped(x, kv_heads):
    b, t, h, d = x.shape
    return x.reshape(b, t, kv_heads, h // kv_heads, d)


def _logits(q, k, scale, soft_cap, bias=None):
    """Scaled (biased, soft-capped) f32 logits ``[batch, kv_heads, groups, q_len, kv_len]`` and the
    pre-cap ones (``bias`` already grouped so)."""
    s = jnp.einsum("btkgd,bskd->bkgts", _grouped(q, k.shape[2]), k, preferred_element_type=jnp.float32) * scale
    if bias is not None:
        s = s + bias
    return (s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)), s


def _keep(q, k, q_seg, kv_seg, causal):
    keep = combined_mask(q.shape[1], k.shape[1], mask=None, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                         mask_type="causal" if causal else "no_mask", window_size=None)
    return None if keep is None else keep[:, :, None]  # [b|1, 1, 1, t, s]


def _probs_and_lse(logits, keep):
    """Row-normalised probabilities and the natural-log ``lse`` of the visible f32 ``logits``
    (``-inf`` and zero probabilities for a row that sees nothing)."""
    if keep is not None:
        logits = jnp.where(keep, logits, -jnp.inf)
    lse = jnp.max(logits, axis=-1)
    lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    p = jnp.exp(logits - lse_safe[..., None])
    total = jnp.sum(p, axis=-1)
    lse = jnp.where(total > 0, lse_safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return p / jnp.where(total > 0, total, 1.0)[..., None], lse


def _dropped(p, drop, rate):
    """``p`` with the dropout mask ``drop`` (True: kept) applied, kept entries scaled by ``1 / (1 - rate)``."""
    return p if drop is None else jnp.where(drop, p / (1.0 - rate), 0.0)


def _block_forward(query, value, logits, keep, drop=None, rate=0.0):
    """``(out, lse)`` of one block from its grouped logits ``[batch, kv_heads, groups, q_len, kv_len]``."""
    b, t, h, _ = query.shape
    p, lse = _probs_and_lse(logits, keep)
    p = _dropped(p, drop, rate)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(value.dtype), value, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, value.shape[-1]).astype(query.dtype), lse.reshape(b, h, t)


def _block_backward(query, key, value, logits, raw, keep, out, lse, d_out, *, scale, logits_soft_cap, drop=None,
                    rate=0.0):
    """``(dq, dk, dv, dlogits)`` (float32) of one block given the merged ``out``/``lse``; ``dlogits``
    ``[batch, kv_heads, groups, q_len, kv_len]`` is the gradient of the biased pre-cap logits."""
    b, t, h, d = query.shape
    kv_heads = key.shape[2]
    lse = lse.reshape(b, kv_heads, h // kv_heads, t)
    p = jnp.exp(logits - jnp.where(jnp.isneginf(lse), jnp.inf, lse)[..., None])
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    do = _grouped(d_out.astype(jnp.float32), kv_heads)
    dv = jnp.einsum("bkgts,btkgd->bskd", _dropped(p, drop, rate), do)
    dp = _dropped(jnp.einsum("btkgd,bskd->bkgts", do, value.astype(jnp.float32)), drop, rate)
    # sum_j p_ij dp_ij over all keys is the dot of the row's output and output gradient, dropout or not.
    delta = jnp.einsum("btkgd,btkgd->bkgt", do, _grouped(out.astype(jnp.float32), kv_heads))
    ds = p * (dp - delta[..., None])
    if logits_soft_cap is not None:
        ds = ds * (1.0 - jnp.tanh(raw / logits_soft_cap) ** 2)
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, key.astype(jnp.float32)).reshape(b, t, h, d) * scale
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, _grouped(query.astype(jnp.float32), kv_heads)) * scale
    return dq, dk, dv, ds


@backend.register("attention_with_lse", backend.REFERENCE)
def attention_with_lse_reference(query, key, value, q_segment_ids, kv_segment_ids, *, causal: bool, scale: float,
                                 logits_soft_cap: float | None):
    """The ``"xla"`` implementation of `attention_with_lse`."""
    logits, _ = _logits(query, key, scale, logits_soft_cap)
    return _block_forward(query, value, logits, _keep(query, key, q_segment_ids, kv_segment_ids, causal))


@backend.register("attention_with_lse_backward", backend.REFERENCE)
def attention_with_lse_backward_reference(query, key, value, q_segment_ids, kv_segment_ids, out, lse, d_out, *,
                                          causal: bool, scale: float, logits_soft_cap: float | None):
    """The ``"xla"`` implementation of `attention_with_lse_backward`."""
    logits, raw = _logits(query, key, scale, logits_soft_cap)
    keep = _keep(query, key, q_segment_ids, kv_segment_ids, causal)
    dq, dk, dv, _ = _block_backward(query, key, value, logits, raw, keep, out, lse, d_out, scale=scale,
                                    logits_soft_cap=logits_soft_cap)
    return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype)


def _pallas_unsupported(query, key, value, *args, **static) -> str | None:
    if not jnp.result_type(query) == jnp.result_type(key) == jnp.result_type(value):
        return "query, key and value of different dtypes"
    return flash_attention.unsupported(jnp.shape(query), jnp.shape(key), jnp.result_type(query))


@backend.register("attention_with_lse", "pallas_triton", requires=(backend.PALLAS_TRITON,),
                  unsupported=_pallas_unsupported, priority=10, single_device=True)
def _attention_with_lse_pallas(query, key, value, q_segment_ids, kv_segment_ids, *, causal, scale, logits_soft_cap):
    return flash_attention.flash_attention_forward(query, key, value, q_segment_ids, kv_segment_ids, scale=scale,
                                                   causal=causal, logits_soft_cap=logits_soft_cap,
                                                   interpret=kernel_interpret())


@backend.register("attention_with_lse_backward", "pallas_triton", requires=(backend.PALLAS_TRITON,),
                  unsupported=_pallas_unsupported, priority=10, single_device=True)
def _attention_with_lse_backward_pallas(query, key, value, q_segment_ids, kv_segment_ids, out, lse, d_out, *,
                                        causal, scale, logits_soft_cap):
    return flash_attention.flash_attention_backward(query, key, value, q_segment_ids, kv_segment_ids, out, lse, d_out,
                                                    scale=scale, causal=causal, logits_soft_cap=logits_soft_cap,
                                                    interpret=kernel_interpret())


@backend.register("attention_with_lse", "triton", requires=(backend.TRITON,), unsupported=_pallas_unsupported,
                  priority=9, single_device=True)
def _attention_with_lse_triton(query, key, value, q_segment_ids, kv_segment_ids, *, causal, scale, logits_soft_cap):
    from mtjax.kernels.triton import flash_attention as native

    return native.flash_attention_forward(query, key, value, q_segment_ids, kv_segment_ids, scale=scale,
                                          causal=causal, logits_soft_cap=logits_soft_cap)


@backend.register("attention_with_lse_backward", "triton", requires=(backend.TRITON,),
                  unsupported=_pallas_unsupported, priority=9, single_device=True)
def _attention_with_lse_backward_triton(query, key, value, q_segment_ids, kv_segment_ids, out, lse, d_out, *,
                                        causal, scale, logits_soft_cap):
    from mtjax.kernels.triton import flash_attention as native

    return native.flash_attention_backward(query, key, value, q_segment_ids, kv_segment_ids, out, lse, d_out,
                                           scale=scale, causal=causal, logits_soft_cap=logits_soft_cap)


def attention_with_lse(query: jax.Array, key: jax.Array, value: jax.Array, q_segment_ids: jax.Array | None = None,
                       kv_segment_ids: jax.Array | None = None, *, causal: bool = False, scale: float,
                       logits_soft_cap: float | None = None,
                       implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention of one key block: ``(out [batch, q_len, heads, head_dim], lse [batch, heads, q_len])``.

    Layout and masks as `mtjax.ops.attention` (``causal`` bottom-right aligned, segment ids with 0
    as padding). ``lse`` is the float32 natural-log ``logsumexp`` of each row's visible scaled
    logits, ``-inf`` where a row sees nothing (its output is zeros). Partial results over disjoint
    key blocks merge exactly by `merge_attention`. Not differentiable on its own: the gradient of
    merged blocks is the sum of `attention_with_lse_backward` over the blocks.
    """
    return backend.dispatch("attention_with_lse", query, key, value, q_segment_ids, kv_segment_ids,
                            implementation=implementation, causal=bool(causal), scale=float(scale),
                            logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap))


def attention_with_lse_backward(query: jax.Array, key: jax.Array, value: jax.Array, q_segment_ids: jax.Array | None,
                                kv_segment_ids: jax.Array | None, out: jax.Array, lse: jax.Array, d_out: jax.Array,
                                *, causal: bool = False, scale: float, logits_soft_cap: float | None = None,
                                implementation: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` of one key block given the *merged* ``out``, ``lse`` and the output gradient."""
    return backend.dispatch("attention_with_lse_backward", query, key, value, q_segment_ids, kv_segment_ids, out,
                            lse, d_out, implementation=implementation, causal=bool(causal), scale=float(scale),
                            logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap))


def merge_attention(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array,
                    lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merge two partial attentions of the same queries over disjoint key blocks (float32 result).

    ``out``: ``[batch, q_len, heads, head_dim]``, ``lse``: ``[batch, heads, q_len]``; a row with
    ``lse = -inf`` (no visible key) contributes nothing.
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)

    def weight(part):  # [b, h, t] -> [b, t, h, 1]
        return jnp.swapaxes(jnp.exp(part - safe), 1, 2)[..., None]

    out = out_a.astype(jnp.float32) * weight(lse_a) + out_b.astype(jnp.float32) * weight(lse_b)
    return out, lse


# --------------------------------------------------------------------------------------------------
# The blocks of one device against one key shard
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
    axis_name: str
    strategy: str
    causal: bool
    load_balanced: bool
    scale: float
    logits_soft_cap: float | None
    implementation: str | None
    window_size: tuple[int, int] | None = None
    dropout_rate: float = 0.0
    has_bias: bool = False
    batch_axes: tuple[str, ...] = ()  # mesh axes that split the batch / the heads inside the shard_map:
    head_axes: tuple[str, ...] = ()  # the dropout hash needs each row's global batch and head index

    def block_kwargs(self):
        return dict(scale=self.scale, logits_soft_cap=self.logits_soft_cap, implementation=self.implementation)

    @property
    def positional(self) -> bool:
        """A window, dropout or a bias: every block needs its tokens' global positions, and runs the
        XLA reference (the flash kernel's masks are static offsets within one block)."""
        return self.window_size is not None or self.dropout_rate > 0.0 or self.has_bias


def _half(x, which, axis=1):
    if x is None:
        return None
    n = x.shape[axis] // 2
    return lax.slice_in_dim(x, 0, n, axis=axis) if which == 0 else lax.slice_in_dim(x, n, 2 * n, axis=axis)


def _relation(src, me):
    """0: the key shard comes from an earlier device, 1: it is the local one, 2: from a later one."""
    return jnp.sign(src - me).astype(jnp.int32) + 1


def _shard_branches(cfg: _Config, full: Callable, diagonal: Callable, q_half: Callable, kv_half: Callable,
                    nothing: Callable) -> list[Callable]:
    """The three cases of `_relation`, each a thunk: what a query shard computes against a key shard."""
    if not cfg.causal:
        return [full, full, full]
    if cfg.load_balanced:
        return [kv_half, diagonal, q_half]
    return [full, diagonal, nothing]


def _step_forward(q, k, v, q_seg, kv_seg, src, me, cfg: _Config, bias=None, seed=None):
    """``(out f32, lse)`` of the local queries against the key shard of device ``src`` (``None``: the local one)."""
    if cfg.positional:
        src = me if src is None else src
        return _positional_forward(q, k, v, q_seg, kv_seg, _bias_block(bias, src, k.shape[1]), seed, src, me, cfg)
    kw = cfg.block_kwargs()
    b, t, h, d = q.shape
    empty_lse = jnp.full((b, h, t), -jnp.inf, jnp.float32)

    def full():
        out, lse = attention_with_lse(q, k, v, q_seg, kv_seg, causal=False, **kw)
        return out.astype(jnp.float32), lse

    def diagonal():
        out, lse = attention_with_lse(q, k, v, q_seg, kv_seg, causal=True, **kw)
        return out.astype(jnp.float32), lse

    def kv_half():  # an earlier device's shard: every query sees its first chunk
        out, lse = attention_with_lse(q, _half(k, 0), _half(v, 0), q_seg, _half(kv_seg, 0), causal=False, **kw)
        return out.astype(jnp.float32), lse

    def q_half():  # a later device's shard: the second query chunk sees all of it
        out, lse = attention_with_lse(_half(q, 1), k, v, _half(q_seg, 1), kv_seg, causal=False, **kw)
        zeros = jnp.zeros((b, t - out.shape[1], h, d), jnp.float32)
        return jnp.concatenate([zeros, out.astype(jnp.float32)], 1), jnp.concatenate([empty_lse[..., :t // 2], lse], -1)

    def nothing():
        return jnp.zeros((b, t, h, v.shape[-1]), jnp.float32), empty_lse

    return _select(_shard_branches(cfg, full, diagonal, q_half, kv_half, nothing), src, me, cfg)


def _select(branches, src, me, cfg: _Config):
    """Run the branch of `_relation` (``src`` None: the local shard, known statically)."""
    if src is None:
        return branches[1]()
    if not cfg.causal:
        return branches[0]()
    if cfg.strategy == "ring":  # a ring step after the first never holds the local shard
        return lax.cond(src < me, branches[0], branches[2])
    return lax.switch(_relation(src, me), branches)


def _step_backward(q, k, v, q_seg, kv_seg, out, lse, do, src, me, cfg: _Config, bias=None, seed=None):
    """``(dq, dk, dv, dbias)`` (float32) of the local queries against the key shard of device ``src``
    (``dbias``: the bias gradient's columns of that shard, None without a bias)."""
    if cfg.positional:
        src = me if src is None else src
        return _positional_backward(q, k, v, q_seg, kv_seg, _bias_block(bias, src, k.shape[1]), seed, out, lse, do,
                                    src, me, cfg)
    kw = cfg.block_kwargs()
    f32 = functools.partial(jax.tree.map, lambda x: x.astype(jnp.float32))

    def block(q_, k_, v_, q_seg_, kv_seg_, out_, lse_, do_, causal):
        return f32(attention_with_lse_backward(q_, k_, v_, q_seg_, kv_seg_, out_, lse_, do_, causal=causal, **kw))

    def full():
        return block(q, k, v, q_seg, kv_seg, out, lse, do, False)

    def diagonal():
        return block(q, k, v, q_seg, kv_seg, out, lse, do, True)

    def kv_half():
        dq, dk, dv = block(q, _half(k, 0), _half(v, 0), q_seg, _half(kv_seg, 0), out, lse, do, False)
        return dq, jnp.concatenate([dk, jnp.zeros_like(dk)], 1), jnp.concatenate([dv, jnp.zeros_like(dv)], 1)

    def q_half():
        dq, dk, dv = block(_half(q, 1), k, v, _half(q_seg, 1), kv_seg, _half(out, 1), _half(lse, 1, axis=2),
                           _half(do, 1), False)
        return jnp.concatenate([jnp.zeros_like(dq), dq], 1), dk, dv

    def nothing():
        return f32((jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)))

    return (*_select(_shard_branches(cfg, full, diagonal, q_half, kv_half, nothing), src, me, cfg), None)


# --------------------------------------------------------------------------------------------------
# Blocks with a window, dropout or a bias: masks from the tokens' global positions
# --------------------------------------------------------------------------------------------------


def _positions(device, length: int, cfg: _Config):
    """Natural-order positions ``[length]`` of the tokens of ``device``'s sequence shard."""
    if cfg.causal and cfg.load_balanced:
        n, half = lax.axis_size(cfg.axis_name), length // 2
        return jnp.concatenate([device * half + jnp.arange(half), (2 * n - 1 - device) * half + jnp.arange(half)])
    return device * length + jnp.arange(length)


def _index_over(axis_names: tuple[str, ...]):
    """This device's linear index over ``axis_names`` (the first the most significant) and their size."""
    index, size = 0, 1
    for name in axis_names:
        index = index * lax.axis_size(name) + lax.axis_index(name)
        size = size * lax.axis_size(name)
    return index, size


def _bias_block(bias, src, length: int):
    """The columns of key shard ``src`` of this shard's bias rows ``[b|1, h|1, q_len, cp * length]``."""
    return None if bias is None else lax.dynamic_slice_in_dim(bias, src * length, length, axis=3)


def _grouped_bias(bias, kv_heads: int):
    """``[b|1, h|1, t, s]`` as ``[b|1, kv_heads|1, groups|1, t, s]`` (f32)."""
    b, h, t, s = bias.shape
    bias = bias.astype(jnp.float32)
    return bias[:, :, None] if h == 1 else bias.reshape(b, kv_heads, h // kv_heads, t, s)


def _positional_logits(q, k, q_seg, kv_seg, bias, seed, src, me, cfg: _Config):
    """``(logits, raw, keep, drop)`` of the local queries against key shard ``src`` (grouped layout)."""
    b, t, h, _ = q.shape
    kv_heads, length = k.shape[2], k.shape[1]
    q_pos, kv_pos = _positions(me, t, cfg), _positions(src, length, cfg)
    bias = None if bias is None else _grouped_bias(bias, kv_heads)
    logits, raw = _logits(q, k, cfg.scale, cfg.logits_soft_cap, bias)
    keep = _keep(q, k, q_seg, kv_seg, False)
    visible = jnp.ones((t, length), bool)
    if cfg.causal:
        visible &= kv_pos[None, :] <= q_pos[:, None]
    if cfg.window_size is not None:
        left, right = cfg.window_size
        if left >= 0:
            visible &= kv_pos[None, :] >= q_pos[:, None] - left
        if right >= 0:
            visible &= kv_pos[None, :] <= q_pos[:, None] + right
    keep = visible if keep is None else keep & visible
    drop = None
    if cfg.dropout_rate > 0.0:
        # The hash of `mtjax.ops.attention`'s dropout at the global (batch, head, query, key):
        # the same mask as the unsharded op's with the same seed.
        b0, batch_ways = _index_over(cfg.batch_axes)
        h0, head_ways = _index_over(cfg.head_axes)
        heads, seq = h * head_ways, t * lax.axis_size(cfg.axis_name)
        rows = (((b0 * b + jnp.arange(b)).astype(jnp.uint32)[:, None] * np.uint32(heads)
                 + (h0 * h + jnp.arange(h)).astype(jnp.uint32)[None, :])[:, :, None] * np.uint32(seq)
                + q_pos.astype(jnp.uint32)[None, None, :])
        drop = dropout_keep(seed, rows[..., None], kv_pos[None, None, None, :], cfg.dropout_rate)
        drop = drop.reshape(b, kv_heads, h // kv_heads, t, length)
    return logits, raw, keep, drop


def _positional_forward(q, k, v, q_seg, kv_seg, bias, seed, src, me, cfg: _Config):
    logits, _, keep, drop = _positional_logits(q, k, q_seg, kv_seg, bias, seed, src, me, cfg)
    out, lse = _block_forward(q, v, logits, keep, drop, cfg.dropout_rate)
    return out.astype(jnp.float32), lse


def _positional_backward(q, k, v, q_seg, kv_seg, bias, seed, out, lse, do, src, me, cfg: _Config):
    """``(dq, dk, dv, dbias)`` (float32; ``dbias`` None without a bias, else the block's columns)."""
    logits, raw, keep, drop = _positional_logits(q, k, q_seg, kv_seg, bias, seed, src, me, cfg)
    dq, dk, dv, ds = _block_backward(q, k, v, logits, raw, keep, out, lse, do, scale=cfg.scale,
                                     logits_soft_cap=cfg.logits_soft_cap, drop=drop, rate=cfg.dropout_rate)
    if bias is None:
        return dq, dk, dv, None
    b, t, h, _ = q.shape
    dbias = ds.reshape(b, h, t, k.shape[1])
    return dq, dk, dv, jnp.sum(dbias, axis=tuple(i for i in (0, 1) if bias.shape[i] == 1), keepdims=True)


# --------------------------------------------------------------------------------------------------
# The strategies (per shard, inside shard_map), forward and backward
# --------------------------------------------------------------------------------------------------


def _ring_perm(n):
    return [(j, (j + 1) % n) for j in range(n)]


def _ppermute(tree, axis_name, perm):
    return jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), tree)


def _gather_shards(cfg: _Config, k, v, kv_seg):
    """The all-gathered key/value shards ``[cp, batch, shard_len, ...]`` (``kv_seg`` may be ``None``)."""
    n = lax.axis_size(cfg.axis_name)
    return jax.tree.map(lambda x: lax.all_gather(x, cfg.axis_name, axis=0).reshape((n,) + x.shape), (k, v, kv_seg))


def _forward(q, k, v, q_seg, kv_seg, bias, seed, cfg: _Config):
    n, me = lax.axis_size(cfg.axis_name), lax.axis_index(cfg.axis_name)
    if cfg.strategy == "all_gather":
        shards = _gather_shards(cfg, k, v, kv_seg)

        def body(carry, xs):
            (k_j, v_j, kv_seg_j), j = xs
            part = _step_forward(q, k_j, v_j, q_seg, kv_seg_j, j, me, cfg, bias, seed)
            return merge_attention(*carry, *part), None

        empty = (jnp.zeros(q.shape[:3] + (v.shape[-1],), jnp.float32),
                 jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, jnp.float32))
        (out, lse), _ = lax.scan(body, empty, (shards, jnp.arange(n)))
        return out.astype(q.dtype), lse
    # The ring: step 0 attends the local shard; each later step first sends the shard it holds on
    # to the next device (so XLA can overlap the transfer with this step's attention), then
    # attends it. The shard held at step s came from device me - s.
    perm = _ring_perm(n)
    out, lse = _step_forward(q, k, v, q_seg, kv_seg, None, me, cfg, bias, seed)

    def body(carry, step):
        kv, out, lse = carry
        kv = _ppermute(kv, cfg.axis_name, perm)
        part = _step_forward(q, kv[0], kv[1], q_seg, kv[2], (me - step) % n, me, cfg, bias, seed)
        return (kv, *merge_attention(out, lse, *part)), None

    (_, out, lse), _ = lax.scan(body, ((k, v, kv_seg), out, lse), jnp.arange(1, n))
    return out.astype(q.dtype), lse


def _add_bias_columns(dbias, block, src):
    """``dbias`` with the columns of key shard ``src`` set to ``block`` (None without a bias)."""
    return None if dbias is None else lax.dynamic_update_slice_in_dim(dbias, block, src * block.shape[3], axis=3)


def _backward(q, k, v, q_seg, kv_seg, bias, seed, out, lse, do, cfg: _Config):
    n, me = lax.axis_size(cfg.axis_name), lax.axis_index(cfg.axis_name)
    dbias = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
    if cfg.strategy == "all_gather":
        shards = _gather_shards(cfg, k, v, kv_seg)

        def body(carry, xs):
            dq, dbias = carry
            (k_j, v_j, kv_seg_j), j = xs
            dq_j, dk_j, dv_j, dbias_j = _step_backward(q, k_j, v_j, q_seg, kv_seg_j, out, lse, do, j, me, cfg, bias,
                                                       seed)
            return (dq + dq_j, _add_bias_columns(dbias, dbias_j, j)), (dk_j, dv_j)

        (dq, dbias), (dks, dvs) = lax.scan(body, (jnp.zeros(q.shape, jnp.float32), dbias), (shards, jnp.arange(n)))
        # [cp, batch, shard_len, ...]: each device's gradient of every shard, summed onto its owner.
        dk, dv = (lax.psum_scatter(d, cfg.axis_name, scatter_dimension=0, tiled=True)[0] for d in (dks, dvs))
        return dq, dk, dv, dbias
    # The ring: the key/value gradients ride along with their shard and reach its owner after n hops.
    perm = _ring_perm(n)
    dq, dk, dv, dbias_0 = _step_backward(q, k, v, q_seg, kv_seg, out, lse, do, None, me, cfg, bias, seed)
    dbias = _add_bias_columns(dbias, dbias_0, me)

    def body(carry, step):
        kv, dq, dkv, dbias = carry
        src = (me - step) % n
        kv = _ppermute(kv, cfg.axis_name, perm)
        dkv = _ppermute(dkv, cfg.axis_name, perm)
        dq_s, dk_s, dv_s, dbias_s = _step_backward(q, kv[0], kv[1], q_seg, kv[2], out, lse, do, src, me, cfg, bias,
                                                   seed)
        return (kv, dq + dq_s, (dkv[0] + dk_s, dkv[1] + dv_s), _add_bias_columns(dbias, dbias_s, src)), None

    (_, dq, dkv, dbias), _ = lax.scan(body, ((k, v, kv_seg), dq, (dk, dv), dbias), jnp.arange(1, n))
    return dq, *_ppermute(dkv, cfg.axis_name, perm), dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k, v, q_seg, kv_seg, bias, seed, cfg: _Config):
    return _forward(q, k, v, q_seg, kv_seg, bias, seed, cfg)[0]


def _attention_fwd(q, k, v, q_seg, kv_seg, bias, seed, cfg: _Config):
    out, lse = _forward(q, k, v, q_seg, kv_seg, bias, seed, cfg)
    return out, (q, k, v, q_seg, kv_seg, bias, seed, out, lse)


def _attention_bwd(cfg: _Config, residuals, do):
    q, k, v, q_seg, kv_seg, bias, seed, out, lse = residuals
    dq, dk, dv, dbias = _backward(q, k, v, q_seg, kv_seg, bias, seed, out, lse, do, cfg)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None,
            None if bias is None else dbias.astype(bias.dtype), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


_PER_SHARD_ARGS = """
    Args:
      query, key, value: this device's shards ``[batch, shard_len, heads | kv_heads, head_dim]``
        of one sequence split over ``axis_name`` (in the load-balanced layout when
        ``load_balanced`` and the mask is causal; see the module docstring).
      mask_type: ``"no_mask"``, ``"padding"``, ``"causal"`` or ``"padding_causal"``.
      q_segment_ids, kv_segment_ids: this shard's ``[batch, shard_len]`` ids (0: padding); the same
        array for self-attention.
      scale: logit scale, default ``1 / sqrt(head_dim)``.
      logits_soft_cap: ``cap * tanh(logits / cap)`` (after the bias).
      load_balanced: the shards hold the two mirrored chunks of `reorder_causal_load_balancing`.
      implementation: of the per-block `attention_with_lse` (``"xla"``, ``"pallas_triton"``).
      bias: this shard's rows of the additive bias of the whole sequence, ``[batch|1, heads|1,
        shard_len, cp * shard_len]``, rows and columns in the sequence's layout (differentiable).
      window_size: sliding window ``(left, right)`` over the tokens' positions, ``-1`` unbounded.
      dropout_rate, dropout_rng: attention-probability dropout; the mask is `mtjax.ops.attention`'s
        (a hash of seed, batch, head, query and key position), the same as the unsharded op's when
        ``batch_axes`` / ``head_axes`` name the mesh axes that split the batch and the heads.
      With a bias, a window or dropout every block runs the XLA reference: the masks depend on each
      block's global positions, which the flash kernel's static masks do not express.
    Returns:
      ``[batch, shard_len, heads, head_dim]`` in ``query.dtype``: this shard's rows of the
      attention over the whole sequence.
"""


def _per_shard_function(strategy: str, summary: str) -> Callable[..., jax.Array]:
    """The per-shard attention of ``strategy`` (`ring_attention`, `all_gather_attention`)."""

    def attention(query: jax.Array, key: jax.Array, value: jax.Array, *, axis_name: str = "cp",
                  mask_type: str = "causal", q_segment_ids: jax.Array | None = None,
                  kv_segment_ids: jax.Array | None = None, scale: float | None = None,
                  logits_soft_cap: float | None = None, load_balanced: bool = True,
                  implementation: str | None = None, bias: jax.Array | None = None,
                  window_size: tuple[int, int] | None = None, dropout_rate: float = 0.0,
                  dropout_rng: jax.Array | None = None, batch_axes: tuple[str, ...] = (),
                  head_axes: tuple[str, ...] = ()) -> jax.Array:
        op = f"{strategy}_attention"
        check_choice(op, "mask_type", mask_type, CONTEXT_PARALLEL_MASK_TYPES)
        if query.ndim != 4 or key.ndim != 4 or key.shape != value.shape[:3] + key.shape[3:]:
            raise ValueError(f"{op}: query {query.shape}, key {key.shape}, value {value.shape}; expected BTNH arrays")
        if query.shape[1] != key.shape[1]:
            raise ValueError(f"{op}: query and key shards must have the same length (self-attention over one "
                             f"sequence); got {query.shape[1]} and {key.shape[1]}")
        if (q_segment_ids is None) != (kv_segment_ids is None):
            raise ValueError(f"{op}: pass q_segment_ids and kv_segment_ids together")
        if mask_type in ("padding", "padding_causal") and q_segment_ids is None:
            raise ValueError(f"{op}: mask_type={mask_type!r} needs q/kv_segment_ids")
        causal = mask_type in ("causal", "padding_causal")
        if causal and load_balanced and query.shape[1] % 2:
            raise ValueError(f"{op}: load_balanced=True needs an even shard length (two chunks); got {query.shape[1]}")
        b, t, h, _ = query.shape
        if bias is not None:
            columns = t * lax.axis_size(axis_name)
            if (jnp.ndim(bias) != 4 or bias.shape[0] not in (1, b) or bias.shape[1] not in (1, h)
                    or bias.shape[2:] != (t, columns)):
                raise ValueError(f"{op}: bias has shape {jnp.shape(bias)}; expected this shard's rows of the whole "
                                 f"sequence's bias, [{b}|1, {h}|1, {t}, {columns}]")
            if not jnp.issubdtype(bias.dtype, jnp.floating):
                raise TypeError(f"{op}: bias must be a float array; got {bias.dtype}")
        if window_size is not None:
            window_size = tuple(int(w) for w in window_size)
            if len(window_size) != 2 or min(window_size) < -1:
                raise ValueError(f"{op}: window_size={window_size}; expected (left, right) with -1 for unbounded")
        if not 0.0 <= dropout_rate < 1.0:
            raise ValueError(f"{op}: dropout_rate={dropout_rate}; expected 0 <= dropout_rate < 1")
        if dropout_rate > 0.0 and dropout_rng is None:
            raise ValueError(f"{op}: dropout_rate={dropout_rate} needs dropout_rng")
        cfg = _Config(axis_name=axis_name, strategy=strategy, causal=causal, load_balanced=bool(load_balanced),
                      scale=float(query.shape[-1] ** -0.5 if scale is None else scale),
                      logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
                      implementation=implementation, window_size=window_size, dropout_rate=float(dropout_rate),
                      has_bias=bias is not None, batch_axes=tuple(batch_axes), head_axes=tuple(head_axes))
        if cfg.positional and implementation not in (None, backend.REFERENCE):
            raise ValueError(f"{op}: implementation={implementation!r}: with a window, dropout or a bias every block "
                             f"runs the XLA reference (implementation=None or {backend.REFERENCE!r})")
        seed = jax.random.bits(dropout_rng, (), jnp.uint32) if dropout_rate > 0.0 else None
        return _attention(query, key, value, q_segment_ids, kv_segment_ids, bias, seed, cfg)

    attention.__name__ = attention.__qualname__ = f"{strategy}_attention"
    attention.__doc__ = summary + "\n" + _PER_SHARD_ARGS
    return attention


ring_attention = _per_shard_function(
    "ring", "Ring attention of this device's sequence shard (call inside ``shard_map``, ``axis_name`` manual).")
all_gather_attention = _per_shard_function(
    "all_gather", "As `ring_attention`, with the key/value shards all-gathered once (gradients reduce-scattered).")
_PER_SHARD_ATTENTION = {"ring": ring_attention, "all_gather": all_gather_attention}


def _spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one `PartitionSpec` entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def context_parallel_attention(query: jax.Array, key: jax.Array, value: jax.Array, *, strategy: str = "ring",
                               q_spec: P, kv_spec: P, axis_name: str = "cp", mask_type: str = "causal",
                               q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
                               scale: float | None = None, logits_soft_cap: float | None = None,
                               load_balanced: bool = True, implementation: str | None = None,
                               bias: jax.Array | None = None, window_size: tuple[int, int] | None = None,
                               dropout_rate: float = 0.0, dropout_rng: jax.Array | None = None) -> jax.Array:
    """`ring_attention` / `all_gather_attention` of global arrays under the current mesh (``jax.set_mesh``).

    The ``shard_map`` is manual over every mesh axis, so the per-block kernel runs on each
    device's own piece (batch and heads split as the specs say, as well as the sequence).

    Args:
      strategy: ``"ring"`` or ``"all_gather"``.
      q_spec, kv_spec: `PartitionSpec` of ``query`` and ``key``/``value`` (``[batch, length, heads,
        head_dim]``); the length must be split over ``axis_name`` alone.
      bias: ``[batch|1, heads|1, length, length]``, rows and columns in the layout of ``query``
        and ``key`` (load-balanced where they are); split like the queries' rows.
      window_size, dropout_rate, dropout_rng: as `mtjax.ops.attention` (the same dropout mask).
      Others: as `ring_attention`.
    """
    check_choice("context_parallel_attention", "strategy", strategy, CONTEXT_PARALLEL_STRATEGIES)
    q_spec, kv_spec = (P(*spec, *([None] * (4 - len(spec)))) for spec in (q_spec, kv_spec))
    for name, spec in (("q_spec", q_spec), ("kv_spec", kv_spec)):
        if spec[1] not in (axis_name, (axis_name,)):
            raise ValueError(f"context_parallel_attention: {name}={spec} must split the length (dimension 1) over "
                             f"{axis_name!r} alone")
    if q_spec[0] != kv_spec[0]:
        raise ValueError(f"context_parallel_attention: q_spec {q_spec} and kv_spec {kv_spec} split the batch "
                         f"differently")
    if bias is not None and (jnp.ndim(bias) != 4 or bias.shape[0] not in (1, query.shape[0])
                             or bias.shape[1] not in (1, query.shape[2])
                             or bias.shape[2:] != (query.shape[1], key.shape[1])):
        raise ValueError(f"context_parallel_attention: bias has shape {jnp.shape(bias)}; expected "
                         f"[{query.shape[0]}|1, {query.shape[2]}|1, {query.shape[1]}, {key.shape[1]}]")
    seg_spec = P(q_spec[0], q_spec[1])
    # Manual over every axis not already manual (e.g. ``pp`` inside a pipeline stage): the arrays
    # are replicated over the axes the specs leave out.
    mesh = get_abstract_mesh()
    manual = {name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind != AxisType.Manual}
    fn = functools.partial(_PER_SHARD_ATTENTION[strategy], axis_name=axis_name, mask_type=mask_type, scale=scale,
                           logits_soft_cap=logits_soft_cap, load_balanced=load_balanced, implementation=implementation,
                           window_size=window_size, dropout_rate=dropout_rate,
                           batch_axes=_spec_axes(q_spec[0]), head_axes=_spec_axes(q_spec[2]))

    def per_device(q, k, v, q_seg, kv_seg, bias, rng):
        return fn(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, bias=bias, dropout_rng=rng)

    segs = (q_segment_ids, kv_segment_ids)
    seg_specs = tuple(None if s is None else seg_spec for s in segs)
    bias_spec = None if bias is None else P(q_spec[0] if bias.shape[0] > 1 else None,
                                            q_spec[2] if bias.shape[1] > 1 else None, q_spec[1], None)
    rng = dropout_rng if dropout_rate > 0.0 else None
    # check_vma=False: the per-block kernels' outputs do not declare how they vary over manual axes.
    return jax.shard_map(per_device, axis_names=manual, check_vma=False,
                         in_specs=(q_spec, kv_spec, kv_spec, *seg_specs, bias_spec, None if rng is None else P()),
                         out_specs=q_spec)(query, key, value, *segs, bias, rng)
