"""Prometheus plumbing the services share (prometheus_client, one registry per process):
scrape-time collectors over plain counters, per-connection transport counters, and the
HTTP endpoint.

The counters live where they always did (plain numbers in the services' stats objects); a
collector reads them when ``/metrics`` is scraped, so the serve loops pay nothing for it.
"""
from __future__ import annotations

import sys
from typing import Callable, Iterable, Iterator, Optional

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
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


def serve_families(stats, service: str) -> list:
    """The serve loop's counters (transport/service/loop.py ServeStats): what was refused,
    dropped or timed out, and why."""
    refused = CounterMetricFamily("moe_serve_refused_connections", "Connections refused or dropped by the "
                                  "serve loop, by reason", labels=["service", "reason"])
    for reason, v in (("connection_cap", stats.refused_cap), ("authentication", stats.refused_auth),
                      ("handshake_refused", stats.refused_other), ("bad_handshake", stats.bad_handshakes),
                      ("handshake_timeout", stats.handshake_timeouts), ("idle", stats.idle_closed),
                      ("slow_reader", stats.slow_dropped), ("protocol_error", stats.protocol_errors)):
        refused.add_metric([service, reason], v)
    return [
        refused,
        _counter("moe_serve_accepted_connections", "Handshakes completed", service, stats.accepted),
        _gauge("moe_serve_open_connections", "Served connections open", service, stats.open),
        _gauge("moe_serve_pending_handshakes", "Handshakes in progress", service, stats.pending),
        _counter("moe_serve_accept_backoffs", "Times a listener paused (out of file descriptors)", service,
                 stats.accept_backoffs),
        _counter("moe_serve_held_replies", "Replies held for a peer that could not take them at once", service,
                 stats.held_replies),
    ]


def _counter(name: str, doc: str, service: str, value: float) -> CounterMetricFamily:
    fam = CounterMetricFamily(name, doc, labels=["service"])
    fam.add_metric([service], value)
    return fam


def _gauge(name: str, doc: str, service: str, value: float) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=["service"])
    fam.add_metric([service], value)
    return fam


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
