"""bfloat16 in numpy, with or without ml_dtypes.

Conventions the checkpoint reader, the kernels and the wire share:

- A bf16 array is either an ``ml_dtypes.bfloat16`` array (when ml_dtypes is installed: it
  prints and converts like a float) or a ``uint16`` array holding the raw bf16 bits. No
  other meaning is ever given to a uint16 activation or weight in this project, so
  :func:`is_bf16` accepts both and the numpy-only path (the rxe guest: Debian's numpy
  1.24, no ml_dtypes) never needs the package.
- bf16 -> fp32 is exact: the 16 bits become the high half of a float32 (a shift).
- fp32 -> bf16 rounds to nearest, ties to even (what torch and ml_dtypes do), NaN stays
  NaN (quiet).

Every function takes an optional ``out`` (and ``scratch`` where one is needed) so the
kernels can convert into preallocated buffers without allocating on the hot path. Written
for numpy 1.24 too: each ufunc gets an explicit ``dtype`` so its result type never
depends on value-based casting.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["BF16_NAME", "bfloat16_dtype", "is_bf16", "bits", "to_float32", "from_float32",
           "wire_dtype", "dtype_name"]

BF16_NAME = "bfloat16"
_U16 = np.dtype(np.uint16)
_USER_DTYPES = 256  # NPY_USERDEF: type numbers from here on are registered ones (ml_dtypes')
_ml_dtype: Any = None  # cached np.dtype of ml_dtypes.bfloat16, False when unavailable


def bfloat16_dtype() -> np.dtype | None:
    """ml_dtypes' bfloat16 dtype, or None where ml_dtypes is not installed (imported
    lazily: the numpy-only path must not pay for it or need it)."""
    global _ml_dtype
    if _ml_dtype is None:
        try:
            import ml_dtypes
            _ml_dtype = np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            _ml_dtype = False
    return _ml_dtype or None


def is_bf16(dtype: Any) -> bool:
    """True for ml_dtypes.bfloat16 and for uint16 (raw bf16 bits)."""
    dt = np.dtype(dtype) if not isinstance(dtype, np.dtype) else dtype
    if dt.num < _USER_DTYPES:  # numpy's own types (asked on every array of the hot path: no name lookup)
        return dt.num == _U16.num and dt.isnative
    return dt.name == BF16_NAME


def wire_dtype(name: str) -> np.dtype:
    """The numpy dtype that represents activations named ``name`` on the wire:
    ml_dtypes.bfloat16 (or uint16 bits without ml_dtypes) for "bfloat16", else np.dtype(name)."""
    if name == BF16_NAME:
        return bfloat16_dtype() or np.dtype(np.uint16)
    return np.dtype(name)


_NAMES: dict = {}  # dtype -> its name: numpy builds a dtype's name in Python, on every call


def dtype_name(dtype: Any) -> str:
    """"bfloat16" for either bf16 representation, else numpy's name ("float32", ...)."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):
        pass
    name = BF16_NAME if is_bf16(dtype) else np.dtype(dtype).name
    if len(_NAMES) < 64 and isinstance(dtype, (np.dtype, str)):
        _NAMES[dtype] = name
    return name


def bits(a: np.ndarray) -> np.ndarray:
    """The uint16 bit view of a bf16 array (no copy)."""
    if not is_bf16(a.dtype):
        raise TypeError(f"not a bf16 array: {a.dtype}")
    return a if a.dtype == np.uint16 else a.view(np.uint16)


def to_float32(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bf16 (either representation) -> float32, exactly, into ``out`` if given."""
    b = bits(a)
    if out is None:
        out = np.empty(b.shape, np.float32)
    if out.shape != b.shape or out.dtype != np.float32:
        raise ValueError(f"out must be float32 of shape {b.shape}, got {out.dtype} {out.shape}")
    np.left_shift(b, np.uint32(16), out=out.view(np.uint32), dtype=np.uint32)
    return out


def from_float32(a: np.ndarray, out: np.ndarray | None = None, scratch: np.ndarray | None = None
                 ) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even) into ``out`` (a uint16 or
    ml_dtypes.bfloat16 array; a new uint16 array if None). ``scratch``: a uint32 array of
    at least a.size elements, to stay allocation-free."""
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise TypeError(f"from_float32 needs float32, got {a.dtype}")
    if out is None:
        out = np.empty(a.shape, np.uint16)
    ob = bits(out)
    if ob.shape != a.shape:
        raise ValueError(f"out shape {ob.shape} != {a.shape}")
    n = a.size
    if scratch is None:
        scratch = np.empty(n, np.uint32)
    if scratch.dtype != np.uint32 or scratch.size < n:
        raise ValueError(f"scratch must be uint32 with >= {n} elements")
    t = scratch.reshape(-1)[:n].reshape(a.shape)
    u = a.view(np.uint32)
    # t = u + 0x7FFF + ((u >> 16) & 1), then >> 16: round half to even on the dropped bits.
    np.right_shift(u, np.uint32(16), out=t, dtype=np.uint32)
    np.bitwise_and(t, np.uint32(1), out=t, dtype=np.uint32)
    np.add(t, np.uint32(0x7FFF), out=t, dtype=np.uint32)
    np.add(t, u, out=t, dtype=np.uint32)  # wraps only for NaN payloads, fixed below
    np.right_shift(t, np.uint32(16), out=t, dtype=np.uint32)
    np.copyto(ob, t, casting="unsafe")
    if n and np.isnan(a.max()):  # max propagates NaN: a check that allocates nothing
        nan = np.isnan(a)  # rare: keep NaN a (quiet) NaN whatever its payload
        ob[nan] = (u[nan] >> np.uint32(16)).astype(np.uint16) | np.uint16(0x0040)
    return out
