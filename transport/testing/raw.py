"""Putting raw bytes on a connection's wire, for tests only (the conformance kit's bad frames).

Production connections have no such door: this module reaches into each backend's
internals, keyed by URL scheme, so that the public classes carry no testing hook.
A backend (or a test double) that wants the kit's malformed-frame checks registers a
function with :func:`register`.
"""
from __future__ import annotations

from typing import Callable

from transport.base import Connection, Deadline
from transport.errors import Timeout

RawSender = Callable[[Connection, bytes], None]
_SENDERS: dict[str, RawSender] = {}


def register(scheme: str, fn: RawSender) -> None:
    _SENDERS[scheme] = fn


def send_raw(conn: Connection, frame: bytes) -> None:
    """Put ``frame`` (a framing.py frame: prefix, header, payload back to back) on
    ``conn``'s wire, ring or queue as if it were a frame, bypassing every check, so that
    the peer's validation can be tested."""
    scheme = conn.url.split("://", 1)[0]
    try:
        fn = _SENDERS[scheme]
    except KeyError:
        raise NotImplementedError(f"no raw sender for {scheme}:// (transport.testing.raw.register)") from None
    if conn._state:
        raise conn._closed_error()
    fn(conn, frame)


def _tcp(conn, frame: bytes) -> None:
    conn._write_rest([memoryview(frame)], 0, len(frame), None, None)


def _shm(conn, frame: bytes) -> None:
    if conn._out.push(frame) is None:
        raise Timeout("ring full")
    conn._acq()
    conn._rel()
    conn._ring()


def _rdma(conn, frame: bytes) -> None:
    from transport.rdma_verbs import E

    if len(frame) > conn._peer_small:
        raise ValueError(f"a raw frame must fit the peer's receive buffers ({conn._peer_small} B)")
    deadline = Deadline(conn.default_timeout)
    while conn._c.tx_credits <= 0:
        conn._wait(deadline, "waiting for credits")
    hdr = conn._wait_hdr(deadline)
    hdr.whole[:len(frame)] = frame
    conn._ensure_sq(1, deadline)
    conn._c.tx_credits -= 1
    conn._post_chain([(conn._hdr.address + hdr.offset, len(frame), conn._hdr_lkey)],
                     E.IBV_WR_SEND, 0, None, [], hdr)


def _inproc(conn, frame: bytes) -> None:
    conn._push(bytes(frame), None)


register("tcp", _tcp)
register("shm", _shm)
register("rdma", _rdma)
register("inproc", _inproc)
