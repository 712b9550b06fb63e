"""The machine's ceilings, measured in every `mtjax bench` run: rows are judged against these.

- ``copy_gbps``: a large elementwise pass (read once, write once), bytes read plus written per second;
- ``bf16_gemm_tflops``: a square bf16 GEMM through ``lax.dot_general`` (cuBLAS on the GPU);
- ``fp8_gemm_tflops``: the same with float8_e4m3fn operands contracting the last dim of both
  (the layout cuBLASLt's FP8 GEMM takes without a transpose), bf16 output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtjax import fp8
from mtjax.bench import timing


def _copy(quick: bool) -> dict:
    shape = (256, 256) if quick else (2**15, 2**14)  # 1 GiB of bf16 on the GPU
    keys = jax.random.split(jax.random.key(0), 16)
    inputs = timing.rotating(lambda i: (timing.random_array(keys[i], shape, jnp.bfloat16),), max_sets=len(keys))
    fn = jax.jit(lambda x: x * jnp.bfloat16(1.5))
    t = timing.measure(fn, inputs, runs=5 if quick else 20)
    size = inputs[0][0].nbytes
    return timing.row("ceiling", f"copy {shape[0]}x{shape[1]} bf16", "xla", t, bytes=2 * size, ceiling="copy_gbps")


def _gemm(quick: bool, dtype) -> dict:
    n = 256 if quick else 8192
    keys = jax.random.split(jax.random.key(1), 32)

    def make(i):
        a = timing.random_array(keys[2 * i], (n, n), jnp.bfloat16).astype(dtype)
        b = timing.random_array(keys[2 * i + 1], (n, n), jnp.bfloat16).astype(dtype)
        return a, b

    # Both operands contract their last dim (B is [N, K]): cuBLAS(Lt) runs this "NT" GEMM without a transpose.
    fn = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16))
    inputs = timing.rotating(make, max_sets=16)
    # FP8 as mtjax compiles its FP8 programs (cuBLASLt; XLA's Triton GEMM autotuning would add half a minute).
    options = None if dtype == jnp.bfloat16 else fp8.compiler_options()
    compiled, _ = timing.compile_lowered(fn.lower(*inputs[0]), options)
    t = timing.measure(compiled, inputs, runs=5 if quick else 20)
    name = "bf16" if dtype == jnp.bfloat16 else "fp8 e4m3"
    key = "bf16_gemm_tflops" if dtype == jnp.bfloat16 else "fp8_gemm_tflops"
    return timing.row("ceiling", f"gemm {n}^3 {name}", "xla", t, flops=2 * n**3, ceiling=key)


def run(quick: bool) -> tuple[list[dict], dict[str, float]]:
    """Measure the ceilings: their rows, and ``{key: value}`` for every key of `timing.CEILING_KEYS`."""
    copy = _copy(quick)
    bf16 = _gemm(quick, jnp.bfloat16)
    fp8 = _gemm(quick, jnp.float8_e4m3fn)
    values = {"copy_gbps": copy["gbps"], "bf16_gemm_tflops": bf16["tflops"], "fp8_gemm_tflops": fp8["tflops"]}
    return [copy, bf16, fp8], values
