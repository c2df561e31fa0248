"""shm://name — same-host transport through shared memory: the payload is never copied.

Each side creates one segment (transport/shmring.py) holding its send pool, sized to what
the peer accepts, its outgoing record ring and the ring its slots come back on. A Unix
socket in the abstract namespace ("\\0moe-transport/shm/<name>") carries the handshake --
HELLO both ways, then the segment fd and the doorbell eventfd (SCM_RIGHTS) -- and then
stays open only so that its HUP tells either side, within a poll, that the peer is gone
(a SIGKILL included).

send writes one small record (framing prefix + msgpack [header, lens, extra]) where
``extra`` is ``[slot, offset, slot, offset, ...]`` per buffer; the receiver checks it and
hands out memoryviews straight into the sender's slots. Releasing the message pushes the
slot ids onto the return ring: that return is the credit. Unregistered buffers are staged
into one send slot (packed, one copy each, counted).
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
from .base import (DEFAULT_NSLOTS, DEFAULT_SLOT_SIZE, DEFAULT_TIMEOUT, Connection, ConnectionStats,
                   Deadline, Listener, Message, closed_error)
from .errors import AcceptFailed, ConnectionClosed, ProtocolError, Refused, Timeout
from .framing import Kind
from .pool import BufferPool, Slot, buffer_address, round_up
from .shmring import (REC_HDR, W_ARMED_DATA, W_ARMED_SPACE, W_OUT_HEAD, W_OUT_TAIL, W_RUNG, Doorbell, Fence, Layout,
                      RecordReader, RecordWriter, ReturnReader, ReturnWriter, Segment, pow2,
                      ring_bell)

__all__ = ["ShmConnection", "ShmListener", "connect", "listen"]

SOCK_PREFIX = "\0moe-transport/shm/"
# a record holds at most a prefix and a MAX_HEADER header; twice that always fits the ring
MAX_RECORD = framing.PREFIX_SIZE + framing.MAX_HEADER + 64
RING_BYTES = pow2(2 * MAX_RECORD + 64)  # 256 KiB
MAX_RING = 64 << 20
SPIN = 50e-6  # busy-poll this long before sleeping: on 2 cores a longer spin steals a core
SPIN_MIN = 5e-6  # an idle connection's spin shrinks to this
NAP = 0.005  # the longest sleep between re-checks: the safety net under the fence
_DATA = int(Kind.DATA)
_CLOSE = int(Kind.CLOSE)
_PREFIX = framing.PREFIX
_MAGIC, _VERSION = framing.MAGIC, framing.VERSION
_FD_MSG = b"F"
_CRED = struct.Struct("3i")
_pack = msgpack.Packer(use_bin_type=True).pack
_unpackb = msgpack.unpackb
# The hot-path record: ring length word, framing prefix, then the msgpack header
# [user, [len], [slot, 0]] written as fixarray(3) + packed user header + a fixed tail
# (fixarray(1), uint64 len, fixarray(2), uint32 slot, 0): valid msgpack that any decoder
# reads, and that the receiver recognises with two struct unpacks.
_WHEAD = struct.Struct("<I4x2sBBIQB")  # 25 bytes: what send() writes before the user header
_RHEAD = struct.Struct("<IIQB")  # the same prefix read back: magic|version|kind as one u32
_TAIL = struct.Struct(">HQHIB")  # msgpack is big-endian
_TAIL_SIZE = _TAIL.size  # 17
_T1, _T2 = 0x91CF, 0x92CE
_TAG_DATA = struct.unpack("<I", framing.encode_prefix(Kind.DATA, 0, 0)[:4])[0]
_FAST_MIN = 16 + 1 + 1 + _TAIL_SIZE  # prefix, fixarray, the smallest user header, tail
_MAX_HEADER, _MAX_BUFFERS = framing.MAX_HEADER, framing.MAX_BUFFERS


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
               limits: hs.Limits, secret: Optional[bytes], allowed_gids: Sequence[int]) -> hs.HandshakeGen:
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
                          limits=limits, secret=secret, validate=_validate)
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
                             default_timeout=timeout)
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


class _ShmMessage(Message):
    """A Message whose release returns its slots without a per-message closure."""

    __slots__ = ("_conn", "_ids")

    def __init__(self, header: Any, buffers: list, conn: "ShmConnection", ids):
        self.header = header
        self.buffers = buffers
        self._on_release = None
        self.released = False
        self._conn = conn
        self._ids = ids  # one slot id (int), or a list of them

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        for b in self.buffers:
            b.release()
        self.buffers = []
        self._conn._give_back_slots(self._ids)


# -- the connection -----------------------------------------------------------------
class ShmConnection(Connection):
    """One shm connection after the handshake (used by one thread at a time)."""

    def __init__(self, url: str, sock: socket.socket, seg: Segment, peer_seg: Segment,
                 bell: Doorbell, peer_bell: int, slot_size: int, nslots: int,
                 *, default_timeout: float = DEFAULT_TIMEOUT):
        self.url = url
        self.default_timeout = default_timeout
        self.stats = ConnectionStats()
        self._sock = sock
        self._seg, self._peer_seg = seg, peer_seg
        self._bell, self._peer_bell = bell, peer_bell
        lay = seg.layout
        self.max_message = lay.slot_size  # what the peer accepts (our pool is sized to it)
        self.send_pool = BufferPool(lay.slot_size, lay.nslots, buffer=seg.pool_mem, name=f"send:{url}")
        self._w = seg.words  # our control words
        self._pw = peer_seg.words  # the peer's
        self._out = RecordWriter(seg.ring, seg.words)
        self._in = RecordReader(peer_seg.ring, peer_seg.words)
        self._returns = ReturnReader(seg.ret, seg.words)
        self._give_back = ReturnWriter(peer_seg.ret, peer_seg.words)
        fence = Fence()
        self._acq, self._rel = fence._lock.acquire, fence._lock.release  # inlined: hot path
        # receive side: read-only views into the peer's pool (the sender's very slots)
        self._recv_slot_size, self._recv_nslots = slot_size, nslots
        self._recv_stride = peer_seg.layout.stride
        self._recv_mem = peer_seg.pool_mem.toreadonly()
        self._ranges = [(buffer_address(s.mem), len(s.mem)) for s in (peer_seg, seg)]
        self._rung_sent = self._pw[W_RUNG]
        self._rung_seen = self._w[W_RUNG]
        self._spin = SPIN
        self._closed = False
        self._peer_gone: Optional[str] = None
        self._usable = True  # not closed and the peer not gone: one test on the hot path
        self._w[W_ARMED_DATA] = 1  # outside recv a Poller may be sleeping on fileno()
        self._w[W_ARMED_SPACE] = 0

    def _gone(self, why: str) -> None:
        if self._peer_gone is None:
            self._peer_gone = why
        self._usable = False

    # -- doorbell -------------------------------------------------------------------
    def _ring(self) -> None:
        ring_bell(self._peer_bell)
        self._rung_sent += 1
        self._pw[W_RUNG] = self._rung_sent  # after the write: a reader that sees it may clear

    def _clear_bell(self) -> None:
        rung = self._w[W_RUNG]
        if rung != self._rung_seen:
            self._bell.clear()
            self._rung_seen = rung

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
            self._gone(f"peer connection reset ({e})")
            return
        self._gone("peer closed the connection" if not data else "peer wrote to the control socket")

    # -- receive --------------------------------------------------------------------
    def pending(self) -> bool:
        if self._closed:
            return False
        if self._in.ready():
            return True
        self._clear_bell()  # a stale ring would make the fd readable with nothing to read
        # look again: a record pushed after the first look may have rung the bell we just
        # cleared (the sender rings after pushing), and nobody would announce it again
        return self._in.ready()

    def send_ready(self) -> bool:
        if not self._usable:
            return False
        if not self.send_pool.available and not self._returns.ready():
            return False
        return self._out.room() >= 2 * (REC_HDR + MAX_RECORD)  # room for any record, padding included

    def recv(self, timeout: Optional[float] = None) -> Message:
        if self._closed:
            raise ConnectionClosed(f"{self.url}: connection is closed")
        inr = self._in
        try:
            n = inr.peek()
            if n < 0:
                n = self._wait_record(timeout)
            p = inr.pos
            data = inr.data
            try:
                # the common record, as send() writes it: [header, [len], [slot, 0]] with
                # fixed-width ints; anything else takes the general path, same checks
                if n >= _FAST_MIN:
                    tag, hlen, plen, arr = _RHEAD.unpack_from(data, p)
                    q = p + n - _TAIL_SIZE
                    if tag == _TAG_DATA and arr == 0x93 and n == 16 + hlen and hlen <= _MAX_HEADER:
                        t1, k, t2, s, z = _TAIL.unpack_from(data, q)
                        if t1 == _T1 and t2 == _T2 and z == 0 and k == plen \
                                and k <= self._recv_slot_size and s < self._recv_nslots:
                            try:
                                user = _unpackb(data[p + 17 : q], strict_map_key=False)
                            except Exception:
                                pass  # not exactly one object: the general path says why
                            else:
                                st = self.stats
                                st.messages_received += 1
                                st.bytes_received += k
                                base = s * self._recv_stride
                                return _ShmMessage(user, [self._recv_mem[base : base + k]], self, s)
                return self._decode(p, n)
            finally:
                inr.advance()  # the record is parsed into Python objects: free its space
                # re-armed only now: a sender that saw us spinning, or saw the record
                # consumed already, does not ring (see send)
                self._w[W_ARMED_DATA] = 1
                if self._pw[W_ARMED_SPACE]:  # the peer waits for ring space
                    self._ring()
                if self._w[W_RUNG] != self._rung_seen:  # we were rung for this record:
                    self._clear_bell()  # unread, the fd would stay readable for a Poller
        except ProtocolError:
            self._abort()
            raise

    def _wait_record(self, timeout: Optional[float]) -> int:
        """Busy-poll briefly, then sleep on the doorbell; the length of the next record.

        The spin adapts: it stays long while messages keep arriving within it, and halves
        (down to SPIN_MIN) each time a wait had to sleep for longer than the spin could
        have covered, so an idle connection costs little CPU; a wait that slept but ended
        soon after the spin would have, restores it."""
        deadline = Deadline(timeout, self.default_timeout)
        inr, w, pw = self._in, self._w, self._pw
        if timeout != 0 and self._usable:
            head = inr.head
            clock = time.perf_counter
            start = clock()
            end = start + self._spin
            w[W_ARMED_DATA] = 0  # spinning: the peer need not ring
            while pw[W_OUT_TAIL] == head and clock() < end:
                pass
            if pw[W_OUT_TAIL] != head:
                return inr.peek()  # recv re-arms once the record is consumed
            w[W_ARMED_DATA] = 1
        else:
            start = 0.0
        while True:
            self._acq()  # full fence: "armed" (store) before the ring is re-read (load)
            self._rel()
            n = inr.peek()
            if n >= 0:
                if start:
                    waited = time.perf_counter() - start
                    self._spin = SPIN if waited < 4 * SPIN else max(SPIN_MIN, self._spin / 2)
                return n
            if not self._usable:
                if self._closed:
                    raise ConnectionClosed(f"{self.url}: connection is closed")
                raise closed_error(self, self._peer_gone)
            if deadline.expired():
                self._bell.wait(0) and self._check_socket()
                if self._usable:
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

    def _decode(self, p: int, n: int) -> Message:
        """Parse and check any record at ``ring[p:p+n]`` in place; views into the slots."""
        data = self._in.data
        if n < 16:
            raise ProtocolError(f"ring record of {n} bytes is shorter than a prefix")
        magic, ver, kind, hlen, plen = _PREFIX.unpack_from(data, p)
        if magic != _MAGIC or ver != _VERSION or kind != _DATA or not 0 < hlen <= _MAX_HEADER \
                or plen > self._recv_slot_size or n != 16 + hlen:
            return self._odd_record(bytes(data[p : p + 16]), n)
        try:
            obj = _unpackb(data[p + 16 : p + n], strict_map_key=False)
        except Exception as e:  # msgpack raises several unrelated types on garbage
            raise ProtocolError(f"undecodable header: {e}") from None
        if type(obj) is not list or len(obj) != 3:
            raise ProtocolError("header is not [user_header, lengths, extra]")
        user, lens, extra = obj
        if type(lens) is not list or type(extra) is not list or len(extra) != 2 * len(lens):
            raise ProtocolError("shm DATA record without slot descriptors")
        if len(lens) > _MAX_BUFFERS:
            raise ProtocolError(f"{len(lens)} buffers exceed the limit of {_MAX_BUFFERS}")
        mem, stride, size, nslots = self._recv_mem, self._recv_stride, self._recv_slot_size, self._recv_nslots
        bufs, ids, total = [], [], 0
        for i, k in enumerate(lens):
            s, off = extra[2 * i], extra[2 * i + 1]
            if type(k) is not int or type(s) is not int or type(off) is not int or k < 0 \
                    or not 0 <= s < nslots or not 0 <= off <= size - k:
                raise ProtocolError(f"buffer {i} ({k!r} B) outside the peer's slots: slot {s!r} offset {off!r}")
            total += k
            base = s * stride + off
            bufs.append(mem[base : base + k])
            if s not in ids:
                ids.append(s)
        if total != plen:
            for b in bufs:
                b.release()
            raise ProtocolError(f"buffer lengths sum to {total}, prefix says {plen}")
        st = self.stats
        st.messages_received += 1
        st.bytes_received += plen
        return _ShmMessage(user, bufs, self, ids)

    def _odd_record(self, prefix: bytes, n: int) -> Message:
        """Not a plain DATA record: CLOSE, or garbage explained by framing's own checks."""
        kind, hlen, _ = framing.decode_prefix(prefix, max_payload=self._recv_slot_size)
        if kind == _CLOSE:
            self._gone("peer closed the connection")
            raise closed_error(self, self._peer_gone)
        if kind == _DATA:
            raise ProtocolError(f"shm DATA record of {n} bytes for a {hlen}-byte header")
        raise ProtocolError(f"unexpected {Kind(kind).name} frame on an shm ring")

    def _give_back_slots(self, ids) -> None:
        """A message was released: its slots go back to the sender, which is the credit."""
        if self._closed:
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
        ids = self._returns.drain()
        if not ids:
            return False
        free = self.send_pool.free
        for i in ids:
            try:
                free(i)
            except ValueError as e:
                self._abort()
                raise ProtocolError(f"peer returned a slot it did not have: {e}") from None
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
                if not self._usable:
                    self._check_usable()
                if deadline.expired():
                    self._bell.wait(0) and self._check_socket()
                    if not self._usable:
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
                self.stats.credit_stalls += 1
                self._wait_space(lambda: self._take_returns() and pool.available > 0, deadline,
                                 "waiting for the peer to release a slot")
                slot = pool.try_alloc()
        return slot

    def alloc(self, nbytes: int, timeout: Optional[float] = None) -> Slot:
        if not self._usable:
            self._check_usable()
        if not 0 <= nbytes <= self.max_message:
            raise ValueError(f"{nbytes} bytes exceed the peer's largest message ({self.max_message})")
        slot = self.send_pool.try_alloc()
        if slot is None:
            slot = self._alloc_slot(Deadline(timeout, self.default_timeout))
        slot.nbytes = nbytes
        return slot

    def send(self, header: Any, buffers: Sequence = (), timeout: Optional[float] = None) -> None:
        if len(buffers) == 1:
            b = buffers[0]
            if b.__class__ is Slot and b.pool is self.send_pool and self._usable:
                # the hot path: one slot from alloc(), packed straight into the ring
                try:
                    uh = _pack(header)
                except Exception as e:
                    b.release()  # the slot belongs to the transport even when send raises
                    raise TypeError(f"header is not msgpack-serialisable: {e}") from None
                k = b.nbytes
                luh = len(uh)
                hlen = luh + 18
                reclen = 16 + hlen
                out = self._out
                if hlen <= _MAX_HEADER and (pos := out.reserve(REC_HDR + ((reclen + 7) & ~7))) >= 0:
                    data = out.data
                    _WHEAD.pack_into(data, pos, reclen, _MAGIC, _VERSION, _DATA, hlen, k, 0x93)
                    data[pos + 25 : pos + 25 + luh] = uh
                    _TAIL.pack_into(data, pos + 25 + luh, _T1, k, _T2, b.index, 0)
                    old = out.commit()
                    self._acq()  # full fence: the tail (store) before "armed", head (loads)
                    self._rel()
                    if self._pw[W_ARMED_DATA] and out.words[W_OUT_HEAD] == old:
                        self._ring()  # armed, and it had taken all but our record
                    st = self.stats
                    st.messages_sent += 1
                    st.bytes_sent += k
                    return
                head = b"\x93" + uh + _TAIL.pack(_T1, k, _T2, b.index, 0)
                self._send_head(head, k, [b], timeout, None)
                return
        self._send_general(header, buffers, timeout)

    def _send_general(self, header: Any, buffers: Sequence, timeout: Optional[float]) -> None:
        pool = self.send_pool
        owned = [b for b in buffers if type(b) is Slot and b.pool is pool]
        try:
            if not self._usable:
                self._check_usable()
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
        out = self._out
        try:
            if not self._usable:
                self._check_usable()
            hlen = len(head)
            if hlen > _MAX_HEADER:
                raise ValueError(f"header of {hlen} bytes exceeds the limit of {_MAX_HEADER}")
            prefix = framing.encode_prefix(_DATA, hlen, total)
            old = out.push(prefix, head)
            if old is None:
                self._wait_space(lambda: self._usable and out.push(prefix, head) is not None,
                                 deadline or Deadline(timeout, self.default_timeout),
                                 "waiting for ring space")
                old = -1  # the ring was full, so the peer is busy: no need to ring
        except BaseException:
            for s in owned:
                s.release()
            raise
        self._acq()  # full fence: the tail (store) before "armed" and the head (loads)
        self._rel()
        if self._pw[W_ARMED_DATA] and old >= 0 and out.empty_for_peer(old):
            self._ring()
        st = self.stats
        st.messages_sent += 1
        st.bytes_sent += total

    def _describe(self, buffers: Sequence, owned: list, deadline: Deadline) -> tuple:
        """lens and slot descriptors of a general message, unregistered buffers staged."""
        pool = self.send_pool
        lens, extra, others = [], [], []
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
        if total > self.max_message:
            raise ValueError(f"message of {total} bytes exceeds the peer's limit of {self.max_message}")
        if len(lens) > _MAX_BUFFERS:
            raise ValueError(f"{len(lens)} buffers exceed the limit of {_MAX_BUFFERS}")
        if others:
            self._stage(others, extra, owned, deadline)
        return lens, extra, total

    def _stage(self, others: list, extra: list, owned: list, deadline: Deadline) -> None:
        """Copy unregistered buffers into send slots, packed (64-byte aligned) into as few
        slots as they fit: one copy per buffer, counted."""
        slot, used = None, 0
        size = self.max_message
        for i, mv in others:
            n = mv.nbytes
            if slot is None or used + n > size:
                slot = self._alloc_slot(deadline)
                owned.append(slot)
                used = 0
            slot.whole[used : used + n] = mv
            extra[2 * i] = slot.index
            extra[2 * i + 1] = used
            used = round_up(used + n)
            self.stats.copies += 1

    def _send_raw(self, frame: bytes) -> None:
        if self._out.push(frame) is None:
            raise Timeout("ring full")
        self._acq()
        self._rel()
        self._ring()

    # -- lifecycle ------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise ConnectionClosed(f"{self.url}: connection is closed")
        if self._peer_gone is not None:
            raise closed_error(self, self._peer_gone)

    def in_registered_memory(self, buf) -> bool:
        mv = memoryview(buf)
        if mv.nbytes == 0:
            return True
        a = buffer_address(mv)
        return any(lo <= a and a + mv.nbytes <= lo + n for lo, n in self._ranges)

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        return self._bell.ep.fileno() if not self._closed else -1

    def abort(self) -> None:
        self._teardown(goodbye=False)

    def _abort(self) -> None:
        self._teardown(goodbye=False)

    def close(self) -> None:
        self._teardown(goodbye=True)

    def _teardown(self, goodbye: bool) -> None:
        if self._closed:
            return
        if goodbye and self._peer_gone is None:
            try:
                if self._out.push(framing.frame_close()) is not None:
                    self._acq()
                    self._rel()
                    self._ring()
            except ProtocolError:
                pass
        self._closed = True
        self._usable = False
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # the peer's poll sees HUP now
        except OSError:
            pass
        self._sock.close()
        self._bell.close()
        os.close(self._peer_bell)
        # drop every view of the segments we made, so that the mappings (and the fds mmap
        # keeps) go now; one the application still exports (a numpy array over a slot or an
        # unreleased message) keeps its mapping alive until it is gone
        for v in [s._mem for s in self.send_pool._slots] + [self.send_pool.memory, self._recv_mem]:
            try:
                v.release()
            except BufferError:
                pass
        self.send_pool._slots = []
        self._peer_seg.close()
        self._seg.close()


