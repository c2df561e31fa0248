"""Prometheus metrics for the worker and the gateway (prometheus_client, own registry).

The counters live where they always did (ExpertCounters, WorkerStats, GatewayStats,
WorkerState, ConnectionStats: plain numbers); a custom Collector reads them when
``/metrics`` is scraped, so the serve loops pay nothing for it. The only per-event work
is the gateway's per-round stage histograms (one ``observe`` per stage per round).

Both services share this module; it reads their objects through their public attributes
and takes no lock (values are plain ints/floats; containers are copied before iterating).
"""
from __future__ import annotations

import sys
from typing import Callable, Iterable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

METRICS = "METRICS"  # the stderr line: "METRICS http://host:port/metrics"
TRANSPORT_FIELDS = (  # ConnectionStats field -> metric (all counters)
    ("bytes_sent", "moe_transport_bytes_sent", "Bytes sent on the connection"),
    ("bytes_received", "moe_transport_bytes_received", "Bytes received on the connection"),
    ("messages_sent", "moe_transport_messages_sent", "Messages sent on the connection"),
    ("messages_received", "moe_transport_messages_received", "Messages received on the connection"),
    ("copies", "moe_transport_copies", "User-space copies (unregistered buffers handed to send)"),
    ("credit_stalls", "moe_transport_credit_stalls", "Sends that waited for the peer to return credits"),
)
STAGES = ("queue", "route", "dispatch", "compute", "wait", "combine", "total")
STAGE_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0, 10.0)


class _FnCollector(Collector):
    def __init__(self, fn: Callable[[], Iterable]):
        self._fn = fn

    def collect(self) -> Iterator:
        yield from self._fn()


def backend_of(conn) -> str:
    url = getattr(conn, "url", "") or ""
    return url.split("://", 1)[0] if "://" in url else type(conn).__module__.rsplit(".", 1)[-1]


def transport_families(conns: Iterable[tuple[str, object]]) -> list:
    """``conns``: (role, connection) pairs; one sample per connection per counter."""
    labels = ["role", "conn", "peer", "backend"]
    fams = {f: CounterMetricFamily(name, doc, labels=labels) for f, name, doc in TRANSPORT_FIELDS}
    for role, conn in conns:
        st = getattr(conn, "stats", None)
        if st is None:
            continue
        lv = [role, f"{role}-{id(conn):x}", str(getattr(conn, "url", "")), backend_of(conn)]
        for f, _, _ in TRANSPORT_FIELDS:
            fams[f].add_metric(lv, getattr(st, f))
    return list(fams.values())


# -- worker ---------------------------------------------------------------------

def worker_families(daemon) -> list:
    st = daemon.stats
    experts = sorted(list(st.experts.items()))
    tok = CounterMetricFamily("moe_expert_tokens", "Tokens (rows) computed per expert", labels=["expert"])
    bat = CounterMetricFamily("moe_expert_batches", "Expert groups computed per expert", labels=["expert"])
    err = CounterMetricFamily("moe_expert_errors", "Compute failures per expert", labels=["expert"])
    cs = SummaryMetricFamily("moe_expert_compute_seconds", "Expert compute time (count = batches)",
                             labels=["expert"])
    ver = GaugeMetricFamily("moe_expert_version", "Weights version served per expert", labels=["expert"])
    for e, c in experts:
        lv = [str(e)]
        tok.add_metric(lv, c.tokens)
        bat.add_metric(lv, c.batches)
        err.add_metric(lv, c.errors)
        cs.add_metric(lv, count_value=c.batches, sum_value=c.compute_seconds)
        ex = daemon.experts.get(e)
        ver.add_metric(lv, getattr(ex, "version", 0) if ex is not None else 0)
    fams = [tok, bat, err, cs, ver]
    fams.append(GaugeMetricFamily("moe_worker_in_flight", "Batches received and not yet answered",
                                  value=daemon.in_flight))
    fams.append(GaugeMetricFamily("moe_worker_queue_depth", "Batches waiting in this worker (received, "
                                  "not yet answered; the loop is single-threaded)", value=daemon.in_flight))
    fams.append(CounterMetricFamily("moe_worker_requests", "Requests handled", value=st.requests))
    fams.append(CounterMetricFamily("moe_worker_batches", "Forward batches answered", value=st.batches))
    ec = CounterMetricFamily("moe_worker_errors", "Error replies by code", labels=["code"])
    for code, n in sorted(list(st.errors.items())):
        ec.add_metric([str(code)], n)
    fams.append(ec)
    fams.append(CounterMetricFamily("moe_worker_connections_accepted", "Connections accepted",
                                    value=st.connections_accepted))
    fams.append(GaugeMetricFamily("moe_worker_connections_open", "Connections open", value=st.connections_open))
    fams.append(GaugeMetricFamily("moe_worker_draining", "1 while draining", value=int(daemon._draining)))
    fams.extend(transport_families(("gateway", c) for c in list(daemon._conns)))
    return fams


def worker_registry(daemon) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_FnCollector(lambda: worker_families(daemon)))
    return reg


# -- gateway --------------------------------------------------------------------

