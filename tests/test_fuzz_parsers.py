"""Property tests of the production parsers of all three backends (transport/framing.py).

The tcp, shm and rdma receive paths call exactly these functions, so random and mutated
frames fed here are what a hostile peer can feed them. For every input a parser either
returns something consistent or raises ProtocolError, never anything else; it reads
nothing outside the bytes it was given (its result does not change when the bytes around
them do); and it allocates nothing from a size the peer announced (the peak of Python
allocations stays proportional to the input, whatever lengths the input claims).

tests/fuzz/fuzz_framing.py is the coverage-guided (atheris) harness of the same targets.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tracemalloc

import msgpack
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import transport
from transport import framing
from transport.errors import ConnectionClosed, ProtocolError, Timeout
from transport.framing import Kind

MAX_HEADER = 4096
MAX_PAYLOAD = 1 << 16
SLOT_SIZE, NSLOTS = 4096, 8
GUARD = 64
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

atoms = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                  st.text(max_size=20), st.binary(max_size=20))
headers = st.recursive(atoms, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                       max_leaves=12)
payloads = st.lists(st.binary(max_size=300), max_size=4)


def _run(parse, data: bytes):
    """parse(data) -> result, or the ProtocolError; anything else fails the test. The
    peak of allocations must not follow a length the input announces."""
    tracemalloc.start()
    try:
        return parse(data)
    except ProtocolError as e:
        return ("ProtocolError", str(e))
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 256 * 1024 + 64 * len(data), f"{peak} bytes allocated parsing {len(data)} bytes"


def _canon(x):
    """x with every NaN replaced by a marker: a header may carry NaN, and NaN != NaN would
    make two equal parses compare unequal."""
    if isinstance(x, float) and x != x:
        return "<NaN>"
    if isinstance(x, dict):
        return {_canon(k): _canon(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_canon(v) for v in x)
    return x


def _framed(data: bytes, pad: int, fill: int) -> tuple[memoryview, int, int]:
    """``data`` placed ``pad`` bytes into a buffer with ``fill`` bytes around it."""
    buf = bytearray([fill]) * pad + data + bytearray([fill]) * GUARD
    return memoryview(buf), pad, pad + len(data)


def _mutate(draw, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "word"]))
        if op == "flip" and out:
            out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(0, 255))
        elif op == "cut" and out:
            i = draw(st.integers(0, len(out) - 1))
            del out[i:i + draw(st.integers(1, 8))]
        elif op == "insert":
            i = draw(st.integers(0, len(out)))
            out[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "word" and len(out) >= 16:  # a length field set to something extreme
            i = draw(st.sampled_from([4, 8]))
            out[i:i + 4] = draw(st.sampled_from([b"\xff\xff\xff\xff", b"\x00\x00\x00\x00",
                                                 b"\x00\x00\x01\x00", b"\xff\xff\xff\x7f"]))
    return bytes(out)


@st.composite
def wire_streams(draw):
    """A stream of valid tcp frames (DATA, CREDIT, CLOSE, HELLO), then mutated."""
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        k = draw(st.sampled_from(["data", "data", "credit", "close", "hello"]))
        if k == "data":
            parts.append(b"".join(bytes(memoryview(p)) for p in framing.frame_data(
                draw(headers), draw(payloads), draw(st.one_of(st.none(), st.integers(0, 9))))))
        elif k == "credit":
            parts.append(framing.frame_credit(draw(st.integers(0, 2**64 - 1))))
        elif k == "close":
            parts.append(framing.frame_close())
        else:
            parts.append(b"".join(framing.encode_hello({"x": draw(atoms)})))
    return _mutate(draw, b"".join(parts)) if draw(st.booleans()) else b"".join(parts)


# -- tcp: framing.next_frame ----------------------------------------------------------------
def _scan(buf: memoryview, pos: int, end: int) -> list:
    """Walk the stream as stream.py does: frames until one is incomplete."""
    out = []
    while True:
        f = framing.next_frame(buf, pos, end, MAX_HEADER, MAX_PAYLOAD)
        if f is None:
            return out
        kind, nxt, header, lens, extra, n = f
        assert pos < nxt <= end, (pos, nxt, end)
        if kind == Kind.DATA:
            assert 0 <= n <= MAX_PAYLOAD and type(lens) is list and len(lens) <= framing.MAX_BUFFERS
            assert all(type(k) is int and k >= 0 for k in lens) and sum(lens) == n
            out.append((kind, header, lens, extra, bytes(buf[nxt:min(nxt + n, end)])))
            if nxt + n > end:
                return out  # the rest of the payload is the caller's to read
            pos = nxt + n
        else:
            assert kind in (Kind.CREDIT, Kind.CLOSE, Kind.HELLO)
            out.append((kind, header, n))
            pos = nxt


@SETTINGS
@given(data=st.one_of(wire_streams(), st.binary(max_size=400)), pad=st.integers(0, 40))
@example(data=b"MT\x02\x01\x0c" + bytes(11) + b"\x81\xa1x\xcb\x7f\xf0\x01\x00\x00\x00\x00\x00"  # {'x': NaN}
         + b"MT\x02\x03" + bytes(12), pad=0)
def test_next_frame_parses_or_refuses_and_stays_inside(data, pad):
    a = _run(lambda d: _scan(*_framed(d, pad, 0x00)), data)
    b = _run(lambda d: _scan(*_framed(d, pad, 0xFF)), data)  # other bytes around it
    assert _canon(a) == _canon(b)


@SETTINGS
@given(header=headers, bufs=payloads)
def test_next_frame_round_trips_what_frame_data_builds(header, bufs):
    wire = b"".join(bytes(memoryview(p)) for p in framing.frame_data(header, bufs))
    ((kind, h, lens, extra, payload),) = _scan(memoryview(wire), 0, len(wire))
    assert (kind, h, lens, payload) == (Kind.DATA, header, [len(b) for b in bufs], b"".join(bufs))


# -- shm: framing.parse_fast_record, parse_slot_record, parse_record ---------------------------
@st.composite
def shm_records(draw):
    user = msgpack.packb(draw(headers), use_bin_type=True)
    form = draw(st.integers(0, 2))
    if form == 2:  # the negotiated fixed-width fast record ({} as no header bytes)
        u = draw(st.one_of(st.just(b""), st.just(user)))
        rec = bytes(framing.FAST_HEAD.pack(framing.TAG_FAST, draw(st.integers(0, NSLOTS + 2)),
                                           draw(st.integers(0, SLOT_SIZE + 2))) + u)
    elif form == 1:  # the one-slot fixed-tail form send() writes
        rec = bytearray(framing.SLOT_OVERHEAD + len(user))
        framing.pack_slot_frame(rec, 0, user, draw(st.integers(0, SLOT_SIZE + 2)),
                                draw(st.integers(0, NSLOTS + 2)))
        rec = bytes(rec)
    else:  # the general form: [user, lens, [slot, offset, ...]]
        n = draw(st.integers(0, 4))
        lens = [draw(st.integers(0, SLOT_SIZE + 2)) for _ in range(n)]
        extra = [draw(st.integers(-1, NSLOTS + 1)) if i % 2 == 0 else draw(st.integers(0, SLOT_SIZE))
                 for i in range(2 * n)]
        head = msgpack.packb([msgpack.unpackb(user, raw=False), lens, extra], use_bin_type=True)
        rec = framing.encode_prefix(Kind.DATA, len(head), sum(lens)) + head
    return _mutate(draw, rec) if draw(st.booleans()) else rec


def _records(buf: memoryview, p: int, end: int):
    n = end - p
    try:  # the fast record: None (not one), a descriptor inside the pool, or ProtocolError
        quick = framing.parse_fast_record(buf, p, n, SLOT_SIZE, NSLOTS)
    except ProtocolError as e:
        quick = ("ProtocolError", str(e))
    if quick is not None and quick[0] != "ProtocolError":
        _, s, k = quick
        assert 0 <= s < NSLOTS and 0 <= k <= SLOT_SIZE and n <= framing.MAX_FAST_RECORD
    fast = framing.parse_slot_record(buf, p, n, SLOT_SIZE, NSLOTS)
    try:
        full = framing.parse_record(buf, p, n, SLOT_SIZE, NSLOTS)
    except ProtocolError as e:
        full = ("ProtocolError", str(e))
    if fast is not None:  # the fast path accepts only what the full validation accepts, alike
        user, s, k = fast
        assert 0 <= s < NSLOTS and 0 <= k <= SLOT_SIZE
        assert full == (Kind.DATA, user, [k], [s, 0], k), (fast, full)
    if full[0] == Kind.DATA:
        _, _, lens, extra, plen = full
        assert sum(lens) == plen <= SLOT_SIZE and len(extra) == 2 * len(lens)
        for i, k in enumerate(lens):
            assert 0 <= extra[2 * i] < NSLOTS and 0 <= extra[2 * i + 1] <= SLOT_SIZE - k
    if quick is not None:  # a fast record is never anything else
        assert fast is None and full[0] == "ProtocolError", (quick, fast, full)
    return quick, fast, full


@SETTINGS
@given(data=st.one_of(shm_records(), st.binary(max_size=200)), pad=st.integers(0, 40))
def test_shm_record_parsers_agree_and_stay_inside(data, pad):
    a = _run(lambda d: _records(*_framed(d, pad, 0x00)), data)
    b = _run(lambda d: _records(*_framed(d, pad, 0x93)), data)
    assert _canon(a) == _canon(b)


# -- rdma: framing.decode_in_buffer, decode_in_slot, decode_credit_message --------------------
ROOM = (16 + MAX_HEADER + 63) // 64 * 64
SMALL = 512


def _rdma_frame(draw) -> bytes:
    bufs = draw(payloads)
    head = framing.encode_header(draw(headers), [len(b) for b in bufs],
                                 draw(st.one_of(st.none(), st.just([1, 0, [2]]))))
    prefix = framing.encode_prefix(Kind.DATA, len(head), sum(len(b) for b in bufs))
    return prefix, head, b"".join(bufs)


@st.composite
def rdma_sends(draw):
    prefix, head, body = _rdma_frame(draw)
    pad = -(16 + len(head)) % 64
    frame = prefix + head + b"\0" * pad + body
    return _mutate(draw, frame) if draw(st.booleans()) else frame


@st.composite
def rdma_slots(draw):
    prefix, head, body = _rdma_frame(draw)
    frame = prefix + head
    frame += b"\0" * (framing.payload_offset(len(head)) - len(frame)) + body
    return _mutate(draw, frame) if draw(st.booleans()) else frame


def _check_decoded(got, base: int, limit: int):
    if got[0] == Kind.DATA:
        _, user, lens, extra, start = got
        assert base + 16 <= start and start + sum(lens) <= limit, (start, lens, limit)
        if extra is not None:
            try:
                framing.check_credit_return(extra)
            except ProtocolError:
                pass
    return got


@SETTINGS
@given(frame=st.one_of(rdma_sends(), st.binary(max_size=SMALL + 8)), pad=st.integers(0, 40))
def test_rdma_receive_buffer_decode(frame, pad):
    def parse(d, fill):
        buf, base, end = _framed(d, pad, fill)
        return _check_decoded(framing.decode_in_buffer(buf, base, end - base, SMALL, MAX_PAYLOAD), base, end)
    assert _canon(_run(lambda d: parse(d, 0), frame)) == _canon(_run(lambda d: parse(d, 0xAA), frame))


@SETTINGS
@given(frame=st.one_of(rdma_slots(), st.binary(max_size=400)), pad=st.integers(0, 40))
def test_rdma_slot_decode(frame, pad):
    size = ROOM + 1024  # the slot: header room + payload; bytes past what was written are old data

    def parse(d, fill):
        buf, base, end = _framed(d.ljust(size, b"\0"), pad, fill)  # fill: outside the slot
        return _check_decoded(framing.decode_in_slot(buf, base, size, 1024), base, base + size)
    assume(len(frame) <= size)
    assert _canon(_run(lambda d: parse(d, 0), frame)) == _canon(_run(lambda d: parse(d, 0xAA), frame))


@SETTINGS
@given(body=st.one_of(st.binary(max_size=64),
                      st.builds(lambda *x: msgpack.packb(list(x)), atoms, atoms,
                                st.lists(st.integers(-3, 2**33), max_size=5))))
def test_rdma_credit_message_decode(body):
    got = _run(framing.decode_credit_message, body)
    if got[0] != "ProtocolError":
        credits, acks, slots = got
        assert credits >= 0 and acks >= 0 and all(type(s) is int and s >= 0 for s in slots)


# -- the receive paths themselves, over real endpoints ----------------------------------------
def _stream_pair(native=None):
    from transport.pool import BufferPool
    from transport.stream import StreamConnection
    a, b = socket.socketpair()
    peer = {"slot_size": MAX_PAYLOAD, "nslots": 4}
    conn = StreamConnection(b, "tcp://fuzz", BufferPool(MAX_PAYLOAD, 4), peer, default_timeout=1.0,
                            max_header=MAX_HEADER, native=native)
    return a, conn


@pytest.mark.parametrize("native", [None, False], ids=["compiled-where-built", "python"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(wire_streams(), st.binary(max_size=400)))
def test_tcp_receive_path_only_raises_transport_errors(native, data):
    raw, conn = _stream_pair(native)
    try:
        raw.sendall(data)
        raw.shutdown(socket.SHUT_WR)
        for _ in range(20):
            try:
                msg = conn.recv(timeout=0.05)
            except (Timeout, ConnectionClosed):
                break
            except ProtocolError:
                assert conn.closed and conn.state == "BROKEN"
                break
            assert sum(b.nbytes for b in msg.buffers) <= MAX_PAYLOAD
            msg.release()
    finally:
        conn.close()
        raw.close()


@pytest.fixture(scope="module")
def shm_listener():
    import uuid
    with transport.listen(f"shm://moe-fuzz-{uuid.uuid4().hex[:10]}", slot_size=SLOT_SIZE, nslots=NSLOTS,
                          timeout=5) as lst:
        yield lst


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(record=shm_records())
def test_shm_receive_path_only_raises_transport_errors(shm_listener, record):
    import threading

    from transport.testing import raw
    assume(len(record) < 60000)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("c", transport.connect(
        shm_listener.url, slot_size=SLOT_SIZE, nslots=NSLOTS, timeout=5)))
    t.start()
    server = shm_listener.accept(timeout=5)
    t.join(5)
    client = box["c"]
    try:
        raw.send_raw(client, record)
        try:
            with server.recv(timeout=1) as msg:
                assert all(server.in_registered_memory(b) for b in msg.buffers)
        except ProtocolError:
            assert server.closed
        except (ConnectionClosed, Timeout):
            pass
    finally:
        client.close()
        server.close()


def test_atheris_harness_short_run():
    """tests/fuzz/fuzz_framing.py runs (a few thousand inputs) and finds nothing."""
    pytest.importorskip("atheris")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "tests", "fuzz", "fuzz_framing.py"),
                        "-atheris_runs=5000", "-seed=1"], cwd=root, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": root}, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Done 5000" in p.stderr, p.stderr[-3000:]