# -- listener and connect -----------------------------------------------------------
class ShmListener(Listener):
    def __init__(self, name: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
                 timeout: float = DEFAULT_TIMEOUT, backlog: int = 128, secret: Any = None,
                 max_peer_slot_size: Optional[int] = None, max_peer_nslots: Optional[int] = None,
                 allowed_gids: Sequence[int] = ()):
        if slot_size <= 0 or nslots <= 0:
            raise ValueError("slot_size and nslots must be positive")
        self.secret = hs.as_secret(secret)
        self.limits = hs.Limits.for_endpoint(slot_size, nslots, max_slot_size=max_peer_slot_size,
                                             max_nslots=max_peer_nslots)
        self.allowed_gids = tuple(allowed_gids)
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
        try:
            got = hs.accept_socket(self.sock)
        except OSError as e:
            raise AcceptFailed(f"{self.url}: accept failed: {e}", e.errno) from None
        if got is None:
            return None
        sock = got[0]
        self._n += 1
        url = f"{self.url}#{self._n}"
        gen = _handshake(sock, "server", url, self.slot_size, self.nslots, self.timeout, self.limits,
                         self.secret, self.allowed_gids)
        return hs.Pending(gen, sock, url)

    def close(self) -> None:
        self.sock.close()


def listen(address: str, **options: Any) -> ShmListener:
    """Listen on ``shm://address`` (options: slot_size, nslots, timeout, secret,
    max_peer_slot_size, max_peer_nslots, allowed_gids)."""
    return ShmListener(address, **options)


def connect(address: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
            timeout: float = DEFAULT_TIMEOUT, secret: Any = None, max_peer_slot_size: Optional[int] = None,
            max_peer_nslots: Optional[int] = None, allowed_gids: Sequence[int] = ()) -> ShmConnection:
    """Connect to ``shm://address``; blocks (bounded by ``timeout``) on the handshake."""
    if slot_size <= 0 or nslots <= 0:
        raise ValueError("slot_size and nslots must be positive")
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
                         tuple(allowed_gids))
        return hs.run(gen, sock.fileno(), deadline, "in the shm handshake")
    except BaseException:
        sock.close()
        raise
