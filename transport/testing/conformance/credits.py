"""Checks: flow control (credits, send_ready, timeouts, slots held by the caller)."""
from __future__ import annotations

import time

import numpy as np

from transport.errors import ConnectionClosed, Timeout
from transport.poller import Poller

from .env import PairEnv, Worker
from .helpers import (expect_closed, expect_nothing, pattern, recv_seq, roundtrip, send_seq, timed)


def check_credits(env: PairEnv) -> None:
    """The receiver holds every message: the sender's next alloc/send raises Timeout
    within its timeout; after the releases it continues and everything arrives."""
    nslots = 4
    client, server = env.pair(nslots=nslots)
    held = []
    seq = 0
    # the peer gives us `nslots` credits: that many messages go through unreleased
    for seq in range(nslots):
        send_seq(client, seq, 1024, timeout=5)
        held.append(recv_seq(server, seq, 1024, hold=True))
    stalls = client.stats.credit_stalls
    for attempt, timeout in enumerate((0.2, 0.0, 0.3)):
        err, dt = timed(lambda: send_seq(client, nslots, 1024, timeout=timeout))
        assert isinstance(err, Timeout), f"send with no credits left: {err!r} after {dt:.2f} s"
        assert isinstance(err, TimeoutError), "transport.Timeout must be a TimeoutError"
        assert dt <= timeout + env.slack, f"Timeout after {dt:.2f} s, asked for {timeout}"
        assert dt >= timeout * 0.8, f"Timeout after {dt:.3f} s, before the {timeout} s asked"
    assert client.stats.credit_stalls > stalls, "credit stalls not counted"
    expect_nothing(server, 0.05)
    # release: the sender resumes; the message that timed out was never sent
    for m in held:
        m.release()
    total = 4 * nslots
    w = Worker(lambda: [send_seq(client, s, 1024, timeout=5) for s in range(nslots, total)], "sender")
    for s in range(nslots, total):
        recv_seq(server, s, 1024, timeout=5)
    w.join(5 + env.slack)
    expect_nothing(server, 0.05)
    roundtrip(client, server, 1000)
    # and the other way round (a fresh pair: the credits of released messages may be
    # batched, so only a fresh window is exactly `nslots`)
    client, server = env.pair(nslots=nslots)
    for s in range(nslots):
        send_seq(server, s, 10, timeout=5)
    err, _ = timed(lambda: send_seq(server, nslots, 10, timeout=0.1))
    assert isinstance(err, Timeout), f"server side without credits: {err!r}"
    for s in range(nslots):
        recv_seq(client, s, 10)
    send_seq(server, nslots, 10, timeout=5)
    recv_seq(client, nslots, 10)


def check_send_ready(env: PairEnv) -> None:
    """send_ready() says whether a send would go without waiting: True on a fresh pair,
    False once the receiver holds every message, True again (after the sender looked at
    what came back: a recv(0)) once they are released."""
    nslots = 4
    client, server = env.pair(nslots=nslots)
    assert client.send_ready() and server.send_ready(), "a fresh connection is ready"
    held = []
    for seq in range(nslots):
        send_seq(client, seq, 1024, timeout=5)
        held.append(recv_seq(server, seq, 1024, hold=True))
    assert not client.send_ready(), "ready with every credit held by the receiver"
    err, _ = timed(lambda: send_seq(client, nslots, 10, timeout=0))
    assert isinstance(err, Timeout), f"send after send_ready() said no: {err!r}"
    for m in held:
        m.release()
    server.recv(timeout=0) if server.pending() else None
    end = time.monotonic() + 2 + env.slack
    while not client.send_ready():
        assert time.monotonic() < end, "not ready again after the receiver released everything"
        try:
            client.recv(timeout=0.01).release()
        except Timeout:
            pass
    send_seq(client, nslots, 10, timeout=0.5)
    recv_seq(server, nslots, 10)
    client.close()
    assert not client.send_ready(), "a closed connection is not ready"


def check_send_timeout_consistent(env: PairEnv) -> None:
    """Large sends with a short timeout to a receiver that is not reading: each send
    either returns (the message will arrive) or raises Timeout (it never will, and the
    connection still works) or ConnectionClosed (then everything sent before arrives and
    then ConnectionClosed). No message arrives corrupted or twice."""
    client, server = env.pair()
    n = client.max_message
    sent, outcome = 0, None
    for seq in range(env.options["nslots"] + 2):
        try:
            send_seq(client, seq, n, timeout=0.2)
            sent += 1
        except (Timeout, ConnectionClosed) as e:
            outcome = e
            break
    assert outcome is not None, "sent more messages than the receiver has credits for"
    for seq in range(sent):
        recv_seq(server, seq, n, timeout=5)
    if isinstance(outcome, Timeout):
        expect_nothing(server, 0.1)
        roundtrip(client, server, 1000)
    else:
        expect_closed(server, 5 + env.slack, "after the sender's ConnectionClosed")


