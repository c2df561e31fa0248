"""What a worker serves, built from its flags: experts keyed by (layer, id), as kernels.

Two sources:

- a Hugging Face checkpoint (``--checkpoint DIR --layers 0-23 --experts 0-3``): only these
  experts of these layers are read (shared-expert pieces are ids n_experts.. like any
  other), each becomes a kernel (``--compute numpy|torch``) taking activations in the wire
  dtype (``--dtype``), and each layer's fingerprint is computed for the gateway's check;
- demo weights (``--seed``, or an .npz): the classic ``SwiGLUExpert`` for numpy with a
  float32/float64 wire, else the same seeded weights in a kernel
  (``--compute torch``, or a bf16/fp16 wire), so benchmarks can run the torch kernel on
  synthetic weights.

Also the builders of hot-update versions (:func:`build_version`): the same kind of object
as the expert it replaces, from a seed, an .npz, or a checkpoint layer (whose fingerprint
must be the one the gateway computed).

The experts of one call (one worker: one serve loop, one expert at a time) share one set of
intermediates (``workers.kernels.Scratch``), and so do the hot-update versions built for them;
two workers in one process (tests) each have their own.

Where dtype conversions happen (the only copies besides the kernel's own scratch): a bf16
wire with a float32 compute dtype (the numpy kernel always; the torch kernel on CPUs
without bf16 matrix units, see ``workers.kernels.torch_compute_dtype``) converts the
received bf16 rows into float32 scratch once, and the float32 result into the reply slot
once (round to nearest even). With the wire already in the compute dtype (float32, or bf16
on AMX/AVX512-BF16 CPUs with torch) tensors are made over the received buffer and the
reply slot and nothing is converted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from workers import bf16
from workers.kernels import KINDS, Kernel, Scratch, make_kernel, torch_compute_dtype

__all__ = ["KernelExpert", "compute_dtype", "checkpoint_experts", "demo_experts", "build_version", "Served"]

WIRE_DTYPES = ("float32", "float64", "float16", "bfloat16")


@dataclass
class KernelExpert:
    """One expert id of one layer served by a kernel (what the daemon holds per (layer, id))."""

    kernel: Kernel
    expert_id: int
    layer: int
    wire: np.dtype  # activations in and out (numpy representation, bf16 via workers.bf16)
    version: int = 0
    scratch: Optional[Scratch] = None  # shared with the worker's other kernels
    fingerprint: Optional[str] = None  # of the weights as their source holds them (workers/fingerprint.py)
    source: Optional[dict] = None  # where they came from, as a load names it ({"seed": 7}, ...)

    @property
    def d_model(self) -> int:
        return self.kernel.d_model

    @property
    def d_ff(self) -> int:
        return self.kernel.d_ff

    @property
    def dtype(self) -> np.dtype:
        return self.wire

    def forward(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        return self.kernel.forward(x, out)

    def describe(self) -> dict:
        return {**self.kernel.describe(), "wire_dtype": bf16.dtype_name(self.wire)}


def describe_expert(ex: Any) -> dict:
    """``describe()`` of a KernelExpert, or the same fields for a demo SwiGLUExpert."""
    if hasattr(ex, "describe"):
        return ex.describe()
    return {"kernel": "numpy", "dtype": ex.dtype.name, "threads": None, "d_model": ex.d_model, "d_ff": ex.d_ff,
            "max_tokens": ex.max_tokens, "wire_dtype": ex.dtype.name}


def compute_dtype(kind: str, wire: str) -> str:
    """The kernel's compute dtype for activations of ``wire``: numpy float32 (float64 for a
    float64 wire); torch the wire dtype, except bf16 on a CPU without bf16 matrix units
    (float32 there: bf16 would be emulated, several times slower)."""
    if kind not in KINDS:
        raise ValueError(f"unknown compute kind {kind!r}; expected one of {KINDS}")
    if wire not in WIRE_DTYPES:
        raise ValueError(f"unknown dtype {wire!r}; expected one of {WIRE_DTYPES}")
    if kind == "numpy":
        return "float64" if wire == "float64" else "float32"
    if wire == "float64":
        raise ValueError("the torch kernel computes in bfloat16, float16 or float32, not float64")
    return torch_compute_dtype(wire)


@dataclass
class Served:
    """A worker's experts and identity: {(layer, id): expert}, {layer: fingerprint or None},
    the checkpoint's fingerprint (None for demo weights) and its directory."""

    experts: dict
    fingerprints: dict
    checkpoint: Optional[str] = None
    checkpoint_dir: Optional[str] = None


