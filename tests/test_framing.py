"""transport/framing.py without sockets: round trips, incremental feeding, every limit,
and seeded fuzzing: whatever bytes come in, the parser either yields frames or raises
ProtocolError, never anything else. FrameParser drives framing.next_frame, the parser
tcp's receive path runs (tests/test_fuzz_parsers.py fuzzes every backend's parser)."""
import random
import struct

import msgpack
import pytest

from transport import framing
from transport.errors import ProtocolError
from transport.framing import Frame, FrameParser, Kind, next_frame

P = framing.PREFIX


def wire(parts) -> bytes:
    return b"".join(bytes(memoryview(p)) for p in parts)


def data_frame(header, payloads, extra=None) -> bytes:
    return wire(framing.frame_data(header, payloads, extra))


def raw_data(head: bytes, payload: bytes = b"", plen=None) -> bytes:
    return framing.encode_prefix(Kind.DATA, len(head), len(payload) if plen is None else plen) + head + payload


def parse_all(data: bytes, **limits) -> list[Frame]:
    return FrameParser(**limits).feed(data)


# -- round trips ------------------------------------------------------------------------
HEADERS = [None, 0, "", [], {}, False, {"op": "x", "n": [1, 2, {"k": b"\x00"}]}, 2**64 - 1, -(2**63),
           "ünï", b"bin", [[[]]], {1: 2}]


@pytest.mark.parametrize("header", HEADERS, ids=repr)
def test_data_round_trip_header_exact(header):
    (f,) = parse_all(data_frame(header, [b"abc"]))
    assert f.kind == Kind.DATA
    assert f.header == header and type(f.header) is type(header)
    assert f.lens == [3] and bytes(f.payload) == b"abc"


def test_data_round_trip_buffers_and_extra():
    bufs = [b"", b"a", b"bc" * 100, bytes(range(256)), b""]
    (f,) = parse_all(data_frame({"h": 1}, bufs, extra=7))
    assert f.lens == [len(b) for b in bufs]
    assert bytes(f.payload) == b"".join(bufs)
    assert f.extra == 7


def test_no_buffers():
    (f,) = parse_all(data_frame({"only": "header"}, []))
    assert f.lens == [] and bytes(f.payload) == b""


def test_prefix_layout():
    frame = data_frame({}, [b"xyz"])
    magic, version, kind, hlen, plen = P.unpack(frame[:16])
    assert (magic, version, kind, plen) == (b"MT", framing.VERSION, Kind.DATA, 3)
    assert framing.PREFIX_SIZE == 16 and len(frame) == 16 + hlen + 3


def test_control_frames():
    stream = (wire(framing.encode_hello({"slot_size": 4096, "nslots": 4})) + framing.frame_credit(5)
              + framing.frame_close())
    hello, credit, close = parse_all(stream)
    assert hello.kind == Kind.HELLO and hello.header == {"slot_size": 4096, "nslots": 4}
    assert credit.kind == Kind.CREDIT and credit.credits == 5
    assert close.kind == Kind.CLOSE


def test_credit_count_is_not_a_payload_size():
    # a credit count larger than any payload limit is fine: nothing follows it
    (f,) = parse_all(framing.frame_credit(2**40), max_payload=16)
    assert f.credits == 2**40


def test_many_frames_in_one_feed_and_order():
    frames = [data_frame({"seq": i}, [bytes([i]) * i]) for i in range(50)]
    got = parse_all(b"".join(frames))
    assert [f.header["seq"] for f in got] == list(range(50))
    assert all(bytes(f.payload) == bytes([i]) * i for i, f in enumerate(got))


def test_byte_by_byte_feeding():
    frames = [data_frame({"seq": i}, [b"p" * i, b"q"]) for i in range(10)] + [framing.frame_credit(3)]
    stream = b"".join(frames)
    parser = FrameParser()
    got = []
    for i in range(len(stream)):
        got += parser.feed(stream[i : i + 1])
    assert len(got) == 11
    assert [f.header["seq"] for f in got[:10]] == list(range(10))
    assert got[10].credits == 3


@pytest.mark.parametrize("seed", range(5))
def test_random_chunking(seed):
    rng = random.Random(seed)
    frames = [data_frame({"seq": i, "pad": "x" * rng.randrange(100)}, [rng.randbytes(rng.randrange(3000))])
              for i in range(30)]
    stream = b"".join(frames)
    parser, got, pos = FrameParser(), [], 0
    while pos < len(stream):
        n = rng.randrange(1, 700)
        got += parser.feed(stream[pos : pos + n])
        pos += n
    assert [f.header["seq"] for f in got] == list(range(30))


def test_incomplete_frame_yields_nothing_yet():
    frame = data_frame({"a": 1}, [b"hello"])
    parser = FrameParser()
    assert parser.feed(frame[:-1]) == []
    (f,) = parser.feed(frame[-1:])
    assert bytes(f.payload) == b"hello"


