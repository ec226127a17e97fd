"""Numbers as people write them in forms, tables and logs: ``2.6e-4``, not ``0.0002612293709960431``."""

from __future__ import annotations

import math


def human_number(value: float | int) -> str:
    """An int as is; a float with at most 3 significant digits in scientific form below 1e-3 and from 1e5 up
    (``2.61e-4``, ``1.5e6``), else with at most 4 significant digits (``0.0312``, ``500``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        mantissa, exponent = f"{value:.2e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{int(exponent)}"
    return f"{value:.4g}"
