"""paged_attention: the reference against dense attention, the Pallas kernel (interpret mode) against
the reference, argument errors, and the Triton lowering for an abstract H200."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import ops


def make_case(seed, *, lengths, q_len=1, kv_heads=2, groups=2, head_dim=16, page_size=4, pages_per_seq=None,
              extra_pages=3, dtype=jnp.float32):
    """Random q and a paged cache whose pages are shuffled; also the dense per-sequence K/V."""
    rng = np.random.default_rng(seed)
    batch = len(lengths)
    heads = kv_heads * groups
    max_len = max(max(lengths), 1)
    pages_per_seq = pages_per_seq or math.ceil(max_len / page_size)
    num_pages = batch * pages_per_seq + extra_pages
    k_pages = rng.standard_normal((kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    v_pages = rng.standard_normal((kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    perm = rng.permutation(num_pages)
    block_tables = np.zeros((batch, pages_per_seq), np.int32)
    used = 0
    for b, length in enumerate(lengths):
        n = math.ceil(length / page_size)
        block_tables[b, :n] = perm[used:used + n]
        used += n
    q = rng.standard_normal((batch, q_len, heads, head_dim)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype), jnp.asarray(block_tables),
            jnp.asarray(np.asarray(lengths, np.int32)))


def dense_per_sequence(q, k_pages, v_pages, block_tables, lengths, **kw):
    """Each sequence alone through `mtjax.ops.attention` (causal, bottom-right aligned) on its gathered K/V."""
    out = np.zeros(q.shape, np.float32)
    page_size = k_pages.shape[2]
    q_len = q.shape[1]
    for b, length in enumerate(np.asarray(lengths)):
        length = int(length)
        if length == 0:
            continue
        pages = np.asarray(block_tables[b, :math.ceil(length / page_size)])
        k = jnp.swapaxes(k_pages[:, pages].reshape(k_pages.shape[0], -1, k_pages.shape[-1])[:, :length], 0, 1)[None]
        v = jnp.swapaxes(v_pages[:, pages].reshape(v_pages.shape[0], -1, v_pages.shape[-1])[:, :length], 0, 1)[None]
        t0 = max(q_len - length, 0)  # queries at negative positions see nothing
        res = ops.attention(q[b:b + 1, t0:], k, v, mask_type="causal", implementation="xla", **kw)
        out[b, t0:] = np.asarray(res[0], np.float32)
    return out


@pytest.mark.parametrize("lengths,q_len,groups,page_size", [
    ([5, 1, 12, 0], 1, 2, 4),
    ([7, 16, 3], 3, 4, 8),
    ([9, 2], 4, 1, 4),
])
def test_reference_matches_dense_attention(lengths, q_len, groups, page_size):
    args = make_case(0, lengths=lengths, q_len=q_len, groups=groups, page_size=page_size)
    got = ops.paged_attention(*args, implementation="xla")
    want = dense_per_sequence(*args)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[np.asarray(args[4]) == 0] == 0)


def test_reference_window_and_soft_cap():
    args = make_case(1, lengths=[11, 6], q_len=2, page_size=4)
    got = ops.paged_attention(*args, window_size=(3, 0), logits_soft_cap=2.0, implementation="xla")
    want = dense_per_sequence(*args, window_size=(3, 0), logits_soft_cap=2.0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_reference_fp8_pages_dequantize():
    q, k, v, bt, lengths = make_case(2, lengths=[6, 9])
    k_scale = jnp.asarray([0.5, 2.0], jnp.float32)
    v_scale = jnp.asarray([1.5, 0.25], jnp.float32)
    k8 = (k / k_scale[:, None, None, None]).astype(jnp.float8_e4m3fn)
    v8 = (v / v_scale[:, None, None, None]).astype(jnp.float8_e4m3fn)
    got = ops.paged_attention(q, k8, v8, bt, lengths, k_scale=k_scale, v_scale=v_scale, implementation="xla")
    kd = k8.astype(jnp.float32) * k_scale[:, None, None, None]
    vd = v8.astype(jnp.float32) * v_scale[:, None, None, None]
    want = dense_per_sequence(q, kd, vd, bt, lengths)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_argument_errors():
    q, k, v, bt, lengths = make_case(3, lengths=[4, 2])
    with pytest.raises(ValueError, match="multiple"):
        ops.paged_attention(q[:, :, :3], k, v, bt, lengths)
    with pytest.raises(ValueError, match="k_scale"):
        ops.paged_attention(q, k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn), bt, lengths)
    with pytest.raises(ValueError, match="FP8 pages only"):
        ops.paged_attention(q, k, v, bt, lengths, k_scale=jnp.ones(2))
    with pytest.raises(ValueError, match="lengths"):
        ops.paged_attention(q, k, v, bt, lengths[:1])
    with pytest.raises(TypeError, match="block_tables"):
        ops.paged_attention(q, k, v, bt.astype(jnp.float32), lengths)
    with pytest.raises(TypeError, match="pages of dtype"):
        ops.paged_attention(q, k.astype(jnp.int8), v.astype(jnp.int8), bt, lengths)
    with pytest.raises(ValueError, match="head_dim"):
        ops.paged_attention(q[..., :8], k, v, bt, lengths)
