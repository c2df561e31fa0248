"""Checks: closing, peers that go away or die, other processes, listeners, leaks."""
from __future__ import annotations

import signal
import threading
import time

import transport
from transport.errors import ConnectionClosed, Timeout

from .env import PairEnv, Worker, requires
from .helpers import (expect_closed, filled_slot, raises, recv_seq, roundtrip, send_seq, timed, transfer,
                      verify)
from .helpers import _open_fds


def _close_cases(env: PairEnv, closer_is_client: bool) -> None:
    client, server = env.pair()
    closer, survivor = (client, server) if closer_is_client else (server, client)
    roundtrip(closer, survivor)
    closer.close()
    assert closer.closed
    closer.close()  # idempotent
    expect_closed(survivor, 5 + env.slack, "the peer closed")
    assert survivor.state == "PEER_GONE", survivor.state
    assert not survivor.send_ready(), "send_ready() after the peer closed"
    raises(ConnectionClosed, lambda: survivor.recv(timeout=1), "recv again after ConnectionClosed")
    raises(ConnectionClosed, lambda: send_seq(survivor, 0, 10, timeout=1), "send to a closed peer")
    survivor.close()
    survivor.close()
    assert survivor.closed and survivor.state == "CLOSED"
    for conn in (closer, survivor):
        raises(ConnectionClosed, lambda: conn.recv(timeout=0.1), "recv on a closed connection")
        raises(ConnectionClosed, lambda: conn.send({"x": 1}, [b"abc"], timeout=0.1),
               "send on a closed connection")
        raises(ConnectionClosed, lambda: conn.alloc(10, timeout=0.1), "alloc on a closed connection")


def check_peer_close(env: PairEnv) -> None:
    """The peer closes: recv on the survivor raises ConnectionClosed (not a hang, not a
    Timeout), then send does too; close() is idempotent; every operation on a closed
    connection raises ConnectionClosed. Both ways round."""
    _close_cases(env, closer_is_client=True)
    _close_cases(env, closer_is_client=False)


def check_close_delivers(env: PairEnv) -> None:
    """Messages sent before close() are delivered, in order, before ConnectionClosed."""
    client, server = env.pair()
    sizes = [10, 1 << 20, 0, 4096, 1 << 20, 1]

    def sender():
        for seq, n in enumerate(sizes):
            send_seq(client, seq, n, timeout=10)
        client.close()

    w = Worker(sender, "sender")
    for seq, n in enumerate(sizes):
        recv_seq(server, seq, n, timeout=10)
    expect_closed(server, 5 + env.slack, "after the delivered messages")
    w.join(5 + env.slack)


def check_close_while_blocked(env: PairEnv) -> None:
    """A recv blocked on one end (long timeout) wakes with ConnectionClosed soon after the
    peer closes."""
    client, server = env.pair()
    w = Worker(lambda: timed(lambda: server.recv(timeout=20)), "blocked-recv")
    time.sleep(0.2)
    client.close()
    err, dt = w.join(5 + env.slack)
    assert isinstance(err, ConnectionClosed), f"blocked recv after the peer closed: {err!r}"
    assert dt < 0.2 + 5 + env.slack, dt


@requires("cross_process")
def check_peer_killed(env: PairEnv) -> None:
    """A peer process streaming to us is killed with SIGKILL: our recv raises
    ConnectionClosed within 5 s (never a hang or a Timeout), the message we still hold is
    readable until released, send raises ConnectionClosed, and nothing is left behind."""
    lst = env.listen()
    peer = env.spawn_peer(lst.url, "stream", size=4096)
    conn = lst.accept(timeout=20)
    env.defer(conn.close)
    peer.wait_line("ready", 20)
    held = None
    for seq in range(50):
        msg = conn.recv(timeout=5)
        assert msg.header.get("seq") == seq, msg.header
        verify(msg.buffers[0], seq, 4096)
        if held is not None:
            held.release()
        held = msg
    peer.kill(signal.SIGKILL)
    t0 = time.monotonic()
    end = t0 + 5 + env.slack
    n = 50
    while True:
        try:
            m = conn.recv(timeout=max(0.0, end - time.monotonic()))
        except ConnectionClosed:
            break
        except Timeout:
            raise AssertionError(f"Timeout instead of ConnectionClosed {time.monotonic() - t0:.2f} s "
                                 "after the peer was killed") from None
        assert m.header.get("seq") == n, (m.header, n)
        verify(m.buffers[0], n, 4096)
        n += 1
        m.release()
    verify(held.buffers[0], held.header["seq"], 4096, "the message held across the kill")
    held.release()
    raises(ConnectionClosed, lambda: conn.send({"x": 1}, [b"abc"], timeout=1), "send to a killed peer")
    conn.close()
    lst.close()


@requires("cross_process")
def check_peer_killed_while_we_wait_for_credits(env: PairEnv) -> None:
    """A peer process that holds everything we send (no credits back) is killed while our
    send waits for credits: the send raises ConnectionClosed, not Timeout, within 5 s."""
    nslots = 4
    lst = env.listen(nslots=nslots)
    peer = env.spawn_peer(lst.url, "hold", count=nslots, options=env.conn_options(nslots=nslots))
    conn = lst.accept(timeout=20)
    env.defer(conn.close)
    peer.wait_line("ready", 20)
    for seq in range(nslots):
        send_seq(conn, seq, 1000, timeout=5)
    peer.wait_line("held", 10)
    timer = threading.Timer(0.3, peer.kill)
    timer.start()
    try:
        err, dt = timed(lambda: send_seq(conn, nslots, 1000, timeout=10))
    finally:
        timer.cancel()
    assert isinstance(err, ConnectionClosed), f"send while the peer died: {err!r} after {dt:.2f} s"
    assert dt < 0.3 + 5 + env.slack, dt
    raises(ConnectionClosed, lambda: conn.recv(timeout=1), "recv after the peer died")


