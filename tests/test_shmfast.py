"""shm://'s compiled fast path (transport/_shmfast.c) against the Python path it replaces.

The Link is tested without sockets or a second process: two anonymous mappings laid out as
two segments, the record rings and words written by hand. For any bytes a peer can put in
its ring, the compiled recv either makes exactly the message the Python path makes
(framing.parse_fast_record, the same ring checks) and consumes exactly that record, or
declines and touches nothing (the Python path then reads it, and raises what is wrong).
Its send writes the bytes framing.pack_fast_record writes, or declines and writes nothing.
Then real connections: every mix of compiled and Python ends interoperates, and the
counters agree.
"""
from __future__ import annotations

import os
import struct
import threading
import uuid

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import transport
from transport import framing, shm
from transport.base import BROKEN
from transport.errors import ProtocolError, TransportError
from transport.testing.shmlink import NSLOTS, RING, SLOT, Segments, check_recv
from transport.shmring import (REC_HDR, W_ARMED_DATA, W_ARMED_SPACE, W_OUT_HEAD, W_OUT_TAIL, W_RET_HEAD,
                               W_RET_TAIL, W_RUNG)

REQUIRED = os.environ.get("MOE_REQUIRE_NATIVE") == "1"
needs_native = pytest.mark.skipif(not shm.NATIVE_AVAILABLE and not REQUIRED,
                                  reason="transport/_shmfast.c is not built here (make deps builds it)")
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_the_compiled_path_is_built_where_it_is_required():
    """`make test` sets MOE_REQUIRE_NATIVE=1: there the module must have been built. Anywhere,
    native=True asks for it: it works when built and says how to build it when not."""
    if REQUIRED:
        assert shm.NATIVE_AVAILABLE, "transport/_shmfast.c was not built (make deps: gcc, python3-dev)"
    name = f"moe-native-{uuid.uuid4().hex[:8]}"
    if shm.NATIVE_AVAILABLE:
        transport.listen(f"shm://{name}", native=True).close()
    else:
        with pytest.raises(TransportError, match="make deps"):
            transport.listen(f"shm://{name}", native=True)
    with pytest.raises(ValueError):
        transport.listen(f"shm://{name}", native="yes")


@pytest.fixture
def segs():
    s = Segments()
    yield s
    s.close()


records = st.one_of(
    st.builds(lambda s, k, u: framing.FAST_HEAD.pack(framing.TAG_FAST, s, k) + u,
              st.integers(0, NSLOTS + 1), st.integers(0, SLOT + 1),
              st.one_of(st.just(b""), st.builds(lambda h: msgpack.packb(h), st.dictionaries(
                  st.text(max_size=6), st.one_of(st.integers(-2**63, 2**64 - 1), st.text(max_size=10), st.none()), max_size=4)),
                  st.binary(max_size=40))),
    st.binary(max_size=80))


@needs_native
@SETTINGS
@given(rec=records, head=st.integers(0, 3 * RING), length=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
       extra=st.integers(-8, 64), flip=st.one_of(st.none(), st.tuples(st.integers(0, 79), st.integers(0, 255))))
@example(rec=framing.FAST_HEAD.pack(framing.TAG_FAST, 1, 10), head=RING - 24, length=None, extra=0, flip=None)
@example(rec=framing.FAST_HEAD.pack(framing.TAG_FAST, 1, 10), head=RING - 16, length=None, extra=0, flip=None)
@example(rec=framing.FAST_HEAD.pack(framing.TAG_FAST, 1, 10) + b"\xc1", head=0, length=None, extra=0, flip=None)
def test_recv_makes_what_the_python_path_makes_or_touches_nothing(rec, head, length, extra, flip):
    if flip is not None and flip[0] < len(rec):
        rec = rec[:flip[0]] + bytes([flip[1]]) + rec[flip[0] + 1:]
    n = len(rec) if length is None else length
    check_recv(rec, head, n, head + max(0, ((min(n, 1 << 20) + 15) & ~7) + extra))