def checkpoint_experts(path: str, layers: Optional[Iterable[int]], ids: Optional[Iterable[int]], *,
                       kind: str = "numpy", wire: str = "float32", max_tokens: int = 256,
                       threads: Optional[int] = 1) -> Served:
    """Expert ids ``ids`` (default: every id, shared pieces included) of MoE layers
    ``layers`` (default: all) of the checkpoint at ``path``, sharing one scratch."""
    from workers.checkpoint import Checkpoint, checkpoint_fingerprint, layer_fingerprint, model_spec
    from workers.layer_experts import load_expert_kernels

    ckpt = Checkpoint(path)
    ms = model_spec(ckpt)
    wanted = ms.moe_layers if layers is None else [int(L) for L in layers]
    cdt = compute_dtype(kind, wire)
    wdt = bf16.wire_dtype(wire)
    scratch = Scratch()
    experts, fps = {}, {}
    for L in wanted:
        spec = ms.layer(L)  # CheckpointError naming the MoE layers for a dense or absent one
        want = list(range(spec.n_ids)) if ids is None else [int(e) for e in ids]
        bad = [e for e in want if not 0 <= e < spec.n_ids]
        if bad:
            raise ValueError(f"layer {L} has expert ids 0..{spec.n_ids - 1} ({spec.n_experts} routed + "
                             f"{spec.n_shared} shared pieces), not {bad}")
        fps[L] = layer_fingerprint(ckpt, spec)
        source = {"checkpoint": ckpt.path, "fingerprint": fps[L]}
        weights: dict = {}
        for e, k in load_expert_kernels(ckpt, spec, want, kind=kind, dtype=cdt, max_tokens=max_tokens,
                                        threads=threads, scratch=scratch, fingerprints=weights).items():
            experts[(L, e)] = KernelExpert(k, e, L, wdt, scratch=scratch, fingerprint=weights[e], source=source)
    return Served(experts, fps, checkpoint_fingerprint(ckpt), ckpt.path)


def demo_experts(ids: Iterable[int], *, d_model: int, d_ff: int, seed: int = 0, weights: Optional[str] = None,
                 kind: str = "numpy", wire: str = "float32", max_tokens: int = 256,
                 threads: Optional[int] = 1) -> Served:
    """Layer 0's experts from a seed or an .npz (see the module docstring)."""
    from workers.expert import SwiGLUExpert

    out = {}
    scratch = Scratch()
    for e in ids:
        if weights:
            ex = SwiGLUExpert.from_npz(weights, e, max_tokens=0 if _as_kernel(kind, wire) else max_tokens,
                                       dtype=None if _as_kernel(kind, wire) else np.dtype(wire))
        else:
            ex = SwiGLUExpert.from_seed(e, d_model, d_ff, seed=seed, max_tokens=0 if _as_kernel(kind, wire)
                                        else max_tokens, dtype=np.float32 if _as_kernel(kind, wire) else wire)
        out[(0, e)] = _wrap(ex, kind, wire, max_tokens, threads, scratch) if _as_kernel(kind, wire) else ex
    return Served(out, {0: None})


def _as_kernel(kind: str, wire: str) -> bool:
    return kind != "numpy" or wire not in ("float32", "float64")


def _wrap(ex: Any, kind: str, wire: str, max_tokens: int, threads: Optional[int], scratch: Optional[Scratch],
          layer: int = 0) -> KernelExpert:
    """A SwiGLUExpert's weights ((d_model, d_ff) orientation) in a kernel ((d_ff, d_model))."""
    k = make_kernel(kind, ex.w_gate.T, ex.w_up.T, ex.w_down.T, dtype=compute_dtype(kind, wire),
                    max_tokens=max_tokens, threads=threads, scratch=scratch)
    return KernelExpert(k, ex.expert_id, layer, bf16.wire_dtype(wire), ex.version, scratch,
                        fingerprint=ex.fingerprint, source=ex.source)


