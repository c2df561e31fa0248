"""In-process MoE layer: the ground truth distributed results are checked against.

Deliberately written without DispatchPlan (a loop over experts with boolean
masks, accumulation in float64), so that a test comparing the two compares
two different code paths.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from gateway.router import Router, Routing
from workers.expert import SwiGLUExpert

__all__ = ["ReferenceMoE"]


class ReferenceMoE:
    def __init__(self, router: Router, experts: Sequence[SwiGLUExpert]) -> None:
        if len(experts) != router.n_experts:
            raise ValueError(f"router has {router.n_experts} experts, got {len(experts)}")
        for i, e in enumerate(experts):
            if e.d_model != router.d_model:
                raise ValueError(f"expert {i} has d_model {e.d_model}, router {router.d_model}")
        self.router = router
        self.experts = list(experts)

    @classmethod
    def from_seed(cls, d_model: int, d_ff: int, n_experts: int, top_k: int, *, seed: int = 0,
                  dtype: object = np.float32, **router_kw: object) -> "ReferenceMoE":
        """Router and experts drawn from one seed, as the workers draw theirs
        (`SwiGLUExpert.from_seed(e, d_model, d_ff, seed)`)."""
        router = Router(d_model, n_experts, top_k, seed=seed, **router_kw)  # type: ignore[arg-type]
        experts = [SwiGLUExpert.from_seed(e, d_model, d_ff, seed=seed, dtype=dtype) for e in range(n_experts)]
        return cls(router, experts)

    def forward(self, x: np.ndarray, *, rng: np.random.Generator | int | None = None
                ) -> tuple[np.ndarray, Routing]:
        routing = self.router.route(x, rng=rng)
        return self.combine(x, routing), routing

    def combine(self, x: np.ndarray, routing: Routing) -> np.ndarray:
        """Run every expert on its tokens and sum weight * output per token."""
        acc = np.zeros(x.shape, dtype=np.float64)
        for e, expert in enumerate(self.experts):
            hit = routing.topk_idx == e  # (T, k)
            rows = np.flatnonzero(hit.any(axis=1))
            if rows.size == 0:
                continue
            xe = np.ascontiguousarray(x[rows], dtype=expert.dtype)
            ye = expert.forward(xe, np.empty_like(xe)).astype(np.float64)
            # Summing over slots also covers a (hand-built) routing that lists
            # an expert twice for one token.
            w = np.where(hit[rows], routing.topk_weights[rows], 0).sum(axis=1, dtype=np.float64)
            acc[rows] += w[:, None] * ye
        return acc.astype(self.experts[0].dtype if self.experts else x.dtype)
