"""The gateway's worker connections and their health; no rounds, no routing.

Each worker has a :class:`WorkerLink`: its URL, connection, what it hosts (from its
``info``), counters, and a health state::

    healthy ──no answer to a ping / a round in time──▶ unhealthy ──it answers──▶ healthy
       │  ▲                                                │
       │  └────────────── reconnected, same shape ◀── lost ◀┘ connection gone
       └──draining notice──▶ draining (no new work; lost when it goes)
    lost ──came back with another shape or checkpoint──▶ refused (retried slowly, reported)
    connected ──▶ admitting ──holds the served weights──▶ healthy
                      └──cannot load them──▶ refused

Every connection starts *admitting*: gateway/admission.py brings the worker to the weights
the gateway serves (loads, retires) and only then makes it healthy; what the worker holds
comes from its ``weights`` pages at connect and from each acknowledged load and retire.

Only ``healthy`` workers get new work. A lost worker is reconnected in the background with a
growing back-off (never blocking the serve loop: the connect, handshake and ``info`` run in a
thread and the result is posted back to the loop), and taken back when it answers again at
its URL with the same shape; a supervisor (local workers, Ray) may move a worker to a new URL
with :meth:`WorkerSet.set_url`. A heartbeat ping to every worker finds the hung ones (stopped,
deadlocked) that still hold their connection open.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence

import transport
from gateway.worker_link import (RECONNECT_BACKOFF, Health, LayerShape, WorkerLink,  # noqa: F401
                                 check_layers, worker_layers)
from transport import ConnectionClosed, Timeout, TransportError
from transport.service.backoff import Backoff
from workers import protocol as P

log = logging.getLogger("moe.workers")

HEARTBEAT_INTERVAL = 0.5  # a worker not heard from for this long is pinged
HEARTBEAT_TIMEOUT = 2.0  # a ping unanswered this long makes the worker unhealthy
REFUSED_BACKOFF = 5.0  # a worker that came back wrong is retried this slowly
CONNECT_ATTEMPT = 2.0  # one reconnection attempt (connect, handshake, info) at most
MIN_SLOT_SIZE = 64 << 10
WORKER_SLOT_LIMIT = 256 << 20  # the largest worker receive slot the gateway accepts to send into


def _hello(conn, shape: LayerShape, url: str, timeout: float) -> dict:
    """Ask a freshly connected worker for its info and check it serves ``shape``."""
    conn.send(P.request(P.INFO, 0), timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        msg = conn.recv(timeout=max(0.0, deadline - time.monotonic()))
        h = msg.header
        msg.release()
        if isinstance(h, dict) and h.get("op") in (P.INFO, P.ERROR) and h.get("id") == 0:
            break
    P.raise_if_error(h, url)
    if h.get("d_model") != shape.d_model or h.get("dtype") != P.dtype_name(shape.dtype):
        raise ValueError(f"worker {url} serves d_model={h.get('d_model')} {h.get('dtype')}, "
                         f"the gateway needs d_model={shape.d_model} {P.dtype_name(shape.dtype)}")
    layers = check_layers(h, shape, url)
    h["_weights"] = _fetch_weights(conn, url, deadline, limit=P.MAX_VERSIONS * sum(len(ids) for ids, _ in
                                                                                  layers.values()))
    max_tokens = int(h.get("max_tokens", 0))
    if max_tokens < shape.max_rows or conn.max_message < shape.max_rows * shape.row_bytes:
        raise ValueError(
            f"worker {url} takes batches of at most {max_tokens} rows ({conn.max_message} bytes) but "
            f"this gateway may send {shape.max_rows} rows; start it with --max-tokens >= {shape.max_rows} "
            f"or lower the gateway's --max-batch-tokens")
    return h


def _fetch_weights(conn, url: str, deadline: float, limit: int) -> dict:
    """Every version the worker holds: {(layer, expert): {version: (fingerprint, source)}},
    a page at a time; at most ``limit`` entries (its hosted experts x MAX_VERSIONS)."""
    out: dict = {}
    start: Optional[int] = 0
    n = 0
    while start is not None:
        conn.send(P.request(P.WEIGHTS, -3, start=start), timeout=max(0.0, deadline - time.monotonic()))
        while True:
            msg = conn.recv(timeout=max(0.0, deadline - time.monotonic()))
            h = msg.header
            msg.release()
            if isinstance(h, dict) and h.get("id") == -3 and h.get("op") in (P.WEIGHTS, P.ERROR):
                break
        if h.get("op") == P.ERROR:
            raise ValueError(f"worker {url} does not report its weights ({h.get('message')}): it is older than "
                             f"this gateway; upgrade it")
        entries, nxt = P.parse_weights_page(h, limit - n)
        n += len(entries)
        for L, e, v, fp, src in entries:
            out.setdefault((L, e), {})[v] = (fp, src)
        if nxt is not None and nxt != n:
            raise ValueError(f"worker {url} sent a weights page out of order")
        start = nxt
    return out


class WorkerSet:
    """Every worker's link: connect, watch health, reconnect.

    ``post(fn)`` runs ``fn`` on the owner's loop thread (ServeLoop.call_soon_threadsafe);
    ``on_up(w)`` / ``on_down(w, why)`` tell the owner when a worker's connection appears or
    goes (to watch it in a poller; to fail or retry what was in flight on it);
    ``on_write_pending(w)`` when a send left bytes of a frame for later (to wake when the
    kernel has room for them, and call :meth:`flush`).
    """

    def __init__(self, urls: Sequence[str], shape: LayerShape, *, nslots: int = 8, timeout: float = 10.0,
                 secret: Optional[bytes] = None, post: Optional[Callable[[Callable[[], None]], None]] = None,
                 heartbeat: float = HEARTBEAT_INTERVAL, heartbeat_timeout: float = HEARTBEAT_TIMEOUT) -> None:
        if not urls:
            raise ValueError("a gateway needs at least one worker URL")
        self.shape = shape
        self.nslots = nslots
        self.timeout = timeout
        self.secret = secret
        self.slot_size = max(MIN_SLOT_SIZE, shape.max_rows * shape.row_bytes)
        self.heartbeat, self.heartbeat_timeout = heartbeat, heartbeat_timeout
        self.links = [WorkerLink(i, u) for i, u in enumerate(urls)]
        self.post = post
        self.on_up: list[Callable[[WorkerLink], None]] = []
        self.on_down: list[Callable[[WorkerLink, str], None]] = []
        self.on_write_pending: list[Callable[[WorkerLink], None]] = []
        self.on_message: Callable[[WorkerLink, Any], None] = lambda w, msg: msg.release()
        self._closed = False

    def __iter__(self):
        return iter(self.links)

    def __len__(self) -> int:
        return len(self.links)

    def __getitem__(self, i: int) -> WorkerLink:
        return self.links[i]

    # -- connecting ------------------------------------------------------------------------
    def _connect(self, url: str, timeout: float):
        # a worker's receive slots (our send slots) may be larger than what we send: it was
        # started for bigger batches. We chose this worker (and it proved the secret), so its
        # slot size is not a stranger's say-so; the bound only stops absurd values
        conn = transport.connect(url, slot_size=self.slot_size, nslots=self.nslots, timeout=timeout,
                                 secret=self.secret, max_peer_slot_size=max(self.slot_size, WORKER_SLOT_LIMIT))
        try:
            info = _hello(conn, self.shape, url, timeout)
        except BaseException:
            conn.close()
            raise
        return conn, info

    def connect_all(self, connect_timeout: float) -> None:
        """The first connection to every worker, retried until ``connect_timeout`` (workers
        may still be starting); raises with every worker's reason if one never answers."""
        deadline = time.monotonic() + connect_timeout
        for w in self.links:
            wait = Backoff(*RECONNECT_BACKOFF)
            while True:
                try:
                    conn, info = self._connect(w.url, max(0.5, min(self.timeout, deadline - time.monotonic())))
                    break
                except transport.Refused as e:  # it answered, and the answer is no: final
                    e.peer = w.url
                    raise
                except (ConnectionClosed, Timeout) as e:  # not up yet: retry
                    delay = wait.next()
                    if time.monotonic() + delay >= deadline:
                        raise ConnectionClosed(f"worker {w.url} did not answer within {connect_timeout:.0f} s: "
                                               f"{e}") from None
                    time.sleep(delay)
            self._attach(w, conn, info, first=True)
        for L, n in self.shape.n_ids.items():
            missing = [e for e in range(n) if not any(w.hosts(e, L) for w in self.links)]
            if missing:
                where = f" of layer {L}" if L != P.DEFAULT_LAYER or len(self.shape.n_ids) > 1 else ""
                raise ValueError(f"experts {missing}{where} are hosted by no worker of "
                                 f"{[w.url for w in self.links]}")

    def _attach(self, w: WorkerLink, conn, info: dict, first: bool = False) -> None:
        # what it hosts may differ from before (restarted with its start-up experts after
        # copies moved): admission brings it to the placement
        layers = {L: frozenset(ids) for L, (ids, _) in worker_layers(info).items()}
        w.conn = conn
        w.layers = layers
        w.experts = sorted({e for ids in layers.values() for e in ids})
        self.set_versions(w, info.get("versions", []))
        w.weights = info.get("_weights", {})
        w.max_tokens = int(info.get("max_tokens", 0))
        w.d_ff = info.get("d_ff")
        w.kernel = dict(info.get("kernel") or {})
        w.pid = info.get("pid")
        hosted = sum(len(ids) for ids in layers.values())
        w.max_experts = max(hosted, int(info.get("max_experts") or hosted))
        w.state, w.why = Health.ADMITTING, "being brought to the served weights"
        w.admitted_at = None
        w.backoff.reset()
        w.last_heard = time.monotonic()
        w.ping_sent = None
        n_ids = self.shape.n_ids
        for L, ids in layers.items():
            bad = sorted(e for e in ids if not 0 <= e < n_ids.get(L, 0))
            if bad:
                log.warning("worker %s hosts experts %s of layer %d beyond its %d", w.url, bad, L, n_ids.get(L, 0))
        if not first:
            w.reconnects += 1
            log.warning("worker %s is back (pid %s)", w.url, w.pid)
        for fn in self.on_up:
            fn(w)

    def _refuse(self, w: WorkerLink, why: str) -> None:
        again = w.state == Health.REFUSED and w.why == why
        w.state, w.why = Health.REFUSED, why
        w.next_attempt = time.monotonic() + REFUSED_BACKOFF
        w.refusals += 1
        (log.info if again else log.error)("worker %s refused: %s", w.url, why)

    def admit(self, w: WorkerLink) -> None:
        """``w`` holds the served weights: it takes traffic from now on."""
        if w.state != Health.ADMITTING or w.conn is None:
            return
        w.state, w.why = Health.HEALTHY, ""
        w.admitted_at = time.monotonic()

    def refuse(self, w: WorkerLink, why: str) -> None:
        """``w`` cannot serve what the gateway serves: drop its connection, retry slowly."""
        if w.conn is not None:
            for fn in self.on_down:
                fn(w, why)
            conn, w.conn = w.conn, None
            w.control_queue = []
            try:
                conn.close()
            except TransportError:
                pass
        self._refuse(w, why)

    def add(self, url: str) -> WorkerLink:
        """A new worker at ``url``: connected in the background (then admitted, like a
        reconnection); its index is the next one."""
        w = WorkerLink(len(self.links), url)
        w.next_attempt = 0.0
        self.links.append(w)
        log.info("worker %d added at %s", w.index, url)
        return w

    def remove(self, index: int, why: str = "removed") -> None:
        """Take worker ``index`` out for good: its connection is closed, never reconnected
        (its index stays, so dispatch plans keep their columns)."""
        w = self.links[index]
        if w.conn is not None:
            self.lost(w, why)
        w.state, w.why = Health.REMOVED, why
        log.info("worker %d (%s) removed", index, w.url)

    def set_url(self, index: int, url: str) -> None:
        """A supervisor moved worker ``index`` (respawned elsewhere): reconnect there now."""
        w = self.links[index]
        if w.url == url and w.connected:
            return
        if w.connected:
            self.lost(w, f"moved to {url}")
        w.url = url
        w.next_attempt = 0.0
        w.backoff.reset()

    # -- health ----------------------------------------------------------------------------
    @staticmethod
    def set_versions(w: WorkerLink, versions: list) -> None:
        """From info/pong: [[expert, active, [held, ...](, layer)], ...]."""
        w.versions = {(P.entry_layer(v, 3), int(v[0])): int(v[1]) for v in versions}
        w.held = {(P.entry_layer(v, 3), int(v[0])): set(int(x) for x in (v[2] if len(v) > 2 else [v[1]]))
                  for v in versions}

    def heard(self, w: WorkerLink) -> None:
        """A message came from ``w``: it is alive."""
        w.last_heard = time.monotonic()
        w.ping_sent = None
        if w.state == Health.UNHEALTHY:
            log.info("worker %s is healthy again", w.url)
            w.state, w.why = Health.HEALTHY, ""

    def mark_unhealthy(self, w: WorkerLink, why: str) -> None:
        if w.state == Health.HEALTHY:
            log.warning("worker %s: %s", w.url, why)
            w.state = Health.UNHEALTHY
        w.failures += 1
        w.why = why

    def on_notice(self, w: WorkerLink, h: dict) -> None:
        """An unsolicited or health message (draining, pong, info)."""
        op = h.get("op")
        if op == P.DRAINING:
            log.info("worker %s is draining: no new work goes to it", w.url)
            w.state, w.why = Health.DRAINING, "draining"
        elif op == P.PONG:
            if "versions" in h:
                self.set_versions(w, h["versions"])
            w.cpu_s = float(h.get("cpu_s", w.cpu_s))
            if h.get("draining"):
                w.state, w.why = Health.DRAINING, "draining"
        elif op != P.INFO:
            log.warning("unexpected message from worker %s: %r", w.url, h)

    def lost(self, w: WorkerLink, why: str) -> None:
        """``w``'s connection is gone (or unusable): tell the owner, close it, reconnect later."""
        if w.conn is None:
            return
        w.failures += 1
        w.state, w.why = Health.LOST, why
        w.ping_sent = None
        w.control_queue = []  # control messages for the connection that went (their owners time out)
        w.next_attempt = time.monotonic() + w.backoff.restart()
        log.warning("worker %s lost: %s", w.url, why)
        for fn in self.on_down:  # the owner unwatches it (before close: its fd may be reused at once)
            fn(w, why)
        conn, w.conn = w.conn, None
        try:
            conn.close()
        except TransportError:
            pass

    def send(self, w: WorkerLink, header: dict, buffers=(), *, ready: bool = False) -> bool:
        """Send without waiting (a worker that cannot take it now is a failure of that send).
        ``ready``: the caller saw ``send_ready()`` before taking the slot it sends (asked
        again, shm would count that slot as taken and say no)."""
        if w.conn is None:
            for b in buffers:
                if hasattr(b, "pool"):
                    b.release()
            return False
        if not ready and not w.conn.send_ready():
            if not buffers and w.outstanding_rows > 0:
                # a control message to a connection busy with our rows (a chunk still going
                # out, every slot on the way): it waits its turn, sent by tick()
                w.control_queue.append(header)
                return True
            for b in buffers:
                if hasattr(b, "pool"):
                    b.release()
            self.mark_unhealthy(w, "its connection takes no more messages (it holds every credit)")
            return False
        try:
            conn = w.conn
            conn.send(header, buffers, timeout=0)  # the rest of a big frame: see flush()
            if conn.wants_write():
                for fn in self.on_write_pending:
                    fn(w)
            return True
        except Timeout:
            self.mark_unhealthy(w, "send timed out")
        except (TransportError, ValueError) as e:
            self.lost(w, f"send failed: {e}")
        return False

    def flush(self, w: WorkerLink) -> bool:
        """Write what the kernel takes now of a frame ``w``'s connection holds; True once
        nothing is left (or the connection is gone: lost)."""
        conn = w.conn
        if conn is None or not conn.wants_write():
            return True
        try:
            return conn.flush()
        except TransportError as e:
            self.lost(w, f"send failed: {e}")
            return True

    def read(self, w: WorkerLink, batch: int = 64) -> None:
        """Take what ``w`` has ready (call when its connection polls readable)."""
        for _ in range(batch):
            conn = w.conn
            if conn is None:
                return
            try:
                msg = conn.recv(timeout=0)
            except Timeout:
                return
            except TransportError as e:  # ConnectionClosed, ProtocolError
                self.lost(w, f"connection lost: {e}")
                return
            self.heard(w)
            self.on_message(w, msg)

    def tick(self, now: float) -> Optional[float]:
        """Heartbeats and reconnections; returns when it next wants to run."""
        nxt = now + self.heartbeat
        for w in self.links:
            conn = w.conn
            if not self.flush(w):  # (the owner flushes as the kernel takes them: a fallback)
                nxt = min(nxt, now + 0.005)
            if conn is not None and w.conn is None:
                continue  # lost while flushing: reconnecting starts at its next attempt time
            if w.control_queue and w.conn is not None:
                while w.control_queue and w.conn is not None and (w.conn.send_ready() or w.outstanding_rows <= 0):
                    self.send(w, w.control_queue.pop(0))  # (not ready with nothing of ours out: it reports it)
                if w.control_queue:
                    nxt = min(nxt, now + 0.005)
            if w.conn is not None:
                if w.ping_sent is not None and now - w.ping_sent > self.heartbeat_timeout:
                    self.mark_unhealthy(w, f"no answer to a ping for {now - w.ping_sent:.1f} s")
                    w.ping_sent = now  # ping again, and report again, a timeout later
                    if self._may_ping(w):
                        self.send(w, P.request(P.PING, -1))
                elif w.ping_sent is None and now - w.last_heard >= self.heartbeat:
                    if self._may_ping(w):
                        w.ping_sent = now
                        self.send(w, P.request(P.PING, -1))
                    else:
                        nxt = min(nxt, now + 0.05)
            elif w.state == Health.REMOVED:
                continue
            elif not w.connecting and now >= w.next_attempt and not self._closed:
                self._reconnect(w)
            elif not w.connecting:
                nxt = min(nxt, w.next_attempt)
        return nxt

    @staticmethod
    def _may_ping(w: WorkerLink) -> bool:
        """A connection that cannot take a message while messages of ours are unanswered
        there is busy with them (a chunk still going out, every slot on the way), not
        failing: the ping waits (their replies are news enough; a round's deadline still
        catches a worker that never answers). With nothing of ours out, a connection that
        is not ready is a worker holding every credit: the ping's send reports it."""
        return w.outstanding_rows <= 0 or w.conn.send_ready()

    def _reconnect(self, w: WorkerLink) -> None:
        """One attempt in a thread; the outcome is posted to the loop."""
        w.connecting = True
        url = w.url

        def attempt() -> None:
            try:
                conn, info = self._connect(url, CONNECT_ATTEMPT)
                result: Any = (conn, info)
            except Exception as e:  # reported on the loop
                result = e
            post = self.post
            if post is None:
                if not isinstance(result, Exception):
                    result[0].close()
                return
            post(lambda: self._reconnected(w, url, result))

        threading.Thread(target=attempt, daemon=True, name=f"reconnect-{w.index}").start()

    def _reconnected(self, w: WorkerLink, url: str, result: Any) -> None:
        w.connecting = False
        if self._closed or url != w.url or w.state == Health.REMOVED:  # stale: closed, moved or removed
            if not isinstance(result, Exception):
                result[0].close()
            return
        if isinstance(result, Exception):
            if isinstance(result, (ValueError, P.RemoteError, transport.Refused)):
                self._refuse(w, str(result))  # it answered, and the answer is no: retry slowly
                return
            w.why = f"reconnecting: {result}"
            w.next_attempt = time.monotonic() + w.backoff.next()
            return
        self._attach(w, *result)

    def close(self) -> None:
        self._closed = True
        for w in self.links:
            if w.conn is not None:
                for fn in self.on_down:
                    fn(w, "the gateway is closing")
                conn, w.conn = w.conn, None
                conn.close()
