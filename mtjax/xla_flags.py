"""XLA flag presets for multi-GPU runs, in one place.

XLA reads ``XLA_FLAGS`` once, when jax creates its backends, so the flags must be in the
environment before the first jax computation (`mtjax train --xla-preset` sets them before it
joins the job). Every flag here exists in the XLA of the supported jax versions (an unknown flag
is a fatal error at start-up); `mtjax info` lists the presets and what ``XLA_FLAGS`` holds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# name -> flags. "multi_gpu": the MaxText / JAX-Toolbox practice for NVLink / InfiniBand jobs.
XLA_FLAG_PRESETS: Mapping[str, tuple[str, ...]] = {
    "multi_gpu": (
        # Schedule collectives asynchronously and overlap them with independent compute.
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_gpu_enable_highest_priority_async_stream=true",
        # Combine small collectives (FSDP's per-layer gathers and reduce-scatters) into large ones.
        "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
        "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
        "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
        "--xla_gpu_enable_all_gather_combine_by_dim=false",
        "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
        # Issue the next scanned layer's collectives during the current layer.
        "--xla_gpu_enable_pipelined_all_gather=true",
        "--xla_gpu_enable_pipelined_reduce_scatter=true",
        "--xla_gpu_enable_pipelined_all_reduce=true",
        "--xla_gpu_enable_while_loop_double_buffering=true",
    ),
}
XLA_PRESETS = tuple(XLA_FLAG_PRESETS)


def xla_flags(preset: str = "multi_gpu") -> list[str]:
    """The flags of ``preset`` (one of `XLA_PRESETS`)."""
    if preset not in XLA_FLAG_PRESETS:
        raise ValueError(f"xla_flags(preset={preset!r}): accepted: {', '.join(XLA_PRESETS)}")
    return list(XLA_FLAG_PRESETS[preset])


def apply_xla_flags(preset: str = "multi_gpu", environ: dict[str, str] | None = None) -> str:
    """Add ``preset``'s flags to ``XLA_FLAGS`` (of ``environ``, default ``os.environ``); returns the new value.

    A flag already set there keeps its value: the user's own ``XLA_FLAGS`` win.
    """
    environ = os.environ if environ is None else environ
    current = environ.get("XLA_FLAGS", "").split()
    names = {flag.split("=", 1)[0] for flag in current}
    added = [flag for flag in xla_flags(preset) if flag.split("=", 1)[0] not in names]
    environ["XLA_FLAGS"] = " ".join(current + added)
    return environ["XLA_FLAGS"]
