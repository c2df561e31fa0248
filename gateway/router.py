"""Token router: linear gate, softmax, (noisy) top-k and expert capacity. No I/O.

Conventions the rest of the gateway relies on:
- slot j of a token holds its j-th best expert (by the score used for selection);
- a token never gets the same expert twice;
- `topk_idx == -1` marks a dropped assignment, whose weight is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Router", "Routing", "OVERFLOW_POLICIES"]

OVERFLOW_POLICIES = ("drop", "spill")
_ROUTER_STREAM = 1  # SeedSequence spawn keys: experts use 0, so streams never collide
_NOISE_STREAM = 2


@dataclass(frozen=True)
class Routing:
    """Result of `Router.route` for T tokens and top-k.

    topk_idx: (T, k) int32 expert ids, -1 where the assignment was dropped.
    topk_weights: (T, k) float32 combine weights, 0 where dropped.
    expert_counts: (n_experts,) int64 assignments per expert after capacity.
    overflow: assignments that did not fit their chosen expert's capacity.
    dropped: assignments finally dropped (== overflow under "drop").
    capacity: per-expert capacity used, or None when unlimited.
    """

    topk_idx: np.ndarray
    topk_weights: np.ndarray
    expert_counts: np.ndarray
    overflow: int
    dropped: int
    capacity: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.topk_idx.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.topk_idx.shape[1])


class Router:
    """Linear gate + top-k routing with an optional per-expert capacity.

    Weights: softmax over the gate logits, restricted to the k selected
    experts and renormalised over them (so they sum to 1 per token when
    nothing is dropped).

    Noisy top-k (Shazeer et al. 2017, eq. 3-5): H = logits + N(0,1) * std, with
    std = softplus(x @ w_noise) when `w_noise` is given, else `noise_std`.
    Both the selection and the weights use H, i.e. G = softmax(KeepTopK(H, k)).

    Capacity (when `capacity_factor` is set): each expert takes at most
    ceil(capacity_factor * T * k / n_experts) assignments. Priority within an
    expert is token order, first come first served: assignments are considered
    token by token (token 0's slots, then token 1's, ...), so an earlier token
    always keeps its place over a later one. What happens to an assignment
    that does not fit is the `overflow` policy:

    - "drop": idx becomes -1 and weight 0. The token's other weights are NOT
      renormalised: its output is scaled down by what it lost, which is what
      a residual connection around the MoE layer expects.
    - "spill": after all first choices are placed, the overflowed assignments
      are re-placed one at a time, in token order, on the token's next-best
      expert (by the selection score) that still has room and that the token
      does not already use. The moved assignment keeps its slot's weight (the
      gate's budget for that slot is spent elsewhere, so the token's weights
      still sum to 1). Dropped, as above, only if no expert has room.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        top_k: int,
        *,
        noisy: bool = False,
        noise_std: float = 1.0,
        capacity_factor: float | None = None,
        overflow: str = "drop",
        seed: int = 0,
        dtype: object = np.float32,
        w_gate: np.ndarray | None = None,
        bias: np.ndarray | None = None,
        w_noise: np.ndarray | None = None,
    ) -> None:
        if d_model < 1:
            raise ValueError(f"d_model must be >= 1, got {d_model}")
        if n_experts < 1:
            raise ValueError(f"n_experts must be >= 1, got {n_experts}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"unknown overflow policy {overflow!r}; expected one of {OVERFLOW_POLICIES}")
        if capacity_factor is not None and not (capacity_factor > 0 and math.isfinite(capacity_factor)):
            raise ValueError(f"capacity_factor must be a positive finite number or None, got {capacity_factor}")
        if not (noise_std >= 0 and math.isfinite(noise_std)):
            raise ValueError(f"noise_std must be >= 0, got {noise_std}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        dt = np.dtype(dtype)
        if not np.issubdtype(dt, np.floating):
            raise ValueError(f"router dtype must be a floating type, got {dt}")
        self.d_model, self.n_experts, self.top_k = int(d_model), int(n_experts), int(top_k)
        self.noisy, self.noise_std = bool(noisy), float(noise_std)
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.overflow_policy = overflow
        self.seed, self.dtype = int(seed), dt

        if w_gate is None:
            rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_ROUTER_STREAM,)))
            w_gate = rng.standard_normal((self.d_model, self.n_experts)) / np.sqrt(self.d_model)
        self.w_gate = self._param(w_gate, (self.d_model, self.n_experts), "w_gate")
        self.bias = None if bias is None else self._param(bias, (self.n_experts,), "bias")
        self.w_noise = None if w_noise is None else self._param(
            w_noise, (self.d_model, self.n_experts), "w_noise")
        # Used when route() gets no rng: reproducible per router, but stateful.
        self._rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_NOISE_STREAM,)))

    def describe(self) -> dict:
        """The settings that rebuild this router elsewhere (a load generator steering tokens
        to chosen experts, a cache model replaying its routing): plain msgpack values."""
        return {"d_model": self.d_model, "n_experts": self.n_experts, "top_k": self.top_k,
                "seed": self.seed, "noisy": self.noisy, "noise_std": self.noise_std,
                "capacity_factor": self.capacity_factor, "overflow": self.overflow_policy,
                "bias": None if self.bias is None else [float(b) for b in self.bias],
                "dtype": self.dtype.name}

    @classmethod
    def from_description(cls, d: dict) -> "Router":
        """The router :meth:`describe` describes (same seed: the same gate weights)."""
        return cls(d["d_model"], d["n_experts"], d["top_k"], noisy=d.get("noisy", False),
                   noise_std=d.get("noise_std", 1.0), capacity_factor=d.get("capacity_factor"),
                   overflow=d.get("overflow", "drop"), seed=d.get("seed", 0), dtype=d.get("dtype", "float32"),
                   bias=None if d.get("bias") is None else np.asarray(d["bias"], np.float32))

    def _param(self, a: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
        a = np.ascontiguousarray(a, dtype=self.dtype)
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{name} has non-finite values")
        return a

    def capacity(self, num_tokens: int) -> int | None:
        """Per-expert capacity for a batch of `num_tokens`, None if unlimited."""
        if self.capacity_factor is None:
            return None
        c = self.capacity_factor * num_tokens * self.top_k / self.n_experts
        # round() first so that e.g. 1.1 * 10 / 1 = 11.000000000000002 gives 11, not 12.
        return int(math.ceil(round(c, 9)))

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Clean gate logits (T, n_experts) in the router dtype."""
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.d_model:
            raise ValueError(f"x must have shape (T, {self.d_model}), got {x.shape}")
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"x must be floating point, got {x.dtype}")
        z = np.matmul(x.astype(self.dtype, copy=False), self.w_gate)
        if self.bias is not None:
            z += self.bias
        if not np.all(np.isfinite(z)):
            raise ValueError("gate logits are not finite (NaN/inf in x?)")
        return z

    def route(self, x: np.ndarray, *, rng: np.random.Generator | int | None = None) -> Routing:
        """Route tokens x (T, d_model). `rng` (a Generator or a seed) drives the
        noise of noisy top-k; without one the router's own seeded stream is used."""
        z = self.logits(x)
        T, E, k = z.shape[0], self.n_experts, self.top_k
        if self.noisy:
            gen = self._rng if rng is None else np.random.default_rng(rng)
            if self.w_noise is not None:
                std = np.logaddexp(0.0, np.matmul(x.astype(self.dtype, copy=False), self.w_noise))
            else:
                std = self.noise_std
            z = z + (gen.standard_normal(z.shape) * std).astype(self.dtype, copy=False)
        # Full ranking: stable so that ties go to the lower expert id, and spill
        # needs every token's order of preference anyway.
        order = np.argsort(-z, axis=1, kind="stable")
        idx = order[:, :k].astype(np.int32)
        top = np.take_along_axis(z, idx, axis=1).astype(np.float64)
        e = np.exp(top - top[:, :1])  # top[:, 0] is the row max
        weights = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)

        cap = self.capacity(T)
        overflow = dropped = 0
        if cap is not None and T > 0:
            fits = _fits_in_order(idx.ravel(), E, cap).reshape(T, k)
            overflow = int(np.count_nonzero(~fits))
            if overflow:
                idx[~fits] = -1
                if self.overflow_policy == "spill":
                    _spill(idx, fits, order, E, cap)
                lost = idx < 0
                weights[lost] = 0.0
                dropped = int(np.count_nonzero(lost))
        counts = np.bincount(idx[idx >= 0].ravel(), minlength=E).astype(np.int64)
        return Routing(idx, weights, counts, overflow, dropped, cap)


