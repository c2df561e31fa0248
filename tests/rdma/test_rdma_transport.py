"""rdma:// behaviour of its own (the conformance kit covers the common contract): both
message paths and their limits, credits, dead peers and QP errors, bad handshakes, many
connections, and teardown that leaves no verbs resource, fd or kernel object behind.

Runs in the soft-RoCE guest (`python -m tests.rxe.vm test -- tests/rdma`); on a host
without an RDMA device the `rdma_device` fixture skips it.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import transport
from transport import framing
from transport.errors import ConnectionClosed, ProtocolError, Timeout, TransportError
from transport.poller import Poller
from transport.testing.conformance import pattern, verify

pytestmark = pytest.mark.rdma


def kernel_objects() -> dict:
    """The kernel's count of verbs objects per device (`rdma resource show`), or {}."""
    try:
        out = subprocess.run(["rdma", "-j", "resource", "show"], capture_output=True, text=True,
                             timeout=20).stdout
        return {d["ifname"]: {k: v for k, v in d.items() if k in ("pd", "cq", "qp", "mr")}
                for d in json.loads(out or "[]")}
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}


def nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


def send(conn, seq, n, timeout=10, **extra):
    slot = conn.alloc(n, timeout=timeout)
    if n:
        slot.array("u1", n)[:] = pattern(seq, n)
    conn.send({"seq": seq, **extra}, [slot], timeout=timeout)


def expect(conn, seq, n, hold=False, timeout=10):
    m = conn.recv(timeout=timeout)
    assert m.header["seq"] == seq, m.header
    verify(m.buffers[0], seq, n, f"message {seq}")
    if hold:
        return m
    m.release()


def test_sizes_across_mtu_receive_buffer_and_slot(make_pair):
    """Messages below and above the path MTU, a receive buffer and up to the largest slot
    arrive intact; small ones land in receive buffers (SEND), the others in slots (WRITE
    WITH IMMEDIATE), both in registered memory."""
    small = 4096
    c, s = make_pair(slot_size=1 << 20, nslots=4, small_size=small)
    mtu = 128 << c.path_mtu  # IBV_MTU_256 == 1
    assert 256 <= mtu <= 4096 and c.path_mtu == s.path_mtu
    sizes = sorted({0, 1, mtu - 1, mtu, mtu + 1, small // 2, small - 200, small, small + 1,
                    3 * mtu + 7, 64 << 10, (1 << 20) - 1, 1 << 20})
    paths = set()
    for seq, n in enumerate(sizes):
        for a, b in ((c, s), (s, c)):
            send(a, seq, n)
            m = expect(b, seq, n, hold=True)
            buf = m.buffers[0]
            assert b.in_registered_memory(buf)
            in_slot = b.recv_pool.contains(buf) and n > 0
            if n > small:
                assert in_slot, f"{n} B did not go by WRITE WITH IMMEDIATE"
            if 0 < n <= small // 2:
                assert not in_slot, f"{n} B did not go by SEND"
            paths.add(in_slot)
            m.release()
    assert paths == {True, False}
    assert c.stats.copies == 0 and s.stats.copies == 0
    with pytest.raises(ValueError):
        c.alloc((1 << 20) + 1)


def test_more_segments_than_the_device_gathers(make_pair):
    """A message of 40 buffers (rxe gathers at most 32 per WR) mixing slots and plain bytes."""
    c, s = make_pair(slot_size=256 << 10, nslots=32)
    bufs = []
    for j in range(40):
        n = 1000 + 37 * j
        if j % 3:
            slot = c.alloc(n)
            slot.array("u1", n)[:] = pattern(j, n)
            bufs.append(slot)
        else:
            bufs.append(pattern(j, n).tobytes())
    c.send({"many": 40}, bufs)
    with s.recv(timeout=10) as m:
        assert len(m.buffers) == 40
        for j, b in enumerate(m.buffers):
            verify(b, j, 1000 + 37 * j, f"buffer {j}")
    assert c.stats.copies == 14


