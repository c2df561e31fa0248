"""rdma://ip:port — RC queue pairs over pyverbs (tested on soft-RoCE).

The listener is a TCP server on ip:port, the side channel that sets a connection up and
then watches it (transport/rdma_handshake.py); the data path is verbs only
(transport/rdma_conn.py, its common message in C: transport/_rdmafast.c): small messages by
SEND into pre-posted receives, large ones by RDMA WRITE WITH IMMEDIATE into slots the
receiver advertised, credits returned on release.

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
``secret``      shared secret both ends must prove (transport/handshake.py); default none
``max_peer_slot_size``, ``max_peer_nslots``  the most the peer may make us allocate
``native``      None: the compiled fast path (transport/_rdmafast.c) where it is built;
                True: require it; False: the Python path

Needs pyverbs (Debian's python3-pyverbs) and a device; without either, ``listen`` and
``connect`` raise TransportError saying so (importing this module needs neither).
"""
from __future__ import annotations

import socket
from typing import Any, Optional

from . import handshake as hs
from . import rdma_handshake as rh
from .base import DEFAULT_NSLOTS, DEFAULT_SLOT_SIZE, DEFAULT_TIMEOUT, Deadline, Listener
from .errors import ConnectionClosed, ProtocolError, Timeout
from .rdma_conn import RdmaConnection
from .rdma_device import DeviceChoice, pick_device
from .rdma_verbs import live_resources, require_pyverbs
from .timing import RDMA_SETUP_TIMEOUT, RDMA_SPIN

__all__ = ["RdmaConnection", "RdmaListener", "connect", "listen", "live_resources", "pick_device",
           "DeviceChoice", "DEFAULT_SMALL_SIZE", "DEFAULT_SPIN"]

DEFAULT_SMALL_SIZE = 8192  # a 4 KiB payload and its header still go by SEND
DEFAULT_SPIN = RDMA_SPIN
SETUP_TIMEOUT = RDMA_SETUP_TIMEOUT  # see transport/timing.py


