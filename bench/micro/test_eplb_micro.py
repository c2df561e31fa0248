"""pytest-benchmark for the EPLB rebalancer at DeepSeek-V3's routing shape (256 routed
experts, 8 workers of 36 slots, 32 redundant; `make bench-micro`; not a test).

The rebalancer runs once per layer per interval, off the round path; these say how much
of an interval it takes.
"""
from __future__ import annotations

import numpy as np

from gateway.eplb import plan_moves, rebalance

SHAPE = dict(slots=[36] * 8, redundant=32)


def _zipf(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (1.0 / np.arange(1, 257) ** 1.2)[rng.permutation(256)]


def test_rebalance_v3_fresh(benchmark):
    load = _zipf(0)
    target = benchmark(rebalance, load, **SHAPE)
    assert sum(map(len, target)) == 288


def test_rebalance_v3_with_current(benchmark):
    """The steady case: today's placement given, the load drifted 20%."""
    current = rebalance(_zipf(0), **SHAPE)
    load = _zipf(0) * np.random.default_rng(1).uniform(0.8, 1.2, 256)
    benchmark(rebalance, load, current=current, **SHAPE)


def test_rebalance_v3_hierarchical(benchmark):
    benchmark(rebalance, _zipf(0), nodes=[0] * 4 + [1] * 4, groups=8, **SHAPE)


def test_plan_moves_v3(benchmark):
    current = rebalance(_zipf(0), **SHAPE)
    target = rebalance(_zipf(2), current=current, **SHAPE)
    benchmark(plan_moves, current, target, 32, slots=[37] * 8)
