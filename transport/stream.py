"""Receive and send machinery shared by byte-stream backends (tcp today).

The receive side is a scatter reader: it keeps a queue of memoryviews to fill (the
prefix, then the header, then the payload *inside a pool slot*, then a read-ahead of the
next prefix) and fills them with one ``recvmsg_into`` per wake-up, so the payload goes
from the kernel straight into registered memory and a ping-pong costs two syscalls.
"""
from __future__ import annotations

import collections
import select
import socket
from typing import Any, Optional, Sequence

from . import framing
from .base import Connection, ConnectionStats, Deadline, Message, closed_error
from .errors import ConnectionClosed, ProtocolError, Timeout
from .framing import Kind
from .pool import BufferPool, Slot

_IOV_MAX = 1024


def wait_fd(fd: int, events: int, deadline: Deadline, what: str) -> None:
    p = select.poll()
    p.register(fd, events)
    while True:
        left = deadline.check(what)
        if p.poll(left * 1000.0 + 0.5):
            return


def sendmsg_all(sock: socket.socket, views: list, deadline: Deadline, on_wait=None) -> int:
    """Send a gather list completely (looping on partial sends) before the deadline."""
    total = sum(v.nbytes for v in views)
    sent_total = 0
    while views:
        try:
            n = sock.sendmsg(views[:_IOV_MAX])
        except (BlockingIOError, InterruptedError):
            n = 0
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise ConnectionClosed(f"send failed: {e}") from None
        sent_total += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views:
            if n:
                views[0] = views[0][n:]
            if on_wait is not None:
                on_wait()  # drain the peer while our socket is full: no mutual blocking
            wait_fd(sock.fileno(), select.POLLOUT | select.POLLIN, deadline, "sending")
    return total


