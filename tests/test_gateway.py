"""moe-gateway as a real process over real workers: dynamic batching, client timeouts,
bad requests, worker failures (killed, stalled) that give errors and never hangs,
replicas taking load, and a clean SIGTERM. On tcp and shm (shm FAILS until it imports)."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import transport
from gateway.client import GatewayClient
from gateway.reference import ReferenceMoE
from tests.helpers_procs import BACKENDS, Services, backend_problem, pid_alive, shm_entries, wait_until
from workers import protocol as P

D, F, E, K, SEED = 16, 32, 8, 2, 2
TOL = dict(rtol=1e-4, atol=1e-5)
MAX_BATCH = 64
ROWS = MAX_BATCH * 4  # workers accept top-4 rounds of MAX_BATCH tokens

pytestmark = pytest.mark.timeout(120)


def tokens(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)


@pytest.fixture(scope="module")
def reference():
    return ReferenceMoE.from_seed(D, F, E, K, seed=SEED)


def _require(backend):
    problem = backend_problem(backend)
    if problem:
        pytest.fail(problem)


class Cluster:
    """Workers w0 (experts 0-3), w1 (4-7), w2 (0-3: replicas of w0's) and two gateways:
    ``batching`` waits up to 150 ms to fill a round while another is out, ``whole`` never
    splits an expert."""

    def __init__(self, services: Services, backend: str):
        self.backend = backend
        self.workers = [services.worker(backend, ex, d_model=D, d_ff=F, seed=SEED, max_tokens=ROWS)
                        for ex in ([0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3])]
        urls = [w.url for w in self.workers]
        common = dict(workers=urls, d_model=D, d_ff=F, n_experts=E, top_k=K, seed=SEED,
                      max_batch_tokens=MAX_BATCH)
        self.batching = services.gateway(backend, max_wait_ms=150, **common)
        self.whole = services.gateway(backend, max_wait_ms=0, no_split=True, **common)


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request):
    backend = request.param
    problem = backend_problem(backend)
    if problem:
        yield problem
        return
    with Services() as services:
        yield Cluster(services, backend)


def _cluster(c):
    if isinstance(c, str):
        pytest.fail(c)
    return c


def test_the_client_reads_the_layers_width_and_dtype_from_the_gateway(cluster, reference):
    c = _cluster(cluster)
    with GatewayClient(c.whole.url, timeout=10.0) as client:
        info = client.info()
        assert (info["d_model"], info["dtype"], info["n_experts"], info["top_k"]) == (D, "float32", E, K)
        assert client.d_model == D and client.dtype == np.float32
        x = tokens(5).astype(client.dtype)[:, :client.d_model]
        np.testing.assert_allclose(client.forward(x), reference.forward(x)[0], **TOL)


def test_concurrent_clients_are_batched_into_one_round(cluster, reference):
    c = _cluster(cluster)
    n = 4
    xs = [tokens(10 + i, seed=i) for i in range(n)]
    ys, rounds, errors = [None] * n, [None] * n, []
    clients = [GatewayClient(c.batching.url, timeout=10.0) for _ in range(n)]
    barrier = threading.Barrier(n)

    def run(i):
        try:
            barrier.wait(timeout=10)
            ys[i] = clients[i].forward(xs[i])
            rounds[i] = clients[i].last_round
        except Exception as e:
            errors.append(e)

    with GatewayClient(c.batching.url) as probe:
        before = probe.ping()["gateway"]
        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        after = probe.ping()["gateway"]
    for cl in clients:
        cl.close()
    assert not errors
    for x, y in zip(xs, ys):  # references on this thread: experts keep scratch, not thread-safe
        np.testing.assert_allclose(y, reference.forward(x)[0], **TOL)
    requests = after["requests"] - before["requests"]
    assert requests == n
    assert after["rounds"] - before["rounds"] < requests
    assert len(set(rounds)) < n  # some clients were served by the same round
    assert after["max_round_requests"] >= 2


def test_max_wait_zero_dispatches_each_request_at_once(cluster, reference):
    c = _cluster(cluster)
    with GatewayClient(c.whole.url) as cl:
        before = cl.ping()["gateway"]
        for i in range(3):
            x = tokens(8, seed=20 + i)
            np.testing.assert_allclose(cl.forward(x), reference.forward(x)[0], **TOL)
        after = cl.ping()["gateway"]
    assert after["rounds"] - before["rounds"] == 3


def test_a_lone_request_is_not_held_for_company(cluster, reference):
    """Batching is work-conserving: with no round out, a request goes at once instead of
    waiting max_wait (150 ms here) for others to share its round."""
    c = _cluster(cluster)
    with GatewayClient(c.batching.url) as cl:
        before = cl.ping()["gateway"]
        for i in range(3):
            x = tokens(6, seed=40 + i)
            np.testing.assert_allclose(cl.forward(x), reference.forward(x)[0], **TOL)
        after = cl.ping()["gateway"]
    assert after["rounds"] - before["rounds"] == 3
    queued = after["stage_seconds"]["queue"] - before["stage_seconds"]["queue"]
    assert queued < 3 * 0.05, f"lone requests waited {queued:.3f} s in the queue"


def test_client_timeout_then_the_late_reply_is_not_mistaken_for_the_next(cluster, reference):
    c = _cluster(cluster)
    with GatewayClient(c.batching.url) as cl:
        x1, x2 = tokens(5, seed=31), tokens(5, seed=32)
        t = time.monotonic()
        with pytest.raises(transport.Timeout):
            cl.forward(x1, timeout=0.0)  # sent, then abandoned before any reply can land
        assert time.monotonic() - t < 1.0
        y2 = cl.forward(x2, timeout=10.0)
        np.testing.assert_allclose(y2, reference.forward(x2)[0], **TOL)


@pytest.mark.parametrize("case", ["bad_dtype", "bad_d_model", "oversized", "one_dim"])
def test_bad_request_gets_a_clear_error_and_the_gateway_keeps_serving(cluster, reference, case):
    c = _cluster(cluster)
    x = {"bad_dtype": np.zeros((4, D), np.float64), "bad_d_model": np.zeros((4, D + 1), np.float32),
         "oversized": np.zeros((MAX_BATCH + 1, D), np.float32)}.get(case)
    code = {"bad_dtype": P.BAD_DTYPE, "bad_d_model": P.BAD_SHAPE, "oversized": P.OVERSIZED}.get(case)
    with GatewayClient(c.whole.url) as cl:
        if case == "one_dim":  # refused before it leaves the client
            with pytest.raises(ValueError):
                cl.forward(np.zeros(D, np.float32))
        else:
            with pytest.raises(P.RemoteError) as info:
                cl.forward(x, timeout=10.0)
            assert info.value.code == code and info.value.message
        y = tokens(6, seed=40)
        np.testing.assert_allclose(cl.forward(y, timeout=10.0), reference.forward(y)[0], **TOL)


def test_empty_batch_gets_an_empty_result(cluster):
    c = _cluster(cluster)
    with GatewayClient(c.whole.url) as cl:
        assert cl.forward(np.zeros((0, D), np.float32)).shape == (0, D)


def _expert_rows(pong, worker, experts):
    rows = dict((e, n) for e, n in pong["workers"][worker]["expert_rows"])
    return sum(rows.get(e, 0) for e in experts)


@pytest.mark.parametrize("gateway", ["batching", "whole"])
def test_replicas_share_the_load(cluster, reference, gateway):
    c = _cluster(cluster)
    g = getattr(c, gateway)
    with GatewayClient(g.url) as cl:
        before = cl.ping()
        for i in range(8):
            x = tokens(MAX_BATCH, seed=50 + i)
            np.testing.assert_allclose(cl.forward(x, timeout=10.0), reference.forward(x)[0], **TOL)
        after = cl.ping()
    replicated = [0, 1, 2, 3]
    w0 = _expert_rows(after, 0, replicated) - _expert_rows(before, 0, replicated)
    w2 = _expert_rows(after, 2, replicated) - _expert_rows(before, 2, replicated)
    assert w0 > 0 and w2 > 0
    if gateway == "batching":  # split over replicas: within a few rows per expert and batch
        assert abs(w0 - w2) <= 0.25 * (w0 + w2), (w0, w2)
    # experts 4-7 have one home
    assert _expert_rows(after, 2, [4, 5, 6, 7]) == 0
    assert all(w["healthy"] for w in after["workers"])


def _start(services, backend, layout, **flags):
    workers = [services.worker(backend, ex, d_model=D, d_ff=F, seed=SEED, max_tokens=ROWS) for ex in layout]
    gw = services.gateway(backend, workers=[w.url for w in workers], d_model=D, d_ff=F, n_experts=E,
                          top_k=K, seed=SEED, max_batch_tokens=MAX_BATCH, max_wait_ms=0, **flags)
    return workers, gw


@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_worker_gives_an_error_not_a_hang(backend, reference):
    _require(backend)
    with Services() as services:
        (w0, w1), gw = _start(services, backend, [[0, 1, 2, 3], [4, 5, 6, 7]], worker_timeout=5)
        with GatewayClient(gw.url, timeout=10.0) as cl:
            x = tokens(32, seed=60)
            np.testing.assert_allclose(cl.forward(x), reference.forward(x)[0], **TOL)
            w1.kill()
            for attempt in range(2):  # the loss is noticed, then the experts are unavailable
                t = time.monotonic()
                with pytest.raises(P.RemoteError) as info:
                    cl.forward(x)
                assert time.monotonic() - t < 5.0
                assert info.value.code in (P.WORKER_FAILED, P.UNAVAILABLE)
            assert info.value.code == P.UNAVAILABLE and "expert" in info.value.message
            # a batch that needs only the live worker's experts is still served
            pong = cl.ping()
            assert pong["workers"][1]["closed"] and pong["workers"][0]["healthy"]
        assert gw.alive()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replica_takes_over_from_a_dead_worker(backend, reference):
    _require(backend)
    with Services() as services:
        (w0, w1), gw = _start(services, backend, [list(range(E)), list(range(E))])
        with GatewayClient(gw.url, timeout=10.0) as cl:
            x = tokens(32, seed=61)
            y_ref = reference.forward(x)[0]
            np.testing.assert_allclose(cl.forward(x), y_ref, **TOL)
            w0.kill()
            for i in range(4):  # every expert has a second copy: a dead worker costs no request
                np.testing.assert_allclose(cl.forward(x), y_ref, **TOL)
            pong = cl.ping()
            assert pong["workers"][0]["closed"] and pong["workers"][1]["healthy"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_stalled_worker_times_out_then_comes_back(backend, reference):
    _require(backend)
    with Services() as services:
        (w0,), gw = _start(services, backend, [list(range(E))], worker_timeout=1)
        with GatewayClient(gw.url, timeout=10.0) as cl:
            x = tokens(16, seed=62)
            y_ref = reference.forward(x)[0]
            os.kill(w0.pid, signal.SIGSTOP)
            try:
                t = time.monotonic()
                with pytest.raises(P.RemoteError) as info:
                    cl.forward(x)
                # no replica: the request fails with `unavailable` once its part times out
                assert info.value.code == P.UNAVAILABLE and "no reply" in info.value.message
                assert time.monotonic() - t < 5.0
                with pytest.raises(P.RemoteError) as info:  # unhealthy now: refused at once
                    cl.forward(x)
                assert info.value.code == P.UNAVAILABLE
            finally:
                os.kill(w0.pid, signal.SIGCONT)

            def served():
                try:
                    return np.allclose(cl.forward(x), y_ref, **TOL)
                except P.RemoteError:
                    time.sleep(0.2)
                    return False
            assert wait_until(served, timeout=10.0)  # pinged back in once it answers


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigterm_stops_the_gateway_and_its_local_workers(backend, reference):
    _require(backend)
    shm_before = shm_entries()
    with Services() as services:
        gw = services.gateway(backend, local_workers=2, d_model=D, d_ff=F, n_experts=E, top_k=K,
                              seed=SEED, max_batch_tokens=MAX_BATCH, max_wait_ms=0)
        children = gw.children()
        assert len(children) == 2
        with GatewayClient(gw.url, timeout=10.0) as cl:
            x = tokens(20, seed=70)
            np.testing.assert_allclose(cl.forward(x), reference.forward(x)[0], **TOL)
        assert gw.stop(timeout=20.0) == 0
        assert wait_until(lambda: not any(pid_alive(p) for p in children), timeout=10.0)
    assert shm_entries() - shm_before == set()



@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_gateway_takes_its_local_workers_with_it(backend):
    _require(backend)
    shm_before = shm_entries()
    with Services() as services:
        gw = services.gateway(backend, local_workers=2, d_model=D, d_ff=F, n_experts=E, top_k=K, seed=SEED,
                              max_batch_tokens=MAX_BATCH)
        children = gw.children()
        assert len(children) == 2
        gw.kill()  # SIGKILL: no chance to stop them itself
        assert wait_until(lambda: not any(pid_alive(p) for p in children), timeout=10.0)
    assert shm_entries() - shm_before == set()

# -- pure parts, no processes ------------------------------------------------------

def test_choose_replicas_balances_load_and_splits_a_hot_expert():
    from gateway.replicas import choose_replicas

    counts = np.array([100, 30, 0, 10])
    hosts = {0: [0, 1], 1: [0], 3: [1, 2]}
    load = np.zeros(3)
    replicas, shares = choose_replicas(counts, hosts, load, split=True, min_split=8)
    # expert 1 pinned to w0 first; the hot expert 0 water-fills w0/w1 to one level
    assert replicas[1] == [0]
    assert replicas[0] == [0, 1] and shares[0][1] > shares[0][0]
    assert replicas[3] == [2]  # w2 is idle: the whole of expert 3 goes there
    assert load.sum() == counts.sum()
    assert abs(load[0] - load[1]) <= 1e-9
    whole, wshares = choose_replicas(counts, hosts, np.array([0.0, 50.0, 0.0]), split=False)
    assert whole[0] == [0] and wshares[0] == [1.0]  # least outstanding rows wins


def test_placement_spreads_experts_and_replicas():
    from gateway.supervisor import placement

    assert placement(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert placement(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    two = placement(8, 2, replicas=2)
    assert two == [list(range(8))] * 2
    three = placement(6, 3, replicas=2)
    assert all(sum(e in w for w in three) == 2 for e in range(6))
