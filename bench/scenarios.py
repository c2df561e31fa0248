"""Routing scenarios for `moe-bench load`: which experts the tokens of a run go to.

Pure computation, no I/O. A scenario is an expert popularity that may change with time
(uniform, Zipf, one hot expert, a drifting Zipf); a :class:`TokenBank` turns it into real
token vectors that the real router sends there. The router is a linear gate, so a token
``x = noise + beta * g_e`` (``g_e`` the unit gate column of expert e) makes e its top-1
choice; the bank keeps, per expert, only tokens the router really sends there first
(rejection), so the scenario holds whatever the other gate columns look like. Its other
top-k choices are the gate's own, so the measured load follows the scenario, not exactly.

A request draws its tokens' bank indices once, at its arrival time; the same indices go
to every system measured, and replaying them through the router afterwards gives the run's
routing trace (per-expert load, drops, the communication and cache models) without
routing anything twice while the clock runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

SCENARIOS = ("uniform", "zipf", "hot", "drift")


@dataclass(frozen=True)
class Scenario:
    kind: str = "uniform"
    n_experts: int = 8
    zipf_s: float = 1.2  # zipf, drift: popularity of the r-th most popular ~ 1 / (r + 1) ** s
    hot_expert: int = 0  # hot: this expert takes hot_share of the first choices
    hot_share: float = 0.5
    drift_period: float = 5.0  # drift: the ranking rotates by one expert every period seconds

    def __post_init__(self) -> None:
        if self.kind not in SCENARIOS:
            raise ValueError(f"unknown scenario {self.kind!r}; one of {SCENARIOS}")
        if self.n_experts < 1:
            raise ValueError("n_experts must be >= 1")
        if not self.zipf_s >= 0:
            raise ValueError(f"zipf s must be >= 0, got {self.zipf_s}")
        if not 0 <= self.hot_expert < self.n_experts:
            raise ValueError(f"hot expert {self.hot_expert} is not one of {self.n_experts}")
        if not 0.0 < self.hot_share <= 1.0:
            raise ValueError(f"hot share must be in (0, 1], got {self.hot_share}")
        if not self.drift_period > 0:
            raise ValueError(f"drift period must be > 0 s, got {self.drift_period}")

    def popularity(self, t: float = 0.0) -> np.ndarray:
        """P(first choice = e) at ``t`` seconds into the run (sums to 1)."""
        n = self.n_experts
        if self.kind == "uniform":
            return np.full(n, 1.0 / n)
        if self.kind == "hot":
            p = np.full(n, (1.0 - self.hot_share) / max(1, n - 1)) if n > 1 else np.ones(1)
            p[self.hot_expert] = self.hot_share if n > 1 else 1.0
            return p / p.sum()
        z = 1.0 / np.arange(1, n + 1) ** self.zipf_s  # rank r -> weight
        first = 0 if self.kind == "zipf" else int(t // self.drift_period) % n
        p = np.empty(n)
        p[(np.arange(n) + first) % n] = z  # expert `first` is the most popular now
        return p / p.sum()

    def describe(self) -> str:
        return {"uniform": "uniform", "zipf": f"zipf(s={self.zipf_s:g})",
                "hot": f"hot expert {self.hot_expert} ({100 * self.hot_share:.0f}% of first choices)",
                "drift": f"zipf(s={self.zipf_s:g}) drifting one rank every {self.drift_period:g} s"}[self.kind]


class TokenBank:
    """``per_expert`` tokens per expert whose top-1 choice under ``router`` is that expert."""

    def __init__(self, router, per_expert: int = 256, seed: int = 0, beta: float = 3.0,
                 dtype=np.float32, max_tries: int = 50):
        rng = np.random.default_rng(seed)
        d, n = router.d_model, router.n_experts
        g = np.asarray(router.w_gate, np.float64)
        unit = g / np.maximum(np.linalg.norm(g, axis=0), 1e-12)
        banks = []
        for e in range(n):
            got: list = []
            have = 0
            for _ in range(max_tries):
                cand = rng.standard_normal((2 * per_expert, d)) + beta * unit[:, e]
                cand = cand.astype(dtype)
                keep = cand[np.argmax(router.logits(cand), axis=1) == e]
                got.append(keep)
                have += len(keep)
                if have >= per_expert:
                    break
            block = np.concatenate(got)[:per_expert]
            if len(block) < per_expert:
                raise ValueError(f"expert {e}: only {len(block)} of {per_expert} tokens route there first "
                                 f"(its gate is dominated; raise beta)")
            banks.append(block)
        self.tokens = np.ascontiguousarray(np.concatenate(banks))  # expert e: rows e*B .. (e+1)*B
        self.per_expert = per_expert
        self.n_experts = n

    def draw(self, n: int, popularity: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Bank indices of ``n`` tokens whose first choices follow ``popularity``."""
        experts = rng.choice(self.n_experts, size=n, p=popularity)
        return experts * self.per_expert + rng.integers(0, self.per_expert, size=n)

    def rows(self, idx: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        return np.take(self.tokens, idx, axis=0, out=out)
