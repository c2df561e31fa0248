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
from .base import (DEFAULT_NSLOTS, DEFAULT_SLOT_SIZE, DEFAULT_TIMEOUT, Connection, ConnectionStats,
                   Deadline, Listener, Message, closed_error)
from .errors import ConnectionClosed, ProtocolError, Timeout
from .framing import Kind
from .pool import BufferPool, Slot, buffer_address, round_up
from .shmring import (W_ARMED_DATA, W_ARMED_SPACE, W_RUNG, Doorbell, Fence, Layout,
                      RecordReader, RecordWriter, ReturnReader, ReturnWriter, Segment, pow2,
                      ring_bell)

__all__ = ["ShmConnection", "ShmListener", "connect", "listen"]

SOCK_PREFIX = "\0moe-transport/shm/"
# a record holds at most a prefix and a MAX_HEADER header; twice that always fits the ring
MAX_RECORD = framing.PREFIX_SIZE + framing.MAX_HEADER + 64
RING_BYTES = pow2(2 * MAX_RECORD + 64)  # 256 KiB
MAX_RING = 64 << 20
SPIN = 30e-6  # busy-poll this long before sleeping: on 2 cores a longer spin steals a core
NAP = 0.005  # the longest sleep between re-checks: the safety net under the fence
_DATA = int(Kind.DATA)
_CLOSE = int(Kind.CLOSE)
_PREFIX = framing.PREFIX
_MAGIC, _VERSION = framing.MAGIC, framing.VERSION
_FD_MSG = b"F"
_pack = msgpack.Packer(use_bin_type=True).pack


def _sock_name(name: str) -> str:
    if not name or len(SOCK_PREFIX) + len(name.encode()) > 107:
        raise ValueError(f"shm name must be 1..{107 - len(SOCK_PREFIX)} bytes, got {name!r}")
    return SOCK_PREFIX + name


# -- handshake ----------------------------------------------------------------------
def _recv_exact(sock: socket.socket, n: int, deadline: Deadline) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(deadline.check("in the shm handshake"))
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            raise Timeout("timed out in the shm handshake") from None
        except OSError as e:
            raise ConnectionClosed(f"shm handshake failed: {e}") from None
        if not chunk:
            raise ConnectionClosed("peer closed during the shm handshake")
        buf += chunk
    return bytes(buf)


