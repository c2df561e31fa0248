"""Loading what each process needs from a checkpoint layer, and its identity.

- a worker: :func:`load_experts` (its expert ids of a layer, shared pieces included);
- the gateway: :func:`load_router` (the gate, the selection bias, the shared expert's
  sigmoid gate: everything a layer computes outside the experts);
- both: :func:`layer_fingerprint`, compared at handshake.

Expert weights are returned in the checkpoint's own orientation (nn.Linear's (out, in):
gate and up (d_ff, d_model), down (d_model, d_ff)) and dtype (BF16 as uint16 bits), as
read-only views of the mapped files: nothing is copied or converted here; a kernel
converts (numpy: to float32) or takes the bf16 bits as they are (torch).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Iterable

import numpy as np

from workers import bf16
from workers.checkpoint.spec import LayerSpec
from workers.checkpoint.store import Checkpoint, CheckpointError

__all__ = ["ExpertWeights", "RouterWeights", "load_experts", "load_router", "layer_fingerprint",
           "checkpoint_fingerprint"]


@dataclass(frozen=True)
class ExpertWeights:
    """One expert's SwiGLU weights, y = down(silu(gate x) * up x), in (out, in) orientation.

    ``dtype`` names what the arrays hold: "bfloat16" (uint16 bits), "float16" or "float32".
    The arrays may be read-only views of the checkpoint's mapped files."""

    expert_id: int
    w_gate: np.ndarray  # (d_ff, d_model)
    w_up: np.ndarray  # (d_ff, d_model)
    w_down: np.ndarray  # (d_model, d_ff)
    dtype: str

    @property
    def d_model(self) -> int:
        return int(self.w_gate.shape[1])

    @property
    def d_ff(self) -> int:
        return int(self.w_gate.shape[0])

    def float32(self) -> "ExpertWeights":
        """A float32 copy (bf16 exactly, by shifting its bits)."""
        return ExpertWeights(self.expert_id, *(to_float32(w, self.dtype) for w in
                                               (self.w_gate, self.w_up, self.w_down)), "float32")


@dataclass(frozen=True)
class RouterWeights:
    """A layer's gate in float32: weight (n_experts, d_model), the selection-only score
    bias (n_experts,) or None, the shared expert's gate (1, d_model) or None."""

    weight: np.ndarray
    bias: np.ndarray | None
    shared_gate: np.ndarray | None


