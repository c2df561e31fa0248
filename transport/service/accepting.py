"""How a serve loop takes connections: each listener's site (its limits, back-off and the
handshakes in progress), accepting without blocking, stepping handshakes, refusing.

A mixin of :class:`transport.service.loop.ServeLoop` (its state is the loop's).
"""
from __future__ import annotations

import collections
import errno
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .. import framing
from .. import handshake as hs
from ..errors import AcceptFailed, AuthenticationError, Refused, TransportError
from .backoff import Backoff, RateLimit

log = logging.getLogger("moe.serve")

ACCEPT_BATCH = 32  # connections taken from one listener per wake-up
ACCEPT_BACKOFF = (0.05, 1.0)  # first and longest pause of a listener out of file descriptors
LOG_INTERVAL = 10.0  # rate of repeated warnings (accept failures, refused handshakes)
REFUSAL_LOG_BURST = 5  # refused handshakes logged one by one per LOG_INTERVAL; the rest are counted
_OUT_OF_FDS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


@dataclass
class Served:
    """A served connection's book-keeping."""

    conn: Any
    site: "Site"
    last: float  # time of the last message (idle timeout)
    outbox: collections.deque = field(default_factory=collections.deque)  # (header, buffers, since)


@dataclass
class Site:
    """A listener and what is attached to it."""

    listener: Any
    on_message: Callable[[Any, Any], None]
    on_open: Optional[Callable[[Any], None]]
    on_close: Optional[Callable[[Any, Optional[str]], None]]
    max_connections: int
    idle_timeout: Optional[float]
    name: str
    handshake_timeout: float = hs.HELLO_TIMEOUT
    pending: set = field(default_factory=set)
    served: set = field(default_factory=set)
    paused_until: float = 0.0  # accept back-off (out of file descriptors)
    backoff: Backoff = field(default_factory=lambda: Backoff(*ACCEPT_BACKOFF))
    refusals: RateLimit = field(default_factory=lambda: RateLimit(REFUSAL_LOG_BURST, LOG_INTERVAL))
    watching: bool = True
    failures: int = 0  # accept failures since the last log line
    logged_at: float = 0.0


class Accepting:
    def _accept(self, site: Site) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                p = site.listener.accept_pending()
            except AcceptFailed as e:
                self._accept_failed(site, e)
                return
            if p is None:
                return
            site.backoff.reset()
            if len(site.pending) + len(site.served) >= site.max_connections:
                self.stats.refused_cap += 1
                _refuse(p, f"the server is at its connection limit ({site.max_connections})")
                continue
            p.deadline = min(p.deadline, time.monotonic() + site.handshake_timeout)
            site.pending.add(p)
            self.stats.pending += 1
            self._poller.register(p, ("pending", site))
            self._step(site, p)  # the server speaks first: its HELLO goes out now

    def _accept_failed(self, site: Site, e: AcceptFailed) -> None:
        site.failures += 1
        now = time.monotonic()
        if e.errno in _OUT_OF_FDS:
            # the connection stays in the kernel's queue, so the listener stays readable: stop
            # looking at it for a while instead of spinning on it
            site.paused_until = now + site.backoff.next()
            if site.watching:
                self._poller.unregister(site.listener)
                site.watching = False
            self.stats.accept_backoffs += 1
        if now - site.logged_at >= LOG_INTERVAL:
            log.warning("%s: %s (%d accept failures since the last report; backing off %.2f s)",
                        site.name, e, site.failures, max(0.0, site.paused_until - now))
            site.logged_at, site.failures = now, 0

    def _step(self, site: Site, p) -> None:
        try:
            conn = p.step()
        except Refused as e:  # a secret that does not match, a limit, a version: a WARNING (rate-limited)
            if isinstance(e, AuthenticationError):
                self.stats.refused_auth += 1
            else:
                self.stats.refused_other += 1
            allowed, skipped = site.refusals.take(time.monotonic())
            if allowed:
                log.warning("%s: refused the handshake of %s: %s%s", site.name, p.peer, e,
                            f" ({skipped} more refused since the last report)" if skipped else "")
            return self._pending_failed(site, p, e, logged=True)
        except TransportError as e:  # garbage (ProtocolError) or a broken peer
            self.stats.bad_handshakes += 1
            return self._pending_failed(site, p, e)
        if conn is None:
            if p.events == hs.WRITE:
                self._poller.modify(p, write=True)
            elif p.events == hs.READ:
                self._poller.modify(p, write=False)
            return
        self._poller.unregister(p)
        site.pending.discard(p)
        self.stats.pending -= 1
        self.stats.accepted += 1
        served = Served(conn, site, time.monotonic())
        self._served[conn] = served
        site.served.add(conn)
        self.stats.open = len(self._served)
        self._poller.register(conn, ("served", served), lazy=True)  # pending() asked only when used
        if site.on_open is not None:
            site.on_open(conn)
        if conn.pending():  # messages that came with the handshake: the fd may stay quiet
            self._serve(conn, served)

    def _pending_failed(self, site: Site, p, e: Exception, logged: bool = False) -> None:
        if not logged:
            log.info("%s: handshake with %s failed: %s", site.name, p.peer, e)
        self._poller.unregister(p)
        site.pending.discard(p)
        self.stats.pending -= 1

    def _drop_pending(self, site: Site, p) -> None:
        self._poller.unregister(p)
        site.pending.discard(p)
        self.stats.pending -= 1
        p.close()


def _refuse(p, reason: str) -> None:
    """Tell a client we will not serve it (a REFUSED frame it reads as Refused), close."""
    try:
        p.sock.send(b"".join(framing.encode_hello({"refused": reason, "code": "capacity"})),
                    socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
    except OSError:
        pass
    p.close()
