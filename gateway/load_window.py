"""Per-expert load over a sliding window of time, from the gateway's own routing; no I/O.

Every round adds its rows per logical expert (what the router assigned, after capacity)
into the bucket of the current second; :meth:`LoadWindow.load` sums the buckets of the last
``window`` seconds. Rows are the work: a worker's time is its rows times its compute per
row, so balancing rows balances time on equal workers.
"""
from __future__ import annotations

from collections import deque
from typing import Mapping

import numpy as np

BUCKET = 1.0  # seconds a bucket covers


class LoadWindow:
    def __init__(self, n_ids: Mapping[int, int], window: float = 60.0) -> None:
        self.window = float(window)
        self.n_ids = dict(n_ids)
        self._buckets: deque = deque()  # (start time, {layer: rows per expert})
        self.total = {L: np.zeros(n, np.int64) for L, n in self.n_ids.items()}  # since start

    def record(self, layer: int, counts: np.ndarray, now: float) -> None:
        """``counts``: rows per expert id of ``layer`` in one round."""
        if not self._buckets or now - self._buckets[-1][0] >= BUCKET:
            self._buckets.append((now, {}))
            self._trim(now)
        cur = self._buckets[-1][1]
        n = self.n_ids[layer]
        c = counts[:n]
        acc = cur.get(layer)
        if acc is None:
            acc = cur[layer] = np.zeros(n, np.int64)
        acc[:len(c)] += c
        self.total[layer][:len(c)] += c

    def _trim(self, now: float) -> None:
        while self._buckets and now - self._buckets[0][0] > self.window + BUCKET:
            self._buckets.popleft()

    def load(self, layer: int, now: float) -> np.ndarray:
        """Rows per expert of ``layer`` over the last ``window`` seconds."""
        self._trim(now)
        out = np.zeros(self.n_ids[layer], np.float64)
        for t, per in self._buckets:
            if now - t <= self.window and layer in per:
                out += per[layer]
        return out