# -- hot-update versions ---------------------------------------------------------------------

def build_version(req: Any, path: Optional[str], ref: Any, *, max_tokens: int, new: bool = False) -> Any:
    """The new version ``req`` (workers.protocol.LoadRequest) of the expert ``ref`` serves:
    from ``path`` (an .npz file or a checkpoint directory, already resolved inside the
    worker's update directory) or a seed; the same kind of object as ``ref``. ``new``: a
    copy of an expert this worker does not host yet, built like ``ref`` (another expert of
    the layer: its width may differ, a checkpoint's shared piece say)."""
    from workers.expert import SwiGLUExpert

    if req.checkpoint is not None:
        ex = _from_checkpoint(req, path, ref, max_tokens, new)
    else:
        wire = bf16.dtype_name(ref.dtype)
        as_kernel = isinstance(ref, KernelExpert)
        dt = np.float32 if as_kernel else ref.dtype
        if path is not None:
            ex = SwiGLUExpert.from_npz(path, req.expert, max_tokens=0 if as_kernel else max_tokens,
                                       dtype=None if as_kernel else dt)
        else:
            ex = SwiGLUExpert.from_seed(req.expert, ref.d_model, ref.d_ff, seed=req.seed, dtype=dt,
                                        max_tokens=0 if as_kernel else max_tokens)
        if (ex.d_model, ex.d_ff) != (ref.d_model, ref.d_ff):
            raise ValueError(f"weights are ({ex.d_model}, {ex.d_ff}), this worker serves "
                             f"({ref.d_model}, {ref.d_ff})")
        ex.source = {"weights": req.weights} if path is not None else {"seed": req.seed}
        if as_kernel:
            ex = _wrap(ex, ref.kernel.kind, wire, max_tokens, None, ref.scratch, layer=req.layer)
    ex.version = req.version
    return ex


def _from_checkpoint(req: Any, path: Optional[str], ref: Any, max_tokens: int, new: bool = False) -> KernelExpert:
    from workers.checkpoint import Checkpoint, layer_fingerprint, model_spec
    from workers.layer_experts import load_expert_kernels

    if not isinstance(ref, KernelExpert):
        raise ValueError("this worker serves demo weights: a checkpoint version needs a worker started "
                         "with --checkpoint")
    ckpt = Checkpoint(path)
    spec = model_spec(ckpt).layer(req.layer)
    if req.fingerprint is not None:
        fp = layer_fingerprint(ckpt, spec)
        if fp != req.fingerprint:
            raise ValueError(f"layer {req.layer} of {ckpt.path} has fingerprint {fp[:12]}, the gateway read "
                             f"{req.fingerprint[:12]}: they do not read the same checkpoint")
    if spec.d_model != ref.d_model or (not new and spec.expert_d_ff(req.expert) != ref.d_ff):
        raise ValueError(f"layer {req.layer} expert {req.expert} of {ckpt.path} is ({spec.d_model}, "
                         f"{spec.expert_d_ff(req.expert)}), this worker serves ({ref.d_model}, {ref.d_ff})")
    weights: dict = {}
    k = load_expert_kernels(ckpt, spec, [req.expert], kind=ref.kernel.kind, dtype=ref.kernel.describe()["dtype"],
                            max_tokens=max_tokens, threads=None, scratch=ref.scratch, fingerprints=weights)[req.expert]
    source = {"checkpoint": req.checkpoint}
    if req.fingerprint is not None:
        source["fingerprint"] = req.fingerprint
    return KernelExpert(k, req.expert, req.layer, ref.wire, req.version, ref.scratch,
                        fingerprint=weights[req.expert], source=source)


def layer_table(experts: Mapping) -> dict:
    """{layer: sorted ids} of {(layer, id): expert}."""
    out: dict = {}
    for L, e in experts:
        out.setdefault(L, []).append(e)
    return {L: sorted(v) for L, v in sorted(out.items())}