def check_recv_timeout(env: PairEnv) -> None:
    """recv(timeout=0.05) with nothing sent raises transport.Timeout (a TimeoutError) in
    bounded time, recv(timeout=0) polls, and the connection stays usable."""
    client, server = env.pair()
    for conn in (server, client):
        for timeout in (0.05, 0.0, 0.2):
            err, dt = timed(lambda: conn.recv(timeout=timeout))
            assert isinstance(err, Timeout), f"recv({timeout}) on an idle connection: {err!r}"
            assert isinstance(err, TimeoutError)
            assert dt <= timeout + env.slack, f"recv({timeout}) took {dt:.2f} s"
            assert dt >= timeout * 0.8, f"recv({timeout}) gave up after {dt:.3f} s"
        assert not conn.closed
    roundtrip(client, server)
    # a message that is already there is returned by recv(timeout=0)
    send_seq(client, 7, 10)
    end = time.monotonic() + 5
    while True:
        try:
            recv_seq(server, 7, 10, timeout=0)
            break
        except Timeout:
            assert time.monotonic() < end, "recv(0) never returned the message"
            time.sleep(0.005)
    roundtrip(server, client, 20)


def check_default_timeout(env: PairEnv) -> None:
    """With no timeout argument, recv and a credit-starved send give up after the
    connection's ``timeout`` option (never "forever")."""
    t = 0.3
    client, server = env.pair(timeout=t, nslots=2)
    assert client.default_timeout == t and server.default_timeout == t
    err, dt = timed(lambda: server.recv())
    assert isinstance(err, Timeout), f"recv() with nothing sent: {err!r}"
    assert t * 0.8 <= dt <= t + env.slack, dt
    held = []
    for seq in range(2):
        send_seq(client, seq, 10)
        held.append(recv_seq(server, seq, 10, hold=True))
    err, dt = timed(lambda: send_seq(client, 2, 10))
    assert isinstance(err, Timeout), f"send() without credits: {err!r}"
    assert dt <= t + env.slack, dt
    for m in held:
        m.release()
    send_seq(client, 2, 10)
    recv_seq(server, 2, 10)


def check_alloc_when_all_slots_held(env: PairEnv) -> None:
    """Allocating while the caller holds every send slot raises Timeout within the
    timeout; giving one back (``slot.release()``) makes the next alloc work; slots
    released unsent are reusable and nothing leaks."""
    client, server = env.pair(nslots=4)
    held = []
    for _ in range(1000):
        err, dt = timed(lambda: held.append(client.alloc(100, timeout=0.1)))
        if err is not None:
            break
    assert isinstance(err, Timeout), f"alloc with every slot held: {err!r}"
    assert dt <= 0.1 + env.slack, dt
    assert 1 <= len(held) < 1000, len(held)
    held.pop().release()
    slot = client.alloc(100, timeout=1)
    np.frombuffer(slot.buf, np.uint8)[:] = pattern(1, 100)
    client.send({"seq": 1, "n": 100}, [slot])
    recv_seq(server, 1, 100)
    for s in held:
        s.release()
    for seq in range(3 * len(held) + 3):
        send_seq(client, seq, 100, timeout=5)
        recv_seq(server, seq, 100)
    assert client.stats.copies == 0


def check_nonblocking_send(env: PairEnv) -> None:
    """send(timeout=0) never blocks: to a receiver that stops reading, large messages are
    taken (the rest of a frame stays with the connection, which then wants_write() and is
    not send_ready()) or refused at once with Timeout; once the receiver reads again and
    the sender's poller sees it writable and flush()es, every message that was taken
    arrives, in order and intact, and nothing else does (the kernel may make room for a
    later one after refusing some: those refused never arrive)."""
    client, server = env.pair()
    n = client.max_message
    taken = []
    for seq in range(env.options["nslots"] + 2):
        err, dt = timed(lambda: send_seq(client, seq, n, timeout=0))
        assert dt <= 0.25 + env.slack, f"send(timeout=0) of {n} B took {dt:.2f} s"
        if err is None:
            taken.append(seq)
        else:
            assert isinstance(err, Timeout), f"send(timeout=0) to a receiver that does not read: {err!r}"
    assert taken and taken[0] == 0, taken  # the first always goes (a slot, a ring, or the kernel)
    if client.wants_write():
        assert not client.send_ready(), "send_ready() while a frame is unfinished"
        assert not client.flush(), "flush() wrote a frame the receiver cannot take"

    def pump():  # the sender's side of a serve loop: POLLOUT -> flush()
        poller = Poller()
        try:
            deadline = time.monotonic() + 10 + env.slack
            while client.wants_write():
                assert time.monotonic() < deadline, "flush() never finished"
                poller.register(client, write=True)
                poller.poll(0.1)
                poller.unregister(client)
                client.flush()
        finally:
            poller.close()

    w = Worker(pump, "flusher")
    for seq in taken:
        recv_seq(server, seq, n, timeout=10)
    w.join(10 + env.slack)
    assert not client.wants_write() and client.flush()
    expect_nothing(server, 0.1)
    roundtrip(client, server, 1000)
