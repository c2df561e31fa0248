"""tcp://'s compiled fast path (transport/_tcpfast.c) against the Python path it replaces,
over real sockets, and the sizes where tcp changes how it reads and writes.

The compiled send writes exactly the Python path's bytes; for any bytes a peer writes,
however they are cut, the compiled receive delivers exactly the messages, credits and
errors the Python receive does. Around every size threshold (the read-ahead, the idle
read, the padded frame) messages arrive whole by either path, with a peer that writes a
byte at a time, with frames cut at every boundary, with a kernel that takes a frame in
pieces, and with a receive that times out in the middle of a payload.
"""
from __future__ import annotations

import os
import pathlib
import socket
import struct
import threading
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transport
from transport import framing, stream
from transport.errors import ConnectionClosed, ProtocolError, Timeout, TransportError
from transport.pool import BufferPool, buffer_address
from transport.stream import StreamConnection

from .test_fuzz_parsers import _canon, headers, wire_streams

ROOT = pathlib.Path(__file__).resolve().parent.parent
REQUIRED = os.environ.get("MOE_REQUIRE_NATIVE") == "1"
needs_native = pytest.mark.skipif(not stream.NATIVE_AVAILABLE and not REQUIRED,
                                  reason="transport/_tcpfast.c is not built here (make deps builds it)")
NATIVE = [pytest.param(None, marks=needs_native, id="compiled"), pytest.param(False, id="python")]
SLOT = 2 << 20
READ_AHEAD, IDLE, HEAD_ROOM, PAD = stream._READ_AHEAD, stream._IDLE_READ, stream._HEAD_ROOM, framing.PAD_MIN
THRESHOLD_SIZES = [1, READ_AHEAD - 1, READ_AHEAD, READ_AHEAD + 1, IDLE - 1, IDLE, IDLE + 1, IDLE + HEAD_ROOM,
                   PAD - 1, PAD, PAD + 1]


def test_the_compiled_path_is_built_where_it_is_required():
    """`make test` sets MOE_REQUIRE_NATIVE=1: there the module must have been built. Anywhere,
    native=True asks for it: it works when built and says how to build it when not."""
    if REQUIRED:
        assert stream.NATIVE_AVAILABLE, "transport/_tcpfast.c was not built (make deps: gcc, python3-dev)"
    if stream.NATIVE_AVAILABLE:
        transport.listen("tcp://127.0.0.1:0", native=True).close()
    else:
        with pytest.raises(TransportError, match="make deps"):
            transport.listen("tcp://127.0.0.1:0", native=True)
    with pytest.raises(ValueError):
        transport.listen("tcp://127.0.0.1:0", native="yes")



#: a process where transport/_tcpfast.c cannot be imported (as where no compiler was found)
_WITHOUT_THE_EXTENSION = r"""
import sys, threading
sys.modules["transport._tcpfast"] = None  # import raises ImportError
import transport
from transport import stream
from transport.errors import TransportError
assert stream.NATIVE_AVAILABLE is False and stream._tcpfast is None
try:
    transport.listen("tcp://127.0.0.1:0", native=True)
    raise SystemExit("native=True did not fail")
except TransportError as e:
    assert "make deps" in str(e), e
lst = transport.listen("tcp://127.0.0.1:0", slot_size=1 << 21, nslots=4)
box = {}
t = threading.Thread(target=lambda: box.setdefault("s", lst.accept(timeout=10)))
t.start()
c = transport.connect(lst.url, slot_size=1 << 21, nslots=4, timeout=10)
t.join(10)
s = box["s"]
assert c._link is None and s._link is None
for n in (0, 64, 4096, 1 << 20, 1 << 21):
    slot = c.alloc(n)
    slot.buf[:] = bytes([n % 251]) * n
    c.send({"n": n}, [slot])
    with s.recv(timeout=10) as m:
        assert m.header == {"n": n} and bytes(m.buffers[0]) == bytes([n % 251]) * n, n
c.close(); s.close(); lst.close()
print("python path ok")
"""


