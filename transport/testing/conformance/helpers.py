"""What the checks share: deterministic payloads, send/receive/verify, and bounded waits."""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

import numpy as np

from transport.errors import ConnectionClosed, Timeout

from .env import Worker


def pattern(seq: int, n: int) -> np.ndarray:
    """``n`` deterministic bytes that depend on ``seq`` (cheap at any size)."""
    return ((np.arange(n, dtype=np.uint32) * 7 + seq * 13 + 1) % 251).astype(np.uint8)


def verify(buf, seq: int, n: Optional[int] = None, what: str = "buffer") -> None:
    """Assert that ``buf`` holds ``pattern(seq, n)``."""
    got = np.frombuffer(buf, dtype=np.uint8)
    if n is not None:
        assert got.size == n, f"{what}: {got.size} bytes, expected {n}"
    want = pattern(seq, got.size)
    if not np.array_equal(got, want):
        bad = int(np.argmax(got != want))
        raise AssertionError(f"{what} (seq {seq}, {got.size} B) differs at byte {bad}: "
                             f"{got[bad]} != {want[bad]}")


def filled_slot(conn, seq: int, n: int, timeout: Optional[float] = None):
    slot = conn.alloc(n, timeout=timeout)
    assert slot.nbytes == n, f"alloc({n}) gave a slot of nbytes={slot.nbytes}"
    if n:
        np.frombuffer(slot.buf, dtype=np.uint8)[:] = pattern(seq, n)
    return slot


def send_seq(conn, seq: int, n: int, timeout: Optional[float] = None, **extra) -> None:
    """Send message ``seq``: header {"seq": seq, **extra}, one slot of ``pattern(seq, n)``."""
    slot = filled_slot(conn, seq, n, timeout)
    conn.send({"seq": seq, "n": n, **extra}, [slot], timeout=timeout)


def recv_seq(conn, seq: int, n: Optional[int] = None, timeout: float = 5.0, hold: bool = False):
    """Receive message ``seq`` sent by :func:`send_seq`, verify it, release it (or return it
    unreleased with ``hold``)."""
    msg = conn.recv(timeout=timeout)
    try:
        assert isinstance(msg.header, dict) and msg.header.get("seq") == seq, \
            f"expected message {seq}, got header {msg.header!r}"
        assert len(msg.buffers) == 1, f"message {seq}: {len(msg.buffers)} buffers, expected 1"
        verify(msg.buffers[0], seq, msg.header["n"] if n is None else n, f"message {seq}")
    except BaseException:
        msg.release()
        raise
    if hold:
        return msg
    msg.release()
    return None


def transfer(a, b, seq: int, n: int, *, unregistered: bool = False, timeout: float = 10.0) -> None:
    """Message ``seq`` of ``n`` bytes from ``a`` to ``b``, verified. Large messages are sent
    from a helper thread: a byte-stream backend cannot buffer them all in the kernel while
    the receiving end (this thread) is not reading."""
    def go():
        if unregistered:
            a.send({"seq": seq, "n": n}, [pattern(seq, n).tobytes()], timeout=timeout)
        else:
            send_seq(a, seq, n, timeout)
    if n <= 64 << 10:
        go()
        recv_seq(b, seq, n, timeout)
        return
    w = Worker(go, "sender")
    try:
        recv_seq(b, seq, n, timeout)
    finally:
        w.join(timeout + 5)


def roundtrip(a, b, seq: int = 0, n: int = 64, timeout: float = 5.0) -> None:
    """a -> b and b -> a, content verified: the pair still works."""
    send_seq(a, seq, n, timeout)
    recv_seq(b, seq, n, timeout)
    send_seq(b, seq + 1, n, timeout)
    recv_seq(a, seq + 1, n, timeout)


def expect_nothing(conn, wait: float = 0.1) -> None:
    """Nothing arrives on ``conn`` within ``wait`` seconds."""
    try:
        msg = conn.recv(timeout=wait)
    except Timeout:
        return
    header = msg.header
    msg.release()
    raise AssertionError(f"unexpected message {header!r}")


def expect_closed(conn, within: float, what: str) -> float:
    """``conn.recv`` raises ConnectionClosed within ``within`` seconds (messages still
    queued are received and released first). Returns the time it took."""
    t0 = time.monotonic()
    end = t0 + within
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{what}: no ConnectionClosed within {within:.1f} s")
        try:
            conn.recv(timeout=left).release()
        except ConnectionClosed:
            return time.monotonic() - t0
        except Timeout:
            raise AssertionError(f"{what}: recv raised Timeout, not ConnectionClosed, "
                                 f"after {time.monotonic() - t0:.2f} s") from None


def raises(exc_type, fn: Callable[[], Any], what: str):
    try:
        fn()
    except exc_type as e:
        return e
    except BaseException as e:
        raise AssertionError(f"{what}: raised {type(e).__name__}: {e}, expected {exc_type.__name__}") from e
    raise AssertionError(f"{what}: did not raise {exc_type.__name__}")


def timed(fn: Callable[[], Any]) -> tuple[Optional[BaseException], float]:
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as e:
        return e, time.monotonic() - t0
    return None, time.monotonic() - t0


def _open_fds() -> Optional[int]:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None
