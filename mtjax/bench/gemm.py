"""`mtjax bench gemm`: FP8 dense layers (per-tensor and block-scaled) against the same layer in bf16.

Each case is one Dense GEMM ``y = x @ w`` (x ``[tokens, in]``, w ``[in, out]``, bf16), timed as one
jitted call: its forward alone (``dense fwd``, ``2 * M * K * N`` FLOPs) and with its backward (``dense
fwd+bwd``, dgrad and wgrad, ``6 * M * K * N`` FLOPs). Rows: ``xla bf16`` (the peer: ``lax.dot_general``
in bf16), ``mtjax fp8`` (`mtjax.fp8.fp8_dot_general` with delayed scaling, quantization, amaxes and
the meta update included) and ``mtjax fp8 block`` (`mtjax.fp8.BlockScaling`: 1x128 tiles, 128x128
weight blocks, every tile cast included). ``block fp8 gemm`` rows time the block-scaled GEMM alone
(`mtjax.ops.block_fp8_gemm` on operands cast beforehand, ``2 * M * K * N`` FLOPs) against the
machine's per-tensor FP8 GEMM ceiling: the dispatched op, then (first shape) each of its kernels
that runs here (``[pallas_triton]``, ``[triton]``, ``[mosaic_gpu]``, ``[cublaslt]``: cuBLASLt's block
modes once `mtjax.kernels.cublaslt` is built); ``--sweep`` adds one row per
candidate tile of the Pallas Triton and Mosaic GPU kernels (`mtjax.kernels.block_fp8_gemm.SWEEP_CONFIGS`,
`mtjax.kernels.mosaic_gpu.block_fp8_gemm.SWEEP_CONFIGS`). ``--layouts`` adds ``gemm layout`` rows:
each GEMM of a layer's forward and backward alone, in the shape it has there (``fwd`` ``[M, K] x [K,
N]``, ``dgrad`` ``[M, N] x [N, K]``, ``wgrad`` ``[K, M] x [M, N]``; operands cast beforehand, bf16
output): ``xla bf16``, ``per-tensor fp8`` (``lax.dot_general`` on E4M3 operands, the peer) and the
dispatched block-scaled GEMM with its second operand in 128x128 blocks (``block 1x128 x 128x128``:
`BlockScaling`'s forward and dgrad) or in 1x128 tiles (``block 1x128 x 1x128``: its wgrad).

Each row's ``extra`` counts the GEMMs of the compiled program (`gemm_calls`: ``fp8_gemms`` should be
3 per fwd+bwd on a GPU for per-tensor FP8, forward, dgrad and wgrad all on cuBLASLt's FP8 GEMM;
``triton_gemms`` counts those XLA emitted as Triton fusions instead; ``pallas_kernels`` the Pallas
Triton kernels, which block scaling's GEMMs and large casts are). The FP8 rows compile with
`mtjax.fp8.compiler_options()`, as mtjax's FP8 train steps do (on CUDA: no Triton GEMM fusions);
the bf16 peer with XLA's defaults.

Shapes: 8192^3, and the four GEMMs of a 1.3B GPT layer (hidden 2048, ffn 8192) at 8192 tokens.
``python -m mtjax.bench.gemm [--quick] [--sweep] [--layouts]`` prints the rows as a table.
"""

from __future__ import annotations

import argparse
import functools
import re

import jax
import jax.numpy as jnp
from jax import lax

from mtjax import backend, fp8, ops
from mtjax.bench import timing
from mtjax.kernels import block_fp8_gemm as block_fp8_gemm_kernel
from mtjax.kernels.block_fp8_gemm import SWEEP_CONFIGS, GemmConfig
from mtjax.kernels.mosaic_gpu import block_fp8_gemm as mosaic_block_fp8_gemm
from mtjax.kernels.mosaic_gpu.block_fp8_gemm import SWEEP_CONFIGS as MOSAIC_SWEEP_CONFIGS
from mtjax.kernels.mosaic_gpu.block_fp8_gemm import MosaicGemmConfig

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


def _bf16_dot(x, w, meta):
    return lax.dot_general(x, w, DENSE)


def _fp8_dot(recipe, x, w, meta):
    return fp8.fp8_dot_general(x, w, DENSE, meta, recipe=recipe)


def _fwd(dot, x, w, dy, meta):
    return dot(x, w, meta)


def _fwd_bwd(dot, x, w, dy, meta):
    y, vjp = jax.vjp(dot, x, w, meta)
    return (y, *vjp(dy))


