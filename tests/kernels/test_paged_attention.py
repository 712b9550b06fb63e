"""paged_attention: the reference against dense attention, the Pallas kernel (interpret mode) against
the reference, argument errors, and the Triton lowering for an abstract H200."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax._src.pallas.triton import lowering as triton_lowering

from mtjax import backend, ops
from mtjax.kernels import paged_attention as pa

# Interpret mode and the references run as XLA programs on the CPU: their compilation dominates, and
# XLA's optimizations (twice the compile time) matter for no assertion here unless a test says so.
pytestmark = pytest.mark.usefixtures("fast_compiles")


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


def dense_per_sequence(q, k_pages, v_pages, block_tables, lengths, *, window_size=None, logits_soft_cap=None):
    """Each sequence alone on its contiguous K/V, in float64 numpy: causal (query t at position
    length - q_len + t), GQA by repeating KV heads, optional window and soft cap."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    batch, q_len, heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    out = np.zeros(q.shape)
    for b, length in enumerate(np.asarray(lengths)):
        if length == 0:
            continue  # an empty slot: zeros
        pages = np.asarray(block_tables[b, :math.ceil(length / page_size)])
        k = k_pages[:, pages].reshape(kv_heads, -1, head_dim)[:, :length]  # [kv_heads, length, head_dim]
        v = v_pages[:, pages].reshape(kv_heads, -1, head_dim)[:, :length]
        k, v = (np.repeat(x, heads // kv_heads, axis=0) for x in (k, v))
        logits = np.einsum("thd,hsd->hts", q[b], k) * head_dim ** -0.5
        if logits_soft_cap is not None:
            logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
        q_pos = length - q_len + np.arange(q_len)[:, None]
        k_pos = np.arange(length)[None, :]
        keep = k_pos <= q_pos
        if window_size is not None:
            keep &= k_pos >= q_pos - window_size[0]
        logits = np.where(keep[None], logits, -np.inf)
        top = np.max(logits, axis=-1, keepdims=True)
        p = np.where(keep[None], np.exp(logits - np.where(np.isfinite(top), top, 0.0)), 0.0)
        total = p.sum(-1, keepdims=True)
        out[b] = np.einsum("hts,hsd->thd", p / np.where(total == 0, 1.0, total), v)
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


# -------------------------------------------------------------------------------------------------- the kernel


def kernel(*args, blocks=None, **kw):
    q, k, v, bt, lengths, *scales = args
    scales = scales or [None, None]
    left = kw.pop("window_left", None)
    return pa.paged_attention(q, k, v, bt, lengths, *scales, scale=q.shape[-1] ** -0.5, window_left=left,
                                         blocks=blocks, interpret=True, **kw)


KERNEL_CASES = [
    # lengths, q_len, kv_heads, groups, head_dim, page_size, num_splits
    ([5, 1, 12, 0], 1, 2, 2, 16, 4, None),
    ([33, 64, 7], 1, 1, 8, 32, 16, 2),
    ([70, 3], 1, 2, 1, 16, 8, 3),
    ([19, 40], 3, 2, 4, 16, 4, None),
    ([0, 0], 1, 2, 4, 16, 16, None),
    ([2, 9], 4, 1, 4, 16, 4, 1),  # a query at a negative position (length < q_len) sees nothing
]


@pytest.mark.parametrize("lengths,q_len,kv_heads,groups,head_dim,page_size,num_splits", KERNEL_CASES)
def test_kernel_matches_reference(lengths, q_len, kv_heads, groups, head_dim, page_size, num_splits):
    args = make_case(4, lengths=lengths, q_len=q_len, kv_heads=kv_heads, groups=groups, head_dim=head_dim,
                     page_size=page_size)
    blocks = pa.DecodeBlocks(block_k=max(16, page_size), block_rows=16, num_splits=num_splits)
    got = kernel(*args, blocks=blocks)
    want = ops.paged_attention(*args, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert not np.any(np.isnan(np.asarray(got)))


def test_kernel_window_soft_cap_and_row_blocks():
    # 3 queries x 8 groups = 24 rows: two row blocks of 16.
    args = make_case(5, lengths=[37, 12], q_len=3, kv_heads=1, groups=8, page_size=8)
    got = kernel(*args, blocks=pa.DecodeBlocks(block_k=16, block_rows=16, num_splits=2), window_left=9,
                 logits_soft_cap=3.0)
    want = ops.paged_attention(*args, window_size=(9, 0), logits_soft_cap=3.0, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_kernel_fp8_pages(fp8):
    q, k, v, bt, lengths = make_case(6, lengths=[21, 50, 0], kv_heads=2, groups=2, page_size=16, dtype=jnp.bfloat16)
    k_scale = jnp.asarray([0.02, 0.05], jnp.float32)
    v_scale = jnp.asarray([0.03, 0.01], jnp.float32)
    k8 = (k.astype(jnp.float32) / k_scale[:, None, None, None]).astype(fp8)
    v8 = (v.astype(jnp.float32) / v_scale[:, None, None, None]).astype(fp8)
    got = kernel(q, k8, v8, bt, lengths, k_scale, v_scale)
    want = ops.paged_attention(q, k8, v8, bt, lengths, k_scale=k_scale, v_scale=v_scale, implementation="xla")
    assert got.dtype == jnp.bfloat16
    # Both read the same FP8 values; they differ by the bf16 rounding of the probabilities and the output.
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_kernel_bfloat16():
    args = make_case(7, lengths=[45, 8, 17], kv_heads=2, groups=4, page_size=8, dtype=jnp.bfloat16)
    got = kernel(*args)
    want = ops.paged_attention(*args, implementation="xla")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_dispatch_uses_kernel_in_interpret_mode(interpret):
    args = make_case(8, lengths=[9, 30], page_size=8)
    got = ops.paged_attention(*args)  # automatic selection: a kernel (Pallas or native Triton) in interpret mode
    want = ops.paged_attention(*args, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    got = ops.paged_attention(*args, implementation="pallas_triton")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@settings(max_examples=4)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    q_len=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2, 4]),
    page_size=st.sampled_from([4, 8, 16]),
    num_splits=st.sampled_from([None, 1, 2, 3]),
    left=st.sampled_from([None, 5]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_kernel_matches_reference(lengths, q_len, kv_heads, groups, page_size, num_splits, left, seed):
    args = make_case(seed, lengths=lengths, q_len=q_len, kv_heads=kv_heads, groups=groups, page_size=page_size)
    blocks = pa.DecodeBlocks(block_k=max(16, page_size), block_rows=16, num_splits=num_splits)
    got = kernel(*args, blocks=blocks, window_left=left)
    want = ops.paged_attention(*args, window_size=None if left is None else (left, 0), implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_kernel_declines_unsupported():
    assert "head_dim" in pa.unsupported((1, 1, 4, 24), (2, 8, 16, 24), jnp.bfloat16, jnp.bfloat16)
    assert "page_size" in pa.unsupported((1, 1, 4, 16), (2, 8, 12, 16), jnp.bfloat16, jnp.bfloat16)
    assert pa.unsupported((1, 1, 4, 128), (2, 8, 16, 128), jnp.bfloat16, jnp.float8_e4m3fn) is None


# -------------------------------------------------------------------------------------------------- cuda lowering


@pytest.mark.parametrize("q_len,groups,page_dtype,page_size,head_dim,options", [
    (1, 4, jnp.bfloat16, 16, 128, {}),
    (1, 4, jnp.bfloat16, 64, 64, {}),  # one page per loop step
    (1, 8, jnp.float8_e4m3fn, 32, 128, {"logits_soft_cap": 30.0}),
    (4, 4, jnp.bfloat16, 16, 128, {"window_size": (100, 0)}),  # chunked prefill rows
    (1, 2, jnp.float8_e5m2, 16, 256, {}),
])
def test_lowers_for_cuda(q_len, groups, page_dtype, page_size, head_dim, options, monkeypatch):
    """The Triton lowering for an H200, on the CPU, with the module run through the MLIR verifier."""
    lower_module = triton_lowering.lower_jaxpr_to_triton_module
    lowered = []

    def lower_and_verify(*args, **kwargs):
        result = lower_module(*args, **kwargs)
        result.module.operation.verify()
        lowered.append(result)
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    batch, kv_heads, num_pages, pages_per_seq = 3, 2, 64, 40
    q = jax.ShapeDtypeStruct((batch, q_len, kv_heads * groups, head_dim), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((kv_heads, num_pages, page_size, head_dim), page_dtype)
    tables = jax.ShapeDtypeStruct((batch, pages_per_seq), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    fp8 = page_dtype != jnp.bfloat16
    scales = (jax.ShapeDtypeStruct((kv_heads,), jnp.float32),) * 2 if fp8 else ()

    def f(q, k, v, bt, lengths, *scales):
        ks, vs = scales or (None, None)
        # Automatic selection: the cuda branch of the lowering gets the kernel.
        return ops.paged_attention(q, k, v, bt, lengths, k_scale=ks, v_scale=vs, **options)

    with backend.abstract_gpu():
        text = jax.jit(f).trace(q, pages, pages, tables, lengths, *scales).lower(lowering_platforms=("cuda",)).as_text()
    assert "mtjax_paged_attention" in text
    assert lowered  # the kernel went through the Triton lowering and the verifier


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="assumes no local GPU (the cuda device comes from config)")
def test_selection_on_cuda(monkeypatch):
    monkeypatch.setattr(backend, "native_triton_problem", lambda: "jax_triton cannot be imported")
    q = jax.ShapeDtypeStruct((8, 1, 32, 64), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((8, 100, 16, 64), jnp.bfloat16)
    tables, lengths = jax.ShapeDtypeStruct((8, 10), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32)
    args = (q, pages, pages, tables, lengths, None, None)
    static = {"scale": 0.125, "logits_soft_cap": None, "window_size": None}
    assert backend.select("paged_attention", platform_name="cuda", args=args, static=static)[0].name == "pallas_triton"
    odd = (jax.ShapeDtypeStruct((8, 1, 32, 80), jnp.bfloat16), jax.ShapeDtypeStruct((8, 100, 16, 80), jnp.bfloat16))
    args = (odd[0], odd[1], odd[1]) + args[3:]
    assert backend.select("paged_attention", platform_name="cuda", args=args, static=static)[0].name == "xla"
    assert backend.select("paged_attention", platform_name="cpu", args=args, static=static)[0].name == "xla"
    monkeypatch.setattr(backend, "native_triton_problem", lambda: None)  # with jax-triton: the native kernel
    args = (q, pages, pages) + args[3:]
    assert backend.select("paged_attention", platform_name="cuda", args=args, static=static)[0].name == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("batch,context,page_dtype", [(1, 2048, jnp.bfloat16), (64, 2048, jnp.bfloat16),
                                                       (8, 8192, jnp.float8_e4m3fn)])
def test_gpu_real_sizes(batch, context, page_dtype):
    page_size, kv_heads, groups, head_dim = 16, 8, 4, 64
    pages_per_seq = context // page_size
    rng = np.random.default_rng(0)
    lengths = jnp.asarray(rng.integers(1, context + 1, batch), jnp.int32)
    num_pages = batch * pages_per_seq + 1
    tables = jnp.asarray(rng.permutation(num_pages)[:batch * pages_per_seq].reshape(batch, pages_per_seq), jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, 1, kv_heads * groups, head_dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((kv_heads, num_pages, page_size, head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((kv_heads, num_pages, page_size, head_dim)), jnp.bfloat16)
    scales = {}
    if page_dtype != jnp.bfloat16:
        k, v = k.astype(page_dtype), v.astype(page_dtype)
        scales = {"k_scale": jnp.full((kv_heads,), 0.5, jnp.float32),
                  "v_scale": jnp.full((kv_heads,), 2.0, jnp.float32)}
    got = ops.paged_attention(q, k, v, tables, lengths, implementation="pallas_triton", **scales)
    want = ops.paged_attention(q, k, v, tables, lengths, implementation="xla", **scales)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="assumes no local GPU (the cuda device comes from config)")
def test_cudnn_is_explicit_only(monkeypatch):
    monkeypatch.setattr(backend, "native_triton_problem", lambda: "jax_triton cannot be imported")
    batch, pages_per_seq = 4, 8
    q = jax.ShapeDtypeStruct((batch, 1, 16, 128), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((4, batch * pages_per_seq, 16, 128), jnp.bfloat16)
    args = (q, pages, pages, jax.ShapeDtypeStruct((batch, pages_per_seq), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32), None, None)
    static = {"scale": 0.1, "logits_soft_cap": None, "window_size": None}
    impl = backend.get_implementation("paged_attention", "cudnn")
    assert impl.unsupported(*args, **static) is None
    assert "copy the whole cache" in impl.not_preferred(args, static)
    assert backend.select("paged_attention", platform_name="cuda", args=args, static=static)[0].name == "pallas_triton"
    pool = jax.ShapeDtypeStruct((4, 40, 16, 128), jnp.bfloat16)  # more pages than batch * pages_per_seq
    assert "pool" in impl.unsupported(q, pool, pool, *args[3:], **static)