@needs_native
@SETTINGS
@given(slot=st.integers(0, 2**32 - 1), nbytes=st.integers(0, 2**64 - 1),
       user=st.one_of(st.just(b""), st.binary(max_size=framing.MAX_FAST_USER + 8)), tail=st.integers(0, 3 * RING),
       backlog=st.integers(0, RING + 8))
def test_send_writes_what_pack_fast_record_writes_or_nothing(slot, nbytes, user, tail, backlog):
    s = Segments()
    try:
        s.w[W_OUT_HEAD] = max(0, tail - backlog)
        before = bytes(s.out_ring)
        link = s.link(out_tail=tail)
        n = framing.FAST_SIZE + len(user)
        need = (n + 15) & ~7
        pos = tail & (RING - 1)
        fits = n <= framing.MAX_FAST_RECORD and pos + need <= RING and min(backlog, tail) <= RING - need
        assert link.send(slot, nbytes, user) == (0 if fits else -1)
        if not fits:
            assert bytes(s.out_ring) == before and link.out_tail == tail and s.w[W_OUT_TAIL] == 0
            return
        want = bytearray(need)
        struct.pack_into("<II", want, 0, n, 0)
        framing.pack_fast_record(want, REC_HDR, user, slot, nbytes)
        assert bytes(s.out_ring[pos:pos + REC_HDR + n]) == bytes(want[:REC_HDR + n])
        assert link.out_tail == tail + need and s.w[W_OUT_TAIL] == tail + need
        assert (link.msgs_out, link.bytes_out) == (1, nbytes)
    finally:
        s.close()


@needs_native
def test_send_rings_only_a_peer_that_sleeps_with_everything_taken(segs):
    link = segs.link()
    assert link.send(0, 1, b"") == 0 and link.rung_sent == 0  # not armed: no ring
    segs.pw[W_ARMED_DATA] = 1
    assert link.send(0, 1, b"") == 0 and link.rung_sent == 0  # armed, but a record is unread
    segs.w[W_OUT_HEAD] = link.out_tail
    assert link.send(0, 1, b"") == 0 and link.rung_sent == 1 and segs.pw[W_RUNG] == 1
    assert os.eventfd_read(segs.peer_bell) == 1


@needs_native
def test_give_back_returns_the_slot_and_refuses_a_corrupted_ring(segs):
    link = segs.link()
    for i in range(8):
        assert link.give_back(i) == 0
    assert list(segs.pret[:8]) == list(range(8)) and segs.pw[W_RET_TAIL] == 8 == link.ret_tail
    assert link.give_back(1) == -1  # 8 outstanding in a ring of 8: the peer never took them
    segs.pw[W_RET_HEAD] = 8
    segs.pw[W_ARMED_SPACE] = 1  # the peer waits for a slot: it is rung
    assert link.give_back(3) == 0 and link.rung_sent == 1
    segs.pw[W_RET_HEAD] = 2**63  # a head past the tail: corrupted
    assert link.give_back(3) == -1 and link.ret_tail == 9


@needs_native
def test_a_closed_link_declines_everything_and_keeps_its_cursors(segs):
    link = segs.link(out_tail=40, in_head=8)
    link.close()
    assert link.send(0, 1, b"") == -1 and link.recv(None) is None and link.give_back(0) == -1
    assert (link.out_tail, link.in_head, link.open) == (40, 8, 0)
    link.close()  # idempotent
    for v in (segs.w, segs.out_ring, segs.mine):
        v.release()
    segs.ours.close()  # BufferError if the link still held the mapping


# -- real connections ---------------------------------------------------------------------------
def _pair(client_native, server_native, **opts):
    url = f"shm://moe-native-{uuid.uuid4().hex[:8]}"
    opts = dict(slot_size=4096, nslots=4, timeout=5, **opts)
    lst = transport.listen(url, native=server_native, **opts)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("c", transport.connect(url, native=client_native, **opts)))
    t.start()
    s = lst.accept(timeout=5)
    t.join(5)
    return lst, box["c"], s