class StreamConnection(Connection):
    """A message connection over a connected stream socket, after the handshake."""

    def __init__(self, sock: socket.socket, url: str, recv_pool: BufferPool, peer: dict,
                 *, default_timeout: float, max_header: int = framing.MAX_HEADER):
        self.url = url
        self.sock = sock
        self.default_timeout = default_timeout
        self.stats = ConnectionStats()
        self.recv_pool = recv_pool
        self.max_message = int(peer["slot_size"])
        self.send_pool = BufferPool(self.max_message, int(peer["nslots"]), name=f"send:{url}")
        self.peer = peer
        self._credits = int(peer["nslots"])  # messages the peer can still take
        self._owed = 0  # credits we released but have not returned yet
        self._owe_flush = max(1, recv_pool.nslots // 2)
        self._inbox: collections.deque = collections.deque()
        self._closed = False
        self._peer_gone: Optional[str] = None
        self._dec = framing.FrameDecoder(max_header=max_header, max_payload=recv_pool.slot_size)
        self._hdr = bytearray(max_header)
        self._segs: collections.deque = collections.deque()  # [role, view] still to fill
        self._prefix = bytearray(framing.PREFIX_SIZE)
        self._slot: Optional[Slot] = None
        self._push_prefix()

    # -- receive --------------------------------------------------------------
    def _push_prefix(self) -> None:
        # the previous prefix was decoded when it completed, so one buffer serves all
        self._segs.append(["prefix", memoryview(self._prefix)])

    def _fill(self) -> bool:
        """One non-blocking read into the pending segments; False if nothing was there."""
        views = [s[1] for s in self._segs]
        try:
            n = self.sock.recvmsg_into(views)[0]
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:  # reset: what was already read is still delivered
            self._peer_gone = f"connection reset ({e})"
            return False
        if n == 0:
            self._peer_gone = "peer closed the connection"
            return False
        self.stats.bytes_received += n
        while n:
            seg = self._segs[0]
            k = min(n, seg[1].nbytes)
            n -= k
            if k < seg[1].nbytes:
                seg[1] = seg[1][k:]
                break
            self._segs.popleft()
            self._complete(seg[0])
        return True

    def _complete(self, role: str) -> None:
        dec = self._dec
        try:
            if role == "prefix":
                dec.prefix(self._prefix)
                if dec.state == "header":
                    if dec.kind == Kind.DATA and dec.payload_len:
                        slot = self.recv_pool.try_alloc()
                        if slot is None:
                            raise ProtocolError("peer sent beyond its credits")
                        self._slot = slot.resize(dec.payload_len)
                    self._segs.append(["header", memoryview(self._hdr)[: dec.header_len]])
                    if self._slot is not None:
                        self._segs.append(["payload", self._slot.buf])
                    self._push_prefix()
                    return
                self._frame_done()
                self._push_prefix()
            elif role == "header":
                dec.header_bytes(memoryview(self._hdr)[: dec.header_len])
                if dec.state == "done":
                    self._frame_done()
            else:
                dec.payload()
                self._frame_done()
        except ProtocolError:
            self._abort()
            raise

    def _frame_done(self) -> None:
        dec = self._dec
        kind = dec.kind
        if kind == Kind.DATA:
            slot, self._slot = self._slot, None
            if isinstance(dec.extra, int) and dec.extra > 0:
                self._credits += dec.extra  # credits piggybacked on data
            bufs, off = [], 0
            base = slot.buf if slot is not None else memoryview(b"")
            for n in dec.lens:
                bufs.append(base[off : off + n])
                off += n
            self.stats.messages_received += 1
            self._inbox.append(Message(dec.header, bufs, self._releaser(slot)))
        elif kind == Kind.CREDIT:
            self._credits += dec.payload_len
        elif kind == Kind.CLOSE:
            self._peer_gone = "peer closed the connection"
        else:
            raise ProtocolError("unexpected HELLO after the handshake")
        dec.reset()

    def _releaser(self, slot: Optional[Slot]):
        def release() -> None:
            if slot is not None and not self._closed:
                slot.release()
            self._owed += 1
            if self._owed >= self._owe_flush:
                self._flush_credits()
        return release

    def _flush_credits(self) -> None:
        if self._owed and not self._closed and self._peer_gone is None:
            n, self._owed = self._owed, 0
            try:
                sendmsg_all(self.sock, [memoryview(framing.frame_credit(n))], Deadline(self.default_timeout))
            except ConnectionClosed:
                pass  # the receive side reports the loss

    def _lost(self, why: str):
        self._peer_gone = why
        raise closed_error(self, why)

    def _pump(self) -> None:
        """Read everything that is already there (never blocks)."""
        while self._fill():
            pass

    def _pump_one(self) -> None:
        """Read until one message is complete or nothing more is there (never blocks).
        Stopping at the first message saves the syscall that would only say EAGAIN."""
        while not self._inbox and self._fill():
            pass

    def pending(self) -> bool:
        return bool(self._inbox)

    def recv(self, timeout: Optional[float] = None) -> Message:
        if self._inbox:
            return self._inbox.popleft()
        self._check_open()
        deadline = Deadline(timeout, self.default_timeout)
        self._flush_credits()  # about to wait: make sure the peer is not waiting on us
        while True:
            if self._peer_gone is None:
                self._pump_one()
            if self._inbox:
                return self._inbox.popleft()
            if self._peer_gone is not None:
                raise closed_error(self, self._peer_gone)
            wait_fd(self.sock.fileno(), select.POLLIN, deadline, "waiting for a message")

    # -- send -----------------------------------------------------------------
    def alloc(self, nbytes: int, timeout: Optional[float] = None) -> Slot:
        self._check_open()
        if nbytes > self.max_message:
            raise ValueError(f"{nbytes} bytes exceed the peer's largest message ({self.max_message})")
        slot = self.send_pool.try_alloc()
        if slot is None:  # tcp frees send slots as soon as they are sent: the caller holds them all
            raise Timeout(f"all {self.send_pool.nslots} send slots are held by the caller")
        return slot.resize(nbytes)

    def _stage(self, buffers: Sequence) -> tuple[list, list]:
        views, slots = [], []
        for b in buffers:
            if isinstance(b, Slot) and b.pool is self.send_pool:
                slots.append(b)
                views.append(b.buf)
                continue
            mv = memoryview(b).cast("B")
            s = self.alloc(mv.nbytes)
            s.buf[:] = mv  # an unregistered buffer: staged through a slot, and counted
            self.stats.copies += 1
            slots.append(s)
            views.append(s.buf)
        return views, slots

    def send(self, header: Any, buffers: Sequence = (), timeout: Optional[float] = None) -> None:
        self._check_open()
        if self._peer_gone is not None:
            raise closed_error(self, self._peer_gone)
        deadline = Deadline(timeout, self.default_timeout)
        views, slots = self._stage(buffers)
        try:
            total = sum(v.nbytes for v in views)
            if total > self.max_message:
                raise ValueError(f"message of {total} bytes exceeds the peer's limit of {self.max_message}")
            if self._credits <= 0:
                self.stats.credit_stalls += 1
                while self._credits <= 0:
                    self._pump()
                    if self._credits > 0:
                        break
                    if self._peer_gone is not None:
                        raise closed_error(self, self._peer_gone)
                    wait_fd(self.sock.fileno(), select.POLLIN, deadline, "waiting for credits")
            owed, self._owed = self._owed, 0
            frame = framing.frame_data(header, views, owed or None)
            gather = [memoryview(frame[0]), memoryview(frame[1]), *views]
            sendmsg_all(self.sock, gather, deadline, on_wait=self._pump)
            self._credits -= 1
            self.stats.messages_sent += 1
            self.stats.bytes_sent += total
        finally:
            for s in slots:
                s.release()

    def _send_raw(self, frame: bytes) -> None:
        sendmsg_all(self.sock, [memoryview(frame)], Deadline(self.default_timeout))

    # -- lifecycle ------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionClosed(f"{self.url}: connection is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        return self.sock.fileno() if not self._closed else -1

    def _abort(self) -> None:
        if not self._closed:
            self._closed = True
            self.sock.close()

    def close(self) -> None:
        if self._closed:
            return
        if self._peer_gone is None:
            try:
                self.sock.send(framing.frame_close(), socket.MSG_DONTWAIT)
            except OSError:
                pass
        self._closed = True
        self._inbox.clear()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._segs.clear()
        if self._slot is not None:
            self._slot = None