class GatewayMetrics:
    """The gateway's registry: a scrape-time collector plus per-round histograms fed by
    ``server.on_round`` (set by :meth:`attach`)."""

    def __init__(self, server) -> None:
        self.server = server
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_FnCollector(self._collect))
        self.stage = Histogram("moe_gateway_stage_seconds", "Per-round time per stage", ["stage"],
                               registry=self.registry, buckets=STAGE_BUCKETS)
        self._stage = {s: self.stage.labels(stage=s) for s in STAGES}
        self.round_requests = Histogram("moe_gateway_round_requests", "Requests batched per round",
                                        registry=self.registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.dropped = Counter("moe_gateway_dropped_tokens", "Token-expert assignments dropped by capacity",
                               registry=self.registry)
        self.overflow = Counter("moe_gateway_overflow_tokens", "Token-expert assignments over capacity",
                                registry=self.registry)
        self.rows = Counter("moe_gateway_rows", "Rows (token-expert assignments) sent to workers",
                            registry=self.registry)

    def attach(self) -> "GatewayMetrics":
        self.server.on_round = self.on_round
        return self

    def on_round(self, st, queue_s: float) -> None:
        s = self._stage
        s["queue"].observe(queue_s)
        s["route"].observe(st.route_s)
        s["dispatch"].observe(st.dispatch_s)
        s["compute"].observe(st.compute_s)
        s["wait"].observe(st.wait_s)
        s["combine"].observe(st.combine_s)
        s["total"].observe(st.total_s)
        self.round_requests.observe(st.requests)
        if st.dropped:
            self.dropped.inc(st.dropped)
        if st.overflow:
            self.overflow.inc(st.overflow)
        if st.rows:
            self.rows.inc(st.rows)

    def _collect(self) -> list:
        srv = self.server
        st = srv.stats
        pool = srv.pool
        fams = [
            CounterMetricFamily("moe_gateway_requests", "Forward requests received", value=st.requests),
            CounterMetricFamily("moe_gateway_replies", "Results sent", value=st.replies),
            CounterMetricFamily("moe_gateway_tokens", "Tokens received in forward requests", value=st.tokens),
            CounterMetricFamily("moe_gateway_rounds", "Dispatch rounds finished", value=st.rounds),
            CounterMetricFamily("moe_gateway_failed_rounds", "Dispatch rounds that failed", value=st.failed_rounds),
            CounterMetricFamily("moe_gateway_clients_accepted", "Client connections accepted",
                                value=st.clients_accepted),
            GaugeMetricFamily("moe_gateway_clients_open", "Client connections open", value=st.clients_open),
            GaugeMetricFamily("moe_gateway_queued_requests", "Requests waiting for a round", value=len(srv._queue)),
            GaugeMetricFamily("moe_gateway_queued_tokens", "Tokens waiting for a round", value=srv._queued_tokens),
            GaugeMetricFamily("moe_gateway_rounds_in_flight", "Rounds out at the workers", value=len(srv._rounds)),
        ]
        ec = CounterMetricFamily("moe_gateway_errors", "Error replies by code", labels=["code"])
        for code, n in sorted(list(st.errors.items())):
            ec.add_metric([str(code)], n)
        fams.append(ec)
        wl = ["worker", "url"]
        healthy = GaugeMetricFamily("moe_gateway_worker_healthy", "1 if the worker is usable", labels=wl)
        state = GaugeMetricFamily("moe_gateway_worker_state", "Worker state (1 on the current one)",
                                  labels=wl + ["state"])
        out = GaugeMetricFamily("moe_gateway_worker_outstanding_tokens", "Rows sent and not yet answered",
                                labels=wl)
        sent = CounterMetricFamily("moe_gateway_worker_rows_sent", "Rows sent to the worker", labels=wl)
        bsent = CounterMetricFamily("moe_gateway_worker_batches_sent", "Batches sent to the worker", labels=wl)
        fail = CounterMetricFamily("moe_gateway_worker_failures", "Failures seen on the worker", labels=wl)
        comp = CounterMetricFamily("moe_gateway_worker_compute_seconds", "Compute time the worker reported",
                                   labels=wl)
        erows = CounterMetricFamily("moe_gateway_worker_expert_rows", "Rows sent per worker and expert",
                                    labels=wl + ["expert"])
        conns = []
        for w in list(pool.workers):
            lv = [str(w.index), w.url]
            cur = "closed" if w.closed else "draining" if w.draining else "healthy" if w.healthy else "unhealthy"
            healthy.add_metric(lv, int(w.usable))
            for s in ("healthy", "unhealthy", "draining", "closed"):
                state.add_metric(lv + [s], int(s == cur))
            out.add_metric(lv, w.outstanding_rows)
            sent.add_metric(lv, w.rows_sent)
            bsent.add_metric(lv, w.batches_sent)
            fail.add_metric(lv, w.failures)
            comp.add_metric(lv, w.compute_seconds)
            for e, n in sorted(list(w.expert_rows.items())):
                erows.add_metric(lv + [str(e)], n)
            if not w.closed:
                conns.append(("worker", w.conn))
        fams += [healthy, state, out, sent, bsent, fail, comp, erows]
        conns += [("client", c) for c in list(srv._clients)]
        fams.extend(transport_families(conns))
        return fams


# -- serving --------------------------------------------------------------------

def serve(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1", *, stream=None) -> str:
    """Serve ``registry`` on http://addr:port/metrics (port 0: any free one) from a daemon
    thread; prints ``METRICS <url>`` on ``stream`` (stderr) and returns the URL."""
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    host, bound = server.server_address[:2]
    url = f"http://{'[' + host + ']' if ':' in str(host) else host}:{bound}/metrics"
    print(f"{METRICS} {url}", file=stream or sys.stderr, flush=True)
    return url


def add_flags(parser) -> None:
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on http://ADDR:PORT/metrics (0: a free port; "
                             "prints 'METRICS <url>' on stderr); default: off")
    parser.add_argument("--metrics-addr", default="127.0.0.1", help="address the metrics endpoint binds")


def maybe_serve(registry_fn: Callable[[], CollectorRegistry], args) -> Optional[str]:
    if getattr(args, "metrics_port", None) is None:
        return None
    return serve(registry_fn(), args.metrics_port, args.metrics_addr)