MODES = [None, False] if not shm.NATIVE_AVAILABLE and not REQUIRED else [True, False]


@pytest.mark.parametrize("client_native", MODES)
@pytest.mark.parametrize("server_native", MODES)
def test_compiled_and_python_ends_interoperate(client_native, server_native):
    """Either end may run either path (the bytes are the same): headers of every form,
    the ring wrapped many times, the general path between, counters as the Python path
    keeps them."""
    lst, c, s = _pair(client_native, server_native)
    try:
        assert c.native is bool(client_native) and s.native is bool(server_native)
        headers = [{}, {"seq": 1}, [1, 2], None, "x" * 600]  # the last one is too big for a fast record
        total = 0
        for i in range(600):
            h = headers[i % len(headers)]
            if isinstance(h, dict) and h:
                h = {"seq": i}
            a, b = (c, s) if i % 2 == 0 else (s, c)
            slot = a.alloc(i % 97)
            slot.buf[:] = bytes([i % 251]) * (i % 97)
            a.send(h, [slot], timeout=5)
            total += i % 97
            with b.recv(timeout=5) as m:
                assert m.header == h and bytes(m.buffers[0]) == bytes([i % 251]) * (i % 97)
            if i % 50 == 0:
                a.send({"n": i}, [a.alloc(3), b"xyz"], timeout=5)  # the general path between
                with b.recv(timeout=5) as m:
                    assert m.header == {"n": i} and [x.nbytes for x in m.buffers] == [3, 3]
        sent = c.stats.messages_sent + s.stats.messages_sent
        got = c.stats.messages_received + s.stats.messages_received
        assert sent == got == 612
        assert c.stats.bytes_sent + s.stats.bytes_sent == total + 12 * 6
    finally:
        c.close(), s.close(), lst.close()


@pytest.mark.parametrize("native", MODES)
def test_a_message_released_after_close_neither_raises_nor_returns(native):
    lst, c, s = _pair(native, native)
    try:
        c.send({"a": 1}, [c.alloc(10)])
        m = s.recv(timeout=5)
        s.close()
        m.release()  # the connection is gone: nothing to give back, and no error
        assert m.released and m.buffers == []
        m.release()
    finally:
        c.close(), s.close(), lst.close()


@needs_native
def test_default_connections_take_the_compiled_path():
    lst, c, s = _pair(None, None)
    try:
        assert c.native and s.native
        c.send({}, [c.alloc(5)])
        with s.recv(timeout=5) as m:
            assert type(m) is shm._NativeSlotMessage and m.header == {}
    finally:
        c.close(), s.close(), lst.close()


@needs_native
def test_compiled_send_and_alloc_decline_to_the_python_path_which_raises():
    """What the compiled send and alloc do not take (a header msgpack cannot pack, another
    pool's slot, two buffers, a pool with no free slot, a peer gone) gets the Python path's
    answer: the same error, the slot back in the pool, nothing written."""
    lst, c, s = _pair(None, None)
    try:
        assert c.native
        free = c.send_pool.available
        with pytest.raises(TypeError, match="msgpack"):
            c.send({"x": object()}, [c.alloc(4)])
        assert c.send_pool.available == free and c.stats.messages_sent == 0
        with pytest.raises(ValueError):
            c.alloc(c.max_message + 1)
        c.send({"n": 2}, (c.alloc(2), b"ab"))  # two buffers: the general record
        other = s.alloc(3)  # a slot of another pool is not ours to describe: refused, not sent
        with pytest.raises(TypeError):
            c.send({"n": 3}, [other])
        other.release()
        with s.recv(timeout=5) as m:
            assert m.header == {"n": 2} and type(m) is not shm._NativeSlotMessage
        assert not s.pending()
        held = [c.alloc(1) for _ in range(c.send_pool.nslots)]
        with pytest.raises(transport.Timeout):
            c.alloc(1, timeout=0.05)
        for h in held:
            h.release()
        s.close()
        with pytest.raises(transport.ConnectionClosed):
            for _ in range(20):
                c.send({}, [c.alloc(1)], timeout=1)
    finally:
        c.close(), s.close(), lst.close()


