"""Checks: file descriptors and the Poller (readiness, pending(), many clients on one thread)."""
from __future__ import annotations

import threading
import time

import transport
from transport.errors import ConnectionClosed, Timeout
from transport.poller import Poller

from .env import PairEnv, Worker
from .helpers import (expect_closed, raises, recv_seq, roundtrip, send_seq, verify)


def _wait_ready(poller: Poller, timeout: float) -> list:
    return [o for o, _ in poller.poll(timeout)]


def check_poller(env: PairEnv) -> None:
    """A Poller over several connections wakes for the one with a message; a message
    already buffered in user space (pending()) is reported although the fd is quiet."""
    pairs = [env.pair(nslots=4) for _ in range(4)]
    poller = Poller()
    env.defer(poller.close)
    for i, (_, server) in enumerate(pairs):
        poller.register(server, i)
    t0 = time.monotonic()
    assert poller.poll(0.1) == [], "poll with nothing sent"
    assert time.monotonic() - t0 <= 0.1 + env.slack
    for target in (2, 0, 3):
        client, server = pairs[target]
        assert not server.pending()
        send_seq(client, target, 100)
        end = time.monotonic() + 5
        while True:
            ready = poller.poll(max(0.0, end - time.monotonic()))
            assert ready, f"the poller did not wake for connection {target}"
            # only the target has anything: a spurious wake-up of another is tolerated only
            # if its recv(0) then times out
            objs = [o for o, _ in ready]
            for o in objs:
                if o is not server:
                    raises(Timeout, lambda: o.recv(timeout=0), "spurious readiness")
            if server in objs:
                break
        assert [d for o, d in ready if o is server] == [target]
        try:
            recv_seq(server, target, 100, timeout=0)
        except Timeout:  # readable but not a whole message yet: allowed, then it comes
            recv_seq(server, target, 100, timeout=5)
    assert poller.poll(0.05) == []
    # pending(): two messages in a row; once the first is taken the second may be in user
    # space already, and the poller must still report the connection
    client, server = pairs[1]
    send_seq(client, 1, 10)
    send_seq(client, 2, 10)
    time.sleep(0.05)
    assert server in _wait_ready(poller, 5)
    recv_seq(server, 1, 10)
    if server.pending():
        assert server in _wait_ready(poller, 0), "pending() connection not reported by poll(0)"
        recv_seq(server, 2, 10, timeout=0)  # pending() means recv(0) succeeds
    else:
        assert server in _wait_ready(poller, 5)
        recv_seq(server, 2, 10)
    assert not server.pending()
    assert poller.poll(0.05) == []
    # a listener in a poller wakes when a client connects
    lst = env.listen()
    poller.register(lst, "listener")
    assert poller.poll(0.05) == []
    box = Worker(lambda: env.connect(lst.url), "connect")
    assert [d for _, d in poller.poll(5 + env.slack)] == ["listener"]
    server = lst.accept(timeout=5)
    env.defer(server.close)
    roundtrip(box.join(5), server)
    poller.unregister(lst)
    # a peer that closes wakes the poller too
    client, server = pairs[3]
    client.close()
    assert server in _wait_ready(poller, 5), "the peer's close did not wake the poller"
    expect_closed(server, 5, "closed peer in the poller")
    poller.unregister(server)


def check_many_clients(env: PairEnv) -> None:
    """8 clients on one listener, served by a single thread with a Poller (accepting and
    echoing); every client gets its own messages back, in order."""
    nclients, count = 8, 60
    lst = env.listen(nslots=4)
    stop = threading.Event()
    served = []

    def serve():
        poller = Poller()
        poller.register(lst, None)
        conns = 0
        finished = 0
        try:
            while finished < nclients and not stop.is_set():
                for obj, data in poller.poll(0.2):
                    if data is None:
                        conn = lst.accept(timeout=5)
                        conns += 1
                        poller.register(conn, conns)
                        continue
                    conn = obj
                    try:
                        while True:  # everything already there, without blocking
                            try:
                                msg = conn.recv(timeout=0)
                            except Timeout:
                                break
                            with msg:
                                conn.send({**msg.header, "by": data}, list(msg.buffers), timeout=5)
                            served.append(data)
                            if not conn.pending():
                                break
                    except ConnectionClosed:
                        poller.unregister(conn)
                        conn.close()
                        finished += 1
        finally:
            poller.close()

    server_thread = Worker(serve, "server")
    env.defer(stop.set)

    def client_run(k):
        conn = transport.connect(lst.url, **env.conn_options(nslots=4))
        try:
            by = None
            for seq in range(count):
                send_seq(conn, seq * 100 + k, 100 + k, timeout=10)
                msg = conn.recv(timeout=10)
                with msg:
                    assert msg.header["seq"] == seq * 100 + k, msg.header
                    by = msg.header["by"] if by is None else by
                    assert msg.header["by"] == by, "a reply came from another connection"
                    verify(msg.buffers[0], seq * 100 + k, 100 + k)
        finally:
            conn.close()

    clients = [Worker(lambda k=k: client_run(k), f"client-{k}") for k in range(nclients)]
    for c in clients:
        c.join(30 + env.slack)
    server_thread.join(10 + env.slack)
    assert len(served) == nclients * count, len(served)