BLOCK_RECIPE = fp8.BlockScaling()
DOTS = {  # implementation -> dot(x, w, meta) (meta: the delayed-scaling state, else None)
    "xla bf16": _bf16_dot,
    "mtjax fp8": functools.partial(_fp8_dot, fp8.DelayedScaling()),
    "mtjax fp8 block": functools.partial(_fp8_dot, BLOCK_RECIPE),
}
DTYPES = {"xla bf16": "bf16", "mtjax fp8": "fp8 (e4m3 fwd, e5m2 grads)",
          "mtjax fp8 block": "fp8 e4m3, 1x128 tiles / 128x128 weight blocks"}
MODES = {"fwd+bwd": (_fwd_bwd, 6), "fwd": (_fwd, 2)}  # mode -> (function, FLOPs per M*K*N)
# mode -> implementation -> jitted fn(x, w, dy, meta)
VARIANTS = {mode: {impl: jax.jit(functools.partial(fn, dot)) for impl, dot in DOTS.items()}
            for mode, (fn, _) in MODES.items()}


def _inputs(m: int, k: int, n: int, seed: int) -> list[tuple]:
    keys = jax.random.split(jax.random.key(seed), 64)

    def make(i):
        kx, kw, kg = jax.random.split(keys[i], 3)
        return (timing.random_array(kx, (m, k), jnp.bfloat16), timing.random_array(kw, (k, n), jnp.bfloat16, k**-0.5),
                timing.random_array(kg, (m, n), jnp.bfloat16, 1e-3))

    return timing.rotating(make)


def _calibrated_meta(inputs: tuple) -> dict:
    """The delayed-scaling meta after two steps, so the timed calls quantize with real (not initial) scales."""
    meta = fp8.init_meta(HISTORY)
    # Compiled as the timed FP8 rows are: XLA's default Triton GEMM autotuning of FP8 fusions takes minutes.
    step, _ = timing.compile_lowered(VARIANTS["fwd+bwd"]["mtjax fp8"].lower(*inputs, meta), fp8.compiler_options())
    for _ in range(2):
        meta = step(*inputs, meta)[3]
    return meta


