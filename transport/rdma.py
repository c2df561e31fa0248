"""rdma://ip:port — RC queue pairs over pyverbs (tested on soft-RoCE).

The listener is a TCP server on ip:port, the side channel that sets a connection up and
then watches it (transport/rdma_handshake.py); the data path is verbs only
(transport/rdma_conn.py): small messages by SEND into pre-posted receives, large ones by
RDMA WRITE WITH IMMEDIATE into slots the receiver advertised, credits returned on release.

Options of ``listen`` and ``connect`` (same names as the other backends where they exist):

``slot_size``   largest message the peer may send us (receive slot payload), bytes
``nslots``      messages the peer may have unreleased at once (our receive slots)
``timeout``     default timeout of every blocking call, seconds
``device``      RDMA device (default: env MOE_RDMA_DEVICE, else found automatically)
``gid_index``   GID table index (default: env MOE_RDMA_GID_INDEX, else the RoCE v2 IPv4
                GID of the connection's local IP, else the first RoCE v2 IPv4 GID)
``ib_port``     device port (default: the first active one)
``small_size``  size of each receive buffer: frames up to this go by SEND
``spin``        seconds a wait busy-polls the CQ before it sleeps on the completion channel

Needs pyverbs (Debian's python3-pyverbs) and a device; without either, ``listen`` and
``connect`` raise TransportError saying so (importing this module needs neither).
"""
from __future__ import annotations

import socket
from typing import Optional

from .base import DEFAULT_NSLOTS, DEFAULT_SLOT_SIZE, DEFAULT_TIMEOUT, Deadline, Listener
from .errors import ConnectionClosed, Timeout
from . import rdma_handshake as hs
from .rdma_conn import RdmaConnection
from .rdma_device import DeviceChoice, pick_device
from .rdma_verbs import live_resources, require_pyverbs
from .stream import accept_before

__all__ = ["RdmaConnection", "RdmaListener", "connect", "listen", "live_resources", "pick_device",
           "DeviceChoice", "DEFAULT_SMALL_SIZE", "DEFAULT_SPIN"]

DEFAULT_SMALL_SIZE = 8192  # a 4 KiB payload and its header still go by SEND
DEFAULT_SPIN = 100e-6
HELLO_WAIT = 5.0  # a client that never says hello must not stall the listener for long


def _parse(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"rdma address must be ip:port, got {address!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)


def _conn_options(slot_size: int, nslots: int, timeout: float, device: Optional[str],
                  gid_index: Optional[int], ib_port: Optional[int], small_size: int,
                  spin: float) -> dict:
    return dict(slot_size=slot_size, nslots=nslots, timeout=timeout, device=device,
                gid_index=gid_index, ib_port=ib_port, small_size=small_size, spin=spin)


class RdmaListener(Listener):
    def __init__(self, address: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
                 timeout: float = DEFAULT_TIMEOUT, device: Optional[str] = None,
                 gid_index: Optional[int] = None, ib_port: Optional[int] = None,
                 small_size: int = DEFAULT_SMALL_SIZE, spin: float = DEFAULT_SPIN, backlog: int = 128):
        require_pyverbs()
        host, port = _parse(address)
        # fail here, not at the first accept, when there is no usable device
        self.device = pick_device(None if host == "0.0.0.0" else host, device=device,
                                  gid_index=gid_index, port=ib_port)
        self.sock = socket.create_server((host, port), backlog=backlog)
        self.sock.setblocking(False)
        self.timeout = timeout
        self._opts = _conn_options(slot_size, nslots, timeout, device, gid_index, ib_port,
                                   small_size, spin)
        if host != "0.0.0.0":  # every accepted connection has this local address: same choice
            self._opts["choice"] = self.device
        bound = self.sock.getsockname()
        self.url = f"rdma://{bound[0]}:{bound[1]}"

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self, timeout: Optional[float] = None) -> RdmaConnection:
        deadline = Deadline(timeout, self.timeout)
        sock, addr = accept_before(self.sock, deadline, self.url)
        try:
            _tune(sock)
            # the client speaks first: garbage is a ProtocolError before we create anything
            peer = hs.validate(hs.read_hello(sock, Deadline(min(deadline.remaining() or 1.0, HELLO_WAIT))))
            # set-up is local work (registration is slow under emulation): at least a few
            # seconds for the rest, whatever was left of the accept timeout
            rest = Deadline(max(deadline.remaining(), HELLO_WAIT))
            return RdmaConnection(sock, f"rdma://{addr[0]}:{addr[1]}", deadline=rest,
                                  peer_hello=peer, **self._opts)
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        self.sock.close()


def listen(address: str, **options) -> RdmaListener:
    return RdmaListener(address, **options)


def connect(address: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
            timeout: float = DEFAULT_TIMEOUT, device: Optional[str] = None,
            gid_index: Optional[int] = None, ib_port: Optional[int] = None,
            small_size: int = DEFAULT_SMALL_SIZE, spin: float = DEFAULT_SPIN) -> RdmaConnection:
    require_pyverbs()
    host, port = _parse(address)
    pick_device(None, device=device, gid_index=gid_index, port=ib_port)  # a clear error first
    deadline = Deadline(timeout)
    try:
        sock = socket.create_connection((host, port), timeout=max(deadline.remaining(), 0.001))
    except socket.timeout:
        raise Timeout(f"connecting to rdma://{address}") from None
    except OSError as exc:
        raise ConnectionClosed(f"cannot connect to rdma://{address}: {exc}") from None
    try:
        _tune(sock)
        return RdmaConnection(sock, f"rdma://{address}", deadline=deadline,
                              **_conn_options(slot_size, nslots, timeout, device, gid_index,
                                              ib_port, small_size, spin))
    except BaseException:
        sock.close()
        raise
