"""A worker's experts of a checkpoint layer as compute kernels.

    kernels = load_expert_kernels(ckpt, spec, [0, 1, 8], kind="torch", dtype="bfloat16")
    kernels[8].forward(x, reply_slot_array)          # id 8: a shared piece, if n_experts == 8

Reads only these experts' tensors (workers.checkpoint.load_experts), hands the stored
weights to the kernel as they are (bf16 bits stay bits for torch; numpy converts once).
"""
from __future__ import annotations

from typing import Iterable

from workers.checkpoint import Checkpoint, LayerSpec, load_experts
from workers.fingerprint import weights_fingerprint
from workers.kernels import Kernel, Scratch, make_kernel

__all__ = ["load_expert_kernels"]


def load_expert_kernels(ckpt: Checkpoint, spec: LayerSpec, expert_ids: Iterable[int], *, kind: str = "numpy",
                        dtype: object = "float32", max_tokens: int = 256, threads: int | None = 1,
                        scratch: Scratch | None = None, fingerprints: dict | None = None) -> dict[int, Kernel]:
    """``scratch``: intermediates shared by these kernels (and any others given the same
    one); only for kernels that never run at the same time, as in a worker.
    ``fingerprints``: filled with each expert's weights fingerprint (workers/fingerprint.py)
    of the stored tensors, as they are read."""
    out = {}
    for e, w in load_experts(ckpt, spec, expert_ids).items():
        if fingerprints is not None:
            fingerprints[e] = weights_fingerprint((w.w_gate, w.w_up, w.w_down))
        out[e] = make_kernel(kind, w.w_gate, w.w_up, w.w_down, dtype=dtype, max_tokens=max_tokens, threads=threads,
                             activation=spec.activation, scratch=scratch)
    return out
