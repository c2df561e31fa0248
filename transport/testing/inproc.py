"""inproc://name -- both ends of a connection in one process: the transport's test double.

It is shm:// without shared memory or a second process, behind the same public API:

- each end has a send pool (a :class:`~transport.pool.BufferPool`) sized to what its peer
  accepts; ``alloc`` hands out its slots, and a received buffer is a read-only view of the
  sender's very slot (zero copy). Releasing the message gives the slots back, and that
  return is the credit: a sender with no slot left waits (bounded), as on shm;
- messages travel as framing records through a bounded queue and the receiver parses them
  with framing's shm parsers, so a raw frame injected by the conformance kit
  (transport.testing.raw) meets the production checks;
- ``fileno()`` is an eventfd, readable while a record waits or once the peer is gone;
- the lifecycle is transport/base.py's: a closing end's messages already queued are still
  delivered to the other end, then ConnectionClosed.

Registered in transport.registry as a test double (importing this module registers nothing
and starts nothing; a listener's name lives in a process-wide table until it is closed).
:data:`CAPABILITIES` says what it cannot do: reach another process.
"""
from __future__ import annotations

import collections
import itertools
import os
import threading
from typing import Any, Optional, Sequence

import msgpack

from transport import framing
from transport import handshake as hs
from transport.base import (BROKEN, DEFAULT_NSLOTS, DEFAULT_SLOT_SIZE, DEFAULT_TIMEOUT, OPEN, Connection,
                            ConnectionStats, Deadline, Listener, Message)
from transport.errors import AuthenticationError, ConnectionClosed, ProtocolError, Refused, Timeout, TransportError
from transport.pool import BufferPool, Slot, describe_buffers, stage_buffers

__all__ = ["CAPABILITIES", "InprocConnection", "InprocListener", "connect", "listen"]

#: what the conformance kit may not ask of this backend (transport.testing.conformance)
CAPABILITIES = {"cross_process": False}
#: records that may wait in one direction (shm bounds them by its ring's bytes)
MAX_QUEUED = 1024

_pack = msgpack.Packer(use_bin_type=True).pack
_LISTENERS: dict[str, "InprocListener"] = {}
_LISTENERS_LOCK = threading.Lock()
_ids = itertools.count(1)


def _bell(fd: int) -> None:
    os.eventfd_write(fd, 1)


