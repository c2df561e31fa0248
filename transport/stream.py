"""Receive machinery and lifecycle for byte-stream backends (tcp); the send side is
transport/stream_send.py.

Receiving is one syscall per wake-up. The socket stays in blocking mode; a wait is a
``recv_into`` that blocks in the kernel for at most the caller's timeout (``SO_RCVTIMEO``,
set only when it changes), and reads that must not block pass ``MSG_DONTWAIT``. What
arrives lands in a read buffer where framing.next_frame parses prefixes and headers in
place:

- a payload that arrived in the read buffer together with its header (small messages,
  and the first bytes of a large one) is copied from there into a slot of the receive
  pool: a few KiB of memcpy is much cheaper than the syscall that avoiding it costs;
- the rest of a payload is read straight into the slot (one ``recv_into`` with
  ``MSG_WAITALL`` when the caller waits; ``recvmsg_into`` scattering over [the rest of
  the slot, a short read-ahead for the next prefix and header] when it does not), so for
  large messages the kernel's socket copy is the only one.

Either way ``Message.buffers`` are views of registered memory (the receive pool).

Where transport/_tcpfast.c is built (``native``, the default), alloc, send, recv and a
message's release run there for the common message -- one slot, a header that fits --
on the same state (the attributes in ``__slots__``); everything else (waiting for
credits, a frame the kernel does not take at once, a payload larger than one read, any
malformed input) is handed to the Python methods below, which own the protocol.

A peer on this machine gets congestion control without pacing (:func:`tune_socket`).

A connection is used by one thread at a time (messages too: release them from that
thread).
"""
from __future__ import annotations

import collections
import fcntl
import ipaddress
import select
import socket
import termios
import time
from typing import Any, Optional

from . import framing
from .base import BROKEN, OPEN, CompiledPath, Connection, ConnectionStats, Message
from .errors import ProtocolError, Timeout, TransportError
from .framing import next_frame
from .pool import BufferPool, Slot
from .stream_send import StreamSender, set_timeo
from .timing import TCP_LINGER, TCP_LINGER_POLL

try:
    from . import _tcpfast
except ImportError:  # no C compiler where it was installed: the Python path
    _tcpfast = None

#: whether transport/_tcpfast.c is built here (connections use it unless ``native=False``)
NATIVE_AVAILABLE = _tcpfast is not None

_DONTWAIT = socket.MSG_DONTWAIT
_WAITALL = socket.MSG_WAITALL
_POLLIN, _POLLOUT = select.POLLIN, select.POLLOUT
_PREFIX_SIZE = framing.PREFIX_SIZE
_DATA, _CREDIT, _CLOSE = framing.DATA, framing.CREDIT, framing.CLOSE
_IDLE_READ = 64 << 10  # a payload up to this size is read with its header into the read buffer
_HEAD_ROOM = 1 << 10  # an idle read takes a prefix and a header beside such a payload
_READ_AHEAD = 4 << 10  # after the rest of a payload: the next prefix + header (+ a bit)
_monotonic = time.monotonic
#: congestion control for a peer on this machine: loopback has no congestion, and the
#: pacing of the system's default (bbr here) held one large message to its bandwidth estimate
LOCAL_CONGESTION = b"reno"


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


def tune_socket(sock: socket.socket, here: bool) -> None:
    """Socket options for a tcp connection's data: to a peer on this machine, congestion
    control without pacing (reno, which every kernel allows unprivileged); nothing changes
    where the option is refused or the socket is not TCP."""
    if here and sock.family != socket.AF_UNIX and hasattr(socket, "TCP_CONGESTION"):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, LOCAL_CONGESTION)
        except OSError:
            pass


class _StreamMessage(Message):
    """A tcp message: its release runs in transport/_tcpfast.c where that is built."""

    __slots__ = ()


