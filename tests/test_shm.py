"""shm:// specifics the conformance kit cannot see: the SPSC rings on their own (wrap-around,
full, garbage), the segment's mode and cleanup, fds, and zero copy across processes (the
receiver sees the sender's later writes to a slot it has not released yet)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid

import numpy as np
import pytest

import transport
from transport import framing
from transport.errors import ConnectionClosed, ProtocolError
from transport.framing import Kind
from transport.testing import raw
from transport.shmring import (PAD, W_OUT_HEAD, W_OUT_TAIL, W_RET_TAIL, Layout, RecordReader,
                               RecordWriter, ReturnReader, ReturnWriter, Segment)

pytestmark = pytest.mark.timeout(60)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ring(cap: int = 1024):
    words = memoryview(bytearray(4096)).cast("Q")
    data = memoryview(bytearray(cap))
    return RecordWriter(data, words), RecordReader(data, words), words, data


def _url() -> str:
    return f"shm://moe-test-shm-{uuid.uuid4().hex[:12]}"


def _shm_entries() -> set:
    return set(os.listdir("/dev/shm"))


def _pair(**opts):
    opts = {"slot_size": 1 << 16, "nslots": 4, "timeout": 5.0, **opts}
    url = _url()
    lst = transport.listen(url, **opts)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("c", transport.connect(url, **opts)))
    t.start()
    try:
        server = lst.accept(timeout=5)
    finally:
        t.join(5)
    return lst, box["c"], server


# -- rings without processes ------------------------------------------------------
def test_ring_wraps_around_many_times():
    w, r, words, _ = _ring(1024)
    rng = np.random.default_rng(1)
    sent, got = [], []
    for i in range(3000):
        rec = bytes(rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8))
        if w.push(rec[:5], rec[5:]) is None:  # full: drain a few, then it must fit
            while (x := r.pop()) is not None:
                got.append(x)
            assert w.push(rec[:5], rec[5:]) is not None
        sent.append(rec)
        if i % 3 == 0:
            x = r.pop()
            if x is not None:
                got.append(x)
    while (x := r.pop()) is not None:
        got.append(x)
    assert got == sent
    assert words[W_OUT_TAIL] > 100 * 1024  # the counters went round the ring many times


def test_ring_full_and_peek_advance():
    w, r, _, _ = _ring(256)
    assert r.pop() is None and r.peek() == -1
    n = 0
    while w.push(b"x" * 40) is not None:
        n += 1
    assert n == 256 // 48
    assert r.peek() == 40 and r.peek() == 40  # peek does not consume
    r.advance()
    assert w.push(b"y" * 40) is not None  # space came back


def test_ring_garbage_raises_protocol_error():
    w, r, words, data = _ring(256)
    w.push(b"hello")
    data[0:4] = (10_000).to_bytes(4, "little")  # a length past the ring
    with pytest.raises(ProtocolError):
        r.pop()
    w2, r2, words2, data2 = _ring(256)
    words2[W_OUT_TAIL] = 10_000  # a tail more than a ring ahead
    with pytest.raises(ProtocolError):
        r2.pop()
    w3, r3, words3, data3 = _ring(256)
    data3[0:4] = PAD.to_bytes(4, "little")  # padding with nothing after it
    words3[W_OUT_TAIL] = 8
    with pytest.raises(ProtocolError):
        r3.pop()
    w4, r4, words4, _ = _ring(256)
    words4[W_OUT_HEAD] = 5000  # the consumer claims more than was written
    with pytest.raises(ProtocolError):
        w4.push(b"x")


def test_return_ring():
    words = memoryview(bytearray(4096)).cast("Q")
    ids = memoryview(bytearray(4 * 8)).cast("I")
    wr, rd = ReturnWriter(ids, words), ReturnReader(ids, words)
    for rnd in range(20):
        wr.push([rnd % 8, (rnd + 3) % 8])
        assert rd.drain() == [rnd % 8, (rnd + 3) % 8]
    assert rd.drain() == []
    wr.push(list(range(8)))
    with pytest.raises(ProtocolError):
        wr.push([0])  # more than the ring (the peer's pool) holds
    words[W_RET_TAIL] = words[W_RET_TAIL] + 100
    with pytest.raises(ProtocolError):
        rd.drain()


# -- the segment --------------------------------------------------------------------
def test_segment_mode_0600_and_never_named():
    before = _shm_entries()
    seg, fd = Segment.create(Layout(1 << 18, 8, 4096, 8, 4096))
    try:
        st = os.fstat(fd)
        assert st.st_mode & 0o777 == 0o600
        assert st.st_nlink == 0  # unlinked already: nothing in /dev/shm to leak
        assert _shm_entries() == before
        assert st.st_size == seg.layout.total
    finally:
        os.close(fd)
        seg.close()


def test_no_fd_or_segment_leak():
    fds_before = set(os.listdir("/proc/self/fd"))
    before = _shm_entries()
    for _ in range(5):
        lst, c, s = _pair()
        slot = c.alloc(10)
        c.send({"a": 1}, [slot])
        m = s.recv(timeout=5)
        m.release()
        c.close()
        s.close()
        lst.close()
    assert _shm_entries() == before
    assert set(os.listdir("/proc/self/fd")) == fds_before


def test_in_process_pair_shares_the_slot():
    lst, c, s = _pair()
    try:
        slot = c.alloc(4096)
        a = np.frombuffer(slot.buf, np.uint8)
        a[:] = 7
        c.send("x", [slot])
        with s.recv(timeout=5) as m:
            got = np.frombuffer(m.buffers[0], np.uint8)
            assert np.shares_memory(got, a)
            assert not got.flags.writeable  # the peer's memory: read-only for us
            del got
        del a
    finally:
        c.close(), s.close(), lst.close()


def test_slot_descriptor_outside_the_segment_is_rejected():
    for extra in ([4, 0], [0, 1 << 16], [-1, 0], ["a", 0], None, [0]):
        lst, c, s = _pair()
        try:
            head = framing._packer.pack([{}, [16], extra])
            raw.send_raw(c, framing.encode_prefix(Kind.DATA, len(head), 16) + head)
            with pytest.raises(ProtocolError):
                s.recv(timeout=5)
            assert s.closed
            with pytest.raises(ConnectionClosed):
                c.recv(timeout=5)
        finally:
            c.close(), s.close(), lst.close()


def _mixed_pair(client_fast: bool, server_fast: bool):
    opts = {"slot_size": 1 << 16, "nslots": 4, "timeout": 5.0}
    url = _url()
    lst = transport.listen(url, fast=server_fast, **opts)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("c", transport.connect(url, fast=client_fast, **opts)))
    t.start()
    try:
        server = lst.accept(timeout=5)
    finally:
        t.join(5)
    return lst, box["c"], server


HEADERS = [{}, {"op": "fwd", "layer": 3, "shape": [8, 64]}, None, 0, "", [1, {}],
           {"big": "x" * (framing.MAX_FAST_USER + 10)}]  # the last one is too big for a fast record


@pytest.mark.parametrize("client_fast,server_fast", [(True, True), (True, False), (False, True), (False, False)])
def test_fast_record_is_negotiated_and_old_peers_keep_msgpack(client_fast, server_fast):
    """The fixed-width record is used only when both HELLOs offer it; otherwise (an older
    peer, or fast=False) every message keeps the msgpack records, and nothing changes for
    the application either way: headers round-trip exactly, slots come back."""
    lst, c, s = _mixed_pair(client_fast, server_fast)
    try:
        both = client_fast and server_fast
        assert c._fast is both and s._fast is both
        for _ in range(3):  # more messages than slots: the credits come back
            for a, b in ((c, s), (s, c)):
                for h in HEADERS:
                    slot = a.alloc(5)
                    slot.buf[:] = b"hello"
                    a.send(h, [slot])
                    with b.recv(timeout=5) as m:
                        assert m.header == h and type(m.header) is type(h)
                        assert bytes(m.buffers[0]) == b"hello" and b.in_registered_memory(m.buffers[0])
                a.send({"n": 2}, [a.alloc(3), b"xyz"])  # the general path beside the fast one
                with b.recv(timeout=5) as m:
                    assert m.header == {"n": 2} and [x.nbytes for x in m.buffers] == [3, 3]
    finally:
        c.close(), s.close(), lst.close()


@pytest.mark.parametrize("native", [None, False])  # the compiled path (where built) declines, Python raises
@pytest.mark.parametrize("slot,nbytes,user", [(4, 16, b""), (2**32 - 1, 0, b""), (0, (1 << 16) + 1, b""),
                                              (0, 16, b"\xc1"), (0, 16, b"\x80\x80")])
def test_bad_fast_record_breaks_the_connection(slot, nbytes, user, native):
    """A fast record with a descriptor outside the slot pool, or a bad header: ProtocolError
    from recv, the connection BROKEN, the peer told."""
    lst, c, s = _pair(native=native)
    try:
        assert s._fast
        raw.send_raw(c, framing.FAST_HEAD.pack(framing.TAG_FAST, slot, nbytes) + user)
        with pytest.raises(ProtocolError):
            s.recv(timeout=5)
        assert s.closed and s.state == "BROKEN"
        with pytest.raises(ConnectionClosed):
            c.recv(timeout=5)
    finally:
        c.close(), s.close(), lst.close()


def test_fast_record_without_negotiation_is_refused():
    lst, c, s = _mixed_pair(True, False)
    try:
        raw.send_raw(c, framing.FAST_HEAD.pack(framing.TAG_FAST, 0, 16))
        with pytest.raises(ProtocolError, match="unknown frame kind"):
            s.recv(timeout=5)
        assert s.state == "BROKEN"
    finally:
        c.close(), s.close(), lst.close()


@pytest.mark.parametrize("native", [None, False])
def test_fast_records_across_ring_wrap_around(native):
    """Enough messages to wrap the record ring many times (padding at its end): the fast
    record takes the long way there, in order, nothing lost."""
    lst, c, s = _pair(native=native)
    try:
        user = {"pad": "y" * 200}
        for i in range(3000):
            slot = c.alloc(8)
            slot.buf[:] = i.to_bytes(8, "little")
            c.send({**user, "i": i}, [slot])
            with s.recv(timeout=5) as m:
                assert m.header["i"] == i and int.from_bytes(m.buffers[0], "little") == i
        assert c.stats.messages_sent == s.stats.messages_received == 3000
    finally:
        c.close(), s.close(), lst.close()


def test_a_ring_that_beats_its_counter_does_not_leave_the_fd_readable():
    """The peer writes our eventfd, then stores the ring counter; a scheduler may run us in
    between (for milliseconds on 2 cores). A wake-up with nothing to read must clear the
    eventfd, or a level-triggered poller spins on it until the counter lands."""
    import select

    from transport.shmring import ring_bell
    lst, a, b = _pair()
    try:
        p = select.poll()
        p.register(b.fileno(), select.POLLIN)
        assert p.poll(0) == []
        ring_bell(a._peer_bell)  # the write, without the counter store that follows it
        assert p.poll(0) != []
        with pytest.raises(transport.Timeout):
            b.recv(timeout=0)
        assert p.poll(0) == [], "the fd stayed readable with nothing to read"
        # a record that arrives with its ring is still announced and received
        a.send({"k": 1}, [b"xyz"])
        assert p.poll(1.0) != [] and b.pending()
        with b.recv(timeout=1) as m:
            assert m.header == {"k": 1}
    finally:
        a.close()
        b.close()
        lst.close()


def test_staged_buffers_share_one_slot():
    lst, c, s = _pair(nslots=2)
    try:
        c.send("many", [bytes([i]) * 10 for i in range(40)])  # 40 buffers, 2 slots
        assert c.stats.copies == 40
        with s.recv(timeout=5) as m:
            assert [bytes(b) for b in m.buffers] == [bytes([i]) * 10 for i in range(40)]
    finally:
        c.close(), s.close(), lst.close()


# -- across processes -------------------------------------------------------------
CHILD = textwrap.dedent("""
    import sys, numpy as np, transport
    conn = transport.connect(sys.argv[1], slot_size=1 << 16, nslots=4, timeout=10)
    slot = conn.alloc(4096)
    a = np.frombuffer(slot.buf, np.uint8)
    a[:] = 1
    conn.send({"step": 1}, [slot])
    print("sent", flush=True)
    sys.stdin.readline()          # the receiver holds the message, unreleased
    a[:] = 2                      # write the slot *after* sending it
    print("written", flush=True)
    sys.stdin.readline()
    conn.close()
