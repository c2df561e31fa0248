"""The rdma:// TCP side channel's phase-2 fields: the queue pair HELLO and its validation.

Why a TCP side channel rather than rdmacm (pyverbs.cmid): the listener is an ordinary TCP
port (port 0 works, the conformance kit's garbage-on-the-socket case is a plain read),
every wait is a socket poll with a deadline, we keep full control of the CQs, channels and
QP attributes (rdmacm wants to create them), and the socket stays open after set-up as a
liveness signal: a dead peer process is an EOF within milliseconds, where RC retries take
seconds.

Phase 1 (transport/handshake.py: identity, slot size and count against local limits,
authentication) runs first on the side channel, so a stranger never makes us create verbs
objects. Then each side sends one more HELLO frame (framing.py, kind HELLO, a msgpack map):

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
    caps                                    optional: what else we read, e.g.
                                            framing.CAP_RDMA_FAST (fast SENDs)

then moves its QP to RTS and sends READY (a HELLO frame ``{"ready": true}``); nobody
sends on the QP before it has the peer's READY, so no packet meets a QP that is not yet
ready to receive.
"""
from __future__ import annotations

import re
import socket
from typing import Optional

from . import framing
from .errors import ProtocolError

PROTO = 1  # version of the rdma wire protocol below the framing
MAX_NSLOTS = 4096
MAX_NCTRL = 256
_GID = re.compile(r"^[0-9a-f]{4}(:[0-9a-f]{4}){7}$")
_INTS = ("proto", "qpn", "psn", "mtu", "max_msg", "addr", "rkey", "slot_size", "room", "stride",
         "nslots", "small_size", "nctrl")


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
    caps = peer.get("caps", [])
    checks.append((type(caps) is list and len(caps) <= 16 and all(type(c) is str and len(c) <= 64 for c in caps),
                   "caps is not a short list of names"))
    for ok, why in checks:
        if not ok:
            raise ProtocolError(f"handshake: {why}")
    return peer


def local_ip(sock: socket.socket) -> Optional[str]:
    try:
        return sock.getsockname()[0]
    except OSError:
        return None
