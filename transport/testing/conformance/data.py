"""Checks: data arrives intact and in order (sizes, headers, buffers, many in flight, stats)."""
from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

from transport.errors import Timeout

from .env import PairEnv, Worker
from .helpers import (expect_nothing, filled_slot, pattern, recv_seq, roundtrip, send_seq, transfer, verify)


def check_roundtrip(env: PairEnv) -> None:
    """One message each way; the Message API (array, nbytes, context manager, release)."""
    client, server = env.pair()
    slot = client.alloc(16)
    arr = slot.array(np.float32, (2, 2))
    arr[:] = [[1, 2], [3, 4]]
    client.send({"op": "ping"}, [slot])
    with server.recv(timeout=5) as msg:
        assert msg.header == {"op": "ping"}, msg.header
        assert msg.nbytes == 16 and len(msg.buffers) == 1
        np.testing.assert_array_equal(msg.array(0, np.float32, (2, 2)), [[1, 2], [3, 4]])
    assert msg.released
    msg.release()  # idempotent
    roundtrip(server, client, 10, 1000)
    for c in (client, server):
        assert c.stats.messages_sent >= 1 and c.stats.messages_received >= 1, c.stats
        assert not c.closed


def check_order(env: PairEnv) -> None:
    """500 messages of varied sizes arrive in order with their contents, both directions."""
    client, server = env.pair()
    sizes = [0, 1, 7, 64, 4096, 100, 65536, 3]
    for a, b in ((client, server), (server, client)):
        n = 0
        for seq in range(500):
            send_seq(a, seq, sizes[seq % len(sizes)], timeout=5)
            # keep a few messages in flight, within the credits
            if seq - n >= 3:
                recv_seq(b, n, sizes[n % len(sizes)])
                n += 1
        while n < 500:
            recv_seq(b, n, sizes[n % len(sizes)])
            n += 1
        expect_nothing(b, 0.02)
    assert client.stats.messages_sent == 500 and server.stats.messages_received == 500


HEADERS = [
    None, 0, 1, -1, True, False, "", "x", [], {},
    2**63 - 1, -(2**63), 2**64 - 1, 1.5, -0.0, float("inf"),
    "ünïcødé ✓", b"", b"\x00\xff" * 100,
    {"op": "dispatch", "layer": 7, "experts": [1, 5, 9], "shape": [128, 4096], "dtype": "bf16"},
    {"nested": {"a": [1, [2, [3, [4, {"deep": True}]]]], "b": {"c": {"d": None}}}},
    {1: "int key", 2: [b"bin", "str", 3.25]},
    [[], {}, [[]], [{}], ""],
    {"big": list(range(2000)), "blob": b"\x01" * 20000},
]


def _deep(n: int):
    obj: Any = "leaf"
    for i in range(n):
        obj = {"level": i, "child": [obj]}
    return obj


def check_header_roundtrip(env: PairEnv) -> None:
    """Any msgpack object survives as the header, exactly (falsy values and None too)."""
    client, server = env.pair()
    cases = HEADERS + [_deep(40)]
    for i, h in enumerate(cases):
        client.send(h, [] if i % 2 else [client.alloc(8)])
        with server.recv(timeout=5) as msg:
            assert msg.header == h and type(msg.header) is type(h), \
                f"header {h!r:.80} came back as {msg.header!r:.80}"
            assert len(msg.buffers) == (0 if i % 2 else 1)
    # tuples come back as lists (msgpack has one array type)
    client.send({"t": (1, (2, 3))})
    with server.recv(timeout=5) as msg:
        assert msg.header == {"t": [1, [2, 3]]}, msg.header


