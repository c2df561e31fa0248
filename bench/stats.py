"""Sample statistics shared by the reports: which percentiles a sample count supports, and
the load tool's latency histogram.

A p-th percentile estimated from fewer than ``100 / (100 - p)`` samples is the maximum (or
an interpolation towards it) dressed up as a tail figure: p99 needs at least 100 samples,
p99.9 at least 1000, p95 20, the median 2. The reports still print such a figure, marked
(``p99.9*`` with a footnote), and the JSON says ``reliable: false`` beside its
``samples`` count.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

MARK = "*"
PCTS = (("p50", 50.0), ("p95", 95.0), ("p99", 99.0), ("p999", 99.9))  # the load tool's, in its JSON


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


class Histogram:
    """Latencies in seconds, percentiles in ms: an HDR histogram (1 us .. 1 h, 3 significant
    digits) when the hdrhistogram package imports, else exact numpy percentiles."""

    LOW_US, HIGH_US, DIGITS = 1, 3_600_000_000, 3

    def __init__(self, use_hdr: Optional[bool] = None) -> None:
        self._h = None
        if use_hdr is not False:
            try:
                from hdrh.histogram import HdrHistogram
                self._h = HdrHistogram(self.LOW_US, self.HIGH_US, self.DIGITS)
            except Exception:
                if use_hdr:
                    raise
        self._values: list[float] = []

    @property
    def kind(self) -> str:
        return "hdr" if self._h is not None else "numpy"

    def record(self, seconds: float) -> None:
        self._values.append(seconds)
        if self._h is not None:
            us = int(round(seconds * 1e6))
            self._h.record_value(min(max(us, self.LOW_US), self.HIGH_US))

    def __len__(self) -> int:
        return len(self._values)

    def percentile_ms(self, p: float) -> float:
        if not self._values:
            return float("nan")
        if self._h is not None:
            return self._h.get_value_at_percentile(p) / 1e3
        return float(np.percentile(np.asarray(self._values) * 1e3, p))

    def summary(self) -> dict:
        """Percentiles, mean, std and max in ms; ``n``/``samples`` the sample count and
        ``reliable`` which percentiles it supports (p99 needs 100 samples, p99.9 1000)."""
        d: dict[str, Any] = {k: self.percentile_ms(p) for k, p in PCTS}
        n = len(self._values)
        if n:
            a = np.asarray(self._values) * 1e3
            d.update(mean=float(a.mean()), std=float(a.std()), max=float(a.max()))
        else:
            d.update(mean=float("nan"), std=float("nan"), max=float("nan"))
        d.update(n=n, samples=n, reliable={k: reliable(p, n) for k, p in PCTS})
        return d