def _fits_in_order(flat_idx: np.ndarray, n_experts: int, cap: int) -> np.ndarray:
    """For assignments in priority order, whether each is within the first
    `cap` of its expert (a vectorised first-come-first-served)."""
    by_expert = np.argsort(flat_idx, kind="stable")  # keeps priority order within an expert
    sorted_e = flat_idx[by_expert]
    starts = np.searchsorted(sorted_e, np.arange(n_experts))
    rank = np.empty_like(by_expert)
    rank[by_expert] = np.arange(flat_idx.size) - starts[sorted_e]
    return rank < cap


def _spill(idx: np.ndarray, fits: np.ndarray, order: np.ndarray, n_experts: int, cap: int) -> None:
    """Re-place overflowed assignments (idx == -1) in token order, in place.

    Sequential on purpose: each placement changes the room left for the next.
    Only overflowed assignments are visited, each scanning its token's
    preference list, so the cost is O(overflow * n_experts) Python steps."""
    room = (cap - np.bincount(idx[fits], minlength=n_experts)).tolist()
    rows, slots = np.nonzero(~fits)  # row-major: token order, then slot order
    for t, j in zip(rows.tolist(), slots.tolist()):
        used = set(idx[t].tolist())
        for e in order[t].tolist():
            if room[e] > 0 and e not in used:
                idx[t, j] = e
                room[e] -= 1
                break