def check_multi_buffer(env: PairEnv) -> None:
    """Messages of several buffers (zero-length ones included) keep each buffer's length,
    order and content; a message with no buffers has ``buffers == []``."""
    client, server = env.pair()
    layouts = [[], [0], [0, 0], [5, 0, 3], [4096, 1, 65536], [1] * 6, [1000, 2000, 3000, 4000]]
    for i, lens in enumerate(layouts):
        slots = [filled_slot(client, 100 * i + j, n) for j, n in enumerate(lens)]
        client.send({"i": i}, slots)
        with server.recv(timeout=5) as msg:
            assert msg.header == {"i": i}
            assert [b.nbytes for b in msg.buffers] == lens, ([b.nbytes for b in msg.buffers], lens)
            for j, (b, n) in enumerate(zip(msg.buffers, lens)):
                verify(b, 100 * i + j, n, f"layout {lens} buffer {j}")
            assert msg.nbytes == sum(lens)
    # unregistered buffers mixed with slots
    slot = filled_slot(client, 1, 300)
    client.send("mixed", [pattern(2, 10).tobytes(), slot, bytearray(pattern(3, 20).tobytes()),
                          pattern(4, 40)])
    with server.recv(timeout=5) as msg:
        assert [b.nbytes for b in msg.buffers] == [10, 300, 20, 40]
        for b, seq in zip(msg.buffers, (2, 1, 3, 4)):
            verify(b, seq)


def check_sizes(env: PairEnv) -> None:
    """0 B, 1 B, 4 KiB, 1 MiB and exactly ``max_message`` arrive intact, from a slot and
    from an unregistered buffer, both directions."""
    client, server = env.pair()
    for a, b in ((client, server), (server, client)):
        assert a.max_message >= 1 << 20, f"max_message {a.max_message} < 1 MiB with {env.options}"
        sizes = [0, 1, 4096, 1 << 20, a.max_message - 1, a.max_message]
        for seq, n in enumerate(sizes):
            transfer(a, b, seq, n)
            transfer(a, b, seq, n, unregistered=True)


def check_many_in_flight(env: PairEnv) -> None:
    """5000 small messages from a sender thread to a receiver: every one, in order."""
    client, server = env.pair()
    count = 5000

    def sender():
        for seq in range(count):
            send_seq(client, seq, 8 + seq % 56, timeout=10)

    w = Worker(sender, "sender")
    for seq in range(count):
        recv_seq(server, seq, 8 + seq % 56, timeout=10)
    w.join(10 + env.slack)
    expect_nothing(server, 0.02)
    assert server.stats.messages_received == count
    roundtrip(client, server, count)


def check_full_duplex(env: PairEnv) -> None:
    """Both ends send large messages at once while draining what arrives (one thread per
    end): nothing deadlocks, everything arrives in order."""
    client, server = env.pair()
    count, n = 40, 512 << 10

    def run(conn):
        got = 0
        for seq in range(count):
            send_seq(conn, seq, n, timeout=10)
            while conn.pending() or got < seq - 1:
                recv_seq(conn, got, n, timeout=10)
                got += 1
        while got < count:
            recv_seq(conn, got, n, timeout=10)
            got += 1

    w = Worker(lambda: run(server), "server-end")
    run(client)
    w.join(20 + env.slack)
    roundtrip(client, server)


def check_stats(env: PairEnv) -> None:
    """stats agree across the pair: messages and payload bytes sent by one end are the
    ones the other end received (headers and framing not counted)."""
    client, server = env.pair()
    sizes = [0, 1, 100, 4096, 70000, 3]
    for a, b in ((client, server), (server, client), (client, server)):
        for seq, n in enumerate(sizes):
            transfer(a, b, seq, n)
        b.send("ack", [b"12345"])
        with a.recv(timeout=5):
            pass
    for a, b in ((client, server), (server, client)):
        assert a.stats.messages_sent == b.stats.messages_received, (a.stats, b.stats)
        assert a.stats.bytes_sent == b.stats.bytes_received, (a.stats, b.stats)
    assert client.stats.messages_sent == 2 * len(sizes) + 1
    assert client.stats.bytes_sent == 2 * sum(sizes) + 5
    assert server.stats.bytes_sent == sum(sizes) + 2 * 5
    d = client.stats.as_dict()
    assert {"bytes_sent", "bytes_received", "messages_sent", "messages_received", "copies",
            "credit_stalls"} <= set(d)


