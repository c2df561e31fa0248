"""Checks: limits refused before anything is sent, and malformed frames from a peer."""
from __future__ import annotations

from typing import Optional

import numpy as np

from transport import framing
from transport.errors import ConnectionClosed, ProtocolError
from transport.framing import Kind
import transport.testing.raw as raw

from .env import PairEnv
from .helpers import (expect_closed, expect_nothing, filled_slot, raises, recv_seq, roundtrip, send_seq,
                      timed, verify)


def check_over_limit(env: PairEnv) -> None:
    """One byte over ``max_message`` is a ValueError before anything is sent (alloc, an
    unregistered buffer, several buffers adding up); the connection keeps working."""
    client, server = env.pair()
    m = client.max_message
    raises(ValueError, lambda: client.alloc(m + 1), "alloc(max_message + 1)")
    raises(ValueError, lambda: client.send("big", [bytes(m + 1)]), "send of max_message + 1 bytes")
    raises(ValueError, lambda: client.send("big", [np.zeros(m + 1, np.uint8)]), "send of a large array")
    half = m // 2 + 1
    raises(ValueError, lambda: client.send("sum", [client.alloc(half), client.alloc(half)]),
           "two slots adding up to more than max_message")
    raises(ValueError, lambda: client.send("sum", [bytes(half), bytes(half)]),
           "two buffers adding up to more than max_message")
    expect_nothing(server, 0.1)
    # every slot is usable again: nothing leaked by the refusals
    for seq in range(3 * env.options["nslots"]):
        send_seq(client, seq, 1000, timeout=5)
        recv_seq(server, seq, 1000)
    roundtrip(client, server, 100)
    assert client.stats.messages_sent == 3 * env.options["nslots"] + 1


def check_header_limits(env: PairEnv) -> None:
    """A header msgpack cannot encode is a TypeError, one over the header limit or more
    buffers than the limit a ValueError, all before anything is sent; the connection works."""
    client, server = env.pair(slot_size=1 << 16, nslots=framing.MAX_BUFFERS)
    raises(TypeError, lambda: client.send({"f": object()}), "unserialisable header")
    raises(TypeError, lambda: client.send({"s": {1, 2}}), "a set in the header")
    raises(ValueError, lambda: client.send({"pad": b"x" * (framing.MAX_HEADER + 1)}),
           "a header over the limit")
    raises(ValueError, lambda: client.send("many", [b"x"] * (framing.MAX_BUFFERS + 1)),
           "more buffers than the limit")
    expect_nothing(server, 0.1)
    # just under the limits works
    h = {"pad": b"x" * (framing.MAX_HEADER - 1000)}
    client.send(h, [filled_slot(client, i, 3) for i in range(framing.MAX_BUFFERS)])
    with server.recv(timeout=5) as msg:
        assert msg.header == h and len(msg.buffers) == framing.MAX_BUFFERS
        for i, b in enumerate(msg.buffers):
            verify(b, i, 3)
    roundtrip(client, server)


def _bad_frames(max_payload: int) -> list[tuple[str, bytes]]:
    P = framing.PREFIX
    good_head = framing.encode_header({"x": 1}, [4])
    prefix = framing.encode_prefix

    def data(head: bytes, payload: bytes = b"", plen: Optional[int] = None) -> bytes:
        return prefix(Kind.DATA, len(head), len(payload) if plen is None else plen) + head + payload

    return [
        ("bad magic", P.pack(b"XX", framing.VERSION, Kind.DATA, len(good_head), 4) + good_head + b"abcd"),
        ("bad version", P.pack(framing.MAGIC, 99, Kind.DATA, len(good_head), 4) + good_head + b"abcd"),
        ("bad kind", P.pack(framing.MAGIC, framing.VERSION, 99, len(good_head), 4) + good_head + b"abcd"),
        ("kind zero", P.pack(framing.MAGIC, framing.VERSION, 0, 0, 0)),
        ("header longer than the limit", prefix(Kind.DATA, framing.MAX_HEADER + 1, 0)),
        ("payload larger than the slot",
         data(framing.encode_header({}, [max_payload + 1]), plen=max_payload + 1)),
        ("garbage msgpack header", data(b"\xc1" * 12, b"abcd", plen=4)),
        ("truncated msgpack header", data(good_head[:-3], b"abcd", plen=4)),
        ("header is not a triple", data(framing._packer.pack({"x": 1}), b"abcd")),
        ("buffer lengths do not sum to payload_len",
         data(framing.encode_header({}, [3, 4]), b"0123456789")),
        ("negative buffer length", data(framing._packer.pack([{}, [-1, 5], None]), b"abcd")),
        ("too many buffers",
         data(framing.encode_header({}, [0] * (framing.MAX_BUFFERS + 1)))),
        ("DATA without a header", prefix(Kind.DATA, 0, 4) + b"abcd"),
        ("HELLO after the handshake", b"".join(framing.encode_hello({"transport": "moe-transport"}))),
    ]


def check_malformed_frames(env: PairEnv) -> None:
    """A malformed frame makes the receiver raise ProtocolError and close that connection
    (the sender then sees ConnectionClosed); the listener keeps serving good clients."""
    lst = env.listen()
    client, server = env.accept_pair(lst)
    cases = _bad_frames(client.max_message)
    for what, frame in cases:
        roundtrip(client, server)
        raw.send_raw(client, frame)
        err, dt = timed(lambda: server.recv(timeout=5))
        assert isinstance(err, ProtocolError), f"{what}: the receiver got {err!r} after {dt:.2f} s"
        assert server.closed, f"{what}: the connection was not closed after ProtocolError"
        assert server.state == "BROKEN" and not server.send_ready(), f"{what}: {server.state}"
        raises(ConnectionClosed, lambda: server.recv(timeout=0.1), f"{what}: recv after ProtocolError")
        expect_closed(client, 5 + env.slack, f"{what}: the sender of the bad frame")
        # a new client on the same listener is served
        client, server = env.accept_pair(lst)
    roundtrip(client, server)
