"""The public contract every backend implements (small ABCs, in the style of trio's _abc).

Ownership is the whole protocol:
- ``conn.alloc(n)`` hands the caller a slot of the connection's registered send pool;
- ``conn.send(header, [slot, ...])`` transfers the slots to the transport, which returns
  them to the pool once the peer no longer needs them (tcp: after the kernel copied them;
  shm: when the receiver released the message; rdma: on the send completion);
- ``conn.recv(timeout)`` returns a :class:`Message` whose ``buffers`` are memoryviews where
  the bytes landed (the receiver's pool, or on shm the sender's slot itself), valid until
  ``message.release()``; releasing is what returns the credit to the sender.

Every blocking call takes ``timeout`` in seconds; ``None`` means the connection's
``default_timeout`` (finite), never "forever".

Connection lifecycle, the same on every backend (the state is ``conn.state``)::

    state       recv()                         send()/alloc()    closed   send_ready()
    OPEN        messages                       work              False    per backend
    PEER_GONE   what had arrived, in order,    ConnectionClosed  False    False
                then ConnectionClosed
    BROKEN      ConnectionClosed               ConnectionClosed  True     False
    CLOSED      ConnectionClosed               ConnectionClosed  True     False

    OPEN      -> PEER_GONE  the peer said goodbye, closed its end, died, or its QP failed
    OPEN      -> BROKEN     this side found a protocol error (raised once, as ProtocolError,
    PEER_GONE -> BROKEN     by the recv/send that found it), or cut a frame it was writing:
                            nothing more is delivered
    any       -> CLOSED     close() (idempotent)

A protocol error found while *releasing* a message (a peer that corrupted what we write
slot returns into) is never raised by ``Message.release``: the connection becomes BROKEN
and its next recv/send raises that ProtocolError (``pending()`` turns True so that a
poller calls it). Messages handed out stay readable until released, in every state.
"""
from __future__ import annotations

import abc
import select
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from .errors import ConnectionClosed, Timeout, TransportError
from .pool import Slot
from .timing import ACCEPT_GRACE, DEFAULT_TIMEOUT, HELLO_TIMEOUT

DEFAULT_SLOT_SIZE = 4 << 20
DEFAULT_NSLOTS = 16

Buffer = Union[Slot, bytes, bytearray, memoryview, np.ndarray]

# the lifecycle states (see the table above); OPEN is 0 so that hot paths test ``if self._state``
OPEN, PEER_GONE, BROKEN, CLOSED = 0, 1, 2, 3
STATE_NAMES = ("OPEN", "PEER_GONE", "BROKEN", "CLOSED")


class Deadline:
    """An absolute deadline on the monotonic clock, so a loop of waits cannot drift."""

    __slots__ = ("at",)

    def __init__(self, timeout: Optional[float], default: float = DEFAULT_TIMEOUT):
        self.at = time.monotonic() + (default if timeout is None else max(0.0, timeout))

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def check(self, what: str) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise Timeout(f"timed out {what}")
        return left


def wait_fd(fd: int, events: int, deadline: Deadline, what: str) -> None:
    """Block until ``fd`` polls ``events`` (select.POLLIN/POLLOUT), or Timeout at ``deadline``."""
    p = select.poll()
    p.register(fd, events)
    while True:
        left = deadline.check(what)
        if p.poll(left * 1000.0 + 0.5):
            return


