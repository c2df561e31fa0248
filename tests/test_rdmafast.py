"""rdma://'s compiled fast path (transport/_rdmafast.c) where no device is needed: the
fixed-width fast SEND (framing.pack_rdma_fast / parse_rdma_fast) and the compiled parser
against it, and the Link refusing objects that are not pyverbs' QP and CQs. The message
path itself runs on the rxe device (tests/rdma/test_rdma_fast.py, the conformance kit on
both paths)."""
from __future__ import annotations

import os
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from transport import framing, rdma_conn
from transport.errors import ProtocolError
from transport.testing.rdmalink import check_parse

REQUIRED = os.environ.get("MOE_REQUIRE_NATIVE") == "1"
needs_native = pytest.mark.skipif(rdma_conn._rdmafast is None and not REQUIRED,
                                  reason="transport/_rdmafast.c is not built here (make deps builds it)")
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_PAYLOAD = 8192


def test_the_compiled_path_is_built_where_it_is_required():
    """`make test` sets MOE_REQUIRE_NATIVE=1: there the module must have been built (it needs
    verbs.h: libibverbs-dev, which `make deps` installs)."""
    if REQUIRED:
        assert rdma_conn._rdmafast is not None, f"transport/_rdmafast.c was not built: {rdma_conn.NATIVE_ERROR}"


@pytest.mark.parametrize("user", [b"", msgpack.packb({"seq": 7}), msgpack.packb("x" * 500)])
@pytest.mark.parametrize("nbytes", [0, 1, 4096])
@pytest.mark.parametrize("slot", [None, 0, 4095])
def test_pack_then_parse_round_trips(user, nbytes, slot):
    buf = bytearray(framing.rfast_offset(len(user)) + nbytes)
    off = framing.pack_rdma_fast(buf, 0, user, nbytes, 3, 1, slot)
    assert off % 64 == 0 and off >= framing.RFAST_SIZE + len(user)
    got = framing.parse_rdma_fast(buf, 0, off + nbytes, MAX_PAYLOAD)
    assert got == (msgpack.unpackb(user) if user else {}, [3, 1, [] if slot is None else [slot]], off, nbytes)
    assert framing.check_credit_return(got[1]) == (3, 1, got[1][2])
    check_parse(bytes(buf), len(buf), MAX_PAYLOAD)


def head(nbytes=4, credits=0, acks=0, ulen=0, tag=framing.TAG_RFAST, slot=0):
    return framing.RFAST_HEAD.pack(tag, nbytes, credits, acks, ulen, slot)


@pytest.mark.parametrize("data,length,why", [
    (head(nbytes=5).ljust(68, b"\0"), 68, "5 B of payload"),  # the length says 4
    (head(ulen=513).ljust(1024, b"\0"), 1024, "exceeds the limit"),
    (head(nbytes=MAX_PAYLOAD + 1).ljust(64 + MAX_PAYLOAD + 1, b"\0"), 64 + MAX_PAYLOAD + 1, "limit"),
    (head(nbytes=0, ulen=2) + b"\xc1\xc1", 64, "undecodable"),  # 0xc1 is never valid msgpack
    (head(nbytes=0, ulen=3) + b"\x01\x02\x03", 64, "undecodable"),  # trailing bytes
], ids=["length", "header-limit", "payload-limit", "garbage-header", "trailing-bytes"])
def test_malformed_fast_sends_are_protocol_errors(data, length, why):
    data = data.ljust(length, b"\0")
    with pytest.raises(ProtocolError, match=why):
        framing.parse_rdma_fast(data, 0, length, MAX_PAYLOAD)
    check_parse(data, length, MAX_PAYLOAD)  # the compiled parser declines each


def test_a_fast_write_fills_part_of_its_slot():
    """In a slot the frame may end anywhere before the slot does (the completion of a WRITE
    WITH IMMEDIATE says no length); past the slot's end it is a ProtocolError."""
    frame = head(nbytes=100) + b"\0" * 48 + b"p" * 100
    slot = frame.ljust(4096, b"\xee")
    assert framing.parse_rdma_fast_slot(slot, 0, len(slot), MAX_PAYLOAD) == ({}, [0, 0, []], 64, 100)
    with pytest.raises(ProtocolError, match="fast SEND of 4096 bytes"):
        framing.parse_rdma_fast(slot, 0, len(slot), MAX_PAYLOAD)  # as a SEND the length must match
    with pytest.raises(ProtocolError, match="100 B of payload"):
        framing.parse_rdma_fast_slot(frame, 0, 163, MAX_PAYLOAD)  # one byte short of the payload
    for length, slot_mode in ((len(slot), True), (len(slot), False), (163, True)):
        check_parse(slot, length, MAX_PAYLOAD, slot_mode)


