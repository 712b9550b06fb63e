"""`mtjax bench attention`: `mtjax.ops.attention` (its default choice, the Pallas Triton kernel, its
native Triton port and the Mosaic GPU kernels) side by side with cuDNN and XLA, forward and
forward+backward, bf16.

FLOPs as in docs/performance.md: ``4·B·H·Tq·Tk·D`` forward (halved when causal), 3.5x that for
forward+backward. The ``mtjax`` row is the implementation the default selection picks for the case
(named in ``extra["chosen"]``), so its time is that implementation's; the peer of every mtjax row is cuDNN.
Each ``--variant`` (kernel choices and switches, `mtjax.bench.variants`) adds an ``mtjax [setting]`` row:
the default selection traced under the setting (``--variant attention=triton,tma_row_limits=false``).
An implementation that fails (a kernel that does not compile, out of memory) gives a row with the
error instead of numbers, and the run goes on.

``python -m mtjax.bench.attention --sweep`` times block-size candidates of the kernel on the headline
case (how `kernels.flash_attention.BlockSizes.default` was tuned), and the Mosaic GPU kernels' configs
(`mtjax.kernels.mosaic_gpu.flash_attention.SWEEP_CONFIGS`) where they run.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from mtjax import backend, ops
from mtjax.bench import variants
from mtjax.bench.timing import error_row, measure, random_array, rotating, row
from mtjax.kernels import flash_attention as fa
from mtjax.kernels.mosaic_gpu import flash_attention as mosaic_attention


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool

    @property
    def label(self) -> str:
        heads = f"H{self.heads}" if self.kv_heads == self.heads else f"H{self.heads}/KV{self.kv_heads}"
        return f"{'causal' if self.causal else 'full'} B{self.batch} S{self.seq} {heads} D{self.head_dim} bf16"

    def flops(self, backward: bool) -> float:
        forward = 4 * self.batch * self.heads * self.seq * self.seq * self.head_dim / (2 if self.causal else 1)
        return forward * (3.5 if backward else 1.0)

    def inputs(self, seed: int) -> tuple:
        keys = jax.random.split(jax.random.PRNGKey(seed), 4)
        q_shape = (self.batch, self.seq, self.heads, self.head_dim)
        kv_shape = (self.batch, self.seq, self.kv_heads, self.head_dim)
        return (random_array(keys[0], q_shape, jnp.bfloat16), random_array(keys[1], kv_shape, jnp.bfloat16),
                random_array(keys[2], kv_shape, jnp.bfloat16), random_array(keys[3], q_shape, jnp.bfloat16))


HEADLINE = Case(4, 4096, 32, 32, 128, True)
# Most telling first: a run cut short still has the headline.
CASES = (
    HEADLINE,
    Case(4, 4096, 32, 32, 128, False),
    Case(4, 4096, 32, 4, 128, True),
    Case(4, 4096, 32, 32, 64, True),
    Case(4, 4096, 32, 32, 64, False),
    Case(16, 1024, 32, 32, 128, True),
    Case(16, 1024, 32, 32, 128, False),
    Case(1, 16384, 32, 32, 128, True),
    Case(1, 16384, 32, 32, 128, False),
)
QUICK_CASES = (Case(1, 128, 2, 1, 64, True),)
# Samples span at least this long (up to `timing.measure`'s 100 calls each): samples of only a few
# calls of a millisecond kernel vary between rounds of one process far more than the differences
# being compared.
SAMPLE_S = 20e-3
# XLA materialises the logits (and is 10x slower): timed on the headline and the short cases only.
XLA_CASES = (HEADLINE, Case(16, 1024, 32, 32, 128, True), Case(16, 1024, 32, 32, 128, False)) + QUICK_CASES


def _function(case: Case, implementation: str | None, backward: bool, block_sizes: fa.BlockSizes | None = None,
              mosaic_config: mosaic_attention.AttentionConfig | None = None):
    mask_type = "causal" if case.causal else "no_mask"
    if mosaic_config is not None:  # a tuning candidate of the Mosaic GPU kernels
        def attend(q, k, v):
            return fa.flash_attention(q, k, v, scale=case.head_dim ** -0.5, causal=case.causal, ptx_exp2=False,
                                      launchers=mosaic_attention.launchers(mosaic_config))
    elif block_sizes is None:
        def attend(q, k, v):
            return ops.attention(q, k, v, mask_type=mask_type, implementation=implementation)
    else:  # a tuning candidate: the kernel itself with explicit tiles
        def attend(q, k, v):
            return fa.flash_attention(q, k, v, scale=case.head_dim ** -0.5, causal=case.causal, block_sizes=block_sizes)

    if not backward:
        return jax.jit(lambda q, k, v, do: attend(q, k, v))
    return jax.jit(lambda q, k, v, do: jax.vjp(attend, q, k, v)[1](do))


def _chosen(case: Case) -> str:
    q, k, v, _ = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in case.inputs(0))
    static = dict(mask_type="causal" if case.causal else "no_mask", scale=case.head_dim ** -0.5, dropout_rate=0.0,
                  window_size=None, logits_soft_cap=None)
    return backend.select("attention", args=(q, k, v, None, None, None, None, None), static=static)[0].name


def _runnable(implementation: str) -> bool:
    return backend.get_implementation("attention", implementation).runs_on(backend.platform()) is None


IMPLEMENTATIONS = ("pallas_triton", "triton", "mosaic_gpu", "cudnn", "xla")


def case_rows(case: Case, *, runs: int = 10, settings: tuple[variants.Setting, ...] = ()) -> list[dict]:
    """The rows of one case: each runnable implementation, forward and forward+backward, then the
    default selection under each of ``settings``."""
    rows = []
    inputs = rotating(case.inputs)
    chosen = _chosen(case)
    implementations = [i for i in IMPLEMENTATIONS if _runnable(i)]
    if case not in XLA_CASES and chosen != "xla":
        implementations.remove("xla")
    for backward in (False, True):
        direction = "fwd+bwd" if backward else "fwd"
        name = f"attention {direction} {case.label}"
        flops = case.flops(backward)
        extra = dict(shape=[case.batch, case.seq, case.heads, case.kv_heads, case.head_dim], causal=case.causal,
                     direction=direction)
        peer = "cudnn" if "cudnn" in implementations else None
        timings = {}
        for implementation in implementations:
            label = implementation if implementation in ("cudnn", "xla") else f"mtjax {implementation}"
            try:
                timings[implementation] = measure(_function(case, implementation, backward), inputs, runs=runs,
                                                  min_sample_s=SAMPLE_S)
            except Exception as err:  # noqa: BLE001 - a failing implementation becomes a row; the run goes on
                rows.append(error_row("attention", name, label, err, **extra))
                continue
            rows.append(row("attention", name, label, timings[implementation], flops=flops,
                            peer=None if implementation == "cudnn" else peer, ceiling="bf16_gemm_tflops", **extra))
        if chosen in timings:
            rows.append(row("attention", name, "mtjax", timings[chosen], flops=flops, peer=peer,
                            ceiling="bf16_gemm_tflops", chosen=chosen, **extra))
        for setting in settings:
            label = f"mtjax [{setting.label()}]"
            try:
                with variants.mtjax_context(False, setting):  # traced (first call) under the setting
                    timed = measure(_function(case, None, backward), inputs, runs=runs, min_sample_s=SAMPLE_S)
            except Exception as err:  # noqa: BLE001 - a failing setting becomes a row; the run goes on
                rows.append(error_row("attention", name, label, err, **extra))
                continue
            rows.append(row("attention", name, label, timed, flops=flops, peer=peer, ceiling="bf16_gemm_tflops",
                            **extra))
    return rows


def run(quick: bool, settings: tuple[variants.Setting, ...] = ()) -> list[dict]:
    """Every case's rows (`case_rows`); ``settings``: ``--variant`` kernel choices and switches (model,
    train and recipe settings do not apply)."""
    for setting in settings:
        if setting.model or setting.train or setting.recipe or setting.xla_options:
            raise ValueError(f"mtjax bench attention: --variant {setting.label()}: only op=implementation and "
                             "switches apply to the attention suite")
    return [r for case in (QUICK_CASES if quick else CASES)
            for r in case_rows(case, runs=5 if quick else 10, settings=tuple(settings))]


def sweep(case: Case = HEADLINE) -> list[tuple[str, float, float]]:
    """TFLOP/s of block-size candidates (forward alone, then forward+backward), printed as a table."""
    base = fa.BlockSizes.default(case.head_dim)
    forward = [dict(block_q=bq, block_k=bk, num_warps=w, num_stages=s)
               for bq, bk, w, s in ((128, 64, 4, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2),
                                    (128, 64, 4, 3), (128, 64, 8, 4), (64, 64, 4, 2), (128, 32, 4, 4))]
    backward = ([dict(dkdv_block_q=bq, dkdv_block_k=bk, dkdv_num_warps=w, dkdv_num_stages=s)
                 for bq, bk, w, s in ((64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2),
                                      (64, 128, 8, 3), (128, 128, 8, 2), (32, 64, 4, 4))]
                + [dict(dq_block_q=bq, dq_block_k=bk, dq_num_warps=w, dq_num_stages=s)
                   for bq, bk, w, s in ((128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 8, 2),
                                        (128, 32, 4, 4))])
    inputs = rotating(case.inputs)
    candidates = [(backward_pass, dict(block_sizes=dataclasses.replace(base, **changes)),
                   ("fwd+bwd " if backward_pass else "fwd ") + " ".join(f"{k}={v}" for k, v in changes.items()))
                  for backward_pass, options in ((False, forward), (True, backward)) for changes in options]
    if _runnable("mosaic_gpu"):  # the Mosaic GPU kernels' configs, forward and forward+backward
        candidates += [(backward_pass, dict(mosaic_config=config), f"{'fwd+bwd' if backward_pass else 'fwd'} {config}")
                       for config in (mosaic_attention.DEFAULT_CONFIG, *mosaic_attention.SWEEP_CONFIGS)
                       for backward_pass in (False, True)]
    results = []
    for backward_pass, options, label in candidates:
        try:
            t = measure(_function(case, None, backward_pass, **options), inputs, runs=5, min_sample_s=SAMPLE_S).median
            results.append((label, t * 1e3, case.flops(backward_pass) / t / 1e12))
        except Exception as err:
            results.append((label + f"  FAILED {type(err).__name__}: {str(err)[:120]}", float("nan"), float("nan")))
        print(f"{results[-1][0]:<90} {results[-1][1]:9.3f} ms {results[-1][2]:7.1f} TFLOP/s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time block-size candidates on the headline case")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke test)")
    parser.add_argument("--json", metavar="PATH", help="write the rows here, rewritten after every case")
    args = parser.parse_args()
    if args.sweep:
        sweep()
        return
    from mtjax.bench import report

    rows = []
    for case in QUICK_CASES if args.quick else CASES:
        new = report.complete(case_rows(case, runs=5 if args.quick else 10), {}, report.H200_BF16_PEAK_TFLOPS)
        rows += new
        for r in new:
            if r["time_ms"] is None:
                print(f"{r['name']:<58} {r['implementation']}", flush=True)
                continue
            versus = f"  {r['speedup_vs_peer']:.2f}x vs {r['peer']}" if r["speedup_vs_peer"] else ""
            print(f"{r['name']:<58} {r['implementation']:<20} {r['time_ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s"
                  + versus, flush=True)
        if args.json:
            report.write_json(args.json, rows, {"suite": "attention", "device": jax.devices()[0].device_kind})


if __name__ == "__main__":
    main()
