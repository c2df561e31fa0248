"""Prometheus metrics for the worker (prometheus_client, own registry), and the pieces the
gateway's metrics (gateway/metrics.py) share: transport counters, serving, the flags.

The counters live where they always did (ExpertCounters, WorkerStats, GatewayStats,
WorkerState, ConnectionStats: plain numbers); a custom Collector reads them when
``/metrics`` is scraped, so the serve loops pay nothing for it. The only per-event work
is the gateway's per-round stage histograms (one ``observe`` per stage per round).

It reads the daemon's objects through their public attributes and takes no lock (values
are plain ints/floats; containers are copied before iterating).
"""
from __future__ import annotations

import sys
from typing import Callable, Iterable, Iterator, Optional

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
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


class FnCollector(Collector):
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
    ver = GaugeMetricFamily("moe_expert_version", "Active weights version per expert", labels=["expert"])
    held = GaugeMetricFamily("moe_expert_version_held", "1 per weights version held (hot update: two)",
                             labels=["expert", "version"])
    for e, c in experts:
        lv = [str(e)]
        tok.add_metric(lv, c.tokens)
        bat.add_metric(lv, c.batches)
        err.add_metric(lv, c.errors)
        cs.add_metric(lv, count_value=c.batches, sum_value=c.compute_seconds)
        ex = daemon.experts.get(e)
        ver.add_metric(lv, getattr(ex, "version", 0) if ex is not None else 0)
        for v in sorted(list(getattr(daemon, "held", {}).get(e, {}))):
            held.add_metric([str(e), str(v)], 1)
    fams = [tok, bat, err, cs, ver, held]
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
    reg.register(FnCollector(lambda: worker_families(daemon)))
    ProcessCollector(registry=reg)  # process_cpu_seconds_total, resident memory, open fds
    return reg


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
