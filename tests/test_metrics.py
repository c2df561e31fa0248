"""Prometheus metrics: a real gateway with local workers, each serving /metrics
(--metrics-port 0, --worker-metrics); the endpoints are scraped over HTTP and parsed with
prometheus_client's parser, then scraped by a real Prometheus (/usr/bin/prometheus, which
the Makefile installs; missing, that test FAILS)."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.parse
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.client import GatewayClient
from tests.helpers_procs import BACKENDS, backend_problem, listen_url, wait_until
from transport.service.launch import blas_env, spawn_service, stop_process

D, F, E, K, SEED = 16, 32, 4, 2, 3
REQUESTS = [7, 12, 5, 20]  # tokens per request
PROMETHEUS = "/usr/bin/prometheus"

pytestmark = pytest.mark.timeout(120)


def scrape(url: str) -> dict:
    """{(sample name, frozenset(labels)): value} of one /metrics page."""
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}


def family_names(url: str) -> set:
    """Every sample name the page declares, whether or not its family has samples now (an
    error counter with no error yet still is exported)."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = set()
    for fam in text_string_to_metric_families(text):
        out |= {fam.name + sfx for sfx in SUFFIXES.get(fam.type, ("",))}
        out |= {smp.name for smp in fam.samples}
    return out


def total(samples: dict, name: str, **match) -> float:
    want = set(match.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def labels_of(samples: dict, name: str, key: str) -> set:
    return {dict(lab)[key] for (n, lab) in samples if n == name and key in dict(lab)}


class Stack:
    def __init__(self, backend: str, tmp_path):
        self.stderr_path = tmp_path / "gateway.stderr"
        self.err = open(self.stderr_path, "w+")
        argv = [sys.executable, "-m", "gateway.cli", "--listen", listen_url(backend, "g"),
                "--backend", backend, "--local-workers", "2", "--d-model", str(D), "--d-ff", str(F),
                "--n-experts", str(E), "--top-k", str(K), "--seed", str(SEED), "--max-batch-tokens", "64",
                "--max-wait-ms", "0", "--metrics-port", "0", "--worker-metrics"]
        self.proc, self.url = spawn_service(argv, env=blas_env(1), stderr=self.err)
        # the gateway prints its METRICS line after its workers' (both before LISTENING)
        urls = re.findall(r"^METRICS (\S+)$", self.stderr_path.read_text(), re.M)
        assert len(urls) == 3, f"expected 3 METRICS lines, stderr:\n{self.stderr_path.read_text()}"
        self.gateway_metrics, self.worker_metrics = urls[-1], urls[:-1]

    def close(self):
        stop_process(self.proc, timeout=10.0)
        self.err.close()


@pytest.fixture(params=BACKENDS)
def stack(request, tmp_path):
    problem = backend_problem(request.param)
    if problem:
        pytest.fail(problem)
    s = Stack(request.param, tmp_path)
    yield s
    s.close()


def test_scrape_counts_match_what_was_sent(stack):
    rng = np.random.default_rng(0)
    with GatewayClient(stack.url, timeout=20.0) as client:
        for n in REQUESTS:
            client.forward(rng.standard_normal((n, D)).astype(np.float32))
        gw = scrape(stack.gateway_metrics)  # while the client is connected: its connection shows
        workers = [scrape(u) for u in stack.worker_metrics]
    tokens = sum(REQUESTS)
    assert total(gw, "moe_gateway_requests_total") == len(REQUESTS)
    assert total(gw, "moe_gateway_replies_total") == len(REQUESTS)
    assert total(gw, "moe_gateway_tokens_total") == tokens
    assert total(gw, "moe_gateway_rounds_total") == len(REQUESTS)  # max-wait 0, one client in turn
    assert total(gw, "moe_gateway_failed_requests_total") == 0
    for stage in ("route", "dispatch", "compute", "wait", "combine"):
        assert total(gw, "moe_gateway_stage_seconds_count", stage=stage) == len(REQUESTS), stage
        assert total(gw, "moe_gateway_stage_seconds_bucket", stage=stage, le="+Inf") == len(REQUESTS)
    assert total(gw, "moe_gateway_dropped_tokens_total") == 0  # no capacity factor
    assert total(gw, "moe_gateway_worker_healthy") == 2
    assert total(gw, "moe_gateway_worker_outstanding_tokens") == 0
    assert total(gw, "moe_gateway_worker_rows_sent_total") == tokens * K
    # the client's connection, seen from the gateway
    assert total(gw, "moe_transport_messages_received_total", role="client") == len(REQUESTS)
    assert total(gw, "moe_transport_messages_sent_total", role="client") == len(REQUESTS)
    assert total(gw, "moe_transport_bytes_sent_total", role="client") >= tokens * D * 4

    experts = set()
    for w in workers:
        experts |= labels_of(w, "moe_expert_tokens_total", "expert")
        assert total(w, "moe_worker_in_flight") == 0
        assert total(w, "moe_worker_connections_open") == 1
        assert labels_of(w, "moe_expert_version", "expert") == labels_of(w, "moe_expert_tokens_total", "expert")
        assert total(w, "moe_expert_errors_total") == 0
        assert total(w, "moe_expert_compute_seconds_sum") > 0
        # every message the worker received is a request it handled (hello + batches)
        assert total(w, "moe_transport_messages_received_total") == total(w, "moe_worker_requests_total")
        assert total(w, "moe_transport_messages_sent_total") == total(w, "moe_worker_requests_total")
    assert experts == {str(e) for e in range(E)}
    assert sum(total(w, "moe_expert_tokens_total") for w in workers) == tokens * K
    # what the gateway sent its workers is what they received
    assert total(gw, "moe_transport_messages_sent_total", role="worker") == \
        sum(total(w, "moe_transport_messages_received_total") for w in workers)
    # bytes_sent counts payload; bytes_received also the frame headers (on tcp)
    assert total(gw, "moe_transport_bytes_sent_total", role="worker") == tokens * K * D * 4
    assert sum(total(w, "moe_transport_bytes_received_total") for w in workers) >= tokens * K * D * 4
    # the data path copies nothing in user space
    assert total(gw, "moe_transport_copies_total") == 0
    for w in workers:
        assert total(w, "moe_transport_copies_total") == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(base: str, q: str) -> list:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': q})}"
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body.get("status") == "success", body
    return body["data"]["result"]


@pytest.mark.timeout(90)
def test_real_prometheus_scrapes_them(tmp_path):
    if not os.path.exists(PROMETHEUS):
        pytest.fail(f"{PROMETHEUS} is missing: install Debian's 'prometheus' package (make deps does, via apt)")
    s = Stack("tcp", tmp_path)
    prom = None
    try:
        with GatewayClient(s.url, timeout=20.0) as client:
            for n in REQUESTS:
                client.forward(np.random.default_rng(n).standard_normal((n, D)).astype(np.float32))
        targets = [urllib.parse.urlsplit(u).netloc for u in [s.gateway_metrics, *s.worker_metrics]]
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                       "scrape_configs:\n  - job_name: moe\n    static_configs:\n"
                       f"      - targets: {json.dumps(targets)}\n")
        port = _free_port()
        log = open(tmp_path / "prometheus.log", "w")
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        state = {}

        def ready():
            if prom.poll() is not None:
                raise AssertionError(f"prometheus exited with {prom.returncode}:\n"
                                     f"{(tmp_path / 'prometheus.log').read_text()[-3000:]}")
            try:
                up = _query(base, "up")
                tok = _query(base, "sum(moe_expert_tokens_total)")
                rounds = _query(base, "moe_gateway_rounds_total")
            except (OSError, ValueError):
                return False
            state.update(up=up, tok=tok, rounds=rounds)
            return (len(up) == 3 and all(r["value"][1] == "1" for r in up) and tok and rounds)

        assert wait_until(ready, timeout=30.0, interval=0.5), \
            f"targets not up within 30 s: {state}\n{(tmp_path / 'prometheus.log').read_text()[-3000:]}"
        assert {r["metric"]["instance"] for r in state["up"]} == set(targets)
        assert float(state["tok"][0]["value"][1]) == sum(REQUESTS) * K
        assert float(state["rounds"][0]["value"][1]) == len(REQUESTS)
    finally:
        if prom is not None:
            prom.kill()
            prom.wait(timeout=10)
        s.close()