def test_next_frame_steps():
    frame = data_frame({"k": "v"}, [b"12345"])
    view = memoryview(bytearray(frame))
    limits = (framing.MAX_HEADER, 1 << 20)
    assert next_frame(view, 0, 15, *limits) is None  # the prefix is not all here
    hlen = len(frame) - 16 - 5
    assert next_frame(view, 0, 16 + hlen - 1, *limits) is None  # nor the header
    kind, pstart, header, lens, extra, n = next_frame(view, 0, 16 + hlen, *limits)
    assert (kind, pstart, header, lens, extra, n) == (Kind.DATA, 16 + hlen, {"k": "v"}, [5], None, 5)
    # the payload is the caller's: next_frame says where it starts, whether or not it is here
    assert bytes(view[pstart:pstart + n]) == b"12345"
    kind, nxt, *_ , credits = next_frame(memoryview(framing.frame_credit(9)), 0, 16, *limits)
    assert (kind, nxt, credits) == (Kind.CREDIT, 16, 9)
    assert next_frame(memoryview(framing.frame_close()), 0, 16, *limits)[0] == Kind.CLOSE


def test_header_encoding_errors_are_type_errors():
    with pytest.raises(TypeError):
        framing.encode_header({"f": object()}, [1])
    with pytest.raises(TypeError):
        framing.encode_header({1, 2}, [])


# -- every limit and malformed case ------------------------------------------------------
GOOD_HEAD = framing.encode_header({"x": 1}, [4])

BAD = {
    "bad magic": P.pack(b"XX", framing.VERSION, Kind.DATA, len(GOOD_HEAD), 4) + GOOD_HEAD + b"abcd",
    "bad version": P.pack(b"MT", 99, Kind.DATA, len(GOOD_HEAD), 4) + GOOD_HEAD + b"abcd",
    "version zero": P.pack(b"MT", 0, Kind.DATA, len(GOOD_HEAD), 4) + GOOD_HEAD + b"abcd",
    "bad kind": P.pack(b"MT", framing.VERSION, 99, len(GOOD_HEAD), 4) + GOOD_HEAD + b"abcd",
    "kind zero": P.pack(b"MT", framing.VERSION, 0, 0, 0),
    "header longer than the limit": framing.encode_prefix(Kind.DATA, framing.MAX_HEADER + 1, 0),
    "header length 2**32-1": framing.encode_prefix(Kind.DATA, 2**32 - 1, 0),
    "payload over the absolute ceiling": raw_data(GOOD_HEAD, plen=framing.MAX_PAYLOAD + 1),
    "payload 2**64-1": raw_data(GOOD_HEAD, plen=2**64 - 1),
    "DATA without a header": framing.encode_prefix(Kind.DATA, 0, 4) + b"abcd",
    "CREDIT with a header": framing.encode_prefix(Kind.CREDIT, 3, 1) + b"abc",
    "CLOSE with a payload": framing.encode_prefix(Kind.CLOSE, 0, 5) + b"abcde",
    "HELLO with a payload": framing.encode_prefix(Kind.HELLO, 1, 5) + b"\x80" + b"abcde",
    "garbage msgpack": raw_data(b"\xc1" * 8, b"abcd", plen=4),
    "truncated msgpack": raw_data(GOOD_HEAD[:-2], b"abcd", plen=4),
    "trailing bytes after the header": raw_data(GOOD_HEAD + b"\x00", b"abcd", plen=4),
    "header is a map": raw_data(msgpack.packb({"x": 1}), b"abcd"),
    "header is a pair": raw_data(msgpack.packb([{}, [4]]), b"abcd"),
    "header is a quadruple": raw_data(msgpack.packb([{}, [4], None, 1]), b"abcd"),
    "lengths not a list": raw_data(msgpack.packb([{}, 4, None]), b"abcd"),
    "lengths do not sum": raw_data(msgpack.packb([{}, [3, 4], None]), b"0123456789"),
    "lengths sum short": raw_data(msgpack.packb([{}, [1], None]), b"abcd"),
    "negative length": raw_data(msgpack.packb([{}, [-1, 5], None]), b"abcd"),
    "float length": raw_data(msgpack.packb([{}, [4.0], None]), b"abcd"),
    "bool length": raw_data(msgpack.packb([{}, [True], None]), b"a"),
    "string length": raw_data(msgpack.packb([{}, ["4"], None]), b"abcd"),
    "too many buffers": raw_data(msgpack.packb([{}, [0] * (framing.MAX_BUFFERS + 1), None])),
    "hello not a map": framing.encode_prefix(Kind.HELLO, 2, 0) + msgpack.packb([1]),
    "hello garbage": framing.encode_prefix(Kind.HELLO, 2, 0) + b"\xc1\xc1",
}


