"""The services' HTTP endpoint: ``/metrics`` (Prometheus text, or OpenMetrics when asked),
``/healthz`` (liveness) and ``/readyz`` (readiness), from a small ThreadingHTTPServer.

Liveness means the serve loop is turning: a :class:`Heartbeat` registered as one of its
ticks stamps the time on every loop iteration (the loop runs its ticks at least every
POLL_TICK, 0.5 s, even when idle), and a stamp older than ``stale_after`` seconds means the
loop is stuck (a deadlock, a runaway computation): 503, so an orchestrator restarts it.
Readiness is the service's own judgement (a gateway: every expert has a healthy worker and
it is not draining; a worker: it is not draining): 503 takes it out of rotation without a
restart. Both answer JSON saying why.

Replaces prometheus_client's start_http_server, which answered every path with the
metrics page (so ``/healthz`` "worked" whatever the service's state).
"""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

STALE_AFTER = 10.0  # seconds without a loop iteration before /healthz says 503

Check = Callable[[], tuple[bool, dict]]  # -> (ok, details for the JSON body)


class Heartbeat:
    """Register :meth:`tick` with ``ServeLoop.add_tick``; :meth:`check` is the liveness."""

    def __init__(self, stale_after: float = STALE_AFTER, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after = stale_after
        self.clock = clock
        self.last = clock()
        self.beats = 0

    def tick(self, now: float) -> Optional[float]:
        self.last = now
        self.beats += 1
        return None  # no deadline of its own: the loop's POLL_TICK bounds the gap

    def check(self) -> tuple[bool, dict]:
        age = self.clock() - self.last
        return age <= self.stale_after, {"loop_age_s": round(age, 3), "stale_after_s": self.stale_after,
                                         "beats": self.beats}


class Health:
    """What /healthz and /readyz ask. Without a liveness check the process answering is
    all that is known (200); without a readiness check, ready means live."""

    def __init__(self, live: Optional[Check] = None, ready: Optional[Check] = None) -> None:
        self.live = live
        self.ready = ready

    def liveness(self) -> tuple[bool, dict]:
        return self.live() if self.live is not None else (True, {})

    def readiness(self) -> tuple[bool, dict]:
        ok, detail = self.liveness()
        if not ok:
            return False, dict(detail, reason="not live")
        if self.ready is None:
            return True, detail
        r_ok, r_detail = self.ready()
        return r_ok, dict(detail, **r_detail)


def _handler(registry: CollectorRegistry, health: Health):
    class Handler(BaseHTTPRequestHandler):
        server_version = "moe-transport"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, ctype = choose_encoder(self.headers.get("Accept", ""))
                try:
                    body = encoder(registry)
                except Exception as e:  # a collector bug: say so rather than drop the connection
                    return self._send(500, "text/plain; charset=utf-8", f"collect failed: {e}\n".encode())
                return self._send(200, ctype, body)
            if path in ("/healthz", "/livez"):
                return self._json(*health.liveness())
            if path == "/readyz":
                return self._json(*health.readiness())
            if path == "/":
                return self._send(200, "text/plain; charset=utf-8", b"/metrics /healthz /readyz\n")
            self._send(404, "text/plain; charset=utf-8", b"not found: /metrics /healthz /readyz\n")

        def do_HEAD(self) -> None:  # noqa: N802
            self._head_only = True
            self.do_GET()

        def _json(self, ok: bool, detail: dict) -> None:
            body = json.dumps(dict(detail, status="ok" if ok else "unavailable"), sort_keys=True).encode() + b"\n"
            self._send(200 if ok else 503, "application/json", body)

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if not getattr(self, "_head_only", False):
                self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # scrapes every few seconds: no access log on stderr
            pass

    return Handler


class HealthServer:
    """The endpoint, serving from a daemon thread (one thread per request)."""

    def __init__(self, addr: str, port: int, registry: CollectorRegistry, health: Health) -> None:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET

        class Server(ThreadingHTTPServer):
            address_family = family
            daemon_threads = True
            allow_reuse_address = True

        self.httpd = Server((addr, port), _handler(registry, health))
        self.address = self.httpd.server_address[:2]
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "HealthServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