def test_hot_update_metrics_and_every_dashboard_metric_is_exposed(stack):
    """During a hot update the gateway exports its traffic split and state, each worker the
    versions it holds; and every metric the Grafana dashboard queries is really served."""
    from pathlib import Path
    with GatewayClient(stack.url, timeout=20.0) as client:
        client.update("start", experts=[1], version=4, seed=SEED + 1, steps=[0.05, 0.5])
        assert wait_until(lambda: client.update("status")["state"] == "shifting", timeout=20.0)
        client.update("advance")
        for n in REQUESTS:
            client.forward(np.random.default_rng(n).standard_normal((n, D)).astype(np.float32))
        gw = scrape(stack.gateway_metrics)
        workers = [scrape(u) for u in stack.worker_metrics]
        client.update("finish")
    lab = dict(experts="1", old="0", new="4")
    assert total(gw, "moe_gateway_update_fraction", **lab) == 0.5
    assert total(gw, "moe_gateway_update_state", state="shifting", **lab) == 1
    assert total(gw, "moe_gateway_update_state", **lab) == 1  # exactly one state is on
    assert total(gw, "moe_gateway_update_requests_total", **lab) == len(REQUESTS)
    held = [w for w in workers if total(w, "moe_expert_version_held", expert="1")]
    assert len(held) == 1 and total(held[0], "moe_expert_version_held", expert="1", version="4") == 1
    assert total(held[0], "moe_expert_version_held", expert="1", version="0") == 1  # both: the double buffer
    assert total(gw, "moe_gateway_worker_expert_version", expert="1") == 0  # still the active one
    assert all(total(s, "process_cpu_seconds_total") > 0 for s in [gw, *workers])
    served = set().union(*(family_names(u) for u in [stack.gateway_metrics, *stack.worker_metrics]))
    dash = json.loads((Path(__file__).parent.parent / "deploy/grafana/dashboards/moe-transport.json").read_text())
    queried = {m for p in dash["panels"] for t in p.get("targets", [])
               for m in re.findall(r"\b(?:moe|process)_[a-z_]+\b", t["expr"])}
    assert queried and queried <= served, f"the dashboard queries metrics nobody serves: {queried - served}"


