"""Receive and send machinery for byte-stream backends (tcp today).

Receiving is one syscall per wake-up. The socket stays in blocking mode; a wait is a
``recv_into`` that blocks in the kernel for at most the caller's timeout (``SO_RCVTIMEO``,
set only when it changes), and reads that must not block pass ``MSG_DONTWAIT``. What
arrives lands in a read buffer where prefixes and headers are parsed in place:

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
path), although here the kernel's copy is the only one. A send either completes or
raises before its first byte (Timeout, ValueError, TypeError: the connection is still
usable); if the deadline passes in the middle of a frame the byte stream cannot be
resynchronised, so the connection is torn down and ConnectionClosed raised (everything
sent before is still delivered).

Credits: releasing a message owes the peer a credit; owed credits ride on the next DATA
frame, or go as a CREDIT frame once half the peer's window is owed or before this side
waits. Sending credits never blocks: a frame the kernel cannot take goes later.

A connection is used by one thread at a time (messages too: release them from that
thread).
"""
from __future__ import annotations

import collections
import fcntl
import select
import socket
import struct
import termios
import time

import msgpack
from typing import Any, Optional, Sequence

from . import framing
from .base import Connection, ConnectionStats, Message, closed_error
from .errors import ConnectionClosed, ProtocolError, Timeout
from .framing import Kind
from .pool import BufferPool, Slot

_IOV_MAX = 1024
_DONTWAIT = socket.MSG_DONTWAIT
_WAITALL = socket.MSG_WAITALL
_SEND_SLICE = 0.05  # a blocked send drains the peer this often (no mutual blocking)
_POLLIN, _POLLOUT = select.POLLIN, select.POLLOUT
_POLL_ERR = select.POLLERR | select.POLLHUP | select.POLLNVAL
_PREFIX = framing.PREFIX
_TAGGED = struct.Struct("<IIQ")  # the prefix with magic|version|kind as one u32
_PREFIX_SIZE = framing.PREFIX_SIZE
_MAGIC, _VERSION = framing.MAGIC, framing.VERSION
_DATA, _CREDIT, _CLOSE = int(Kind.DATA), int(Kind.CREDIT), int(Kind.CLOSE)
_MAX_BUFFERS = framing.MAX_BUFFERS
_TAG_DATA = struct.unpack("<I", _PREFIX.pack(_MAGIC, _VERSION, _DATA, 0, 0)[:4])[0]
_TAG_CREDIT = struct.unpack("<I", _PREFIX.pack(_MAGIC, _VERSION, _CREDIT, 0, 0)[:4])[0]
_IDLE_READ = 64 << 10  # read size when no payload is being received
_READ_AHEAD = 4 << 10  # after the rest of a payload: the next prefix + header (+ a bit)
_TIMEVAL = struct.Struct("ll")
_SIOCOUTQNSD = 0x894B  # linux/sockios.h
_LINGER = 2.0  # close(): longest wait for the kernel to hand our last bytes to the peer
_monotonic = time.monotonic
_pack = framing._packer.pack
_unpackb = msgpack.unpackb


def _set_timeo(sock: socket.socket, opt: int, t: float) -> float:
    """Set SO_RCVTIMEO/SO_SNDTIMEO to ``t`` seconds (at least 1 us: 0 means forever)."""
    sec = int(t)
    usec = int((t - sec) * 1e6)
    if sec == 0 and usec == 0:
        usec = 1
    sock.setsockopt(socket.SOL_SOCKET, opt, _TIMEVAL.pack(sec, usec))
    return sec + usec * 1e-6


class _StreamMessage(Message):
    """A Message that gives its slot back to its connection (no closure per message)."""

    __slots__ = ("_conn", "_slot")

    def __init__(self, header: Any, buffers: list, conn: "StreamConnection", slot: Optional[Slot]):
        self.header = header
        self.buffers = buffers
        self.released = False
        self._conn = conn
        self._slot = slot

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        for b in self.buffers:
            b.release()
        self.buffers = []
        conn = self._conn
        if conn._closed:
            return
        slot = self._slot
        if slot is not None:
            self._slot = None
            _free_slot(slot)
        conn._owed += 1
        if conn._owed >= conn._owe_flush:
            conn._send_control()