def to_float32(a: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 copy of a stored tensor of dtype name ``dtype``."""
    if dtype == "bfloat16":
        return bf16.to_float32(np.ascontiguousarray(a))
    return np.array(a, dtype=np.float32)


def load_experts(ckpt: Checkpoint, spec: LayerSpec, expert_ids: Iterable[int]) -> dict[int, ExpertWeights]:
    """Expert ``e`` of layer ``spec.layer`` for each id: routed experts (0..n_experts-1) and
    shared pieces (n_experts..n_ids-1). Only these tensors' pages are ever read."""
    out: dict[int, ExpertWeights] = {}
    for e in expert_ids:
        e = int(e)
        spec._check_id(e)
        out[e] = _shared_piece(ckpt, spec, e) if spec.is_shared(e) else _routed(ckpt, spec, e)
    return out


def _routed(ckpt: Checkpoint, spec: LayerSpec, e: int) -> ExpertWeights:
    lay, I, H = spec.experts, spec.d_ff, spec.d_model
    if lay.kind == "fused":
        gu, down = ckpt.raw(lay.gate)[e], ckpt.raw(lay.down)[e]
        return ExpertWeights(e, gu[:I], gu[I:], down, spec.dtype)
    ws = []
    for name, shape in zip(lay.names(e), ((I, H), (I, H), (H, I))):
        w = ckpt.raw(name)
        if w.shape != shape or ckpt.dtype_name(name) != spec.dtype:
            raise CheckpointError(f"layer {spec.layer}: {name} is {ckpt.dtype_name(name)} {w.shape}, "
                                  f"expected {spec.dtype} {shape} like expert 0")
        ws.append(w)
    return ExpertWeights(e, *ws, spec.dtype)


def _shared_piece(ckpt: Checkpoint, spec: LayerSpec, e: int) -> ExpertWeights:
    sh = spec.shared
    assert sh is not None
    j, w = e - spec.n_experts, sh.piece_d_ff
    dts = {ckpt.dtype_name(n) for n in (sh.gate, sh.up, sh.down)}
    if len(dts) != 1:
        raise CheckpointError(f"layer {spec.layer}: shared expert stored in mixed dtypes {sorted(dts)}")
    cols = slice(j * w, (j + 1) * w)
    # The down slice is a strided view (its rows are S wide): kernels copy it contiguous.
    return ExpertWeights(e, ckpt.raw(sh.gate)[cols], ckpt.raw(sh.up)[cols], ckpt.raw(sh.down)[:, cols], dts.pop())


def load_router(ckpt: Checkpoint, spec: LayerSpec) -> RouterWeights:
    """The gateway's part of a layer, in float32."""
    def f32(name: str) -> np.ndarray:
        return to_float32(ckpt.raw(name), ckpt.dtype_name(name))
    bias = f32(spec.routing.bias) if spec.routing.bias else None
    sg = f32(spec.shared.gate_weight) if spec.shared and spec.shared.gate_weight else None
    return RouterWeights(f32(spec.router), bias, sg)


# -- identity -------------------------------------------------------------------

_SAMPLE = 256  # bytes hashed from each end of every expert matrix row block


def layer_fingerprint(ckpt: Checkpoint, spec: LayerSpec) -> str:
    """A stable identity of one MoE layer's weights, cheap for every process to compute.

    Hashes the layer's spec (family, sizes, routing rule, shared experts, dtype), the
    router tensors in full (small, and what a fine-tune changes first) and, for every
    expert id, the first and last ``_SAMPLE`` bytes of its gate, up and down matrices: a
    few pages per expert, not the weights. It names the layer, not the files: the same
    layer saved per-expert or fused, in one file or sharded, has the same fingerprint."""
    h = hashlib.sha256()
    desc = {"family": spec.family, "layer": spec.layer, "d_model": spec.d_model, "d_ff": spec.d_ff,
            "n_experts": spec.n_experts, "activation": spec.activation, "dtype": spec.dtype,
            "routing": {**asdict(spec.routing), "bias": spec.routing.bias is not None},
            "shared": None if spec.shared is None else {"d_ff": spec.shared.d_ff, "pieces": spec.shared.pieces,
                                                        "gated": spec.shared.gate_weight is not None}}
    h.update(json.dumps(desc, sort_keys=True).encode())
    for name in (spec.router, spec.routing.bias, spec.shared.gate_weight if spec.shared else None):
        if name:
            h.update(np.ascontiguousarray(ckpt.raw(name)).tobytes())
    for e, w in load_experts(ckpt, spec, range(spec.n_ids)).items():
        for m in (w.w_gate, w.w_up, w.w_down):
            h.update(_ends(m))
    return h.hexdigest()


def _ends(m: np.ndarray) -> bytes:
    flat_first = np.ascontiguousarray(m[:1]).tobytes()[:_SAMPLE]
    flat_last = np.ascontiguousarray(m[-1:]).tobytes()[-_SAMPLE:]
    return flat_first + flat_last


def checkpoint_fingerprint(ckpt: Checkpoint) -> str:
    """Identity of the checkpoint as files: config.json (canonical JSON) and every tensor's
    name, dtype and shape. Reads headers only."""
    h = hashlib.sha256(json.dumps(ckpt.config, sort_keys=True).encode())
    for name in sorted(ckpt.keys()):
        ti = ckpt.info(name)
        h.update(f"{name}\0{ti.dtype}\0{','.join(map(str, ti.shape))}\n".encode())
    return h.hexdigest()
