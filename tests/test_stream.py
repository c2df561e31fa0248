"""tcp's stream connection (transport/stream.py): where its peer is, and the CPU it yields."""
import os
import socket
import uuid

import pytest

from transport.stream import peer_is_here
from transport.testing.conformance import PairEnv


class _Sock:
    def __init__(self, family, peer):
        self.family, self._peer = family, peer

    def getpeername(self):
        if isinstance(self._peer, Exception):
            raise self._peer
        return self._peer


@pytest.mark.parametrize("family,peer,here", [
    (socket.AF_UNIX, "", True),
    (socket.AF_INET, ("127.0.0.1", 5000), True),
    (socket.AF_INET, ("127.4.5.6", 5000), True),
    (socket.AF_INET6, ("::1", 5000, 0, 0), True),
    (socket.AF_INET6, ("::ffff:127.0.0.1", 5000, 0, 0), True),  # mapped: 3.11 alone says no
    (socket.AF_INET, ("10.0.0.1", 5000), False),
    (socket.AF_INET, ("192.168.1.20", 5000), False),
    (socket.AF_INET6, ("::ffff:10.0.0.1", 5000, 0, 0), False),
    (socket.AF_INET6, ("2001:db8::1", 5000, 0, 0), False),
    (socket.AF_INET, OSError(107, "not connected"), False),
    (socket.AF_INET, ("not an address", 1), False),
])
def test_a_peer_on_this_machine_is_told_by_its_address(family, peer, here):
    """No packet is sent: the address a connected socket reports is all it looks at."""
    assert peer_is_here(_Sock(family, peer)) is here


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_only_a_stream_to_this_machine_yields_the_cpu_to_its_reader(backend, monkeypatch):
    """A socket write wakes the reader with a sync wake-up (Linux queues it on the writer's
    CPU); shm rings an eventfd, which does not, so it has nothing to give up. Either way
    the call is safe at any time, closed or not, and messages still flow."""
    yields = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
    url = "tcp://127.0.0.1:0" if backend == "tcp" else f"shm://moe-test-{uuid.uuid4().hex[:12]}"
    with PairEnv(name=backend, url_factory=lambda: url) as env:
        client, server = env.pair()
        slot = client.alloc(8)
        slot.mem[:8] = b"abcdefgh"
        client.send({"n": 1}, [slot])
        assert client.yield_to_peer() is None
        with server.recv(timeout=5) as msg:
            assert bytes(msg.buffers[0]) == b"abcdefgh"
        server.yield_to_peer()
        client.close()
        client.yield_to_peer()
    assert len(yields) == (3 if backend == "tcp" else 0)
