"""How every `mtjax bench` suite times code, and the row each measurement becomes.

A suite module (``mtjax.bench.gemm``, ``norm``, ``attention``, ``layer``, ``train``) exposes
``run(quick: bool) -> list[dict]`` and builds its rows with `row`. The CLI then fills in what needs
every row of the run: the ratio to the peer row and the fraction of the machine's ceiling.

Timing rules (`measure`, `measure_steps`):
- compile and run ``warmup`` times before timing, so compilation and autotuning stay out;
- every sample ends with ``jax.block_until_ready``; the median over ``runs`` samples is reported
  (a train step's sample is a few steps dispatched back to back, as training runs them);
- a sample of a fast function repeats the call enough times to last ~2 ms (``inner``), so launch
  overhead of the host does not dominate microsecond kernels;
- calls cycle through several input sets (`rotating`) so a small problem is not served from L2.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

# H200: 50 MiB of L2. Inputs rotated through at least twice that are never served from cache.
L2_BYTES = 50 * 2**20

# Every row carries exactly these keys (JSON-safe values; None where a quantity does not apply).
ROW_FIELDS = (
    "suite",            # "ceiling", "gemm", "norm", "attention", "layer", "train"
    "name",             # the case, e.g. "layernorm fwd+bwd 16384x8192 bf16"; rows of one case share it
    "implementation",   # who computed it, e.g. "mtjax", "mtjax fp8", "xla", "flax", "flax fp8"
    "time_ms",          # median of the timed samples, per call
    "time_ms_min",
    "time_ms_max",
    "runs",             # timed samples
    "flops",            # floating-point operations per call (None for memory-bound ops)
    "bytes",            # bytes moved per call, counted as each input read once, each output written once
    "tflops",           # flops / time
    "gbps",             # bytes / time
    "peer",             # implementation name of the row this one is compared with (same suite+name)
    "speedup_vs_peer",  # peer time / this time; filled by the CLI
    "ceiling",          # "copy_gbps", "bf16_gemm_tflops" or "fp8_gemm_tflops": the rate this is bound by
    "fraction_of_ceiling",  # this row's rate / the measured ceiling; filled by the CLI
    "mfu",              # model FLOP/s / peak (train and layer rows); filled by the CLI from `flops`
    "extra",            # dict of suite-specific numbers (tokens/s, batch, ...)
)

# The ceilings every run measures (`mtjax.bench.ceilings`), by the key a row's ``ceiling`` names.
CEILING_KEYS = ("copy_gbps", "bf16_gemm_tflops", "fp8_gemm_tflops")


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call: median, min and max over ``runs`` samples."""

    median: float
    min: float
    max: float
    runs: int


def _block(x: Any) -> Any:
    return jax.block_until_ready(x)


def rotating(make: Callable[[int], tuple], *, min_bytes: int = 2 * L2_BYTES, max_sets: int = 16) -> list[tuple]:
    """Input sets ``make(i)`` (tuples of arrays), enough that together they exceed ``min_bytes``.

    ``make`` must return fresh random inputs for each ``i``; one set is enough when it alone is larger
    than the cache.
    """
    first = make(0)
    per_set = sum(x.nbytes for x in jax.tree.leaves(first))
    count = min(max_sets, max(1, math.ceil(min_bytes / max(per_set, 1))))
    return [first] + [make(i) for i in range(1, count)]


def measure(fn: Callable[..., Any], input_sets: Sequence[tuple], *, warmup: int = 2, runs: int = 20,
            min_sample_s: float = 2e-3) -> Timing:
    """Time ``fn(*inputs)`` (a jitted function), cycling through ``input_sets``; see the module docstring."""
    if not input_sets:
        raise ValueError("measure(input_sets=...): need at least one tuple of inputs")
    if warmup < 1 or runs < 1:
        raise ValueError(f"measure(warmup={warmup}, runs={runs}): both must be >= 1")
    for i in range(warmup):
        start = time.perf_counter()
        _block(fn(*input_sets[i % len(input_sets)]))
        once = time.perf_counter() - start
    inner = max(1, min(100, math.ceil(min_sample_s / max(once, 1e-7))))
    samples = []
    call = 0
    for _ in range(runs):
        start = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*input_sets[call % len(input_sets)])
            call += 1
        _block(out)
        samples.append((time.perf_counter() - start) / inner)
    return Timing(statistics.median(samples), min(samples), max(samples), runs)


