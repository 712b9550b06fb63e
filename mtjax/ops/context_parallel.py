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
from jax import lax
from jax.sharding import AxisType, get_abstract_mesh
from jax.sharding import PartitionSpec as P

from mtjax import backend
from mtjax.kernels import flash_attention
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


def _logits(q, k, scale, soft_cap):
    """Scaled (soft-capped) f32 logits ``[batch, kv_heads, groups, q_len, kv_len]`` and the raw ones."""
    s = jnp.einsum("btkgd,bskd->bkgts", _grouped(q, k.shape[2]), k, preferred_element_type=jnp.float32) * scale
    return (s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)), s


def _keep(q, k, q_seg, kv_seg, causal):
    keep = combined_mask(q.shape[1], k.shape[1], mask=None, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                         mask_type="causal" if causal else "no_mask", window_size=None)
    return None if keep is None else keep[:, :, None]  # [b|1, 1, 1, t, s]


@backend.register("attention_with_lse", backend.REFERENCE)
def attention_with_lse_reference(query, key, value, q_segment_ids, kv_segment_ids, *, causal: bool, scale: float,
                                 logits_soft_cap: float | None):
    """The ``"xla"`` implementation of `attention_with_lse`."""
    b, t, h, _ = query.shape
    logits, _ = _logits(query, key, scale, logits_soft_cap)
    keep = _keep(query, key, q_segment_ids, kv_segment_ids, causal)
    if keep is not None:
        logits = jnp.where(keep, logits, -jnp.inf)
    lse = jnp.max(logits, axis=-1)
    lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    p = jnp.exp(logits - lse_safe[..., None])
    total = jnp.sum(p, axis=-1)
    lse = jnp.where(total > 0, lse_safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    p = p / jnp.where(total > 0, total, 1.0)[..., None]
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(value.dtype), value, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, value.shape[-1]).astype(query.dtype), lse.reshape(b, h, t)


@backend.register("attention_with_lse_backward", backend.REFERENCE)
def attention_with_lse_backward_reference(query, key, value, q_segment_ids, kv_segment_ids, out, lse, d_out, *,
                                          causal: bool, scale: float, logits_soft_cap: float | None):
    """The ``"xla"`` implementation of `attention_with_lse_backward`."""
    b, t, h, d = query.shape
    kv_heads = key.shape[2]
    logits, raw = _logits(query, key, scale, logits_soft_cap)
    lse = lse.reshape(b, kv_heads, h // kv_heads, t)
    p = jnp.exp(logits - jnp.where(jnp.isneginf(lse), jnp.inf, lse)[..., None])
    keep = _keep(query, key, q_segment_ids, kv_segment_ids, causal)
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    do = _grouped(d_out.astype(jnp.float32), kv_heads)
    dv = jnp.einsum("bkgts,btkgd->bskd", p, do)
    dp = jnp.einsum("btkgd,bskd->bkgts", do, value.astype(jnp.float32))
    delta = jnp.einsum("btkgd,btkgd->bkgt", do, _grouped(out.astype(jnp.float32), kv_heads))
    ds = p * (dp - delta[..., None])
    if logits_soft_cap is not None:
        ds = ds * (1.0 - jnp.tanh(raw / logits_soft_cap) ** 2)
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, key.astype(jnp.float32)).reshape(b, t, h, d) * scale
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, _grouped(query.astype(jnp.float32), kv_heads)) * scale
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

    def block_kwargs(self):
        return dict(scale=self.scale, logits_soft_cap=self.logits_soft_cap, implementation=self.implementation)


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


def _step_forward(q, k, v, q_seg, kv_seg, src, me, cfg: _Config):
    """``(out f32, lse)`` of the local queries against the key shard of device ``src`` (``None``: the local one)."""
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


def _step_backward(q, k, v, q_seg, kv_seg, out, lse, do, src, me, cfg: _Config):
    """``(dq, dk, dv)`` (float32) of the local queries against the key shard of device ``src``."""
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

    return _select(_shard_branches(cfg, full, diagonal, q_half, kv_half, nothing), src, me, cfg)


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


