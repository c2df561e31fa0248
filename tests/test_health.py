"""The operator surface over real HTTP: /healthz is the serve loop turning (stale when it is
stuck), /readyz the service's judgement (a gateway with an expert nobody healthy serves,
a draining worker: 503); connection labels are stable slots that survive reconnects and
only grow; every service says its build; per-expert compute is a histogram."""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from gateway.client import GatewayClient
from tests.helpers_procs import Services, wait_until
from transport.service.connbook import ConnectionBook
from transport.service.health import Health, HealthServer, Heartbeat

pytestmark = pytest.mark.timeout(120)
D, F, E = 16, 32, 4


def get(url: str) -> tuple[int, str, str]:
    """(status, content type, body) of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def samples(base: str) -> dict:
    status, _, text = get(base + "/metrics")
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the endpoint itself ---------------------------------------------------------------------
def test_endpoint_paths_and_a_stale_heartbeat():
    clock = SimpleNamespace(t=100.0)
    beat = Heartbeat(stale_after=2.0, clock=lambda: clock.t)
    ready = {"ok": True}
    reg = CollectorRegistry()
    Counter("moe_demo", "a demo counter", registry=reg).inc(3)
    srv = HealthServer("127.0.0.1", 0, reg, Health(live=beat.check, ready=lambda: (ready["ok"], {"why": "test"})))
    srv.start()
    base = f"http://127.0.0.1:{srv.address[1]}"
    try:
        status, ctype, body = get(base + "/metrics")
        assert status == 200 and ctype.startswith("text/plain") and "moe_demo_total 3.0" in body
        assert get(base + "/healthz")[0] == 200
        assert get(base + "/readyz")[0] == 200
        assert get(base + "/nothing")[0] == 404  # not the metrics page, as prometheus_client served it
        clock.t += 5.0  # the loop stopped stamping: liveness fails, and so does readiness
        status, ctype, body = get(base + "/healthz")
        assert status == 503 and ctype == "application/json"
        assert json.loads(body)["status"] == "unavailable" and json.loads(body)["loop_age_s"] >= 5.0
        assert get(base + "/readyz")[0] == 503
        beat.tick(clock.t)
        assert get(base + "/healthz")[0] == 200
        ready["ok"] = False
        status, _, body = get(base + "/readyz")
        assert status == 503 and json.loads(body)["why"] == "test"
        assert get(base + "/healthz")[0] == 200  # not ready is not dead
    finally:
        srv.close()


def test_heartbeat_goes_stale_while_the_serve_loop_is_stuck():
    """A real ServeLoop: while a timer of the service blocks the loop, /healthz is 503."""
    from transport.service.loop import ServeLoop

    loop = ServeLoop()
    beat = Heartbeat(stale_after=0.3)
    loop.add_tick(beat.tick)
    stuck = threading.Event()
    release = threading.Event()

    def tick(now):
        if stuck.is_set():
            release.wait(10)
            stuck.clear()
        return None

    loop.add_tick(tick)
    srv = HealthServer("127.0.0.1", 0, CollectorRegistry(), Health(live=beat.check))
    srv.start()
    base = f"http://127.0.0.1:{srv.address[1]}"
    stop = threading.Event()
    t = threading.Thread(target=lambda: loop.run(until=stop.is_set), daemon=True)
    t.start()
    try:
        assert wait_until(lambda: get(base + "/healthz")[0] == 200, timeout=5)
        stuck.set()
        loop.wake()
        assert wait_until(lambda: get(base + "/healthz")[0] == 503, timeout=5)
        release.set()
        assert wait_until(lambda: get(base + "/healthz")[0] == 200, timeout=5)
    finally:
        release.set()
        stop.set()
        loop.wake()
        t.join(5)
        loop.close()
        srv.close()


def test_connection_book_reuses_slots_and_its_counts_only_grow():
    class Conn:
        def __init__(self, url, sent):
            self.url = url
            self.stats = SimpleNamespace(bytes_sent=sent, bytes_received=0, messages_sent=1, messages_received=0,
                                         copies=0, credit_stalls=0)

    book = ConnectionBook("client")
    a, b = Conn("tcp://127.0.0.1:40001", 10), Conn("tcp://127.0.0.1:40002", 20)
    assert (book.opened(a), book.opened(b)) == (0, 1)
    book.closed(a)
    c = Conn("tcp://127.0.0.1:40003", 5)  # another ephemeral port: the same series
    assert book.opened(c) == 0
    rows = {name: counts for name, backend, counts in book.samples()}
    assert set(rows) == {"client-0", "client-1"}
    assert rows["client-0"][0] == 15 and rows["client-0"][2] == 2  # a's final counts + c's
    book.closed(c)
    book.closed(b)
    rows = {name: counts for name, _, counts in book.samples()}
    assert rows["client-0"][0] == 15 and rows["client-1"][0] == 20  # closed: kept, never reset
    workers = ConnectionBook("worker")
    workers.opened(Conn("tcp://10.0.0.2:5000", 7), slot=3)
    assert [n for n, _, _ in workers.samples()] == ["worker-3"]


# -- the services ------------------------------------------------------------------------------
def test_gateway_readiness_follows_its_workers_and_labels_stay_bounded():
    with Services() as services:
        w0 = services.worker("tcp", [0, 1], d_model=D, d_ff=F, max_tokens=64,
                             extra=["--metrics-port", str(wport := free_port())])
        w1 = services.worker("tcp", [2, 3], d_model=D, d_ff=F, max_tokens=64)
        gport = free_port()
        gw = services.gateway("tcp", workers=[w0.url, w1.url], n_experts=E, top_k=2, max_batch_tokens=32,
                              metrics_port=gport)
        gbase, wbase = f"http://127.0.0.1:{gport}", f"http://127.0.0.1:{wport}"
        assert get(gbase + "/healthz")[0] == 200
        status, _, body = get(gbase + "/readyz")
        assert status == 200, body
        assert get(wbase + "/readyz")[0] == 200
        x = np.random.default_rng(0).standard_normal((8, D)).astype(np.float32)
        for _ in range(3):  # three clients one after the other: one client slot
            with GatewayClient(gw.url, timeout=20.0) as c:
                c.forward(x)
        s = samples(gbase)
        conns = {dict(lab)["conn"] for (n, lab) in s if n == "moe_transport_messages_received_total"}
        assert conns == {"client-0", "worker-0", "worker-1"}, conns
        assert sum(v for (n, lab), v in s.items() if n == "moe_transport_messages_received_total"
                   and dict(lab)["conn"] == "client-0") == 3  # closed connections' counts kept
        assert not any("peer" in dict(lab) or "url" in dict(lab) for (n, lab) in s if n.startswith("moe_transport"))
        build = [dict(lab) for (n, lab) in s if n == "moe_build_info"]
        assert len(build) == 1 and build[0]["service"] == "gateway" and build[0]["version"] and build[0]["python"]
        wb = [dict(lab) for (n, lab) in samples(wbase) if n == "moe_build_info"]
        assert len(wb) == 1 and wb[0]["service"] == "worker"
        assert {dict(lab)["url"] for (n, lab) in s if n == "moe_gateway_worker_info"} == {w0.url, w1.url}

        w1.kill()  # experts 2 and 3 have nobody now: alive, but not ready
        assert wait_until(lambda: get(gbase + "/readyz")[0] == 503, timeout=15)
        status, _, body = get(gbase + "/readyz")
        assert json.loads(body)["experts_without_healthy_worker"] == [2, 3]
        assert get(gbase + "/healthz")[0] == 200

        # worker 0 restarts at its URL: the gateway reconnects; its series continue, none is added
        before = sum(v for (n, lab), v in samples(gbase).items() if n == "moe_transport_messages_sent_total"
                     and dict(lab)["conn"] == "worker-0")
        w0.kill()
        services.start(w0.argv[:w0.argv.index("--listen") + 1] + [w0.url] + w0.argv[w0.argv.index("--listen") + 2:])
        assert wait_until(lambda: samples(gbase)[("moe_gateway_worker_healthy", frozenset({("worker", "0")}))] == 1,
                          timeout=20)
        s = samples(gbase)
        conns = {dict(lab)["conn"] for (n, lab) in s if n == "moe_transport_messages_sent_total"}
        assert conns == {"client-0", "worker-0", "worker-1"}, conns
        after = sum(v for (n, lab), v in s.items() if n == "moe_transport_messages_sent_total"
                    and dict(lab)["conn"] == "worker-0")
        assert after >= before  # the old connection's messages are kept in its slot


def test_worker_compute_histogram_and_draining_readiness(tmp_path):
    from workers.daemon import COMPUTE_BUCKETS, WorkerDaemon
    from workers.expert import SwiGLUExpert
    from workers.metrics import worker_health, worker_registry
    from transport.service.metrics import serve

    import transport

    experts = {e: SwiGLUExpert.from_seed(e, D, F, seed=0, max_tokens=64) for e in (0, 1)}
    daemon = WorkerDaemon(experts, "tcp://127.0.0.1:0", max_tokens=64, drain_idle=30.0, drain_timeout=30.0)
    conn = runner = None
    try:
        for dt in (2e-5, 3e-3, 3e-3, 9.0):  # what the forward path records per expert group
            daemon.stats.experts[(0, 0)].observe(dt)  # (layer, expert): demo weights are layer 0
        url = serve(worker_registry(daemon), 0, health=worker_health(daemon), stream=open(tmp_path / "m", "w"))
        base = url.rsplit("/", 1)[0]
        s = samples(base)
        b = {dict(lab)["le"]: v for (n, lab), v in s.items()
             if n == "moe_expert_compute_seconds_bucket" and dict(lab)["expert"] == "0"}
        assert len(b) == len(COMPUTE_BUCKETS) + 1
        assert b["2.5e-05"] == 1 and b["0.0025"] == 1 and b["0.005"] == 3 and b["2.5"] == 3 and b["+Inf"] == 4
        lab = frozenset({("expert", "0"), ("layer", "0")})
        assert s[("moe_expert_compute_seconds_count", lab)] == 4
        assert s[("moe_expert_compute_seconds_sum", lab)] == pytest.approx(9.00602)

        runner = threading.Thread(target=daemon.serve, daemon=True)
        runner.start()
        conn = transport.connect(daemon.url, timeout=5)  # an idle gateway keeps the drain going
        assert wait_until(lambda: len(daemon.conn_book) == 1, timeout=5)
        assert get(base + "/readyz")[0] == 200
        daemon.request_stop()
        assert wait_until(lambda: get(base + "/readyz")[0] == 503, timeout=5)
        assert runner.is_alive()  # still draining: taken out of rotation, not dead
        assert json.loads(get(base + "/readyz")[2])["draining"] is True
        assert get(base + "/healthz")[0] == 200
    finally:
        if conn is not None:
            conn.close()
        daemon.request_stop()
        if runner is not None:
            runner.join(35)
        else:
            daemon.loop.close()
