"""A SwiGLU feed-forward expert with an allocation-free forward pass.

The worker daemon calls `forward(x, out)` with `x` and `out` being views into
transport buffers, so the steady state must not allocate: intermediates live in
scratch buffers sized for `max_tokens` and every matmul writes through `out=`.
"""

from __future__ import annotations

import os
import re
from typing import Iterable, Optional

import numpy as np

from workers.fingerprint import weights_fingerprint

__all__ = ["SwiGLUExpert", "npz_expert_ids"]

_KEY = re.compile(r"^expert(\d+)\.(w_gate|w_up|w_down|version)$")
_WEIGHTS = ("w_gate", "w_up", "w_down")
# Keeps experts' streams apart from other users of the same seed (the router).
_EXPERT_STREAM = 0


def _as_dtype(dtype: object) -> np.dtype:
    dt = np.dtype(dtype)
    if not np.issubdtype(dt, np.floating):
        raise ValueError(f"expert dtype must be a floating type, got {dt}")
    return dt


def silu_mul_(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``u = silu(g) * u`` in place (``g`` is overwritten): g * u / (1 + exp(-g)), with no
    temporary the size of a block. exp(-g) overflows to inf for very negative g, giving the
    right limit 0."""
    np.multiply(u, g, out=u)
    np.negative(g, out=g)
    with np.errstate(over="ignore"):
        np.exp(g, out=g)
    g += 1
    np.divide(u, g, out=u)
    return u

class SwiGLUExpert:
    """y = (silu(x @ w_gate) * (x @ w_up)) @ w_down.

    Weights: w_gate, w_up (d_model, d_ff) and w_down (d_ff, d_model), stored
    C-contiguous in `dtype` (given arrays already in that form are used as-is,
    not copied). `version` is an opaque integer the worker uses for hot-swap.
    """

    def __init__(
        self,
        w_gate: np.ndarray,
        w_up: np.ndarray,
        w_down: np.ndarray,
        *,
        expert_id: int = 0,
        version: int = 0,
        max_tokens: int = 256,
        dtype: object = None,
    ) -> None:
        dt = _as_dtype(w_gate.dtype if dtype is None else dtype)
        w_gate = np.ascontiguousarray(w_gate, dtype=dt)
        w_up = np.ascontiguousarray(w_up, dtype=dt)
        w_down = np.ascontiguousarray(w_down, dtype=dt)
        if w_gate.ndim != 2:
            raise ValueError(f"w_gate must be 2-D (d_model, d_ff), got shape {w_gate.shape}")
        d_model, d_ff = w_gate.shape
        if w_up.shape != (d_model, d_ff):
            raise ValueError(f"w_up must have shape {(d_model, d_ff)}, got {w_up.shape}")
        if w_down.shape != (d_ff, d_model):
            raise ValueError(f"w_down must have shape {(d_ff, d_model)}, got {w_down.shape}")
        if d_model < 1 or d_ff < 1:
            raise ValueError(f"d_model and d_ff must be >= 1, got {d_model}, {d_ff}")
        if int(max_tokens) < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.expert_id = int(expert_id)
        self.version = int(version)
        self.dtype = dt
        self.d_model = int(d_model)
        self.d_ff = int(d_ff)
        self.w_gate = w_gate
        self.w_up = w_up
        self.w_down = w_down
        # where the weights came from, as a hot-update load names it ({"seed": 7},
        # {"weights": path}): the gateway re-creates a version on a returning worker from it
        self.source: Optional[dict] = None
        self._fingerprint: Optional[str] = None
        self._alloc_scratch(int(max_tokens))

    @property
    def fingerprint(self) -> str:
        """The weights' identity (workers/fingerprint.py), computed once."""
        if self._fingerprint is None:
            self._fingerprint = weights_fingerprint((self.w_gate, self.w_up, self.w_down))
        return self._fingerprint

    # -- construction -------------------------------------------------------

    @classmethod
    def from_seed(
        cls,
        expert_id: int,
        d_model: int,
        d_ff: int,
        seed: int = 0,
        dtype: object = np.float32,
        *,
        version: int = 0,
        max_tokens: int = 256,
    ) -> "SwiGLUExpert":
        """Deterministic weights: the same (seed, expert_id) gives the same
        weights in any process. Drawn in float64 and then cast, so float32 and
        float64 experts agree to float32 precision. Scale 1/sqrt(fan_in) keeps
        activations O(1) for O(1) inputs."""
        if expert_id < 0 or seed < 0:
            raise ValueError(f"expert_id and seed must be >= 0, got {expert_id}, {seed}")
        ss = np.random.SeedSequence(int(seed), spawn_key=(_EXPERT_STREAM, int(expert_id)))
        rng = np.random.default_rng(ss)
        dt = _as_dtype(dtype)
        w_gate = (rng.standard_normal((d_model, d_ff)) / np.sqrt(d_model)).astype(dt)
        w_up = (rng.standard_normal((d_model, d_ff)) / np.sqrt(d_model)).astype(dt)
        w_down = (rng.standard_normal((d_ff, d_model)) / np.sqrt(d_ff)).astype(dt)
        ex = cls(w_gate, w_up, w_down, expert_id=expert_id, version=version, max_tokens=max_tokens, dtype=dt)
        ex.source = {"seed": int(seed)}
        return ex

    @classmethod
    def from_npz(
        cls,
        path: str | os.PathLike,
        expert_id: int,
        *,
        max_tokens: int = 256,
        dtype: object = None,
    ) -> "SwiGLUExpert":
        """Load expert `expert_id` from a file written by `save_npz`/`save_many`."""
        with np.load(path, allow_pickle=False) as npz:
            prefix = f"expert{int(expert_id)}."
            missing = [k for k in _WEIGHTS if prefix + k not in npz.files]
            if missing:
                ids = sorted({int(m.group(1)) for f in npz.files if (m := _KEY.match(f))})
                raise ValueError(f"{os.fspath(path)}: no expert {expert_id} "
                                 f"(missing {missing}); experts in file: {ids}")
            ws = [npz[prefix + k] for k in _WEIGHTS]
            version = int(npz[prefix + "version"]) if prefix + "version" in npz.files else 0
        ex = cls(*ws, expert_id=expert_id, version=version, max_tokens=max_tokens, dtype=dtype)
        ex.source = {"weights": os.fspath(path)}
        return ex

    def save_npz(self, path: str | os.PathLike) -> None:
        """Write this expert alone to `path` (see `save_many` for several)."""
        self.save_many(path, [self])

    @staticmethod
    def save_many(path: str | os.PathLike, experts: Iterable["SwiGLUExpert"]) -> None:
        """Write several experts to one .npz (keys `expert{id}.w_gate`, ...).

        The file is written beside `path` and renamed over it, so a worker
        hot-swapping from `path` never reads a half-written file. The name is
        used exactly as given (no `.npz` appended)."""
        arrays: dict[str, np.ndarray] = {}
        for e in experts:
            p = f"expert{e.expert_id}."
            if p + "w_gate" in arrays:
                raise ValueError(f"expert id {e.expert_id} appears twice")
            arrays.update({p + "w_gate": e.w_gate, p + "w_up": e.w_up, p + "w_down": e.w_down,
                           p + "version": np.asarray(e.version, dtype=np.int64)})
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    # -- compute ------------------------------------------------------------

    def _alloc_scratch(self, n: int) -> None:
        self.max_tokens = n
        self._h_gate = np.empty((n, self.d_ff), dtype=self.dtype)
        self._h_up = np.empty((n, self.d_ff), dtype=self.dtype)

    def forward(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Compute the expert on `x` (n, d_model) into `out` (n, d_model); return `out`.

        `out` may be any writeable view (e.g. into a transport slot) and may
        even be `x` itself: x is fully consumed before `out` is written.
        Allocates nothing unless n exceeds `max_tokens` (then the scratch grows
        once, to n)."""
        if not isinstance(x, np.ndarray) or not isinstance(out, np.ndarray):
            raise ValueError("x and out must be numpy arrays")
        if x.ndim != 2 or x.shape[1] != self.d_model:
            raise ValueError(f"x must have shape (n, {self.d_model}), got {x.shape}")
        n = x.shape[0]
        if out.shape != (n, self.d_model):
            raise ValueError(f"out must have shape {(n, self.d_model)}, got {out.shape}")
        if x.dtype != self.dtype or out.dtype != self.dtype:
            raise ValueError(f"x and out must be {self.dtype}, got {x.dtype} and {out.dtype}")
        if not out.flags.writeable:
            raise ValueError("out is read-only")
        if n > self.max_tokens:
            self._alloc_scratch(n)
        g = self._h_gate[:n]
        u = self._h_up[:n]
        np.matmul(x, self.w_gate, out=g)
        np.matmul(x, self.w_up, out=u)
        silu_mul_(g, u)
        np.matmul(u, self.w_down, out=out)
        return out

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Allocating convenience for tests and tools, not for the hot path."""
        out = np.empty((x.shape[0], self.d_model), dtype=self.dtype)
        return self.forward(x, out)

    @property
    def nbytes(self) -> int:
        """Bytes held by the weights (scratch buffers excluded)."""
        return int(self.w_gate.nbytes + self.w_up.nbytes + self.w_down.nbytes)

    @property
    def scratch_nbytes(self) -> int:
        return int(self._h_gate.nbytes + self._h_up.nbytes)

    def __repr__(self) -> str:
        return (f"SwiGLUExpert(id={self.expert_id}, d_model={self.d_model}, d_ff={self.d_ff}, "
                f"dtype={self.dtype}, version={self.version})")


def npz_expert_ids(path: str | os.PathLike) -> list[int]:
    """Expert ids stored in an .npz written by `SwiGLUExpert.save_many`."""
    with np.load(path, allow_pickle=False) as npz:
        ids = {int(m.group(1)) for f in npz.files if (m := _KEY.match(f))}
    return sorted(ids)
