"""The gateway's batching, per-worker failure handling and hot update, in one process: a real
WorkerPool and GatewayServer on one serve loop (in a thread), fake workers
(workers/testing.py) on theirs, real connections between them. Each test takes well under a
second (no processes, no signals)."""
from __future__ import annotations

import threading
from contextlib import contextmanager
import time

import numpy as np
import pytest

from gateway.client import GatewayClient
from gateway.pool import WorkerPool
from gateway.router import Router
from gateway.server import GatewayServer
from workers import protocol as P
from tests.helpers_procs import secret as secret_of_session
from workers.testing import FakeWorker, fake_layer_output

D, E, K = 8, 4, 2
pytestmark = pytest.mark.timeout(30)


def tokens(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)


class Stack:
    """Fake workers, a pool and a server on its own loop thread; a client per test. Every
    end shares ``secret`` (default: the test session's), as a deployment would."""

    def __init__(self, layout, *, worker_timeout=5.0, max_wait_ms=0.0, secret=b"", chunk_rows="auto", nslots=8,
                 reply_spin=True, **server_kw):
        secret = secret_of_session() if secret == b"" else secret
        self.workers = [FakeWorker(ex, d_model=D, secret=secret) for ex in layout]
        self.router = Router(D, E, K, seed=3)
        self.pool = WorkerPool([w.url for w in self.workers], self.router, max_batch_tokens=256,
                               timeout=worker_timeout, connect_timeout=5, secret=secret, chunk_rows=chunk_rows,
                               nslots=nslots, reply_spin=reply_spin)
        self.server = GatewayServer(self.pool, "tcp://127.0.0.1:0", max_wait_ms=max_wait_ms, secret=secret,
                                    **server_kw)
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()

    def expected(self, x, versions=None):
        return fake_layer_output(x, self.router.route(x), versions)

    def close(self):
        self.server.request_stop()
        self.thread.join(10)
        self.pool.close()
        for w in self.workers:
            w.close()


def _stack(layout, **kw):
    return Stack(layout, **kw)


# the fake workers report no compute, so "auto" sends each part whole; 3 rows cuts every
# part into chunks (groups and requests split across them)
CHUNKS = pytest.mark.parametrize("chunk_rows", ["auto", 3], ids=["whole", "chunks-3"])


@CHUNKS
def test_forward_equals_the_fake_reference(chunk_rows):
    s = _stack([[0, 1], [2, 3]], chunk_rows=chunk_rows)
    try:
        with GatewayClient(s.server.url, timeout=5) as c:
            for seed in range(3):
                x = tokens(17, seed)
                np.testing.assert_allclose(c.forward(x), s.expected(x), rtol=1e-5, atol=1e-6)
    finally:
        s.close()


def test_more_chunks_than_credits_all_arrive():
    """One-row chunks over connections of two slots each way: chunks wait in the backlog
    for credits, and replies are combined and given back as they land (a round holding
    them all would hold every credit the worker has for its replies, and never finish)."""
    s = _stack([[0, 1], [2, 3]], chunk_rows=1, nslots=2)
    try:
        # heartbeats fall due while every slot is on the way: a busy connection is not a
        # failing one (the ping waits; it used to mark the worker unhealthy)
        s.pool.workers.heartbeat = 0.01
        for w in s.workers:
            w.delay = 0.003
        with GatewayClient(s.server.url, timeout=5) as c:
            ids = [c.submit(tokens(20 + seed, seed)) for seed in range(3)]
            for seed, i in enumerate(ids):
                x = tokens(20 + seed, seed)
                np.testing.assert_allclose(c.result(i), s.expected(x), rtol=1e-5, atol=1e-6)
            g = c.ping()["gateway"]
        rows = 2 * sum(20 + seed for seed in range(3))
        assert g["messages"] >= rows  # the gateway counts what it sent: a message a row
        assert 0 <= g["stage_seconds"]["no_token"] <= g["stage_seconds"]["total"]
        # the gateway's CPU time in its own stages: counted, and never more than their wall
        # time (give or take the bookkeeping between route and dispatch)
        sts = g["stage_seconds"]
        assert 0 < sts["own_cpu"] <= sts["route"] + sts["dispatch"] + sts["combine"] + 1e-3 * g["rounds"]
        st = s.pool.stats()
        assert all(w["healthy"] for w in st)  # waiting for credits is not a failure
        assert sum(w["batches_sent"] for w in st) >= 2 * sum(20 + seed for seed in range(3))  # a message a row
    finally:
        s.close()