@dataclass
class ConnectionStats:
    """Per-connection counters (exported as Prometheus metrics by the services)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    copies: int = 0  # user-space copies: only unregistered buffers handed to send()
    credit_stalls: int = 0  # sends that had to wait for the peer to return credits

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def fold(self, link: Any) -> "ConnectionStats":
        """Add the message counts a compiled fast path kept on its own (``link``'s
        msgs_in, bytes_in, msgs_out, bytes_out: it updates no Python object per message)
        and zero them there; ``link`` None: nothing to add."""
        if link is not None and (link.msgs_in or link.msgs_out):
            self.messages_received += link.msgs_in
            self.bytes_received += link.bytes_in
            self.messages_sent += link.msgs_out
            self.bytes_sent += link.bytes_out
            link.msgs_in = link.bytes_in = link.msgs_out = link.bytes_out = 0
        return self


class Message:
    """A received message: ``header`` (msgpack-able object) and ``buffers`` (memoryviews
    into registered memory), valid until :meth:`release`.

    Backends make one with ``Message(header, buffers, None, conn, token)``: releasing it
    calls ``conn._release_message(token)`` once (the backend hook that returns the slot or
    the credit). ``Message(header, buffers, on_release)`` calls a plain callback instead.
    """

    __slots__ = ("header", "buffers", "released", "_conn", "_token")

    def __init__(self, header: Any, buffers: list, on_release: Optional[Callable[[], None]] = None,
                 conn: Optional["Connection"] = None, token: Any = None):
        self.header = header
        self.buffers = buffers
        self.released = False
        self._conn = conn
        self._token = on_release if conn is None else token

    def array(self, i: int, dtype: Any, shape: Any = -1) -> np.ndarray:
        """Buffer ``i`` as a numpy array, in place (read-only where the memory is the peer's)."""
        return np.frombuffer(self.buffers[i], dtype=dtype).reshape(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def release(self) -> None:
        """Hand the buffers back; the views must not be used afterwards. Idempotent; never
        raises a transport error (see the lifecycle above)."""
        if self.released:
            return
        self.released = True
        for b in self.buffers:
            b.release()
        self.buffers = []
        conn, token = self._conn, self._token
        self._conn = self._token = None
        if conn is not None:
            try:
                conn._release_message(token)
            except TransportError as e:
                conn._release_failed(e)
        elif token is not None:
            token()

    def __enter__(self) -> "Message":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<Message header={self.header!r} buffers={[b.nbytes for b in self.buffers]}>"


class Connection(abc.ABC):
    """One bidirectional, message-oriented, credit-controlled connection."""

    url: str
    default_timeout: float = DEFAULT_TIMEOUT
    #: the largest payload (sum of a message's buffers) the peer accepts
    max_message: int
    stats: ConnectionStats
    #: the peer proved the shared secret in the handshake (transport/handshake.py)
    authenticated: bool = False
    #: (pid, uid, gid) of the peer process where the kernel tells (shm: SO_PEERCRED)
    peer_credentials: Optional[tuple] = None
    # lifecycle (module docstring): the state, why it left OPEN, and a ProtocolError found
    # on the release path, raised by the next recv/send
    _state: int = OPEN
    _why: Optional[str] = None
    _error: Optional[TransportError] = None

    @property
    def state(self) -> str:
        """OPEN, PEER_GONE, BROKEN or CLOSED (the lifecycle table in transport/base.py)."""
        return STATE_NAMES[self._state]

    @property
    def closed(self) -> bool:
        """True once nothing more can be received or sent (BROKEN or CLOSED)."""
        return self._state >= BROKEN

    def _to_peer_gone(self, why: str) -> None:
        if self._state == OPEN:
            self._state, self._why = PEER_GONE, why

    def _to_broken(self, why: str) -> None:
        if self._state < BROKEN:
            self._state, self._why = BROKEN, why

    def _to_closed(self) -> bool:
        """Enter CLOSED; False if it already was (close() is idempotent)."""
        if self._state == CLOSED:
            return False
        self._state = CLOSED
        return True

    def _closed_error(self) -> TransportError:
        """What a call on a connection that is not OPEN raises: a ProtocolError found on the
        release path (once), else ConnectionClosed saying why."""
        err = self._error
        if err is not None:
            self._error = None
            return err
        if self._state == CLOSED:
            return ConnectionClosed(f"{self.url}: connection is closed")
        return ConnectionClosed(f"{self.url}: {self._why}")

    def _release_message(self, token: Any) -> None:
        """Backend hook: a message made with ``token`` was released (return its slot/credit)."""

    def _release_failed(self, exc: TransportError) -> None:
        """The release hook found the peer broke the protocol: remember it for the next
        recv/send of this connection (a release never raises it)."""
        if self._state < BROKEN:
            self._error = exc
        self._to_broken(f"protocol error: {exc}")

    @abc.abstractmethod
    def alloc(self, nbytes: int, timeout: Optional[float] = None) -> Slot:
        """A send slot of at least ``nbytes``; waits (bounded) while all are in flight."""

    @abc.abstractmethod
    def send(self, header: Any, buffers: Sequence[Buffer] = (), timeout: Optional[float] = None) -> None:
        """Send one message. Slots are taken over; other buffers are copied (and counted)."""

    @abc.abstractmethod
    def recv(self, timeout: Optional[float] = None) -> Message:
        """The next message, in order. Raises Timeout, ConnectionClosed or ProtocolError."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """A file descriptor that polls readable when ``recv`` may make progress."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close; idempotent. Pending messages are discarded, registrations undone."""

    def abort(self) -> None:
        """Close at once, without waiting for what we sent to reach the peer (a service
        dropping a peer that does not read must not wait for it). Idempotent."""
        self.close()

    def in_registered_memory(self, buf) -> bool:
        """Whether ``buf`` (a received buffer) lies in memory registered for this connection."""
        return self.recv_pool.contains(buf)  # type: ignore[attr-defined]

    def pending(self) -> bool:
        """Whether a message is already buffered (``recv(0)`` would not block on the fd)."""
        return False

    @abc.abstractmethod
    def send_ready(self) -> bool:
        """Whether one message (up to ``max_message`` bytes, in a slot of ours) could be sent
        now without waiting: the peer has credits left and there is room on the way. A
        service holds a reply for a peer that is not ready instead of blocking on it.
        False whenever the connection is not OPEN, and (tcp) while a frame is unfinished."""

    def wants_write(self) -> bool:
        """Whether bytes accepted by an earlier ``send(..., timeout=0)`` still wait for room
        in the kernel: a poller should watch ``fileno()`` for writing too and call
        :meth:`flush` when it is writable (only byte-stream backends ever say True)."""
        return False

    def flush(self) -> bool:
        """Write what :meth:`wants_write` holds, without blocking; True once nothing is left
        (any later send/recv also makes progress on it)."""
        return True

    def yield_to_peer(self) -> None:
        """Call after a send when more work of ours follows at once (a chunked round's next
        gather): a peer on this machine that the send woke may be queued on our CPU, and
        should read now rather than after our time slice. A no-op where a send cannot put
        the reader there (shm and rdma wake it through an eventfd or a completion)."""

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()



class CompiledPath:
    """For a connection whose common message may go through a compiled fast path (shm's
    transport/_shmfast.c, rdma's _rdmafast.c): ``_link`` is the extension's object, or None
    where the Python path runs; it counts its messages itself, folded into ``stats`` here."""

    _link: Any = None
    _stats: ConnectionStats

    @property
    def native(self) -> bool:
        """Whether the compiled path carries this connection's common messages."""
        return self._link is not None

    @property
    def stats(self) -> ConnectionStats:
        return self._stats.fold(self._link)


class Listener(abc.ABC):
    """Accepts connections. A serve loop polls ``fileno()`` and calls
    :meth:`accept_pending` to start handshakes it drives itself (transport/handshake.py's
    ``Pending``); :meth:`accept` is the blocking form of the same."""

    url: str  # the bound address (a port of 0 replaced by the real one)
    timeout: float = DEFAULT_TIMEOUT

    @abc.abstractmethod
    def accept_pending(self):
        """Take one waiting connection and start its handshake without blocking: a
        ``handshake.Pending``, or None if nobody is waiting. Raises AcceptFailed when the
        listener cannot accept now (out of file descriptors, closed)."""

    def accept(self, timeout: Optional[float] = None) -> Connection:
        """The next connection, handshake done. Timeout if none arrives in ``timeout``; a
        client that stalls its handshake fails this accept within at most
        ``handshake.HELLO_TIMEOUT`` (Timeout), and the listener goes on working."""
        deadline = Deadline(timeout, self.timeout)
        while True:
            pending = self.accept_pending()
            if pending is not None:
                break
            wait_fd(self.fileno(), select.POLLIN, deadline, "waiting for a connection")
        return pending.wait(Deadline(min(deadline.remaining() or ACCEPT_GRACE, HELLO_TIMEOUT)))

    @abc.abstractmethod
    def fileno(self) -> int: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
