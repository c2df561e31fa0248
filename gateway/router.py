"""Token router: linear gate, softmax, (noisy) top-k and expert capacity. No I/O.

Conventions the rest of the gateway relies on:
- slot j of a token holds its j-th best expert (by the score used for selection);
- a token never gets the same expert twice;
- `topk_idx == -1` marks a dropped assignment, whose weight is 0.

Two routers share the `Routing` result: `Router` (the synthetic layer: random gate,
noisy top-k, capacity) and `FamilyRouter` (a real model's layer: the routing rule of its
family, `RoutingRule`, and its shared experts as extra expert ids; see `FamilyRouter`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from workers import bf16

__all__ = ["Router", "Routing", "OVERFLOW_POLICIES", "RoutingRule", "FamilyRouter", "select_experts"]

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

    @staticmethod
    def _widen(x: np.ndarray) -> np.ndarray:
        """bf16 activations (either representation) as float32, exactly; others as they are."""
        x = np.asarray(x)
        return bf16.to_float32(np.ascontiguousarray(x)) if bf16.is_bf16(x.dtype) else x

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Clean gate logits (T, n_experts) in the router dtype (x: floating or bf16)."""
        x = self._widen(x)
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
        x = self._widen(x)
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


# -- routing rules of real model families --------------------------------------------------

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RoutingRule:
    """How a model family turns gate logits into top-k experts and weights.

    softmax (Mixtral, Qwen-MoE, OLMoE): p = softmax(logits) over all experts; the top-k
    of p; weights p[top-k], divided by their sum when `renormalize` (Mixtral always,
    Qwen/OLMoE per `norm_topk_prob`).

    sigmoid (DeepSeek-V3, GLM-4-MoE, dots1): s = sigmoid(logits); selection on
    s + bias (the e_score_correction_bias, for selection only), restricted to the
    `topk_group` best of `n_group` equal groups of experts (a group's score: the sum of its
    two best biased scores); weights from the unbiased s, divided by (their sum + 1e-20)
    when `renormalize`.

    Both: weights times `scale` (routed_scaling_factor).

    `logits_in_activation_dtype` / `weights_in_activation_dtype`: with bf16 activations,
    round the logits / the final weights to bf16 as the model does (transformers computes
    Mixtral's and Qwen's gate in the model dtype, DeepSeek's in float32; Qwen casts its
    weights back to the model dtype, Mixtral does not). Without them a bf16 layer would
    pick a different expert than the model on near ties.
    """

    scoring: str = "softmax"
    renormalize: bool = True
    scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    logits_in_activation_dtype: bool = False
    weights_in_activation_dtype: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"scale must be positive and finite, got {self.scale}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"need 1 <= topk_group ({self.topk_group}) <= n_group ({self.n_group})")
        if self.n_group > 1 and self.scoring != "sigmoid":
            raise ValueError("group-limited selection is defined for sigmoid scoring only")


def _topk_desc(score: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest per row, best first (ties: lower id first)."""
    E = score.shape[1]
    if k < E:
        part = np.argpartition(-score, k - 1, axis=1)[:, :k]
    else:
        part = np.broadcast_to(np.arange(E), score.shape).copy()
    sel = np.take_along_axis(score, part, axis=1)
    # lexsort: last key is primary -> by score descending, then by id ascending
    order = np.lexsort((part, -sel), axis=1)
    return np.take_along_axis(part, order, axis=1)


def select_experts(logits: np.ndarray, top_k: int, rule: RoutingRule, bias: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Pure routing math: (T, E) float32 logits -> topk_idx (T, k) int32, topk_weights (T, k)
    float32, slot 0 the best by the selection score. See `RoutingRule`."""
    z = np.asarray(logits, dtype=np.float32)
    T, E = z.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, {E}], got {top_k}")
    if rule.scoring == "softmax":
        if bias is not None:
            raise ValueError("a selection bias is defined for sigmoid scoring only")
        m = z.max(axis=1, keepdims=True) if T else z[:, :1]
        p = np.exp(z - m)
        p /= p.sum(axis=1, keepdims=True)
        idx = _topk_desc(p, top_k)
        w = np.take_along_axis(p, idx, axis=1)
        if rule.renormalize:
            w = w / w.sum(axis=1, keepdims=True)
    else:
        with np.errstate(over="ignore"):  # exp(-z) -> inf for very negative z: sigmoid -> 0
            s = (1.0 / (1.0 + np.exp(-z))).astype(np.float32)
        choice = s if bias is None else s + np.asarray(bias, np.float32)
        G = rule.n_group
        if G > 1:
            if E % G:
                raise ValueError(f"{E} experts do not split into {G} groups")
            per = E // G
            if top_k > rule.topk_group * per:
                raise ValueError(f"top_k {top_k} > topk_group {rule.topk_group} x {per} experts per group")
            grouped = choice.reshape(T, G, per)
            best2 = -np.partition(-grouped, min(2, per) - 1, axis=2)[:, :, :min(2, per)]
            gscore = best2.sum(axis=2)
            keep = _topk_desc(gscore, rule.topk_group)
            mask = np.zeros((T, G), dtype=bool)
            np.put_along_axis(mask, keep, True, axis=1)
            choice = np.where(np.repeat(mask, per, axis=1), choice, -np.inf)
        idx = _topk_desc(choice, top_k)
        w = np.take_along_axis(s, idx, axis=1)
        if rule.renormalize:
            w = w / (w.sum(axis=1, keepdims=True) + np.float32(1e-20))
    w = w * np.float32(rule.scale)
    return idx.astype(np.int32), w.astype(np.float32)