def test_requests_arriving_while_a_round_is_out_share_the_next_round():
    s = _stack([[0, 1], [2, 3]], max_wait_ms=50.0)
    try:
        s.workers[0].delay = s.workers[1].delay = 0.1  # the first round stays out a while
        xs = [tokens(8, seed) for seed in range(5)]
        with GatewayClient(s.server.url, timeout=5) as c:
            ids = [c.submit(x) for x in xs]
            ys = [c.result(i) for i in ids]
        for x, y in zip(xs, ys):
            np.testing.assert_allclose(y, s.expected(x), rtol=1e-5, atol=1e-6)
        st = s.server.stats
        assert st.rounds < len(xs) and st.max_round_requests >= 2, st
    finally:
        s.close()


@CHUNKS
def test_a_hung_worker_delays_only_the_requests_that_need_it(chunk_rows):
    """Worker 1 (experts 2, 3) hangs: requests routed only to experts 0, 1 are answered at
    once; the others fail with `unavailable` when their part times out, then at once."""
    s = _stack([[0, 1], [2, 3]], worker_timeout=0.4, chunk_rows=chunk_rows)
    try:
        router = s.router
        pick = lambda want: next(x for x in (tokens(1, seed) for seed in range(2000))  # noqa: E731
                                 if set(router.route(x).topk_idx.ravel()) <= want)
        x_fast, x_slow = pick({0, 1}), pick({2, 3})
        s.workers[1].hang = True
        with GatewayClient(s.server.url, timeout=5) as c:
            slow = c.submit(x_slow)
            t = time.monotonic()
            np.testing.assert_allclose(c.forward(x_fast), s.expected(x_fast), rtol=1e-5)
            assert time.monotonic() - t < 0.3  # not behind the hung worker's request
            with pytest.raises(P.RemoteError) as e:
                c.result(slow)
            assert e.value.code == P.UNAVAILABLE and "no reply" in e.value.message
            t = time.monotonic()
            with pytest.raises(P.RemoteError) as e:  # unhealthy now: refused at once
                c.forward(x_slow)
            assert e.value.code == P.UNAVAILABLE and time.monotonic() - t < 0.2
            s.workers[1].hang = False  # it answers pings again: taken back
            deadline = time.monotonic() + 5
            while True:
                try:
                    np.testing.assert_allclose(c.forward(x_slow), s.expected(x_slow), rtol=1e-5)
                    break
                except P.RemoteError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
    finally:
        s.close()


@CHUNKS
def test_a_dead_worker_with_replicas_costs_no_request(chunk_rows):
    s = _stack([[0, 1, 2, 3], [0, 1, 2, 3]], chunk_rows=chunk_rows)
    try:
        with GatewayClient(s.server.url, timeout=5) as c:
            ids = [c.submit(tokens(16, seed)) for seed in range(4)]
            s.workers[0].crash()  # mid-traffic
            ids += [c.submit(tokens(16, seed)) for seed in range(4, 8)]
            for seed, i in enumerate(ids):
                x = tokens(16, seed)
                np.testing.assert_allclose(c.result(i), s.expected(x), rtol=1e-5, atol=1e-6)
    finally:
        s.close()