def _handshake(sock: socket.socket, url: str, slot_size: int, nslots: int, timeout: float,
               deadline: Deadline) -> "ShmConnection":
    """Symmetric: HELLO both ways, create our segment for the peer's limits, swap fds."""
    ours = {"transport": "moe-transport", "version": framing.VERSION, "backend": "shm",
            "slot_size": slot_size, "nslots": nslots, "ring_bytes": RING_BYTES}
    try:
        sock.settimeout(deadline.check("in the shm handshake"))
        sock.sendall(b"".join(framing.encode_hello(ours)))
        kind, hlen, _ = framing.decode_prefix(_recv_exact(sock, framing.PREFIX_SIZE, deadline))
        if kind != Kind.HELLO:
            raise ProtocolError(f"expected a handshake, got frame kind {kind}")
        peer = framing.decode_hello(_recv_exact(sock, hlen, deadline))
        if peer.get("transport") != "moe-transport" or peer.get("backend") != "shm":
            raise ProtocolError("peer is not a moe-transport shm endpoint")
        for key in ("slot_size", "nslots"):
            v = peer.get(key)
            if not isinstance(v, int) or not 0 < v < 1 << 40:
                raise ProtocolError(f"handshake field {key}={v!r} is invalid")
        p_slot, p_nslots = peer["slot_size"], peer["nslots"]
        layout = Layout(RING_BYTES, pow2(max(p_nslots, 2)), p_slot, p_nslots, round_up(p_slot))
        seg, seg_fd = Segment.create(layout)
    except socket.timeout:
        raise Timeout("timed out in the shm handshake") from None
    except (BrokenPipeError, ConnectionResetError) as e:
        raise ConnectionClosed(f"shm handshake failed: {e}") from None
    peer_seg = None
    bell = None
    fds: list = []
    try:
        bell = Doorbell(sock.fileno())
        try:
            socket.send_fds(sock, [_FD_MSG], [seg_fd, bell.fd])
        except socket.timeout:
            raise Timeout("timed out in the shm handshake") from None
        except OSError as e:
            raise ConnectionClosed(f"shm handshake failed: {e}") from None
        finally:
            os.close(seg_fd)
        while True:
            sock.settimeout(deadline.check("in the shm handshake"))
            try:
                msg, fds, _flags, _addr = socket.recv_fds(sock, 16, 4)
            except socket.timeout:
                raise Timeout("timed out in the shm handshake") from None
            except OSError as e:
                raise ConnectionClosed(f"shm handshake failed: {e}") from None
            if not msg:
                raise ConnectionClosed("peer closed during the shm handshake")
            break
        if msg != _FD_MSG or len(fds) != 2:
            raise ProtocolError("bad fd message in the shm handshake")
        peer_seg = Segment.attach(fds[0], slot_size=slot_size, nslots=nslots,
                                  max_ring=MAX_RING, min_ring=2 * MAX_RECORD)
        os.close(fds[0])
        peer_bell = fds[1]
        fds = []
        sock.setblocking(False)
        return ShmConnection(url, sock, seg, peer_seg, bell, peer_bell, slot_size, nslots,
                             default_timeout=timeout)
    except BaseException:
        for fd in fds:
            os.close(fd)
        if peer_seg is not None:
            peer_seg.close()
        if bell is not None:
            bell.close()
        seg.close()
        raise


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
        self._fence = Fence()
        # receive side: read-only views into the peer's pool (the sender's very slots)
        self._recv_slot_size, self._recv_nslots = slot_size, nslots
        self._recv_stride = peer_seg.layout.stride
        self._recv_mem = peer_seg.pool_mem.toreadonly()
        self._ranges = [(buffer_address(s.mem), len(s.mem)) for s in (peer_seg, seg)]
        self._rung_sent = self._pw[W_RUNG]
        self._rung_seen = self._w[W_RUNG]
        self._closed = False
        self._peer_gone: Optional[str] = None
        self._w[W_ARMED_DATA] = 1  # outside recv a Poller may be sleeping on fileno()
        self._w[W_ARMED_SPACE] = 0

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
            data = b""
            why = f"peer connection reset ({e})"
        else:
            why = "peer closed the connection" if not data else "peer wrote to the control socket"
        if self._peer_gone is None:
            self._peer_gone = why

    # -- receive --------------------------------------------------------------------
    def pending(self) -> bool:
        if self._closed:
            return False
        if self._in.ready():
            return True
        self._clear_bell()  # a stale ring would make the fd readable with nothing to read
        return False

    def recv(self, timeout: Optional[float] = None) -> Message:
        if self._closed:
            raise ConnectionClosed(f"{self.url}: connection is closed")
        try:
            rec = self._in.pop()
            if rec is None:
                rec = self._wait_record(timeout)
            return self._decode(rec)
        except ProtocolError:
            self._abort()
            raise

    def _wait_record(self, timeout: Optional[float]) -> bytes:
        deadline = Deadline(timeout, self.default_timeout)
        pop, w = self._in.pop, self._w
        if deadline.remaining() > 0 and self._peer_gone is None:
            w[W_ARMED_DATA] = 0  # spinning: the peer need not ring
            end = time.perf_counter() + SPIN
            while time.perf_counter() < end:
                rec = pop()
                if rec is not None:
                    w[W_ARMED_DATA] = 1
                    return rec
            w[W_ARMED_DATA] = 1
        while True:
            self._fence()  # armed (store) before the ring is re-read (load): Dekker
            rec = pop()
            if rec is not None:
                return rec
            if self._peer_gone is not None:
                raise closed_error(self, self._peer_gone)
            if deadline.expired():
                self._bell.wait(0) and self._check_socket()
                if self._peer_gone is None:
                    raise Timeout("timed out waiting for a message")
                continue
            self._sleep(deadline)

    def _decode(self, rec: bytes) -> Message:
        if len(rec) < 16:
            raise ProtocolError(f"ring record of {len(rec)} bytes is shorter than a prefix")
        kind, hlen, plen = framing.decode_prefix(rec[:16], max_payload=self._recv_slot_size)
        self._space_freed()
        if kind == _DATA:
            if len(rec) != 16 + hlen:
                raise ProtocolError("shm DATA record carries inline bytes")
            user, lens, extra = framing.decode_header(rec[16:], plen)
            nb = len(lens)
            if type(extra) is not list or len(extra) != 2 * nb:
                raise ProtocolError("shm DATA record without slot descriptors")
            bufs = []
            ids = []
            mem, stride, size, nslots = self._recv_mem, self._recv_stride, self._recv_slot_size, self._recv_nslots
            for i in range(nb):
                s, off, n = extra[2 * i], extra[2 * i + 1], lens[i]
                if type(s) is not int or type(off) is not int or not 0 <= s < nslots \
                        or not 0 <= off <= size - n:
                    raise ProtocolError(f"buffer {i} outside the peer's slots: slot {s!r} offset {off!r}")
                base = s * stride + off
                bufs.append(mem[base : base + n])
                if s not in ids:
                    ids.append(s)
            st = self.stats
            st.messages_received += 1
            st.bytes_received += plen
            return Message(user, bufs, self._releaser(ids) if ids else None)
        if kind == _CLOSE:
            self._peer_gone = "peer closed the connection"
            raise closed_error(self, self._peer_gone)
        raise ProtocolError(f"unexpected {Kind(kind).name} frame on an shm ring")

    def _space_freed(self) -> None:
        """We consumed a record: wake the peer if it waits for ring space."""
        if self._pw[W_ARMED_SPACE]:
            self._fence()
            self._ring()

    def _releaser(self, ids: list):
        def release() -> None:
            if self._closed:
                return
            self._give_back.push(ids)
            self._fence()  # published the returns (store) before reading "armed" (load)
            if self._pw[W_ARMED_SPACE]:
                self._ring()
        return release

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
                self._fence()
                if ready():
                    return
                if self._peer_gone is not None:
                    raise closed_error(self, self._peer_gone)
                if deadline.expired():
                    self._bell.wait(0) and self._check_socket()
                    if self._peer_gone is not None:
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
        self._check_usable()
        if not 0 <= nbytes <= self.max_message:
            raise ValueError(f"{nbytes} bytes exceed the peer's largest message ({self.max_message})")
        return self._alloc_slot(Deadline(timeout, self.default_timeout)).resize(nbytes)

    def send(self, header: Any, buffers: Sequence = (), timeout: Optional[float] = None) -> None:
        pool = self.send_pool
        owned = [b for b in buffers if type(b) is Slot and b.pool is pool]
        try:
            self._check_usable()
            lens, extra, others = [], [], []
            for b in buffers:
                if type(b) is Slot and b.pool is pool:
                    lens.append(b.nbytes)
                    extra.append(b.index)
                    extra.append(0)
                else:
                    mv = memoryview(b)
                    if mv.ndim != 1 or mv.itemsize != 1:
                        mv = mv.cast("B")
                    others.append((len(lens), mv))
                    lens.append(mv.nbytes)
                    extra.append(-1)
                    extra.append(0)
            total = sum(lens)
            if total > self.max_message:
                raise ValueError(f"message of {total} bytes exceeds the peer's limit of {self.max_message}")
            if len(lens) > framing.MAX_BUFFERS:
                raise ValueError(f"{len(lens)} buffers exceed the limit of {framing.MAX_BUFFERS}")
            deadline = Deadline(timeout, self.default_timeout)
            if others:
                self._stage(others, extra, owned, deadline)
            try:  # not framing.encode_header: it turns a None header into {}
                head = _pack([header, lens, extra])
            except (TypeError, ValueError, OverflowError) as e:
                raise TypeError(f"header is not msgpack-serialisable: {e}") from None
            if len(head) > framing.MAX_HEADER:
                raise ValueError(f"header of {len(head)} bytes exceeds the limit of {framing.MAX_HEADER}")
            prefix = _PREFIX.pack(_MAGIC, _VERSION, _DATA, len(head), total)
            old = self._out.push(prefix, head)
            if old is None:
                self._wait_space(lambda: self._peer_gone is None and self._out.push(prefix, head) is not None
                                 or False, deadline, "waiting for ring space")
                old = -1  # the ring was full, so the peer is not idle: no need to ring
        except BaseException:
            for s in owned:  # the slots belong to the transport even when send raises
                s.release()
            raise
        self._fence()  # published the tail (store) before reading "armed" (load)
        if self._pw[W_ARMED_DATA] and old >= 0 and self._out.empty_for_peer(old):
            self._ring()
        st = self.stats
        st.messages_sent += 1
        st.bytes_sent += total

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
        self._fence()
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
                    self._fence()
                    self._ring()
            except ProtocolError:
                pass
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # the peer's poll sees HUP now
        except OSError:
            pass
        self._sock.close()
        self._bell.close()
        os.close(self._peer_bell)
        self.send_pool._slots = []
        try:
            self.send_pool.memory.release()
        except BufferError:
            pass
        try:
            self._recv_mem.release()
        except BufferError:
            pass
        self._peer_seg.close()
        self._seg.close()


