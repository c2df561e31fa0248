"""Replica choice: which copy of a replicated expert serves a round's tokens (no I/O).

Two policies (``moe-gateway --balancing``), both returning (replicas, shares) for
dispatch.split_over_replicas:

- ``load-aware`` (the default, :func:`choose_replicas`): experts with one host are placed
  first (no choice), then replicated experts from the busiest down, each on the replica
  with the least outstanding rows; a big expert is water-filled over its replicas instead
  (each share at least ``min_split`` rows), so one hot expert does not pile onto one worker.
- ``least-loaded`` (:func:`choose_least_loaded`): every expert goes whole to the replica
  whose outstanding WORK is least when its rows land there: rows out from earlier rounds
  plus rows placed this round, times that worker's measured seconds per row (so a slower
  or busier worker, e.g. one sharing its core, gets less); experts are placed largest
  first (LPT, the classic makespan heuristic) and never split (fewer, larger groups).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

BALANCING = ("load-aware", "least-loaded")


def choose_replicas(counts: np.ndarray, hosts: dict, load: np.ndarray, *, split: bool = True,
                    min_split: int = 16) -> tuple[dict, dict]:
    """Load-aware replica choice for one round.

    ``counts[e]``: rows routed to expert e; ``hosts[e]``: usable workers hosting e;
    ``load[w]``: rows outstanding on w (updated in place with this round's choice).
    Experts with one host are placed first (no choice), then replicated experts from the
    busiest down, each on the replica with the least load; with ``split``, a big expert is
    water-filled over its replicas instead (each share at least ``min_split`` rows).
    Returns (replicas, shares) for :func:`split_over_replicas`.
    """
    replicas: dict = {}
    shares: dict = {}
    order = sorted((e for e in range(len(counts)) if counts[e] > 0),
                   key=lambda e: (len(hosts[e]) > 1, -counts[e], e))
    for e in order:
        ws = hosts[e]
        c = float(counts[e])
        if len(ws) == 1:
            replicas[e], shares[e] = [ws[0]], [1.0]
            load[ws[0]] += c
            continue
        ls = np.array([load[w] for w in ws], dtype=np.float64)
        if split and c >= 2 * min_split:
            share = _water_fill(ls, c)
            keep = share >= min_split
            if not keep.any():
                keep = share == share.max()
            share = np.where(keep, share, 0.0)
        else:
            share = np.zeros(len(ws))
            share[int(np.argmin(ls))] = 1.0
        share = share / share.sum()
        replicas[e] = [w for w, s in zip(ws, share) if s > 0]
        shares[e] = [float(s) for s in share if s > 0]
        for w, s in zip(ws, share):
            load[w] += c * s
    return replicas, shares


def _water_fill(loads: np.ndarray, amount: float) -> np.ndarray:
    """Shares of ``amount`` that bring the lowest loads up to a common level."""
    order = np.sort(loads)
    level = order[0] + amount
    for k in range(1, len(order) + 1):
        level = (order[:k].sum() + amount) / k
        if k == len(order) or level <= order[k]:
            break
    return np.maximum(0.0, level - loads)


def choose_least_loaded(counts: np.ndarray, hosts: dict, load: np.ndarray,
                        seconds_per_row: Optional[np.ndarray] = None) -> tuple[dict, dict]:
    """Least-loaded balancing for one round: each expert, largest first, wholly on the host
    where (outstanding rows + this round's rows so far + its rows) x seconds per row is
    least. ``seconds_per_row[w]`` is NaN (or the array None) where unknown: the mean of the
    known ones is assumed (1 when none is known, so rows alone decide). ``load[w]`` is
    updated in place with this round's rows."""
    n = len(load)
    cost = np.ones(n) if seconds_per_row is None else np.asarray(seconds_per_row, dtype=np.float64).copy()
    known = np.isfinite(cost) & (cost > 0)
    cost[~known] = cost[known].mean() if known.any() else 1.0
    replicas: dict = {}
    shares: dict = {}
    for e in sorted((e for e in range(len(counts)) if counts[e] > 0), key=lambda e: (-counts[e], e)):
        ws = hosts[e]
        c = float(counts[e])
        w = min(ws, key=lambda w: ((load[w] + c) * cost[w], load[w], w))
        replicas[e], shares[e] = [w], [1.0]
        load[w] += c
    return replicas, shares
