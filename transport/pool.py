"""A registered buffer pool: one region, registered once, carved into fixed-size slots.

Registration (an RDMA memory region, a shared segment mapped by the peer) is expensive on
every stack, so a pool is registered once and slots are handed out and returned; nothing
is registered per message. A slot is a writable memoryview that numpy wraps in place.
"""
from __future__ import annotations

import collections
import mmap
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .errors import PoolExhausted

ALIGN = 64  # a cache line: slots never share one, so two writers never false-share


def buffer_address(buf) -> int:
    """The virtual address of the first byte of any buffer (read-only ones too)."""
    if memoryview(buf).nbytes == 0:
        return 0
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


def buffer_extent(buf) -> tuple[int, int]:
    """[low, high) addresses of the bytes a buffer touches, strided views included."""
    mv = memoryview(buf)
    if mv.contiguous:
        a = buffer_address(mv)
        return a, a + mv.nbytes
    arr = np.asarray(mv)
    low = high = arr.__array_interface__["data"][0]
    for n, stride in zip(arr.shape, arr.strides):
        if stride < 0:
            low += stride * (n - 1)
        else:
            high += stride * (n - 1)
    return low, high + arr.itemsize


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class Slot:
    """One slot of a pool: ``capacity`` bytes, of which the first ``nbytes`` are the message.

    The owner fills ``buf`` (or ``array(...)``) and hands the slot to ``send``; from then
    on the transport owns it and returns it to the pool when the peer is done with it.
    """

    __slots__ = ("pool", "index", "offset", "capacity", "nbytes", "mem")

    def __init__(self, pool: "BufferPool", index: int):
        self.pool = pool
        self.index = index
        self.offset = index * pool.stride
        self.capacity = pool.slot_size
        self.nbytes = pool.slot_size
        #: the whole slot (``capacity`` bytes), writable; hot paths slice it themselves
        self.mem = pool.memory[self.offset : self.offset + self.capacity]

    @property
    def buf(self) -> memoryview:
        """The writable view of the message bytes (the first ``nbytes``)."""
        return self.mem[: self.nbytes]

    @property
    def whole(self) -> memoryview:
        return self.mem

    def resize(self, nbytes: int) -> "Slot":
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(f"{nbytes} bytes do not fit a slot of {self.capacity}")
        self.nbytes = nbytes
        return self

    def array(self, dtype: Any, shape: Any) -> np.ndarray:
        """A numpy array over the slot, sized to exactly ``shape`` (sets ``nbytes``)."""
        dt = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        self.resize(count * dt.itemsize)
        return np.frombuffer(self.mem, dtype=dt, count=count).reshape(shape)

    def release(self) -> None:
        """Give an unsent slot back to its pool."""
        self.pool.free(self.index)

    def __repr__(self) -> str:
        return f"<Slot {self.index} of {self.pool.name} {self.nbytes}/{self.capacity} B>"


