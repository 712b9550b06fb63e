"""``mtjax info``: what mtjax sees on this machine and which kernel each op will use, and why."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os

import jax

from mtjax import backend
from mtjax.config import config
from mtjax.kernels import cublaslt
from mtjax.xla_flags import XLA_FLAG_PRESETS


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect() -> dict:
    """Everything ``mtjax info`` prints, as a dict."""
    devices = jax.devices()
    return {
        "versions": {p: _version(p) for p in ("mtjax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint",
                                              "triton", "jax-triton")},
        "platform": backend.platform(),
        "devices": [f"{d.id}: {d.device_kind}" for d in devices],
        "process": f"{jax.process_index()} of {jax.process_count()}",
        "capabilities": sorted(backend.capabilities()),
        "kernel_packages": {"pallas_triton": "jax has Pallas' Triton backend" if backend.pallas_triton_present()
                            else "this jax has no Pallas Triton backend",
                            "triton": backend.native_triton_problem() or "triton and jax_triton import",
                            "cublaslt": cublaslt.load() or f"FFI library {cublaslt.library_path()} loaded"},
        "plugins": backend.loaded_plugins(),
        "config": {
            "implementations": config.implementations,
            "pallas_interpret": config.pallas_interpret,
            "cuda_compute_capability": config.cuda_compute_capability,
            "environment": {k: v for k, v in os.environ.items()
                            if k.startswith(("MTJAX_", "JAX_PLATFORMS", "XLA_FLAGS"))},
        },
        "ops": backend.describe(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "xla_flag_presets": {name: list(flags) for name, flags in XLA_FLAG_PRESETS.items()},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print("versions:    " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(f"platform:    {info['platform']}  (process {info['process']})")
    more = " ..." if len(info["devices"]) > 8 else ""
    print(f"devices:     {len(info['devices'])}: " + "; ".join(info["devices"][:8]) + more)
    print(f"capabilities: {', '.join(info['capabilities']) or 'none (references only)'}")
    print("kernel packages: " + "; ".join(f"{k}: {v}" for k, v in info["kernel_packages"].items()))
    print(f"plugins:     {info['plugins'] or 'none'}")
    print(f"config:      {info['config']}")
    print(f"XLA_FLAGS:   {info['xla_flags'] or '(none)'}")
    for name, flags in info["xla_flag_presets"].items():
        print(f"XLA preset {name} (mtjax train --xla-preset {name}): {' '.join(flags)}")
    width = max(len(r["op"]) for r in info["ops"])
    print("ops (implementation used here, why; all registered):")
    for row in info["ops"]:
        print(f"  {row['op']:<{width}}  {row['implementation']:<14} {row['why']}  [{row['registered']}]")
    return 0