def check_held_buffers_stay_intact(env: PairEnv) -> None:
    """Messages the receiver holds keep their bytes while many later messages arrive
    (no slot is reused under a held message); releasing in any order is fine."""
    nslots = 6
    client, server = env.pair(nslots=nslots)
    rng = random.Random(7)
    held: dict = {}
    seq, total = 0, 400

    def sender():
        for k in range(total):
            send_seq(client, k, 1 + (k * 37) % 5000, timeout=10)

    w = Worker(sender, "sender")
    for seq in range(total):
        n = 1 + (seq * 37) % 5000
        msg = recv_seq(server, seq, n, timeout=10, hold=True)
        held[seq] = msg
        if len(held) >= nslots - 1 or rng.random() < 0.3:  # release a random one, keep the rest
            k = rng.choice(sorted(held))
            m = held.pop(k)
            verify(m.buffers[0], k, 1 + (k * 37) % 5000, f"message {k} held while others arrived")
            m.release()
    for k, m in sorted(held.items()):
        verify(m.buffers[0], k, 1 + (k * 37) % 5000, f"message {k} held to the end")
        m.release()
    w.join(10 + env.slack)
    roundtrip(client, server)


def check_random_traffic(env: PairEnv) -> None:
    """Seeded random traffic both ways at once (a thread per end): random sizes up to
    max_message, 0-3 buffers mixing slots and plain bytes, random headers, a message
    sometimes held a while; everything arrives intact and in order.

    Bounds that any backend may rely on: at most 2 messages in flight per direction and
    1 held, each of at most 3 buffers, so even a backend whose every buffer occupies a
    sender slot until release (shm) needs at most 3 * 3 + 3 of its 16 slots."""
    client, server = env.pair(nslots=16)
    count, window = 150, 2
    consumed = {id(client): 0, id(server): 0}  # messages each end has received
    # a hang guard, not a speed bound: it grows with the env's slack (an emulated guest
    # with slack 2 gets 120 s)
    budget = 30 * max(1.0, env.slack / 0.5)
    deadline = time.monotonic() + budget

    def plan(seed):
        rng = random.Random(seed)
        msgs = []
        for seq in range(count):
            nbuf = rng.choice([0, 1, 1, 1, 2, 3])
            cap = client.max_message // max(nbuf, 1)
            sizes = [rng.choice([0, 1, rng.randrange(1, 5000), rng.randrange(1, 200000), cap])
                     for _ in range(nbuf)]
            kinds = [rng.random() < 0.7 for _ in sizes]  # True: a slot, False: plain bytes
            header = {"seq": seq, "r": rng.choice([None, 1.5, "x" * rng.randrange(50), [1, {"a": b"b"}]])}
            msgs.append((header, sizes, kinds))
        return msgs

    def run(conn, peer, out_plan, in_plan, seed):
        rng = random.Random(seed)
        sent = got = 0
        held = None
        while sent < count or got < count:
            assert time.monotonic() < deadline, f"stuck at sent={sent} got={got}"
            if sent < count and sent - consumed[id(peer)] < window:
                header, sizes, kinds = out_plan[sent]
                bufs = [filled_slot(conn, sent * 10 + j, n, timeout=10) if is_slot
                        else pattern(sent * 10 + j, n).tobytes()
                        for j, (n, is_slot) in enumerate(zip(sizes, kinds))]
                conn.send(header, bufs, timeout=10)
                sent += 1
                continue
            if got >= count:
                time.sleep(0.001)
                continue
            try:
                msg = conn.recv(timeout=0.05)
            except Timeout:
                continue
            header, sizes, _ = in_plan[got]
            assert msg.header == header, (msg.header, header)
            assert [b.nbytes for b in msg.buffers] == sizes, ([b.nbytes for b in msg.buffers], sizes)
            for j, (b, n) in enumerate(zip(msg.buffers, sizes)):
                verify(b, got * 10 + j, n, f"message {got} buffer {j}")
            got += 1
            consumed[id(conn)] = got
            if held is not None:
                held.release()
                held = None
            if rng.random() < 0.3:
                held = msg
            else:
                msg.release()
        if held is not None:
            held.release()

    a_plan, b_plan = plan(1), plan(2)
    w = Worker(lambda: run(server, client, b_plan, a_plan, 3), "server-end")
    run(client, server, a_plan, b_plan, 4)
    w.join(budget + env.slack)
    roundtrip(client, server)
