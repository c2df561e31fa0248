"""Prometheus plumbing the services share (prometheus_client, one registry per process):
scrape-time collectors over plain counters, per-connection transport counters, the build
info, and the HTTP endpoint (/metrics, /healthz, /readyz: transport/service/health.py).

The counters live where they always did (plain numbers in the services' stats objects); a
collector reads them when ``/metrics`` is scraped, so the serve loops pay nothing for it.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from typing import Callable, Iterable, Iterator, Optional

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .connbook import COUNTED, ConnectionBook
from .health import Health, HealthServer
from .options import host, port, version

METRICS = "METRICS"  # the stderr line: "METRICS http://host:port/metrics"
# Both services' conventional metrics port: 9632 is marked FREE in the exporters' range of
# Prometheus' default port allocations (9100 is node_exporter's, 9090-9094 Prometheus' own).
DEFAULT_PORT = 9632
TRANSPORT_FIELDS = (  # ConnectionStats field -> metric (all counters), in connbook.COUNTED order
    ("bytes_sent", "moe_transport_bytes_sent", "Bytes sent on the connection"),
    ("bytes_received", "moe_transport_bytes_received", "Bytes received on the connection"),
    ("messages_sent", "moe_transport_messages_sent", "Messages sent on the connection"),
    ("messages_received", "moe_transport_messages_received", "Messages received on the connection"),
    ("copies", "moe_transport_copies", "User-space copies (unregistered buffers handed to send)"),
    ("credit_stalls", "moe_transport_credit_stalls", "Sends that waited for the peer to return credits"),
)
assert tuple(f for f, _, _ in TRANSPORT_FIELDS) == COUNTED


class FnCollector(Collector):
    def __init__(self, fn: Callable[[], Iterable]):
        self._fn = fn

    def collect(self) -> Iterator:
        yield from self._fn()


def transport_families(books: Iterable[ConnectionBook]) -> list:
    """One sample per connection slot per counter, labelled ``role``, ``conn`` (a stable
    name: connbook.py) and ``backend``; nothing per peer address or object id, so the
    series are bounded and survive reconnects."""
    labels = ["role", "conn", "backend"]
    fams = [CounterMetricFamily(name, doc, labels=labels) for _, name, doc in TRANSPORT_FIELDS]
    for book in books:
        for name, backend, counts in book.samples():
            lv = [book.role, name, backend]
            for fam, v in zip(fams, counts):
                fam.add_metric(lv, v)
    return fams


_COMMIT: Optional[str] = None


def build_commit() -> str:
    """The commit the running code was built from: $MOE_BUILD_COMMIT (the Dockerfile's
    build argument), else the checkout's HEAD when it runs from one, else "unknown"."""
    global _COMMIT
    if _COMMIT is None:
        commit = os.environ.get("MOE_BUILD_COMMIT", "").strip()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if not commit and os.path.exists(os.path.join(root, ".git")):
            try:
                p = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                                   timeout=5)
                commit = p.stdout.strip() if p.returncode == 0 else ""
            except (OSError, subprocess.SubprocessError):
                commit = ""
        _COMMIT = commit or "unknown"
    return _COMMIT


def build_info(service: str) -> GaugeMetricFamily:
    """``moe_build_info{service, version, commit, python} 1``: join it on ``instance`` to
    see which build each target runs."""
    fam = GaugeMetricFamily("moe_build_info", "Build of the running service (always 1)",
                            labels=["service", "version", "commit", "python"])
    fam.add_metric([service, version(), build_commit(), platform.python_version()], 1)
    return fam


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
        _counter("moe_serve_spin_seconds", "Seconds busy-polled for an expected message instead of sleeping",
                 service, stats.spin_s),
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

def serve(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1", *, health: Optional[Health] = None,
          stream=None) -> str:
    """Serve ``registry`` on http://addr:port/metrics, with /healthz and /readyz from
    ``health`` (port 0: any free one), from daemon threads; prints ``METRICS <url>`` on
    ``stream`` (stderr) and returns the URL."""
    server = HealthServer(addr, port, registry, health or Health())
    server.start()
    host, bound = server.address
    url = f"http://{'[' + host + ']' if ':' in str(host) else host}:{bound}/metrics"
    print(f"{METRICS} {url}", file=stream or sys.stderr, flush=True)
    return url


def add_flags(parser) -> None:
    parser.add_argument("--metrics-port", type=port, nargs="?", const=DEFAULT_PORT, default=None, metavar="PORT",
                        help=f"serve Prometheus metrics on http://ADDR:PORT/metrics, liveness on /healthz and "
                             f"readiness on /readyz (the flag alone: port {DEFAULT_PORT}; 0: a free port); prints "
                             f"'METRICS <url>' on stderr; default: off")
    parser.add_argument("--metrics-addr", default="127.0.0.1", type=host, metavar="ADDR",
                        help="address the metrics endpoint binds")


def maybe_serve(registry_fn: Callable[[], CollectorRegistry], args, health: Optional[Health] = None) -> Optional[str]:
    if getattr(args, "metrics_port", None) is None:
        return None
    return serve(registry_fn(), args.metrics_port, args.metrics_addr, health=health)