def test_without_the_extension_the_python_path_carries_every_size():
    """Where the module cannot be imported, ``native=None`` connections run the Python path
    (detected at import, not at build time) and ``native=True`` says how to build it."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", _WITHOUT_THE_EXTENSION], capture_output=True, text=True,
                       timeout=120, env=env, cwd=ROOT)
    assert p.returncode == 0 and "python path ok" in p.stdout, p.stderr

# -- helpers ---------------------------------------------------------------------------------
def _tcp_sockets() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as ls:
        a = socket.create_connection(ls.getsockname())
        b, _ = ls.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


def _conn(sock: socket.socket, native, *, slot: int = SLOT, nslots: int = 8, peer_slot: int = SLOT,
          max_header: int = framing.MAX_HEADER, timeout: float = 5.0) -> StreamConnection:
    return StreamConnection(sock, "tcp://test", BufferPool(slot, nslots), {"slot_size": peer_slot, "nslots": nslots},
                            default_timeout=timeout, max_header=max_header, native=native)


def _raw_peer(native, **kw) -> tuple[socket.socket, StreamConnection]:
    """A connection of ours whose peer is a plain socket the test writes and reads."""
    a, b = _tcp_sockets()
    a.settimeout(10)
    return a, _conn(b, native, **kw)


def _pattern(seq: int, n: int) -> bytes:
    return bytes((seq * 7 + i) % 251 for i in range(min(n, 4096))) * (n // 4096 + 1)


def _frame(header, payload: bytes, credits: int = 0) -> bytes:
    return b"".join(bytes(v) for v in framing.frame_data(header, [payload], credits or None))


def _read_all(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        assert got, "peer closed"
        out += got
    return bytes(out)


def _collect(conn: StreamConnection, timeout: float, out: list) -> bool:
    """Append what ``conn`` delivers to ``out``: (header, payload bytes) per message, then
    how it stopped; True if that was a Timeout (more may come)."""
    for _ in range(500):
        try:
            m = conn.recv(timeout=timeout)
        except Timeout:
            return True
        except (ConnectionClosed, ProtocolError) as e:
            out.append(type(e).__name__)
            return False
        out.append((_canon(m.header), [bytes(b) for b in m.buffers]))
        m.release()
    return False


# -- the send ----------------------------------------------------------------------------------
def _wire(native, header, size: int, owed: int) -> tuple[bytes, int]:
    """The bytes ``send(header, [slot of size])`` writes with ``owed`` credits owed, and the
    slot's address."""
    a, conn = _raw_peer(native)
    try:
        conn._owed = owed
        s = conn.alloc(size)
        s.buf[:] = _pattern(size, size)[:size]
        got = bytearray()

        def read():
            parser = framing.FrameParser(max_payload=SLOT)
            while True:
                b = a.recv(1 << 20)
                got.extend(b)
                if not b or any(f.kind == framing.DATA for f in parser.feed(b)):
                    return
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        conn.send(header, [s])
        reader.join(10)
        assert not reader.is_alive() and conn._owed == 0
        return bytes(got), buffer_address(s.mem)
    finally:
        conn.close()
        a.close()


@needs_native
@pytest.mark.parametrize("header", [{}, {"op": 3, "rid": 77, "shape": [256, 1024]}, None, "x" * 300])
@pytest.mark.parametrize("owed", [0, 1, 300])
@pytest.mark.parametrize("size", [0, 1, 4096, PAD - 1, PAD])
def test_the_compiled_send_writes_the_python_paths_bytes(header, owed, size):
    compiled, _ = _wire(None, header, size, owed)
    python, _ = _wire(False, header, size, owed)
    assert compiled == python
    frames = framing.FrameParser(max_payload=SLOT).feed(compiled)
    data = [f for f in frames if f.kind == framing.DATA]
    assert len(data) == 1 and data[0].header == header and bytes(data[0].payload) == _pattern(size, size)[:size]
    credits = sum(f.credits for f in frames if f.kind == framing.CREDIT)
    # below PAD_MIN the credits ride in the header; from it, in a CREDIT frame before the frame
    assert (credits, data[0].extra) == ((0, owed or None) if size < PAD else (owed, data[0].extra))


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("size", [PAD - 1, PAD, PAD + 4096])
def test_a_large_payload_lands_at_its_slots_offset_modulo_64_and_not_modulo_4k(native, size):
    """From framing.PAD_MIN on, the frame is padded so that the kernel's copy of the payload
    into its socket pages (filled from the write's first byte) keeps the source's alignment,
    and never lands just past its source's offset in a page (a copy at a fraction of speed)."""
    for owed in (0, 1):
        wire, src = _wire(native, {"k": 1}, size, owed)
        lead = framing.PREFIX_SIZE * (2 if owed and size >= PAD else 1)
        hlen = struct.unpack_from("<I", wire, lead - framing.PREFIX_SIZE + 4)[0]
        off = lead + hlen
        assert wire[off:off + 64] == _pattern(size, size)[:64]
        if size >= PAD:
            assert off % 64 == src % 64 and (off - src) % 4096 != 0
        else:
            assert off == framing.PREFIX_SIZE + len(msgpack.packb([{"k": 1}, [size], owed or None]))


