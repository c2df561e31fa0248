"""tcp://host:port — TCP with TCP_NODELAY.

One ``sendmsg`` per message with the slot memoryviews in the gather list, and one
``recv_into`` per wake-up (see transport/stream.py): small payloads are copied from the
read buffer into a slot of the receiver's pool, the rest of a large one is read straight
into its slot. The common message goes through transport/_tcpfast.c where it is built
(``native``: None uses it where built, True requires it, False takes the Python path;
either end may choose either, the bytes on the wire are the same). The handshake (transport/handshake.py) exchanges each side's slot size and
slot count, checked against the other side's limits; the slot count is the number of
credits the peer starts with. With a ``secret`` both sides prove it (HMAC) first.
"""
from __future__ import annotations

import socket
from typing import Any, Optional

from . import handshake as hs
from .base import DEFAULT_NSLOTS, DEFAULT_SLOT_SIZE, DEFAULT_TIMEOUT, Deadline, Listener
from .errors import ConnectionClosed, Timeout, TransportError
from .pool import BufferPool
from .stream import NATIVE_AVAILABLE, StreamConnection

CALLER_MOVES_BYTES = True  # the kernel's socket copies run on the caller's thread (registry.caller_moves_bytes)


def _parse(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"tcp address must be host:port, got {address!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _check_native(native: Optional[bool]) -> Optional[bool]:
    """``native=True`` where the compiled path is not built fails here, not per connection."""
    if native not in (None, True, False):
        raise ValueError(f"native must be None, True or False, got {native!r}")
    if native and not NATIVE_AVAILABLE:
        raise TransportError("tcp:// native=True, but the compiled fast path (transport/_tcpfast.c) "
                             "is not built here: `make deps` builds it (it needs gcc and python3-dev)")
    return native


def _handshake(sock: socket.socket, role: str, url: str, slot_size: int, nslots: int, timeout: float,
               limits: hs.Limits, secret: Optional[bytes], native: Optional[bool]) -> hs.HandshakeGen:
    ex = hs.HelloExchange(role, "tcp", {"slot_size": slot_size, "nslots": nslots},
                          limits=limits, secret=secret)
    yield from hs.exchange(sock, ex)
    pool = BufferPool(slot_size, nslots, name=f"recv:{url}")
    conn = StreamConnection(sock, url, pool, ex.peer, default_timeout=timeout, native=native)
    conn.authenticated = ex.authenticated
    return conn


class TcpListener(Listener):
    def __init__(self, address: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
                 timeout: float = DEFAULT_TIMEOUT, backlog: int = 128, secret: Any = None,
                 max_peer_slot_size: Optional[int] = None, max_peer_nslots: Optional[int] = None,
                 native: Optional[bool] = None):
        if slot_size <= 0 or nslots <= 0:
            raise ValueError("slot_size and nslots must be positive")
        host, port = _parse(address)
        self.native = _check_native(native)
        self.secret = hs.as_secret(secret)
        self.limits = hs.Limits.for_endpoint(slot_size, nslots, max_slot_size=max_peer_slot_size,
                                             max_nslots=max_peer_nslots)
        self.sock = socket.create_server((host, port), backlog=backlog, reuse_port=False)
        self.sock.setblocking(False)
        self.slot_size, self.nslots, self.timeout = slot_size, nslots, timeout
        bound = self.sock.getsockname()
        self.url = f"tcp://{bound[0]}:{bound[1]}"

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept_pending(self) -> Optional[hs.Pending]:
        got = hs.accept_stream(self.sock, self.url, "tcp")
        if got is None:
            return None
        sock, url = got
        gen = _handshake(sock, "server", url, self.slot_size, self.nslots, self.timeout, self.limits,
                         self.secret, self.native)
        return hs.Pending(gen, sock, url)

    def close(self) -> None:
        self.sock.close()


def listen(address: str, **options) -> TcpListener:
    return TcpListener(address, **options)


def connect(address: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
            timeout: float = DEFAULT_TIMEOUT, secret: Any = None, max_peer_slot_size: Optional[int] = None,
            max_peer_nslots: Optional[int] = None, native: Optional[bool] = None) -> StreamConnection:
    if slot_size <= 0 or nslots <= 0:
        raise ValueError("slot_size and nslots must be positive")
    native = _check_native(native)
    host, port = _parse(address)
    secret = hs.as_secret(secret)
    limits = hs.Limits.for_endpoint(slot_size, nslots, max_slot_size=max_peer_slot_size,
                                    max_nslots=max_peer_nslots)
    deadline = Deadline(timeout)
    try:
        sock = socket.create_connection((host, port), timeout=deadline.remaining())
    except socket.timeout:
        raise Timeout(f"connecting to tcp://{address}") from None
    except OSError as e:
        raise ConnectionClosed(f"cannot connect to tcp://{address}: {e}") from None
    try:
        hs.tune_stream(sock)
        return hs.run(_handshake(sock, "client", f"tcp://{address}", slot_size, nslots, timeout, limits,
                                 secret, native), sock.fileno(), deadline)
    except BaseException:
        sock.close()
        raise
