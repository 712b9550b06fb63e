"""What distinguishes the mtjax rows of the layer and train suites: FP8 on or off, and kernel choices.

``--kernels layernorm=xla,activation=xla`` adds mtjax rows (bf16 and FP8) traced with those
implementations forced through `mtjax.config.override`, labelled ``"mtjax [layernorm=xla,...]"``,
so a kernel's effect on a whole layer or train step is measured beside the default choice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from mtjax import backend
from mtjax.config import override


def parse_kernels(spec: str) -> dict[str, str]:
    """``"op=implementation,..."`` -> ``{op: implementation}``, checked against the kernel registry."""
    kernels = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        op, sep, name = (x.strip() for x in item.partition("="))
        if not sep or op not in backend.ops():
            raise ValueError(f"--kernels {spec!r}: {item!r} is not op=implementation with op one of {backend.ops()}")
        if name not in backend.implementations(op):
            raise ValueError(f"--kernels {spec!r}: op {op!r} has no implementation {name!r}; "
                             f"registered: {backend.implementations(op)}")
        kernels[op] = name
    if not kernels:
        raise ValueError(f"--kernels {spec!r}: expected op=implementation[,op=implementation...]")
    return kernels


def label(fp8: bool, kernels: Mapping[str, str]) -> str:
    """``"mtjax"``, ``"mtjax fp8"``, ``"mtjax [layernorm=xla]"``, ..."""
    name = "mtjax fp8" if fp8 else "mtjax"
    if kernels:
        name += " [" + ",".join(f"{op}={impl}" for op, impl in sorted(kernels.items())) + "]"
    return name


@contextlib.contextmanager
def mtjax_context(fp8: bool, kernels: Mapping[str, str]) -> Iterator[None]:
    """Enter around tracing (and init) of an mtjax variant: ``fp8_autocast`` and the kernel choices."""
    from mtjax.fp8 import fp8_autocast

    with fp8_autocast(enabled=fp8), override(implementations=dict(kernels)):
        yield


def mtjax_variants(kernel_sets: list[Mapping[str, str]]) -> list[tuple[bool, dict[str, str]]]:
    """``(fp8, kernels)`` of every mtjax row: the default choice, then each kernel set, bf16 and FP8."""
    return [(fp8, dict(kernels)) for kernels in [{}, *kernel_sets] for fp8 in (False, True)]