def gemm_calls(hlo_text: str) -> dict[str, int]:
    """The GEMMs of a compiled (optimized) HLO module: cuBLASLt FP8 calls, other cuBLAS calls, and
    GEMMs XLA emitted as Triton fusions instead (its autotuner may pick those over cuBLAS)."""
    targets = re.findall(r'custom_call_target="(__cublas[^"]*)"', hlo_text)
    fp8_calls = sum(t.endswith("$f8") for t in targets)
    return {"fp8_gemms": fp8_calls, "other_gemms": len(targets) - fp8_calls,
            "triton_gemms": len(re.findall(r'"kind":"__triton(?:_nested)?_gemm(?:_fusion)?"', hlo_text)),
            "pallas_kernels": len(re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton"', hlo_text))}


def _block_operands(inputs: tuple) -> tuple:
    """The block-scaled GEMM's operands cast from ``(x, w, dy)`` as the forward GEMM takes them."""
    x, w, _ = inputs

    @jax.jit
    def cast(x, w):
        x_q, x_s = ops.tile_quantize(x, jnp.float8_e4m3fn)
        _, w_q_t, w_s = ops.block_quantize(w, jnp.float8_e4m3fn)
        return x_q, x_s, w_q_t, w_s.T

    return cast(x, w)


# The block-scaled GEMM's kernels beside the dispatched op (each where its backend runs).
BLOCK_GEMM_KERNELS = ("pallas_triton", "triton", "mosaic_gpu", "cublaslt")


def _block_gemm_fn(variant: str | GemmConfig | MosaicGemmConfig | None):
    """The GEMM alone: the dispatched op (``None``), one implementation of it (a name), or a kernel
    with a config's tiles (Pallas Triton's or Mosaic GPU's)."""
    if variant is None or isinstance(variant, str):
        return jax.jit(lambda a, sa, b, sb: ops.block_fp8_gemm(a, sa, b, sb, out_dtype=jnp.bfloat16,
                                                               implementation=variant))
    kernel = block_fp8_gemm_kernel if isinstance(variant, GemmConfig) else mosaic_block_fp8_gemm
    return jax.jit(lambda a, sa, b, sb: kernel.block_fp8_gemm(
        a, sa, b, jnp.repeat(sb, 128, axis=0)[:b.shape[0]], jnp.bfloat16, config=variant))


def _block_variant_label(variant) -> str:
    if variant is None:
        return "mtjax block kernel"
    return f"mtjax block kernel [{variant if isinstance(variant, str) else variant.label()}]"


def _gemm_only_rows(label: str, m: int, k: int, n: int, inputs: list[tuple], variants: list, quick: bool
                    ) -> list[dict]:
    rows = []
    operand_sets = [_block_operands(xs) for xs in inputs[:2]]
    for variant in variants:
        implementation = _block_variant_label(variant)
        try:
            fn = _block_gemm_fn(variant)
            compiled, _ = timing.compile_lowered(fn.lower(*operand_sets[0]), fp8.compiler_options())
            t = timing.measure(compiled, operand_sets, runs=3 if quick else 20)
        except Exception as err:  # noqa: BLE001 - a kernel that fails becomes a row; the run goes on
            rows.append(timing.error_row("gemm", f"block fp8 gemm {label} ({m}x{k}x{n})", implementation, err))
            continue
        rows.append(timing.row(
            "gemm", f"block fp8 gemm {label} ({m}x{k}x{n})", implementation, t, flops=2 * m * k * n,
            peer=None, ceiling="fp8_gemm_tflops", shape=[m, k, n], dtype=DTYPES["mtjax fp8 block"],
            **gemm_calls(compiled.as_text())))
    return rows


def _block_variants(first_shape: bool, sweep: bool) -> list:
    """The dispatched op, each kernel that runs here (on the first shape), and with ``sweep`` each
    candidate config of the Pallas Triton and Mosaic GPU kernels (first shape, where they run)."""
    runnable = [impl for impl in BLOCK_GEMM_KERNELS if _runs("block_fp8_gemm", impl)]
    variants: list = [None] + (runnable if first_shape else [])
    if sweep and first_shape:
        variants += list(SWEEP_CONFIGS) if "pallas_triton" in runnable else []
        variants += list(MOSAIC_SWEEP_CONFIGS) if "mosaic_gpu" in runnable else []
    return variants


# layout -> (a's shape, b's shape) of ``a @ b^T`` from a layer's (M, K, N): both operands contract
# their last axis, as FP8 tensor cores and `mtjax.ops.block_fp8_gemm` take them.
LAYOUTS = {"fwd": lambda m, k, n: ((m, k), (n, k)), "dgrad": lambda m, k, n: ((m, n), (k, n)),
           "wgrad": lambda m, k, n: ((k, m), (n, m))}
FP8 = jnp.float8_e4m3fn


CONTRACT_LAST = (((1,), (1,)), ((), ()))  # a [m, k] . b [n, k]


def _per_tensor_fp8_gemm(a, b):
    return lax.dot_general(a, b, CONTRACT_LAST, preferred_element_type=jnp.bfloat16)


def _block_scaled_gemm(a, a_scale_inv, b, b_scale_inv):
    return ops.block_fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype=jnp.bfloat16)


@jax.jit
def layout_operands(a: jax.Array, b: jax.Array) -> tuple[jax.Array, ...]:
    """``a [m, k]`` and ``b [n, k]`` (bf16) with their E4M3 and block-scaled forms: ``(a, b, a8, b8, aq,
    sa, bq_tiles, sb_tiles, bq_blocks, sb_blocks)``, the operands `LAYOUT_VARIANTS` pick from."""
    aq, sa = ops.tile_quantize(a, FP8)
    bq, sb = ops.tile_quantize(b, FP8)
    _, bq_blocks, sb_blocks = ops.block_quantize(b.T, FP8)  # b^T [k, n]: its transpose is b's blocks
    return a, b, a.astype(FP8), b.astype(FP8), aq, sa, bq, sb, bq_blocks, sb_blocks.T


def _layout_operands(a_shape: tuple, b_shape: tuple, seed: int) -> list[tuple]:
    keys = jax.random.split(jax.random.key(seed), 32)

    def make(i):
        ka, kb = jax.random.split(keys[i])
        return layout_operands(timing.random_array(ka, a_shape, jnp.bfloat16),
                               timing.random_array(kb, b_shape, jnp.bfloat16))

    return timing.rotating(make)


LAYOUT_VARIANTS = {  # implementation -> (fn, indices of its operands in `layout_operands`)
    "xla bf16": (jax.jit(functools.partial(lax.dot_general, dimension_numbers=CONTRACT_LAST)), (0, 1)),
    "per-tensor fp8": (jax.jit(_per_tensor_fp8_gemm), (2, 3)),
    "block 1x128 x 128x128": (jax.jit(_block_scaled_gemm), (4, 5, 8, 9)),
    "block 1x128 x 1x128": (jax.jit(_block_scaled_gemm), (4, 5, 6, 7)),
}


def _layout_rows(label: str, m: int, k: int, n: int, seed: int, quick: bool) -> list[dict]:
    rows = []
    for layout, shapes in LAYOUTS.items():
        a_shape, b_shape = shapes(m, k, n)
        (am, ak), bn = a_shape, b_shape[0]
        name = f"gemm layout {layout} {label} ({am}x{ak}x{bn})"
        operand_sets = _layout_operands(a_shape, b_shape, seed=seed)
        for implementation, (fn, picks) in LAYOUT_VARIANTS.items():
            sets = [tuple(xs[i] for i in picks) for xs in operand_sets]
            try:
                compiled, _ = timing.compile_lowered(fn.lower(*sets[0]), fp8.compiler_options())
                t = timing.measure(compiled, sets, runs=3 if quick else 20)
            except Exception as err:  # noqa: BLE001 - a kernel that fails becomes a row; the run goes on
                rows.append(timing.error_row("gemm", name, implementation, err))
                continue
            bf16 = implementation == "xla bf16"
            rows.append(timing.row(
                "gemm", name, implementation, t, flops=2 * am * ak * bn,
                peer=None if implementation in ("xla bf16", "per-tensor fp8") else "per-tensor fp8",
                ceiling="bf16_gemm_tflops" if bf16 else "fp8_gemm_tflops", shape=[am, ak, bn],
                dtype="bf16" if bf16 else "fp8 e4m3", **gemm_calls(compiled.as_text())))
    return rows


def run(quick: bool, sweep: bool = False, layouts: bool = False) -> list[dict]:
    """Rows (`timing.row`, suite ``"gemm"``) for every shape, mode and variant; peer: ``xla bf16``.
    ``sweep``: also the block-scaled GEMM with each candidate tile of its kernel (where it runs).
    ``layouts``: also each GEMM of a layer's forward and backward alone (`LAYOUTS`), per-tensor FP8
    against block-scaled."""
    rows = []
    for index, (label, m, k, n) in enumerate(QUICK_SHAPES if quick else SHAPES):
        inputs = _inputs(m, k, n, seed=index)
        meta = _calibrated_meta(inputs[0])
        for mode, (_, flops_per_mkn) in MODES.items():
            name = f"dense {mode} {label} ({m}x{k}x{n})"
            for implementation, fn in VARIANTS[mode].items():
                is_fp8 = implementation != "xla bf16"
                input_sets = [xs + (meta if implementation == "mtjax fp8" else None,) for xs in inputs]
                # Timed as compiled, so its HLO is what ran; FP8 compiled as mtjax's FP8 steps are.
                compiled, _ = timing.compile_lowered(fn.lower(*input_sets[0]),
                                                     fp8.compiler_options() if is_fp8 else None)
                t = timing.measure(compiled, input_sets, runs=3 if quick else 20)
                rows.append(timing.row(
                    "gemm", name, implementation, t, flops=flops_per_mkn * m * k * n,
                    peer="xla bf16" if is_fp8 else None,
                    ceiling="fp8_gemm_tflops" if is_fp8 else "bf16_gemm_tflops",
                    shape=[m, k, n], dtype=DTYPES[implementation], **gemm_calls(compiled.as_text())))
        rows += _gemm_only_rows(label, m, k, n, inputs, _block_variants(index == 0, sweep), quick)
        if layouts:
            rows += _layout_rows(label, m, k, n, index, quick)
    return rows


def _runs(op: str, implementation: str) -> bool:
    """Whether ``op``'s ``implementation`` can run on this platform (outside interpret mode)."""
    return backend.get_implementation(op, implementation).runs_on(backend.platform()) is None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--sweep", action="store_true", help="also time each candidate tile of the block GEMM kernel")
    parser.add_argument("--layouts", action="store_true",
                        help="also time forward, dgrad and wgrad GEMMs alone: per-tensor FP8 against block-scaled")
    args = parser.parse_args()
    rows = run(args.quick, sweep=args.sweep, layouts=args.layouts)
    times = {(r["name"], r["implementation"]): r["time_ms"] for r in rows}
    print(f"{'case':<56} {'implementation':<40} {'ms':>8} {'TFLOP/s':>8} {'vs peer':>8} {'fp8 GEMMs':>9}")
    for r in rows:
        if r["time_ms"] is None:  # a variant that failed: its error is in the label
            print(f"{r['name']:<56} {r['implementation']}")
            continue
        peer_ms = times.get((r["name"], r["peer"])) if r["peer"] else None
        ratio = f"{peer_ms / r['time_ms']:7.2f}x" if peer_ms else f"{'':>8}"
        print(f"{r['name']:<56} {r['implementation']:<40} {r['time_ms']:8.3f} {r['tflops']:8.1f} {ratio} "
              f"{r['extra']['fp8_gemms']:9d}")


if __name__ == "__main__":
    main()