@given(user=headers, lens=st.lists(st.integers(0, 1 << 34), min_size=1, max_size=5),
       credits=st.integers(0, 1 << 20), src=st.integers(0, 1 << 48))
@settings(max_examples=300, deadline=None)
def test_padded_frame_heads_decode_to_the_frame_and_place_the_payload(user, lens, credits, src):
    lead, head = framing.padded_frame_head(msgpack.packb(user, use_bin_type=True), lens, sum(lens), credits, src)
    off = len(lead) + len(head)
    assert off % 64 == src % 64 and (off - src) % 4096 != 0 and off <= 2 * framing.PREFIX_SIZE + len(head)
    frames = framing.FrameParser(max_payload=1 << 40).feed(lead + head)
    assert [f.kind for f in frames if f.kind != framing.DATA] == [framing.CREDIT] * (credits > 0)
    if credits:
        assert frames[0].credits == credits
    got_user, got_lens, extra = framing.decode_header(head, sum(lens))
    assert got_lens == lens and (extra is None or type(extra) is bytes)  # never credits
    assert msgpack.packb(got_user) == msgpack.packb(user)


# -- the receive --------------------------------------------------------------------------------
@needs_native
@given(data=st.one_of(wire_streams(), st.binary(max_size=400)), timeout=st.sampled_from([0.0, 0.05]),
       cut=st.integers(0, 400))
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_compiled_receive_delivers_what_the_python_receive_delivers(data, timeout, cut):
    """Any bytes, written in two pieces: the same messages, then the same way of stopping,
    and the same credits from the peer."""
    results = []
    for native in (None, False):
        a, b = socket.socketpair()
        conn = _conn(b, native, slot=1 << 16, peer_slot=1 << 16, max_header=4096, timeout=1.0)
        out: list = []
        try:
            a.sendall(data[:cut])
            more = _collect(conn, 0.0, out) if timeout == 0 else True
            if more:  # (else it closed the connection: a protocol error)
                a.sendall(data[cut:])
                a.shutdown(socket.SHUT_WR)
            for _ in range(3):  # the peer is done: nothing can time out but a wait for nothing
                if not (more and _collect(conn, timeout, out)):
                    break
            else:
                out.append("Timeout")
            results.append((out, conn._credits))
        finally:
            conn.close()
            a.close()
    assert results[0] == results[1]


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("waits", [True, False], ids=["waits", "polls"])
def test_a_peer_writing_one_byte_at_a_time(native, waits):
    """Frames of every size up to past the idle read, and credits, written a byte per send:
    every message whole and in order, whether the receiver waits or polls."""
    sizes = [0, 1, READ_AHEAD - 1, READ_AHEAD + 1, IDLE + 1]
    stream_ = b"".join(_frame({"seq": i}, _pattern(i, n)[:n], credits=i % 2) for i, n in enumerate(sizes))
    stream_ += framing.frame_credit(5)
    a, conn = _raw_peer(native)
    credits0 = conn._credits

    def write():
        for i in range(len(stream_)):
            a.send(stream_[i:i + 1])
            if i % 20000 == 0:
                time.sleep(0.001)
    w = threading.Thread(target=write, daemon=True)
    w.start()
    try:
        got = []
        deadline = time.monotonic() + 60
        while len(got) < len(sizes) and time.monotonic() < deadline:
            try:
                m = conn.recv(timeout=5.0 if waits else 0)
            except Timeout:
                time.sleep(0.0005)
                continue
            got.append((m.header, bytes(m.buffers[0]) if m.buffers else b""))
            m.release()
        w.join(30)
        assert got == [({"seq": i}, _pattern(i, n)[:n]) for i, n in enumerate(sizes)]
        with pytest.raises(Timeout):  # the last CREDIT frame is read, no message follows
            conn.recv(timeout=0.2)
        assert conn._credits == credits0 + sum(i % 2 for i in range(len(sizes))) + 5
    finally:
        conn.close()
        a.close()


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("waits", [True, False], ids=["waits", "polls"])
def test_frames_cut_at_every_boundary(native, waits):
    """Two frames and a CREDIT frame written in two pieces, cut at every byte: the prefix,
    the header and the payload each split, and a frame's end with the next one's start."""
    one = _frame({"a": 1}, b"x" * 40, credits=2) + framing.frame_credit(1) + _frame({"b": [2]}, b"y" * 70)
    a, conn = _raw_peer(native, nslots=4)
    try:
        for k in range(len(one) + 1):
            credits0 = conn._credits
            a.sendall(one[:k])
            got = []
            if not waits:
                while True:
                    try:
                        m = conn.recv(timeout=0)
                    except Timeout:
                        break
                    got.append((m.header, bytes(m.buffers[0])))
                    m.release()
            # the rest comes while the receiver waits (or polls) on what it has
            rest = threading.Timer(0.002, a.sendall, (one[k:],))
            rest.start()
            while len(got) < 2:
                m = conn.recv(timeout=5.0) if waits else _poll(conn)
                got.append((m.header, bytes(m.buffers[0])))
                m.release()
            rest.join(5)
            assert got == [({"a": 1}, b"x" * 40), ({"b": [2]}, b"y" * 70)], k
            deadline = time.monotonic() + 5
            while conn._credits != credits0 + 3 and time.monotonic() < deadline:
                with pytest.raises(Timeout):  # the trailing credits
                    conn.recv(timeout=0.01)
            assert conn._credits == credits0 + 3
    finally:
        conn.close()
        a.close()