@needs_native
def test_the_public_methods_are_compiled_and_keywords_take_the_python_path():
    """alloc, send and recv are the extension's methods (no Python frame for the common
    message); a call with keywords, or one the compiled path declines, gets the Python
    method's answer, the same messages in order."""
    assert "ShmConnection" in repr(shm.ShmConnection.recv) and not hasattr(shm.ShmConnection.recv, "__code__")
    lst, c, s = _pair(None, None)
    try:
        for i in range(40):
            slot = c.alloc(8) if i % 2 else c.alloc(nbytes=8, timeout=5)
            slot.buf[:] = i.to_bytes(8, "little")
            if i % 3:
                c.send({"i": i}, [slot])
            else:
                c.send({"i": i}, buffers=[slot], timeout=5)
            m = s.recv(5) if i % 2 else s.recv(timeout=5)
            assert m.header == {"i": i} and int.from_bytes(m.buffers[0], "little") == i
            m.release()
        with pytest.raises(transport.Timeout):
            s.recv(0.05)  # nothing there: the Python path waits, bounded
        with pytest.raises(TypeError):
            s.recv(1, 2)  # what the Python method says of a bad call
    finally:
        c.close(), s.close(), lst.close()


@pytest.mark.parametrize("native", MODES)
def test_a_sender_reuses_the_slot_given_back_last(native):
    """Returns are taken before a slot is popped, so the slot the peer gave back last is the
    one written next: with one message in flight a sender writes one slot over and over (a
    sender that took returns only when its pool ran dry would go through all four first,
    faulting each one in, in both processes)."""
    lst, c, s = _pair(native, native)
    try:
        used = []
        for i in range(12):
            slot = c.alloc(8)
            used.append(slot.index)
            slot.buf[:] = i.to_bytes(8, "little")
            c.send({}, [slot], timeout=5)
            with s.recv(timeout=5) as m:
                assert int.from_bytes(m.buffers[0], "little") == i
        assert set(used) == {used[0]}
        first, second = c.alloc(1), c.alloc(1)  # two in flight, given back in the other order
        c.send({}, [first], timeout=5)
        c.send({}, [second], timeout=5)
        m1, m2 = s.recv(timeout=5), s.recv(timeout=5)
        m2.release()
        m1.release()
        assert c.alloc(1).index == first.index and c.alloc(1).index == second.index
        assert c._w[shm.W_RET_HEAD] == c._cur.ret_head == 14  # the peer sees every return taken
    finally:
        c.close(), s.close(), lst.close()


@pytest.mark.parametrize("native", MODES)
@pytest.mark.parametrize("bad", ["never lent", "twice", "past the tail"])
def test_a_peer_that_returns_what_it_did_not_have_breaks_the_connection(native, bad):
    """A hostile peer writes our return ring: an id out of range, one returned twice, or a tail
    further than the ring holds. The next alloc raises ProtocolError and the connection is
    BROKEN, on either path (the compiled one takes the good return and leaves the rest to the
    Python path, which says what is wrong)."""
    lst, c, s = _pair(native, native)
    try:
        slot = c.alloc(1)
        c.send({}, [slot], timeout=5)
        s.recv(timeout=5).release()  # a good return, not yet taken
        ring, tail = c._returns.ids, c._w[W_RET_TAIL]
        if bad == "past the tail":
            c._w[W_RET_TAIL] = tail + len(ring) + 1
        else:
            ring[tail % len(ring)] = 99 if bad == "never lent" else slot.index
            c._w[W_RET_TAIL] = tail + 1
        with pytest.raises(ProtocolError, match="did not have|corrupted the return ring"):
            c.alloc(1)
        assert c._state == BROKEN
        with pytest.raises(transport.ConnectionClosed):
            c.alloc(1)
    finally:
        c.close(), s.close(), lst.close()
