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
import struct
import time
from typing import Any, Optional, Sequence

import msgpack

from . import framing
from . import handshake as hs
from .base import (BROKEN, DEFAULT_NSLOTS, DEFAULT_SLOT_SIZE, DEFAULT_TIMEOUT, OPEN, CompiledPath, Connection,
                   ConnectionStats, Deadline, Listener, Message)
from .errors import ConnectionClosed, ProtocolError, Refused, Timeout, TransportError
from .framing import CLOSE as _CLOSE
from .framing import DATA as _DATA
from .framing import (CAP_SHM_FAST, FAST_HEAD, FAST_SIZE, MAX_FAST_RECORD, SLOT_OVERHEAD, TAG_FAST,
                      pack_slot_frame, parse_fast_record, parse_record, parse_slot_record, slot_header,
                      unpack_fast_user)
from .pool import BufferPool, Slot, buffer_address, describe_buffers, round_up, stage_buffers
from .shmring import (REC_HDR, W_ARMED_DATA, W_ARMED_SPACE, W_OUT_HEAD, W_OUT_TAIL, W_RET_HEAD, W_RET_TAIL, W_RUNG,
                      W_RUNG_AT, Cursors, Doorbell, Fence, Layout, RecordReader, RecordWriter, ReturnReader,
                      ReturnWriter, Segment, pow2, ring_bell)
from .timing import SHM_NAP, SHM_SPIN, SHM_SPIN_MIN

try:  # the compiled fast path (setup.py builds it; without it every message takes the Python path)
    from . import _shmfast
except ImportError:  # no compiler where this was installed
    _shmfast = None

__all__ = ["ShmConnection", "ShmListener", "connect", "listen", "NATIVE_AVAILABLE"]

#: whether transport/_shmfast.c is built here (connections use it unless ``native=False``)
NATIVE_AVAILABLE = _shmfast is not None

SOCK_PREFIX = "\0moe-transport/shm/"
# a record holds at most a prefix and a MAX_HEADER header; twice that always fits the ring
MAX_RECORD = framing.PREFIX_SIZE + framing.MAX_HEADER + 64
RING_BYTES = pow2(2 * MAX_RECORD + 64)  # 256 KiB
MAX_RING = 64 << 20
SPIN, SPIN_MIN, NAP = SHM_SPIN, SHM_SPIN_MIN, SHM_NAP  # the historical names
_FD_MSG = b"F"
_CRED = struct.Struct("3i")
_pack = msgpack.Packer(use_bin_type=True).pack
_REC_LEN = struct.Struct("<I")  # the ring's record length word (transport/shmring.py)
_MAX_HEADER, _MAX_BUFFERS = framing.MAX_HEADER, framing.MAX_BUFFERS
_MAX_RECORD_LEN = framing.PREFIX_SIZE + _MAX_HEADER  # the longest one-slot record the fast path writes
# the ring's record header (u32 length, u32 spare) and framing's fast record, packed in one go
_FAST_REC = struct.Struct("<II" + FAST_HEAD.format.lstrip("<"))
_FAST_OFF = REC_HDR + FAST_SIZE  # where the user header starts, from the record header


def _sock_name(name: str) -> str:
    if not name or len(SOCK_PREFIX) + len(name.encode()) > 107:
        raise ValueError(f"shm name must be 1..{107 - len(SOCK_PREFIX)} bytes, got {name!r}")
    return SOCK_PREFIX + name


# -- handshake ----------------------------------------------------------------------
def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def check_credentials(creds: tuple[int, int, int], allowed_gids: Sequence[int]) -> None:
    """Refused unless the peer runs as our user (or root), or its group is allowed: a
    second local user can neither reach a service over shm nor pose as one."""
    pid, uid, gid = creds
    if uid in (os.getuid(), 0) or gid in allowed_gids:
        return
    raise Refused(f"shm peer (pid {pid}, uid {uid}, gid {gid}) is not this user "
                  f"(uid {os.getuid()}) and not in an allowed group {sorted(allowed_gids)}")


def _validate(peer: dict) -> None:
    ring = peer.get("ring_bytes")
    if type(ring) is not int or ring & (ring - 1) or not 2 * MAX_RECORD <= ring <= MAX_RING:
        raise ProtocolError(f"handshake field ring_bytes={ring!r} is invalid")


