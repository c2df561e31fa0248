"""The rdma:// TCP side channel: HELLO exchange, READY barrier, field validation.

Why a TCP side channel rather than rdmacm (pyverbs.cmid): the listener is an ordinary TCP
port (port 0 works, the conformance kit's garbage-on-the-socket case is a plain read),
every wait is a socket poll with a deadline, we keep full control of the CQs, channels and
QP attributes (rdmacm wants to create them), and the socket stays open after set-up as a
liveness signal: a dead peer process is an EOF within milliseconds, where RC retries take
seconds.

Each side sends one HELLO frame (framing.py, kind HELLO, a msgpack map):

    transport, backend, version, proto      who we are
    gid, qpn, psn, mtu, max_msg             the RC QP: GID (RoCE v2), QP number, first
                                            PSN, active port MTU (IBV_MTU_* enum), the
                                            port's largest message
    addr, rkey, slot_size, room, stride,    the receive slots the peer may WRITE into:
    nslots                                  slot i starts at addr + i * stride, holds a
                                            frame prefix + header in its first ``room``
                                            bytes' worth and up to slot_size payload bytes
    small_size, nctrl                       receive buffers posted for SENDs: nslots for
                                            data plus nctrl for credit messages, each
                                            small_size bytes

then moves its QP to RTS and sends READY (a HELLO frame ``{"ready": true}``); nobody
sends on the QP before it has the peer's READY, so no packet meets a QP that is not yet
ready to receive.
"""
from __future__ import annotations

import re
import select
import socket
from typing import Optional

from . import framing
from .base import Deadline
from .errors import ConnectionClosed, ProtocolError
from .framing import Kind
from .stream import sendmsg_all, wait_fd

PROTO = 1  # version of the rdma wire protocol below the framing
MAX_NSLOTS = 4096
MAX_NCTRL = 256
_GID = re.compile(r"^[0-9a-f]{4}(:[0-9a-f]{4}){7}$")
_INTS = ("proto", "qpn", "psn", "mtu", "max_msg", "addr", "rkey", "slot_size", "room", "stride",
         "nslots", "small_size", "nctrl")


def read_exact(sock: socket.socket, n: int, deadline: Deadline, what: str) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            wait_fd(sock.fileno(), select.POLLIN, deadline, what)
            continue
        except OSError as exc:
            raise ConnectionClosed(f"rdma handshake failed: {exc}") from None
        if k == 0:
            raise ConnectionClosed("peer closed during the rdma handshake")
        got += k
    return bytes(buf)


def read_hello(sock: socket.socket, deadline: Deadline) -> dict:
    """One HELLO frame from the side channel; anything else is a ProtocolError."""
    kind, hlen, _ = framing.decode_prefix(read_exact(sock, framing.PREFIX_SIZE, deadline,
                                                     "in the rdma handshake"))
    if kind != Kind.HELLO:
        raise ProtocolError(f"expected a handshake, got a {Kind(kind).name} frame")
    return framing.decode_hello(read_exact(sock, hlen, deadline, "in the rdma handshake"))


def send_hello(sock: socket.socket, params: dict, deadline: Deadline) -> None:
    sendmsg_all(sock, [memoryview(b) for b in framing.encode_hello(params)], deadline)


def params(**fields) -> dict:
    return {"transport": "moe-transport", "backend": "rdma", "version": framing.VERSION,
            "proto": PROTO, **fields}


def validate(peer: dict) -> dict:
    """Check every field a peer's HELLO must have; returns it (ProtocolError otherwise)."""
    if peer.get("transport") != "moe-transport" or peer.get("backend") != "rdma":
        raise ProtocolError("peer is not a moe-transport rdma endpoint")
    if peer.get("version") != framing.VERSION:
        raise ProtocolError(f"peer speaks framing version {peer.get('version')!r}")
    for key in _INTS:
        v = peer.get(key)
        if type(v) is not int or v < 0:
            raise ProtocolError(f"handshake field {key}={v!r} is invalid")
    if peer["proto"] != PROTO:
        raise ProtocolError(f"peer speaks rdma protocol {peer['proto']}, we speak {PROTO}")
    gid = peer.get("gid")
    if not isinstance(gid, str) or not _GID.match(gid):
        raise ProtocolError(f"handshake GID {gid!r} is invalid")
    checks = [
        (1 <= peer["mtu"] <= 5, "mtu is not an IBV_MTU value"),
        (0 < peer["qpn"] < 1 << 24 and peer["psn"] < 1 << 24, "QP number or PSN out of range"),
        (1 <= peer["nslots"] <= MAX_NSLOTS, f"nslots outside 1..{MAX_NSLOTS}"),
        (1 <= peer["nctrl"] <= MAX_NCTRL, f"nctrl outside 1..{MAX_NCTRL}"),
        (peer["slot_size"] > 0, "empty slots"),
        (peer["room"] >= framing.PREFIX_SIZE + framing.MAX_HEADER, "header room below the header limit"),
        (peer["stride"] >= peer["room"] + peer["slot_size"], "slot stride smaller than a slot"),
        (peer["small_size"] >= 256, "receive buffers below 256 bytes"),
        (peer["addr"] > 0 and peer["addr"] + peer["stride"] * peer["nslots"] < 1 << 64, "bad slot address"),
        (peer["rkey"] < 1 << 32, "bad rkey"),
    ]
    for ok, why in checks:
        if not ok:
            raise ProtocolError(f"handshake: {why}")
    return peer


def ready(sock: socket.socket, deadline: Deadline) -> None:
    """The READY barrier: our QP is in RTS with its receives posted; wait for the peer's."""
    send_hello(sock, {"ready": True}, deadline)
    if read_hello(sock, deadline).get("ready") is not True:
        raise ProtocolError("expected READY from the peer")


def local_ip(sock: socket.socket) -> Optional[str]:
    try:
        return sock.getsockname()[0]
    except OSError:
        return None