def _poll(conn, limit: float = 5.0):
    deadline = time.monotonic() + limit
    while True:
        try:
            return conn.recv(timeout=0)
        except Timeout:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.0005)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("waits", [True, False], ids=["waits", "polls"])
def test_a_receive_that_times_out_in_the_middle_of_a_payload_goes_on_later(native, waits):
    payload = _pattern(3, 300_000)[:300_000]
    frame = _frame({"big": True}, payload)
    a, conn = _raw_peer(native)
    try:
        a.sendall(frame[:150_000])
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            conn.recv(timeout=0.3 if waits else 0)
        assert time.monotonic() - t0 < 2.0  # bounded by the timeout (and the slot is in use)
        assert conn._want is not None
        a.sendall(frame[150_000:])
        m = conn.recv(timeout=5.0) if waits else _poll(conn)
        assert m.header == {"big": True} and bytes(m.buffers[0]) == payload
        m.release()
        assert conn._want is None
    finally:
        conn.close()
        a.close()


# -- sizes, both ends -----------------------------------------------------------------------------
@pytest.fixture(params=[(None, None), (None, False), (False, None), (False, False)],
                ids=["compiled-compiled", "compiled-python", "python-compiled", "python-python"])
def pair(request):
    for n in request.param:
        if n is None and not stream.NATIVE_AVAILABLE and not REQUIRED:
            pytest.skip("transport/_tcpfast.c is not built here")
    a, b = _tcp_sockets()
    ca, cb = _conn(a, request.param[0]), _conn(b, request.param[1])
    yield ca, cb
    ca.close()
    cb.close()


@pytest.mark.parametrize("size", THRESHOLD_SIZES)
def test_messages_at_every_size_threshold_round_trip(pair, size):
    """Each threshold's size and its neighbours, back to back and mixed with small ones,
    waiting and polling: whole, in order; an idle read is as large as it should be after."""
    ca, cb = pair
    for seq, n in enumerate([size, 16, size, size]):
        s = ca.alloc(n)
        s.buf[:] = _pattern(seq, n)[:n]
        sender = threading.Thread(target=lambda: ca.send({"seq": seq}, [s]), daemon=True)
        sender.start()
        m = cb.recv(timeout=10.0) if seq % 2 == 0 else _poll(cb, 10.0)
        sender.join(10)
        assert not sender.is_alive() and m.header == {"seq": seq} and bytes(m.buffers[0]) == _pattern(seq, n)[:n]
        m.release()
        # a payload that did not come whole with an idle read leaves idle reads at the read-ahead
        # (its successor's payload then lands in its slot); a small one restores them
        if n > cb._idle - framing.PREFIX_SIZE:
            assert cb._rsize == READ_AHEAD
        elif n < READ_AHEAD:
            assert cb._rsize == cb._idle


