"""The gateway's client-facing server: one thread, one Poller over the listener, every
client connection and every worker connection.

Dynamic batching: forward requests queue up as they land (their message kept, so the
tokens stay where the transport put them). It is work-conserving: when no round is out,
whatever arrived in the same wake-up goes at once (idle workers gain nothing from a wait);
while rounds are out, a round goes when the queue holds ``max_batch_tokens``, when its
oldest request has waited ``max_wait_ms`` (0: at once), or when ``max_batch_requests``
are queued, and at most ``max_inflight_rounds`` rounds are out at a time (the next one
fills while workers compute). The pool gathers each request's rows straight from the client's landed
buffer into the worker send slots, so there is no batching copy; each request's output is
combined straight into a slot of that client's connection, which becomes the reply.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

import transport
from gateway.pool import BatchStats, NoHealthyWorker, Round, WorkerPool, WorkerState
from gateway.update import DEFAULT_STEPS, UpdateError
from transport import ConnectionClosed, ProtocolError, Timeout, TransportError
from transport.poller import Poller
from workers import protocol as P
from workers.daemon import WakePipe

log = logging.getLogger("moe.gateway")

MIN_SLOT_SIZE = 64 << 10
POLL_TICK = 0.5


@dataclass
class _Pending:
    conn: Any
    msg: Any
    request_id: int
    x: np.ndarray
    arrived: float

    @property
    def tokens(self) -> int:
        return int(self.x.shape[0])


@dataclass
class GatewayStats:
    """Counters and summed stage timings (means = sum / rounds); easy to export."""

    requests: int = 0
    replies: int = 0
    tokens: int = 0
    rounds: int = 0
    failed_rounds: int = 0
    max_round_requests: int = 0
    dropped: int = 0  # token-expert assignments dropped by the capacity factor
    overflow: int = 0  # assignments over capacity (dropped or spilled)
    clients_accepted: int = 0
    clients_open: int = 0
    errors: dict = field(default_factory=dict)
    stage_seconds: dict = field(default_factory=lambda: {k: 0.0 for k in (
        "queue", "route", "dispatch", "compute", "wait", "combine", "total")})

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def add_round(self, st: BatchStats, queue_s: float) -> None:
        self.rounds += 1
        self.max_round_requests = max(self.max_round_requests, st.requests)
        self.dropped += st.dropped
        self.overflow += st.overflow
        s = self.stage_seconds
        s["queue"] += queue_s
        s["route"] += st.route_s
        s["dispatch"] += st.dispatch_s
        s["compute"] += st.compute_s
        s["wait"] += st.wait_s
        s["combine"] += st.combine_s
        s["total"] += st.total_s

    def as_dict(self) -> dict:
        return {"requests": self.requests, "replies": self.replies, "tokens": self.tokens,
                "rounds": self.rounds, "failed_rounds": self.failed_rounds,
                "max_round_requests": self.max_round_requests, "dropped": self.dropped,
                "overflow": self.overflow,
                "clients_accepted": self.clients_accepted, "clients_open": self.clients_open,
                "errors": dict(self.errors), "stage_seconds": dict(self.stage_seconds)}


class GatewayServer:
    """Serve the MoE layer of ``pool`` to clients connecting to ``listen_url``."""

    def __init__(self, pool: WorkerPool, listen_url: str, *, max_batch_tokens: Optional[int] = None,
                 max_wait_ms: float = 1.0, max_inflight_rounds: int = 2, max_batch_requests: int = 256,
                 nslots: int = 8, io_timeout: float = 10.0, reply_timeout: float = 2.0,
                 drain_timeout: float = 10.0) -> None:
        self.pool = pool
        self.max_batch_tokens = int(max_batch_tokens or pool.max_batch_tokens)
        if not 1 <= self.max_batch_tokens <= pool.max_batch_tokens:
            raise ValueError(f"max_batch_tokens must be in [1, {pool.max_batch_tokens}] (the pool's)")
        self.max_wait = max(0.0, max_wait_ms) / 1000.0
        self.max_inflight_rounds = max(1, int(max_inflight_rounds))
        self.max_batch_requests = max(1, int(max_batch_requests))
        self.io_timeout, self.reply_timeout, self.drain_timeout = io_timeout, reply_timeout, drain_timeout
        slot_size = max(MIN_SLOT_SIZE, self.max_batch_tokens * pool.row_bytes)
        self.listener = transport.listen(listen_url, slot_size=slot_size, nslots=nslots, timeout=io_timeout)
        self.url = self.listener.url
        self.stats = GatewayStats()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._queued_tokens = 0
        self._clients: list = []
        self._rounds: dict[int, Round] = {}
        self._poller = Poller()
        self._wake = WakePipe()
        self._stop = False
        self.on_round = None  # callable(BatchStats, queue_s) after each round (metrics)

    # -- lifecycle -------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop accepting, answer what is queued and in flight, then return from serve()."""
        self._stop = True
        self._wake.wake()

    def serve(self) -> int:
        poller = self._poller
        poller.register(self._wake, ("wake", None))
        poller.register(self.listener, ("listener", None))
        self.pool.watch(poller, lambda w: ("worker", w))
        draining_since: Optional[float] = None
        try:
            while True:
                if self._stop and draining_since is None:
                    draining_since = time.monotonic()
                    poller.unregister(self.listener)
                    self.listener.close()
                if draining_since is not None:
                    if not self._queue and not self._rounds:
                        return 0
                    if time.monotonic() - draining_since > self.drain_timeout:
                        log.warning("drain timed out with %d queued, %d rounds in flight",
                                    len(self._queue), len(self._rounds))
                        return 0
                for obj, (role, data) in poller.poll(self._poll_timeout()):
                    if role == "wake":
                        self._wake.drain()
                    elif role == "listener":
                        self._accept()
                    elif role == "client":
                        self._serve_client(obj)
                    else:
                        self._worker_ready(data)
                now = time.monotonic()
                for rnd in self.pool.expire(now):
                    self._finish(rnd)
                self.pool.tick(now)
                self._dispatch_ready(now, flush=draining_since is not None)
        finally:
            self._close()

    def _close(self) -> None:
        for p in self._queue:
            p.msg.release()
        self._queue.clear()
        for conn in list(self._clients):
            self._drop_client(conn, None)
        if not self._stop:
            self.listener.close()
        self.pool.unwatch(self._poller)
        self._poller.close()
        self._wake.close()

    def _poll_timeout(self) -> float:
        now = time.monotonic()
        t = POLL_TICK
        if self._queue and len(self._rounds) < self.max_inflight_rounds:
            t = min(t, max(0.0, self._queue[0].arrived + self.max_wait - now))
        d = self.pool.next_deadline()
        if d is not None:
            t = min(t, max(0.0, d - now))
        return t

    # -- clients ---------------------------------------------------------------
    def _accept(self) -> None:
        try:
            conn = self.listener.accept(timeout=1.0)
        except Timeout:
            return
        except TransportError as e:
            log.warning("rejected a client: %s", e)
            return
        self._clients.append(conn)
        self._poller.register(conn, ("client", None))
        self.stats.clients_accepted += 1
        self.stats.clients_open = len(self._clients)

    def _drop_client(self, conn, why: Optional[str]) -> None:
        if why:
            log.info("client %s: %s", conn.url, why)
        self._poller.unregister(conn)
        keep = collections.deque()
        for p in self._queue:  # its queued requests go: nobody is left to answer
            if p.conn is conn:
                p.msg.release()
                self._queued_tokens -= p.tokens
            else:
                keep.append(p)
        self._queue = keep
        conn.close()
        if conn in self._clients:
            self._clients.remove(conn)
        self.stats.clients_open = len(self._clients)

    def _serve_client(self, conn) -> None:
        for _ in range(64):
            try:
                msg = conn.recv(timeout=0)
            except Timeout:
                return
            except (ConnectionClosed, ProtocolError) as e:
                self._drop_client(conn, str(e))
                return
            try:
                self._handle(conn, msg)
            except TransportError as e:
                self._drop_client(conn, f"reply failed: {e}")
                return

    def _handle(self, conn, msg) -> None:
        rid = P.request_id_of(msg.header)
        try:
            op = P.parse_op(msg.header, (P.FORWARD, P.PING, P.UPDATE))
            if op == P.PING:
                msg.release()
                conn.send(self.pong(rid), timeout=self.io_timeout)
                return
            if op == P.UPDATE:
                header = msg.header
                msg.release()
                conn.send({"op": P.UPDATE, "id": rid, "status": self.update(header)}, timeout=self.io_timeout)
                return
            self.stats.requests += 1
            pool = self.pool
            batch = P.parse_forward(msg.header, [b.nbytes for b in msg.buffers], dtype=pool.dtype,
                                    d_model=pool.d_model, max_rows=self.max_batch_tokens)
            if batch.nbytes > conn.max_message:
                raise P.RequestError(P.OVERSIZED, f"the reply ({batch.nbytes} bytes) exceeds this connection's "
                                                  f"slot size ({conn.max_message}); connect with a larger slot_size")
        except P.RequestError as e:
            msg.release()
            self.stats.error(e.code)
            conn.send(P.error_reply(rid, e.code, e.message), timeout=self.io_timeout)
            return
        if batch.rows == 0:
            msg.release()
            self._reply_result(conn, rid, np.empty((0, pool.d_model), pool.dtype), None)
            return
        x = msg.array(0, pool.dtype, (batch.rows, pool.d_model))
        self._queue.append(_Pending(conn, msg, rid, x, time.monotonic()))
        self._queued_tokens += batch.rows
        self.stats.tokens += batch.rows

    def update(self, h: dict) -> dict:
        """A hot-update command from a client (``moe-gateway update ...``): start, advance,
        finish, rollback or status; see gateway/update.py. Bad ones are RequestErrors."""
        action = h.get("action")
        try:
            if action == "start":
                experts = h.get("experts")
                version = h.get("version")
                if not (isinstance(experts, list) and experts and all(type(e) is int for e in experts)):
                    raise UpdateError(f"start needs experts: a list of expert ids, got {experts!r}")
                if type(version) is not int or version < 0:
                    raise UpdateError(f"start needs an integer version >= 0, got {version!r}")
                interval = h.get("auto_interval")
                return self.pool.update_start(experts, version, weights=h.get("weights"), seed=h.get("seed"),
                                              steps=h.get("steps") or DEFAULT_STEPS,
                                              auto_interval=None if interval is None else float(interval))
            fraction = h.get("fraction")
            return self.pool.update_command(str(action), None if fraction is None else float(fraction))
        except (UpdateError, TypeError, ValueError) as e:
            raise P.RequestError(P.BAD_REQUEST, f"update {action}: {e}") from None

    def pong(self, rid: Optional[int]) -> dict:
        return {"op": P.PONG, "id": rid, "gateway": self.stats.as_dict(), "workers": self.pool.stats(),
                "queued": len(self._queue), "rounds_in_flight": len(self._rounds),
                "cpu_s": time.process_time(), "pid": os.getpid(),
                "update": self.pool.update.status() if self.pool.update is not None else None,
                "config": {"max_batch_tokens": self.max_batch_tokens, "max_wait_ms": self.max_wait * 1000,
                           "max_inflight_rounds": self.max_inflight_rounds,
                           "n_experts": self.pool.n_experts, "top_k": self.pool.router.top_k,
                           "d_model": self.pool.d_model, "dtype": self.pool.dtype.name,
                           "router": self.pool.router.describe()}}

    # -- rounds ----------------------------------------------------------------
    def _dispatch_ready(self, now: float, flush: bool = False) -> None:
        while self._queue and len(self._rounds) < self.max_inflight_rounds:
            # work-conserving: with no round out the workers are idle, and waiting for company
            # would only add latency; while rounds are out, requests gather for the next one
            due = (flush or self.max_wait == 0 or not self._rounds or self._queued_tokens >= self.max_batch_tokens
                   or len(self._queue) >= self.max_batch_requests
                   or now >= self._queue[0].arrived + self.max_wait)
            if not due:
                return
            batch, tokens = [], 0
            while (self._queue and len(batch) < self.max_batch_requests
                   and tokens + self._queue[0].tokens <= self.max_batch_tokens):
                p = self._queue.popleft()
                batch.append(p)
                tokens += p.tokens
            self._queued_tokens -= tokens
            rnd = self.pool.dispatch([p.x for p in batch], tag=(batch, now))
            for p in batch:  # gathered into the worker slots: the client gets its slot back now
                p.msg.release()
                p.x = None
            if rnd.finished:
                self._finish(rnd)
            else:
                self._rounds[rnd.id] = rnd
            for other in self.pool.take_finished():  # failed by a worker lost while sending
                self._finish(other)

    def _worker_ready(self, w: WorkerState) -> None:
        for rnd in self.pool.on_ready(w):
            self._finish(rnd)

    def _finish(self, rnd: Round) -> None:
        self._rounds.pop(rnd.id, None)
        batch, dispatched_at = rnd.tag
        queue_s = max(dispatched_at - p.arrived for p in batch) if batch else 0.0
        if rnd.error is not None:
            self.stats.failed_rounds += 1
        try:
            for i, p in enumerate(batch):
                if p.conn.closed:
                    continue
                err = rnd.request_error(i)
                try:
                    if err is None:
                        self._reply_result(p.conn, p.request_id, None, (rnd, i))
                    else:
                        code = P.UNAVAILABLE if isinstance(err, NoHealthyWorker) else \
                            P.BAD_REQUEST if isinstance(err, ValueError) else P.WORKER_FAILED
                        self.stats.error(code)
                        p.conn.send(P.error_reply(p.request_id, code, str(err)), timeout=self.io_timeout)
                except TransportError as e:
                    self._drop_client(p.conn, f"reply failed: {e}")
        finally:
            rnd.release()
        self.stats.add_round(rnd.stats, queue_s)
        if self.on_round is not None:
            self.on_round(rnd.stats, queue_s)

    def _reply_result(self, conn, rid: int, y: Optional[np.ndarray], source) -> None:
        pool = self.pool
        if source is None:
            rows, timing = y.shape[0], None
        else:
            rnd, i = source
            rows, timing = rnd.routing(i).num_tokens, rnd.stats
        shape = (rows, pool.d_model)
        slot = conn.alloc(rows * pool.row_bytes, timeout=self.reply_timeout)
        out = slot.array(pool.dtype, shape)
        if source is not None:
            try:
                rnd.combine(i, out)  # straight into the reply slot
            except BaseException:
                slot.release()
                raise
        fields = {}
        if timing is not None:
            fields = {"round": rnd.id, "round_requests": timing.requests, "timing": {
                "route_s": timing.route_s, "dispatch_s": timing.dispatch_s, "compute_s": timing.compute_s,
                "wait_s": timing.wait_s, "combine_s": timing.combine_s}}
            versions = rnd.versions(i)
            if versions:
                fields["versions"] = versions
        conn.send(P.result_reply(rid, shape, pool.dtype, **fields), [slot], timeout=self.io_timeout)
        self.stats.replies += 1


def install_signal_handlers(server: GatewayServer) -> None:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    signal.signal(signal.SIGINT, lambda *_: server.request_stop())