class BufferPool:
    """``nslots`` slots of ``slot_size`` bytes in one contiguous, registrable region.

    ``buffer`` is the region (an anonymous mmap by default; a shared segment for shm);
    backends register ``memory`` once (``address`` and ``length`` are what an RDMA MR
    needs).
    """

    def __init__(self, slot_size: int, nslots: int, *, buffer: Optional[Any] = None, name: str = "pool"):
        if slot_size <= 0 or nslots <= 0:
            raise ValueError("slot_size and nslots must be positive")
        self.slot_size = slot_size
        self.nslots = nslots
        self.stride = round_up(slot_size)
        self.length = self.stride * nslots
        self.name = name
        if buffer is None:
            buffer = mmap.mmap(-1, max(self.length, 1))
        self._buffer = buffer
        mem = memoryview(buffer).cast("B")
        if len(mem) < self.length:
            raise ValueError(f"buffer of {len(mem)} bytes is smaller than {self.length}")
        self.memory = mem[: self.length]
        self.address = buffer_address(self.memory)
        self._slots = [Slot(self, i) for i in range(nslots)]
        self._free = collections.deque(range(nslots))
        self._in_use = [False] * nslots

    @property
    def available(self) -> int:
        return len(self._free)

    def try_alloc(self, nbytes: int = -1) -> Optional[Slot]:
        """A free slot sized to ``nbytes`` (default: its capacity), or None if none is free.
        Last freed, first reused: a slot that was just written or read is still in cache."""
        free = self._free
        if not free:
            return None
        if nbytes > self.slot_size:
            raise ValueError(f"{nbytes} bytes do not fit a slot of {self.slot_size}")
        i = free.pop()
        self._in_use[i] = True
        s = self._slots[i]
        s.nbytes = self.slot_size if nbytes < 0 else nbytes
        return s

    def alloc(self, nbytes: int = -1) -> Slot:
        s = self.try_alloc(nbytes)
        if s is None:
            raise PoolExhausted(f"all {self.nslots} slots of {self.name} are in use")
        return s

    def slot(self, index: int) -> Slot:
        """The slot object for ``index`` (receivers use it to view a peer-filled slot)."""
        return self._slots[index]

    def take(self, index: int) -> Slot:
        """Mark a specific slot as in use (a receiver taking the slot a message landed in)."""
        if self._in_use[index]:
            raise ValueError(f"slot {index} of {self.name} is already in use")
        self._free.remove(index)
        self._in_use[index] = True
        return self._slots[index]

    def free(self, index: int) -> None:
        """Return slot ``index``; ValueError if it is out of range or not in use (a peer that
        returns a slot twice, or one it never had)."""
        if not 0 <= index < self.nslots:
            raise ValueError(f"slot {index} out of range 0..{self.nslots - 1}")
        if not self._in_use[index]:
            raise ValueError(f"slot {index} of {self.name} freed twice")
        self._in_use[index] = False
        self._free.append(index)

    def put(self, slot: Slot) -> bool:
        """Return one of this pool's own slots if it is in use; False if it was free already
        (the owner's idempotent give-back, without free()'s checks of a peer's index)."""
        i = slot.index
        in_use = self._in_use
        if not in_use[i]:
            return False
        in_use[i] = False
        self._free.append(i)
        return True

    def view(self, index: int, start: int = 0, nbytes: Optional[int] = None) -> memoryview:
        if not 0 <= index < self.nslots or (nbytes is not None and nbytes < 0):
            raise ValueError(f"no view of {nbytes} bytes of slot {index} in {self.name}")
        off = index * self.stride + start
        end = index * self.stride + (self.slot_size if nbytes is None else start + nbytes)
        if start < 0 or end > index * self.stride + self.slot_size:
            raise ValueError("view outside the slot")
        return self.memory[off:end]

    def contains(self, buf) -> bool:
        """Whether ``buf`` lies entirely inside this pool's registered region."""
        mv = memoryview(buf)
        if mv.nbytes == 0:
            return True
        low, high = buffer_extent(mv)
        return self.address <= low and high <= self.address + self.length

    def close(self) -> None:
        """Drop every view of the region (a view the application still exports keeps the
        memory alive until it goes), and unmap it if the pool made it."""
        for s in self._slots:
            try:
                s.mem.release()
            except BufferError:
                pass
        self._slots = []
        try:
            self.memory.release()
        except BufferError:
            pass
        if isinstance(self._buffer, mmap.mmap):
            try:
                self._buffer.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when it does

    def __repr__(self) -> str:
        return f"<BufferPool {self.name} {self.nslots}x{self.slot_size} B, {self.available} free>"


# -- a general message's buffers, for backends that pass slot descriptors (shm, inproc) -------

def describe_buffers(buffers: Sequence, pool: "BufferPool", max_message: int, max_buffers: int
                     ) -> tuple[list, list, list, int]:
    """(lens, extra, others, total) of a message's buffers: ``extra`` holds a (slot, offset)
    pair per buffer, (index, 0) for a slot of ``pool`` and (-1, 0) for a buffer still to be
    staged; ``others`` lists those as (position, byte view). ValueError past the peer's
    ``max_message`` bytes or ``max_buffers`` buffers."""
    lens: list = []
    extra: list = []
    others: list = []
    for b in buffers:
        if type(b) is Slot and b.pool is pool:
            lens.append(b.nbytes)
            extra += (b.index, 0)
        else:
            mv = memoryview(b)
            if mv.ndim != 1 or mv.itemsize != 1:
                mv = mv.cast("B")
            others.append((len(lens), mv))
            lens.append(mv.nbytes)
            extra += (-1, 0)
    total = sum(lens)
    if total > max_message:
        raise ValueError(f"message of {total} bytes exceeds the peer's limit of {max_message}")
    if len(lens) > max_buffers:
        raise ValueError(f"{len(lens)} buffers exceed the limit of {max_buffers}")
    return lens, extra, others, total


def stage_buffers(others: list, extra: list, alloc: Callable[[], "Slot"], slot_size: int, owned: list) -> int:
    """Copy the unregistered buffers ``describe_buffers`` found into send slots from
    ``alloc``, packed (64-byte aligned) into as few as fit, filling in their ``extra``
    pairs; the slots go to ``owned``. Returns the copies made (one per buffer)."""
    slot, used = None, 0
    for i, mv in others:
        n = mv.nbytes
        if slot is None or used + n > slot_size:
            slot = alloc()
            owned.append(slot)
            used = 0
        slot.whole[used : used + n] = mv
        extra[2 * i] = slot.index
        extra[2 * i + 1] = used
        used = round_up(used + n)
    return len(others)