def _send_fds(sock: socket.socket, fds: list) -> hs.HandshakeGen:
    while True:
        try:
            socket.send_fds(sock, [_FD_MSG], fds, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            return
        except (BlockingIOError, InterruptedError):
            yield hs.WRITE
        except OSError as e:
            raise ConnectionClosed(f"shm handshake failed: {e}") from None


def _recv_fds(sock: socket.socket) -> hs.HandshakeGen:
    """The peer's [segment fd, doorbell fd]; anything else is closed and refused."""
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 16, 2, socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
            break
        except (BlockingIOError, InterruptedError):
            yield hs.READ
        except OSError as e:
            raise ConnectionClosed(f"shm handshake failed: {e}") from None
    if msg != _FD_MSG or len(fds) != 2:
        for fd in fds:
            os.close(fd)
        if not msg:
            raise ConnectionClosed("peer closed during the shm handshake")
        raise ProtocolError("bad fd message in the shm handshake")
    return fds


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


# -- the connection -----------------------------------------------------------------
class _SlotMessage(Message):
    """A one-slot message (the fast record, or the fixed-tail one): its token is the slot id,
    and releasing it returns that slot straight into the peer's return ring."""

    __slots__ = ()

    def __init__(self, header: Any, buffers: list, conn: "ShmConnection", slot: int):
        self.header = header
        self.buffers = buffers
        self.released = False
        self._conn = conn
        self._token = slot

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        bufs = self.buffers
        self.buffers = []
        for b in bufs:
            b.release()
        conn = self._conn
        self._conn = None
        if conn is None or conn._state >= BROKEN:
            return
        link = conn._link
        if link is not None:  # compiled: the same push and wake-up check
            if link.give_back(self._token):
                conn._release_failed(ProtocolError("more slots returned than the peer has"))
            return
        # the slot goes back: ReturnWriter.push_one and the wake-up check inlined (a
        # corrupted return ring makes the connection BROKEN; release never raises)
        gb, pw, cur = conn._give_back, conn._pw, conn._cur
        tail = cur.ret_tail
        if tail - pw[W_RET_HEAD] >= gb.cap:
            conn._release_failed(ProtocolError("more slots returned than the peer has"))
            return
        gb.ids[tail & gb.mask] = self._token
        cur.ret_tail = tail = tail + 1
        pw[W_RET_TAIL] = tail
        conn._acq()  # full fence: the return published (store) before "armed" is read (load)
        conn._rel()
        if pw[W_ARMED_SPACE]:
            conn._ring()


class _NativeSlotMessage(_SlotMessage):
    """A one-slot message the compiled path made: the same fields, and its ``release`` is
    the compiled version of _SlotMessage.release (installed below when the module is built)."""

    __slots__ = ()


if _shmfast is not None:
    _NativeSlotMessage.release = _shmfast.bind(_NativeSlotMessage, ProtocolError, BROKEN, Slot, _pack)


class ShmConnection(CompiledPath, Connection):
    """One shm connection after the handshake (used by one thread at a time)."""

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

    # -- receive --------------------------------------------------------------------
    def pending(self) -> bool:
        if self._state >= BROKEN:
            return self._error is not None  # a ProtocolError for recv to raise
        if self._in.ready():
            return True
        self._clear_bell()  # a stale ring would make the fd readable with nothing to read
        # look again: a record pushed after the first look may have rung the bell we just
        # cleared (the sender rings after pushing), and nobody would announce it again
        return self._in.ready()

    def send_ready(self) -> bool:
        if self._state:
            return False
        if not self.send_pool.available and not self._returns.ready():
            return False
        return self._out.room() >= 2 * (REC_HDR + MAX_RECORD)  # room for any record, padding included

    def _recv_py(self, timeout: Optional[float] = None) -> Message:
        if self._state >= BROKEN:
            raise self._closed_error()
        inr = self._in
        pw = self._pw
        try:
            link = self._link
            if link is not None:  # compiled: a fast record in one call (None: anything else)
                m = link.recv(self)
                if m is not None:
                    return m
                if pw[W_OUT_TAIL] == link.in_head:
                    self._wait_record(timeout)  # returns once a record is there
                    m = link.recv(self)
                    if m is not None:
                        return m
            cur = self._cur
            head = cur.in_head
            tail = pw[W_OUT_TAIL]
            if tail == head:
                self._wait_record(timeout)  # returns once a record is there
                tail = pw[W_OUT_TAIL]
            if self._fast:
                # the negotiated fixed-width record, read in place: the ring checks of
                # RecordReader.peek inlined for the one shape it can have (anything else,
                # padding included, takes the general path below, which says what is wrong)
                pos = head & inr.mask
                n = self._in32[pos >> 2]
                need = (n + 15) & ~7  # REC_HDR + n rounded up to 8
                cap = inr.cap
                if n <= MAX_FAST_RECORD and need <= tail - head <= cap and pos + need <= cap:
                    fast = parse_fast_record(inr.data, pos + REC_HDR, n, self._recv_slot_size, self._recv_nslots)
                    if fast is not None:
                        cur.in_head = inr.next_head = head = head + need
                        pw[W_OUT_HEAD] = head  # the record is parsed: its space goes back
                        w = self._w
                        w[W_ARMED_DATA] = 1  # re-armed only now (see below)
                        if pw[W_ARMED_SPACE]:
                            self._ring()
                        if w[W_RUNG] != self._cur.rung_seen:
                            self._clear_bell()
                        # _one_slot_message inlined: this is the hot path, a call costs here
                        user, s, k = fast
                        st = self._stats
                        st.messages_received += 1
                        st.bytes_received += k
                        base = s * self._recv_stride
                        return _SlotMessage(user, [self._recv_mem[base : base + k]], self, s)
            n = inr.peek()
            p = inr.pos
            try:
                # the one-slot msgpack record (framing's fixed-tail form, what a peer without
                # the fast capability sends); anything else takes the general path, same checks
                fast = parse_slot_record(inr.data, p, n, self._recv_slot_size, self._recv_nslots)
                if fast is None and self._fast:  # a fast record after ring padding
                    fast = parse_fast_record(inr.data, p, n, self._recv_slot_size, self._recv_nslots)
                if fast is not None:
                    return self._one_slot_message(*fast)
                return self._decode(p, n)
            finally:
                inr.advance()  # the record is parsed into Python objects: free its space
                # re-armed only now: a sender that saw us spinning, or saw the record
                # consumed already, does not ring (see send)
                self._w[W_ARMED_DATA] = 1
                if self._pw[W_ARMED_SPACE]:  # the peer waits for ring space
                    self._ring()
                if self._w[W_RUNG] != self._cur.rung_seen:  # we were rung for this record:
                    self._clear_bell()  # unread, the fd would stay readable for a Poller
        except ProtocolError as e:
            self._abort(f"protocol error: {e}")
            raise

    def _wait_record(self, timeout: Optional[float]) -> None:
        """Busy-poll briefly, then sleep on the doorbell, until a record is there.

        The spin adapts: it stays long while messages keep arriving within it, and halves
        (down to SPIN_MIN) each time a wait had to sleep for longer than the spin could
        have covered, so an idle connection costs little CPU; a wait whose record came soon
        after the spin would have caught it restores it. When the record came is the peer's
        ring time if it says (W_RUNG_AT): on a loaded machine the wake-up itself can take
        milliseconds, and counting those would keep the spin short exactly when every
        sleep is expensive."""
        inr, w, pw = self._in, self._w, self._pw
        if timeout != 0 and not self._state:
            head = inr.head
            clock = time.perf_counter
            start = clock()
            end = start + self._spin
            w[W_ARMED_DATA] = 0  # spinning: the peer need not ring
            # the clock is read once per 16 looks at the tail: a look costs a fraction of
            # a clock call, and how soon a record is seen is the latency
            spins = self._spins
            while True:
                for _ in spins:
                    if pw[W_OUT_TAIL] != head:
                        return  # recv reads it, and re-arms once it is consumed
                if clock() >= end:
                    break
            w[W_ARMED_DATA] = 1
        else:
            start = 0.0
        deadline = Deadline(timeout, self.default_timeout)
        while True:
            self._acq()  # full fence: "armed" (store) before the ring is re-read (load)
            self._rel()
            n = inr.peek()
            if n >= 0:
                if start:
                    now = time.perf_counter()  # CLOCK_MONOTONIC, like the peer's ring time
                    rung = w[W_RUNG_AT] * 1e-9
                    waited = (rung if start <= rung <= now else now) - start
                    self._spin = SPIN if waited < 4 * SPIN else max(SPIN_MIN, self._spin / 2)
                return
            if self._state:
                raise self._closed_error()
            if deadline.expired():
                self._bell.wait(0) and self._check_socket()
                if not self._state:
                    # Woken with nothing to read: the peer's eventfd write can reach us before
                    # its W_RUNG store (a 2-core scheduler may run us in between, for ms), so
                    # _clear_bell would not clear, and a level-triggered poller would spin on
                    # the fd. Clear it, then look once more: a record that raced in is returned
                    # (its ring may be the one just cleared), so no wake-up is lost.
                    self._bell.clear()
                    self._acq()
                    self._rel()
                    if inr.peek() >= 0:
                        continue
                    raise Timeout("timed out waiting for a message")
                continue
            self._sleep(deadline)

    def _one_slot_message(self, user: Any, s: int, k: int) -> Message:
        """The message of a one-slot record: ``k`` bytes of receive slot ``s``, where they landed."""
        st = self._stats
        st.messages_received += 1
        st.bytes_received += k
        base = s * self._recv_stride
        return _SlotMessage(user, [self._recv_mem[base : base + k]], self, s)

    def _decode(self, p: int, n: int) -> Message:
        """Any record at ``ring[p:p+n]`` (framing.parse_record checks it); views into the slots."""
        kind, user, lens, extra, plen = parse_record(self._in.data, p, n, self._recv_slot_size,
                                                     self._recv_nslots)
        if kind == _CLOSE:
            self._to_peer_gone("peer closed the connection")
            raise self._closed_error()
        mem, stride = self._recv_mem, self._recv_stride
        bufs, ids = [], []
        for i, k in enumerate(lens):
            s = extra[2 * i]
            base = s * stride + extra[2 * i + 1]
            bufs.append(mem[base : base + k])
            if s not in ids:
                ids.append(s)
        st = self._stats
        st.messages_received += 1
        st.bytes_received += plen
        return Message(user, bufs, None, self, ids)

    def _release_message(self, ids) -> None:
        """A message was released: its slots go back to the sender, which is the credit.
        A ProtocolError here (the peer corrupted its return ring's head) is turned by
        Message.release into BROKEN, raised by our next recv/send."""
        if self._state >= BROKEN:
            return
        if ids.__class__ is int:
            self._give_back.push_one(ids)
        elif ids:
            self._give_back.push(ids)
        else:
            return
        self._acq()  # full fence: returns published (store) before "armed" is read (load)
        self._rel()
        if self._pw[W_ARMED_SPACE]:
            self._ring()

    # -- send -----------------------------------------------------------------------
    def _take_returns(self) -> bool:
        """Our slots the peer gave back, into the pool: ProtocolError (and BROKEN) for ids
        it never had, ids returned twice, or a corrupted return ring."""
        try:
            ids = self._returns.drain()
        except ProtocolError as e:
            self._abort(f"protocol error: {e}")
            raise
        if not ids:
            return False
        free, in_use, nslots = self._free, self._in_use, len(self._in_use)
        for i in ids:  # BufferPool.free inlined, same checks
            if i < nslots and in_use[i]:
                in_use[i] = False
                free.append(i)
            else:
                why = f"slot {i} out of range 0..{nslots - 1}" if i >= nslots else f"slot {i} freed twice"
                self._abort(f"protocol error: peer returned a slot it did not have: {why}")
                raise ProtocolError(f"peer returned a slot it did not have: {why}")
        return True

    def _wait_space(self, ready, deadline: Deadline, what: str) -> None:
        """Wait (bounded) until ``ready()``; the peer rings us while W_ARMED_SPACE is set."""
        w = self._w
        w[W_ARMED_SPACE] = 1
        try:
            while True:
                self._acq()  # full fence: "armed" (store) before the re-check (loads)
                self._rel()
                if ready():
                    return
                if self._state:
                    raise self._closed_error()
                if deadline.expired():
                    self._bell.wait(0) and self._check_socket()
                    if self._state:
                        continue
                    raise Timeout(f"timed out {what}")
                self._sleep(deadline)
        finally:
            w[W_ARMED_SPACE] = 0

    def _alloc_slot(self, deadline: Deadline) -> Slot:
        pool = self.send_pool
        slot = pool.try_alloc()
        if slot is None:
            if not self._take_returns() or (slot := pool.try_alloc()) is None:
                self._stats.credit_stalls += 1
                self._wait_space(lambda: self._take_returns() and pool.available > 0, deadline,
                                 "waiting for the peer to release a slot")
                slot = pool.try_alloc()
        return slot

    def _alloc_py(self, nbytes: int, timeout: Optional[float] = None) -> Slot:
        link = self._link
        if link is not None:  # compiled: returns taken, the last freed slot (None: wait or raise below)
            slot = link.alloc(self, nbytes)
            if slot is not None:
                return slot
        free = self._free
        # returns first, so the slot given back last is the one reused: the slots in flight
        # stay the working set (taken only when the pool ran dry, a sender would write every
        # slot once, faulting each one in, before it came back to the first; see
        # docs/design.md#the-last-slot-returned-is-the-next-one-written)
        if not self._state and self._w[W_RET_TAIL] != self._cur.ret_head:
            self._take_returns()
        if free and not self._state and 0 <= nbytes <= self.max_message:
            i = free.pop()  # BufferPool.try_alloc inlined: last freed, first reused
            self._in_use[i] = True
            slot = self._slots[i]
            slot.nbytes = nbytes
            return slot
        if self._state:
            raise self._closed_error()
        if not 0 <= nbytes <= self.max_message:
            raise ValueError(f"{nbytes} bytes exceed the peer's largest message ({self.max_message})")
        slot = self.send_pool.try_alloc(nbytes)
        if slot is None:
            slot = self._alloc_slot(Deadline(timeout, self.default_timeout))
            slot.nbytes = nbytes
        return slot

    def _send_py(self, header: Any, buffers: Sequence = (), timeout: Optional[float] = None) -> None:
        link = self._link  # (a call with keywords comes here first: the compiled path takes it too)
        if link is not None and not link.send_message(self, header, buffers):
            return  # compiled: a one-slot message as a fast record (-1: the paths below)
        if len(buffers) == 1:
            b = buffers[0]
            if b.__class__ is Slot and b.pool is self.send_pool and not self._state:
                # the hot path: one slot from alloc(), packed straight into the ring
                if self._fast:
                    if header.__class__ is dict and not header:
                        uh = b""  # the fast record's {}: no header bytes at all
                        n = FAST_SIZE
                    else:
                        try:
                            uh = _pack(header)
                        except Exception as e:
                            b.release()  # the slot belongs to the transport even when send raises
                            raise TypeError(f"header is not msgpack-serialisable: {e}") from None
                        n = FAST_SIZE + len(uh)
                        if n > MAX_FAST_RECORD:
                            self._send_slot(uh, b, timeout)
                            return
                    # RecordWriter.reserve and commit inlined for a record that fits
                    # without padding (nearly always); anything else goes the long way
                    out = self._out
                    need = (n + 15) & ~7  # REC_HDR + n rounded up to 8
                    cur = self._cur
                    old = cur.out_tail
                    pos = old & out.mask
                    w = self._w
                    if pos + need > out.cap or not 0 <= old - w[W_OUT_HEAD] <= out.cap - need:
                        self._send_fast_slow(uh, n, b, timeout)
                        return
                    cur.out_tail = new = old + need
                    k = b.nbytes
                    data = out.data
                    _FAST_REC.pack_into(data, pos, n, 0, TAG_FAST, b.index, k)
                    if uh:
                        data[pos + _FAST_OFF : pos + REC_HDR + n] = uh
                    w[W_OUT_TAIL] = new  # publish: x86-TSO orders it after the record's bytes
                    self._acq()  # full fence: the tail (store) before "armed", head (loads)
                    self._rel()
                    if self._pw[W_ARMED_DATA] and w[W_OUT_HEAD] == old:
                        self._ring()  # armed, and it had taken all but our record
                    st = self._stats
                    st.messages_sent += 1
                    st.bytes_sent += k
                    return
                try:
                    uh = _pack(header)
                except Exception as e:
                    b.release()
                    raise TypeError(f"header is not msgpack-serialisable: {e}") from None
                self._send_slot(uh, b, timeout)
                return
        self._send_general(header, buffers, timeout)

    # the public names; where the compiled path is built they are replaced (below the class)
    # by its methods, which take the common message with no Python frame and hand anything
    # else to these
    recv, alloc, send = _recv_py, _alloc_py, _send_py

    def _send_fast_slow(self, uh: bytes, n: int, b: Slot, timeout: Optional[float]) -> None:
        """The fast record when the ring needs padding first, or is full (then wait for room)."""
        out = self._out
        k = b.nbytes
        try:
            pos = out.reserve((n + 15) & ~7)
        except ProtocolError as e:  # the peer corrupted the ring's head
            self._abort(f"protocol error: {e}")
            raise
        if pos < 0:  # the ring is full: wait for room like any record
            self._send_record(FAST_HEAD.pack(TAG_FAST, b.index, k), uh, k, [b], timeout, None)
            return
        data = out.data
        _FAST_REC.pack_into(data, pos, n, 0, TAG_FAST, b.index, k)
        if uh:
            data[pos + _FAST_OFF : pos + REC_HDR + n] = uh
        old = out.commit()
        self._acq()  # full fence: the tail (store) before "armed", head (loads)
        self._rel()
        if self._pw[W_ARMED_DATA] and out.words[W_OUT_HEAD] == old:
            self._ring()
        st = self._stats
        st.messages_sent += 1
        st.bytes_sent += k

    def _send_slot(self, uh: bytes, b: Slot, timeout: Optional[float]) -> None:
        """The fixed-tail msgpack record for slot ``b`` (a peer without the fast record)."""
        k = b.nbytes
        out = self._out
        reclen = SLOT_OVERHEAD + len(uh)
        try:
            pos = out.reserve(REC_HDR + ((reclen + 7) & ~7)) if reclen <= _MAX_RECORD_LEN else -1
        except ProtocolError as e:  # the peer corrupted the ring's head
            self._abort(f"protocol error: {e}")
            raise
        if pos < 0:
            self._send_head(slot_header(uh, k, b.index), k, [b], timeout, None)
            return
        data = out.data
        _REC_LEN.pack_into(data, pos, reclen)
        pack_slot_frame(data, pos + REC_HDR, uh, k, b.index)
        old = out.commit()
        self._acq()  # full fence: the tail (store) before "armed", head (loads)
        self._rel()
        if self._pw[W_ARMED_DATA] and out.words[W_OUT_HEAD] == old:
            self._ring()  # armed, and it had taken all but our record
        st = self._stats
        st.messages_sent += 1
        st.bytes_sent += k

    def _send_general(self, header: Any, buffers: Sequence, timeout: Optional[float]) -> None:
        pool = self.send_pool
        owned = [b for b in buffers if type(b) is Slot and b.pool is pool]
        try:
            if self._state:
                raise self._closed_error()
            deadline = Deadline(timeout, self.default_timeout)
            lens, extra, total = self._describe(buffers, owned, deadline)
            try:  # not framing.encode_header: it turns a None header into {}
                head = _pack([header, lens, extra])
            except Exception as e:
                raise TypeError(f"header is not msgpack-serialisable: {e}") from None
        except BaseException:
            for s in owned:  # the slots belong to the transport even when send raises
                s.release()
            raise
        self._send_head(head, total, owned, timeout, deadline)

    def _send_head(self, head: bytes, total: int, owned: list, timeout: Optional[float],
                   deadline: Optional[Deadline]) -> None:
        """Write the record prefix + ``head``, waiting (bounded) for ring space."""
        hlen = len(head)
        if hlen > _MAX_HEADER:
            for s in owned:
                s.release()
            raise ValueError(f"header of {hlen} bytes exceeds the limit of {_MAX_HEADER}")
        self._send_record(framing.encode_prefix(_DATA, hlen, total), head, total, owned, timeout, deadline)

    def _send_record(self, prefix: bytes, head: bytes, total: int, owned: list, timeout: Optional[float],
                     deadline: Optional[Deadline]) -> None:
        """Write the record ``prefix + head``, waiting (bounded) for ring space."""
        out = self._out
        try:
            if self._state:
                raise self._closed_error()
            old = out.push(prefix, head)
            if old is None:
                self._wait_space(lambda: not self._state and out.push(prefix, head) is not None,
                                 deadline or Deadline(timeout, self.default_timeout),
                                 "waiting for ring space")
                old = -1  # the ring was full, so the peer is busy: no need to ring
        except ProtocolError as e:  # the peer corrupted the ring's head
            self._abort(f"protocol error: {e}")
            raise
        except BaseException:
            for s in owned:
                s.release()
            raise
        self._acq()  # full fence: the tail (store) before "armed" and the head (loads)
        self._rel()
        if self._pw[W_ARMED_DATA] and old >= 0 and out.empty_for_peer(old):
            self._ring()
        st = self._stats
        st.messages_sent += 1
        st.bytes_sent += total

    def _describe(self, buffers: Sequence, owned: list, deadline: Deadline) -> tuple:
        """lens and slot descriptors of a general message, unregistered buffers staged."""
        lens, extra, others, total = describe_buffers(buffers, self.send_pool, self.max_message, _MAX_BUFFERS)
        if others:
            self._stats.copies += stage_buffers(others, extra, lambda: self._alloc_slot(deadline),
                                               self.max_message, owned)
        return lens, extra, total

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
