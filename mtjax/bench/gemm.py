"""`mtjax bench gemm`: an FP8 dense layer's forward+backward against the same layer in bf16.

Each case is one Dense GEMM ``y = x @ w`` (x ``[tokens, in]``, w ``[in, out]``, bf16) with its
backward (dgrad and wgrad), timed as one jitted ``jax.vjp`` call: three GEMMs, ``6 * M * K * N``
FLOPs. Rows: ``xla bf16`` (the peer: ``lax.dot_general`` in bf16), ``mtjax fp8`` (`mtjax.fp8.
fp8_dot_general` with delayed scaling, quantization, amaxes and the meta update included). Each
row's ``extra`` counts the GEMMs of the compiled program (`gemm_calls`: ``fp8_gemms`` should be 3 on
a GPU, forward, dgrad and wgrad all on cuBLASLt's FP8 GEMM; ``triton_gemms`` counts those XLA
emitted as Triton fusions instead). The FP8 rows compile with `mtjax.fp8.compiler_options()`, as
mtjax's FP8 train steps do (on CUDA: no Triton GEMM fusions); the bf16 peer with XLA's defaults.

Shapes: 8192^3, and the four GEMMs of a 1.3B GPT layer (hidden 2048, ffn 8192) at 8192 tokens.
``python -m mtjax.bench.gemm [--quick]`` prints the rows as a table.
"""

from __future__ import annotations

import argparse
import functools
import re

import jax
import jax.numpy as jnp
from jax import lax

from mtjax import fp8
from mtjax.bench import timing

DENSE = (((1,), (0,)), ((), ()))  # x [M, K] . w [K, N]
HISTORY = 1024  # DelayedScaling's default amax_history_len

# (name, tokens M, in K, out N)
SHAPES = (
    ("8192^3", 8192, 8192, 8192),
    ("gpt-1.3b qkv", 8192, 2048, 6144),
    ("gpt-1.3b attn out", 8192, 2048, 2048),
    ("gpt-1.3b mlp fc1", 8192, 2048, 8192),
    ("gpt-1.3b mlp fc2", 8192, 8192, 2048),
)
QUICK_SHAPES = (("256^3", 256, 256, 256),)


def _bf16_fwd_bwd(x, w, dy, meta):
    y, vjp = jax.vjp(lambda x, w: lax.dot_general(x, w, DENSE), x, w)
    return (y, *vjp(dy))


def _fp8_fwd_bwd(recipe, x, w, dy, meta):
    y, vjp = jax.vjp(lambda x, w, m: fp8.fp8_dot_general(x, w, DENSE, m, recipe=recipe), x, w, meta)
    return (y, *vjp(dy))


VARIANTS = {  # implementation -> jitted fwd+bwd (x, w, dy, meta) -> (y, dx, dw, next meta)
    "xla bf16": jax.jit(_bf16_fwd_bwd),
    "mtjax fp8": jax.jit(functools.partial(_fp8_fwd_bwd, fp8.DelayedScaling())),
}


def _inputs(m: int, k: int, n: int, seed: int) -> list[tuple]:
    keys = jax.random.split(jax.random.key(seed), 64)

    def make(i):
        kx, kw, kg = jax.random.split(keys[i], 3)
        return (timing.random_array(kx, (m, k), jnp.bfloat16), timing.random_array(kw, (k, n), jnp.bfloat16, k**-0.5),
                timing.random_array(kg, (m, n), jnp.bfloat16, 1e-3))

    return timing.rotating(make)


def _calibrated_meta(fn, inputs: tuple) -> dict:
    """The meta after two steps, so the timed calls quantize with real (not initial) scales."""
    meta = fp8.init_meta(HISTORY)
    for _ in range(2):
        meta = fn(*inputs, meta)[3]
    return meta


def gemm_calls(hlo_text: str) -> dict[str, int]:
    """The GEMMs of a compiled (optimized) HLO module: cuBLASLt FP8 calls, other cuBLAS calls, and
    GEMMs XLA emitted as Triton fusions instead (its autotuner may pick those over cuBLAS)."""
    targets = re.findall(r'custom_call_target="(__cublas[^"]*)"', hlo_text)
    fp8_calls = sum(t.endswith("$f8") for t in targets)
    return {"fp8_gemms": fp8_calls, "other_gemms": len(targets) - fp8_calls,
            "triton_gemms": len(re.findall(r'"kind":"__triton(?:_nested)?_gemm(?:_fusion)?"', hlo_text))}


def run(quick: bool) -> list[dict]:
    """Rows (`timing.row`, suite ``"gemm"``) for every shape and variant; peer: ``xla bf16``."""
    rows = []
    for index, (label, m, k, n) in enumerate(QUICK_SHAPES if quick else SHAPES):
        inputs = _inputs(m, k, n, seed=index)
        name = f"dense fwd+bwd {label} ({m}x{k}x{n})"
        for implementation, fn in VARIANTS.items():
            is_fp8 = implementation != "xla bf16"
            meta = _calibrated_meta(fn, inputs[0]) if is_fp8 else None
            input_sets = [xs + (meta,) for xs in inputs]
            # Timed as compiled, so its HLO is what ran; FP8 compiled as mtjax's FP8 steps are.
            compiled, _ = timing.compile_lowered(fn.lower(*input_sets[0]), fp8.compiler_options() if is_fp8 else None)
            t = timing.measure(compiled, input_sets, runs=3 if quick else 20)
            rows.append(timing.row(
                "gemm", name, implementation, t, flops=6 * m * k * n,
                peer="xla bf16" if is_fp8 else None,
                ceiling="fp8_gemm_tflops" if is_fp8 else "bf16_gemm_tflops",
                shape=[m, k, n], dtype="fp8 (e4m3 fwd, e5m2 grads)" if is_fp8 else "bf16",
                **gemm_calls(compiled.as_text())))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    rows = run(parser.parse_args().quick)
    times = {(r["name"], r["implementation"]): r["time_ms"] for r in rows}
    print(f"{'case':<48} {'implementation':<12} {'ms':>8} {'TFLOP/s':>8} {'vs bf16':>8} {'fp8 GEMMs':>9}")
    for r in rows:
        ratio = times[(r["name"], r["peer"])] / r["time_ms"] if r["peer"] else 1.0
        print(f"{r['name']:<48} {r['implementation']:<12} {r['time_ms']:8.3f} {r['tflops']:8.1f} {ratio:7.2f}x "
              f"{r['extra']['fp8_gemms']:9d}")


if __name__ == "__main__":
    main()