def _parse(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"rdma address must be ip:port, got {address!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _phase1_fields(peer: dict) -> None:
    if not peer["nslots"] <= rh.MAX_NSLOTS:
        raise ProtocolError(f"handshake: nslots outside 1..{rh.MAX_NSLOTS}")


def _ready(peer: dict) -> dict:
    if peer.get("ready") is not True:
        raise ProtocolError("expected READY from the peer")
    return peer


def _handshake(sock: socket.socket, role: str, url: str, opts: dict, limits: hs.Limits,
               secret: Optional[bytes]) -> hs.HandshakeGen:
    """Phase 1 (identity, limits, authentication), then verbs set-up, the QP HELLO both
    ways, RTS, and the READY barrier; everything made is torn down if any step fails."""
    ex = hs.HelloExchange(role, "rdma", {"slot_size": opts["slot_size"], "nslots": opts["nslots"]},
                          limits=limits, secret=secret, validate=_phase1_fields)
    yield from hs.exchange(sock, ex)
    yield hs.Rearm(SETUP_TIMEOUT)
    conn = RdmaConnection(sock, url, **opts)
    try:
        def check(peer: dict) -> dict:
            rh.validate(peer)
            if (peer["slot_size"], peer["nslots"]) != (ex.peer["slot_size"], ex.peer["nslots"]):
                raise ProtocolError("the peer's queue pair HELLO contradicts its first HELLO")
            return peer

        peer = yield from hs.frame_exchange(sock, conn.local_hello(), check)
        conn.connect_peer(peer)
        yield from hs.frame_exchange(sock, {"ready": True}, _ready)
        conn.start()
    except BaseException:  # GeneratorExit too: an abandoned handshake leaks no verbs object
        conn.abort()
        raise
    conn.authenticated = ex.authenticated
    return conn


def _conn_options(slot_size: int, nslots: int, timeout: float, device: Optional[str],
                  gid_index: Optional[int], ib_port: Optional[int], small_size: int,
                  spin: float, native: Optional[bool]) -> dict:
    return dict(slot_size=slot_size, nslots=nslots, timeout=timeout, device=device,
                gid_index=gid_index, ib_port=ib_port, small_size=small_size, spin=spin, native=native)


class RdmaListener(Listener):
    def __init__(self, address: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
                 timeout: float = DEFAULT_TIMEOUT, device: Optional[str] = None,
                 gid_index: Optional[int] = None, ib_port: Optional[int] = None,
                 small_size: int = DEFAULT_SMALL_SIZE, spin: float = DEFAULT_SPIN, backlog: int = 128,
                 secret: Any = None, max_peer_slot_size: Optional[int] = None,
                 max_peer_nslots: Optional[int] = None, native: Optional[bool] = None):
        require_pyverbs()
        host, port = _parse(address)
        self.secret = hs.as_secret(secret)
        self.limits = hs.Limits.for_endpoint(slot_size, nslots, max_slot_size=max_peer_slot_size,
                                             max_nslots=min(max_peer_nslots or rh.MAX_NSLOTS, rh.MAX_NSLOTS))
        # fail here, not at the first accept, when there is no usable device
        self.device = pick_device(None if host == "0.0.0.0" else host, device=device,
                                  gid_index=gid_index, port=ib_port)
        self.sock = socket.create_server((host, port), backlog=backlog)
        self.sock.setblocking(False)
        self.timeout = timeout
        self._opts = _conn_options(slot_size, nslots, timeout, device, gid_index, ib_port,
                                   small_size, spin, native)
        if host != "0.0.0.0":  # every accepted connection has this local address: same choice
            self._opts["choice"] = self.device
        bound = self.sock.getsockname()
        self.url = f"rdma://{bound[0]}:{bound[1]}"

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept_pending(self) -> Optional[hs.Pending]:
        got = hs.accept_stream(self.sock, self.url, "rdma")
        if got is None:
            return None
        sock, url = got
        return hs.Pending(_handshake(sock, "server", url, self._opts, self.limits, self.secret), sock, url)

    def close(self) -> None:
        self.sock.close()


def listen(address: str, **options) -> RdmaListener:
    return RdmaListener(address, **options)


def connect(address: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
            timeout: float = DEFAULT_TIMEOUT, device: Optional[str] = None,
            gid_index: Optional[int] = None, ib_port: Optional[int] = None,
            small_size: int = DEFAULT_SMALL_SIZE, spin: float = DEFAULT_SPIN, secret: Any = None,
            max_peer_slot_size: Optional[int] = None, max_peer_nslots: Optional[int] = None,
            native: Optional[bool] = None) -> RdmaConnection:
    require_pyverbs()
    host, port = _parse(address)
    secret = hs.as_secret(secret)
    limits = hs.Limits.for_endpoint(slot_size, nslots, max_slot_size=max_peer_slot_size,
                                    max_nslots=min(max_peer_nslots or rh.MAX_NSLOTS, rh.MAX_NSLOTS))
    pick_device(None, device=device, gid_index=gid_index, port=ib_port)  # a clear error first
    deadline = Deadline(timeout)
    try:
        sock = socket.create_connection((host, port), timeout=max(deadline.remaining(), 0.001))
    except socket.timeout:
        raise Timeout(f"connecting to rdma://{address}") from None
    except OSError as exc:
        raise ConnectionClosed(f"cannot connect to rdma://{address}: {exc}") from None
    try:
        hs.tune_stream(sock)
        opts = _conn_options(slot_size, nslots, timeout, device, gid_index, ib_port, small_size, spin, native)
        return hs.run(_handshake(sock, "client", f"rdma://{address}", opts, limits, secret),
                      sock.fileno(), deadline, "in the rdma handshake")
    except BaseException:
        sock.close()
        raise
