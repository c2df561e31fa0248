"""Sample statistics shared by the reports: which percentiles a sample count supports.

A p-th percentile estimated from fewer than ``100 / (100 - p)`` samples is the maximum (or
an interpolation towards it) dressed up as a tail figure: p99 needs at least 100 samples,
p99.9 at least 1000, p95 20, the median 2. The reports still print such a figure, marked
(``p99.9*`` with a footnote), and the JSON says ``reliable: false`` beside its
``samples`` count.
"""
from __future__ import annotations

import math

MARK = "*"


def min_samples(p: float) -> int:
    """Samples a p-th percentile needs: one sample beyond it on average (100 / (100 - p))."""
    if not 0 < p < 100:
        raise ValueError(f"a percentile in (0, 100), got {p}")
    return math.ceil(100.0 / (100.0 - p) - 1e-9)


def reliable(p: float, n: int) -> bool:
    return n >= min_samples(p)


def footnote(pcts: dict) -> str:
    """The footnote for the marked figures: ``pcts`` maps a label to its percentile."""
    need = ", ".join(f"{label} needs {min_samples(p)}" for label, p in pcts.items())
    return (f"{MARK} too few samples for this percentile ({need}): shown for completeness, "
            f"not to be relied on")
