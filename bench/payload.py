"""The payload work of `moe-bench transport`'s DATA figure, the same for every implementation.

The descriptor figure passes a message and never touches its bytes (on shared memory that
is a slot index, the same at 64 B as at 16 MiB). The data figure is what an application
pays: the sender writes every payload byte and the receiver reads every payload byte.

- :func:`fill` writes every byte of a buffer with one value (the message's sequence byte,
  1..255: a counter, so consecutive messages differ and a zeroed slot is never right);
- :func:`checksum` reads every byte (Adler-32 up to 8 KiB, where numpy's per-call cost
  would dominate; above, a numpy sum of 64-bit words, which runs near memory speed);
- :func:`verify` checks a received payload against the value it was filled with, so a
  transport that delivered stale or short data fails the run instead of looking fast.

Every implementation calls the same functions on the same sizes, so the figure compares
transports, not checksums.
"""
from __future__ import annotations

import zlib

import numpy as np

MASK = (1 << 64) - 1
_WORD = 0x0101010101010101
SMALL_FILL = 16 << 10  # up to here a bytes multiply and a slice copy beat numpy's call cost
SMALL_SUM = 8 << 10  # up to here Adler-32 (C, no numpy call) beats a numpy reduction
_BYTE = [bytes([i]) for i in range(256)]
_ADLER_MOD = 65521


def next_byte(b: int) -> int:
    """The counter: 1, 2, ..., 255, 1, ... (never 0)."""
    return b % 255 + 1


def fill(buf, value: int) -> None:
    """Write every byte of ``buf`` (a writable buffer) with ``value``."""
    v = memoryview(buf).cast("B")
    n = v.nbytes
    if n <= SMALL_FILL:
        if n:
            v[:] = _BYTE[value] * n
    else:
        np.frombuffer(v, np.uint8).fill(value)


def checksum(buf) -> int:
    """Read every byte of ``buf``: Adler-32 for small payloads, else the sum (mod 2**64) of
    its 64-bit words plus its tail bytes."""
    v = memoryview(buf).cast("B")
    n = v.nbytes
    if n <= SMALL_SUM:
        return zlib.adler32(v)
    a = np.frombuffer(v, np.uint8)
    n8 = n - n % 8
    s = int(a[:n8].view(np.uint64).sum(dtype=np.uint64))
    if n8 < n:
        s += int(a[n8:].sum(dtype=np.uint64))
    return s & MASK


def expected(nbytes: int, value: int) -> int:
    """What :func:`checksum` gives for ``nbytes`` bytes that all hold ``value``."""
    if nbytes <= SMALL_SUM:  # Adler-32: A = 1 + sum of bytes, B = sum of the running A's
        a = (1 + nbytes * value) % _ADLER_MOD
        b = (nbytes + value * nbytes * (nbytes + 1) // 2) % _ADLER_MOD
        return (b << 16) | a
    return ((nbytes // 8) * ((value * _WORD) & MASK) + (nbytes % 8) * value) & MASK


def verify(buf, nbytes: int) -> int:
    """Read a received payload; it must be ``nbytes`` bytes all holding its first byte's
    value. Returns that value (an echo answers with :func:`next_byte` of it)."""
    v = memoryview(buf).cast("B")
    if v.nbytes != nbytes:
        raise AssertionError(f"payload of {v.nbytes} bytes, expected {nbytes}")
    if nbytes == 0:
        return 0
    value = v[0]
    if value == 0 or checksum(v) != expected(nbytes, value):
        raise AssertionError(f"payload of {nbytes} bytes does not hold the value {value} throughout")
    return value