@CHUNKS
def test_a_worker_that_fails_its_part_is_retried_on_a_replica_once(chunk_rows):
    s = _stack([[0, 1, 2, 3], [0, 1, 2, 3]], chunk_rows=chunk_rows)
    try:
        s.workers[0].fail = True
        with GatewayClient(s.server.url, timeout=5) as c:
            for seed in range(4):
                x = tokens(16, seed)
                np.testing.assert_allclose(c.forward(x), s.expected(x), rtol=1e-5, atol=1e-6)
        assert s.server.stats.retried >= 1
        s.workers[1].fail = True  # both fail: the retry fails too, with the worker's error
        with GatewayClient(s.server.url, timeout=5) as c:
            with pytest.raises(P.RemoteError) as e:
                c.forward(tokens(16, 9))
            assert e.value.code == P.WORKER_FAILED and "fake failure" in e.value.message
    finally:
        s.close()


@CHUNKS
def test_replies_go_in_the_slot_taken_at_dispatch_and_every_slot_comes_back(chunk_rows):
    """Each request's output is the reply slot it took when it went out (a chunked round sums
    into it as chunks land), answered or not: failed requests give theirs back, and so does
    a client that left with its requests in flight."""
    s = _stack([[0, 1], [2, 3]], chunk_rows=chunk_rows, max_wait_ms=5.0)
    late = []
    reply = s.server.loop.reply
    s.server.loop.reply = lambda *a: late.append(a) or reply(*a)  # the slot taken only at the reply
    try:
        with GatewayClient(s.server.url, timeout=5) as c:
            ids = [c.submit(tokens(16, seed)) for seed in range(6)]  # batched: rounds of several
            for seed, i in enumerate(ids):
                np.testing.assert_allclose(c.result(i), s.expected(tokens(16, seed)), rtol=1e-5, atol=1e-6)
            s.workers[1].fail = True  # experts 2, 3 have no replica: those requests fail
            for seed in range(6):
                try:
                    np.testing.assert_allclose(c.forward(tokens(16, seed)), s.expected(tokens(16, seed)),
                                               rtol=1e-5, atol=1e-6)
                except P.RemoteError as e:  # failed, then refused while the worker is unhealthy
                    assert e.code in (P.WORKER_FAILED, P.UNAVAILABLE)
            all_slots_back(s.server.clients())
            s.workers[1].fail = False
            c.submit(tokens(16, 1))  # likely still in flight when the client goes
        assert late == []
        with GatewayClient(s.server.url, timeout=5) as c:  # the gateway serves on
            deadline = time.monotonic() + 5
            while True:  # once a ping has taken worker 1 back
                try:
                    np.testing.assert_allclose(c.forward(tokens(16, 3)), s.expected(tokens(16, 3)),
                                               rtol=1e-5, atol=1e-6)
                    break
                except P.RemoteError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            all_slots_back(s.server.clients())
    finally:
        s.close()


def all_slots_back(conns):
    """Every send slot of the gateway's one client connection is free (the client has read
    all its replies), within a few seconds."""
    assert len(conns) == 1
    pool = conns[0].send_pool
    deadline = time.monotonic() + 5
    while pool.available != pool.nslots:
        assert time.monotonic() < deadline, f"{pool.nslots - pool.available} reply slot(s) never came back"
        time.sleep(0.01)


@CHUNKS
def test_hot_update_pins_whole_requests_and_ends(chunk_rows):
    s = _stack([[0, 1], [2, 3]], chunk_rows=chunk_rows)
    try:
        with GatewayClient(s.server.url, timeout=5) as c:
            st = c.update("start", experts=[1], version=2, seed=5)
            deadline = time.monotonic() + 5
            while st["state"] == "loading":
                assert time.monotonic() < deadline
                st = c.update("status")
            assert st["state"] == "shifting"
            st = c.update("advance", fraction=0.5)
            seen = set()
            for seed in range(8):
                x = tokens(12, seed)
                y = c.forward(x)
                v = dict(c.last_versions or [])[1]
                seen.add(v)
                np.testing.assert_allclose(y, s.expected(x, {1: v}), rtol=1e-5, atol=1e-6)
            assert seen == {0, 2}  # at 50%, both versions serve, each a whole request
            st = c.update("finish")
            while st["state"] == "finishing":
                st = c.update("status")
            assert st["state"] == "done" and s.workers[0].active[1] == 2
            # a refused start leaves the machine as it was (no wedge)
            for bad in ({"experts": [9], "version": 3, "seed": 1}, {"experts": [1], "version": "x", "seed": 1},
                        {"experts": [1], "version": 3, "seed": "nope"}, {"experts": [1], "version": 3}):
                with pytest.raises(P.RemoteError):
                    c.update("start", **bad)
                assert c.update("status")["state"] == "done"
    finally:
        s.close()