def _unbell(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


class _Link:
    """What the two ends share: one lock (and condition) for both directions. Every access
    to the other end's queue, returns and eventfd happens under it."""

    def __init__(self) -> None:
        self.cond = threading.Condition()


class InprocConnection(Connection):
    def __init__(self, url: str, link: _Link, *, slot_size: int, nslots: int, peer_slot_size: int,
                 peer_nslots: int, timeout: float):
        self.url = url
        self.default_timeout = timeout
        self.stats = ConnectionStats()
        self._link = link
        self.max_message = peer_slot_size
        self.send_pool = BufferPool(peer_slot_size, peer_nslots, name=f"send:{url}")
        self._recv_slot_size, self._recv_nslots = slot_size, nslots
        self._queue: collections.deque = collections.deque()  # records for us
        self._returns: list = []  # our slots the peer gave back
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._peer: Optional[InprocConnection] = None
        self._torn = False

    def _pair(self, peer: "InprocConnection") -> None:
        self._peer = peer
        self._recv_mem = peer.send_pool.memory.toreadonly()  # the sender's slots, read-only
        self._recv_stride = peer.send_pool.stride
        self._peer_pool = peer.send_pool

    # -- receive ----------------------------------------------------------------------------
    def pending(self) -> bool:
        if self._state >= BROKEN:
            return self._error is not None
        return bool(self._queue)

    def recv(self, timeout: Optional[float] = None) -> Message:
        if self._state >= BROKEN:
            raise self._closed_error()
        deadline = Deadline(timeout, self.default_timeout)
        cond = self._link.cond
        with cond:
            while not self._queue:
                if self._state:
                    raise self._closed_error()
                left = deadline.remaining()
                if left <= 0:
                    raise Timeout("timed out waiting for a message")
                cond.wait(left)
            rec = self._queue.popleft()
            if not self._queue and self._state == OPEN:
                _unbell(self._efd)  # nothing left: the fd goes quiet
            cond.notify_all()  # a sender may wait for queue space
        try:
            return self._parse(rec)
        except ProtocolError as e:
            self._abort(f"protocol error: {e}")
            raise

    def _parse(self, rec: bytes) -> Message:
        n = len(rec)
        fast = framing.parse_slot_record(rec, 0, n, self._recv_slot_size, self._recv_nslots)
        if fast is not None:
            user, s, k = fast
            base = s * self._recv_stride
            bufs, ids, plen = [self._recv_mem[base:base + k]], [s], k
        else:
            kind, user, lens, extra, plen = framing.parse_record(rec, 0, n, self._recv_slot_size,
                                                                 self._recv_nslots)
            if kind == framing.CLOSE:
                self._to_peer_gone("peer closed the connection")
                raise self._closed_error()
            bufs, ids = [], []
            for i, k in enumerate(lens):
                s = extra[2 * i]
                base = s * self._recv_stride + extra[2 * i + 1]
                bufs.append(self._recv_mem[base:base + k])
                if s not in ids:
                    ids.append(s)
        st = self.stats
        st.messages_received += 1
        st.bytes_received += plen
        return Message(user, bufs, None, self, ids)

    def _release_message(self, ids: list) -> None:
        if self._state >= BROKEN or not ids:
            return
        peer = self._peer
        with self._link.cond:
            if not peer._torn:
                peer._returns.extend(ids)
                self._link.cond.notify_all()

    # -- send -------------------------------------------------------------------------------
    def in_registered_memory(self, buf) -> bool:
        return self.send_pool.contains(buf) or self._peer_pool.contains(buf)

    def send_ready(self) -> bool:
        if self._state:
            return False
        return bool(self.send_pool.available or self._returns) and len(self._peer._queue) < MAX_QUEUED

    def _take_returns(self) -> None:
        with self._link.cond:
            ids, self._returns = self._returns, []
        for i in ids:
            try:
                self.send_pool.free(i)
            except ValueError as e:
                self._abort(f"protocol error: peer returned a slot it did not have: {e}")
                raise ProtocolError(f"peer returned a slot it did not have: {e}") from None

    def _slot(self, nbytes: int, deadline: Deadline) -> Slot:
        """A send slot, waiting (bounded) for the peer to release one."""
        pool = self.send_pool
        stalled = False
        while True:
            if self._returns:
                self._take_returns()
            slot = pool.try_alloc(nbytes)
            if slot is not None:
                return slot
            if not stalled:
                self.stats.credit_stalls += 1
                stalled = True
            with self._link.cond:
                while not self._returns:
                    if self._state:
                        raise self._closed_error()
                    left = deadline.remaining()
                    if left <= 0:
                        raise Timeout("timed out waiting for the peer to release a slot")
                    self._link.cond.wait(left)

    def alloc(self, nbytes: int, timeout: Optional[float] = None) -> Slot:
        if self._state:
            raise self._closed_error()
        if not 0 <= nbytes <= self.max_message:
            raise ValueError(f"{nbytes} bytes exceed the peer's largest message ({self.max_message})")
        return self._slot(nbytes, Deadline(timeout, self.default_timeout))

    def send(self, header: Any, buffers: Sequence = (), timeout: Optional[float] = None) -> None:
        pool = self.send_pool
        owned = [b for b in buffers if type(b) is Slot and b.pool is pool]
        try:
            if self._state:
                raise self._closed_error()
            deadline = Deadline(timeout, self.default_timeout)
            rec, total = self._record(header, buffers, owned, deadline)
            self._push(rec, deadline)
        except BaseException:
            for s in owned:  # the slots belong to the transport even when send raises
                pool.put(s)
            raise
        st = self.stats
        st.messages_sent += 1
        st.bytes_sent += total

    def _record(self, header: Any, buffers: Sequence, owned: list, deadline: Deadline) -> tuple[bytes, int]:
        """The framing record for a message (one-slot fixed form when it is one of our
        slots, as shm's hot path writes), unregistered buffers staged into slots."""
        try:
            user = _pack(header)
        except Exception as e:
            raise TypeError(f"header is not msgpack-serialisable: {e}") from None
        if len(buffers) == 1 and owned:
            b = buffers[0]
            if framing.SLOT_OVERHEAD + len(user) - framing.PREFIX_SIZE > framing.MAX_HEADER:
                raise ValueError(f"header exceeds the limit of {framing.MAX_HEADER} bytes")
            rec = bytearray(framing.SLOT_OVERHEAD + len(user))
            framing.pack_slot_frame(rec, 0, user, b.nbytes, b.index)
            return bytes(rec), b.nbytes
        lens, extra, others, total = describe_buffers(buffers, self.send_pool, self.max_message,
                                                      framing.MAX_BUFFERS)
        head = _pack([header, lens, extra])
        if len(head) > framing.MAX_HEADER:
            raise ValueError(f"header of {len(head)} bytes exceeds the limit of {framing.MAX_HEADER}")
        if others:  # one copy per unregistered buffer, packed into as few slots as fit
            self.stats.copies += stage_buffers(others, extra, lambda: self._slot(-1, deadline), self.max_message,
                                               owned)
            head = _pack([header, lens, extra])
        return framing.encode_prefix(framing.DATA, len(head), total) + head, total

    def _push(self, rec: bytes, deadline: Optional[Deadline]) -> None:
        """Queue a record for the peer (waiting, bounded, while its queue is full)."""
        cond = self._link.cond
        peer = self._peer
        with cond:
            while True:
                if self._state:
                    raise self._closed_error()
                if len(peer._queue) < MAX_QUEUED:
                    break
                left = deadline.remaining() if deadline is not None else 0.0
                if left <= 0:
                    raise Timeout("timed out waiting for the peer to take its messages")
                cond.wait(left)
            peer._queue.append(rec)
            _bell(peer._efd)
            cond.notify_all()

    # -- lifecycle --------------------------------------------------------------------------
    def fileno(self) -> int:
        return self._efd if not self._torn else -1

    def _abort(self, why: str) -> None:
        self._to_broken(why)
        self._teardown()

    def close(self) -> None:
        self._to_closed()
        self._teardown()

    def _teardown(self) -> None:
        cond = self._link.cond
        with cond:
            if self._torn:
                return
            self._torn = True
            self._queue.clear()
            peer = self._peer
            if peer is not None and not peer._torn:
                peer._to_peer_gone("peer closed the connection")
                _bell(peer._efd)  # a poller watching the peer wakes for the goodbye
            os.close(self._efd)
            cond.notify_all()
        self.send_pool.close()  # a view the peer still holds keeps the memory alive
        try:
            self._recv_mem.release()
        except (AttributeError, BufferError):
            pass


class _NoSocket:
    """What a serve loop may write a REFUSED frame to before it closes a pending connection:
    there are no bytes on inproc, so the refusal is the close itself."""

    def send(self, data, flags: int = 0) -> int:
        return len(data)


class _Accepted:
    """A connection whose handshake is already done, behind handshake.Pending's interface."""

    sock = _NoSocket()

    def __init__(self, conn: InprocConnection, timeout: float) -> None:
        self.conn = conn
        self.peer = conn.url
        self.events = hs.READ
        self.closed = False
        self.deadline = Deadline(timeout).at

    def fileno(self) -> int:
        return self.conn.fileno()

    def expired(self, now: Optional[float] = None) -> bool:
        return False

    def step(self) -> InprocConnection:
        self.closed = True
        return self.conn

    def wait(self, deadline: Deadline) -> InprocConnection:
        return self.step()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.conn.close()


class InprocListener(Listener):
    def __init__(self, name: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
                 timeout: float = DEFAULT_TIMEOUT, secret: Any = None, max_peer_slot_size: Optional[int] = None,
                 max_peer_nslots: Optional[int] = None, **_ignored: Any):
        if slot_size <= 0 or nslots <= 0:
            raise ValueError("slot_size and nslots must be positive")
        self.name = name or f"anon-{next(_ids)}"
        self.slot_size, self.nslots, self.timeout = slot_size, nslots, timeout
        self.secret = hs.as_secret(secret)
        self.limits = hs.Limits.for_endpoint(slot_size, nslots, max_slot_size=max_peer_slot_size,
                                             max_nslots=max_peer_nslots)
        self.url = f"inproc://{self.name}"
        self._backlog: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._open = True
        with _LISTENERS_LOCK:
            if self.name in _LISTENERS:
                os.close(self._efd)
                raise TransportError(f"{self.url} is already listened on")
            _LISTENERS[self.name] = self

    def fileno(self) -> int:
        return self._efd

    def _offer(self, conn: InprocConnection) -> None:
        with self._lock:
            if not self._open:
                raise ConnectionClosed(f"cannot connect to {self.url}: the listener closed")
            self._backlog.append(conn)
            _bell(self._efd)

    def accept_pending(self) -> Optional[_Accepted]:
        with self._lock:
            if not self._open:
                raise ConnectionClosed(f"{self.url}: listener is closed")
            if not self._backlog:
                _unbell(self._efd)
                return None
            conn = self._backlog.popleft()
            if not self._backlog:
                _unbell(self._efd)
        return _Accepted(conn, self.timeout)

    def close(self) -> None:
        with _LISTENERS_LOCK:
            if _LISTENERS.get(self.name) is self:
                del _LISTENERS[self.name]
        with self._lock:
            if not self._open:
                return
            self._open = False
            backlog, self._backlog = list(self._backlog), collections.deque()
            os.close(self._efd)
        for conn in backlog:  # never accepted: their clients see the peer gone
            conn.close()


def listen(address: str, **options: Any) -> InprocListener:
    return InprocListener(address, **options)


def connect(address: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
            timeout: float = DEFAULT_TIMEOUT, secret: Any = None, max_peer_slot_size: Optional[int] = None,
            max_peer_nslots: Optional[int] = None, **_ignored: Any) -> InprocConnection:
    """Connect to the listener named ``address`` in this process (the handshake's checks --
    limits both ways, the shared secret -- without the bytes)."""
    if slot_size <= 0 or nslots <= 0:
        raise ValueError("slot_size and nslots must be positive")
    secret = hs.as_secret(secret)
    with _LISTENERS_LOCK:
        lst = _LISTENERS.get(address)
    if lst is None:
        raise ConnectionClosed(f"cannot connect to inproc://{address}: nobody listens there")
    limits = hs.Limits.for_endpoint(slot_size, nslots, max_slot_size=max_peer_slot_size,
                                    max_nslots=max_peer_nslots)
    try:
        lst.limits.check({"slot_size": slot_size, "nslots": nslots})
        limits.check({"slot_size": lst.slot_size, "nslots": lst.nslots})
    except ProtocolError as e:
        raise Refused(f"inproc://{address} refused the connection: {e}") from None
    if (secret is None) != (lst.secret is None) or (secret is not None and secret != lst.secret):
        raise AuthenticationError(f"inproc://{address}: the two ends do not share a secret")
    link = _Link()
    url = f"inproc://{address}"
    server = InprocConnection(f"{url}#{next(_ids)}", link, slot_size=lst.slot_size, nslots=lst.nslots,
                              peer_slot_size=slot_size, peer_nslots=nslots, timeout=lst.timeout)
    client = InprocConnection(url, link, slot_size=slot_size, nslots=nslots, peer_slot_size=lst.slot_size,
                              peer_nslots=lst.nslots, timeout=timeout)
    server._pair(client)
    client._pair(server)
    creds = (os.getpid(), os.getuid(), os.getgid())
    for c in (server, client):
        c.authenticated = secret is not None
        c.peer_credentials = creds
    try:
        lst._offer(server)
    except BaseException:
        server.close()
        client.close()
        raise
    return client
