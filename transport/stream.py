"""Receive and send machinery for byte-stream backends (tcp).

Receiving is one syscall per wake-up. The socket stays in blocking mode; a wait is a
``recv_into`` that blocks in the kernel for at most the caller's timeout (``SO_RCVTIMEO``,
set only when it changes), and reads that must not block pass ``MSG_DONTWAIT``. What
arrives lands in a read buffer where framing.next_frame parses prefixes and headers in
place:

- a payload that arrived in the read buffer together with its header (small messages,
  and the first bytes of a large one) is copied from there into a slot of the receive
  pool: a few KiB of memcpy is much cheaper than the syscall that avoiding it costs;
- the rest of a payload is read straight into the slot (``recvmsg_into`` scattering over
  [the rest of the slot, a short read-ahead for the next prefix and header]), so for
  large messages the kernel's socket copy is the only one.

Either way ``Message.buffers`` are views of registered memory (the receive pool).

Sending is one ``sendmsg`` per message: [prefix, header, *buffers], slots and user
buffers alike go to the kernel as they are. A buffer that is not a slot of this
connection is counted in ``stats.copies`` as on every backend (it left the registered
path), although here the kernel's copy is the only one.

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

A connection is used by one thread at a time (messages too: release them from that
thread).
"""
from __future__ import annotations

import collections
import fcntl
import ipaddress
import os
import select
import socket
import struct
import termios
import time
from typing import Any, Optional, Sequence

from . import framing
from .base import BROKEN, OPEN, Connection, ConnectionStats, Message
from .errors import ConnectionClosed, ProtocolError, Timeout
from .framing import next_frame
from .pool import BufferPool, Slot
from .timing import TCP_LINGER, TCP_LINGER_POLL, TCP_SEND_SLICE

_IOV_MAX = 1024
_DONTWAIT = socket.MSG_DONTWAIT
_WAITALL = socket.MSG_WAITALL
_POLLIN, _POLLOUT = select.POLLIN, select.POLLOUT
_PREFIX = framing.PREFIX
_PREFIX_SIZE = framing.PREFIX_SIZE
_MAGIC, _VERSION = framing.MAGIC, framing.VERSION
_DATA, _CREDIT, _CLOSE = framing.DATA, framing.CREDIT, framing.CLOSE
_MAX_BUFFERS = framing.MAX_BUFFERS
_IDLE_READ = 64 << 10  # read size when no payload is being received
_READ_AHEAD = 4 << 10  # after the rest of a payload: the next prefix + header (+ a bit)
_TIMEVAL = struct.Struct("ll")
_SIOCOUTQNSD = 0x894B  # linux/sockios.h
_monotonic = time.monotonic
_pack = framing._packer.pack


def peer_is_here(sock: socket.socket) -> bool:
    """Whether the socket's peer is on this machine: a unix socket, or a loopback address.
    (A peer in another network namespace here cannot be told from one elsewhere.)"""
    if sock.family == socket.AF_UNIX:
        return True
    try:
        ip = ipaddress.ip_address(sock.getpeername()[0])
    except (OSError, ValueError, IndexError, TypeError):
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 (3.11 calls it not loopback)
    return (mapped or ip).is_loopback


def _set_timeo(sock: socket.socket, opt: int, t: float) -> float:
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