def _raw_request(conn, header):
    conn.send(header, timeout=5)
    with conn.recv(timeout=5) as msg:
        return msg.header


def test_connections_and_control_need_the_secret():
    """A client without the gateway's secret cannot connect; on a gateway run without one
    (so no connection is authenticated) the hot update is refused, forwards are served."""
    import transport

    s = _stack([[0, 1], [2, 3]])
    try:
        with pytest.raises(transport.AuthenticationError):
            transport.connect(s.server.url, slot_size=1 << 16, nslots=2, timeout=5)
        with GatewayClient(s.server.url, timeout=5) as c:  # finds the session's secret
            assert c.update("status")["state"] == "none"
    finally:
        s.close()
    s = _stack([[0, 1], [2, 3]], secret=None)
    try:
        conn = transport.connect(s.server.url, slot_size=1 << 16, nslots=2, timeout=5)
        try:
            h = _raw_request(conn, P.request(P.UPDATE, 1, action="status"))
            assert h["op"] == P.ERROR and h["code"] == P.UNAUTHORIZED
            x = tokens(4)
            slot = conn.alloc(x.nbytes)
            np.copyto(slot.array(x.dtype, x.shape), x)
            conn.send(P.forward_request(2, x.shape, x.dtype), [slot], timeout=5)
            with conn.recv(timeout=5) as msg:
                assert msg.header["op"] == P.RESULT
                np.testing.assert_allclose(msg.array(0, np.float32, x.shape), s.expected(x), rtol=1e-5)
        finally:
            conn.close()
    finally:
        s.close()


@contextmanager
def _chunking_pool():
    """One fake worker with every expert, and a pool over it that cuts parts into chunks of 3 rows."""
    secret = secret_of_session()
    fw = FakeWorker([0, 1, 2, 3], d_model=D, secret=secret)
    pool = WorkerPool([fw.url], Router(D, E, K, seed=3), max_batch_tokens=256, timeout=5, connect_timeout=5,
                      secret=secret, chunk_rows=3)
    try:
        yield fw, pool
    finally:
        pool.close()
        fw.close()


def test_replies_that_faulted_in_fresh_memory_are_not_measured():
    """A reply whose worker says it took COLD_FAULTS page faults more than the fewest of its
    last SAMPLES replies measured memory being faulted in, not the worker: its compute, its
    time outside it and its gap are not recorded (gateway/chunking.py). A worker faulting
    that much on every reply is its steady state: after SAMPLES of them they count again."""
    from gateway.chunking import COLD_FAULTS, SAMPLES
    with _chunking_pool() as (fw, pool):
        costs = pool.workers[0].chunk_costs
        recorded = []
        record = costs.record_serve
        costs.record_serve = lambda s: (recorded.append(s), record(s))
        fw.fault_step = 10
        _, st = pool.forward(tokens(17))
        assert st.messages > SAMPLES and len(recorded) == st.messages  # warm: all measured
        recorded.clear()
        fw.fault_step = COLD_FAULTS + 1000  # from here, every reply faults that much
        _, st = pool.forward(tokens(17, 1))
        assert len(recorded) == st.messages - SAMPLES
        assert pool.workers[0].faults == fw.faults