""")


def _child(url: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, url], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": ROOT})


def test_cross_process_zero_copy():
    before = _shm_entries()
    url = _url()
    with transport.listen(url, slot_size=1 << 16, nslots=4, timeout=10) as lst:
        p = _child(url)
        try:
            conn = lst.accept(timeout=10)
            assert p.stdout.readline().strip() == b"sent"
            msg = conn.recv(timeout=10)
            view = np.frombuffer(msg.buffers[0], np.uint8)
            assert (view == 1).all()
            p.stdin.write(b"go\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == b"written"
            # no copy anywhere: the bytes we hold *are* the sender's slot
            assert (view == 2).all()
            del view
            msg.release()
            p.stdin.write(b"bye\n")
            p.stdin.flush()
            with pytest.raises(ConnectionClosed):
                conn.recv(timeout=10)
            assert p.wait(10) == 0
            conn.close()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert _shm_entries() == before


def test_sigkilled_peer_leaves_nothing():
    before = _shm_entries()
    url = _url()
    with transport.listen(url, slot_size=1 << 16, nslots=4, timeout=10) as lst:
        p = _child(url)
        try:
            conn = lst.accept(timeout=10)
            assert p.stdout.readline().strip() == b"sent"
            msg = conn.recv(timeout=10)
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
            with pytest.raises(ConnectionClosed):
                conn.recv(timeout=5)
            assert (np.frombuffer(msg.buffers[0], np.uint8) == 1).all()  # still mapped
            msg.release()
            with pytest.raises(ConnectionClosed):
                conn.alloc(10, timeout=1)
            conn.close()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert _shm_entries() == before


# -- benchmark (measured, never asserted): python -m tests.test_shm ------------------
def _echo(url: str, slot_size: int) -> None:
    conn = transport.connect(url, slot_size=slot_size, nslots=4)
    while True:
        m = conn.recv(timeout=30)
        if m.header == "stop":
            break
        n = m.buffers[0].nbytes
        m.release()
        conn.send(0, [conn.alloc(n)])
    conn.close()


def _bare_round_trip(n: int = 100_000) -> float:
    """The floor: a slot index through a busy-polled shared word, forked peer."""
    import mmap
    import time
    mm = mmap.mmap(-1, 4096)
    w = memoryview(mm).cast("Q")
    pid = os.fork()
    if pid == 0:
        for i in range(1, n + 1):
            while w[0] != i:
                pass
            w[64] = w[8]
            w[16] = i
        os._exit(0)
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        w[8] = i & 7
        w[0] = i
        while w[16] != i:
            pass
    dt = (time.perf_counter() - t0) / n
    os.waitpid(pid, 0)
    return dt


def bench() -> None:
    import time
    slot = 17 << 20
    url = _url()
    with transport.listen(url, slot_size=slot, nslots=4) as lst:
        p = subprocess.Popen([sys.executable, "-c",
                              f"from tests.test_shm import _echo; _echo({url!r}, {slot})"],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
        conn = lst.accept(timeout=10)
        print(f"bare busy-polled index round trip: {_bare_round_trip() * 1e6:.2f} us")
        for n in (64, 4096, 1 << 20, 16 << 20):
            ts = []
            for _ in range(20000 if n <= 4096 else 3000):
                t = time.perf_counter()
                conn.send(0, [conn.alloc(n)])
                conn.recv(timeout=10).release()
                ts.append(time.perf_counter() - t)
            ts = np.array(ts[len(ts) // 10:]) * 1e6
            print(f"shm round trip {n:>9} B: median {np.median(ts):6.2f} us, "
                  f"p10 {np.percentile(ts, 10):6.2f}, p90 {np.percentile(ts, 90):6.2f}")
        conn.send("stop")
        p.wait(10)
        conn.close()


if __name__ == "__main__":
    bench()
