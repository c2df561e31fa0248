"""The send side of transport/stream.py's StreamConnection (a mixin: the receive side,
the lifecycle and the socket are stream.py's).

Sending is one ``sendmsg`` per message: [prefix, header, *buffers], slots and user
buffers alike go to the kernel as they are. A buffer that is not a slot of this
connection is counted in ``stats.copies`` as on every backend (it left the registered
path), although here the kernel's copy is the only one. The common message (one slot of
ours) goes through transport/_tcpfast.c where it is built: the same frame, written with
the same call; what the kernel does not take at once is finished here (:meth:`_sent_part`).

- A blocking send (``timeout`` > 0 or None) either completes or raises before its first
  byte (Timeout, ValueError, TypeError: the connection is still usable); if the deadline
  passes in the middle of a frame the byte stream cannot be resynchronised, so the
  connection is torn down (BROKEN) and ConnectionClosed raised (everything sent before
  is still delivered).
- ``send(..., timeout=0)`` never blocks: what the kernel does not take at once stays with
  the connection (``_out``, with the slots it points into) and is written by later calls
  -- any send, recv, ``flush()`` -- while ``wants_write()`` says so a poller can wait for
  POLLOUT. One unfinished frame at a time: while it is, ``send_ready()`` is False and a
  further ``send(timeout=0)`` raises Timeout (nothing of it sent).

Credits: releasing a message owes the peer a credit; owed credits ride on the next DATA
frame, or go as a CREDIT frame once half the peer's window is owed or before this side
waits. Sending credits never blocks: a frame the kernel cannot take goes later (after any
unfinished DATA frame, never inside one).
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
import time
from typing import Any, Optional, Sequence

from . import framing
from .base import BROKEN
from .errors import ConnectionClosed, Timeout
from .pool import Slot, buffer_address
from .timing import TCP_SEND_SLICE

_IOV_MAX = 1024
_DONTWAIT = socket.MSG_DONTWAIT
_PREFIX = framing.PREFIX
_PREFIX_SIZE = framing.PREFIX_SIZE
_MAGIC, _VERSION, _DATA = framing.MAGIC, framing.VERSION, framing.DATA
_MAX_BUFFERS = framing.MAX_BUFFERS
_TIMEVAL = struct.Struct("ll")
_SIOCOUTQNSD = 0x894B  # linux/sockios.h
_monotonic = time.monotonic
_pack = framing._packer.pack


def set_timeo(sock: socket.socket, opt: int, t: float) -> float:
    """Set SO_RCVTIMEO/SO_SNDTIMEO to ``t`` seconds (at least 1 us: 0 means forever)."""
    sec = int(t)
    usec = int((t - sec) * 1e6)
    if sec == 0 and usec == 0:
        usec = 1
    sock.setsockopt(socket.SOL_SOCKET, opt, _TIMEVAL.pack(sec, usec))
    return sec + usec * 1e-6


def _advance(views: list, n: int) -> None:
    """Drop the first ``n`` bytes of a list of memoryviews (what a sendmsg wrote)."""
    while n:
        k = views[0].nbytes
        if n >= k:
            n -= k
            del views[0]
        else:
            views[0] = views[0][n:]
            return


class StreamSender:
    """StreamConnection's send side (its attributes are set by StreamConnection.__init__)."""

    def _alloc_py(self, nbytes: int, timeout: Optional[float] = None) -> Slot:
        if self._state:
            raise self._closed_error()
        if not 0 <= nbytes <= self.max_message:
            raise ValueError(f"{nbytes} bytes: a message holds 0..{self.max_message} bytes (the peer's slot)")
        slot = self.send_pool.try_alloc(nbytes)
        if slot is None:
            slot = self._alloc_slow(nbytes, timeout)
        return slot

    def _alloc_slow(self, nbytes: int, timeout: Optional[float]) -> Slot:
        # tcp frees send slots as soon as their frame is written: they are held by the
        # caller, or by a frame that a send(timeout=0) left unfinished
        if self._out_slots is None:
            raise Timeout(f"all {self.send_pool.nslots} send slots are held by the caller")
        end = _monotonic() + (self.default_timeout if timeout is None else timeout)
        while True:
            if self._flush_out():
                slot = self.send_pool.try_alloc(nbytes)
                if slot is not None:
                    return slot
                raise Timeout(f"all {self.send_pool.nslots} send slots are held by the caller")
            if self._state:
                raise self._closed_error()
            t = end - _monotonic()
            if t <= 0:
                raise Timeout("timed out waiting for a send slot (the peer is not reading)")
            self._wait_readable(t)

    def _send_py(self, header: Any, buffers: Sequence = (), timeout: Optional[float] = None) -> None:
        slots = None
        pool = self.send_pool
        kept = False  # the slots stay with an unfinished frame (send(timeout=0))
        try:
            if self._state:
                raise self._closed_error()
            views: list = [None, None]
            lens = []
            copies = 0
            for b in buffers:
                if b.__class__ is Slot:
                    if slots is None:
                        slots = [b]
                    else:
                        slots.append(b)
                    mv = b.mem[: b.nbytes]
                    if b.pool is not pool:
                        copies += 1  # a slot of another pool: memory, but not ours
                else:
                    mv = memoryview(b)
                    if mv.format != "B" or mv.ndim != 1:
                        mv = mv.cast("B")  # TypeError for non-contiguous memory
                    copies += 1
                views.append(mv)
                lens.append(mv.nbytes)
            if len(lens) > _MAX_BUFFERS:
                raise ValueError(f"{len(lens)} buffers exceed the limit of {_MAX_BUFFERS} per message")
            total = sum(lens)
            if total > self.max_message:
                raise ValueError(f"message of {total} bytes exceeds the peer's limit of {self.max_message}")
            if self._out is not None and not self._flush_out() and timeout == 0:
                raise Timeout("the previous message is still being written (the peer is not reading)")
            end = None
            if self._credits <= 0:
                end = _monotonic() + (self.default_timeout if timeout is None else timeout)
                self._wait_credits(end)
            owed = self._owed
            try:
                if total >= framing.PAD_MIN:  # credits, if owed, in a CREDIT frame before it
                    views[0], head = framing.padded_frame_head(_pack(header), lens, total, owed,
                                                               buffer_address(views[2]))
                else:
                    head = _pack([header, lens, owed or None])
                    views[0] = None
            except (TypeError, ValueError, OverflowError) as e:
                raise TypeError(f"header is not msgpack-serialisable: {e}") from None
            hlen = len(head)
            if hlen > self.max_header:
                raise ValueError(f"header of {hlen} bytes exceeds the limit of {self.max_header}")
            if views[0] is None:
                views[0] = _PREFIX.pack(_MAGIC, _VERSION, _DATA, hlen, total)
            views[1] = head
            self._owed = 0
            size = len(views[0]) + hlen + total
            try:
                if self._out is not None:
                    raise BlockingIOError  # bytes accepted before go first: the slow path
                n = self.sock.sendmsg(views, (), _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self._to_peer_gone(f"send failed ({e.strerror or e})")
                raise self._closed_error() from None
            except BaseException:
                self._owed += owed  # nothing of the frame went out
                raise
            kept = self._finish(views, n, size, total, owed, buffers, slots, end, timeout, copies)
        finally:
            if slots is not None and not kept:
                for s in slots:
                    if s.pool is pool:
                        pool.put(s)

    def _finish(self, views: list, n: int, size: int, total: int, owed: int, buffers: Sequence,
                slots: Optional[list], end: Optional[float], timeout: Optional[float], copies: int = 0) -> bool:
        """A frame of ``size`` bytes (``total`` of payload, ``owed`` credits in its header)
        whose first write took ``n`` bytes: the rest kept (timeout 0) or written, then
        counted. True if its slots stay with the connection (kept)."""
        kept = False
        if n != size:
            if timeout == 0 and self._out is None:
                self._keep_rest(views, n, buffers, slots)
                kept = True
            else:
                try:
                    self._write_rest(views, n, size, end, timeout)
                except Timeout:
                    self._owed += owed  # nothing of the frame went out
                    raise
        self._credits -= 1
        st = self._stats
        st.messages_sent += 1
        st.bytes_sent += total
        if copies:
            st.copies += copies
        return kept

    def _sent_part(self, prefix: bytes, head: bytes, slot: Slot, n: int, owed: int,
                   timeout: Optional[float]) -> None:
        """The compiled send wrote ``n`` bytes of the frame [prefix, head, slot] (``prefix``
        with the CREDIT frame before it, if any; ``owed`` credits carried, already taken off
        ``_owed``): the rest as :meth:`_send_py` does it."""
        views = [prefix, head, slot.mem[: slot.nbytes]]
        kept = False
        try:
            kept = self._finish(views, n, len(prefix) + len(head) + slot.nbytes, slot.nbytes, owed, (slot,),
                                [slot], None, timeout)
        finally:
            if not kept:
                self.send_pool.put(slot)

    def _keep_rest(self, views: list, n: int, buffers: Sequence, slots: Optional[list]) -> None:
        """send(timeout=0): the kernel took ``n`` bytes of the frame; the rest stays with the
        connection (later calls write it) with the slots it points into. Bytes of buffers
        that are not our slots are copied now: the caller may reuse them once send returns."""
        pool = self.send_pool
        ours = [True, True] + [b.__class__ is Slot and b.pool is pool for b in buffers]
        rest = []
        for v, mine in zip(views, ours):
            k = len(v) if v.__class__ is bytes else v.nbytes
            if n >= k:
                n -= k
                continue
            v = memoryview(v)[n:] if n else memoryview(v)
            n = 0
            rest.append(v if mine else memoryview(bytes(v)))
        self._out = rest
        self._out_slots = [s for s in slots if s.pool is pool] if slots else None

    def _flush_out(self) -> bool:
        """Write the bytes waiting in ``_out`` without blocking; True once none are left."""
        out = self._out
        if out is None:
            return True
        sock = self.sock
        while True:
            try:
                n = sock.sendmsg(out[:_IOV_MAX], (), _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as e:
                self._to_peer_gone(f"send failed ({e.strerror or e})")
                self._drop_out()
                return False
            _advance(out, n)
            if not out:
                self._drop_out()
                return True
            if not n:
                return False

    def _drop_out(self) -> None:
        self._out = None
        slots, self._out_slots = self._out_slots, None
        if slots:
            pool = self.send_pool
            for s in slots:
                pool.put(s)

    def _wait_credits(self, end: float) -> None:
        self._stats.credit_stalls += 1
        while self._credits <= 0:
            if self._state:
                raise self._closed_error()
            t = end - _monotonic()
            if t <= 0:
                raise Timeout("timed out waiting for credits (the peer holds every message)")
            self._wait_readable(t)

    def _write_rest(self, views: list, n: int, total: int, end: Optional[float],
                    timeout: Optional[float]) -> None:
        """The slow path of a frame write: ``n`` of ``total`` bytes of ``views`` went out
        (bytes accepted earlier first, if any). Timeout if nothing of the frame could be
        written in time (what was pending before stays pending); ConnectionClosed (and the
        connection torn down) if only part of it."""
        frame_start = 0
        earlier_slots = None
        if self._out is not None:  # nothing of ours was sent: the pending bytes go first
            earlier = self._out
            frame_start = sum(v.nbytes for v in earlier)
            views = earlier + views
            total += frame_start
            earlier_slots = self._out_slots
            self._out = self._out_slots = None
        if end is None:
            end = _monotonic() + (self.default_timeout if timeout is None else timeout)
        sent = 0
        views = [v if v.__class__ is memoryview else memoryview(v) for v in views]
        sock = self.sock
        while True:
            sent += n
            _advance(views, n)
            if earlier_slots is not None and sent >= frame_start:
                for s in earlier_slots:  # the earlier frame is all out: its slots are free
                    self.send_pool.put(s)
                earlier_slots = None
            if not views:
                return
            t = end - _monotonic()
            if t <= 0:
                if sent <= frame_start:
                    if sent < frame_start:  # the rest of the earlier bytes stays pending
                        keep, left = [], frame_start - sent
                        for v in views:
                            if v.nbytes >= left:
                                keep.append(v[:left])
                                break
                            keep.append(v)
                            left -= v.nbytes
                        self._out, self._out_slots = keep, earlier_slots
                    raise Timeout("timed out sending (the peer is not reading)")
                self._break()
                raise ConnectionClosed(
                    f"{self.url}: send timed out after {sent - frame_start} of {total - frame_start} bytes "
                    "of the frame; a byte stream cannot be resynchronised, so the connection is closed")
            # drain the peer while our socket is full: it may be blocked sending to us
            self._read(_DONTWAIT)
            if self._state:
                if earlier_slots is not None:
                    for s in earlier_slots:
                        self.send_pool.put(s)
                raise self._closed_error()
            # then block in the kernel (as a plain sendall does) for a slice of the time
            t = min(t, TCP_SEND_SLICE)
            if not (t * 0.5 <= self._sndtimeo <= t):
                self._sndtimeo = set_timeo(sock, socket.SO_SNDTIMEO, t)
            try:
                n = sock.sendmsg(views[:_IOV_MAX])
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self._to_peer_gone(f"send failed ({e.strerror or e})")
                raise self._closed_error() from None

    def _send_control(self) -> None:
        """Send owed credits (after any bytes still pending) without blocking."""
        if self._state:
            return
        if self._out is not None and not self._flush_out():
            return
        owed = self._owed
        if not owed:
            return
        frame = framing.frame_credit(owed)
        self._owed = 0
        try:
            n = self.sock.send(frame, _DONTWAIT)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:
            self._to_peer_gone(f"send failed ({e.strerror or e})")
            return
        if n < _PREFIX_SIZE:
            self._out = [memoryview(frame)[n:]]

    def send_ready(self) -> bool:
        if self._state or self._credits <= 0:
            return False
        if self._out is not None and not self._flush_out():
            return False
        # nothing queued in the kernel that it could not send yet: a peer that reads keeps it
        # so, and a frame we start goes out as the peer reads; one that does not read would
        # stall the send (SIOCOUTQNSD: bytes not sent; TIOCOUTQ would count unacked ones too)
        fcntl.ioctl(self._fd, _SIOCOUTQNSD, self._outq)
        return self._outq == b"\0\0\0\0"

    def wants_write(self) -> bool:
        return self._out is not None

    def flush(self) -> bool:
        if self._state >= BROKEN:
            return True
        return self._flush_out()

    def yield_to_peer(self) -> None:
        # A socket write wakes its reader with a sync wake-up, and Linux queues a reader on
        # this machine on the writer's CPU, expecting the writer to sleep. A gateway that goes
        # on to gather the next chunk does not, and the reader waits for it (see
        # docs/design.md#tcp-yield-to-a-local-reader)
        if self._peer_here:
            os.sched_yield()
