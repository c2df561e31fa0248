"""Replica choice: which copy of a replicated expert serves a round's tokens (no I/O).

Load-aware: experts with one host are placed first (no choice), then replicated experts
from the busiest down, each on the replica with the least outstanding rows; a big expert is
water-filled over its replicas instead (each share at least ``min_split`` rows), so one hot
expert does not pile onto one worker. The result feeds dispatch.split_over_replicas.
"""
from __future__ import annotations

import numpy as np


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
