"""pytest-benchmark for the hot path's small operations (`make bench-micro`; not a test).

Run with `pytest bench/micro --benchmark-only`; `pytest tests` never collects this.
"""
from __future__ import annotations

import threading
import uuid

import pytest

import transport
from transport import framing
from transport.pool import BufferPool


def test_frame_encode(benchmark):
    payload = memoryview(bytearray(4096))
    benchmark(framing.frame_data, {"op": "forward", "id": 7}, [payload])


def test_frame_parse(benchmark):
    wire = b"".join(bytes(b) for b in framing.frame_data({"op": "forward", "id": 7}, [b"x" * 4096]))

    def parse():
        return framing.FrameParser().feed(wire)

    assert len(benchmark(parse)) == 1


def test_slot_alloc_release(benchmark):
    pool = BufferPool(4096, 64)

    def cycle():
        pool.alloc().release()

    benchmark(cycle)


def _pair(url):
    lst = transport.listen(url, slot_size=1 << 16, nslots=16, timeout=10)
    box = {}
    t = threading.Thread(target=lambda: box.update(c=transport.connect(lst.url, slot_size=1 << 16, nslots=16, timeout=10)))
    t.start()
    server = lst.accept(timeout=10)
    t.join(10)
    return lst, box["c"], server


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_send_recv_4k(benchmark, backend):
    url = "tcp://127.0.0.1:0" if backend == "tcp" else f"shm://moe-micro-{uuid.uuid4().hex[:8]}"
    lst, c, s = _pair(url)
    try:
        def one():
            c.send({}, [c.alloc(4096)])
            s.recv(timeout=5).release()

        benchmark(one)
    finally:
        c.close(); s.close(); lst.close()
