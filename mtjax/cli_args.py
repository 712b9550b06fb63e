"""Argument types shared by the ``mtjax`` sub-commands: ``type=`` callables for `argparse` that
refuse a bad value with a message naming it (``argparse.ArgumentTypeError``), before any work starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _checked(name: str, parse: Callable[[str], float], accept: Callable[[float], bool],
             expected: str) -> Callable[[str], float]:
    """An argparse type: ``parse(text)`` if it parses and ``accept`` takes it, else an error saying ``expected``."""

    def check(text: str):
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    check.__name__ = check.__qualname__ = name
    check.__doc__ = f"{expected[0].upper()}{expected[1:]}."
    return check


positive_int = _checked("positive_int", int, lambda v: v >= 1, "a positive integer")
non_negative_int = _checked("non_negative_int", int, lambda v: v >= 0, "an integer >= 0")
positive_float = _checked("positive_float", float, lambda v: 0 < v < math.inf, "a positive number")
non_negative_float = _checked("non_negative_float", float, lambda v: 0 <= v < math.inf, "a finite number >= 0")
