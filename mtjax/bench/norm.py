"""`mtjax bench norm`: the fused norm / residual / activation / softmax kernels against XLA.

Every case times the op through `mtjax.ops` with each implementation that can run here:
``implementation="pallas_triton"`` (row ``mtjax``), ``"triton"`` (row ``triton``, the native Triton
port) and ``"xla"`` (row ``xla``, the peer); each row's ``extra["auto"]`` names the implementation
the dispatcher picks for that case, so the selection rule in `mtjax.ops` can be checked against the
same run. An implementation that fails gives a row with its error, and the run goes on. Bytes are
the measured function's inputs read once and outputs written once; rows are judged against the
copy bandwidth (``ceiling="copy_gbps"``). Without a GPU the kernels run in interpret mode
(``--quick`` smoke test on the CPU).

Cases: LayerNorm and RMSNorm forward and forward+backward over the table (hidden 1024..12288,
tokens 2048..65536, bf16); LayerNorm + FP8 cast vs XLA's norm then quantize; residual add +
LayerNorm forward+backward; bias+GELU and SwiGLU forward+backward; causal softmax forward+backward.
``python -m mtjax.bench.norm --sweep`` times the kernels' tile options (how the heuristics in
kernels/ were chosen).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mtjax import backend, ops
from mtjax.bench import ceilings, timing
from mtjax.config import override
from mtjax.kernels import layer_norm as norm_kernels

MAIN_SHAPE = (16384, 8192)
TABLE_HIDDEN = (1024, 2048, 4096, 8192, 12288)
TABLE_TOKENS = (2048, 16384, 65536)
# (row label, implementation); those the platform cannot run are left out (`_implementations`).
IMPLEMENTATIONS = (("mtjax", "pallas_triton"), ("triton", "triton"), ("xla", "xla"))


def _inputs(shape, hidden, dtype, *, count_arrays: int, seed: int = 0) -> list[tuple]:
    """Rotating sets of ``count_arrays`` activations of ``shape`` plus gamma and beta ``[hidden]``."""
    keys = jax.random.split(jax.random.key(seed), 64)

    def make(i):
        k = jax.random.split(keys[i], count_arrays + 2)
        acts = tuple(timing.random_array(k[j], shape, dtype) for j in range(count_arrays))
        return acts + (timing.random_array(k[-2], (hidden,), jnp.float32),
                       timing.random_array(k[-1], (hidden,), jnp.float32))

    return timing.rotating(make)


def _auto(op: str, *args, **static) -> str:
    """The implementation automatic selection picks for ``op`` on these (abstract) arguments here."""
    return backend.select(op, args=args, static=static)[0].name


def _case(rows, name: str, fns: dict[str, Callable], inputs, nbytes: int, quick: bool, auto: str) -> None:
    """Time each ``{implementation: jitted fn}`` of one case and append its rows (peer: xla).

    ``nbytes``: the activation-sized arrays the function reads and writes (``[hidden]`` vectors left out).
    """
    with _on_gpu_or_interpret():
        for implementation, fn in fns.items():
            try:
                t = timing.measure(fn, inputs, runs=3 if quick else 20)
            except Exception as err:  # noqa: BLE001 - a failing implementation becomes a row; the run goes on
                rows.append(timing.error_row("norm", name, implementation, err, auto=auto))
                continue
            rows.append(timing.row("norm", name, implementation, t, bytes=nbytes,
                                   peer=None if implementation == "xla" else "xla", ceiling="copy_gbps", auto=auto))


def _on_gpu_or_interpret():
    """Interpret mode where the platform can run no Triton kernel (CPU smoke runs)."""
    if {backend.PALLAS_TRITON, backend.TRITON} & backend.capabilities():
        return contextlib.nullcontext()
    return override(pallas_interpret=True)


def _implementations() -> tuple[tuple[str, str], ...]:
    """`IMPLEMENTATIONS` that can run here (in interpret mode on a CPU)."""
    with _on_gpu_or_interpret():
        platform = backend.platform()
        return tuple((label, impl) for label, impl in IMPLEMENTATIONS
                     if backend.get_implementation("layernorm", impl).runs_on(platform) is None)


def _norm_fns(kind: str, backward: bool) -> dict[str, Callable]:
    def norm(impl, x, g, b):
        if kind == "layernorm":
            return ops.layernorm(x, g, b, implementation=impl)
        return ops.rmsnorm(x, g, implementation=impl)

    def fwd(impl, x, dy, g, b):
        return norm(impl, x, g, b)

    def fwd_bwd(impl, x, dy, g, b):
        y, vjp = jax.vjp(functools.partial(norm, impl), x, g, b)
        return (y,) + vjp(dy)

    body = fwd_bwd if backward else fwd
    return {label: jax.jit(functools.partial(body, impl)) for label, impl in _implementations()}


def _norm_shapes(quick: bool) -> list[tuple[str, int, int]]:
    """``(kind, tokens, hidden)``: the main shape first, LayerNorm over the whole table, RMSNorm at 16384 tokens."""
    if quick:
        return [("layernorm", 256, 1000), ("rmsnorm", 256, 1000)]
    shapes = [("layernorm", *MAIN_SHAPE), ("rmsnorm", *MAIN_SHAPE)]
    shapes += [("layernorm", t, h) for h in TABLE_HIDDEN for t in TABLE_TOKENS if (t, h) != MAIN_SHAPE]
    shapes += [("rmsnorm", MAIN_SHAPE[0], h) for h in TABLE_HIDDEN if h != MAIN_SHAPE[1]]
    return shapes


def _norm_cases(rows, quick: bool, shapes: list[tuple[str, int, int]] | None = None) -> None:
    for kind, tokens, hidden in shapes or _norm_shapes(quick):
        inputs = _inputs((tokens, hidden), hidden, jnp.bfloat16, count_arrays=2)
        x, _, g, b = inputs[0]
        auto = _auto(kind, x, g, b, epsilon=1e-6, zero_centered_gamma=False) if kind == "layernorm" else \
            _auto(kind, x, g, epsilon=1e-6, zero_centered_gamma=False)
        size = tokens * hidden * 2
        for backward in (False, True):
            # forward reads x, writes y; forward+backward also reads dy and writes dx
            name = f"{kind} {'fwd+bwd' if backward else 'fwd'} {tokens}x{hidden} bf16"
            _case(rows, name, _norm_fns(kind, backward), inputs, size * (4 if backward else 2), quick, auto)


def _fp8_case(rows, quick: bool) -> None:
    tokens, hidden = (64, 130) if quick else MAIN_SHAPE
    inputs = _inputs((tokens, hidden), hidden, jnp.bfloat16, count_arrays=1)
    scale = jnp.float32(4.0)
    fns = {
        label: jax.jit(lambda x, g, b, impl=impl: ops.norm_fp8(x, g, b, scale, implementation=impl))
        for label, impl in _implementations()
    }
    x, g, b = inputs[0]
    auto = _auto("norm_fp8", x, g, b, scale, layernorm_type="layernorm", epsilon=1e-6,
                 zero_centered_gamma=False, out_dtype=jnp.dtype(jnp.float8_e4m3fn))
    _case(rows, f"layernorm+fp8 cast fwd {tokens}x{hidden} bf16->e4m3", fns, inputs, 3 * tokens * hidden, quick, auto)


def _tile_fp8_cases(rows, quick: bool) -> None:
    """`BlockScaling`'s fused casts: LayerNorm and SwiGLU writing 1x128-tile FP8 with the transposed cast,
    and SwiGLU's backward writing its gradient so, beside the same result from the separate ops (the
    norm or activation, or its backward, then `tile_quantize`)."""
    tokens, hidden = (64, 260) if quick else MAIN_SHAPE
    inputs = _inputs((tokens, hidden), hidden, jnp.bfloat16, count_arrays=1)
    fp8 = jnp.float8_e4m3fn
    fns = {label: jax.jit(lambda x, g, b, impl=impl: ops.norm_tile_fp8(x, g, b, transpose=True, implementation=impl))
           for label, impl in _implementations()}
    fns["separate"] = jax.jit(lambda x, g, b: ops.tile_quantize(ops.layernorm(x, g, b), fp8, transpose=True))
    x, g, b = inputs[0]
    auto = _auto("norm_tile_fp8", x, g, b, layernorm_type="layernorm", epsilon=1e-6, zero_centered_gamma=False,
                 out_dtype=jnp.dtype(fp8), transpose=True, power_of_two=False, amax_epsilon=0.0)
    # reads x; writes q and q^T (one byte each)
    _case(rows, f"layernorm+tile cast+T fwd {tokens}x{hidden} bf16->e4m3", fns, inputs, 4 * tokens * hidden, quick,
          auto)
    keys = jax.random.split(jax.random.key(4), 2)
    inputs = timing.rotating(lambda i: (
        timing.random_array(jax.random.fold_in(keys[0], i), (tokens, 2, hidden), jnp.bfloat16),
        timing.random_array(jax.random.fold_in(keys[1], i), (2, hidden), jnp.bfloat16)))
    fns = {label: jax.jit(lambda x, b, impl=impl: ops.activation_tile_fp8(x, "swiglu", b, transpose=True,
                                                                          implementation=impl))
           for label, impl in _implementations()}
    fns["separate"] = jax.jit(lambda x, b: ops.tile_quantize(ops.activation(x, "swiglu", b), fp8, transpose=True))
    x, b = inputs[0]
    auto = _auto("activation_tile_fp8", x, b, activation_type="swiglu", out_dtype=jnp.dtype(fp8), transpose=True,
                 power_of_two=False, amax_epsilon=0.0)
    # reads x [tokens, 2, hidden]; writes q and q^T
    _case(rows, f"bias+swiglu+tile cast+T fwd {tokens}x{2 * hidden} bf16->e4m3", fns, inputs, 6 * tokens * hidden,
          quick, auto)
    # the backward: fc1's output gradient from the activation's, cast in tiles with its transpose (the
    # kernel cuts each gated half in whole tiles)
    hidden -= hidden % 128
    keys = jax.random.split(jax.random.key(5), 3)
    inputs = timing.rotating(lambda i: tuple(
        timing.random_array(jax.random.fold_in(key, i), shape, jnp.bfloat16)
        for key, shape in zip(keys, ((tokens, 2, hidden), (tokens, hidden), (2, hidden)))))
    fns = {label: jax.jit(lambda x, dy, b, impl=impl: ops.activation_grad_tile_fp8(x, dy, "swiglu", b,
                                                                                   implementation=impl))
           for label, impl in _implementations()}

    def separate(x, dy, b):
        dx, db = jax.vjp(lambda x, b: ops.activation(x, "swiglu", b), x, b)[1](dy)
        return (*ops.tile_quantize(dx.reshape(tokens, -1), fp8, transpose=True), db)

    fns["separate"] = jax.jit(separate)
    x, dy, b = inputs[0]
    auto = _auto("activation_grad_tile_fp8", x, b, dy, activation_type="swiglu", out_dtype=jnp.dtype(fp8),
                 power_of_two=False, amax_epsilon=0.0)
    # reads x [tokens, 2, hidden] and dy; writes q and q^T [tokens, 2 * hidden]
    _case(rows, f"swiglu bwd+tile cast+T {tokens}x{2 * hidden} bf16->e4m3", fns, inputs, 10 * tokens * hidden,
          quick, auto)


def _residual_case(rows, quick: bool) -> None:
    tokens, hidden = (64, 130) if quick else MAIN_SHAPE
    inputs = _inputs((tokens, hidden), hidden, jnp.bfloat16, count_arrays=4)
    rng = jax.random.key(7)

    def fwd_bwd(impl, x, r, dr, dy, g, b):
        def f(x, r, g, b):
            return ops.residual_norm(x, r, g, b, dropout_rate=0.1, dropout_rng=rng, implementation=impl)
        outs, vjp = jax.vjp(f, x, r, g, b)
        return outs + vjp((dr, dy))

    fns = {label: jax.jit(functools.partial(fwd_bwd, impl)) for label, impl in _implementations()}
    x, r, _, _, g, b = inputs[0]
    auto = _auto("residual_norm", x, r, g, b, jnp.uint32(0), layernorm_type="layernorm", epsilon=1e-6,
                 zero_centered_gamma=False, dropout_rate=0.1)
    # reads x, residual and both cotangents; writes new residual, normalized, dx, dresidual
    _case(rows, f"residual+dropout+layernorm fwd+bwd {tokens}x{hidden} bf16", fns, inputs,
          8 * tokens * hidden * 2, quick, auto)


def _activation_cases(rows, quick: bool) -> None:
    tokens, hidden = (64, 130) if quick else MAIN_SHAPE
    for act, shape in (("gelu", (hidden,)), ("swiglu", (2, hidden))):  # gated input [tokens, 2, hidden]
        width = math.prod(shape)
        keys = jax.random.split(jax.random.key(3), 3)
        inputs = timing.rotating(lambda i, shape=shape: (
            timing.random_array(jax.random.fold_in(keys[0], i), (tokens, *shape), jnp.bfloat16),
            timing.random_array(jax.random.fold_in(keys[1], i), (tokens, hidden), jnp.bfloat16),
            timing.random_array(jax.random.fold_in(keys[2], i), shape, jnp.bfloat16),
        ))

        def fwd_bwd(impl, x, dy, bias, act=act):
            y, vjp = jax.vjp(lambda x, bias: ops.activation(x, act, bias, implementation=impl), x, bias)
            return (y,) + vjp(dy)

        fns = {label: jax.jit(functools.partial(fwd_bwd, impl)) for label, impl in _implementations()}
        x, _, bias = inputs[0]
        # reads x, dy; writes y [tokens, hidden], dx [tokens, width]
        _case(rows, f"bias+{act} fwd+bwd {tokens}x{width} bf16", fns, inputs, 4 * (tokens * hidden + tokens * width),
              quick, _auto("activation", x, bias, activation_type=act))


def _softmax_case(rows, quick: bool) -> None:
    shape = (1, 2, 16, 16) if quick else (4, 16, 2048, 2048)
    keys = jax.random.split(jax.random.key(5), 2)
    inputs = timing.rotating(lambda i: tuple(
        timing.random_array(jax.random.fold_in(k, i), shape, jnp.bfloat16) for k in keys))

    def fwd_bwd(impl, x, dy):
        y, vjp = jax.vjp(lambda x: ops.softmax(x, scale=0.125, causal=True, implementation=impl), x)
        return (y,) + vjp(dy)

    fns = {label: jax.jit(functools.partial(fwd_bwd, impl)) for label, impl in _implementations()}
    auto = _auto("softmax", inputs[0][0], None, scale=0.125, causal=True)
    _case(rows, f"causal softmax fwd+bwd {'x'.join(map(str, shape))} bf16", fns, inputs,
          4 * math.prod(shape) * 2, quick, auto)


CASES = (_norm_cases, _fp8_case, _tile_fp8_cases, _residual_case, _activation_cases, _softmax_case)


def main_cases(rows, quick: bool) -> None:
    """LayerNorm and RMSNorm at the main shape only, then every other case (one shape each)."""
    _norm_cases(rows, quick, _norm_shapes(quick)[:2])
    for case in CASES[1:]:
        case(rows, quick)


def run(quick: bool) -> list[dict]:
    """Rows (`mtjax.bench.timing.row`) of every case; ``quick``: tiny shapes (CPU smoke test)."""
    rows: list[dict] = []
    for case in CASES:
        case(rows, quick)
    return rows


def sweep(copy_gbps: float, hidden_sizes=(2048, 8192, 12288), tokens: int = 16384) -> list[dict]:
    """Time the LayerNorm kernels' ``(block_m, num_warps, programs)`` options, forward and backward;
    each row is printed as it is measured (its fraction of ``copy_gbps``)."""
    rows = []
    for hidden in hidden_sizes:
        (x, dy, g, b), *_ = _inputs((tokens, hidden), hidden, jnp.bfloat16, count_arrays=2)
        n_pad = norm_kernels.next_power_of_2(hidden)
        options = {("fwd", max(1, e // n_pad), w, p) for e in (4096, 16384) for w in (8, 16) for p in (264, 528)}
        # The backward at 2048 wide: 2 rows x 4 warps (4096 elements) won on the H200, so both are candidates.
        options |= {("bwd", max(1, e // n_pad), w, p) for e in (2048, 4096, 8192) for w in (4, 8, 16)
                    for p in (264, 528)}
        for label, block_m, warps, programs in sorted(options, key=str):
            if label == "fwd":
                fn = jax.jit(lambda x, g, b, tile=(block_m, warps), programs=programs: norm_kernels.forward(
                    x, g, b, rms=False, epsilon=1e-6, zero_centered_gamma=False, tile=tile, programs=programs))
                args, size = (x, g, b), 2
            else:
                fn = jax.jit(lambda x, g, dy, tile=(block_m, warps), programs=programs: norm_kernels.backward(
                    x, g, dy, rms=False, epsilon=1e-6, zero_centered_gamma=False, has_beta=True, tile=tile,
                    programs=programs))
                args, size = (x, g, dy), 3
            t = timing.measure(fn, [args], runs=10)
            rows.append(timing.row("norm", f"layernorm {label} {tokens}x{hidden} m={block_m} w={warps} p={programs}",
                                   "mtjax", t, bytes=size * x.size * 2, ceiling="copy_gbps"))
            _print(rows[-1:], copy_gbps)
    return rows


def _print(rows, copy_gbps: float) -> None:
    for r in rows:
        auto = r["extra"].get("auto", "")
        if r["time_ms"] is None:
            print(f"{r['name']:<58} {r['implementation']}", flush=True)
            continue
        print(f"{r['name']:<58} {r['implementation']:<6} {r['time_ms']:8.3f} ms {r['gbps']:7.0f} GB/s "
              f"{r['gbps'] / copy_gbps:5.0%} of copy  auto={auto}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time the tile options of the norm kernels")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    args = parser.parse_args()
    copy = ceilings.run(args.quick)[1]["copy_gbps"]
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    if args.sweep:
        sweep(copy)
    else:
        for case in CASES:
            case_rows: list[dict] = []
            case(case_rows, args.quick)
            _print(case_rows, copy)