@needs_native
def test_a_payload_of_the_idle_read_size_comes_whole_with_its_header_in_one_read(monkeypatch):
    """The idle read takes IDLE_READ bytes of payload beside a prefix and a header: such a
    message is parsed where it was read, nothing handed to the Python path."""
    handed = []
    for name in ("_parse_rest", "_recv_py", "_read"):
        orig = getattr(StreamConnection, name)
        monkeypatch.setattr(StreamConnection, name, lambda self, *a, _o=orig, _n=name, **k: (handed.append(_n), _o(self, *a, **k))[1])
    a, conn = _raw_peer(None)
    try:
        payload = _pattern(1, IDLE)[:IDLE]
        a.sendall(_frame({"op": "forward", "rid": 12345, "shape": [16, 1024]}, payload))
        time.sleep(0.05)  # all of it in the socket: one read
        m = conn.recv(timeout=5.0)
        assert bytes(m.buffers[0]) == payload and handed == []
        m.release()
        a.sendall(_frame({}, _pattern(2, IDLE + HEAD_ROOM)[:IDLE + HEAD_ROOM]))
        time.sleep(0.05)
        m = conn.recv(timeout=5.0)  # one past: the rest of its payload read straight into the slot
        assert bytes(m.buffers[0]) == _pattern(2, IDLE + HEAD_ROOM)[:IDLE + HEAD_ROOM] and handed == []
        m.release()
        assert conn.stats.messages_received == 2
    finally:
        conn.close()
        a.close()


# -- partial writes -------------------------------------------------------------------------------
@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("size", [200_000, PAD])
def test_a_frame_the_kernel_takes_in_pieces(native, size):
    """A small socket buffer and a reader that is not reading: a send(timeout=0) keeps what
    the kernel did not take (credits owed go with it) and flush() writes it as the reader
    reads; a blocking send writes it all while the reader reads."""
    a, b = _tcp_sockets()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    ours, theirs = _conn(b, native), _conn(a, False)
    try:
        ours._owed = 2
        s = ours.alloc(size)
        s.buf[:] = _pattern(5, size)[:size]
        credits0 = theirs._credits
        ours.send({"n": 1}, [s], timeout=0)
        assert ours.wants_write() and not ours.send_ready() and ours._owed == 0
        got = []
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            ours.flush()
            try:
                got.append(theirs.recv(timeout=0.01))
            except Timeout:
                pass
        assert got and bytes(got[0].buffers[0]) == _pattern(5, size)[:size] and got[0].header == {"n": 1}
        got[0].release()
        assert not ours.wants_write() and theirs._credits == credits0 + 2
        s = ours.alloc(size)
        s.buf[:] = _pattern(6, size)[:size]
        reader = threading.Thread(target=lambda: got.append(theirs.recv(timeout=10)), daemon=True)
        reader.start()
        ours.send({"n": 2}, [s])  # blocking: finished while the reader reads
        reader.join(10)
        assert bytes(got[1].buffers[0]) == _pattern(6, size)[:size]
        got[1].release()
        assert ours.stats.messages_sent == 2 and theirs.stats.messages_received == 2
    finally:
        ours.close()
        theirs.close()


# -- the rest --------------------------------------------------------------------------------------
@needs_native
def test_the_keyword_forms_take_the_compiled_path_and_count():
    a, b = _tcp_sockets()
    ca, cb = _conn(a, None), _conn(b, None)
    try:
        for i in range(5):
            ca.send({"i": i}, [ca.alloc(100, timeout=1.0)], timeout=0)
            with cb.recv(timeout=5.0) as m:
                assert m.header == {"i": i}
        assert (ca._link.msgs_out, cb._link.msgs_in) == (5, 5)  # not handed to the Python methods
        assert ca.stats.messages_sent == 5 and ca.stats.bytes_sent == 500 and (ca._link.msgs_out == 0)
        assert cb.stats.messages_received == 5 and cb.stats.bytes_received == 500
        with pytest.raises(Timeout):
            cb.recv(timeout=0)
    finally:
        ca.close()
        cb.close()


def test_a_peer_on_this_machine_gets_congestion_control_without_pacing():
    lst = transport.listen("tcp://127.0.0.1:0", slot_size=4096, nslots=2)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("s", lst.accept(timeout=5)))
    t.start()
    c = transport.connect(lst.url, slot_size=4096, nslots=2, timeout=5)
    t.join(5)
    try:
        for conn in (c, box["s"]):
            cc = conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0")
            assert cc == stream.LOCAL_CONGESTION
        a, b = _tcp_sockets()
        default = a.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
        stream.tune_socket(a, False)  # a peer elsewhere: the system's choice stays
        assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16) == default
        u, v = socket.socketpair()
        stream.tune_socket(u, True)  # not TCP: nothing to set, nothing raised
        for s in (a, b, u, v):
            s.close()
    finally:
        c.close()
        box["s"].close()
        lst.close()
