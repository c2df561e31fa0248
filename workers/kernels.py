"""SwiGLU expert compute kernels: y = down(silu(gate x) * up x), written into the caller's
output array (the reply slot).

Two kinds, one interface (`Kernel`):

- ``numpy``: float32 (or float64) BLAS, allocation-free: every intermediate lives in
  scratch sized for ``max_tokens``, every matmul writes through ``out=``. bf16 inputs and
  outputs are converted into/out of float32 scratch (the numpy kernel computes in
  float32). Needs numpy alone (it also runs in the rxe guest).
- ``torch``: bf16 (or float32/float16) ``torch.mm`` through oneDNN, which uses the CPU's
  AMX/AVX-512-BF16 matrix units where the CPU has them (see `cpu_bf16_matmul`; on a CPU
  without them bf16 is emulated and slower than float32). Tensors are made over the
  caller's arrays (``torch.from_numpy``: the slot's own memory), so with activations
  already in the compute dtype nothing is converted or copied on the way in or out.

Weights are given in nn.Linear's (out, in) orientation, as checkpoints store them:
w_gate and w_up (d_ff, d_model), w_down (d_model, d_ff); numpy arrays in float32,
float16, float64, or bf16 (uint16 bits or ml_dtypes.bfloat16, see ``workers.bf16``).
Gate and up are stacked into one (2*d_ff, d_model) matrix so the first product is one
GEMM. Activations: (n, d_model) arrays in float32, float64 (numpy kernel), float16
(torch kernel) or bf16 (either representation).

``threads`` is process-wide (BLAS's pool via threadpoolctl for numpy,
torch.set_num_threads for torch): a worker process runs one kernel kind, one thread
unless told otherwise.

``scratch`` (a :class:`Scratch`, optional): kernels that never run at the same time (a
worker's serve loop runs one expert at a time) share their intermediates, so a worker
serving many layers' experts holds one set sized for the largest batch, not one per kernel
(24 layers x 4 experts of a 2048-wide model would otherwise hold ~7 GB of scratch).
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Protocol

import numpy as np

from workers import bf16
from workers.expert import silu_mul_

__all__ = ["Kernel", "NumpySwiGLU", "TorchSwiGLU", "make_kernel", "KINDS", "cpu_bf16_matmul",
           "torch_compute_dtype", "Scratch"]

KINDS = ("numpy", "torch")
ACTIVATIONS = ("silu",)


class Kernel(Protocol):
    d_model: int
    d_ff: int
    max_tokens: int

    def forward(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Compute on x (n, d_model) into out (n, d_model); return out."""

    def describe(self) -> dict[str, Any]:
        """{"kernel", "dtype", "threads", "d_model", "d_ff", ...} for info and /metrics."""


