"""The identity of an expert's weights: a hash of the arrays as their source holds them.

Every worker computes it for every version it holds (start-up weights and hot-update
versions alike) and reports it; the gateway admits a worker only when the fingerprints of
the versions it would be asked to serve equal the ones it serves (gateway/served.py).

It hashes the weights as read from the source (a seed's float arrays, an .npz's arrays, a
checkpoint's stored tensors), before any conversion to a kernel's compute dtype, so two
workers with different kernels over the same weights agree. SHA-256 (hardware-assisted on
x86, see docs/performance.md#fingerprints) over every byte: a sampled hash could miss a
fine-tune that touched the middle of a matrix.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import numpy as np

from workers import bf16

__all__ = ["weights_fingerprint", "FINGERPRINT_CHARS"]

FINGERPRINT_CHARS = 32  # hex characters kept (128 bits)


def weights_fingerprint(arrays: Iterable[np.ndarray]) -> str:
    """A hex digest of ``arrays`` in order: each one's dtype, shape and bytes (bf16 as
    ml_dtypes or as uint16 bits is the same weights, see workers/bf16.py)."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{bf16.dtype_name(a.dtype)}{a.shape}".encode())
        h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()[:FINGERPRINT_CHARS]