def _free_slot(slot: Slot) -> None:
    # BufferPool.free without the call: the slot is one of ours, so its index is valid
    pool = slot.pool
    i = slot.index
    in_use = pool._in_use
    if in_use[i]:
        in_use[i] = False
        pool._free.append(i)


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
        self._closed = False
        self._sock_open = True
        self._peer_gone: Optional[str] = None
        # the read buffer: bytes [_rpos, _rend) are received and not parsed yet
        self._rbuf = bytearray(_PREFIX_SIZE + max_header + _IDLE_READ)
        self._rview = memoryview(self._rbuf)
        self._rhead = self._rview[:_IDLE_READ]  # where an idle read goes
        self._rpos = 0
        self._rend = 0
        # a payload being read straight into its slot: the rest of the slot, and the message
        self._want: Optional[memoryview] = None
        self._cur: Any = None
        # bytes of a control frame (credits, close) the kernel did not take yet
        self._tail: Optional[memoryview] = None
        self._rcvtimeo = -1.0  # the kernel's SO_RCVTIMEO / SO_SNDTIMEO as last set
        self._sndtimeo = -1.0
        self._poll = select.poll()
        self._poll.register(self._fd, _POLLIN)
        self._empty = memoryview(b"")
        self._outq = bytearray(4)

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
            self._peer_gone = f"connection reset ({e.strerror or e})"
            return False
        if n == 0:
            self._peer_gone = "peer closed the connection"
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
            self._inbox.append(_StreamMessage(header, bufs, self, slot))
            if n == k:
                return True
            self._rpos, self._rend = 0, n - k
        try:
            self._parse_frames()
        except ProtocolError:
            self._abort()
            raise
        return True

    def _parse_frames(self) -> None:
        """Turn the complete frames in the read buffer into messages and credits."""
        rbuf, rview = self._rbuf, self._rview
        pos, end = self._rpos, self._rend
        max_header = self.max_header
        inbox = self._inbox
        while end - pos >= _PREFIX_SIZE:
            # magic, version and kind in one compare: "MT", VERSION, kind as a u32
            tag, hlen, plen = _TAGGED.unpack_from(rbuf, pos)
            if not (tag == _TAG_DATA and 0 < hlen <= max_header and plen <= self._max_payload):
                if tag == _TAG_CREDIT and not hlen:
                    self._credits += plen
                    pos += _PREFIX_SIZE
                    continue
                kind, hlen, plen = framing.decode_prefix(
                    rview[pos : pos + _PREFIX_SIZE], max_header=max_header, max_payload=self._max_payload)
                if kind == _CREDIT:
                    self._credits += plen
                    pos += _PREFIX_SIZE
                    continue
                if kind == _CLOSE:
                    self._peer_gone = "peer closed the connection"
                    pos = end  # nothing follows a goodbye
                    break
                if kind != _DATA:
                    raise ProtocolError(f"unexpected {Kind(kind).name} frame after the handshake")
            hstart = pos + _PREFIX_SIZE
            pstart = hstart + hlen
            if end < pstart:
                break  # the header is not all here yet
            # decode_header, with the one-buffer case checked inline
            try:
                header, lens, extra = _unpackb(rview[hstart:pstart], strict_map_key=False)
                fast = lens.__class__ is list and len(lens) == 1 and lens[0] == plen and lens[0].__class__ is int
            except Exception:
                fast = False
            if not fast:  # anything else gets the full validation (and its ProtocolError)
                header, lens, extra = framing.decode_header(rview[hstart:pstart], plen)
            if extra.__class__ is int and extra > 0:
                self._credits += extra  # credits piggybacked on data
            if not plen:
                pos = pstart
                self.stats.messages_received += 1
                inbox.append(_StreamMessage(header, [self._empty[0:0] for _ in lens], self, None))
                continue
            pool = self.recv_pool
            free = pool._free
            if not free:
                raise ProtocolError("peer sent beyond its credits")
            i = free.pop()  # LIFO, as BufferPool.try_alloc
            pool._in_use[i] = True
            slot = pool._slots[i]
            slot.nbytes = plen
            base = slot._mem
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
                inbox.append(_StreamMessage(header, bufs, self, slot))
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
            rbuf[:n] = bytes(rview[pos:end])
            self._rpos, self._rend = 0, n
        else:
            self._rpos, self._rend = pos, end

    def _set_rcvtimeo(self, t: float) -> None:
        self._rcvtimeo = _set_timeo(self.sock, socket.SO_RCVTIMEO, t)

    def _wait_readable(self, t: float) -> None:
        """Read once, waiting up to ``t`` seconds for something to arrive; while control
        bytes wait for room in the kernel, wake for that as well and send them."""
        if t <= 0:
            self._read(_DONTWAIT)
            return
        if self._tail is not None or (self._owed and self._peer_gone is None):
            self._send_control()
            if self._tail is not None or self._owed:
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
        if self._closed or self._peer_gone is not None or self._credits <= 0 or self._tail is not None:
            return False
        # nothing queued in the kernel that it could not send yet: a peer that reads keeps it
        # so, and a frame we start goes out as the peer reads; one that does not read would
        # stall the send (SIOCOUTQNSD: bytes not sent; TIOCOUTQ would count unacked ones too)
        fcntl.ioctl(self._fd, _SIOCOUTQNSD, self._outq)
        return self._outq == b"\0\0\0\0"

    def recv(self, timeout: Optional[float] = None) -> Message:
        inbox = self._inbox
        if inbox:
            return inbox.popleft()
        if self._closed:
            raise ConnectionClosed(f"{self.url}: connection is closed")
        t = self.default_timeout if timeout is None else timeout
        end = _monotonic() + t
        if self._owed and self._peer_gone is None:
            # what is already there needs no credits back; before waiting, though, the
            # peer may be waiting for ours (_wait_readable sends them)
            self._read(_DONTWAIT)
            if inbox:
                return inbox.popleft()
        while True:
            if self._peer_gone is not None:
                raise closed_error(self, self._peer_gone)
            if t > 0 and self._tail is None and not self._owed:  # the common wait, inline
                if not (t * 0.5 <= self._rcvtimeo <= t):
                    self._set_rcvtimeo(t)
                self._read(0)
            else:
                self._wait_readable(t)
            if inbox:
                return inbox.popleft()
            t = end - _monotonic()
            if t <= 0:
                if self._peer_gone is not None:
                    raise closed_error(self, self._peer_gone)
                raise Timeout("timed out waiting for a message")

    # -- send -------------------------------------------------------------------------
    def alloc(self, nbytes: int, timeout: Optional[float] = None) -> Slot:
        if self._closed:
            raise ConnectionClosed(f"{self.url}: connection is closed")
        if not 0 <= nbytes <= self.max_message:
            raise ValueError(f"{nbytes} bytes: a message holds 0..{self.max_message} bytes (the peer's slot)")
        pool = self.send_pool
        free = pool._free
        if not free:  # tcp frees send slots as soon as they are sent: the caller holds them all
            raise Timeout(f"all {pool.nslots} send slots are held by the caller")
        i = free.pop()  # LIFO, as BufferPool.try_alloc
        pool._in_use[i] = True
        slot = pool._slots[i]
        slot.nbytes = nbytes
        return slot

    def send(self, header: Any, buffers: Sequence = (), timeout: Optional[float] = None) -> None:
        slots = None
        pool = self.send_pool
        try:
            if self._closed:
                raise ConnectionClosed(f"{self.url}: connection is closed")
            if self._peer_gone is not None:
                raise closed_error(self, self._peer_gone)
            views: list = [None, None]
            lens = []
            copies = 0
            for b in buffers:
                if b.__class__ is Slot:
                    if slots is None:
                        slots = [b]
                    else:
                        slots.append(b)
                    mv = b._mem[: b.nbytes]
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
                if self._tail is not None:
                    raise BlockingIOError  # control bytes go first: the slow path
                n = self.sock.sendmsg(views, (), _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self._peer_gone = self._peer_gone or f"send failed ({e.strerror or e})"
                raise closed_error(self, self._peer_gone) from None
            except BaseException:
                self._owed += owed  # nothing of the frame went out
                raise
            if n != size:
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
            if slots is not None:
                for s in slots:
                    if s.pool is pool:
                        _free_slot(s)

    def _wait_credits(self, end: float) -> None:
        self.stats.credit_stalls += 1
        while self._credits <= 0:
            if self._peer_gone is not None:
                raise closed_error(self, self._peer_gone)
            if self._closed:
                raise ConnectionClosed(f"{self.url}: connection is closed")
            t = end - _monotonic()
            if t <= 0:
                raise Timeout("timed out waiting for credits (the peer holds every message)")
            self._wait_readable(t)

    def _write_rest(self, views: list, n: int, total: int, end: Optional[float],
                    timeout: Optional[float]) -> None:
        """The slow path of a frame write: ``n`` of ``total`` bytes of ``views`` went out
        (control bytes pending first, if any). Timeout if nothing of the frame could be
        written in time; ConnectionClosed (and the connection torn down) if only part."""
        tail = self._tail
        frame_start = 0
        if tail is not None:  # nothing was sent yet: control bytes go first
            views.insert(0, tail)
            total += tail.nbytes
            frame_start = tail.nbytes
            self._tail = None
        if end is None:
            end = _monotonic() + (self.default_timeout if timeout is None else timeout)
        sent = 0
        views = [v if v.__class__ is memoryview else memoryview(v) for v in views]
        sock = self.sock
        while True:
            sent += n
            while views and n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            if not views:
                return
            if n:
                views[0] = views[0][n:]
            t = end - _monotonic()
            if t <= 0:
                if sent <= frame_start:
                    if frame_start:  # what is left of the control bytes goes later
                        self._tail = memoryview(bytes(views[0][: frame_start - sent]))
                    raise Timeout("timed out sending (the peer is not reading)")
                self._break()
                raise ConnectionClosed(
                    f"{self.url}: send timed out after {sent - frame_start} of {total - frame_start} bytes "
                    "of the frame; a byte stream cannot be resynchronised, so the connection is closed")
            # drain the peer while our socket is full: it may be blocked sending to us
            self._read(_DONTWAIT)
            if self._closed:
                raise ConnectionClosed(f"{self.url}: connection is closed")
            if self._peer_gone is not None:
                raise closed_error(self, self._peer_gone)
            # then block in the kernel (as a plain sendall does) for a slice of the time
            t = min(t, _SEND_SLICE)
            if not (t * 0.5 <= self._sndtimeo <= t):
                self._sndtimeo = _set_timeo(sock, socket.SO_SNDTIMEO, t)
            try:
                n = sock.sendmsg(views[:_IOV_MAX])
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self._peer_gone = self._peer_gone or f"send failed ({e.strerror or e})"
                raise closed_error(self, self._peer_gone) from None

    def _send_control(self) -> None:
        """Send owed credits (after any pending control bytes) without blocking."""
        if self._closed or self._peer_gone is not None:
            return
        sock = self.sock
        try:
            tail = self._tail
            if tail is not None:
                n = sock.send(tail, _DONTWAIT)
                if n < tail.nbytes:
                    self._tail = tail[n:]
                    return
                self._tail = None
            owed = self._owed
            if owed:
                frame = framing.frame_credit(owed)
                self._owed = 0
                n = sock.send(frame, _DONTWAIT)
                if n < _PREFIX_SIZE:
                    self._tail = memoryview(frame)[n:]
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._peer_gone = f"send failed ({e.strerror or e})"

    def _send_raw(self, frame: bytes) -> None:
        if self._closed:
            raise ConnectionClosed(f"{self.url}: connection is closed")
        self._write_rest([memoryview(frame)], 0, len(frame), None, None)

    # -- lifecycle --------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        return self._fd if not self._closed else -1

    def abort(self) -> None:
        self._abort()

    def _abort(self) -> None:
        """Close at once (after a protocol error: the peer's bytes are not worth keeping)."""
        if not self._closed:
            self._closed = True
            self._inbox.clear()
            self._want = self._cur = self._tail = None
        if self._sock_open:
            self._sock_open = False
            self.sock.close()

    def _break(self) -> None:
        """A frame was cut: closed for the caller, FIN after what was written. The socket
        itself stays open until close(), so bytes the peer still sends (credits) are not
        answered with a reset that would drop the messages sent before."""
        self._closed = True
        self._peer_gone = self._peer_gone or "connection torn down after a cut frame"
        self._inbox.clear()
        self._want = self._cur = self._tail = None
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        """Say goodbye, let the kernel hand our last bytes to the peer (bounded), close."""
        if not self._sock_open:
            self._closed = True
            return
        self._sock_open = False
        sock = self.sock
        if not self._closed and self._peer_gone is None:
            try:
                if self._tail is not None:
                    sock.send(self._tail, _DONTWAIT)
                sock.send(framing.frame_close(), _DONTWAIT)
            except OSError:
                pass
        self._closed = True
        self._inbox.clear()
        self._want = self._cur = self._tail = None
        try:
            sock.shutdown(socket.SHUT_WR)  # FIN after everything queued
        except OSError:
            pass
        try:
            self._linger(sock)
        except OSError:
            pass
        sock.close()

    def _linger(self, sock: socket.socket) -> None:
        # Closing a socket that has unread bytes (a credit frame the peer sent meanwhile)
        # makes the kernel reset the connection and drop what we sent and the peer has
        # not received. So drain incoming bytes until the kernel has handed all of ours
        # over, for a bounded time.
        end = _monotonic() + min(_LINGER, self.default_timeout)
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
            self._poll.poll(5)