class Scratch:
    """Intermediate buffers shared by kernels that never run at the same time (not thread
    safe by design: one serve loop, one expert at a time). Each named buffer is as large as
    the largest request; a request for more replaces it (once; the old one lives on in any
    view still held), so the steady state allocates nothing."""

    def __init__(self) -> None:
        self._bufs: dict = {}

    ALIGN = 64  # what torch's CPU allocator gives its tensors (numpy's large arrays: 16)

    def reserve(self, key: Any, nbytes: int) -> None:
        buf = self._bufs.get(key)
        if buf is None or buf.nbytes < nbytes:
            raw = np.empty(max(1, int(nbytes)) + self.ALIGN, np.uint8)
            off = -raw.ctypes.data % self.ALIGN
            self._bufs[key] = raw[off:off + max(1, int(nbytes))]

    def raw(self, key: Any, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of buffer ``key`` (uint8)."""
        self.reserve(key, nbytes)
        return self._bufs[key][:nbytes]

    def array(self, key: Any, shape: tuple, dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        return self.raw((key, dt.str), int(np.prod(shape)) * dt.itemsize).view(dt).reshape(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())


def _weights_f32(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if bf16.is_bf16(a.dtype):
        return bf16.to_float32(np.ascontiguousarray(bf16.bits(a))).astype(dtype, copy=False)
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"weights must be floating point or bf16, got {a.dtype}")
    return np.asarray(a, dtype=dtype)


def _check_shapes(w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> tuple[int, int]:
    if w_gate.ndim != 2:
        raise ValueError(f"w_gate must be 2-D (d_ff, d_model), got shape {w_gate.shape}")
    d_ff, d_model = (int(n) for n in w_gate.shape)
    if d_ff < 1 or d_model < 1:
        raise ValueError(f"d_ff and d_model must be >= 1, got {d_ff}, {d_model}")
    if w_up.shape != (d_ff, d_model):
        raise ValueError(f"w_up must have shape {(d_ff, d_model)}, got {w_up.shape}")
    if w_down.shape != (d_model, d_ff):
        raise ValueError(f"w_down must have shape {(d_model, d_ff)}, got {w_down.shape}")
    return d_model, d_ff


def _check_io(x: np.ndarray, out: np.ndarray, d_model: int) -> int:
    if not isinstance(x, np.ndarray) or not isinstance(out, np.ndarray):
        raise ValueError("x and out must be numpy arrays")
    if x.ndim != 2 or x.shape[1] != d_model:
        raise ValueError(f"x must have shape (n, {d_model}), got {x.shape}")
    n = x.shape[0]
    if out.shape != (n, d_model):
        raise ValueError(f"out must have shape {(n, d_model)}, got {out.shape}")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous (a slot's memory)")
    return n


class NumpySwiGLU:
    """The numpy kernel (see the module docstring). ``dtype``: float32 or float64."""

    kind = "numpy"

    def __init__(self, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, *,
                 dtype: object = np.float32, max_tokens: int = 256, threads: int | None = None,
                 scratch: Scratch | None = None) -> None:
        dt = np.dtype(dtype)
        if dt not in (np.float32, np.float64):
            raise ValueError(f"the numpy kernel computes in float32 or float64, not {bf16.dtype_name(dt)}")
        self.d_model, self.d_ff = _check_shapes(w_gate, w_up, w_down)
        self.dtype = dt
        self.threads = threads
        wgu = np.empty((2 * self.d_ff, self.d_model), dt)
        wgu[: self.d_ff] = _weights_f32(w_gate, dt)
        wgu[self.d_ff:] = _weights_f32(w_up, dt)
        self._wgu = wgu
        self._wd = np.ascontiguousarray(_weights_f32(w_down, dt))
        if threads is not None:
            _limit_blas(threads)
        self._scratch = scratch
        self._alloc(max(0, int(max_tokens)))

    def _shapes(self, n: int) -> dict:
        return {"h": ((n, 2 * self.d_ff), self.dtype),  # gate and up, side by side
                "x": ((n, self.d_model), self.dtype),  # converted input (bf16 or other dtype)
                "y": ((n, self.d_model), self.dtype),  # output before its conversion
                "bits": ((n * self.d_model,), np.dtype(np.uint32))}  # float32 -> bf16 scratch

    def _alloc(self, n: int) -> None:
        self.max_tokens = n
        if self._scratch is not None:  # shared: reserve room, hold nothing of our own
            for k, (shape, dt) in self._shapes(n).items():
                self._scratch.reserve((("numpy", k), dt.str), int(np.prod(shape)) * dt.itemsize)
            return
        self._h, self._x, self._y, self._bits = (np.empty(shape, dt) for shape, dt in self._shapes(n).values())

    def _buf(self, name: str, n: int) -> np.ndarray:
        if self._scratch is None:
            return getattr(self, "_" + name)[:n] if name != "bits" else self._bits[:n * self.d_model]
        shape, dt = self._shapes(n)[name]
        return self._scratch.array(("numpy", name), shape, dt)

    def forward(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """y into ``out``; x and out may be the same array (x is consumed first).
        Allocates nothing unless n > max_tokens (then the scratch grows once)."""
        n = _check_io(x, out, self.d_model)
        if n > self.max_tokens:
            self._alloc(n)
        if x.dtype != self.dtype:
            xs = self._buf("x", n)
            if bf16.is_bf16(x.dtype):
                if self.dtype == np.float32:
                    bf16.to_float32(x, out=xs)
                else:
                    xs[...] = bf16.to_float32(x)  # float64 compute: tests only, allocation ok
            else:
                np.copyto(xs, x, casting="same_kind")
            x = xs
        h = self._buf("h", n)
        I = self.d_ff
        np.matmul(x, self._wgu.T, out=h)
        g, u = h[:, :I], h[:, I:]
        silu_mul_(g, u)
        if out.dtype == self.dtype:
            np.matmul(u, self._wd.T, out=out)  # u: rows 2*d_ff apart, still one BLAS call
        else:
            y = self._buf("y", n)
            np.matmul(u, self._wd.T, out=y)
            if bf16.is_bf16(out.dtype):
                if self.dtype != np.float32:
                    y = y.astype(np.float32)
                bf16.from_float32(y, out=out, scratch=self._buf("bits", n))
            else:
                np.copyto(out, y, casting="same_kind")
        return out

    @property
    def nbytes(self) -> int:
        """Bytes its weights hold."""
        return int(self._wgu.nbytes + self._wd.nbytes)

    def describe(self) -> dict[str, Any]:
        return {"kernel": self.kind, "dtype": self.dtype.name, "threads": self.threads, "d_model": self.d_model,
                "d_ff": self.d_ff, "max_tokens": self.max_tokens}


def _limit_blas(threads: int) -> None:
    from threadpoolctl import threadpool_limits
    threadpool_limits(limits=int(threads), user_api="blas")  # process-wide, as the worker CLI does


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError("the torch kernel needs PyTorch: pip install 'moe-transport[torch]' "
                          "(or use --compute numpy)") from None
    return torch


_TORCH_DTYPES = {"bfloat16", "float32", "float16"}


def _tensor_view(torch: Any, a: np.ndarray) -> Any:
    """A tensor over ``a``'s own memory (no copy): bf16 via its uint16 bits."""
    is_bf = bf16.is_bf16(a.dtype)
    b = a.view(np.uint16) if is_bf else a
    if b.flags.writeable:
        t = torch.from_numpy(b)
    else:
        # from_numpy warns on read-only arrays (a received message's buffer): the kernel
        # only reads x, so the warning says nothing here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(b)
    return t.view(torch.bfloat16) if is_bf else t


class TorchSwiGLU:
    """The torch kernel (see the module docstring). ``dtype``: bfloat16, float32 or float16."""

    kind = "torch"

    def __init__(self, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, *,
                 dtype: str = "bfloat16", max_tokens: int = 256, threads: int | None = 1,
                 scratch: Scratch | None = None) -> None:
        torch = self._torch = _torch()
        name = bf16.dtype_name(dtype) if not isinstance(dtype, str) else dtype
        if name not in _TORCH_DTYPES:
            raise ValueError(f"the torch kernel computes in {sorted(_TORCH_DTYPES)}, not {name}")
        self.d_model, self.d_ff = _check_shapes(w_gate, w_up, w_down)
        self.dtype_name = name
        self.dtype = getattr(torch, name)
        self.threads = threads
        if threads is not None:
            torch.set_num_threads(int(threads))
        # Weights: converted once at load (bf16 bits are taken as they are, no rounding).
        self._wgu = torch.cat([self._weight(w_gate), self._weight(w_up)]).contiguous()
        self._wd = self._weight(w_down).contiguous()
        self._scratch = scratch
        self._alloc(max(0, int(max_tokens)))

    def _weight(self, a: np.ndarray) -> Any:
        torch = self._torch
        if bf16.is_bf16(a.dtype):
            t = torch.from_numpy(np.array(bf16.bits(a), dtype=np.uint16)).view(torch.bfloat16)
        elif np.issubdtype(a.dtype, np.floating):
            t = torch.from_numpy(np.array(a))
        else:
            raise ValueError(f"weights must be floating point or bf16, got {a.dtype}")
        return t.to(self.dtype)

    def _widths(self) -> dict:
        return {"h": 2 * self.d_ff, "x": self.d_model, "y": self.d_model}

    def _alloc(self, n: int) -> None:
        torch = self._torch
        self.max_tokens = n
        if self._scratch is not None:  # shared: reserve room, hold nothing of our own
            size = torch.empty((), dtype=self.dtype).element_size()
            for k, w in self._widths().items():
                self._scratch.reserve(("torch", k, self.dtype_name), n * w * size)
            return
        self._h, self._x, self._y = (torch.empty((n, w), dtype=self.dtype) for w in self._widths().values())

    def _buf(self, name: str, n: int) -> Any:
        if self._scratch is None:
            return getattr(self, "_" + name)[:n]
        torch = self._torch
        w = self._widths()[name]
        size = torch.empty((), dtype=self.dtype).element_size()
        raw = self._scratch.raw(("torch", name, self.dtype_name), n * w * size)
        return torch.from_numpy(raw).view(self.dtype).view(n, w)

    def forward(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """y into ``out`` (a tensor over its memory). x and out may be the same array."""
        torch = self._torch
        n = _check_io(x, out, self.d_model)
        if n > self.max_tokens:
            self._alloc(n)
        xt = _tensor_view(torch, x)
        if xt.dtype != self.dtype:
            xt = self._buf("x", n).copy_(xt)  # the one conversion in: wire dtype -> compute dtype
        h = self._buf("h", n)
        torch.mm(xt, self._wgu.t(), out=h)
        g, u = h[:, : self.d_ff], h[:, self.d_ff:]
        torch.nn.functional.silu(g, inplace=True)
        g.mul_(u)
        ot = _tensor_view(torch, out)
        if ot.dtype == self.dtype:
            torch.mm(g, self._wd.t(), out=ot)
        else:
            y = self._buf("y", n)
            torch.mm(g, self._wd.t(), out=y)
            ot.copy_(y)  # the one conversion out, straight into the reply slot
        return out

    @property
    def nbytes(self) -> int:
        """Bytes its weights hold."""
        return int(self._wgu.element_size() * self._wgu.nelement() + self._wd.element_size() * self._wd.nelement())

    def describe(self) -> dict[str, Any]:
        return {"kernel": self.kind, "dtype": self.dtype_name, "threads": self.threads, "d_model": self.d_model,
                "d_ff": self.d_ff, "max_tokens": self.max_tokens, "cpu_bf16_matmul": cpu_bf16_matmul()}


def make_kernel(kind: str, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, dtype: object = "float32",
                max_tokens: int = 256, threads: int | None = 1, activation: str = "silu",
                scratch: Scratch | None = None) -> Kernel:
    """The kernel ``kind`` ("numpy" | "torch") over these weights, computing in ``dtype``
    ("float32"; "bfloat16"/"float16" for torch). ``threads``: process-wide intra-op/BLAS
    threads (None: leave as is). ``scratch``: shared intermediates (see :class:`Scratch`)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not supported; SwiGLU kernels use {ACTIVATIONS}")
    if kind == "numpy":
        return NumpySwiGLU(w_gate, w_up, w_down, dtype=dtype, max_tokens=max_tokens, threads=threads,
                           scratch=scratch)
    if kind == "torch":
        name = dtype if isinstance(dtype, str) else bf16.dtype_name(dtype)
        return TorchSwiGLU(w_gate, w_up, w_down, dtype=name, max_tokens=max_tokens, threads=threads,
                           scratch=scratch)
    raise ValueError(f"unknown kernel kind {kind!r}; expected one of {KINDS}")


@functools.lru_cache(maxsize=1)
def cpu_bf16_matmul() -> bool:
    """Whether this CPU has bf16 matrix instructions (AMX-BF16 or AVX512-BF16) that oneDNN
    uses for a bf16 matmul; without them torch's bf16 is emulated and slower than float32."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"amx_bf16", "avx512_bf16"})
    except OSError:
        pass
    return False


def torch_compute_dtype(wire_dtype: str) -> str:
    """The torch kernel's compute dtype for activations of ``wire_dtype``: bf16 where the
    CPU has bf16 matrix units, else float32 (bf16 without them is emulated: several times
    slower than float32 on the same core; the kernel then converts bf16 in and out)."""
    if wire_dtype == "bfloat16":
        return "bfloat16" if cpu_bf16_matmul() else "float32"
    return wire_dtype