class StreamConnection(StreamSender, CompiledPath, Connection):
    """A message connection over a connected stream socket, after the handshake."""

    # what the compiled path reads and writes (members it reaches without a lookup)
    __slots__ = ("_state", "_credits", "_owed", "_rpos", "_rend", "_want", "_out", "_inbox", "_rcvtimeo",
                 "_rsize", "_link")

    def __init__(self, sock: socket.socket, url: str, recv_pool: BufferPool, peer: dict,
                 *, default_timeout: float, max_header: int = framing.MAX_HEADER, native: Optional[bool] = None):
        sock.setblocking(True)  # waits block in the kernel; see the module docstring
        self._state = OPEN
        self._link = None
        self.url = url
        self.sock = sock
        self._fd = sock.fileno()
        self.default_timeout = default_timeout
        self._stats = ConnectionStats()
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
        # the read buffer: bytes [_rpos, _rend) are received and not parsed yet; an idle
        # read takes _rsize bytes
        self._rbuf = bytearray(_PREFIX_SIZE + max_header + _IDLE_READ)
        self._rview = memoryview(self._rbuf)
        self._idle = min(len(self._rbuf), _IDLE_READ + _HEAD_ROOM)
        self._rsize = self._idle
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
        tune_socket(sock, self._peer_here)
        if native is not False and _tcpfast is not None:
            self._link = _tcpfast.Link(self._fd, self._rbuf, recv_pool, self.send_pool, self.max_message,
                                       self._max_payload, max_header, self._owe_flush, self._idle, _READ_AHEAD,
                                       _IDLE_READ)

    def _close_link(self) -> None:
        if self._link is not None:
            self._link.close()  # the compiled path declines from now on

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
                n = self.sock.recv_into(self._rview[: self._rsize], 0, flags)
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
            st = self._stats
            st.messages_received += 1
            st.bytes_received += slot.nbytes
            self._inbox.append(_StreamMessage(header, bufs, None, self, slot))
            if n == k:
                return True
            self._rpos, self._rend = 0, n - k
        self._parse_rest()
        return True

    def _parse_rest(self) -> None:
        """Parse what the read buffer holds from ``_rpos`` (the compiled recv hands over
        here what it does not parse itself); a protocol error breaks the connection."""
        try:
            self._parse_frames()
        except ProtocolError as e:
            self._abort(f"protocol error: {e}")
            raise

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
                self._stats.messages_received += 1
                inbox.append(_StreamMessage(header, [self._empty[0:0] for _ in lens], None, self, None))
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
                if plen < _READ_AHEAD:
                    self._rsize = self._idle  # small messages (again): read many at once
                pos = pstart + plen
                base[:plen] = rview[pstart:pos]
                st = self._stats
                st.messages_received += 1
                st.bytes_received += plen
                inbox.append(_StreamMessage(header, bufs, None, self, slot))
                continue
            # the rest of the payload is read straight into the slot; while messages are
            # this large, idle reads take little more than a prefix and header, so that
            # the next payload too lands in its slot rather than in the read buffer
            if plen > _IDLE_READ:
                self._rsize = _READ_AHEAD
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
        self._rcvtimeo = set_timeo(self.sock, socket.SO_RCVTIMEO, t)

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

    def _recv_py(self, timeout: Optional[float] = None) -> Message:
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

    # the public calls: the compiled ones replace these where transport/_tcpfast.c is built
    alloc = StreamSender._alloc_py
    send = StreamSender._send_py
    recv = _recv_py

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
        self._close_link()
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
        self._close_link()
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


if _tcpfast is not None:
    _StreamMessage.release = _tcpfast.bind(_StreamMessage, Slot, StreamConnection, TransportError, Timeout,
                                           BROKEN, framing._packer.pack, framing._unpackb, framing.TAG_DATA,
                                           framing.TAG_CREDIT, framing.PAD_MIN)
    StreamConnection.alloc, StreamConnection.send, StreamConnection.recv = \
        _tcpfast.connection_methods(StreamConnection)
