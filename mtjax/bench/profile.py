"""Where a step's device time goes: a per-kernel breakdown from jax's profiler.

`profile` runs a function a few times under ``jax.profiler.trace`` and reads the Perfetto trace it
writes: the device's kernel events are summed by HLO op (or kernel name) and sorted into categories
(GEMM, attention, mtjax's Pallas kernels, XLA fusions, copies, collectives, other), so the biggest gaps
against the ceilings are visible without a GUI. Given the optimized HLO (`op_sources`), the time is
also summed by the JAX operation that emitted each HLO op, with layer indices folded, so that
"every layer's fc1 weight gradient" is one line.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import jax

# Substrings of a kernel's name (lower case) -> category. First match wins.
CATEGORIES = (
    ("attention", ("fmha", "flash", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "cublas", "cutlass", "xmma", "nvjet", "matmul", "dot")),
    ("pallas", ("mtjax_",)),  # mtjax's own Pallas kernels (named mtjax_*) other than attention
    ("collective", ("nccl", "all-reduce", "all-gather", "reduce-scatter", "collective")),
    ("copy", ("memcpy", "memset", "copy", "transpose")),
    ("fusion", ("fusion", "triton", "reduce", "loop_", "input_", "convert", "broadcast")),
)


def category(name: str) -> str:
    lowered = name.lower()
    for label, needles in CATEGORIES:
        if any(n in lowered for n in needles):
            return label
    return "other"


def _device_events(trace: Mapping[str, Any]) -> list[dict]:
    """Complete ('X') events of the device's kernel lanes (CUDA streams), or its XLA-op lane."""
    events = trace["traceEvents"]
    process_names = {e["pid"]: e["args"]["name"] for e in events
                     if e.get("ph") == "M" and e.get("name") == "process_name"}
    thread_names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
                    if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device_pids = {pid for pid, name in process_names.items() if "/device:" in name}
    lanes = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device_pids:
            lanes[thread_names.get((e["pid"], e.get("tid")), "")].append(e)
    streams = [lane for lane in lanes if lane.lower().startswith("stream")]
    chosen = streams or [lane for lane in lanes if "xla ops" in lane.lower()] or list(lanes)
    return [e for lane in chosen for e in lanes[lane]]


_OP_NAME = re.compile(r'^\s*(?:ROOT )?%(\S+) = .*?op_name="([^"]+)"', re.MULTILINE)
_LAYER_INDEX = re.compile(r"layers_\d+")


def op_sources(hlo_text: str) -> dict[str, str]:
    """``{HLO instruction: op_name}`` from an optimized HLO module's metadata (the JAX operation that
    emitted it, e.g. ``jit(step)/transpose(jvp(GPT))/layers_*/mlp/wi_dot_general/dot_general``),
    layer indices folded to ``layers_*`` so that an unrolled stack's layers add up."""
    return {m[1]: _LAYER_INDEX.sub("layers_*", m[2]) for m in _OP_NAME.finditer(hlo_text)}


def summarize(trace: Mapping[str, Any], steps: int, sources: Mapping[str, str] | None = None) -> dict:
    """Per-step device time by category and the top ops, in milliseconds; with ``sources``
    (`op_sources`) also the top source operations (``by_source_ms``)."""
    by_op: dict[str, float] = collections.Counter()
    by_source: dict[str, float] = collections.Counter()
    by_category: dict[str, float] = collections.Counter()
    kernel_of_op: dict[str, str] = {}
    for e in _device_events(trace):
        args = e.get("args", {})
        op = args.get("hlo_op") or args.get("long_name") or e["name"]
        ms = e.get("dur", 0.0) / 1e3 / steps
        by_op[op] += ms
        if sources is not None:
            by_source[sources.get(op, op)] += ms
        # Per event, not per op: a cuBLAS custom call's first event is often its workspace memset.
        by_category[category(f"{e['name']} {op}")] += ms
        if not e["name"].startswith("Memset"):
            kernel_of_op.setdefault(op, e["name"])
    top = [(op, kernel_of_op.get(op, op), ms) for op, ms in sorted(by_op.items(), key=lambda kv: -kv[1])[:40]]
    summary = {
        "device_ms_per_step": sum(by_op.values()),
        "by_category_ms": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top_ops_ms": [{"op": op, "kernel": kernel[:120], "ms": ms, "category": category(f"{kernel} {op}")}
                       for op, kernel, ms in top],
    }
    if sources is not None:
        summary["by_source_ms"] = dict(sorted(by_source.items(), key=lambda kv: -kv[1])[:40])
    return summary


def profile(run_once: Callable[[], Any], *, steps: int = 3, out_dir: str | None = None,
            label: str = "profile", hlo_text: str | None = None) -> dict:
    """Profile ``steps`` calls of ``run_once`` (already compiled and warm); returns `summarize`'s dict
    (with ``by_source_ms`` when given the compiled program's ``hlo_text``).

    With ``out_dir`` the Perfetto trace is kept as ``<out_dir>/<label>.trace.json.gz`` (open it in
    ui.perfetto.dev).
    """
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(run_once())
        path = sorted(glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
        with gzip.open(path) as f:
            summary = summarize(json.load(f), steps, None if hlo_text is None else op_sources(hlo_text))
        if out_dir is not None:
            os.makedirs(out_dir, exist_ok=True)
            shutil.copy(path, os.path.join(out_dir, f"{label}.trace.json.gz"))
    return summary


def format_summary(label: str, summary: Mapping[str, Any], top: int = 12) -> str:
    lines = [f"profile {label}: {summary['device_ms_per_step']:.2f} ms of device time per step"]
    lines += [f"  {cat:<11} {ms:9.2f} ms" for cat, ms in summary["by_category_ms"].items()]
    if "by_source_ms" in summary:
        lines += [f"    {ms:8.3f} ms  {source[-100:]}" for source, ms in list(summary["by_source_ms"].items())[:top]]
    else:
        lines += [f"    {t['ms']:8.3f} ms  {t['category']:<10} {t['op'][:70]}" for t in summary["top_ops_ms"][:top]]
    return "\n".join(lines)
