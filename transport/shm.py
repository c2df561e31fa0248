"""shm://name — same-host transport through shared memory: the payload is never copied.

Each side creates one segment (transport/shmring.py) holding its send pool, sized to what
the peer accepts, its outgoing record ring and the ring its slots come back on. A Unix
socket in the abstract namespace ("\\0moe-transport/shm/<name>") carries the handshake --
HELLO both ways, then the segment fd and the doorbell eventfd (SCM_RIGHTS) -- and then
stays open only so that its HUP tells either side, within a poll, that the peer is gone
(a SIGKILL included).

Segments are sealed memfds (F_SEAL_SHRINK | F_SEAL_GROW): nothing ever has a name in
/dev/shm, and since neither side can change a segment's size once it exists, no peer can
make the other's accesses fault (SIGBUS); a peer's segment without those seals is refused
before it is mapped.

send writes one small record per message: a framing DATA frame (prefix + msgpack
[header, lens, extra]) where ``extra`` is ``[slot, offset, slot, offset, ...]`` per
buffer, or the fixed-tail one-slot form (framing.pack_slot_frame); the receiver parses
it with framing.parse_slot_record / parse_record and hands out memoryviews straight into
the sender's slots. When both HELLOs offer framing.CAP_SHM_FAST (``fast=True``, the
default) a one-slot message with a small header is instead framing's fixed-width fast
record, written and read in place with one struct call each; its send, recv, alloc and
release paths inline the ring and pool operations, since on this path every Python
call and attribute load is a measurable share of the latency. Releasing the message pushes the slot ids onto the return ring: that
return is the credit. Unregistered buffers are staged into send slots (packed, one copy
each, counted).

A peer can write anything into the words and rings we read from its segment (and into
the return ring and the words of ours that it owns): every value is checked before use,
and whatever is wrong makes *this* connection BROKEN with a ProtocolError from its own
recv/send (transport/base.py's lifecycle), never a crash and never an error raised from
``Message.release``.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Optional, Sequence

from . import framing
from . import handshake as hs
from .base import (DEFAULT_NSLOTS, DEFAULT_SLOT_SIZE, DEFAULT_TIMEOUT, OPEN, CompiledPath, Connection,
                   ConnectionStats, Deadline, Listener)
from .errors import ConnectionClosed, ProtocolError, Refused, Timeout, TransportError
from .framing import CAP_SHM_FAST, MAX_FAST_RECORD, TAG_FAST, unpack_fast_user
from .pool import BufferPool, buffer_address, round_up
from .shmring import (W_ARMED_DATA, W_ARMED_SPACE, W_OUT_HEAD, W_OUT_TAIL, W_RET_HEAD, W_RET_TAIL, W_RUNG,
                      W_RUNG_AT, Cursors, Doorbell, Fence, Layout, RecordReader, RecordWriter, ReturnReader,
                      ReturnWriter, Segment, pow2, ring_bell)
from .shm_handshake import _recv_fds, _send_fds, _validate, check_credentials, peer_credentials
from .shm_recv import _NativeSlotMessage, _SlotMessage, ShmRecvPath  # noqa: F401  (the messages: named here too)
from .shm_send import ShmSendPath
from .shm_wire import MAX_RECORD, MAX_RING, NAP, RING_BYTES, SPIN

try:  # the compiled fast path (setup.py builds it; without it every message takes the Python path)
    from . import _shmfast
except ImportError:  # no compiler where this was installed
    _shmfast = None

__all__ = ["ShmConnection", "ShmListener", "connect", "listen", "NATIVE_AVAILABLE", "peer_credentials",
           "check_credentials"]

#: whether transport/_shmfast.c is built here (connections use it unless ``native=False``)
NATIVE_AVAILABLE = _shmfast is not None

SOCK_PREFIX = "\0moe-transport/shm/"


def _sock_name(name: str) -> str:
    if not name or len(SOCK_PREFIX) + len(name.encode()) > 107:
        raise ValueError(f"shm name must be 1..{107 - len(SOCK_PREFIX)} bytes, got {name!r}")
    return SOCK_PREFIX + name




def _handshake(sock: socket.socket, role: str, url: str, slot_size: int, nslots: int, timeout: float,
               limits: hs.Limits, secret: Optional[bytes], allowed_gids: Sequence[int],
               fast: bool = True, native: Optional[bool] = None) -> hs.HandshakeGen:
    """Credentials, HELLO (+ AUTH) both ways, then each side creates its segment for the
    peer's (checked) limits and the two swap segment and doorbell fds."""
    creds = peer_credentials(sock)
    try:
        check_credentials(creds, allowed_gids)
    except Refused as e:
        try:
            sock.send(b"".join(framing.encode_hello({"refused": str(e), "code": "credentials"})),
                      socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except OSError:
            pass
        raise
    ex = hs.HelloExchange(role, "shm", {"slot_size": slot_size, "nslots": nslots, "ring_bytes": RING_BYTES},
                          limits=limits, secret=secret, validate=_validate,
                          caps=(CAP_SHM_FAST,) if fast else ())
    yield from hs.exchange(sock, ex)
    p_slot, p_nslots = ex.peer["slot_size"], ex.peer["nslots"]
    layout = Layout(RING_BYTES, pow2(max(p_nslots, 2)), p_slot, p_nslots, round_up(p_slot))
    seg, seg_fd = Segment.create(layout)
    peer_seg = bell = None
    fds: list = []
    try:
        bell = Doorbell(sock.fileno())
        try:
            yield from _send_fds(sock, [seg_fd, bell.fd])
        finally:
            os.close(seg_fd)
        fds = yield from _recv_fds(sock)
        peer_seg = Segment.attach(fds[0], slot_size=slot_size, nslots=nslots,
                                  max_ring=MAX_RING, min_ring=2 * MAX_RECORD)
        os.close(fds[0])
        peer_bell = fds[1]
        fds = []
        conn = ShmConnection(url, sock, seg, peer_seg, bell, peer_bell, slot_size, nslots,
                             default_timeout=timeout, fast=CAP_SHM_FAST in ex.shared_caps, native=native)
    except BaseException:  # GeneratorExit too: an abandoned handshake frees what it made
        for fd in fds:
            os.close(fd)
        if peer_seg is not None:
            peer_seg.close()
        if bell is not None:
            bell.close()
        seg.close()
        raise
    conn.authenticated = ex.authenticated
    conn.peer_credentials = creds
    return conn


class ShmConnection(ShmRecvPath, ShmSendPath, CompiledPath, Connection):
    """One shm connection after the handshake (used by one thread at a time): its receive
    side is transport/shm_recv.py's, its send side transport/shm_send.py's."""

    # the public names; where the compiled path is built they are replaced (below the class)
    # by its methods, which take the common message with no Python frame and hand anything
    # else to these
    recv, alloc, send = ShmRecvPath._recv_py, ShmSendPath._alloc_py, ShmSendPath._send_py

    def __init__(self, url: str, sock: socket.socket, seg: Segment, peer_seg: Segment,
                 bell: Doorbell, peer_bell: int, slot_size: int, nslots: int,
                 *, default_timeout: float = DEFAULT_TIMEOUT, fast: bool = False,
                 native: Optional[bool] = None):
        self.url = url
        self._state = OPEN  # an instance attribute: the hot paths read it on every call
        #: both HELLOs listed framing.CAP_SHM_FAST: common messages go as fast records
        self._fast = fast
        self.default_timeout = default_timeout
        self._stats = ConnectionStats()  # the `stats` property adds the compiled path's counts
        self._sock = sock
        self._seg, self._peer_seg = seg, peer_seg
        self._bell, self._peer_bell = bell, peer_bell
        lay = seg.layout
        self.max_message = lay.slot_size  # what the peer accepts (our pool is sized to it)
        self.send_pool = BufferPool(lay.slot_size, lay.nslots, buffer=seg.pool_mem, name=f"send:{url}")
        pool = self.send_pool  # alloc's hot path pops the pool's free list itself
        self._free, self._in_use, self._slots = pool._free, pool._in_use, pool._slots
        self._w = seg.words  # our control words
        self._pw = peer_seg.words  # the peer's
        # receive side: read-only views into the peer's pool (the sender's very slots)
        self._recv_slot_size, self._recv_nslots = slot_size, nslots
        self._recv_stride = peer_seg.layout.stride
        self._recv_mem = peer_seg.pool_mem.toreadonly()
        self._ranges = [(buffer_address(s.mem), len(s.mem)) for s in (peer_seg, seg)]
        cur = Cursors(self._w[W_OUT_TAIL], self._pw[W_OUT_HEAD], self._pw[W_RET_TAIL], self._pw[W_RUNG],
                      self._w[W_RUNG], self._w[W_RET_HEAD])
        #: the compiled fast path (transport/_shmfast.c) for fast records, or None
        self._link = self._make_link(seg, peer_seg, bell, peer_bell, cur) if fast and native is not False else None
        self._cur = cur = self._link if self._link is not None else cur  # one set of cursors for both paths
        if self._link is not None:
            self._link.attach_pool(pool, self._free, self._in_use, self._slots, self.max_message)
        self._out = RecordWriter(seg.ring, seg.words, cur)
        self._in = RecordReader(peer_seg.ring, peer_seg.words, cur)
        self._in32 = peer_seg.ring.cast("I")  # record length words, read without a struct call
        self._spins = range(16)
        self._returns = ReturnReader(seg.ret, seg.words, cur)
        self._give_back = ReturnWriter(peer_seg.ret, peer_seg.words, cur)
        fence = Fence()
        self._acq, self._rel = fence._lock.acquire, fence._lock.release  # inlined: hot path
        self._spin = SPIN
        self._torn = False  # segments, sockets and fds released (BROKEN by a protocol error, CLOSED)
        self._w[W_ARMED_DATA] = 1  # outside recv a Poller may be sleeping on fileno()
        self._w[W_ARMED_SPACE] = 0

    def _make_link(self, seg: Segment, peer_seg: Segment, bell: Doorbell, peer_bell: int, cur: Cursors):
        if _shmfast is None:
            return None
        mine, theirs = seg.layout, peer_seg.layout
        return _shmfast.Link(seg.mem, mine.ring_off, mine.ring_bytes, peer_seg.mem, theirs.ring_off,
                             theirs.ring_bytes, theirs.ret_off, theirs.ret_cap, mine.ret_off, mine.ret_cap,
                             self._recv_mem, self._recv_stride, self._recv_slot_size, self._recv_nslots, bell.fd,
                             peer_bell, unpack_fast_user, MAX_FAST_RECORD, TAG_FAST, cur.out_tail, cur.in_head,
                             cur.ret_tail, cur.ret_head, cur.rung_sent, cur.rung_seen)

    # -- doorbell -------------------------------------------------------------------
    def _ring(self) -> None:
        # when we rang (the clock both processes share): lets a sleeper tell a message that
        # came late from a wake-up that came late (see _wait_record)
        cur = self._cur
        self._pw[W_RUNG_AT] = time.monotonic_ns()
        ring_bell(self._peer_bell)
        cur.rung_sent += 1
        self._pw[W_RUNG] = cur.rung_sent  # after the write: a reader that sees it may clear

    def _clear_bell(self) -> None:
        rung = self._w[W_RUNG]
        cur = self._cur
        if rung != cur.rung_seen:
            self._bell.clear()
            cur.rung_seen = rung

    def _sleep(self, deadline: Deadline) -> None:
        """One bounded sleep on the doorbell (the caller has armed and re-checked)."""
        if self._bell.wait(min(deadline.remaining(), NAP)):
            self._check_socket()
        self._clear_bell()

    def _check_socket(self) -> None:
        try:
            data = self._sock.recv(1, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._to_peer_gone(f"peer connection reset ({e})")
            return
        self._to_peer_gone("peer closed the connection" if not data else "peer wrote to the control socket")

    # -- lifecycle ------------------------------------------------------------------
    def in_registered_memory(self, buf) -> bool:
        mv = memoryview(buf)
        if mv.nbytes == 0:
            return True
        a = buffer_address(mv)
        return any(lo <= a and a + mv.nbytes <= lo + n for lo, n in self._ranges)

    def fileno(self) -> int:
        return self._bell.ep.fileno() if not self._torn else -1

    def abort(self) -> None:
        """CLOSED at once, saying nothing to the peer."""
        self._teardown(goodbye=False)
        self._to_closed()

    def _abort(self, why: str) -> None:
        """BROKEN, and everything released at once (the peer broke the protocol)."""
        self._to_broken(why)
        self._teardown(goodbye=False)

    def close(self) -> None:
        self._teardown(goodbye=not self._state)
        self._to_closed()

    def _teardown(self, goodbye: bool) -> None:
        if self._torn:
            return
        self._torn = True
        if goodbye:
            try:
                if self._out.push(framing.frame_close()) is not None:
                    self._acq()
                    self._rel()
                    self._ring()
            except ProtocolError:
                pass
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # the peer's poll sees HUP now
        except OSError:
            pass
        self._sock.close()
        if self._link is not None:
            self._link.close()  # before the fds and mappings it uses go (its cursors stay)
        self._bell.close()
        os.close(self._peer_bell)
        # drop every view of the segments we made, so that the mappings (and the fds mmap
        # keeps) go now; one the application still exports (a numpy array over a slot or an
        # unreleased message) keeps its mapping alive until it is gone
        self.send_pool.close()
        for v in (self._recv_mem, self._in32):
            try:
                v.release()
            except BufferError:
                pass
        self._peer_seg.close()
        self._seg.close()


if _shmfast is not None:
    ShmConnection.alloc, ShmConnection.send, ShmConnection.recv = _shmfast.connection_methods(ShmConnection)


# -- listener and connect -----------------------------------------------------------
def _check_native(native: Optional[bool]) -> Optional[bool]:
    """``native=True`` where the compiled path is not built fails here, not per connection."""
    if native not in (None, True, False):
        raise ValueError(f"native must be None, True or False, got {native!r}")
    if native and _shmfast is None:
        raise TransportError("shm:// native=True, but the compiled fast path (transport/_shmfast.c) "
                             "is not built here: `make deps` builds it (it needs gcc and python3-dev)")
    return native


class ShmListener(Listener):
    def __init__(self, name: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
                 timeout: float = DEFAULT_TIMEOUT, backlog: int = 128, secret: Any = None,
                 max_peer_slot_size: Optional[int] = None, max_peer_nslots: Optional[int] = None,
                 allowed_gids: Sequence[int] = (), fast: bool = True, native: Optional[bool] = None):
        if slot_size <= 0 or nslots <= 0:
            raise ValueError("slot_size and nslots must be positive")
        self.secret = hs.as_secret(secret)
        self.limits = hs.Limits.for_endpoint(slot_size, nslots, max_slot_size=max_peer_slot_size,
                                             max_nslots=max_peer_nslots)
        self.allowed_gids = tuple(allowed_gids)
        self.fast = fast
        self.native = _check_native(native)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(_sock_name(name))
            self.sock.listen(backlog)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self.slot_size, self.nslots, self.timeout = slot_size, nslots, timeout
        self.url = f"shm://{name}"
        self._n = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept_pending(self) -> Optional[hs.Pending]:
        got = hs.accept_socket(self.sock, self.url)
        if got is None:
            return None
        sock = got[0]
        self._n += 1
        url = f"{self.url}#{self._n}"
        gen = _handshake(sock, "server", url, self.slot_size, self.nslots, self.timeout, self.limits,
                         self.secret, self.allowed_gids, self.fast, self.native)
        return hs.Pending(gen, sock, url)

    def close(self) -> None:
        self.sock.close()


def listen(address: str, **options: Any) -> ShmListener:
    """Listen on ``shm://address`` (options: slot_size, nslots, timeout, secret,
    max_peer_slot_size, max_peer_nslots, allowed_gids, fast: offer the fixed-width fast
    record, used when the peer offers it too; False keeps every message msgpack-framed;
    native: fast records through the compiled path, transport/_shmfast.c -- None (the
    default) when it is built, True to require it, False for the Python path; either end
    may choose either, the bytes are the same)."""
    return ShmListener(address, **options)


def connect(address: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
            timeout: float = DEFAULT_TIMEOUT, secret: Any = None, max_peer_slot_size: Optional[int] = None,
            max_peer_nslots: Optional[int] = None, allowed_gids: Sequence[int] = (),
            fast: bool = True, native: Optional[bool] = None) -> ShmConnection:
    """Connect to ``shm://address``; blocks (bounded by ``timeout``) on the handshake
    (``fast``, ``native``: as for :func:`listen`)."""
    if slot_size <= 0 or nslots <= 0:
        raise ValueError("slot_size and nslots must be positive")
    native = _check_native(native)
    secret = hs.as_secret(secret)
    limits = hs.Limits.for_endpoint(slot_size, nslots, max_slot_size=max_peer_slot_size,
                                    max_nslots=max_peer_nslots)
    deadline = Deadline(timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        try:
            sock.settimeout(deadline.remaining())
            sock.connect(_sock_name(address))
        except socket.timeout:
            raise Timeout(f"connecting to shm://{address}") from None
        except OSError as e:
            raise ConnectionClosed(f"cannot connect to shm://{address}: {e}") from None
        sock.setblocking(False)
        gen = _handshake(sock, "client", f"shm://{address}", slot_size, nslots, timeout, limits, secret,
                         tuple(allowed_gids), fast, native)
        return hs.run(gen, sock.fileno(), deadline, "in the shm handshake")
    except BaseException:
        sock.close()
        raise
