"""Balancedness before/after EPLB for zipf, hot and uniform loads (`python -m
bench.micro.eplb_table`): before is today's static placement (contiguous blocks, one copy
per logical expert), after is :func:`gateway.eplb.rebalance` with the redundant budget.
Also times the rebalancer at DeepSeek-V3's shape (median of repeats)."""
from __future__ import annotations

import time

import numpy as np

from gateway.eplb import balancedness, plan_moves, rebalance

SHAPES = [  # (name, logical experts, workers, slots per worker, redundant)
    ("8x2", 8, 2, 5, 2),
    ("8x2/4", 8, 2, 4, 2),  # 4 slots each: no room for the redundant copies
    ("256x8", 256, 8, 36, 32),
]


def loads(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "uniform":
        return np.ones(n)
    if kind == "hot":
        out = np.ones(n)
        out[0] = 10.0
        return out
    z = 1.0 / np.arange(1, n + 1) ** 1.2
    return z if n <= 8 else z[rng.permutation(n)]  # 8x2: the load tool's zipf; 256x8: hot ones anywhere


def table() -> None:
    print(f"{'shape':7} {'load':8} {'static':>7} {'eplb':>7} {'copies':>7} {'adds':>5}")
    for name, n, workers, slots, redundant in SHAPES:
        static = [[e * workers // n] for e in range(n)]
        for kind in ("zipf", "hot", "uniform"):
            load = loads(kind, n, np.random.default_rng(0))
            target = rebalance(load, [slots] * workers, redundant=redundant, current=static)
            adds = sum(len(set(t) - set(c)) for t, c in zip(target, static))
            print(f"{name:7} {kind:8} {balancedness(load, static, workers):7.3f} "
                  f"{balancedness(load, target, workers):7.3f} {sum(map(len, target)):7d} {adds:5d}")


def timing(repeats: int = 30) -> None:
    load = loads("zipf", 256, np.random.default_rng(0))
    drifted = load * np.random.default_rng(1).uniform(0.8, 1.2, 256)
    current = rebalance(load, [36] * 8, redundant=32)
    cases = {
        "fresh": lambda: rebalance(load, [36] * 8, redundant=32),
        "with current": lambda: rebalance(drifted, [36] * 8, redundant=32, current=current),
        "hierarchical": lambda: rebalance(load, [36] * 8, redundant=32, nodes=[0] * 4 + [1] * 4, groups=8),
        "plan_moves 32": lambda: plan_moves(current, rebalance(drifted, [36] * 8, redundant=32), 32,
                                            slots=[37] * 8),
    }
    for name, fn in cases.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        print(f"256x8 {name:14} median {np.median(times) * 1e3:6.2f} ms  max {max(times) * 1e3:6.2f} ms")


if __name__ == "__main__":
    table()
    timing()
