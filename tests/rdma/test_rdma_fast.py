"""rdma://'s compiled fast path (transport/_rdmafast.c) on the rxe device: it carries the
common message where it is built, every mix of compiled and Python ends interoperates on
every message shape, its credits ride on the fast SENDs, and a hostile fast SEND gets the
same ProtocolError from either receiver. (The conformance kit runs on both paths too:
test_rdma_conformance.py; the parser against framing's without a device: test_rdmafast.py.)
"""
from __future__ import annotations

import random

import msgpack
import pytest

from transport import framing
from transport.errors import ProtocolError
from transport.testing.conformance import pattern, verify
from transport.testing.raw import send_raw

pytestmark = pytest.mark.rdma

PATHS = {"compiled": None, "python": False}


def test_the_compiled_path_carries_the_common_message(make_pair):
    """Where it is built (`make test` requires it), a connection takes the compiled path by
    default: one-slot messages are posted and received in C (its own counters move, the
    messages are its class), and the stats fold them in."""
    from transport import rdma_conn
    assert rdma_conn._rdmafast is not None, rdma_conn.NATIVE_ERROR
    c, s = make_pair(slot_size=4096, nslots=4)
    assert c.native and s.native and c._peer_fast and s._peer_fast
    for seq in range(20):
        slot = c.alloc(100)
        slot.array("u1", 100)[:] = pattern(seq, 100)
        c.send({"seq": seq}, [slot])
        assert c._link.msgs_out == seq + 1  # not folded into stats yet: it went the C way
        m = s.recv(timeout=10)
        assert type(m).__name__ == "_FastMessage" and m.header == {"seq": seq}
        verify(m.buffers[0], seq, 100, "fast message")
        m.release()
        reply = s.alloc(0)
        s.send({}, [reply])
        with c.recv(timeout=10) as r:
            assert r.header == {} and r.buffers[0].nbytes == 0
    assert c.stats.messages_sent == 20 and s.stats.messages_received == 20 and c._link.msgs_out == 0
    # every credit rode back on a fast SEND: no credit message was needed
    assert c._c.ctrl_budget == c._peer_nctrl and s._c.ctrl_budget == s._peer_nctrl
    # a message above the receive buffers: WRITE WITH IMMEDIATE into a slot, in C too
    n = 3000
    c2, s2 = make_pair(slot_size=4096, nslots=4, small_size=1024)
    for seq in range(12):  # three times the slots: each comes back, with its credit
        slot = c2.alloc(n)
        slot.array("u1", n)[:] = pattern(seq, n)
        c2.send({"seq": seq}, [slot])
        assert c2._link.msgs_out == 1
        m = s2.recv(timeout=10)
        assert type(m).__name__ == "_FastMessage" and m.header == {"seq": seq}
        assert s2.recv_pool.contains(m.buffers[0])  # it landed in a slot
        verify(m.buffers[0], seq, n, "fast WRITE")
        m.release()
        s2.send({}, [s2.alloc(0)])  # the slot goes back on the fast SEND (its head has room for one)
        assert s2._link.msgs_out == 1
        c2.recv(timeout=10).release()
        c2.stats, s2.stats  # fold the counters
    assert c2.stats.messages_sent == 12 and s2.stats.messages_received == 12


def test_native_false_is_the_python_path(make_pair):
    c, s = make_pair(slot_size=4096, nslots=4, native=False, server_native=False)
    assert not c.native and not s.native and c._link is None
    c.send({"a": 1}, [c.alloc(8)])
    with s.recv(timeout=10) as m:
        assert type(m).__name__ == "Message" and m.header == {"a": 1}