@pytest.mark.timeout(120)
def test_every_dashboard_query_on_a_real_prometheus(tmp_path):
    """The Grafana dashboard's every expression, evaluated by a real Prometheus scraping a
    gateway and its workers under load: each one parses and runs, and each whose metrics
    the services export returns series (an empty panel would mean a wrong name or label)."""
    import threading
    from pathlib import Path

    if not os.path.exists(PROMETHEUS):
        pytest.fail(f"{PROMETHEUS} is missing: install Debian's 'prometheus' package (make deps does, via apt)")
    dash = json.loads((Path(__file__).parent.parent / "deploy/grafana/dashboards/moe-transport.json").read_text())
    exprs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    s = Stack("tcp", tmp_path)
    prom, stop, load = None, threading.Event(), None

    def traffic():
        rng = np.random.default_rng(1)
        with GatewayClient(s.url, timeout=20.0) as c:
            try:
                c.forward(np.zeros((3, D + 1), np.float32))  # refused: an error code to chart
            except Exception:
                pass
            while not stop.is_set():
                c.forward(rng.standard_normal((int(rng.integers(1, 24)), D)).astype(np.float32))
                stop.wait(0.02)

    try:
        load = threading.Thread(target=traffic, daemon=True)
        load.start()
        jobs = {"moe-gateway": [urllib.parse.urlsplit(s.gateway_metrics).netloc],
                "moe-worker": [urllib.parse.urlsplit(u).netloc for u in s.worker_metrics]}
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n" + "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: {json.dumps(t)}\n" for job, t in jobs.items()))
        port = _free_port()
        log = open(tmp_path / "prometheus.log", "w")
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"

        def rates_flowing():
            if prom.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{(tmp_path / 'prometheus.log').read_text()[-3000:]}")
            try:
                return bool(_query(base, "sum(rate(moe_gateway_tokens_total[5s])) > 0")) and \
                    len(_query(base, "up == 1")) == 3
            except (OSError, ValueError):
                return False

        assert wait_until(rates_flowing, timeout=40.0, interval=0.5), \
            (tmp_path / "prometheus.log").read_text()[-3000:]
        exported = {name for (name, _) in scrape(s.gateway_metrics)}
        for u in s.worker_metrics:
            exported |= {name for (name, _) in scrape(u)}

        def empty_queries() -> list:
            empty = []
            for title, expr in exprs:
                q = expr.replace("$__rate_interval", "5s")
                result = _query(base, q)  # asserts status success: it parsed and ran
                names = set(re.findall(r"\b(?:moe|process)_[a-z_]+\b", expr))
                if names <= exported and not result:
                    empty.append((title, q))
            return empty

        # A worker's per-expert series appear with its first tokens, and a rate needs two
        # scrapes of them: give them a few scrape intervals past the gateway's.
        wait_until(lambda: not empty_queries(), timeout=30.0, interval=1.0)
        empty = empty_queries()
        assert not empty, f"dashboard queries with no series although their metrics are exported: {empty}"
        assert {r["metric"]["job"] for r in _query(base, "moe_build_info")} == {"moe-gateway", "moe-worker"}
    finally:
        stop.set()
        if load is not None:
            load.join(10)
        if prom is not None:
            prom.kill()
            prom.wait(timeout=10)
        s.close()
