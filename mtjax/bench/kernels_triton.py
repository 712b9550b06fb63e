"""``python -m mtjax.bench.kernels_triton``: check every native Triton kernel against its reference and
time it beside the Pallas Triton kernel, cuDNN and XLA, in one GPU run.

- **check**: each op with ``implementation="triton"`` against ``"xla"`` (or `REFERENCE`) at real sizes, bf16, forward
  and (where differentiable) backward: the largest error relative to the reference's largest entry
  must stay under 2e-2; FP8 outputs must agree on 99 % of their elements (one float32 rounding apart
  can flip an FP8 rounding).
- **bench**: the attention suite's headline cases (`mtjax.bench.attention`), the norm suite's main
  shapes (`mtjax.bench.norm`), and one shape of each other family, for every implementation that can
  run here; rows in the shared format (`mtjax.bench.timing.row`), peers cuDNN (attention) and XLA.

Every case is guarded: a kernel that fails to compile or to run gives a FAILED line with its error
and the run goes on. ``--quick``: tiny shapes in interpret mode on the CPU (a smoke test of this
script). ``--json PATH``: the check results and bench rows. The exit status is 1 if a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import backend, ops
from mtjax.bench import attention, norm, report, timing
from mtjax.config import override

TOLERANCE = 2e-2
FP8_AGREEMENT = 0.99
SUITE = "triton"
# Checks whose reference is another kernel, ``name -> (op, implementation)`` (XLA where that cannot
# run): XLA's GPU ragged dot of FP8 operands widened to bfloat16 does not keep their FP8 rounding, so
# it is no reference there; the Pallas kernels are checked against float64 numpy on the same
# quantized operands by the grouped GEMM's GPU tests.
REFERENCE = {"grouped_gemm_fp8": ("grouped_gemm", "pallas_triton")}


def _random(seed: int, *shapes, dtype=jnp.bfloat16, scale: float = 1.0) -> list[jax.Array]:
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [timing.random_array(k, s, dtype, scale) for k, s in zip(keys, shapes)]


def _with_grads(fn: Callable, cotangent_seed: int = 99) -> Callable:
    """``fn(*args)``'s outputs and the gradients of their sum against random weights, for every arg."""
    def run(*args):
        out, vjp = jax.vjp(fn, *args)
        leaves = jax.tree.leaves(out)
        keys = jax.random.split(jax.random.key(cotangent_seed), len(leaves))
        cotangent = jax.tree.unflatten(jax.tree.structure(out), [
            jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype) for k, x in zip(keys, leaves)])
        return out, vjp(cotangent)
    return run


def _compare(got: Any, want: Any) -> tuple[bool, str]:
    """Whether ``got`` matches ``want`` (module docstring), and the worst error found."""
    worst, ok = [], True
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if jnp.dtype(a.dtype).itemsize == 1 and jnp.issubdtype(a.dtype, jnp.floating):  # FP8
            agree = float(np.mean(np.asarray(a, np.float32) == np.asarray(b, np.float32)))
            ok &= agree >= FP8_AGREEMENT
            worst.append(f"fp8 {agree:.4f} equal")
            continue
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if not np.isfinite(a).all():
            return False, "non-finite output"
        error = float(np.max(np.abs(a - b))) / max(1.0, float(np.max(np.abs(b)))) if a.size else 0.0
        ok &= error <= TOLERANCE
        worst.append(f"{error:.1e}")
    return ok, ", ".join(worst)


# --------------------------------------------------------------------------------------------------
# Checks: (name, fn(implementation) -> callable, inputs)
# --------------------------------------------------------------------------------------------------