def test_other_sends_are_not_fast_sends():
    """A DATA frame, a shm fast record and a short SEND are left to the other parsers."""
    data = b"".join(bytes(memoryview(p)) for p in framing.frame_data({}, [b"abcd"], 0))
    assert framing.parse_rdma_fast(data, 0, len(data), MAX_PAYLOAD) is None
    shm_rec = framing.FAST_HEAD.pack(framing.TAG_FAST, 1, 4)
    assert framing.parse_rdma_fast(shm_rec, 0, 16, MAX_PAYLOAD) is None
    assert framing.parse_rdma_fast(head()[:15], 0, 15, MAX_PAYLOAD) is None
    for d in (data, shm_rec, head()[:15]):
        check_parse(d, len(d), MAX_PAYLOAD)


sends = st.one_of(
    st.builds(lambda k, c, a, s, u: head(k, c, a, len(u), slot=s) + u + b"\0" * (-(16 + len(u)) % 64) + b"p" * k,
              st.integers(0, 300), st.integers(0, 0xFFFF), st.integers(0, 0xFFFF), st.sampled_from([0, 1, 0xFFFF]),
              st.sampled_from([b"", msgpack.packb({"a": 1}), b"\xc1", msgpack.packb(list(range(100)))])),
    st.builds(lambda k, c, a, u, s, rest: head(k, c, a, u, slot=s) + rest, st.integers(0, (1 << 32) - 1),
              st.integers(0, 0xFFFF), st.integers(0, 0xFFFF), st.integers(0, 0xFFFF), st.integers(0, 0xFFFF),
              st.binary(max_size=200)),
    st.binary(max_size=200),
)


@needs_native
@SETTINGS
@given(data=sends, cut=st.integers(0, 64), max_payload=st.sampled_from([0, 64, 300, MAX_PAYLOAD]))
@example(data=head(4) + b"\0" * 48 + b"abcd", cut=0, max_payload=MAX_PAYLOAD)
@example(data=head(4) + b"\0" * 48 + b"abcd" + b"rest of the slot", cut=0, max_payload=MAX_PAYLOAD)
def test_compiled_parser_agrees_with_framing(data, cut, max_payload):
    """Whatever a peer leaves in a receive buffer or slot and whatever length the completion
    (or the slot) says: the compiled parser takes the same fast frames with the same result,
    or declines."""
    check_parse(data, max(0, len(data) - cut), max_payload)
    check_parse(data, max(0, len(data) - cut), max_payload, slot=True)


@needs_native
def test_the_link_refuses_what_is_not_a_pyverbs_qp():
    """The QP pointer is searched for in pyverbs' object and verified (QP number, its CQs in
    the CQ objects); anything else is a LookupError, and the connection keeps the Python
    path. The candidates are read with process_vm_readv: random words never fault."""
    class Fake:
        __slots__ = ("a", "b", "c")

    fake = Fake()
    fake.a, fake.b, fake.c = 0, struct.pack("Q", 0xdeadbeef), object()
    with pytest.raises(LookupError, match="QP pointer"):
        rdma_conn._rdmafast.Link(
            qp=fake, qpn=5, recv_cq=object(), send_cq=object(), rb_addr=0, rb_stride=0, rb_size=0, rb_lkey=0,
            nrecv=0, rb_mem=memoryview(b""), recv_max=0, recv_nslots=0, pool=None, free=[], in_use=[], slots=[],
            sp_addr=0, sp_stride=0, room=0, sp_lkey=0, max_message=0, peer_small=0, max_inline=0, sq_depth=1,
            sig_every=1, flush_at=1, ack_at=1, peer_nslots=1, peer_nctrl=1, peer_fast=True, spin=0.0, inbox=[],
            inflight=[], owed_slots=[], tx_slots=[], tx_free=bytearray(1), raddr=0, rkey=0, rstride=0,
            rp_mem=memoryview(b""), rp_addr=0, rp_stride=0, rp_size=0, rp_free=[], rp_in_use=[])
