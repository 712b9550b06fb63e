"""``mtjax bench [suites...] [--quick] [--json PATH] [--plot PATH]``.

Every run first measures the machine's ceilings (`mtjax.bench.ceilings`), then each suite, then
prints one table (time, TFLOP/s or GB/s, speed-up over the peer, fraction of the ceiling, MFU) and
optionally writes the rows as JSON and a PNG chart. ``--quick`` runs tiny shapes (a CPU smoke test).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import sys

import jax

from mtjax.bench import ceilings, report, timing, variants

# suite -> module exposing run(quick: bool) -> list[dict] (rows from mtjax.bench.timing.row)
SUITES = {
    "gemm": "mtjax.bench.gemm",
    "norm": "mtjax.bench.norm",
    "attention": "mtjax.bench.attention",
    "layer": "mtjax.bench.layer",
    "train": "mtjax.bench.train",
    "decode": "mtjax.bench.decode",
    "moe": "mtjax.bench.moe",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suites", nargs="*", metavar="SUITE",
                        help=f"suites to run, from {list(SUITES)} (default: every one installed)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few runs: a smoke test (CPU)")
    parser.add_argument("--json", metavar="PATH", help="write {'meta': ..., 'results': [rows]} here")
    parser.add_argument("--progress-jsonl", metavar="PATH",
                        help="append each row as one JSON line the moment it is measured (kept if a run is cut short)")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG chart of speed-ups here (needs matplotlib)")
    parser.add_argument("--peak-tflops", type=float, default=report.H200_BF16_PEAK_TFLOPS,
                        help="dense bf16 peak used as the MFU denominator (default: H200, %(default)s)")
    parser.add_argument("--presets", nargs="+", metavar="NAME",
                        help="train suite: GPT presets to train (default: gpt-1.3b; tiny with --quick); decode suite: "
                             "presets to decode (default: llama-1b gpt-1.3b; tiny with --quick)")
    parser.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,...]",
                        help="layer, train, decode and attention suites: also run mtjax with these kernel choices "
                             "(OP=IMPL), module switches (SWITCH=true|false) and XLA options (xla_...=VALUE); "
                             "repeatable, one extra pair of rows each")
    parser.add_argument("--train-rows", nargs="+", metavar="LABEL",
                        help="train suite: run only these rows, by label (mtjax, flax, 'mtjax fp8', 'flax fp8', "
                             "'mtjax fp8 [recipe=block]', ...), e.g. to fit a time-limited GPU call")
    parser.add_argument("--sweep", action="store_true",
                        help="gemm suite: also time each candidate tile of the block-scaled FP8 GEMM kernel")
    parser.add_argument("--layouts", action="store_true",
                        help="gemm suite: also time a layer's forward, dgrad and wgrad GEMMs alone, per-tensor FP8 "
                             "against block-scaled")
    parser.add_argument("--profile", metavar="DIR",
                        help="train and decode suites: write a per-op GPU-time profile of each step into DIR")
    from mtjax.bench import decode, moe

    decode.add_arguments(parser.add_argument_group("decode suite"))
    moe.add_arguments(parser.add_argument_group("moe suite"))


def _available(name: str) -> bool:
    try:
        return importlib.util.find_spec(SUITES[name]) is not None
    except ModuleNotFoundError:
        return False


def _run_suite(name: str, args: argparse.Namespace, settings: list[variants.Setting]) -> list[dict]:
    module = importlib.import_module(SUITES[name])
    if name == "train":
        return module.run(args.quick, presets=args.presets, profile_dir=args.profile, settings=settings,
                          only=args.train_rows)
    if name == "layer":
        return module.run(args.quick, settings=settings)
    if name == "decode":
        return module.run(args.quick, models=args.presets, batches=args.decode_batches,
                          contexts=args.decode_contexts, parts=args.decode_parts, settings=settings,
                          profile_dir=args.profile)
    if name == "moe":
        return module.run(args.quick, presets=args.moe_presets, tiles=module.tiles_from_args(args),
                          parts=args.moe_parts, gemm_experts=args.moe_gemm_experts, train_batch=args.moe_train_batch)
    if name == "gemm":
        return module.run(args.quick, sweep=args.sweep, layouts=args.layouts)
    if name == "attention":
        return module.run(args.quick, settings=tuple(settings))
    return module.run(args.quick)


def run(args: argparse.Namespace) -> int:
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        print(f"mtjax bench: unknown suite(s) {unknown}; accepted: {list(SUITES)}", file=sys.stderr)
        return 2
    missing = [s for s in args.suites if not _available(s)]
    if missing:
        print(f"mtjax bench: suite(s) {missing} are not installed in this version of mtjax", file=sys.stderr)
        return 2
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("mtjax bench: --plot needs matplotlib (pip install 'mtjax[plot]')", file=sys.stderr)
        return 2
    try:
        settings = [variants.parse(spec) for spec in args.variant]
    except ValueError as err:
        print(f"mtjax bench: {err}", file=sys.stderr)
        return 2
    suites = args.suites or [s for s in SUITES if _available(s)]
    skipped = [s for s in SUITES if s not in suites]

    timing.set_progress(sys.stderr, args.progress_jsonl)
    rows, ceiling_values = ceilings.run(args.quick)
    print(report.table(report.complete(rows, ceiling_values, args.peak_tflops)), file=sys.stderr, flush=True)
    for name in suites:
        print(f"mtjax bench: running {name}...", file=sys.stderr, flush=True)
        suite_rows = _run_suite(name, args, settings)
        # Each suite's rows as soon as it ends, so a run cut short still reports what it measured.
        print(report.table(report.complete(suite_rows, ceiling_values, args.peak_tflops)), file=sys.stderr, flush=True)
        rows += suite_rows
    rows = report.complete(rows, ceiling_values, args.peak_tflops)

    device = jax.devices()[0]
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "command": "mtjax bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "quick": args.quick,
        "peak_tflops": args.peak_tflops,
        "ceilings": ceiling_values,
        "suites": suites,
        "suites_not_run": skipped,
        "variants": [s.label() for s in settings],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    print(f"{meta['date']}  {meta['device']}  jax {meta['jax']}  MFU of {args.peak_tflops:g} TFLOP/s")
    print(report.table(rows))
    if skipped:
        print(f"not run: {', '.join(skipped)}")
    if args.json:
        report.write_json(args.json, rows, meta)
    if args.plot:
        report.plot(args.plot, rows, f"mtjax bench on {meta['device']}, {meta['date']}")
    return 0