def _checks(quick: bool) -> list[tuple[str, Callable[[str], Callable], tuple]]:
    seq, kv = (40, 56) if quick else (1000, 1500)
    heads, hidden, rows = (2, 96, 24) if quick else (8, 4096, 8192)
    checks = []

    def attention_check(name, head_dim, kv_heads, **options):
        q, do = _random(1, (2, seq, heads, head_dim), (2, seq, heads, head_dim))
        k, v = _random(2, (2, kv, kv_heads, head_dim), (2, kv, kv_heads, head_dim))
        if options.pop("segments", False):
            ids = [jnp.sort(jax.random.randint(jax.random.key(i), (2, n), 0, 4), axis=1).astype(jnp.int32)
                   for i, n in ((3, seq), (4, kv))]
            options.update(q_segment_ids=ids[0], kv_segment_ids=ids[1])
        checks.append((f"attention {name} D{head_dim}", lambda impl: _with_grads(
            lambda q, k, v: ops.attention(q, k, v, implementation=impl, **options)), (q, k, v)))

    attention_check("causal GQA", 128, 2, mask_type="causal")
    attention_check("full", 64, heads)
    attention_check("causal", 16 if quick else 256, heads, mask_type="causal")
    attention_check("segments+window+softcap+dropout", 128, 2, mask_type="padding_causal", segments=True,
                    window_size=(100, 0), logits_soft_cap=30.0, dropout_rate=0.1, dropout_rng=jax.random.key(5))
    q, k = _random(6, (2, seq, heads, 128), (2, kv, 2, 128))
    checks.append(("attention_with_lse", lambda impl: lambda q, k: ops.attention_with_lse(
        q, k, k, causal=True, scale=0.1, implementation=impl), (q, k)))

    x, r = _random(7, (rows, hidden), (rows, hidden))
    gamma, beta = _random(8, (hidden,), (hidden,), dtype=jnp.float32)
    checks += [
        ("layernorm", lambda impl: _with_grads(lambda x, g, b: ops.layernorm(x, g, b, implementation=impl)),
         (x, gamma, beta)),
        ("rmsnorm", lambda impl: _with_grads(lambda x, g: ops.rmsnorm(x, g, implementation=impl)), (x, gamma)),
        ("residual_norm+dropout", lambda impl: _with_grads(lambda x, r, g, b: ops.residual_norm(
            x, r, g, b, dropout_rate=0.1, dropout_rng=jax.random.key(1), implementation=impl)), (x, r, gamma, beta)),
        ("norm_fp8", lambda impl: lambda x, g, b: ops.norm_fp8(x, g, b, jnp.float32(8.0), implementation=impl),
         (x, gamma, beta)),
        ("norm_tile_fp8", lambda impl: lambda x, g: ops.norm_tile_fp8(
            x, g, None, layernorm_type="rmsnorm", transpose=True, implementation=impl), (x, gamma)),
    ]
    xg, = _random(9, (rows, 2, hidden))
    bias, = _random(10, (2, hidden))
    checks += [
        ("swiglu", lambda impl: _with_grads(lambda x, b: ops.activation(x, "swiglu", b, implementation=impl)),
         (xg, bias)),
        ("gelu", lambda impl: _with_grads(lambda x, b: ops.activation(x, "gelu", b, implementation=impl)),
         (x, bias[0])),
        ("activation_fp8", lambda impl: lambda x, b: ops.activation_fp8(
            x, "geglu", b, scale=jnp.float32(30.0), implementation=impl), (xg, bias)),
        ("activation_grad_fp8", lambda impl: lambda x, dy, b: ops.activation_grad_fp8(
            x, dy, "swiglu", b, scale=jnp.float32(30.0), implementation=impl), (xg, x, bias)),
        ("activation_tile_fp8", lambda impl: lambda x, b: ops.activation_tile_fp8(
            x, "clamped_swiglu", b, transpose=True, implementation=impl), (xg, bias)),
        # gated: each half in whole 128-wide tiles (the quick shapes' hidden is not)
        ("activation_grad_tile_fp8", lambda impl: lambda x, dy, b: ops.activation_grad_tile_fp8(
            x, dy, "gelu", b, implementation=impl), (x, r, bias[0])),
    ]
    logits, = _random(11, (2, 4, seq, seq + 8))
    mask = jax.random.bernoulli(jax.random.key(12), 0.8, (2, 1, 1, seq + 8))
    checks += [
        ("softmax causal+mask", lambda impl: _with_grads(lambda z: ops.softmax(
            z, mask, scale=0.3, causal=True, implementation=impl)), (logits,)),
        ("cast_transpose", lambda impl: lambda x: ops.cast_transpose(x, jnp.float32(20.0), jnp.float8_e4m3fn,
                                                                     implementation=impl), (x,)),
    ]
    m, g = (64, 4) if quick else (16384, 8)
    sizes = jnp.asarray(np.diff(np.linspace(0, m - m // 16, g + 1).astype(np.int32)))
    lhs, = _random(13, (m, 128 if quick else 2048))
    rhs, = _random(14, (g, 128 if quick else 2048, 64 if quick else 1408), scale=0.05)
    checks += [
        ("grouped_gemm", lambda impl: _with_grads(lambda a, b: ops.grouped_gemm(a, b, sizes, implementation=impl)),
         (lhs, rhs)),
        ("grouped_gemm_fp8", lambda impl: _with_grads(lambda a, b: ops.grouped_gemm_fp8(
            a, b, sizes, implementation=impl)), (lhs, rhs)),
    ]
    batch, kv_heads, page_size, pages_per_seq = (2, 2, 16, 4) if quick else (16, 8, 16, 256)
    lengths = jnp.asarray(np.linspace(0, pages_per_seq * page_size, batch).astype(np.int32))
    tables = jnp.asarray(np.random.default_rng(0).permutation(batch * pages_per_seq).reshape(batch, -1)
                         .astype(np.int32))
    qd, = _random(15, (batch, 1, kv_heads * 4, 128))
    pages, = _random(16, (kv_heads, batch * pages_per_seq, page_size, 128))
    checks.append(("paged_attention", lambda impl: lambda q, p: ops.paged_attention(
        q, p, p, tables, lengths, implementation=impl), (qd, pages)))
    a, = _random(17, (rows, hidden), dtype=jnp.float32, scale=3.0)
    w, = _random(18, (hidden // 2, hidden), scale=0.05)
    checks += [
        ("tile_quantize", lambda impl: lambda a: ops.tile_quantize(a, jnp.float8_e4m3fn, transpose=True,
                                                                   implementation=impl), (a,)),
        ("block_quantize", lambda impl: lambda w: ops.block_quantize(w, jnp.float8_e4m3fn, implementation=impl),
         (w,)),
        ("block_fp8_gemm", lambda impl: lambda a, w: ops.block_fp8_gemm(
            *ops.tile_quantize(a, jnp.float8_e4m3fn, implementation="xla"),
            *ops.block_quantize(w, jnp.float8_e4m3fn, implementation="xla")[::2], out_dtype=jnp.float32,
            implementation=impl), (a, w)),
    ]
    return checks


def run_checks(quick: bool, only: str | None = None) -> list[dict]:
    """Every check (those whose name contains ``only``); each result is ``{"name", "status":
    PASS|FAIL|ERROR, "detail", "seconds"}``."""
    results = []
    for name, make, inputs in _checks(quick):
        if only is not None and only not in name:
            continue
        start = time.perf_counter()
        try:
            got = jax.jit(make("triton"))(*inputs)
            op, reference = REFERENCE.get(name, (None, "xla"))
            if op is not None and not _runnable(op, reference):
                reference = "xla"
            want = jax.jit(make(reference))(*inputs)
            ok, detail = _compare(got, want)
            status = "PASS" if ok else "FAIL"
        except Exception as err:  # noqa: BLE001 - a kernel that fails is reported, the run goes on
            status, detail = "ERROR", f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
            traceback.print_exc(limit=2, file=sys.stderr)
        results.append(dict(name=name, status=status, detail=detail, seconds=time.perf_counter() - start))
        print(f"check {status:<5} {name:<40} {detail}  ({results[-1]['seconds']:.1f} s)", flush=True)
    return results


# --------------------------------------------------------------------------------------------------
# Bench
# --------------------------------------------------------------------------------------------------


def _runnable(op: str, implementation: str) -> bool:
    return backend.get_implementation(op, implementation).runs_on(backend.platform()) is None


def _time(rows: list[dict], op: str, name: str, make: Callable[[str], Callable], inputs: list[tuple], *,
          implementations=("pallas_triton", "triton", "xla"), peer: str = "xla", quick: bool, **measure) -> None:
    """Time ``make(implementation)`` (jitted) on ``inputs`` for each runnable implementation."""
    for implementation in implementations:
        if not _runnable(op, implementation):
            continue
        try:
            t = timing.measure(jax.jit(make(implementation)), inputs, runs=3 if quick else 10)
            rows.append(timing.row(SUITE, name, implementation, t, peer=None if implementation == peer else peer,
                                   **measure))
        except Exception as err:  # noqa: BLE001 - a failing implementation becomes a row; the run goes on
            rows.append(timing.error_row(SUITE, name, implementation, err))


def _bench_other_families(rows: list[dict], quick: bool) -> None:
    m, k, n, g = (256, 64, 128, 4) if quick else (32768, 2048, 1408, 8)
    sizes = jnp.full((g,), m // g, jnp.int32)
    inputs = [tuple(_random(i, (m, k), (g, k, n), (m, n), scale=0.05)) for i in range(2)]

    def gemm(impl):
        return lambda a, b, dy: _grads_only(lambda a, b: ops.grouped_gemm(a, b, sizes, implementation=impl), (a, b), dy)

    _time(rows, "grouped_gemm", f"grouped_gemm fwd+bwd {m}x{k}x{n} G{g} bf16", gemm, inputs, quick=quick,
          flops=6 * m * k * n, ceiling="bf16_gemm_tflops")
    batch, kv_heads, page_size, pages_per_seq = (2, 2, 16, 4) if quick else (64, 8, 16, 256)
    lengths = jnp.full((batch,), pages_per_seq * page_size - 3, jnp.int32)
    tables = jnp.arange(batch * pages_per_seq, dtype=jnp.int32).reshape(batch, -1)
    inputs = [tuple(_random(20 + i, (batch, 1, kv_heads * 4, 128), (kv_heads, batch * pages_per_seq, page_size, 128)))
              for i in range(2)]
    kv_bytes = 2 * inputs[0][1].size * 2
    _time(rows, "paged_attention", f"paged_attention decode B{batch} ctx{pages_per_seq * page_size} GQA4 D128",
          lambda impl: lambda q, p: ops.paged_attention(q, p, p, tables, lengths, implementation=impl), inputs,
          quick=quick, bytes=kv_bytes, ceiling="copy_gbps")
    size = (256, 256) if quick else (8192, 8192)
    inputs = [tuple(_random(30 + i, size)) for i in range(2)]
    _time(rows, "cast_transpose", f"cast_transpose {size[0]}x{size[1]} bf16->e4m3",
          lambda impl: lambda x: ops.cast_transpose(x, jnp.float32(2.0), jnp.float8_e4m3fn, implementation=impl),
          inputs, quick=quick, bytes=4 * math.prod(size), ceiling="copy_gbps")
    _time(rows, "tile_quantize", f"tile_quantize+transpose {size[0]}x{size[1]} bf16->e4m3",
          lambda impl: lambda x: ops.tile_quantize(x, jnp.float8_e4m3fn, transpose=True, implementation=impl),
          inputs, quick=quick, bytes=4 * math.prod(size), ceiling="copy_gbps")
    a, w = _random(40, size, size, dtype=jnp.float32)
    operands = [(*ops.tile_quantize(a, jnp.float8_e4m3fn, implementation="xla"),
                 *ops.block_quantize(w, jnp.float8_e4m3fn, implementation="xla")[::2])]
    _time(rows, "block_fp8_gemm", f"block_fp8_gemm {size[0]}^3 e4m3",
          lambda impl: lambda a, sa, b, sb: ops.block_fp8_gemm(a, sa, b, sb, out_dtype=jnp.bfloat16,
                                                               implementation=impl),
          operands, quick=quick, flops=2 * size[0] ** 3, ceiling="fp8_gemm_tflops")


def _grads_only(fn, primals, cotangent):
    out, vjp = jax.vjp(fn, *primals)
    return out, vjp(cotangent)


def run_bench(quick: bool) -> list[dict]:
    """The rows: the attention suite's first cases (the headline first), the norm suite's main shapes,
    one shape of each other family."""
    rows: list[dict] = []
    cases = attention.QUICK_CASES if quick else attention.CASES[:4]  # causal, full, GQA, D64 causal
    parts = [functools.partial(_attention_rows, case) for case in cases]
    for part in parts + [norm.main_cases, _bench_other_families]:
        start = len(rows)
        try:
            part(rows, quick)
        except Exception as err:  # noqa: BLE001 - a part that fails as a whole is reported, the run goes on
            rows.append(timing.error_row(SUITE, getattr(part, "__name__", str(part)), "all", err))
        for r in rows[start:]:
            result = "FAILED" if r["time_ms"] is None else f"{r['time_ms']:.3f} ms"
            print(f"bench {r['suite']:<9} {r['name']:<58} {r['implementation'][:120]:<24} {result}", flush=True)
    return rows


def _attention_rows(case: attention.Case, rows: list[dict], quick: bool) -> None:
    rows += attention.case_rows(case, runs=3 if quick else 5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (a CPU smoke test)")
    parser.add_argument("--json", metavar="PATH", help="write the check results and bench rows here")
    parser.add_argument("--skip-bench", action="store_true", help="run the checks only")
    parser.add_argument("--skip-check", action="store_true", help="run the bench only")
    parser.add_argument("--only", metavar="TEXT", help="run the checks whose name contains TEXT")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(f"device {device.device_kind} ({backend.platform()}), jax {jax.__version__}, triton capability: "
          f"{backend.TRITON in backend.capabilities()} ({backend.native_triton_problem() or 'ok'})", flush=True)
    context = override(pallas_interpret=True) if args.quick else contextlib.nullcontext()
    checks, rows = [], []
    with context:
        if not args.skip_check:
            checks = run_checks(args.quick, args.only)
        if not args.skip_bench:
            ceilings = {} if args.quick else timing_ceilings()
            rows = report.complete(run_bench(args.quick), ceilings, report.H200_BF16_PEAK_TFLOPS)
            print(report.table(rows), flush=True)
    failed = [c["name"] for c in checks if c["status"] != "PASS"]
    print(f"checks: {len(checks) - len(failed)} of {len(checks)} passed" + (f"; not: {failed}" if failed else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"device": device.device_kind, "jax": jax.__version__, "quick": args.quick},
                       "checks": checks, "results": rows}, f, indent=1, default=str)
    return 1 if failed else 0


def timing_ceilings() -> dict[str, float]:
    """The machine's copy bandwidth and GEMM rates (`mtjax.bench.ceilings`), for the rows' fractions."""
    from mtjax.bench import ceilings

    return ceilings.run(False)[1]


if __name__ == "__main__":
    sys.exit(main())