def test_compute_in_a_round_that_faulted_here_is_not_measured(monkeypatch):
    """A round that wrote fresh memory in the gateway (a slot's pages touched for the first
    time) slows its workers' compute beside it, though each reply says few faults of its
    own: once the round's faults so far are COLD_FAULTS past the fewest of the last rounds',
    its replies' compute rates are left out of the size model's. The next warm round's
    count again; the messages' own costs are measured throughout."""
    import gateway.requests as R
    from gateway.chunking import COLD_FAULTS
    with _chunking_pool() as (fw, pool):
        costs = pool.workers[0].chunk_costs
        rates, serves = [], []
        record_compute, record_serve = costs.record_compute, costs.record_serve
        costs.record_compute = lambda rows, s: (rates.append(rows), record_compute(rows, s))
        costs.record_serve = lambda s: (serves.append(s), record_serve(s))
        fw.fault_step = 1  # each reply: one fault of the worker's own
        messages = sum(pool.forward(tokens(17, i))[1].messages for i in range(3))
        assert len(rates) == len(serves) == messages > 6  # warm: all measured
        rates.clear(), serves.clear()
        real, extra = R.minor_faults, [0]

        def faulting() -> int:  # the gateway faults 10 * COLD_FAULTS pages between any two looks
            extra[0] += 10 * COLD_FAULTS
            return real() + extra[0]

        monkeypatch.setattr(R, "minor_faults", faulting)
        y, st = pool.forward(tokens(17, 3))
        np.testing.assert_allclose(y, fake_layer_output(tokens(17, 3), pool.router.route(tokens(17, 3))), rtol=1e-5)
        assert rates == [] and len(serves) == st.messages
        monkeypatch.setattr(R, "minor_faults", real)
        _, st = pool.forward(tokens(17, 4))
        assert len(rates) == st.messages and sum(rates) == 17 * K


def test_every_message_measures_its_gather_and_send():
    """Each message's gather and send, by its rows, goes to the worker's costs: with no
    clock from the worker on a chunk's arrival, that is the way in the size model prices
    a part's first chunk by (ChunkCosts.edge_rates)."""
    with _chunking_pool() as (fw, pool):
        costs = pool.workers[0].chunk_costs
        got = []
        record = costs.record_gather
        costs.record_gather = lambda s, rows: (got.append((s, rows)), record(s, rows))
        _, st = pool.forward(tokens(17))
        assert len(got) == st.messages > 1
        assert sum(rows for _, rows in got) == 17 * K and all(s > 0 for s, _ in got)


