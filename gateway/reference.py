"""In-process MoE layers: the ground truth distributed results are checked against.

`ReferenceMoE`: the synthetic layer (Router + SwiGLUExpert). `CheckpointMoE`: one MoE
layer of a checkpoint (FamilyRouter + a kernel per expert id, shared pieces included),
in numpy float32 or torch in any dtype; tests check it equals transformers' own block.

Deliberately written without DispatchPlan (a loop over experts with boolean
masks, accumulation in float64), so that a test comparing the two compares
two different code paths.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np

from gateway.layer import load_layer_router
from gateway.router import FamilyRouter, Router, Routing
from workers import bf16
from workers.checkpoint import Checkpoint, model_spec
from workers.expert import SwiGLUExpert
from workers.kernels import Kernel
from workers.layer_experts import load_expert_kernels

__all__ = ["ReferenceMoE", "CheckpointMoE"]


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


class CheckpointMoE:
    """One MoE layer of a checkpoint, in process: its router and a kernel per expert id.

    `forward(x)` takes (T, d_model) activations in float32 or bf16 (either numpy
    representation) and returns the layer's output in x's dtype: every expert id runs on
    its tokens (the kernel in its own dtype: numpy float32, torch bf16/float32/...), the
    weighted sum accumulates in float64 and is rounded once to x's dtype.
    """

    def __init__(self, router: FamilyRouter, experts: Mapping[int, Kernel]) -> None:
        if sorted(experts) != list(range(router.n_ids)):
            raise ValueError(f"need a kernel for every expert id 0..{router.n_ids - 1}, got {sorted(experts)}")
        for e, k in experts.items():
            if k.d_model != router.d_model:
                raise ValueError(f"expert {e} has d_model {k.d_model}, router {router.d_model}")
        self.router = router
        self.experts = dict(experts)

    @classmethod
    def from_checkpoint(cls, checkpoint: str | os.PathLike | Checkpoint, layer: int, *, kernel: str = "numpy",
                        dtype: object = "float32", max_tokens: int = 256, threads: int | None = None
                        ) -> "CheckpointMoE":
        """Layer ``layer`` of a checkpoint directory (or an open workers.checkpoint.Checkpoint)."""
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        spec = model_spec(ckpt).layer(layer)
        kernels = load_expert_kernels(ckpt, spec, range(spec.n_ids), kind=kernel, dtype=dtype,
                                      max_tokens=max_tokens, threads=threads)
        return cls(load_layer_router(ckpt, spec), kernels)

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Routing]:
        routing = self.router.route(x)
        return self.combine(x, routing), routing

    def combine(self, x: np.ndarray, routing: Routing) -> np.ndarray:
        acc = np.zeros(x.shape, dtype=np.float64)
        for e, kernel in self.experts.items():
            hit = routing.topk_idx == e
            rows = np.flatnonzero(hit.any(axis=1))
            if rows.size == 0:
                continue
            xe = np.ascontiguousarray(x[rows])
            ye = kernel.forward(xe, np.empty_like(xe))
            ye = bf16.to_float32(ye) if bf16.is_bf16(ye.dtype) else ye
            w = np.where(hit[rows], routing.topk_weights[rows], 0).sum(axis=1, dtype=np.float64)
            acc[rows] += w[:, None] * ye.astype(np.float64)
        if bf16.is_bf16(x.dtype):
            return bf16.from_float32(acc.astype(np.float32), out=np.empty_like(x))
        return acc.astype(x.dtype)