def test_credits_mixed_paths_and_slot_return(make_pair):
    """With every credit held (small and large messages), a send times out; releasing one
    of either kind lets exactly one more through; a long run with random holds keeps the
    credit messages flowing without exhausting their own budget."""
    c, s = make_pair(slot_size=64 << 10, nslots=4, small_size=1024)
    held = []
    for seq, n in enumerate((10, 50000, 20, 60000)):
        send(c, seq, n)
        held.append(expect(s, seq, n, hold=True))
    with pytest.raises(Timeout):
        send(c, 99, 10, timeout=0.3)
    held.pop(1).release()  # a slot comes back: a large message fits again
    send(c, 4, 40000)
    held.append(expect(s, 4, 40000, hold=True))
    with pytest.raises(Timeout):
        send(c, 99, 40000, timeout=0.2)
    held.pop(0).release()  # a receive buffer comes back
    send(c, 5, 10)
    held.append(expect(s, 5, 10, hold=True))
    for m in held:
        m.release()
    rng = random.Random(5)
    keep = []
    for seq in range(6, 600):
        n = rng.choice([0, 8, 900, 5000, 64 << 10])
        send(c, seq, n)
        keep.append(expect(s, seq, n, hold=True))
        while keep and (len(keep) >= 3 or rng.random() < 0.5):
            keep.pop(rng.randrange(len(keep))).release()
        assert c._c.ctrl_budget >= 1 and s._c.ctrl_budget >= 1
    for m in keep:
        m.release()
    send(s, 1000, 10)
    expect(c, 1000, 10)


def test_unsignaled_sends_are_reclaimed(make_pair):
    """Most sends are posted unsignaled; when the caller then holds every other slot, the
    next alloc still gets one back (a signaled zero-byte WRITE fences them)."""
    c, s = make_pair(slot_size=4096, nslots=16)
    for seq in range(2):
        send(c, seq, 1000)  # a SEND, too large to go inline: its slot waits for a completion
    assert c._c.unsig > 0 and c.inline_sends == 0
    held = [c.alloc(10) for _ in range(c.send_pool.available)]
    slot = c.alloc(10, timeout=5)  # not a Timeout
    for x in held + [slot]:
        x.release()
    for seq in range(2):
        expect(s, seq, 1000)


def test_small_sends_go_inline_and_free_their_slot_at_once(make_pair):
    """A message whose frame fits the QP's inline size is copied into the work request when
    posted: its slot is back in the pool as send() returns, with no completion polled, and
    the bytes arrive intact even though the slot is overwritten at once."""
    c, s = make_pair(slot_size=4096, nslots=4)
    assert c._max_inline >= 64  # rxe takes inline sends
    full = c.send_pool.available
    n = 3 * full  # three times the slots: each is reused right after posting
    for seq in range(n):
        slot = c.alloc(64, timeout=5)
        slot.array("u1", 64)[:] = pattern(seq, 64)
        c.send({"seq": seq}, [slot], timeout=5)
        assert c.send_pool.available == full
        # two in flight at a time: a receiver that is not waiting holds back up to one
        # credit (returned in pairs), and this one thread plays both sides
        if seq % 2:
            expect(s, seq - 1, 64)
            expect(s, seq, 64)
    assert c.inline_sends == n
    before = s.inline_sends  # the server's credit messages went inline too
    for seq in range(2):
        send(s, seq, 32)
        expect(c, seq, 32)
    assert s.inline_sends >= before + 2
    k = c.inline_sends
    send(c, 99, 2000)  # a frame above the inline size goes from its slot
    expect(s, 99, 2000)
    assert c.inline_sends == k