# -- listener and connect -----------------------------------------------------------
class ShmListener(Listener):
    def __init__(self, name: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
                 timeout: float = DEFAULT_TIMEOUT, backlog: int = 128):
        if slot_size <= 0 or nslots <= 0:
            raise ValueError("slot_size and nslots must be positive")
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

    def accept(self, timeout: Optional[float] = None) -> ShmConnection:
        deadline = Deadline(timeout, self.timeout)
        import select
        p = select.poll()
        p.register(self.sock.fileno(), select.POLLIN)
        while True:
            try:
                sock, _ = self.sock.accept()
                break
            except (BlockingIOError, InterruptedError):
                p.poll(deadline.check("waiting for a connection") * 1000.0 + 0.5)
        self._n += 1
        try:
            # a client that never says hello must not stall the listener for long
            hs = Deadline(min(deadline.remaining() or 1.0, 5.0))
            return _handshake(sock, f"{self.url}#{self._n}", self.slot_size, self.nslots, self.timeout, hs)
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        self.sock.close()


def listen(address: str, **options: Any) -> ShmListener:
    """Listen on ``shm://address`` (options: slot_size, nslots, timeout)."""
    return ShmListener(address, **options)


def connect(address: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
            timeout: float = DEFAULT_TIMEOUT) -> ShmConnection:
    """Connect to ``shm://address``; blocks (bounded by ``timeout``) on the handshake."""
    if slot_size <= 0 or nslots <= 0:
        raise ValueError("slot_size and nslots must be positive")
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
        return _handshake(sock, f"shm://{address}", slot_size, nslots, timeout, deadline)
    except BaseException:
        sock.close()
        raise