@requires("cross_process")
def check_cross_process(env: PairEnv) -> None:
    """Messages to a peer process and back (it echoes): sizes up to max_message, several
    buffers, headers; then it closes and we see ConnectionClosed."""
    lst = env.listen()
    peer = env.spawn_peer(lst.url, "echo")
    conn = lst.accept(timeout=20)
    env.defer(conn.close)
    peer.wait_line("ready", 20)
    sizes = [0, 1, 4096, 1 << 20, conn.max_message - 17, 12345]
    for seq, n in enumerate(sizes):
        slots = [filled_slot(conn, seq, n), filled_slot(conn, seq + 1000, 17)]
        conn.send({"seq": seq, "meta": {"n": n, "l": [1, 2.5, None]}}, slots, timeout=10)
        with conn.recv(timeout=10) as msg:
            assert msg.header == {"seq": seq, "meta": {"n": n, "l": [1, 2.5, None]}}, msg.header
            assert [b.nbytes for b in msg.buffers] == [n, 17]
            verify(msg.buffers[0], seq, n)
            verify(msg.buffers[1], seq + 1000, 17)
            for b in msg.buffers:
                assert conn.in_registered_memory(b)
    count, window, got = 300, 3, 0
    for s in range(count):  # pipelined, a few messages in flight (fewer than the credits)
        send_seq(conn, s, 100, timeout=10)
        if s - got >= window:
            recv_seq(conn, got, 100, timeout=10)
            got += 1
    while got < count:
        recv_seq(conn, got, 100, timeout=10)
        got += 1
    conn.send({"op": "exit"})
    expect_closed(conn, 5 + env.slack, "the echo peer exited")
    assert peer.wait(10) == 0, peer.stderr()


@requires("cross_process")
def check_cross_process_stream(env: PairEnv) -> None:
    """A peer process streams 2000 messages to us and closes: all arrive, in order."""
    lst = env.listen()
    peer = env.spawn_peer(lst.url, "stream", size=256, count=2000)
    conn = lst.accept(timeout=20)
    env.defer(conn.close)
    for seq in range(2000):
        recv_seq(conn, seq, 256, timeout=10)
    expect_closed(conn, 5 + env.slack, "the streaming peer finished")
    assert peer.wait(10) == 0, peer.stderr()


def check_accept_and_connect_errors(env: PairEnv) -> None:
    """accept(timeout) with nobody connecting raises Timeout in bounded time and the
    listener still works; connecting where nobody listens raises a TransportError
    (ConnectionClosed or Timeout), never hangs."""
    lst = env.listen()
    err, dt = timed(lambda: lst.accept(timeout=0.1))
    assert isinstance(err, Timeout), f"accept with nobody connecting: {err!r}"
    assert dt <= 0.1 + env.slack, dt
    client, server = env.accept_pair(lst)
    roundtrip(client, server)
    gone = env.listen()
    url = gone.url
    gone.close()
    err, dt = timed(lambda: env.connect(url, timeout=2.0))
    assert isinstance(err, transport.TransportError), f"connect to a closed listener: {err!r}"
    assert dt <= 2.0 + env.slack, dt


def check_listener_close_keeps_connections(env: PairEnv) -> None:
    """Closing a listener (twice is fine) leaves the connections it accepted working."""
    lst = env.listen()
    client, server = env.accept_pair(lst)
    lst.close()
    lst.close()
    roundtrip(client, server)
    transfer(client, server, 5, 1 << 20)
    client.close()
    expect_closed(server, 5 + env.slack, "after the listener closed")


def check_held_messages_across_close(env: PairEnv) -> None:
    """A message held while the peer closes stays readable until released; releasing
    messages after our own close() is harmless."""
    client, server = env.pair()
    send_seq(client, 1, 4096)
    send_seq(client, 2, 100)
    m1 = recv_seq(server, 1, 4096, hold=True)
    client.close()
    m2 = recv_seq(server, 2, 100, hold=True)
    expect_closed(server, 5 + env.slack, "the peer closed")
    verify(m1.buffers[0], 1, 4096, "held across the peer's close")
    m1.release()
    server.close()
    m2.release()  # after our own close
    m2.release()
    c2, s2 = env.pair()
    send_seq(c2, 3, 10)
    m3 = recv_seq(s2, 3, 10, hold=True)
    s2.close()
    m3.release()


def check_no_fd_leak(env: PairEnv) -> None:
    """Opening and closing 20 pairs (with traffic) leaves no file descriptors behind."""
    def cycle(k):
        lst = env.listen()
        client, server = env.accept_pair(lst)
        roundtrip(client, server, k)
        client.close()
        expect_closed(server, 5 + env.slack, "cycle")
        server.close()
        lst.close()
    cycle(0)  # first use may open lazily-created process-wide fds
    before = _open_fds()
    for k in range(20):
        cycle(k)
    after = _open_fds()
    if before is not None:
        assert after <= before + 2, f"{after - before} file descriptors leaked by 20 pairs"
