"""A memory-mapped reader of one .safetensors file, in numpy alone.

Why our own reader and not the ``safetensors`` package: the checkpoint must also be read
inside the rxe guest, which has Debian's python3-numpy (1.24) and nothing else, and the
format is small enough to read safely by hand: an 8-byte little-endian header length N,
N bytes of JSON (``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
{...}}``), then the raw little-endian tensor bytes, offsets relative to the end of the
header. The file is mapped read-only; a tensor is a numpy view of the map, so only the
pages of the tensors actually used are ever read from disk.

BF16 tensors come back as uint16 bit arrays (see ``workers.bf16``), so neither torch nor
ml_dtypes is needed to read them.
"""
from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass

import numpy as np

__all__ = ["SafetensorsFile", "TensorInfo", "SafetensorsError", "DTYPES"]

# safetensors dtype code -> numpy dtype of the stored bytes (little-endian)
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # bits; workers.bf16 converts
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),  # bits only
}
# The dtype names the rest of the project uses for float tensors.
FLOAT_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
MAX_HEADER = 100 << 20  # the reference implementation's own limit


class SafetensorsError(ValueError):
    """A file that is not valid safetensors (or not what its index promised)."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``offset`` is absolute in ``path``."""

    name: str
    dtype: str  # safetensors code: "BF16", "F32", ...
    shape: tuple[int, ...]
    path: str
    offset: int
    nbytes: int

    @property
    def dtype_name(self) -> str:
        """"bfloat16", "float32", ... (the code itself for non-float dtypes)."""
        return FLOAT_NAMES.get(self.dtype, self.dtype)


class SafetensorsFile:
    """One mapped .safetensors file. ``tensor(name)`` is a read-only view of the map."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise SafetensorsError(f"{self.path}: {size} bytes, too short for safetensors")
            n = int.from_bytes(f.read(8), "little")
            if n > MAX_HEADER or 8 + n > size:
                raise SafetensorsError(f"{self.path}: header length {n} is invalid (file {size} bytes)")
            raw = f.read(n)
            # An empty map is legal only for a file without tensors; mmap of 0 bytes is not.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{self.path}: header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise SafetensorsError(f"{self.path}: __metadata__ is not an object")
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in meta.items()}
        base = 8 + n
        self._infos: dict[str, TensorInfo] = {}
        for name, d in header.items():
            self._infos[name] = self._parse_entry(name, d, base, size)

    def _parse_entry(self, name: str, d: object, base: int, size: int) -> TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(d, dict):
            raise SafetensorsError(f"{where}: entry is not an object")
        code, shape, offs = d.get("dtype"), d.get("shape"), d.get("data_offsets")
        if code not in DTYPES:
            raise SafetensorsError(f"{where}: unknown dtype {code!r}")
        if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
            raise SafetensorsError(f"{where}: bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise SafetensorsError(f"{where}: bad data_offsets {offs!r}")
        want = int(np.prod(shape, dtype=np.int64)) * DTYPES[code].itemsize
        if offs[1] - offs[0] != want:
            raise SafetensorsError(f"{where}: {offs[1] - offs[0]} bytes for shape {shape} of {code} ({want})")
        if base + offs[1] > size:
            raise SafetensorsError(f"{where}: data ends past the end of the file")
        return TensorInfo(name, code, tuple(shape), self.path, base + offs[0], want)

    # -- queries ------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None

    def tensor(self, name: str) -> np.ndarray:
        """The stored bytes as a read-only numpy view (BF16 as uint16 bits). No copy:
        pages are read from disk when touched."""
        ti = self.info(name)
        dt = DTYPES[ti.dtype]
        count = ti.nbytes // dt.itemsize
        a = np.frombuffer(self._map, dtype=dt, count=count, offset=ti.offset) if count else np.empty(0, dt)
        return a.reshape(ti.shape)

    def header_bytes(self) -> bytes:
        """The raw JSON header (what the checkpoint fingerprint hashes for this file)."""
        n = int.from_bytes(self._map[:8], "little")
        return bytes(self._map[8:8 + n])

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, {len(self._infos)} tensors)"
