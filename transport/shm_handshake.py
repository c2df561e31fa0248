"""shm://'s handshake pieces over its Unix socket: the peer's credentials (SO_PEERCRED),
the segment and doorbell fds passed both ways (SCM_RIGHTS), and the HELLO fields' checks."""
from __future__ import annotations

import os
import socket
import struct
from typing import Sequence

from . import handshake as hs
from .errors import ConnectionClosed, ProtocolError, Refused
from .shm_wire import MAX_RECORD, MAX_RING

_FD_MSG = b"F"
_CRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def check_credentials(creds: tuple[int, int, int], allowed_gids: Sequence[int]) -> None:
    """Refused unless the peer runs as our user (or root), or its group is allowed: a
    second local user can neither reach a service over shm nor pose as one."""
    pid, uid, gid = creds
    if uid in (os.getuid(), 0) or gid in allowed_gids:
        return
    raise Refused(f"shm peer (pid {pid}, uid {uid}, gid {gid}) is not this user "
                  f"(uid {os.getuid()}) and not in an allowed group {sorted(allowed_gids)}")


def _validate(peer: dict) -> None:
    ring = peer.get("ring_bytes")
    if type(ring) is not int or ring & (ring - 1) or not 2 * MAX_RECORD <= ring <= MAX_RING:
        raise ProtocolError(f"handshake field ring_bytes={ring!r} is invalid")


def _send_fds(sock: socket.socket, fds: list) -> hs.HandshakeGen:
    while True:
        try:
            socket.send_fds(sock, [_FD_MSG], fds, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            return
        except (BlockingIOError, InterruptedError):
            yield hs.WRITE
        except OSError as e:
            raise ConnectionClosed(f"shm handshake failed: {e}") from None


def _recv_fds(sock: socket.socket) -> hs.HandshakeGen:
    """The peer's [segment fd, doorbell fd]; anything else is closed and refused."""
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 16, 2, socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
            break
        except (BlockingIOError, InterruptedError):
            yield hs.READ
        except OSError as e:
            raise ConnectionClosed(f"shm handshake failed: {e}") from None
    if msg != _FD_MSG or len(fds) != 2:
        for fd in fds:
            os.close(fd)
        if not msg:
            raise ConnectionClosed("peer closed during the shm handshake")
        raise ProtocolError("bad fd message in the shm handshake")
    return fds