@pytest.mark.parametrize("frame", list(BAD.values()), ids=list(BAD))
def test_malformed_raises_protocol_error(frame):
    with pytest.raises(ProtocolError):
        parse_all(frame)


@pytest.mark.parametrize("frame", list(BAD.values()), ids=list(BAD))
def test_malformed_byte_by_byte(frame):
    parser = FrameParser()
    with pytest.raises(ProtocolError):
        for i in range(len(frame)):
            parser.feed(frame[i : i + 1])


def test_malformed_after_good_frames():
    good = data_frame({"ok": 1}, [b"x"])
    parser = FrameParser()
    assert len(parser.feed(good + good)) == 2
    with pytest.raises(ProtocolError):
        parser.feed(BAD["bad magic"])


def test_negotiated_limits():
    frame = data_frame({}, [b"x" * 100])
    with pytest.raises(ProtocolError, match="payload"):
        parse_all(frame, max_payload=99)
    assert len(parse_all(frame, max_payload=100)) == 1
    big_head = data_frame({"pad": "y" * 500}, [])
    with pytest.raises(ProtocolError, match="header"):
        parse_all(big_head, max_header=100)


def test_limit_checked_on_the_prefix_alone():
    # a hostile length must be refused before anything is read or reserved
    for prefix in (framing.encode_prefix(Kind.DATA, 10, (1 << 20) + 1), framing.encode_prefix(Kind.DATA, 1025, 0)):
        with pytest.raises(ProtocolError):
            next_frame(memoryview(prefix), 0, 16, 1024, 1 << 20)


def test_decode_prefix_wrong_length():
    with pytest.raises(ProtocolError):
        framing.decode_prefix(b"MT\x01")
    with pytest.raises(ProtocolError):
        framing.decode_prefix(data_frame({}, [])[:17])


def test_exact_limits_accepted():
    lens = [0] * framing.MAX_BUFFERS
    (f,) = parse_all(raw_data(msgpack.packb([{}, lens, None])))
    assert f.lens == lens
    head = framing.encode_header({"p": b"x" * (framing.MAX_HEADER - 20)}, [])
    assert len(head) <= framing.MAX_HEADER
    assert len(parse_all(raw_data(head))) == 1


# -- seeded fuzzing ----------------------------------------------------------------------
def _only_protocol_errors(data: bytes, chunk_rng=None, **limits) -> list:
    parser = FrameParser(**limits)
    frames = []
    try:
        if chunk_rng is None:
            frames += parser.feed(data)
        else:
            pos = 0
            while pos < len(data):
                n = chunk_rng.randrange(1, 64)
                frames += parser.feed(data[pos : pos + n])
                pos += n
    except ProtocolError:
        pass
    return frames