def _forward(q, k, v, q_seg, kv_seg, cfg: _Config):
    n, me = lax.axis_size(cfg.axis_name), lax.axis_index(cfg.axis_name)
    if cfg.strategy == "all_gather":
        shards = _gather_shards(cfg, k, v, kv_seg)

        def body(carry, xs):
            (k_j, v_j, kv_seg_j), j = xs
            part = _step_forward(q, k_j, v_j, q_seg, kv_seg_j, j, me, cfg)
            return merge_attention(*carry, *part), None

        empty = (jnp.zeros(q.shape[:3] + (v.shape[-1],), jnp.float32),
                 jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, jnp.float32))
        (out, lse), _ = lax.scan(body, empty, (shards, jnp.arange(n)))
        return out.astype(q.dtype), lse
    # The ring: step 0 attends the local shard; each later step first sends the shard it holds on
    # to the next device (so XLA can overlap the transfer with this step's attention), then
    # attends it. The shard held at step s came from device me - s.
    perm = _ring_perm(n)
    out, lse = _step_forward(q, k, v, q_seg, kv_seg, None, me, cfg)

    def body(carry, step):
        kv, out, lse = carry
        kv = _ppermute(kv, cfg.axis_name, perm)
        part = _step_forward(q, kv[0], kv[1], q_seg, kv[2], (me - step) % n, me, cfg)
        return (kv, *merge_attention(out, lse, *part)), None

    (_, out, lse), _ = lax.scan(body, ((k, v, kv_seg), out, lse), jnp.arange(1, n))
    return out.astype(q.dtype), lse


def _backward(q, k, v, q_seg, kv_seg, out, lse, do, cfg: _Config):
    n, me = lax.axis_size(cfg.axis_name), lax.axis_index(cfg.axis_name)
    if cfg.strategy == "all_gather":
        shards = _gather_shards(cfg, k, v, kv_seg)

        def body(dq, xs):
            (k_j, v_j, kv_seg_j), j = xs
            dq_j, dk_j, dv_j = _step_backward(q, k_j, v_j, q_seg, kv_seg_j, out, lse, do, j, me, cfg)
            return dq + dq_j, (dk_j, dv_j)

        dq, (dks, dvs) = lax.scan(body, jnp.zeros(q.shape, jnp.float32), (shards, jnp.arange(n)))
        # [cp, batch, shard_len, ...]: each device's gradient of every shard, summed onto its owner.
        dk, dv = (lax.psum_scatter(d, cfg.axis_name, scatter_dimension=0, tiled=True)[0] for d in (dks, dvs))
        return dq, dk, dv
    # The ring: the key/value gradients ride along with their shard and reach its owner after n hops.
    perm = _ring_perm(n)
    dq, dk, dv = _step_backward(q, k, v, q_seg, kv_seg, out, lse, do, None, me, cfg)

    def body(carry, step):
        kv, dq, dkv = carry
        kv = _ppermute(kv, cfg.axis_name, perm)
        dkv = _ppermute(dkv, cfg.axis_name, perm)
        dq_s, dk_s, dv_s = _step_backward(q, kv[0], kv[1], q_seg, kv[2], out, lse, do, (me - step) % n, me, cfg)
        return (kv, dq + dq_s, (dkv[0] + dk_s, dkv[1] + dv_s)), None

    (_, dq, dkv), _ = lax.scan(body, ((k, v, kv_seg), dq, (dk, dv)), jnp.arange(1, n))
    return dq, *_ppermute(dkv, cfg.axis_name, perm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, q_seg, kv_seg, cfg: _Config):
    return _forward(q, k, v, q_seg, kv_seg, cfg)[0]


def _attention_fwd(q, k, v, q_seg, kv_seg, cfg: _Config):
    out, lse = _forward(q, k, v, q_seg, kv_seg, cfg)
    return out, (q, k, v, q_seg, kv_seg, out, lse)


