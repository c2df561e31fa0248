"""Checks: the zero-copy promise (registered memory, the sender's slot on shm, counted copies)."""
from __future__ import annotations

import numpy as np

from .env import PairEnv, Worker
from .helpers import (filled_slot, pattern, verify)


def check_zero_copy(env: PairEnv) -> None:
    """Received buffers lie in registered memory (on shm: in the sender's very slot);
    stats.copies stays 0 for slots from alloc(), and counts exactly one per unregistered
    buffer (bytes, bytearray, numpy array), which still arrive intact."""
    client, server = env.pair()
    assert not server.in_registered_memory(bytearray(4096)), "a fresh bytearray is not registered"
    for a, b in ((client, server), (server, client)):
        for seq, n in enumerate((1, 4096, 1 << 20)):
            slot = filled_slot(a, seq, n)
            sender_view = np.frombuffer(slot.buf, dtype=np.uint8)
            w = Worker(lambda: a.send({"seq": seq}, [slot], timeout=10), "sender")
            with b.recv(timeout=10) as msg:
                w.join(10)
                buf = msg.buffers[0]
                verify(buf, seq, n)
                assert b.in_registered_memory(buf), f"{n} B buffer outside registered memory"
                if env.shares_sender_memory:
                    assert np.shares_memory(np.frombuffer(buf, dtype=np.uint8), sender_view), \
                        "shm: the received buffer is not the sender's slot"
            del sender_view
    for c in (client, server):
        assert c.stats.copies == 0, f"copies={c.stats.copies} with registered slots only"
    client.send({"u": 1}, [pattern(1, 100).tobytes(), bytearray(pattern(2, 50).tobytes()),
                           pattern(3, 4096), client.alloc(0)])
    assert client.stats.copies == 3, f"3 unregistered buffers counted as {client.stats.copies} copies"
    with server.recv(timeout=5) as msg:
        for buf, (seq, n) in zip(msg.buffers, ((1, 100), (2, 50), (3, 4096), (0, 0))):
            verify(buf, seq, n)
            assert server.in_registered_memory(buf)
    assert server.stats.copies == 0, server.stats
    client.send({"f": 1}, [np.arange(10, dtype=np.float64)])
    with server.recv(timeout=5) as msg:
        np.testing.assert_array_equal(msg.array(0, np.float64), np.arange(10))
    assert client.stats.copies == 4
