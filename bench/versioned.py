"""The reference MoE layer at any mix of expert versions (demo weights from seeds).

A gateway's answer names the version of every expert that computed it (``expert_versions``
in its reply, ``GatewayClient.last_expert_versions``); with the seed behind each version
number, this computes what that answer must be, so a checker can tell a right answer from
one computed with other weights than it says, under hot updates and restarts alike.
"""
from __future__ import annotations

import threading
from typing import Mapping, Optional

import numpy as np

from gateway.router import Router
from workers.expert import SwiGLUExpert


class VersionedReference:
    """``seeds``: version number -> the seed its weights come from (version 0: ``seed``)."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int, *, seed: int = 0,
                 seeds: Optional[Mapping[int, int]] = None) -> None:
        self.d_model, self.d_ff, self.n_experts = d_model, d_ff, n_experts
        self.router = Router(d_model, n_experts, top_k, seed=seed)
        self.seeds = {0: seed, **dict(seeds or {})}
        self._experts: dict = {}
        self._lock = threading.Lock()  # an expert's scratch is not for two threads at once

    def add_version(self, version: int, seed: int) -> None:
        self.seeds[int(version)] = int(seed)

    def expert(self, e: int, version: int) -> SwiGLUExpert:
        key = (int(e), int(version))
        ex = self._experts.get(key)
        if ex is None:
            if version not in self.seeds:
                raise KeyError(f"no seed known for version {version}")
            ex = self._experts[key] = SwiGLUExpert.from_seed(e, self.d_model, self.d_ff, seed=self.seeds[version])
        return ex

    def used(self, x: np.ndarray) -> list:
        """The experts that compute rows of ``x`` (no capacity limit here)."""
        idx = self.router.route(x).topk_idx
        return sorted({int(e) for e in idx.ravel() if e >= 0})

    def forward(self, x: np.ndarray, versions: Mapping[int, int]) -> np.ndarray:
        """The layer's output for ``x`` with expert ``e`` at ``versions[e]`` (0 if absent)."""
        routing = self.router.route(x)
        acc = np.zeros(x.shape, dtype=np.float64)
        for e in self.used(x):
            hit = routing.topk_idx == e
            rows = np.flatnonzero(hit.any(axis=1))
            w = (routing.topk_weights * hit).sum(axis=1)[rows]
            acc[rows] += w[:, None] * self.expert(e, versions.get(e, 0))(x[rows]).astype(np.float64)
        return acc.astype(x.dtype)

    def matches(self, x: np.ndarray, y: np.ndarray, versions: Mapping[int, int], *, rtol: float = 1e-4,
                atol: float = 1e-5) -> bool:
        """Whether ``y`` is the layer at exactly ``versions`` (every expert ``x`` uses named)."""
        if set(self.used(x)) - set(versions):
            return False
        with self._lock:
            want = self.forward(x, versions)
        return y.shape == x.shape and bool(np.allclose(y, want, rtol=rtol, atol=atol))