def _peer(url, mode, **args):
    argv = [sys.executable, "-m", "transport.testing.peer", url, "--mode", mode]
    for k, v in args.items():
        argv += [f"--{k}", v if isinstance(v, str) else json.dumps(v) if k == "options" else str(v)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("size", [100, 300 << 10])
def test_peer_killed_mid_stream(ip, size):
    """SIGKILL a peer process streaming small or large messages: recv delivers what arrived,
    then raises ConnectionClosed (not Timeout) within seconds; send does too."""
    opts = {"slot_size": 1 << 20, "nslots": 4, "timeout": 20}
    with transport.listen(f"rdma://{ip}:0", **opts) as lst:
        p = _peer(lst.url, "stream", size=size, options=opts)
        try:
            conn = lst.accept(timeout=60)
            for seq in range(10):
                m = conn.recv(timeout=20)
                assert m.header["seq"] == seq
                verify(m.buffers[0], seq, size)
                m.release()
            p.send_signal(signal.SIGKILL)
            p.wait(10)
            t0 = time.monotonic()
            with pytest.raises(ConnectionClosed):
                while True:
                    conn.recv(timeout=20).release()
            assert time.monotonic() - t0 < 5
            with pytest.raises(ConnectionClosed):
                conn.send("x", [b"y"], timeout=5)
            conn.close()
        finally:
            p.kill()
            p.wait()
            p.stdout.close()
            p.stderr.close()


def test_poller_wakes_when_the_peer_is_killed(ip):
    opts = {"slot_size": 4096, "nslots": 2, "timeout": 20}
    with transport.listen(f"rdma://{ip}:0", **opts) as lst:
        p = _peer(lst.url, "idle", options=opts)
        poller = Poller()
        try:
            conn = lst.accept(timeout=60)
            poller.register(conn)
            assert poller.poll(0.2) == []
            p.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            assert poller.poll(10), "a killed peer did not wake the poller"
            assert time.monotonic() - t0 < 5
            with pytest.raises(ConnectionClosed):
                conn.recv(timeout=5)
            conn.close()
        finally:
            poller.close()
            p.kill()
            p.wait()
            p.stdout.close()
            p.stderr.close()


def test_qp_error_becomes_connection_closed(make_pair):
    """A QP moved to the error state: its own side sees ConnectionClosed at once (flushed
    receives), the peer within the RC retry time (~2 s), never a stuck poll."""
    import pyverbs.enums as E
    from pyverbs.qp import QPAttr
    c, s = make_pair(slot_size=4096, nslots=4)
    send(c, 0, 10)
    expect(s, 0, 10)
    s._verbs.qp.modify(QPAttr(qp_state=E.IBV_QPS_ERR), E.IBV_QP_STATE)
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosed):
        s.recv(timeout=10)
    assert time.monotonic() - t0 < 2
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosed):
        for seq in range(1, 100):  # the first sends are posted; then the retries run out
            send(c, seq, 10, timeout=15)
        c.recv(timeout=15)
    assert time.monotonic() - t0 < 12
    with pytest.raises(ConnectionClosed):
        c.recv(timeout=1)


def _hello(fields):
    return b"".join(framing.encode_hello(fields))


def test_bad_handshakes_then_the_listener_serves(ip, make_pair):
    """Garbage, a wrong or incomplete HELLO, a silent client and one that hangs up: each
    accept fails (ProtocolError, Timeout, ConnectionClosed) without leaking, and the next
    real client is served."""
    from transport.rdma import live_resources
    lst = transport.listen(f"rdma://{ip}:0", slot_size=4096, nslots=2, timeout=20)
    host, port = ip, int(lst.url.rsplit(":", 1)[1])
    base = {"transport": "moe-transport", "backend": "rdma", "version": framing.VERSION, "proto": 1}
    cases = [
        (b"GET / HTTP/1.0\r\n\r\n" * 4, ProtocolError),
        (_hello({**base, "proto": 99}), ProtocolError),
        (_hello({**base, "qpn": 5}), ProtocolError),  # fields missing
        (framing.encode_prefix(framing.Kind.HELLO, 1 << 30, 0), ProtocolError),  # over the limit
        (None, Timeout),  # says nothing
        (b"MT", ConnectionClosed),  # half a prefix, then hangs up
    ]
    try:
        for data, exc in cases:
            g = socket.create_connection((host, port))
            try:
                if data is not None:
                    g.sendall(data)
                    if exc is ConnectionClosed:
                        g.shutdown(socket.SHUT_WR)
                with pytest.raises(exc):
                    lst.accept(timeout=1.0)
            finally:
                g.close()
            assert live_resources() == {}, data
        c, s = make_pair(listener=lst, slot_size=4096, nslots=2)
        send(c, 1, 100)
        expect(s, 1, 100)
    finally:
        lst.close()