def _valid_stream(rng: random.Random) -> bytes:
    out = []
    for i in range(rng.randrange(1, 6)):
        r = rng.random()
        if r < 0.7:
            bufs = [rng.randbytes(rng.randrange(50)) for _ in range(rng.randrange(4))]
            out.append(data_frame({"i": i, "s": "z" * rng.randrange(20)}, bufs, rng.choice([None, 3])))
        elif r < 0.85:
            out.append(framing.frame_credit(rng.randrange(100)))
        else:
            out.append(wire(framing.encode_hello({"slot_size": 64, "nslots": 2})))
    return b"".join(out)


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_random_bytes(seed):
    rng = random.Random(1000 + seed)
    for _ in range(500):
        data = rng.randbytes(rng.randrange(1, 200))
        if rng.random() < 0.5:  # a plausible prefix, so the header and payload paths run too
            data = P.pack(b"MT", framing.VERSION, rng.choice([1, 2, 2, 2, 3, 4, rng.randrange(256)]),
                          rng.randrange(0, 64), rng.randrange(0, 64)) + data
        _only_protocol_errors(data, max_payload=1 << 16)
        _only_protocol_errors(data, chunk_rng=rng, max_payload=1 << 16)


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_random_msgpack_headers(seed):
    rng = random.Random(2000 + seed)
    atoms = [None, True, 0, -1, 2**33, 1.5, "s", b"b", [], {}, [1, 2], {"a": [3]}]
    for _ in range(500):
        obj = [rng.choice(atoms) for _ in range(rng.randrange(5))]
        if rng.random() < 0.5 and len(obj) >= 2:
            obj[1] = [rng.choice([0, 1, 2, -1, True, 3.0, "x", 2**40]) for _ in range(rng.randrange(4))]
        head = msgpack.packb(obj)
        plen = rng.randrange(6)
        frames = _only_protocol_errors(raw_data(head, rng.randbytes(plen), plen=plen))
        for f in frames:  # whatever was accepted is consistent
            assert sum(f.lens) == len(f.payload) and all(type(n) is int and n >= 0 for n in f.lens)


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_truncations_and_mutations_of_valid_streams(seed):
    rng = random.Random(3000 + seed)
    for _ in range(300):
        stream = _valid_stream(rng)
        whole = parse_all(stream)
        # a truncation: only complete frames come out, all of them a prefix of the whole
        cut = rng.randrange(len(stream) + 1)
        part = FrameParser().feed(stream[:cut])
        assert len(part) <= len(whole)
        for a, b in zip(part, whole):
            assert (a.kind, a.header, a.lens) == (b.kind, b.header, b.lens)
        # a mutation: frames or ProtocolError, nothing else
        mutated = bytearray(stream)
        for _ in range(rng.randrange(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        _only_protocol_errors(bytes(mutated), max_payload=1 << 16)
        _only_protocol_errors(bytes(mutated), chunk_rng=rng, max_payload=1 << 16)
        # random deletions and insertions
        k = rng.randrange(len(stream))
        _only_protocol_errors(stream[:k] + stream[k + rng.randrange(1, 8):], max_payload=1 << 16)
        _only_protocol_errors(stream[:k] + rng.randbytes(rng.randrange(1, 8)) + stream[k:],
                              max_payload=1 << 16)


def test_parser_reads_nothing_beyond_limits_before_raising():
    # a prefix announcing a huge header is refused as soon as its 16 bytes are in
    parser = FrameParser()
    with pytest.raises(ProtocolError):
        parser.feed(struct.pack("<2sBBIQ", b"MT", framing.VERSION, Kind.DATA, 2**31, 0))


# -- the negotiated fast record of shm rings ----------------------------------------------
FAST_POOL = (4096, 8)  # slot_size, nslots


@pytest.mark.parametrize("header", [{}, {"a": 1}, None, 0, "", [1, 2], {"layer": 3, "shape": [8, 64]}])
def test_fast_record_round_trip(header):
    user = b"" if header == {} and type(header) is dict else msgpack.packb(header, use_bin_type=True)
    buf = bytearray(8 + framing.FAST_SIZE + len(user) + 8)
    n = framing.pack_fast_record(buf, 8, user, 7, 4096)
    assert n == framing.FAST_SIZE + len(user)
    assert framing.parse_fast_record(buf, 8, n, *FAST_POOL) == (header, 7, 4096)
    assert framing.parse_fast_record(memoryview(bytes(buf)), 8, n, *FAST_POOL) == (header, 7, 4096)


def test_fast_record_is_not_a_frame_and_frames_are_not_fast_records():
    buf = bytearray(framing.FAST_SIZE)
    framing.pack_fast_record(buf, 0, b"", 1, 10)
    with pytest.raises(ProtocolError, match="unknown frame kind"):  # parse_record never takes it
        framing.parse_record(buf, 0, len(buf), *FAST_POOL)
    with pytest.raises(ProtocolError, match="unknown frame kind"):  # nor does tcp
        next_frame(memoryview(bytes(buf)), 0, len(buf), 4096, 4096)
    rec = bytearray(framing.SLOT_OVERHEAD + 1)
    framing.pack_slot_frame(rec, 0, b"\x80", 10, 1)
    assert framing.parse_fast_record(rec, 0, len(rec), *FAST_POOL) is None
    assert framing.parse_fast_record(b"\0" * 15, 0, 15, *FAST_POOL) is None  # too short to be one


def _fast(slot=1, nbytes=10, user=b""):
    return framing.FAST_HEAD.pack(framing.TAG_FAST, slot, nbytes) + user


@pytest.mark.parametrize("rec,match", [
    (_fast(slot=8), "outside"),  # a descriptor outside the slot pool
    (_fast(slot=2**32 - 1), "outside"),
    (_fast(nbytes=4097), "outside"),  # more bytes than a slot holds
    (_fast(nbytes=2**64 - 1), "outside"),
    (_fast(user=b"\xc1"), "undecodable"),  # never valid msgpack
    (_fast(user=b"\x80\x80"), "undecodable"),  # two objects
    (_fast(user=b"\x92\x01"), "undecodable"),  # a truncated one
    (_fast(user=b"\x80" * (framing.MAX_FAST_USER + 1)), "exceeds the limit"),
])
def test_malformed_fast_records_raise(rec, match):
    with pytest.raises(ProtocolError, match=match):
        framing.parse_fast_record(rec, 0, len(rec), *FAST_POOL)


def test_fast_parser_reads_nothing_outside_the_record():
    rec = _fast(user=b"\x81\xa1k\x01")
    for fill in (0x00, 0x80, 0xFF):
        buf = bytes([fill]) * 5 + rec + bytes([fill]) * 40
        assert framing.parse_fast_record(buf, 5, len(rec), *FAST_POOL) == ({"k": 1}, 1, 10)