def _attention_bwd(cfg: _Config, residuals, do):
    q, k, v, q_seg, kv_seg, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, q_seg, kv_seg, out, lse, do, cfg)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _per_shard(strategy: str, query, key, value, *, axis_name: str, mask_type: str, q_segment_ids, kv_segment_ids,
               scale: float | None, logits_soft_cap: float | None, load_balanced: bool,
               implementation: str | None) -> jax.Array:
    op = f"{strategy}_attention"
    check_choice(op, "mask_type", mask_type, CONTEXT_PARALLEL_MASK_TYPES)
    if query.ndim != 4 or key.ndim != 4 or key.shape != value.shape[:3] + key.shape[3:]:
        raise ValueError(f"{op}: query {query.shape}, key {key.shape}, value {value.shape}; expected BTNH arrays")
    if query.shape[1] != key.shape[1]:
        raise ValueError(f"{op}: query and key shards must have the same length (self-attention over one sequence); "
                         f"got {query.shape[1]} and {key.shape[1]}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(f"{op}: pass q_segment_ids and kv_segment_ids together")
    if mask_type in ("padding", "padding_causal") and q_segment_ids is None:
        raise ValueError(f"{op}: mask_type={mask_type!r} needs q/kv_segment_ids")
    causal = mask_type in ("causal", "padding_causal")
    if causal and load_balanced and query.shape[1] % 2:
        raise ValueError(f"{op}: load_balanced=True needs an even shard length (two chunks); got {query.shape[1]}")
    cfg = _Config(axis_name=axis_name, strategy=strategy, causal=causal, load_balanced=bool(load_balanced),
                  scale=float(query.shape[-1] ** -0.5 if scale is None else scale),
                  logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
                  implementation=implementation)
    return _attention(query, key, value, q_segment_ids, kv_segment_ids, cfg)


def ring_attention(query: jax.Array, key: jax.Array, value: jax.Array, *, axis_name: str = "cp",
                   mask_type: str = "causal", q_segment_ids: jax.Array | None = None,
                   kv_segment_ids: jax.Array | None = None, scale: float | None = None,
                   logits_soft_cap: float | None = None, load_balanced: bool = True,
                   implementation: str | None = None) -> jax.Array:
    """Ring attention of this device's sequence shard (call inside ``shard_map``, ``axis_name`` manual).

    Args:
      query, key, value: this device's shards ``[batch, shard_len, heads | kv_heads, head_dim]``
        of one sequence split over ``axis_name`` (in the load-balanced layout when
        ``load_balanced`` and the mask is causal; see the module docstring).
      mask_type: ``"no_mask"``, ``"padding"``, ``"causal"`` or ``"padding_causal"``.
      q_segment_ids, kv_segment_ids: this shard's ``[batch, shard_len]`` ids (0: padding); the same
        array for self-attention.
      scale: logit scale, default ``1 / sqrt(head_dim)``.
      logits_soft_cap: ``cap * tanh(logits / cap)``.
      load_balanced: the shards hold the two mirrored chunks of `reorder_causal_load_balancing`.
      implementation: of the per-block `attention_with_lse` (``"xla"``, ``"pallas_triton"``).
    Returns:
      ``[batch, shard_len, heads, head_dim]`` in ``query.dtype``: this shard's rows of the
      attention over the whole sequence.
    """
    return _per_shard("ring", query, key, value, axis_name=axis_name, mask_type=mask_type,
                      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, scale=scale,
                      logits_soft_cap=logits_soft_cap, load_balanced=load_balanced, implementation=implementation)


def all_gather_attention(query: jax.Array, key: jax.Array, value: jax.Array, *, axis_name: str = "cp",
                         mask_type: str = "causal", q_segment_ids: jax.Array | None = None,
                         kv_segment_ids: jax.Array | None = None, scale: float | None = None,
                         logits_soft_cap: float | None = None, load_balanced: bool = True,
                         implementation: str | None = None) -> jax.Array:
    """As `ring_attention`, with the key/value shards all-gathered once (gradients reduce-scattered)."""
    return _per_shard("all_gather", query, key, value, axis_name=axis_name, mask_type=mask_type,
                      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, scale=scale,
                      logits_soft_cap=logits_soft_cap, load_balanced=load_balanced, implementation=implementation)


def context_parallel_attention(query: jax.Array, key: jax.Array, value: jax.Array, *, strategy: str = "ring",
                               q_spec: P, kv_spec: P, axis_name: str = "cp", mask_type: str = "causal",
                               q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
                               scale: float | None = None, logits_soft_cap: float | None = None,
                               load_balanced: bool = True, implementation: str | None = None) -> jax.Array:
    """`ring_attention` / `all_gather_attention` of global arrays under the current mesh (``jax.set_mesh``).

    The ``shard_map`` is manual over every mesh axis, so the per-block kernel runs on each
    device's own piece (batch and heads split as the specs say, as well as the sequence).

    Args:
      strategy: ``"ring"`` or ``"all_gather"``.
      q_spec, kv_spec: `PartitionSpec` of ``query`` and ``key``/``value`` (``[batch, length, heads,
        head_dim]``); the length must be split over ``axis_name`` alone.
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
    seg_spec = P(q_spec[0], q_spec[1])
    # Manual over every axis not already manual (e.g. ``pp`` inside a pipeline stage): the arrays
    # are replicated over the axes the specs leave out.
    mesh = get_abstract_mesh()
    manual = {name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind != AxisType.Manual}
    fn = functools.partial(_per_shard, strategy, axis_name=axis_name, mask_type=mask_type, scale=scale,
                           logits_soft_cap=logits_soft_cap, load_balanced=load_balanced, implementation=implementation)

    def per_device(q, k, v, q_seg, kv_seg):
        return fn(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg)

    segs = (q_segment_ids, kv_segment_ids)
    seg_specs = tuple(None if s is None else seg_spec for s in segs)
    # check_vma=False: the per-block kernels' outputs do not declare how they vary over manual axes.
    return jax.shard_map(per_device, axis_names=manual, check_vma=False,
                         in_specs=(q_spec, kv_spec, kv_spec) + seg_specs, out_specs=q_spec)(query, key, value, *segs)