@pytest.mark.timeout(280)
@pytest.mark.parametrize("client,server", [(a, b) for a in PATHS for b in PATHS])
def test_every_mix_of_paths_interoperates(make_pair, client, server):
    """Both directions, a random mix of every message shape -- one slot small enough for a
    fast SEND (with {} or a header), a header too large for it, a large one (WRITE WITH
    IMMEDIATE), several buffers, no buffer, bytes to stage -- with messages held and
    released out of order, so credits come back on fast SENDs, DATA frames and credit
    messages: every message arrives intact and in order."""
    c, s = make_pair(slot_size=32 << 10, nslots=4, small_size=2048, native=PATHS[client],
                     server_native=PATHS[server])
    assert c.native == (client == "compiled") and s.native == (server == "compiled")
    rng = random.Random(f"{client}-{server}")
    big_header = {"pad": "x" * 600}  # packs above framing.MAX_FAST_USER: a DATA frame
    shapes = ["fast", "fast-header", "big-header", "large", "multi", "none", "bytes"]
    held = {c: [], s: []}
    for seq in range(300):
        a, b = (c, s) if rng.random() < 0.6 else (s, c)
        shape = rng.choice(shapes)
        header = {"seq": seq, **(big_header if shape == "big-header" else {})}
        if shape == "fast":
            header = {"seq": seq}
        n = {"large": rng.randrange(2048, 32 << 10), "none": 0}.get(shape, rng.randrange(0, 1500))
        if shape == "none":
            bufs = []
        elif shape == "multi":
            bufs = []
            for j in range(3):
                sl = a.alloc(n // 3)
                sl.array("u1", n // 3)[:] = pattern(seq + j, n // 3)
                bufs.append(sl)
        elif shape == "bytes":
            bufs = [pattern(seq, n).tobytes()]
        else:
            sl = a.alloc(n)
            sl.array("u1", n)[:] = pattern(seq, n)
            bufs = [sl]
        a.send(header, bufs, timeout=10)
        m = b.recv(timeout=10)
        assert m.header["seq"] == seq, (m.header, seq)
        if shape == "multi":
            assert len(m.buffers) == 3
            for j, buf in enumerate(m.buffers):
                verify(buf, seq + j, n // 3, f"message {seq} buffer {j}")
        elif shape == "none":
            assert m.buffers == []
        else:
            verify(m.buffers[0], seq, n, f"message {seq} ({shape})")
        held[b].append(m)
        while held[b] and (len(held[b]) >= 3 or rng.random() < 0.4):
            held[b].pop(rng.randrange(len(held[b]))).release()
    for ms in held.values():
        for m in ms:
            m.release()
    for a, b in ((c, s), (s, c)):  # and still in step both ways
        a.send({"seq": -1}, [a.alloc(10)])
        with b.recv(timeout=10) as m:
            assert m.header == {"seq": -1}
    assert c.stats.messages_sent == s.stats.messages_received
    assert s.stats.messages_sent == c.stats.messages_received
    assert c.stats.copies + s.stats.copies > 0  # the "bytes" shape was staged, and counted


def _fast(nbytes=4, credits=0, acks=0, user=b"", ulen=None, length=None, slot=0) -> bytes:
    ulen = len(user) if ulen is None else ulen
    data = framing.RFAST_HEAD.pack(framing.TAG_RFAST, nbytes, credits, acks, ulen, slot) + user
    data = data.ljust(framing.rfast_offset(len(user)), b"\0") + b"p" * nbytes
    return data if length is None else data[:length].ljust(length, b"\0")


HOSTILE = {
    "wrong-length": (_fast(nbytes=40, length=64 + 30), "fast SEND of 94 bytes"),
    "header-too-long": (_fast(nbytes=0, user=b"\x90", ulen=600, length=700), "exceeds the limit of 512"),
    "undecodable-header": (_fast(nbytes=0, user=b"\xc1\xc1"), "undecodable header"),
    "payload-over-slot": (_fast(nbytes=300), "limit 256"),
    "credits-never-given": (_fast(nbytes=4, credits=50), "more credits than it was given"),
    "acks-never-given": (_fast(nbytes=4, acks=200), "more credits than it was given"),
    "slot-never-given": (_fast(nbytes=4, slot=3), "credit for slot 2, which we do not hold"),
    "slot-out-of-range": (_fast(nbytes=4, slot=100), "credit for slot 99"),
    "write-over-slot": ("write", _fast(nbytes=2000), "limit 1024"),
    "write-header-too-long": ("write", _fast(nbytes=0, user=b"\x90", ulen=600, length=700), "exceeds the limit"),
    "write-credits-never-given": ("write", _fast(nbytes=4, credits=50), "more credits than it was given"),
}


def _raw_write(conn, data: bytes) -> None:
    """``data`` into the peer's next free slot by WRITE WITH IMMEDIATE, as a hostile peer
    could (its frame, its length: nothing checked here)."""
    import socket

    from transport.rdma_verbs import E
    hdr = conn._hdr.try_alloc()  # header room: larger than a slot's payload
    hdr.whole[:len(data)] = data
    s = conn._tx_slots.popleft()
    conn._tx_free[s] = 0
    conn._c.tx_credits -= 1
    conn._post_chain([(conn._hdr.address + hdr.offset, len(data), conn._hdr_lkey)],
                     E.IBV_WR_RDMA_WRITE_WITH_IMM, socket.htonl(s), conn._raddr + s * conn._rstride, [], hdr)


@pytest.mark.parametrize("receiver", list(PATHS))
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_fast_send_is_the_same_error_on_either_path(make_pair, case, receiver):
    """The compiled receiver declines what it does not take, and the Python path raises:
    the same ProtocolError whichever path the receiver runs, and the connection is torn
    down (nothing leaks: the fixture checks)."""
    how, data, why = HOSTILE[case] if len(HOSTILE[case]) == 3 else ("send",) + HOSTILE[case]
    c, s = make_pair(slot_size=256 if how == "send" else 1024, nslots=4, server_native=PATHS[receiver])
    assert s.native == (receiver == "compiled")
    send_raw(c, _fast(nbytes=3, user=msgpack.packb({"ok": 1})))  # a well-formed one first
    with s.recv(timeout=10) as m:
        assert m.header == {"ok": 1} and bytes(m.buffers[0]) == b"ppp"
    if how == "send":
        send_raw(c, data)
    else:
        _raw_write(c, data)
    with pytest.raises(ProtocolError, match=why):
        s.recv(timeout=10)
