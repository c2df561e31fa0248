"""tcp://host:port — TCP with TCP_NODELAY.

One ``sendmsg`` per message with the slot memoryviews in the gather list, and one
``recv_into`` per wake-up (see transport/stream.py): small payloads are copied from the
read buffer into a slot of the receiver's pool, the rest of a large one is read straight
into its slot. A handshake exchanges each side's slot size and slot count; the slot count
is the number of credits the peer starts with.
"""
from __future__ import annotations

import socket
from typing import Optional

from . import framing
from .base import DEFAULT_NSLOTS, DEFAULT_SLOT_SIZE, DEFAULT_TIMEOUT, Deadline, Listener
from .errors import ConnectionClosed, ProtocolError, Timeout
from .framing import Kind
from .pool import BufferPool
from .stream import StreamConnection, accept_before, sendmsg_all, wait_fd

import select


def _parse(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"tcp address must be host:port, got {address!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)


def _read_exact(sock: socket.socket, n: int, deadline: Deadline) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            wait_fd(sock.fileno(), select.POLLIN, deadline, "in the handshake")
            continue
        except OSError as e:
            raise ConnectionClosed(f"handshake failed: {e}") from None
        if k == 0:
            raise ConnectionClosed("peer closed during the handshake")
        got += k
    return bytes(buf)


def _hello(sock: socket.socket, ours: dict, deadline: Deadline) -> dict:
    sendmsg_all(sock, [memoryview(b) for b in framing.encode_hello(ours)], deadline)
    kind, hlen, _ = framing.decode_prefix(_read_exact(sock, framing.PREFIX_SIZE, deadline))
    if kind != Kind.HELLO:
        raise ProtocolError(f"expected a handshake, got frame kind {kind}")
    peer = framing.decode_hello(_read_exact(sock, hlen, deadline))
    for key in ("slot_size", "nslots"):
        v = peer.get(key)
        if not isinstance(v, int) or v <= 0:
            raise ProtocolError(f"handshake field {key}={v!r} is invalid")
    if peer.get("transport") != "moe-transport":
        raise ProtocolError("peer is not a moe-transport endpoint")
    return peer


def _params(slot_size: int, nslots: int) -> dict:
    return {"transport": "moe-transport", "version": framing.VERSION,
            "slot_size": slot_size, "nslots": nslots}


class TcpListener(Listener):
    def __init__(self, address: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
                 timeout: float = DEFAULT_TIMEOUT, backlog: int = 128):
        host, port = _parse(address)
        self.sock = socket.create_server((host, port), backlog=backlog, reuse_port=False)
        self.sock.setblocking(False)
        self.slot_size, self.nslots, self.timeout = slot_size, nslots, timeout
        bound = self.sock.getsockname()
        self.url = f"tcp://{bound[0]}:{bound[1]}"

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self, timeout: Optional[float] = None) -> StreamConnection:
        deadline = Deadline(timeout, self.timeout)
        sock, addr = accept_before(self.sock, deadline, self.url)
        try:
            _tune(sock)
            # a client that never says hello must not stall the listener for long
            peer = _hello(sock, _params(self.slot_size, self.nslots), Deadline(min(deadline.remaining() or 1.0, 5.0)))
        except (ProtocolError, ConnectionClosed, Timeout):
            sock.close()
            raise
        pool = BufferPool(self.slot_size, self.nslots, name="recv:tcp-server")
        return StreamConnection(sock, f"tcp://{addr[0]}:{addr[1]}", pool, peer, default_timeout=self.timeout)

    def close(self) -> None:
        self.sock.close()


def listen(address: str, **options) -> TcpListener:
    return TcpListener(address, **options)


def connect(address: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
            timeout: float = DEFAULT_TIMEOUT) -> StreamConnection:
    host, port = _parse(address)
    deadline = Deadline(timeout)
    try:
        sock = socket.create_connection((host, port), timeout=deadline.remaining())
    except socket.timeout:
        raise Timeout(f"connecting to tcp://{address}") from None
    except OSError as e:
        raise ConnectionClosed(f"cannot connect to tcp://{address}: {e}") from None
    try:
        _tune(sock)
        peer = _hello(sock, _params(slot_size, nslots), deadline)
    except BaseException:
        sock.close()
        raise
    pool = BufferPool(slot_size, nslots, name=f"recv:tcp://{address}")
    return StreamConnection(sock, f"tcp://{address}", pool, peer, default_timeout=timeout)
