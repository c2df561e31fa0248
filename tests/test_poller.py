"""transport/poller.py over plain fds and fake connections (no backend needed); the
conformance kit runs it over real connections of every backend."""
import socket
import time

import pytest

from transport.poller import Poller


class Fake:
    """A connection stand-in: a socketpair end plus a user-space 'pending' flag."""

    def __init__(self):
        self.a, self.b = socket.socketpair()
        self.buffered = False

    def fileno(self):
        return self.a.fileno()

    def pending(self):
        return self.buffered

    def close(self):
        self.a.close()
        self.b.close()


@pytest.fixture
def fakes():
    fs = [Fake() for _ in range(4)]
    yield fs
    for f in fs:
        f.close()


@pytest.fixture
def poller():
    p = Poller()
    yield p
    p.close()


def ready(poller, timeout):
    return sorted(d for _, d in poller.poll(timeout))


def test_nothing_ready_times_out(poller, fakes):
    for i, f in enumerate(fakes):
        poller.register(f, i)
    t0 = time.monotonic()
    assert poller.poll(0.05) == []
    assert 0.04 <= time.monotonic() - t0 < 1.0
    assert poller.poll(0) == []


def test_wakes_for_the_readable_one(poller, fakes):
    for i, f in enumerate(fakes):
        poller.register(f, i)
    fakes[2].b.send(b"x")
    got = poller.poll(1)
    assert [(o, d) for o, d in got] == [(fakes[2], 2)]
    fakes[0].b.send(b"y")
    assert ready(poller, 1) == [0, 2]


def test_pending_reported_without_the_fd(poller, fakes):
    for i, f in enumerate(fakes):
        poller.register(f, i)
    fakes[1].buffered = True
    t0 = time.monotonic()
    assert ready(poller, 5) == [1]
    assert time.monotonic() - t0 < 0.5  # not after the timeout


def test_pending_does_not_starve_readable_fds(poller, fakes):
    # a connection that always has a message buffered must not hide the others
    for i, f in enumerate(fakes):
        poller.register(f, i)
    fakes[0].buffered = True
    fakes[3].b.send(b"z")
    assert ready(poller, 1) == [0, 3]


def test_objects_without_pending(poller):
    a, b = socket.socketpair()
    try:
        poller.register(a, "sock")
        assert poller.poll(0) == []
        b.send(b"1")
        assert poller.poll(1) == [(a, "sock")]
    finally:
        a.close()
        b.close()


def test_register_unregister_len(poller, fakes):
    assert len(poller) == 0
    poller.register(fakes[0], "a")
    poller.register(fakes[1], "b")
    assert len(poller) == 2
    poller.unregister(fakes[0])
    assert len(poller) == 1
    fakes[0].b.send(b"x")
    assert poller.poll(0.05) == []
    poller.unregister(fakes[0])  # unknown: no error
    assert len(poller) == 1
    fakes[1].b.send(b"x")
    assert poller.poll(1) == [(fakes[1], "b")]


def test_unregister_after_the_fd_closed(poller):
    f = Fake()
    poller.register(f, 0)
    f.close()
    poller.unregister(f)  # fileno() no longer works; unregistering still must
    assert len(poller) == 0


def test_hangup_wakes(poller, fakes):
    poller.register(fakes[0], 0)
    fakes[0].b.close()
    assert ready(poller, 1) == [0]


def test_listening_socket(poller):
    srv = socket.create_server(("127.0.0.1", 0))
    try:
        poller.register(srv, "listener")
        assert poller.poll(0.02) == []
        c = socket.create_connection(srv.getsockname())
        assert poller.poll(2) == [(srv, "listener")]
        c.close()
    finally:
        srv.close()