def test_client_against_a_bad_server(ip):
    """A server that answers garbage: connect raises ProtocolError and leaks nothing."""
    from transport.rdma import live_resources
    srv = socket.create_server((ip, 0))
    port = srv.getsockname()[1]

    def serve():
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"\x00" * 64)
            time.sleep(0.5)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with pytest.raises(ProtocolError):
            transport.connect(f"rdma://{ip}:{port}", slot_size=4096, nslots=2, timeout=10)
    finally:
        t.join(10)
        srv.close()
    assert live_resources() == {}


def test_many_connections_to_one_listener(ip, make_pair):
    """12 connections to one listener, all alive at once, traffic both ways on each."""
    lst = transport.listen(f"rdma://{ip}:0", slot_size=16 << 10, nslots=2, timeout=30)
    try:
        pairs = [make_pair(listener=lst, slot_size=16 << 10, nslots=2) for _ in range(12)]
        for k, (c, s) in enumerate(pairs):
            send(c, k, 100 + k)
        for k, (c, s) in enumerate(pairs):
            expect(s, k, 100 + k)
            send(s, k + 100, 10000)
        for k, (c, s) in enumerate(pairs):
            expect(c, k + 100, 10000)
        assert len({s._verbs.qpn for c, s in pairs} | {c._verbs.qpn for c, s in pairs}) == 24
    finally:
        lst.close()


def test_teardown_leaves_nothing_behind(ip):
    """Pairs closed in every state (idle, messages held, sends in flight, peer gone first)
    leave no verbs object in this process, in the kernel's tables, or as an fd."""
    from transport.rdma import live_resources

    def cycle(k):
        with transport.listen(f"rdma://{ip}:0", slot_size=64 << 10, nslots=4, timeout=20) as lst:
            box = {}
            t = threading.Thread(target=lambda: box.setdefault("c", transport.connect(
                lst.url, slot_size=64 << 10, nslots=4, timeout=20)))
            t.start()
            s = lst.accept(timeout=60)
            t.join(60)
            c = box["c"]
            for seq in range(3):
                send(c, seq, 30000)
            if k % 4 == 1:
                m = expect(s, 0, 30000, hold=True)  # held across both closes
            if k % 4 == 2:
                s.close()  # the peer goes first, with messages queued
            c.close()
            s.close()
            if k % 4 == 1:
                verify(m.buffers[0], 0, 30000)
                m.release()

    cycle(0)
    before_fds, before_kernel = nfds(), kernel_objects()
    for k in range(8):
        cycle(k)
    assert live_resources() == {}
    assert nfds() <= before_fds
    assert kernel_objects() == before_kernel


def test_close_is_idempotent_and_everything_after_raises(make_pair):
    c, s = make_pair(slot_size=4096, nslots=2)
    c.close()
    c.close()
    assert c.closed and c.fileno() == -1
    for op in (lambda: c.recv(timeout=0.1), lambda: c.send("x"), lambda: c.alloc(1)):
        with pytest.raises(ConnectionClosed):
            op()
    with pytest.raises(ConnectionClosed):
        s.recv(timeout=10)


def test_environment_overrides(ip, monkeypatch):
    from transport.rdma_device import pick_device
    choice = pick_device(ip)
    monkeypatch.setenv("MOE_RDMA_DEVICE", "nosuchdev0")
    with pytest.raises(TransportError, match="nosuchdev0"):
        transport.listen(f"rdma://{ip}:0")
    monkeypatch.setenv("MOE_RDMA_DEVICE", choice.device)
    monkeypatch.setenv("MOE_RDMA_GID_INDEX", str(choice.gid_index))
    with transport.listen(f"rdma://{ip}:0", slot_size=4096, nslots=2) as lst:
        assert lst.device.gid_index == choice.gid_index
    with pytest.raises(TransportError, match="GID index 100000"):
        transport.listen(f"rdma://{ip}:0", gid_index=100000)


def test_header_only_ping_pong_piggybacks_credits(make_pair):
    """Ping-pong returns every credit on the reply: no credit messages are needed."""
    c, s = make_pair(slot_size=4096, nslots=4)
    for i in range(200):
        c.send({"i": i})
        with s.recv(timeout=10) as m:
            assert m.header == {"i": i} and m.buffers == []
        s.send({"r": i})
        with c.recv(timeout=10) as m:
            assert m.header == {"r": i}
    assert c._c.ctrl_budget == c._peer_nctrl and s._c.ctrl_budget == s._peer_nctrl  # none spent