def test_each_workers_sizer_cuts_its_part():
    """A round asks each worker's ChunkSizer (gateway/chunking.py) for its part's chunk size,
    with the part's rows and the pool's setting, and cuts the part where it says; the
    output is the same."""
    from gateway.chunking import ChunkSizer
    secret = secret_of_session()
    fws = [FakeWorker([0, 1], d_model=D, secret=secret), FakeWorker([2, 3], d_model=D, secret=secret)]
    router = Router(D, E, K, seed=3)
    pool = WorkerPool([f.url for f in fws], router, max_batch_tokens=256, timeout=5, connect_timeout=5,
                      secret=secret, chunk_rows=64)
    asked = []

    class Threes(ChunkSizer):
        def choose(self, rows, setting, costs, groups=None):
            asked.append((rows, setting))
            return 3, 1

    try:
        for w in pool.workers:
            w.chunk_sizer = Threes()
        x = tokens(17)
        out, st = pool.forward(x)
        np.testing.assert_allclose(out, fake_layer_output(x, router.route(x)), rtol=1e-5)
        rows = [f.rows for f in fws]
        assert sorted(asked) == sorted((n, 64) for n in rows if n) and sum(rows) == 17 * K
        # at most 3 rows a message (64 would have sent each part whole)
        assert st.messages == sum(f.forwards for f in fws) >= sum(-(-n // 3) for n in rows) > len(asked)
        assert [s["chunk_reprobes"] for s in pool.stats()] == [0, 0]  # what a gateway ping shows
    finally:
        pool.close()
        for f in fws:
            f.close()


def test_every_worker_gets_its_first_chunk_before_any_gets_its_second():
    """A chunked round goes chunk by chunk across the workers: worker by worker, the second
    worker's first chunk waited for the first worker's whole part to be gathered and sent,
    time it computed nothing. Each worker's chunks still go in order, and outputs are
    unchanged."""
    secret = secret_of_session()
    fws = [FakeWorker([0, 1], d_model=D, secret=secret), FakeWorker([2, 3], d_model=D, secret=secret)]
    router = Router(D, E, K, seed=3)
    try:
        with WorkerPool([f.url for f in fws], router, max_batch_tokens=256, timeout=5, connect_timeout=5,
                        secret=secret, chunk_rows=4) as pool:
            book = pool.rounds
            sends = []
            real = book._send_chunk

            def spy(rnd, w, c):
                why = real(rnd, w, c)
                if why is None:  # sent (not held back for credits)
                    sends.append((w.index, c))
                return why
            book._send_chunk = spy
            x = tokens(33)
            out, st = pool.forward(x)
            np.testing.assert_allclose(out, fake_layer_output(x, router.route(x)), rtol=1e-5)
            assert len(sends) == st.messages
            per = {i: [c for w, c in sends if w == i] for i in range(2)}
            assert all(len(cs) > 2 for cs in per.values()), per  # 33 tokens x top-2 over two workers
            assert all(cs == sorted(cs) == list(range(len(cs))) for cs in per.values()), per
            seconds = [k for k, (w, c) in enumerate(sends) if c == 1]
            firsts = [k for k, (w, c) in enumerate(sends) if c == 0]
            assert max(firsts) < min(seconds), sends
    finally:
        for f in fws:
            f.close()


def test_a_worker_is_let_read_each_chunk_while_the_next_is_gathered():
    """After each message but a round's last, the round asks the worker's connection to let
    its reader run (Connection.yield_to_peer: over tcp to this machine the woken worker
    waited on our CPU while we gathered the next chunk); after the last it waits for
    replies and asks nothing. Outputs are unchanged."""
    secret = secret_of_session()
    fws = [FakeWorker([0, 1], d_model=D, secret=secret), FakeWorker([2, 3], d_model=D, secret=secret)]
    router = Router(D, E, K, seed=3)
    try:
        for chunk_rows in (4, 0):
            with WorkerPool([f.url for f in fws], router, max_batch_tokens=256, timeout=5, connect_timeout=5,
                            secret=secret, chunk_rows=chunk_rows) as pool:
                asked = {w.index: 0 for w in pool.workers}
                for w in pool.workers:
                    w.conn.yield_to_peer = lambda i=w.index: asked.__setitem__(i, asked[i] + 1)
                before = [f.forwards for f in fws]
                x = tokens(17)
                out, st = pool.forward(x)
                np.testing.assert_allclose(out, fake_layer_output(x, router.route(x)), rtol=1e-5)
                sent = [f.forwards - b for f, b in zip(fws, before)]
                assert sum(sent) == st.messages
                if chunk_rows:
                    assert all(n > 1 for n in sent), sent  # 17 tokens x top-2 over two workers, 4 rows a chunk
                else:
                    assert sent == [1, 1]
                # chunk by chunk across the workers: the last message goes to the one with the
                # most chunks (the later one on a tie)
                last = max(range(2), key=lambda i: (sent[i], i))
                assert [asked[i] for i in range(2)] == [n - (i == last) for i, n in enumerate(sent)]
    finally:
        for f in fws:
            f.close()


def test_a_request_that_fails_while_its_chunks_wait_costs_the_others_nothing(caplog):
    """A request fails on one worker while its round's chunks for another worker still wait
    in the backlog for credits, and is released (its input gone) before they go. They go
    without its rows: the other worker keeps every send slot and the next request is served.
    (Gathering a released request's rows raised on every pump, a send slot lost each time,
    until that worker could take nothing.)"""
    s = _stack([[0, 1], [2, 3]], chunk_rows=1, nslots=2)
    try:
        s.workers[0].fail = True  # an error reply: the request fails (no replica to retry on)
        s.workers[1].delay = 0.05  # two of its 1-row chunks in flight, the rest waiting
        x = tokens(16, 0)
        idx = s.router.route(x).topk_idx
        assert (idx < 2).any() and (idx >= 2).sum() > 4  # rows on both, and a backlog on worker 1
        pool = tokens(400, 1)
        only_1 = pool[(s.router.route(pool).topk_idx >= 2).all(axis=1)][:6]  # rows for worker 1 alone
        assert len(only_1) == 6
        with GatewayClient(s.server.url, timeout=10) as c:
            with pytest.raises(P.RemoteError) as e:
                c.forward(x)
            assert "fake failure" in e.value.message
            np.testing.assert_allclose(c.forward(only_1), s.expected(only_1), rtol=1e-5, atol=1e-6)
        assert s.workers[1].rows >= (idx >= 2).sum()  # the failed round's chunks all went
        assert not [r for r in caplog.records if r.levelname == "ERROR"]
    finally:
        s.close()


@pytest.mark.parametrize("spin", [True, False], ids=["spin", "sleep"])
def test_the_loop_spins_for_a_workers_last_reply_only_when_asked(spin):
    """A worker whose compute the gateway measured (0.2 ms a forward): with reply_spin, the
    loop busy-polls in a window around when each reply is due, and never longer than the
    windows allow; without it, it never spins. The outputs are the same either way, and the
    gateway's ping reports the windows."""
    from gateway.reply_clock import LEAD_MAX
    s = _stack([[0, 1, 2, 3]], chunk_rows=0, reply_spin=spin)
    assert s.pool.rounds.clock.local_workers == 1  # on a loopback address
    s.pool.rounds.clock.cpus = 2  # the gateway and its one worker on two processors, wherever this runs
    s.workers[0].compute_s = 0.0002
    try:
        with GatewayClient(s.server.url, timeout=5) as c:
            for seed in range(12):
                x = tokens(17, seed)
                np.testing.assert_allclose(c.forward(x), s.expected(x), rtol=1e-5, atol=1e-6)
            reported = c.ping()["reply_spin"]
        spun = s.pool.loop.stats.spin_s
        if spin:
            # all but the first (unmeasured) and any whose compute overshot a millisecond asleep
            assert reported["enabled"] and reported["windows"] >= 4
            # each accounted for when its reply landed (whether inside: the unit tests; here the
            # fake worker shares the spinning thread's interpreter)
            assert sum(reported[k] for k in ("hits", "early", "late")) == reported["windows"]
            assert 0 < spun <= reported["windows"] * 2 * LEAD_MAX + 0.05
        else:
            assert not reported["enabled"] and reported["windows"] == 0 and spun == 0.0
    finally:
        s.close()



def test_a_part_larger_than_the_socket_buffers_is_written_as_the_worker_reads():
    """A frame the kernel cannot take at once is finished as room appears: the pool's loop
    is asked to wake for room while bytes of it are left, and no longer once they are out
    (tests/test_serve_loop.py: that wake-up comes). Before, only the pool's 5 ms timer and
    its other wake-ups wrote the rest: the first 32 MB of a round took 10-46 ms to arrive."""
    d, rows = 2048, 4096
    worker = FakeWorker([0, 1], d_model=d, max_tokens=rows, secret=secret_of_session())
    router = Router(d, 2, 1, seed=3)
    try:
        with WorkerPool([worker.url], router, max_batch_tokens=rows, timeout=10, connect_timeout=5,
                        secret=secret_of_session(), chunk_rows=0) as pool:
            conn = pool.workers[0].conn
            asked = []
            real_watch = pool.loop.watch_write
            pool.loop.watch_write = lambda obj, on: (asked.append((obj is conn, on)), real_watch(obj, on))
            for seed in range(2):
                x = np.random.default_rng(seed).standard_normal((rows, d)).astype(np.float32)
                y, stats = pool.forward(x)  # 32 MiB each way, one message
                np.testing.assert_allclose(y, fake_layer_output(x, router.route(x)), rtol=1e-5, atol=1e-6)
                assert stats.messages == 1
                assert asked[-2:] == [(True, True), (True, False)]
                assert not pool.loop.watching_write(conn)
            assert len(asked) == 4
    finally:
        worker.close()
