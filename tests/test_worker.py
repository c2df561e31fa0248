"""moe-worker as a real process: forward in place, ping/info, error replies that leave it
serving, and the SIGTERM drain. Runs on tcp and shm (shm FAILS while it does not import)."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import numpy as np
import pytest

import transport
from tests.helpers_procs import BACKENDS, Services, backend_problem, listen_url, secret, shm_entries, wait_until
from workers import protocol as P
from workers.expert import SwiGLUExpert

D, F, SEED, MAX_TOKENS = 16, 32, 3, 32
EXPERTS = (0, 1, 5)

pytestmark = pytest.mark.timeout(120)


# each backend as it runs by default (tcp computes on a thread of its own, shm on the loop's),
# and the other way round
MODES = [(b, "auto") for b in BACKENDS] + [("tcp", "off"), ("shm", "on")]


@pytest.fixture(scope="module", params=MODES, ids=[f"{b}-compute-thread-{m}" for b, m in MODES])
def worker(request, tmp_path_factory):
    backend, compute_thread = request.param
    problem = backend_problem(backend)
    if problem:
        yield backend, problem
        return
    updates = tmp_path_factory.mktemp("updates")
    with Services() as services:
        w = services.worker(backend, EXPERTS, d_model=D, d_ff=F, seed=SEED, max_tokens=MAX_TOKENS,
                            extra=["--update-dir", str(updates), "--compute-thread", compute_thread])
        w.update_dir = updates
        w.compute_thread = compute_thread == "on" or compute_thread == "auto" and backend == "tcp"
        yield backend, w


def _service(worker):
    backend, s = worker
    if isinstance(s, str):
        pytest.fail(f"{backend}: {s}")
    return s


@pytest.fixture
def connect(worker):
    """A connection to the module's worker. Not made in the fixture's setup, so that a
    backend that does not work yet makes the test FAIL (pytest.fail), not error."""
    holder = []

    def make():
        holder.append(transport.connect(_service(worker).url, slot_size=1 << 16, nslots=4, timeout=10.0, secret=secret()))
        return holder[0]
    yield make
    for c in holder:
        c.close()


def _request(c, header, x=None, timeout=10.0):
    """Send one request (x staged into a send slot) and return its reply, skipping
    unsolicited notices."""
    if x is None:
        c.send(header, timeout=timeout)
    else:
        slot = c.alloc(x.nbytes)
        np.copyto(slot.array(x.dtype, x.shape), x)
        c.send(header, [slot], timeout=timeout)
    while True:
        msg = c.recv(timeout=timeout)
        if msg.header.get("op") != P.DRAINING:
            return msg
        msg.release()


def _forward(c, rid, x, groups):
    msg = _request(c, P.forward_request(rid, x.shape, x.dtype, groups), x)
    try:
        P.raise_if_error(msg.header)
        assert msg.header["op"] == P.RESULT and msg.header["id"] == rid
        return msg.array(0, np.float32, x.shape).copy(), msg.header
    finally:
        msg.release()


@contextlib.contextmanager
def _daemon_in_thread(expert_cls, url, *, compute_thread, nslots=4):
    """A WorkerDaemon of ``expert_cls`` experts 0 and 1, serving on a thread of this process,
    and a connection to it; stopped (and checked stopped) after."""
    import threading

    from workers.daemon import WorkerDaemon
    experts = {e: expert_cls.from_seed(e, D, F, seed=SEED, max_tokens=MAX_TOKENS) for e in (0, 1)}
    daemon = WorkerDaemon(experts, url, max_tokens=MAX_TOKENS, secret=secret(),
                          compute_thread=compute_thread, drain_idle=0.05)
    runner = threading.Thread(target=daemon.serve, daemon=True)
    runner.start()
    c = transport.connect(daemon.url, slot_size=1 << 16, nslots=nslots, timeout=10.0, secret=secret())
    try:
        yield daemon, c
    finally:
        c.close()
        daemon.request_stop()
        runner.join(15)
    assert not runner.is_alive()


def _send_forward(c, rid, x, groups):
    slot = c.alloc(x.nbytes)
    np.copyto(slot.array(x.dtype, x.shape), x)
    c.send(P.forward_request(rid, x.shape, x.dtype, groups), [slot], timeout=10.0)


def _tokens(n, seed=0, d=D):
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


def _expected(x, groups):
    y = np.empty_like(x)
    for e, s, c in groups:
        y[s:s + c] = SwiGLUExpert.from_seed(e, D, F, seed=SEED)(x[s:s + c])
    return y


def test_info_names_experts_and_limits(connect):
    conn = connect()
    with _request(conn, P.request(P.INFO, 7)) as msg:
        h = msg.header
    assert h["op"] == P.INFO and h["id"] == 7
    assert h["experts"] == sorted(EXPERTS)
    assert h["d_model"] == D and h["d_ff"] == F and h["dtype"] == "float32"
    assert h["max_tokens"] == MAX_TOKENS
    assert h["versions"] == [[e, 0, [0]] for e in sorted(EXPERTS)]


def test_forward_runs_each_group_on_its_expert(connect):
    conn = connect()
    x = _tokens(20)
    groups = [(0, 0, 7), (1, 7, 0), (5, 7, 13)]
    y, h = _forward(conn, 1, x, groups)
    np.testing.assert_allclose(y, _expected(x, groups), rtol=1e-5, atol=1e-6)
    assert h["compute_s"] >= 0
    assert sorted(e for e, _, _ in h["experts"]) == [0, 5]  # empty groups are skipped
    # its process's minor page faults so far: a count that only grows (gateway/chunking.py)
    assert isinstance(h["flt"], int) and h["flt"] > 0
    _, h2 = _forward(conn, 2, x, groups)
    assert h2["flt"] >= h["flt"]


def _op(conn, header):
    with _request(conn, header) as msg:
        return msg.header


def _load(conn, rid, expert, version, timeout=20.0, **source):
    """Send a load; the reply comes when the loader thread is done (forwards meanwhile are
    answered at once: the loop never waits for a load)."""
    return _op(conn, P.request(P.LOAD, rid, expert=expert, version=version, **source))


def test_hot_update_double_buffer_pin_and_retire(worker, tmp_path):
    """load stages version 1 beside the active 0 (from a seed, or an .npz file); forward
    groups pin either; without a pin the active one serves; retire makes the other active;
    a third version is refused until one is retired; nothing of this stops serving."""
    s = _service(worker)
    conn = transport.connect(s.url, slot_size=1 << 16, nslots=4, timeout=10.0, secret=secret())
    try:
        x = _tokens(12, seed=4)
        v0 = SwiGLUExpert.from_seed(5, D, F, seed=SEED)(x)
        v1 = SwiGLUExpert.from_seed(5, D, F, seed=SEED + 100)(x)
        h = _load(conn, 10, 5, 1, seed=SEED + 100)
        fp0 = SwiGLUExpert.from_seed(5, D, F, seed=SEED).fingerprint
        fp1 = SwiGLUExpert.from_seed(5, D, F, seed=SEED + 100).fingerprint
        assert fp0 != fp1
        assert h == {"op": P.LOADED, "id": 10, "expert": 5, "version": 1, "fingerprint": fp1,
                     "source": {"seed": SEED + 100}, "nbytes": 3 * D * F * 4}
        assert _load(conn, 11, 5, 1, seed=SEED + 100)["fingerprint"] == fp1  # idempotent
        page, nxt = P.parse_weights_page(_op(conn, P.request(P.WEIGHTS, 29)), 100)
        assert nxt is None and (0, 5, 0, fp0, {"seed": SEED}) in page and (0, 5, 1, fp1, {"seed": SEED + 100}) in page
        info = _op(conn, P.request(P.INFO, 12))
        assert [5, 0, [0, 1]] in info["versions"]
        y, h = _forward(conn, 13, x, [[5, 0, 12, 1]])
        np.testing.assert_allclose(y, v1, rtol=1e-5, atol=1e-6)
        assert h["versions"] == [[5, 1]]
        y, h = _forward(conn, 14, x, [[5, 0, 12, 0]])
        np.testing.assert_allclose(y, v0, rtol=1e-5, atol=1e-6)
        y, h = _forward(conn, 15, x, [[5, 0, 12]])  # unpinned: the active version (0)
        np.testing.assert_allclose(y, v0, rtol=1e-5, atol=1e-6)
        assert "versions" not in h
        with pytest.raises(P.RemoteError, match="unknown_version"):
            _forward(conn, 16, x, [[5, 0, 12, 7]])
        bad = _load(conn, 17, 5, 2, seed=1)
        assert bad["op"] == P.ERROR and "retire one first" in bad["message"]
        h = _op(conn, P.request(P.RETIRE, 18, expert=5, version=0))
        assert h == {"op": P.RETIRED, "id": 18, "expert": 5, "version": 0, "active": 1}
        y, _ = _forward(conn, 19, x, [[5, 0, 12]])  # now the active one is 1
        np.testing.assert_allclose(y, v1, rtol=1e-5, atol=1e-6)
        only = _op(conn, P.request(P.RETIRE, 20, expert=5, version=1))
        assert only["op"] == P.ERROR and "only one" in only["message"]
        # a version from an .npz file, then back to weights equal to version 0's
        path = s.update_dir / "e5.npz"  # new weights are read only from the worker's --update-dir
        SwiGLUExpert.save_many(path, [SwiGLUExpert.from_seed(5, D, F, seed=SEED, version=9)])
        h = _load(conn, 21, 5, 2, weights=str(path))
        assert h["fingerprint"] == fp0 and h["source"] == {"weights": str(path)}  # the same weights: one identity
        assert _op(conn, P.request(P.RETIRE, 22, expert=5, version=1))["active"] == 2
        y, _ = _forward(conn, 23, x, [[5, 0, 12]])
        np.testing.assert_allclose(y, v0, rtol=1e-5, atol=1e-6)
        for header, code in ((P.request(P.LOAD, 24, expert=5, version=3, weights=str(tmp_path / "none.npz")), P.LOAD_FAILED),
                             (P.request(P.LOAD, 25, expert=P.MAX_EXPERT_ID, version=3, seed=1), P.UNKNOWN_EXPERT),
                             (P.request(P.LOAD, 26, expert=5, version=3), P.BAD_REQUEST),
                             (P.request(P.LOAD, 27, expert=5, version=-1, seed=1), P.BAD_REQUEST)):
            h = _op(conn, header)
            assert h["op"] == P.ERROR and h["code"] == code, h
        y, _ = _forward(conn, 28, x, [[5, 0, 12]])  # still serving, still version 2
        np.testing.assert_allclose(y, v0, rtol=1e-5, atol=1e-6)
    finally:
        conn.close()


def test_ping_reports_counters(connect):
    conn = connect()
    with _request(conn, P.request(P.PING, 1)) as msg:
        before = msg.header
    x = _tokens(9, seed=1)
    _forward(conn, 2, x, [(1, 0, 4), (5, 4, 5)])
    with _request(conn, P.request(P.PING, 3)) as msg:
        after = msg.header
    assert after["op"] == P.PONG and after["id"] == 3
    assert after["experts"] == sorted(EXPERTS) and after["in_flight"] == 0 and after["draining"] is False
    b = dict((e, c) for e, c in before["counters"]["experts"])
    a = dict((e, c) for e, c in after["counters"]["experts"])
    assert a[1]["tokens"] - b[1]["tokens"] == 4 and a[5]["tokens"] - b[5]["tokens"] == 5
    assert a[1]["batches"] - b[1]["batches"] == 1
    assert a[0]["tokens"] == b[0]["tokens"]
    assert after["counters"]["batches"] == before["counters"]["batches"] + 1


BAD_REQUESTS = {
    "unknown_expert": (lambda x: P.forward_request(1, x.shape, x.dtype, [(2, 0, len(x))]), P.UNKNOWN_EXPERT),
    "wrong_d_model": (lambda x: P.forward_request(1, (len(x) * 2, D // 2), x.dtype, [(0, 0, len(x) * 2)]),
                      P.BAD_SHAPE),
    "payload_mismatch": (lambda x: P.forward_request(1, (len(x) + 1, D), x.dtype, [(0, 0, len(x) + 1)]),
                         P.BAD_SHAPE),
    "bad_dtype": (lambda x: P.forward_request(1, (len(x) * 2, D), np.float16, [(0, 0, len(x) * 2)]),
                  P.BAD_DTYPE),
    "groups_not_tiling": (lambda x: P.forward_request(1, x.shape, x.dtype, [(0, 0, 3)]), P.BAD_GROUPS),
    "no_groups": (lambda x: P.forward_request(1, x.shape, x.dtype), P.BAD_GROUPS),
    "unknown_op": (lambda x: {"op": "explode", "id": 1}, P.BAD_REQUEST),
    "no_id": (lambda x: {"op": P.PING}, P.BAD_REQUEST),
    "not_a_map": (lambda x: [1, 2, 3], P.BAD_REQUEST),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_an_error_reply_and_the_worker_keeps_serving(connect, case):
    conn = connect()
    make, code = BAD_REQUESTS[case]
    x = _tokens(6)
    with _request(conn, make(x), x) as msg:
        h = msg.header
    assert h["op"] == P.ERROR and h["code"] == code, h
    assert h["message"]
    # still serving, on this very connection
    y, _ = _forward(conn, 2, x, [(0, 0, 6)])
    np.testing.assert_allclose(y, _expected(x, [(0, 0, 6)]), rtol=1e-5, atol=1e-6)


def test_oversized_batch_is_refused(connect):
    conn = connect()
    x = _tokens(MAX_TOKENS + 1)
    with _request(conn, P.forward_request(1, x.shape, x.dtype, [(0, 0, len(x))]), x) as msg:
        h = msg.header
    assert h["op"] == P.ERROR and h["code"] == P.OVERSIZED and str(MAX_TOKENS) in h["message"]
    x = _tokens(MAX_TOKENS)
    y, _ = _forward(conn, 2, x, [(5, 0, MAX_TOKENS)])
    np.testing.assert_allclose(y, _expected(x, [(5, 0, MAX_TOKENS)]), rtol=1e-5, atol=1e-6)


def test_error_counters_count_by_code(connect):
    conn = connect()
    with _request(conn, P.request(P.PING, 1)) as msg:
        before = msg.header["counters"]["errors"].get(P.UNKNOWN_EXPERT, 0)
    x = _tokens(3)
    _request(conn, P.forward_request(2, x.shape, x.dtype, [(4, 0, 3)]), x).release()
    with _request(conn, P.request(P.PING, 3)) as msg:
        assert msg.header["counters"]["errors"][P.UNKNOWN_EXPERT] == before + 1


def test_many_connections_are_served_by_one_worker(worker):
    s = _service(worker)
    conns = [transport.connect(s.url, slot_size=1 << 16, nslots=4, timeout=10.0, secret=secret()) for _ in range(3)]
    try:
        xs = [_tokens(5 + i, seed=i) for i in range(3)]
        for i, (c, x) in enumerate(zip(conns, xs)):  # all in flight before any reply is read
            slot = c.alloc(x.nbytes)
            np.copyto(slot.array(x.dtype, x.shape), x)
            c.send(P.forward_request(i, x.shape, x.dtype, [(0, 0, len(x))]), [slot])
        for i, (c, x) in enumerate(zip(conns, xs)):
            with c.recv(timeout=10.0) as msg:
                assert msg.header["id"] == i
                np.testing.assert_allclose(msg.array(0, np.float32, x.shape), _expected(x, [(0, 0, len(x))]),
                                           rtol=1e-5, atol=1e-6)
    finally:
        for c in conns:
            c.close()


@pytest.mark.parametrize("backend,compute_thread", MODES, ids=[f"{b}-compute-thread-{m}" for b, m in MODES])
def test_sigterm_drains_in_flight_batches_then_exits_0(backend, compute_thread):
    problem = backend_problem(backend)
    if problem:
        pytest.fail(problem)
    shm_before = shm_entries()
    with Services() as services:
        # big enough that the batches are still being computed (or queued behind one) when
        # SIGTERM lands
        w = services.worker(backend, [0, 1], d_model=128, d_ff=512, max_tokens=512,
                            extra=["--compute-thread", compute_thread])
        c = transport.connect(w.url, slot_size=1 << 20, nslots=8, timeout=10.0, secret=secret())
        try:
            xs = [_tokens(512, seed=i, d=128) for i in range(4)]
            for i, x in enumerate(xs):
                slot = c.alloc(x.nbytes)
                np.copyto(slot.array(x.dtype, x.shape), x)
                c.send(P.forward_request(i, x.shape, x.dtype, [(0, 0, 256), (1, 256, 256)]), [slot])
            w.proc.send_signal(signal.SIGTERM)
            got, notices = {}, 0
            deadline = time.monotonic() + 20
            while len(got) < len(xs) and time.monotonic() < deadline:
                with c.recv(timeout=10.0) as msg:
                    if msg.header["op"] == P.DRAINING:
                        notices += 1
                        continue
                    assert msg.header["op"] == P.RESULT, msg.header
                    got[msg.header["id"]] = msg.array(0, np.float32, (512, 128)).copy()
            assert sorted(got) == list(range(len(xs)))
            while not notices:  # the notice may trail the results; it must come before the close
                with c.recv(timeout=10.0) as msg:
                    notices += msg.header["op"] == P.DRAINING
            e0 = SwiGLUExpert.from_seed(0, 128, 512, seed=0)
            e1 = SwiGLUExpert.from_seed(1, 128, 512, seed=0)
            for i, x in enumerate(xs):
                np.testing.assert_allclose(got[i][:256], e0(x[:256]), rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(got[i][256:], e1(x[256:]), rtol=1e-4, atol=1e-5)
            assert wait_until(lambda: not w.alive(), timeout=15)
            assert w.proc.returncode == 0
            assert notices == 1  # the peer was told to route elsewhere
        finally:
            c.close()
        with pytest.raises(transport.TransportError):  # it stopped accepting
            transport.connect(w.url, slot_size=1 << 16, nslots=2, timeout=2.0, secret=secret())
    assert shm_entries() - shm_before == set()


def test_more_batches_than_reply_slots_are_all_answered_in_order(connect, worker):
    """Forwards sent back to back, more than the client's receive slots (the worker's reply
    slots): with a compute thread, batches queued behind the one computing must not hold
    every reply slot (nothing could be sent to free one: shm deadlocked that way). A worker
    with a compute thread says when each arrived (``t_rx``, read by its loop's thread
    meanwhile), before it was taken up; one without does not (it reads between computes)."""
    threaded = _service(worker).compute_thread
    c = connect()  # nslots=4: the worker has 4 reply slots; we may send 8 (its slots)
    xs = [_tokens(MAX_TOKENS, seed=10 + i) for i in range(8)]
    groups = [(0, 0, 10), (1, 10, 12), (5, 22, MAX_TOKENS - 22)]
    for i, x in enumerate(xs):
        slot = c.alloc(x.nbytes)
        np.copyto(slot.array(x.dtype, x.shape), x)
        c.send(P.forward_request(100 + i, x.shape, x.dtype, groups), [slot], timeout=10.0)
    spans = []
    for i, x in enumerate(xs):
        with c.recv(timeout=10.0) as msg:
            P.raise_if_error(msg.header)
            assert msg.header["id"] == 100 + i  # computed one at a time, in the order sent
            np.testing.assert_allclose(msg.array(0, np.float32, x.shape), _expected(x, groups), rtol=1e-5, atol=1e-6)
            spans.append((msg.header["t_in"], msg.header["t_out"]))
            if threaded:
                assert isinstance(msg.header["t_rx"], float) and msg.header["t_rx"] <= msg.header["t_in"]
            else:
                assert "t_rx" not in msg.header
    # t_in is when the batch was taken up, not when it arrived: the busy spans never overlap
    for (a0, b0), (a1, b1) in zip(spans, spans[1:]):
        assert a0 <= b0 <= a1 <= b1


def test_weights_file_and_cli_errors(tmp_path):
    path = tmp_path / "experts.npz"
    experts = [SwiGLUExpert.from_seed(e, D, F, seed=11) for e in (2, 3)]
    SwiGLUExpert.save_many(path, experts)
    with Services() as services:
        w = services.start([sys.executable, "-m", "workers.cli", "--listen", listen_url("tcp"),
                            "--weights", str(path), "--max-tokens", "16", "--threads", "1", "--cpu", "0"])
        c = transport.connect(w.url, slot_size=1 << 16, nslots=4, timeout=10.0, secret=secret())
        try:
            with _request(c, P.request(P.INFO, 1)) as msg:
                assert msg.header["experts"] == [2, 3]
            x = _tokens(8)
            msg = _request(c, P.forward_request(2, x.shape, x.dtype, [(2, 0, 3), (3, 3, 5)]), x)
            with msg:
                y = msg.array(0, np.float32, x.shape)
                np.testing.assert_allclose(y[:3], experts[0](x[:3]), rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(y[3:], experts[1](x[3:]), rtol=1e-5, atol=1e-6)
        finally:
            c.close()
        # an expert the file lacks: a clear start-up failure, not a half-started worker
        with pytest.raises(Exception, match="exited with 2"):
            services.start([sys.executable, "-m", "workers.cli", "--listen", listen_url("tcp"),
                            "--weights", str(path), "--experts", "7"])
    assert os.path.exists(path)


@pytest.mark.parametrize("compute_thread", [True, False], ids=["compute-thread", "loop-thread"])
def test_a_failing_expert_costs_its_request_only(compute_thread):
    """An expert that raises while computing: that batch gets an INTERNAL error reply, the
    batches around it are answered, the worker keeps serving (on either thread)."""
    class Flaky(SwiGLUExpert):
        def forward(self, x, out):
            if x.size and x[0, 0] == 1234.0:
                raise FloatingPointError("poisoned input")
            return super().forward(x, out)

    with _daemon_in_thread(Flaky, "tcp://127.0.0.1:0", compute_thread=compute_thread) as (daemon, c):
        groups = [(0, 0, 8), (1, 8, 8)]
        xs = [_tokens(16, seed=i) for i in range(3)]
        xs[1][8, 0] = 1234.0  # expert 1's first row
        for i, x in enumerate(xs):
            _send_forward(c, i, x, groups)
        replies = {}
        for _ in xs:
            with c.recv(timeout=10.0) as msg:
                replies[msg.header["id"]] = (msg.header, msg.array(0, np.float32, (16, D)).copy()
                                             if msg.header["op"] == P.RESULT else None)
        assert replies[1][0]["op"] == P.ERROR and replies[1][0]["code"] == P.INTERNAL
        assert "expert 1 failed" in replies[1][0]["message"] and "poisoned" in replies[1][0]["message"]
        for i in (0, 2):
            assert replies[i][0]["op"] == P.RESULT
            np.testing.assert_allclose(replies[i][1], _expected(xs[i], groups), rtol=1e-5, atol=1e-6)
        assert daemon.stats.errors == {P.INTERNAL: 1}
        assert daemon.stats.experts[(0, 1)].errors == 1
        # the loop thread counts a batch out after its reply went (the client may be first)
        assert wait_until(lambda: daemon.in_flight == 0, timeout=5)


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_forwards_waiting_behind_one_are_read_before_it_computes(backend):
    """On the loop thread (shm's default), the forwards already waiting when one is taken are
    read and checked before it computes, not between two products: a bad one among them is
    refused, and a ping answered, before the batches ahead of them are; every batch is still
    computed once, in the order sent, and the busy spans (t_in, t_out) never overlap."""
    import threading

    gate = threading.Event()

    class Gated(SwiGLUExpert):
        def forward(self, x, out):
            if x.size and x[0, 0] == 4321.0:
                assert gate.wait(10)  # holds the worker in its first batch while the rest arrive
            return super().forward(x, out)

    with _daemon_in_thread(Gated, listen_url(backend), compute_thread=False, nslots=8) as (daemon, c):
        groups = [(0, 0, 8), (1, 8, 8)]
        xs = [_tokens(16, seed=20 + i) for i in range(4)]
        xs[0][0, 0] = 4321.0
        _send_forward(c, 0, xs[0], groups)
        assert wait_until(lambda: daemon.in_flight == 1, timeout=5)  # computing, held at the gate
        _send_forward(c, 1, xs[1], groups)
        _send_forward(c, 2, xs[2], [(0, 0, 8), (9, 8, 8)])  # expert 9 is not hosted: refused
        c.send(P.request(P.PING, 3), timeout=10.0)
        _send_forward(c, 4, xs[3], groups)
        gate.set()
        order, spans = [], {}
        for _ in range(5):
            with c.recv(timeout=10.0) as msg:
                h = msg.header
                order.append((h["op"], h["id"]))
                if h["op"] == P.RESULT:
                    x = xs[{0: 0, 1: 1, 4: 3}[h["id"]]]
                    np.testing.assert_allclose(msg.array(0, np.float32, x.shape), _expected(x, groups),
                                               rtol=1e-5, atol=1e-6)
                    spans[h["id"]] = (h["t_in"], h["t_out"])
        assert order == [(P.RESULT, 0), (P.ERROR, 2), (P.PONG, 3), (P.RESULT, 1), (P.RESULT, 4)]
        (a0, b0), (a1, b1), (a4, b4) = spans[0], spans[1], spans[4]
        assert a0 <= b0 <= a1 <= b1 <= a4 <= b4
        assert daemon.stats.errors == {P.UNKNOWN_EXPERT: 1}
        assert wait_until(lambda: daemon.in_flight == 0, timeout=5)


def test_a_load_of_an_expert_not_hosted_adds_a_copy_up_to_max_experts_and_unhost_drops_it(worker):
    """Live placement's worker side: loading an expert the worker does not host adds a
    physical copy (from a seed here), served at that version and listed in info; more than
    --max-experts (default: twice the start-up experts) is refused; unhost drops a copy and
    its ids again, but never the worker's last expert."""
    s = _service(worker)
    conn = transport.connect(s.url, slot_size=1 << 16, nslots=4, timeout=10.0, secret=secret())
    added = []
    try:
        assert _op(conn, P.request(P.INFO, 40))["max_experts"] == 2 * len(EXPERTS)
        for rid, e in ((41, 2), (42, 3), (43, 4)):
            h = _load(conn, rid, e, 0, seed=SEED)
            assert h["op"] == P.LOADED and h["fingerprint"] == SwiGLUExpert.from_seed(e, D, F, seed=SEED).fingerprint
            added.append(e)
        info = _op(conn, P.request(P.INFO, 44))
        assert info["experts"] == sorted(EXPERTS + (2, 3, 4)) and [3, 0, [0]] in info["versions"]
        full = _load(conn, 45, 6, 0, seed=SEED)
        assert full["op"] == P.ERROR and "at most 6" in full["message"], full
        x = _tokens(9, seed=6)
        y, _ = _forward(conn, 46, x, [[3, 0, 5], [0, 5, 4]])
        np.testing.assert_allclose(y, _expected(x, [(3, 0, 5), (0, 5, 4)]), rtol=1e-5, atol=1e-6)
        for rid, e in ((47, 2), (48, 3), (49, 4)):
            assert _op(conn, P.request(P.UNHOST, rid, expert=e)) == {"op": P.UNHOSTED, "id": rid, "expert": e}
            added.remove(e)
        assert _op(conn, P.request(P.INFO, 50))["experts"] == sorted(EXPERTS)
        with pytest.raises(P.RemoteError, match="unknown_expert"):
            _forward(conn, 51, x, [[3, 0, 9]])
        gone = _op(conn, P.request(P.UNHOST, 52, expert=3))
        assert gone["op"] == P.ERROR and gone["code"] == P.UNKNOWN_EXPERT
    finally:
        for e in added:
            _op(conn, P.request(P.UNHOST, 60 + e, expert=e))
        conn.close()


def test_a_worker_never_unhosts_its_last_expert(tmp_path):
    with Services() as services:
        w = services.worker("tcp", [4], d_model=D, d_ff=F, seed=SEED, max_tokens=MAX_TOKENS)
        conn = transport.connect(w.url, slot_size=1 << 16, nslots=4, timeout=10.0, secret=secret())
        try:
            h = _op(conn, P.request(P.UNHOST, 1, expert=4))
            assert h["op"] == P.ERROR and "only one" in h["message"]
            assert _op(conn, P.request(P.INFO, 2))["experts"] == [4]
        finally:
            conn.close()
