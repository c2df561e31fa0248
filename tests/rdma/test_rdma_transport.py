"""The rdma:// backend on a real (soft-RoCE) device: runs in the qemu guest."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("pyverbs")

from transport import rdma  # noqa: E402
from transport.errors import ConnectionClosed, ProtocolError, Timeout, TransportError  # noqa: E402

IP = "10.0.2.15"


def pair(**opts):
    lst = rdma.listen(f"{IP}:0", **opts)
    box = {}

    def acc():
        try:
            box["s"] = lst.accept(timeout=10)
        except BaseException as exc:  # pragma: no cover
            box["e"] = exc

    t = threading.Thread(target=acc)
    t.start()
    c = rdma.connect(lst.url[len("rdma://"):], timeout=10, **opts)
    t.join(10)
    if "e" in box:
        raise box["e"]
    return lst, c, box["s"]


@pytest.fixture
def conns(rdma_device):
    lst, c, s = pair(slot_size=1 << 20, nslots=4)
    yield c, s
    c.close()
    s.close()
    lst.close()


def test_order_and_content(conns):
    c, s = conns
    for i in range(200):
        c.send({"i": i}, [np.full(100 + i, i % 251, np.uint8)])
        m = s.recv(timeout=5)
        assert m.header == {"i": i}
        assert bytes(m.buffers[0]) == bytes([i % 251]) * (100 + i)
        m.release()
    # both directions, several in flight
    for i in range(3):
        s.send(i, [b"x" * i])
    for i in range(3):
        with c.recv(timeout=5) as m:
            assert m.header == i and bytes(m.buffers[0]) == b"x" * i


@pytest.mark.parametrize("n", [0, 1, 4096, 5000, 1 << 20])
def test_sizes(conns, n):
    c, s = conns
    slot = c.alloc(n)
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    slot.buf[:] = data.tobytes()
    c.send({"n": n}, [slot])
    with s.recv(timeout=5) as m:
        assert m.nbytes == n and bytes(m.buffers[0]) == data.tobytes()
        assert s.in_registered_memory(m.buffers[0])
    assert c.stats.copies == 0


def test_multi_buffer_and_copies(conns):
    c, s = conns
    a = c.alloc(10)
    a.buf[:] = b"0123456789"
    c.send("h", [a, b"abc", bytearray(b"de"), np.arange(4, dtype=np.uint8)])
    with s.recv(timeout=5) as m:
        assert [bytes(b) for b in m.buffers] == [b"0123456789", b"abc", b"de", bytes(range(4))]
    assert c.stats.copies == 3


def test_oversized(conns):
    c, s = conns
    with pytest.raises(ValueError):
        c.send("x", [bytes((1 << 20) + 1)])
    with pytest.raises(ValueError):
        c.alloc((1 << 20) + 1)


def test_credits_then_resume(conns):
    c, s = conns
    for i in range(4):
        c.send(i, [b"a"])
    with pytest.raises(Timeout):
        c.send(4, [b"a"], timeout=0.3)
    msgs = [s.recv(timeout=5) for _ in range(4)]
    assert [m.header for m in msgs] == [0, 1, 2, 3]
    msgs[0].release()
    c.send(4, [b"b"], timeout=5)
    with s.recv(timeout=5) as m:
        assert m.header == 4
    for m in msgs[1:]:
        m.release()


def test_recv_timeout(conns):
    c, s = conns
    t0 = time.monotonic()
    with pytest.raises(Timeout):
        s.recv(timeout=0.3)
    assert time.monotonic() - t0 < 2


def test_peer_close(conns):
    c, s = conns
    c.send("last", [b"z"])
    c.close()
    with s.recv(timeout=5) as m:
        assert m.header == "last"
    with pytest.raises(ConnectionClosed):
        s.recv(timeout=5)


def test_peer_sigkill(rdma_device):
    lst = rdma.listen(f"{IP}:0", slot_size=4096, nslots=4)
    code = ("import time,sys; from transport import rdma; c=rdma.connect(sys.argv[1], timeout=10, slot_size=4096, nslots=4)\n"
            "i=0\nwhile True:\n  c.send(i,[b'q'*100]); i+=1; time.sleep(0.01)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, "-c", code, lst.url[len("rdma://"):]], env=env)
    try:
        s = lst.accept(timeout=15)
        for _ in range(5):
            s.recv(timeout=5).release()
        p.send_signal(signal.SIGKILL)
        p.wait()
        t0 = time.monotonic()
        with pytest.raises(ConnectionClosed):
            while True:
                s.recv(timeout=10).release()
        assert time.monotonic() - t0 < 5
        s.close()
    finally:
        p.kill()
        p.wait()
        lst.close()


def test_bad_handshake(rdma_device):
    lst = rdma.listen(f"{IP}:0", slot_size=4096, nslots=2)
    port = int(lst.url.rsplit(":", 1)[1])
    with socket.create_connection((IP, port)) as g:
        g.sendall(b"GET / HTTP/1.0\r\n\r\n" * 4)
        with pytest.raises(ProtocolError):
            lst.accept(timeout=5)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("s", lst.accept(timeout=10)))
    t.start()
    c = rdma.connect(f"{IP}:{port}", timeout=10, slot_size=4096, nslots=2)
    t.join(10)
    c.send("ok", [b"1"])
    with box["s"].recv(timeout=5) as m:
        assert m.header == "ok"
    c.close()
    box["s"].close()
    lst.close()


def test_four_connections(rdma_device):
    lst = rdma.listen(f"{IP}:0", slot_size=8192, nslots=2)
    addr = lst.url[len("rdma://"):]
    servers = []
    t = threading.Thread(target=lambda: [servers.append(lst.accept(timeout=10)) for _ in range(4)])
    t.start()
    clients = [rdma.connect(addr, timeout=10, slot_size=8192, nslots=2) for _ in range(4)]
    t.join(20)
    assert len(servers) == 4
    for i, c in enumerate(clients):
        c.send(i, [bytes([i]) * 1000])
    got = set()
    for s in servers:
        with s.recv(timeout=5) as m:
            assert bytes(m.buffers[0]) == bytes([m.header]) * 1000
            got.add(m.header)
    assert got == {0, 1, 2, 3}
    for x in clients + servers:
        x.close()
    lst.close()


def test_no_device_is_clear(monkeypatch):
    monkeypatch.setattr(rdma, "IB_SYSFS", "/nonexistent")
    monkeypatch.delenv("MOE_RDMA_DEVICE", raising=False)
    monkeypatch.delenv("MOE_RXE_DEVICE", raising=False)
    with pytest.raises(TransportError):
        rdma.pick_device()
