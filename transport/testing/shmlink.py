"""Two shm segments without a connection, for driving transport/_shmfast.c's Link by hand:
the hypothesis tests (tests/test_shmfast.py) and the atheris harness
(tests/fuzz/fuzz_framing.py) put a peer's bytes in its ring and compare the compiled
recv with :func:`reference`, what shm.py's Python path makes of the same bytes."""
from __future__ import annotations

import mmap
import os
import struct

import msgpack

from transport import framing
from transport.shmring import PAGE, REC_HDR, W_ARMED_DATA, W_OUT_HEAD, W_OUT_TAIL, Layout

SLOT, NSLOTS, RING = 4096, 8, 4096


class Segments:
    """Our segment and the peer's, as anonymous mappings with shm.py's layout."""

    def __init__(self):
        self.lay = Layout(RING, 8, SLOT, NSLOTS, SLOT)
        self.ours = mmap.mmap(-1, self.lay.total)
        self.theirs = mmap.mmap(-1, self.lay.total)
        self.mine, self.peer = memoryview(self.ours), memoryview(self.theirs)
        self.w, self.pw = self.mine[:PAGE].cast("Q"), self.peer[:PAGE].cast("Q")
        lay = self.lay
        self.in_ring = self.peer[lay.ring_off:lay.ring_off + RING]
        self.out_ring = self.mine[lay.ring_off:lay.ring_off + RING]
        self.pret = self.peer[lay.ret_off:lay.ret_off + 4 * lay.ret_cap].cast("I")
        self.pool = self.peer[lay.pool_off:lay.pool_off + SLOT * NSLOTS]
        for i in range(len(self.pool)):
            self.pool[i] = i % 251
        self.recv_mem = self.pool.toreadonly()
        self.bell, self.peer_bell = os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)

    def link(self, **cursors):
        from transport import _shmfast
        lay = self.lay
        c = {**dict(out_tail=0, in_head=0, ret_tail=0, ret_head=0, rung_sent=0, rung_seen=0), **cursors}
        return _shmfast.Link(self.mine, lay.ring_off, RING, self.peer, lay.ring_off, RING, lay.ret_off,
                             lay.ret_cap, lay.ret_off, lay.ret_cap, self.recv_mem, SLOT, SLOT, NSLOTS, self.bell,
                             self.peer_bell, framing.unpack_fast_user, framing.MAX_FAST_RECORD, framing.TAG_FAST,
                             c["out_tail"], c["in_head"], c["ret_tail"], c["ret_head"], c["rung_sent"],
                             c["rung_seen"])

    def close(self):
        os.close(self.bell)
        os.close(self.peer_bell)


def reference(ring, head: int, tail: int):
    """What shm.py's Python path makes of the record at ``head``: ((user, slot, nbytes),
    its ring bytes), or None when it is not a well-formed fast record that fits."""
    avail = tail - head
    if avail == 0 or avail > RING:
        return None
    pos = head & (RING - 1)
    if pos + 4 > RING:
        return None
    n = struct.unpack_from("<I", ring, pos)[0]
    need = (n + 15) & ~7
    if not (n <= framing.MAX_FAST_RECORD and need <= avail and pos + need <= RING):
        return None
    try:
        got = framing.parse_fast_record(ring, pos + REC_HDR, n, SLOT, NSLOTS)
    except framing.ProtocolError:
        return None
    return (got, need) if got is not None else None


def check_recv(rec: bytes, head: int, n: int, tail: int) -> None:
    """Put ``rec`` in the peer's ring at ``head`` as a record announcing ``n`` bytes, the
    peer's tail at ``tail``; AssertionError unless the compiled recv makes what
    :func:`reference` makes and consumes exactly its bytes, or declines and touches nothing."""
    from transport.shm import _NativeSlotMessage
    s = Segments()
    try:
        pos = head & (RING - 1)
        framed = struct.pack("<II", n & 0xFFFFFFFF, 0) + rec
        room = RING - pos
        s.in_ring[pos:pos + min(room, len(framed))] = framed[:room]
        s.pw[W_OUT_TAIL] = tail
        s.pw[W_OUT_HEAD] = head
        link = s.link(in_head=head)
        conn = object()
        want = reference(s.in_ring, head, tail)
        got = link.recv(conn)
        if want is None:
            assert got is None, got
            assert link.in_head == head and s.pw[W_OUT_HEAD] == head and link.msgs_in == 0
            return
        (user, slot, k), need = want
        assert type(got) is _NativeSlotMessage
        assert msgpack.packb(got.header) == msgpack.packb(user) and type(got.header) is type(user)
        assert got._token == slot and got._conn is conn and got.released is False
        assert bytes(got.buffers[0]) == bytes(s.recv_mem[slot * SLOT:slot * SLOT + k])
        assert got.buffers[0].readonly
        assert link.in_head == head + need and s.pw[W_OUT_HEAD] == head + need and s.w[W_ARMED_DATA] == 1
        assert (link.msgs_in, link.bytes_in) == (1, k)
        got.buffers[0].release()
        link.close()
    finally:
        s.close()
