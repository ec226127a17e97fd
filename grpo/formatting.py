"""Numbers as people write them, for every table a person reads (the comparison dashboard, the run form, a sweep's
lines).

Python's ``str`` of a float sampled on a log scale reads ``0.0002612293709960431``; a person writes ``2.61e-4``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

_SMALL, _LARGE = 1e-3, 1e5


def human_number(x: Any) -> str:
    """``x`` as a person writes it: ints as ints (``5500``); floats with ``|x| < 1e-3`` or ``|x| >= 1e5`` in short
    scientific notation with at most 3 significant digits (``2.61e-4``, ``1e-5``, ``1.5e6``); other floats with at
    most 4 significant digits (``0.1235``, ``42``), or in the short notation where 4 digits do not hold the integer
    part (``1.23e4``). A string holding a number is read first (MLflow keeps params as
    strings); anything else is returned as ``str(x)``."""
    if isinstance(x, str):
        try:
            x = int(x) if x.strip().lstrip("+-").isdigit() else float(x)
        except ValueError:
            return x
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return str(x)
    if isinstance(x, numbers.Integral):
        return str(int(x))
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    text = f"{x:.4g}"
    if x != 0 and (abs(x) < _SMALL or abs(x) >= _LARGE or "e" in text):  # "e" in text: 1e4 <= |x| < 1e5
        mantissa, exponent = f"{x:.2e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return text


def human_metric(x: Any) -> str:
    """A metric's value as the CLI prints a run's accuracy: 3 decimals (``0.848``, ``12.300``, ``0.000``), in
    :func:`human_number`'s short scientific notation where 3 decimals would show no significant digit or the number is
    large (``2.61e-4``, ``1.5e6``); ``-`` for None (no value), anything else not a real number as ``str(x)``."""
    if x is None:
        return "-"
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)):
        return str(x)
    x = float(x)
    return human_number(x) if x != 0 and (abs(x) < _SMALL or abs(x) >= _LARGE) else f"{x:.3f}"


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless one: ``count(1, "epoch")`` is ``1 epoch``, ``count(3, "run")`` ``3 runs``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