class StreamConnection(Connection):
    """A message connection over a connected stream socket, after the handshake."""

    def __init__(self, sock: socket.socket, url: str, recv_pool: BufferPool, peer: dict,
                 *, default_timeout: float, max_header: int = framing.MAX_HEADER):
        sock.setblocking(True)  # waits block in the kernel; see the module docstring
        self.url = url
        self.sock = sock
        self._fd = sock.fileno()
        self.default_timeout = default_timeout
        self.stats = ConnectionStats()
        self.recv_pool = recv_pool
        self.max_message = int(peer["slot_size"])
        self.send_pool = BufferPool(self.max_message, int(peer["nslots"]), name=f"send:{url}")
        self.peer = peer
        self.max_header = max_header
        self._max_payload = recv_pool.slot_size
        self._credits = int(peer["nslots"])  # messages the peer can still take
        self._owed = 0  # credits we owe the peer (released messages not yet reported)
        self._owe_flush = max(1, recv_pool.nslots // 2)
        self._inbox: collections.deque = collections.deque()
        self._sock_open = True
        # the read buffer: bytes [_rpos, _rend) are received and not parsed yet
        self._rbuf = bytearray(_PREFIX_SIZE + max_header + _IDLE_READ)
        self._rview = memoryview(self._rbuf)
        self._rhead = self._rview[:_IDLE_READ]  # where an idle read goes
        self._rpos = 0
        self._rend = 0
        # a payload being read straight into its slot: the rest of the slot, and the message
        self._want: Optional[memoryview] = None
        self._cur: Any = None
        # bytes accepted but not written yet (control frames, the rest of a DATA frame that
        # a send(timeout=0) left), in order, and the send slots of that frame
        self._out: Optional[list] = None
        self._out_slots: Optional[list] = None
        self._rcvtimeo = -1.0  # the kernel's SO_RCVTIMEO / SO_SNDTIMEO as last set
        self._sndtimeo = -1.0
        self._poll = select.poll()
        self._poll.register(self._fd, _POLLIN)
        self._empty = memoryview(b"")
        self._outq = bytearray(4)
        self._peer_here = peer_is_here(sock)

    # -- receive: reading -------------------------------------------------------------
    def _read(self, flags: int) -> bool:
        """One read (blocking up to SO_RCVTIMEO unless ``flags`` has MSG_DONTWAIT), then
        parse. False if nothing came (would block, timed out, or the peer is gone)."""
        want = self._want
        try:
            if want is not None:
                if not flags:  # blocking: the rest of the payload in one call
                    n = self.sock.recv_into(want, 0, _WAITALL)
                else:
                    n = self.sock.recvmsg_into([want, self._rview[:_READ_AHEAD]], 0, flags)[0]
            elif self._rend:
                rend = self._rend
                n = self.sock.recv_into(self._rview[rend : rend + _IDLE_READ], 0, flags)
            else:
                n = self.sock.recv_into(self._rhead, 0, flags)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:  # reset: what was already read is still delivered
            self._to_peer_gone(f"connection reset ({e.strerror or e})")
            return False
        if n == 0:
            self._to_peer_gone("peer closed the connection")
            return False
        if want is None:
            self._rend += n
        else:
            k = want.nbytes
            if n < k:
                self._want = want[n:]
                return True
            self._want = None
            header, bufs, slot = self._cur
            self._cur = None
            st = self.stats
            st.messages_received += 1
            st.bytes_received += slot.nbytes
            self._inbox.append(Message(header, bufs, None, self, slot))
            if n == k:
                return True
            self._rpos, self._rend = 0, n - k
        try:
            self._parse_frames()
        except ProtocolError as e:
            self._abort(f"protocol error: {e}")
            raise
        return True

    def _parse_frames(self) -> None:
        """Turn the complete frames in the read buffer into messages and credits
        (framing.next_frame parses; here the payloads go into slots)."""
        rview = self._rview
        pos, end = self._rpos, self._rend
        max_header, max_payload = self.max_header, self._max_payload
        inbox = self._inbox
        try_alloc = self.recv_pool.try_alloc
        while True:
            f = next_frame(rview, pos, end, max_header, max_payload)
            if f is None:
                break
            kind, pstart, header, lens, extra, plen = f
            if kind != _DATA:
                if kind == _CREDIT:
                    self._credits += plen
                    pos = pstart
                    continue
                if kind == _CLOSE:
                    self._to_peer_gone("peer closed the connection")
                    pos = end  # nothing follows a goodbye
                    break
                raise ProtocolError("unexpected HELLO frame after the handshake")
            if extra.__class__ is int and extra > 0:
                self._credits += extra  # credits piggybacked on data
            if not plen:
                pos = pstart
                self.stats.messages_received += 1
                inbox.append(Message(header, [self._empty[0:0] for _ in lens], None, self, None))
                continue
            slot = try_alloc(plen)
            if slot is None:
                raise ProtocolError("peer sent beyond its credits")
            base = slot.mem
            if len(lens) == 1:
                bufs = [base[:plen]]
            else:
                bufs, off = [], 0
                for n in lens:
                    bufs.append(base[off : off + n])
                    off += n
            have = end - pstart
            if have >= plen:
                if self._rhead.nbytes != _IDLE_READ and plen < _READ_AHEAD:
                    self._rhead = rview[:_IDLE_READ]  # small messages again: read many at once
                pos = pstart + plen
                base[:plen] = rview[pstart:pos]
                st = self.stats
                st.messages_received += 1
                st.bytes_received += plen
                inbox.append(Message(header, bufs, None, self, slot))
                continue
            # the rest of the payload is read straight into the slot; while messages are
            # this large, idle reads take little more than a prefix and header, so that
            # the next payload too lands in its slot rather than in the read buffer
            if plen > _IDLE_READ and self._rhead.nbytes != _READ_AHEAD:
                self._rhead = rview[:_READ_AHEAD]
            if have:
                base[:have] = rview[pstart:end]
            self._want = base[have:plen]
            self._cur = (header, bufs, slot)
            pos = end
            break
        if pos >= end:
            self._rpos = self._rend = 0
        elif pos:  # a partial frame: move it to the front (it is smaller than a header)
            n = end - pos
            self._rbuf[:n] = bytes(rview[pos:end])
            self._rpos, self._rend = 0, n
        else:
            self._rpos, self._rend = pos, end

    def _set_rcvtimeo(self, t: float) -> None:
        self._rcvtimeo = _set_timeo(self.sock, socket.SO_RCVTIMEO, t)

    def _wait_readable(self, t: float) -> None:
        """Read once, waiting up to ``t`` seconds for something to arrive; while bytes of
        ours wait for room in the kernel, wake for that as well and write them."""
        if t <= 0:
            self._read(_DONTWAIT)
            return
        if self._out is not None or (self._owed and not self._state):
            self._send_control()
            if self._out is not None or self._owed:
                self._poll.modify(self._fd, _POLLIN | _POLLOUT)
                try:
                    events = self._poll.poll(t * 1000.0 + 0.5)
                finally:
                    self._poll.modify(self._fd, _POLLIN)
                if events and events[0][1] & _POLLOUT:
                    self._send_control()
                self._read(_DONTWAIT)
                return
        # the kernel's timeout is reused while it is not longer than asked (nor much shorter)
        if not (t * 0.5 <= self._rcvtimeo <= t):
            self._set_rcvtimeo(t)
        self._read(0)

    def pending(self) -> bool:
        return bool(self._inbox)

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

    def yield_to_peer(self) -> None:
        # A socket write wakes its reader with a sync wake-up, and Linux queues a reader on
        # this machine on the writer's CPU, expecting the writer to sleep. A gateway that goes
        # on to gather the next chunk does not, and the reader waits for it (see
        # docs/design.md#tcp-yield-to-a-local-reader)
        if self._peer_here:
            os.sched_yield()

    def flush(self) -> bool:
        if self._state >= BROKEN:
            return True
        return self._flush_out()

    def recv(self, timeout: Optional[float] = None) -> Message:
        inbox = self._inbox
        if inbox:
            return inbox.popleft()
        if self._state >= BROKEN:
            raise self._closed_error()
        if self._out is not None:
            self._flush_out()  # bytes a send(timeout=0) left go on with any call
        t = self.default_timeout if timeout is None else timeout
        end = _monotonic() + t
        if self._owed and not self._state:
            # what is already there needs no credits back; before waiting, though, the
            # peer may be waiting for ours (_wait_readable sends them)
            self._read(_DONTWAIT)
            if inbox:
                return inbox.popleft()
        while True:
            if self._state:
                raise self._closed_error()
            if t > 0 and self._out is None and not self._owed:  # the common wait, inline
                if not (t * 0.5 <= self._rcvtimeo <= t):
                    self._set_rcvtimeo(t)
                self._read(0)
            else:
                self._wait_readable(t)
            if inbox:
                return inbox.popleft()
            t = end - _monotonic()
            if t <= 0:
                if self._state:
                    raise self._closed_error()
                raise Timeout("timed out waiting for a message")

    def _release_message(self, slot: Optional[Slot]) -> None:
        """A message was released: its slot goes back to the receive pool, and the peer is
        owed a credit (sent once half its window is owed, or before we wait)."""
        if self._state >= BROKEN:
            return
        if slot is not None:
            self.recv_pool.put(slot)
        self._owed += 1
        if self._owed >= self._owe_flush:
            self._send_control()

    # -- send -------------------------------------------------------------------------
    def alloc(self, nbytes: int, timeout: Optional[float] = None) -> Slot:
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

    def send(self, header: Any, buffers: Sequence = (), timeout: Optional[float] = None) -> None:
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
                head = _pack([header, lens, owed or None])
            except (TypeError, ValueError, OverflowError) as e:
                raise TypeError(f"header is not msgpack-serialisable: {e}") from None
            hlen = len(head)
            if hlen > self.max_header:
                raise ValueError(f"header of {hlen} bytes exceeds the limit of {self.max_header}")
            views[0] = _PREFIX.pack(_MAGIC, _VERSION, _DATA, hlen, total)
            views[1] = head
            self._owed = 0
            size = _PREFIX_SIZE + hlen + total
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
            st = self.stats
            st.messages_sent += 1
            st.bytes_sent += total
            if copies:
                st.copies += copies
        finally:
            if slots is not None and not kept:
                for s in slots:
                    if s.pool is pool:
                        pool.put(s)

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
        self.stats.credit_stalls += 1
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
                self._sndtimeo = _set_timeo(sock, socket.SO_SNDTIMEO, t)
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

    # -- lifecycle --------------------------------------------------------------------
    def fileno(self) -> int:
        return self._fd if self._state < BROKEN else -1

    def abort(self) -> None:
        """CLOSED at once, without lingering for a peer that does not read what we sent."""
        self._abort("aborted by this side")
        self._to_closed()

    def _abort(self, why: str) -> None:
        """BROKEN at once (a protocol error: the peer's bytes are not worth keeping)."""
        self._to_broken(why)
        self._inbox.clear()
        self._want = self._cur = None
        self._drop_out()
        if self._sock_open:
            self._sock_open = False
            self.sock.close()

    def _break(self) -> None:
        """A frame was cut: BROKEN, FIN after what was written. The socket itself stays
        open until close(), so bytes the peer still sends (credits) are not answered with a
        reset that would drop the messages sent before."""
        self._to_broken("connection torn down after a cut frame")
        self._inbox.clear()
        self._want = self._cur = None
        self._drop_out()
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        """Say goodbye after what is pending, let the kernel hand our last bytes to the peer
        (bounded), close."""
        if not self._sock_open:
            self._to_closed()
            return
        self._sock_open = False
        sock = self.sock
        end = _monotonic() + min(TCP_LINGER, self.default_timeout)
        if self._state == OPEN:
            if self._out is not None:
                self._finish_out(end)
            if self._out is None:
                try:
                    sock.send(framing.frame_close(), _DONTWAIT)
                except OSError:
                    pass
        self._to_closed()
        self._inbox.clear()
        self._want = self._cur = None
        self._drop_out()
        try:
            sock.shutdown(socket.SHUT_WR)  # FIN after everything queued
        except OSError:
            pass
        try:
            self._linger(sock, end)
        except OSError:
            pass
        sock.close()

    def _finish_out(self, end: float) -> None:
        """close(): write what a send(timeout=0) left, reading meanwhile, until ``end``."""
        while not self._flush_out() and not self._state:
            t = end - _monotonic()
            if t <= 0:
                return
            self._poll.modify(self._fd, _POLLIN | _POLLOUT)
            try:
                self._poll.poll(t * 1000.0 + 0.5)
            finally:
                self._poll.modify(self._fd, _POLLIN)
            try:
                self._read(_DONTWAIT)
            except ProtocolError:
                return

    def _linger(self, sock: socket.socket, end: float) -> None:
        # Closing a socket that has unread bytes (a credit frame the peer sent meanwhile)
        # makes the kernel reset the connection and drop what we sent and the peer has
        # not received. So drain incoming bytes until the kernel has handed all of ours
        # over, for a bounded time.
        outq = bytearray(4)
        scratch = self._rview
        while True:
            while True:
                try:
                    if not sock.recv_into(scratch, 0, _DONTWAIT):
                        return  # the peer closed too: nothing more will come
                except (BlockingIOError, InterruptedError):
                    break
            fcntl.ioctl(self._fd, termios.TIOCOUTQ, outq)
            if int.from_bytes(outq, "little") == 0 or _monotonic() >= end:
                return
            self._poll.poll(TCP_LINGER_POLL * 1000.0)