def measure_steps(step: Callable[..., Any], state: Any, batches: Sequence[Any], *, warmup: int = 2,
                  runs: int = 10, steps_per_sample: int = 3) -> tuple[Timing, Any]:
    """Time ``state, aux = step(state, batch)`` (a jitted train step that may donate ``state``).

    The state is threaded from call to call as in training; batches cycle. Each sample dispatches
    ``steps_per_sample`` steps back to back and blocks once, as a training loop that does not read
    its metrics every step runs: the host dispatches the next step while the device runs this one.
    (Blocking after every step would add the host's dispatch of the model's state to each step.)
    Returns the per-step timing and the last ``(state, aux)`` so callers can check the loss is finite.
    """
    if not batches:
        raise ValueError("measure_steps(batches=...): need at least one batch")
    if warmup < 1 or runs < 1 or steps_per_sample < 1:
        raise ValueError(f"measure_steps(warmup={warmup}, runs={runs}, steps_per_sample={steps_per_sample}): "
                         "each must be >= 1")
    out = None
    for i in range(warmup):
        out = step(state, batches[i % len(batches)])
        state = out[0]
        _block(out)
    samples = []
    call = 0
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(steps_per_sample):
            out = step(state, batches[call % len(batches)])
            state = out[0]
            call += 1
        _block(out)
        samples.append((time.perf_counter() - start) / steps_per_sample)
    return Timing(statistics.median(samples), min(samples), max(samples), runs), out


def compile_lowered(lowered: Any, options: Mapping[str, Any] | None = None) -> tuple[Any, float]:
    """``(compiled, seconds)`` of a ``jax.stages.Lowered`` with XLA compiler ``options``.

    Variants are compiled one at a time, each right before it is timed: concurrent compilations
    autotune their GEMMs on a busy GPU (worse kernel choices), and on the H200 six concurrent
    1.3B-parameter train steps took over four minutes without a single result to show.
    """
    start = time.perf_counter()
    return lowered.compile(compiler_options=dict(options) if options else None), time.perf_counter() - start


def row(suite: str, name: str, implementation: str, timing: Timing, *, flops: float | None = None,
        bytes: int | None = None, peer: str | None = None, ceiling: str | None = None,
        **extra: Any) -> dict:
    """One result row with every key of `ROW_FIELDS`; rates computed from ``timing``.

    Args:
      peer: the ``implementation`` of the row (same suite and name) this one is compared with.
      ceiling: which measured ceiling bounds this case: ``"copy_gbps"`` for memory-bound ops,
        ``"bf16_gemm_tflops"`` or ``"fp8_gemm_tflops"`` for compute-bound ones.
      extra: suite-specific numbers, JSON-serializable.
    """
    if ceiling is not None and ceiling not in CEILING_KEYS:
        raise ValueError(f"row(ceiling={ceiling!r}): accepted values are {CEILING_KEYS} or None")
    seconds = timing.median
    out = {
        "suite": suite,
        "name": name,
        "implementation": implementation,
        "time_ms": seconds * 1e3,
        "time_ms_min": timing.min * 1e3,
        "time_ms_max": timing.max * 1e3,
        "runs": timing.runs,
        "flops": None if flops is None else float(flops),
        "bytes": None if bytes is None else int(bytes),
        "tflops": None if flops is None else flops / seconds / 1e12,
        "gbps": None if bytes is None else bytes / seconds / 1e9,
        "peer": peer,
        "speedup_vs_peer": None,
        "ceiling": ceiling,
        "fraction_of_ceiling": None,
        "mfu": None,
        "extra": {k: _plain(v) for k, v in extra.items()},
    }
    report_progress(out)
    return out


# Where `row` reports each row as it is made (set by the bench CLI): a run cut short by a time limit
# keeps what it measured.
_progress: dict[str, Any] = {"stream": None, "jsonl": None, "start": time.perf_counter()}


def set_progress(stream: Any = None, jsonl_path: str | None = None) -> None:
    """Report every row made from now on: one line to ``stream`` and one JSON line appended to
    ``jsonl_path`` (either may be None)."""
    _progress.update(stream=stream, jsonl=jsonl_path, start=time.perf_counter())


def note(message: str) -> None:
    """One progress line (elapsed seconds first) where `set_progress` named a stream."""
    if _progress["stream"] is not None:
        print(f"[{time.perf_counter() - _progress['start']:6.0f}s] {message}", file=_progress["stream"], flush=True)


def report_progress(r: dict) -> None:
    stream, path = _progress["stream"], _progress["jsonl"]
    if stream is not None:
        ms = "-" if r["time_ms"] is None or math.isnan(r["time_ms"]) else f"{r['time_ms']:.3f} ms"
        elapsed = time.perf_counter() - _progress["start"]
        print(f"[{elapsed:6.0f}s] {r['suite']} | {r['name']} | {r['implementation']} | {ms}", file=stream, flush=True)
    if path is not None:
        import json

        with open(path, "a") as f:
            f.write(json.dumps(r, default=str) + "\n")



def _plain(value: Any) -> Any:
    """A JSON-serializable version of ``value`` (numpy scalars become Python numbers)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def random_array(key: jax.Array, shape: Sequence[int], dtype: Any, scale: float = 1.0) -> jax.Array:
    """Normal random values of ``dtype`` (never zeros: zeros can run faster than real data)."""
    return (jax.random.normal(key, tuple(shape), jax.numpy.float32) * scale).astype(dtype)


def device_memory_bytes() -> int | None:
    """The first device's memory limit in bytes, or None where the backend does not report it (CPU)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU backends may not report
        return None
    return stats.get("bytes_limit")