def _round_bf16(a: np.ndarray) -> np.ndarray:
    return bf16.to_float32(bf16.from_float32(np.ascontiguousarray(a, np.float32)))


class FamilyRouter:
    """The router of one layer of a real model: its gate, its family's `RoutingRule`,
    and its shared experts as extra expert ids.

    `weight` (n_experts, d_model) is the gate as nn.Linear stores it (logits = x @ weight.T);
    `bias` the selection-only score bias (sigmoid rule); `n_shared` the shared experts'
    pieces, expert ids n_experts .. n_experts + n_shared - 1, which every token is routed to
    with weight 1, or sigmoid(x @ shared_gate.T) when `shared_gate` (1, d_model) is given
    (Qwen2-MoE's shared_expert_gate).

    Shared experts are routed like experts, and so run on the workers: why is the design
    note in gateway/layer.py.

    `route` returns a `Routing` with k + n_shared slots per token: the k routed slots
    (best first), then the shared ones. No capacity limit: these rules are the model's,
    and a model's inference drops nothing.
    """

    def __init__(self, weight: np.ndarray, top_k: int, rule: RoutingRule, *, bias: np.ndarray | None = None,
                 n_shared: int = 0, shared_gate: np.ndarray | None = None) -> None:
        w = np.ascontiguousarray(weight, dtype=np.float32)
        if w.ndim != 2 or min(w.shape) < 1:
            raise ValueError(f"weight must be (n_experts, d_model), got shape {w.shape}")
        self.n_experts, self.d_model = (int(n) for n in w.shape)
        if not 1 <= top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [1, {self.n_experts}], got {top_k}")
        if bias is not None:
            bias = np.ascontiguousarray(bias, dtype=np.float32)
            if bias.shape != (self.n_experts,):
                raise ValueError(f"bias must have shape ({self.n_experts},), got {bias.shape}")
            if rule.scoring != "sigmoid":
                raise ValueError("a selection bias is defined for sigmoid scoring only")
        if n_shared < 0:
            raise ValueError(f"n_shared must be >= 0, got {n_shared}")
        if shared_gate is not None:
            shared_gate = np.ascontiguousarray(shared_gate, dtype=np.float32)
            if shared_gate.shape != (1, self.d_model):
                raise ValueError(f"shared_gate must have shape (1, {self.d_model}), got {shared_gate.shape}")
            if n_shared < 1:
                raise ValueError("shared_gate given without shared experts")
        for name, a in (("weight", w), ("bias", bias), ("shared_gate", shared_gate)):
            if a is not None and not np.all(np.isfinite(a)):
                raise ValueError(f"{name} has non-finite values")
        self.weight, self.bias, self.shared_gate = w, bias, shared_gate
        self.top_k, self.rule, self.n_shared = int(top_k), rule, int(n_shared)

    @property
    def n_ids(self) -> int:
        """Expert ids the layer's workers host: routed then shared."""
        return self.n_experts + self.n_shared

    def _input(self, x: np.ndarray) -> tuple[np.ndarray, bool]:
        """x as float32 (bf16 exactly), and whether it was bf16."""
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.d_model:
            raise ValueError(f"x must have shape (T, {self.d_model}), got {x.shape}")
        if bf16.is_bf16(x.dtype):
            return bf16.to_float32(np.ascontiguousarray(x)), True
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"x must be floating point or bf16, got {x.dtype}")
        return x.astype(np.float32, copy=False), False

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Gate logits (T, n_experts), float32 (bf16-rounded where the rule says)."""
        x32, is_bf16 = self._input(x)
        return self._logits(x32, is_bf16)

    def _logits(self, x32: np.ndarray, is_bf16: bool) -> np.ndarray:
        z = np.matmul(x32, self.weight.T)
        if is_bf16 and self.rule.logits_in_activation_dtype:
            z = _round_bf16(z)
        if not np.all(np.isfinite(z)):
            raise ValueError("gate logits are not finite (NaN/inf in x?)")
        return z

    def route(self, x: np.ndarray) -> Routing:
        """Route tokens x (T, d_model), float32/float64 or bf16."""
        x32, is_bf16 = self._input(x)
        idx, w = select_experts(self._logits(x32, is_bf16), self.top_k, self.rule, self.bias)
        if is_bf16 and self.rule.weights_in_activation_dtype:
            w = _round_bf16(w)
        T = x32.shape[0]
        if self.n_shared:
            if self.shared_gate is not None:
                g = np.matmul(x32, self.shared_gate.T)  # (T, 1)
                if is_bf16:  # the model computes this Linear and its sigmoid in its dtype
                    g = _round_bf16(g)
                with np.errstate(over="ignore"):
                    sw = (1.0 / (1.0 + np.exp(-g))).astype(np.float32)
                if is_bf16:
                    sw = _round_bf16(sw)
            else:
                sw = np.ones((T, 1), np.float32)
            sidx = np.broadcast_to(np.arange(self.n_experts, self.n_ids, dtype=np.int32), (T, self.n_shared))
            idx = np.concatenate([idx, sidx], axis=1)
            w = np.concatenate([w, np.broadcast_to(sw, (T, self.n_shared))], axis=1)
        counts = np.bincount(idx.ravel(), minlength=self.n_ids).astype(np.int64)
        return Routing(idx, w.astype(np.float32, copy=False), counts, 0, 0, None)

    def describe(self) -> dict:
        return {"n_experts": self.n_experts, "d_model": self.d_model, "top_k": self.top_k,
                "n_shared": self.n_shared, "shared_gated": self.shared_gate is not None,
                "bias": self.bias is not None, **{f"rule_{k}": v for k, v in self.rule.__dict__.items()}}
