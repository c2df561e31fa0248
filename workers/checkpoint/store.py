"""A Hugging Face checkpoint directory: config.json plus one or many .safetensors.

Sharded checkpoints name every tensor's file in ``model.safetensors.index.json``
(``{"metadata": {...}, "weight_map": {name: file}}``); a single-file checkpoint is
``model.safetensors``. Shards are opened (mapped) only when one of their tensors is first
asked for, so a worker that needs four experts of one layer maps the shards holding them
and reads only their pages.
"""
from __future__ import annotations

import json
import os

import numpy as np

from workers import bf16
from workers.checkpoint.safetensors import SafetensorsError, SafetensorsFile, TensorInfo

__all__ = ["Checkpoint", "CheckpointError"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served: missing files, bad index, unknown family."""


class Checkpoint:
    """Read-only view of a checkpoint directory. Cheap to open: parses config.json and the
    index (or the single file's header); tensor data is mapped on demand."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(os.fspath(path))
        cfg = os.path.join(self.path, "config.json")
        try:
            with open(cfg, "rb") as f:
                self.config_bytes = f.read()
        except OSError as e:
            raise CheckpointError(f"{self.path}: not a checkpoint directory (no config.json: {e.strerror})") from None
        try:
            self.config: dict = json.loads(self.config_bytes)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg}: not JSON: {e}") from None
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{cfg}: not a JSON object")
        self._files: dict[str, SafetensorsFile] = {}
        index = os.path.join(self.path, INDEX)
        if os.path.exists(index):
            with open(index, "rb") as f:
                try:
                    idx = json.load(f)
                except json.JSONDecodeError as e:
                    raise CheckpointError(f"{index}: not JSON: {e}") from None
            wm = idx.get("weight_map") if isinstance(idx, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise CheckpointError(f"{index}: no weight_map of tensor name -> file")
            for fname in set(wm.values()):
                if os.path.basename(fname) != fname:
                    raise CheckpointError(f"{index}: shard {fname!r} is not a file of the directory")
            self._weight_map: dict[str, str] = dict(wm)
        elif os.path.exists(os.path.join(self.path, SINGLE)):
            self._weight_map = {k: SINGLE for k in self._file(SINGLE).keys()}
        else:
            raise CheckpointError(f"{self.path}: neither {INDEX} nor {SINGLE}")

    # -- files --------------------------------------------------------------

    def _file(self, fname: str) -> SafetensorsFile:
        f = self._files.get(fname)
        if f is None:
            p = os.path.join(self.path, fname)
            try:
                f = SafetensorsFile(p)
            except OSError as e:
                raise CheckpointError(f"{p}: {e.strerror}") from None
            self._files[fname] = f
        return f

    def shard_of(self, name: str) -> str:
        try:
            return self._weight_map[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None

    @property
    def shards(self) -> list[str]:
        return sorted(set(self._weight_map.values()))

    @property
    def mapped_shards(self) -> list[str]:
        """Shards opened so far (what 'reads only what it needs' is checked with)."""
        return sorted(self._files)

    # -- tensors ------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def info(self, name: str) -> TensorInfo:
        f = self._file(self.shard_of(name))
        if name not in f:
            raise SafetensorsError(f"{f.path}: index says it holds {name!r}, its header does not")
        return f.info(name)

    def raw(self, name: str) -> np.ndarray:
        """The stored tensor as a read-only view of the mapped file: float32/float16 as is,
        BF16 as uint16 bits (``workers.bf16``), with its stored shape. No copy."""
        self.info(name)  # the index/header consistency check
        return self._file(self.shard_of(name)).tensor(name)

    def dtype_name(self, name: str) -> str:
        return self.info(name).dtype_name

    def array(self, name: str, dtype: object = np.float32) -> np.ndarray:
        """The tensor converted to a float dtype (a new, writable array). BF16 -> float32 is
        exact (a shift), float16 -> float32 too."""
        a = self.raw(name)
        if self.info(name).dtype == "BF16":
            f32 = bf16.to_float32(a)
            return f32 if np.dtype(dtype) == np.float32 else f32.astype(dtype)
        return np.array(a, dtype=dtype)

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, {len(self._weight_map)} tensors in {len(self.shards)} files)"
