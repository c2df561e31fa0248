"""The gateway's client-facing server, on one serve loop with its worker pool.

Forward requests queue up as they land (their message kept, so the tokens stay where the
transport put them, and a request can be retried on a replica); gateway/batcher.py decides
when the queue goes out as a round; the pool gathers each request's rows straight from the
client's landed buffer into the worker send slots (no batching copy) and the server combines
each finished request straight into a send slot of that client's connection, which becomes
the reply. Requests finish one by one: a request whose workers answered is answered, whatever
the other requests of its round wait for.

A client that does not read its replies gets them held by the serve loop (bounded, then it
is dropped); nobody else waits. Control operations (hot update) are accepted only on a
connection that proved the shared secret.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

import transport
from gateway.batcher import Batcher
from gateway.pool import WorkerPool
from gateway.requests import BatchStats, Request
from gateway.expert_placement import PlacementError
from gateway.update import UpdateError
from transport.service.connbook import ConnectionBook
from transport.service.loop import ServeLoop, buffer_view
from workers import protocol as P

log = logging.getLogger("moe.gateway")

MIN_SLOT_SIZE = 64 << 10


def client_slot_size(max_batch_tokens: int, row_bytes: int) -> int:
    """The slots a gateway offers its clients: a request may be a whole round's tokens."""
    return max(MIN_SLOT_SIZE, int(max_batch_tokens) * int(row_bytes))


@dataclass
class _Client:
    """What a queued or in-flight request needs to be answered."""

    conn: Any
    msg: Any
    request_id: int
    reply: Any = None  # the reply's buffer, taken when the request is dispatched (see _presize)


@dataclass
class GatewayStats:
    """Counters and summed stage timings (means = sum / rounds); easy to export."""

    requests: int = 0
    replies: int = 0
    tokens: int = 0
    rounds: int = 0
    retried: int = 0  # requests retried on a replica after a worker failed
    failed_requests: int = 0
    max_round_requests: int = 0
    dropped: int = 0  # token-expert assignments dropped by the capacity factor
    overflow: int = 0  # assignments over capacity (dropped or spilled)
    clients_accepted: int = 0
    clients_open: int = 0
    errors: dict = field(default_factory=dict)
    stage_seconds: dict = field(default_factory=lambda: {k: 0.0 for k in (
        "queue", "route", "dispatch", "compute", "wait", "combine", "total", "no_token", "own_cpu")})
    messages: int = 0  # messages to workers (more than a round's workers when parts go in chunks)

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def add_round(self, st: BatchStats) -> None:
        self.rounds += 1
        self.retried += st.retried
        self.max_round_requests = max(self.max_round_requests, st.requests)
        self.dropped += st.dropped
        self.overflow += st.overflow
        s = self.stage_seconds
        s["queue"] += st.queue_s
        s["route"] += st.route_s
        s["dispatch"] += st.dispatch_s
        s["compute"] += st.compute_s
        s["wait"] += st.wait_s
        s["combine"] += st.combine_s
        s["own_cpu"] += st.own_cpu_s
        s["total"] += st.total_s
        # the busiest worker's time in the round with no token to compute (its own clocks):
        # what pipelined rounds could hide
        s["no_token"] += max(0.0, st.total_s - st.busiest_s) if st.busiest_s else 0.0
        self.messages += st.messages

    def as_dict(self) -> dict:
        return {"requests": self.requests, "replies": self.replies, "tokens": self.tokens,
                "rounds": self.rounds, "retried": self.retried, "failed_requests": self.failed_requests,
                "max_round_requests": self.max_round_requests, "dropped": self.dropped,
                "overflow": self.overflow, "messages": self.messages,
                "clients_accepted": self.clients_accepted, "clients_open": self.clients_open,
                "errors": dict(self.errors), "stage_seconds": dict(self.stage_seconds)}


class GatewayServer:
    """Serve the MoE layer of ``pool`` to clients connecting to ``listen_url``."""

    def __init__(self, pool: WorkerPool, listen_url: str, *, max_batch_tokens: Optional[int] = None,
                 max_wait_ms: float = 1.0, max_inflight_rounds: int = 2, max_batch_requests: int = 256,
                 nslots: int = 8, io_timeout: float = 10.0, drain_timeout: float = 10.0,
                 secret: Optional[bytes] = None, max_connections: int = 1024,
                 idle_timeout: Optional[float] = 300.0, batching: str = "fifo") -> None:
        self.pool = pool
        self.loop: ServeLoop = pool.loop
        self.max_batch_tokens = int(max_batch_tokens or pool.max_batch_tokens)
        if not 1 <= self.max_batch_tokens <= pool.max_batch_tokens:
            raise ValueError(f"max_batch_tokens must be in [1, {pool.max_batch_tokens}] (the pool's)")
        self.batcher = Batcher(max_batch_tokens=self.max_batch_tokens, max_wait=max_wait_ms / 1000.0,
                               max_inflight_rounds=max_inflight_rounds, max_batch_requests=max_batch_requests,
                               policy=batching)
        self.io_timeout, self.drain_timeout = io_timeout, drain_timeout
        slot_size = client_slot_size(self.max_batch_tokens, pool.row_bytes)
        self.listener = transport.listen(listen_url, slot_size=slot_size, nslots=nslots, timeout=io_timeout,
                                         secret=secret)
        self.url = self.listener.url
        self.loop.add_listener(self.listener, self._handle, on_open=self._opened, on_close=self._closed,
                               max_connections=max_connections, idle_timeout=idle_timeout, name="clients")
        self.loop.add_tick(self._tick)
        pool.on_round = self._round_done
        self.stats = GatewayStats()
        self._stop = False
        self._draining_since: Optional[float] = None
        self.on_round = None  # callable(BatchStats, queue_s) after each round (metrics)
        self.on_request = None  # callable(seconds, ok) after each answered request (metrics)
        self.conn_book = ConnectionBook("client")  # stable connection names for the metrics

    # -- what others read --------------------------------------------------------------------
    @property
    def queued_requests(self) -> int:
        return len(self.batcher)

    @property
    def queued_tokens(self) -> int:
        return self.batcher.tokens

    @property
    def rounds_in_flight(self) -> int:
        return self.pool.in_flight

    def clients(self) -> list:
        return self.loop.connections("clients")

    @property
    def draining(self) -> bool:
        """Stopping: no new requests are accepted (readiness says no)."""
        return self._stop or self._draining_since is not None

    # -- lifecycle ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop accepting, answer what is queued and in flight, then return from serve()."""
        self._stop = True
        self.loop.wake()

    def serve(self) -> int:
        try:
            self.loop.run(until=self._drained)
        finally:
            self._close()
        return 0

    def _drained(self) -> bool:
        if self._draining_since is None:
            return False
        if not self.batcher.queue and not self.pool.in_flight:
            return True
        if time.monotonic() - self._draining_since > self.drain_timeout:
            log.warning("drain timed out with %d queued, %d rounds in flight", len(self.batcher),
                        self.pool.in_flight)
            return True
        return False

    def _close(self) -> None:
        for client in self.batcher.remove(lambda c: False):
            client.tag.msg.release()
        self.loop.stop_accepting()
        for conn in self.clients():
            self.loop.close_connection(conn, None, abort=False)

    def _opened(self, conn) -> None:
        self.stats.clients_accepted += 1
        self.stats.clients_open = len(self.clients())
        self.conn_book.opened(conn)

    def _closed(self, conn, why: Optional[str]) -> None:
        self.stats.clients_open = len(self.clients())
        self.conn_book.closed(conn)
        for req in self.batcher.remove(lambda r: r.tag.conn is not conn):  # nobody is left to answer
            req.tag.msg.release()

    # -- requests ----------------------------------------------------------------------------
    def _handle(self, conn, msg) -> None:
        rid = P.request_id_of(msg.header)
        try:
            op = P.parse_op(msg.header, (P.FORWARD, P.PING, P.UPDATE, P.PLACEMENT, P.WORKERS))
            if op == P.PING:
                msg.release()
                self.loop.send(conn, self.pong(rid))
                return
            if op in (P.UPDATE, P.PLACEMENT, P.WORKERS):
                header = msg.header
                msg.release()
                if not conn.authenticated:
                    raise P.RequestError(P.UNAUTHORIZED, f"{op} is a control operation: it needs a connection "
                                                         "that proved the shared secret (--secret-file)")
                self.loop.send(conn, {"op": op, "id": rid, "status": self.control(op, header)})
                return
            self.stats.requests += 1
            pool = self.pool
            batch = P.parse_forward(msg.header, [b.nbytes for b in msg.buffers], dtype=pool.dtype,
                                    d_model=pool.d_model, max_rows=self.max_batch_tokens, layers=pool.routers.keys())
            if batch.nbytes > conn.max_message:
                raise P.RequestError(P.OVERSIZED, f"the reply ({batch.nbytes} bytes) exceeds this connection's "
                                                  f"slot size ({conn.max_message}); connect with a larger slot_size")
        except P.RequestError as e:
            msg.release()
            self.stats.error(e.code)
            self.loop.send(conn, P.error_reply(rid, e.code, e.message))
            return
        if self._draining_since is not None:
            msg.release()
            self.stats.error(P.UNAVAILABLE)
            self.loop.send(conn, P.error_reply(rid, P.UNAVAILABLE, "the gateway is shutting down"))
            return
        self.stats.tokens += batch.rows
        if batch.rows == 0:
            msg.release()
            self._reply(_Client(conn, None, rid), None)
            return
        x = msg.array(0, pool.dtype, (batch.rows, pool.d_model))
        req = Request(x, _Client(conn, msg, rid), batch.layer)
        experts = None
        if self.batcher.needs_experts:  # expert-aware batching: route now (dispatch then skips it)
            experts = pool.route_early(req)
            if experts is None:  # refused (its error is answered with the finished ones)
                return
        self.batcher.add(req, batch.rows, time.monotonic(), experts)

    def control(self, op: str, h: dict) -> dict:
        """An authenticated control request: a hot update, or the placement or workers."""
        if op == P.UPDATE:
            return self.update(h)
        try:
            fn = self.pool.placement_op if op == P.PLACEMENT else self.pool.workers_op
            return fn(h.get("action"), h)
        except (PlacementError, TypeError, ValueError) as e:
            raise P.RequestError(P.BAD_REQUEST, f"{op} {h.get('action')}: {e}") from None

    def update(self, h: dict) -> dict:
        """A hot-update command from a client (``moe-gateway update ...``): start, advance,
        finish, rollback or status; see gateway/rollout.py. Bad ones are RequestErrors."""
        action = h.get("action")
        try:
            return self.pool.hot_update(action, h)
        except (UpdateError, TypeError, ValueError) as e:
            raise P.RequestError(P.BAD_REQUEST, f"update {action}: {e}") from None

    def pong(self, rid: Optional[int]) -> dict:
        pool = self.pool.status()
        pool["config"].update({"max_batch_tokens": self.max_batch_tokens, "max_wait_ms": self.batcher.max_wait * 1000,
                               "max_inflight_rounds": self.batcher.max_inflight_rounds,
                               "batching": self.batcher.policy})
        return {"op": P.PONG, "id": rid, "gateway": self.stats.as_dict(), **pool, "queued": len(self.batcher),
                "cpu_s": time.process_time(), "pid": os.getpid(), "serve": self.loop.stats.as_dict()}

    # -- rounds ------------------------------------------------------------------------------
    def _tick(self, now: float) -> Optional[float]:
        if self._stop and self._draining_since is None:
            self._draining_since = now
            self.loop.stop_accepting()
        flush = self._draining_since is not None
        while self.batcher.due(now, self.pool.pipelined, flush=flush):
            batch = self.batcher.take(now)
            for req in batch:
                self._presize(req)
            self.pool.dispatch(batch)
        for req in self.pool.take_finished():
            self._finish(req)
        return self.batcher.next_due(self.pool.pipelined)

    def _round_done(self, st: BatchStats) -> None:
        self.stats.add_round(st)
        if self.on_round is not None:
            self.on_round(st, st.queue_s)

    def _presize(self, req: Request) -> None:
        """Take the reply's buffer (a send slot of the client's connection) as the request goes
        out, and make it the request's output: a chunked round sums (or rounds, bf16) each
        chunk into it as it lands, so nothing is copied once the last chunk is in (taken at the
        reply instead, the sum would need a buffer of its own and a copy after the round). A
        connection already gone takes none."""
        client: _Client = req.tag
        if client.reply is not None or req.out is not None:
            return
        nbytes = req.num_tokens * self.pool.row_bytes
        buf = self.loop.reply_buffer(client.conn, nbytes)
        if buf is None:
            return
        client.reply = buf
        req.out = self._rows_in(buffer_view(buf), req.num_tokens)

    def _rows_in(self, view: memoryview, rows: int) -> np.ndarray:
        """A reply buffer seen as the (rows, d_model) output array it carries."""
        pool = self.pool
        return np.frombuffer(view, dtype=pool.dtype, count=rows * pool.d_model).reshape(rows, pool.d_model)

    def _finish(self, req: Request) -> None:
        client: _Client = req.tag
        try:
            if req.error is None:
                self._reply(client, req)
            else:
                err = req.error
                code = getattr(err, "code", None) or (P.BAD_REQUEST if isinstance(err, ValueError)
                                                      else P.WORKER_FAILED)
                self.stats.error(code)
                self.stats.failed_requests += 1
                self.loop.send(client.conn, P.error_reply(client.request_id, code, str(err)))
                if self.on_request is not None:
                    self.on_request(time.perf_counter() - req.arrived, False)
        finally:
            req.release()
            client.msg.release()
            if client.reply is not None:  # an error was sent instead
                self.loop.discard([client.reply])
                client.reply = None

    def _reply(self, client: _Client, req: Optional[Request]) -> None:
        pool = self.pool
        rows = 0 if req is None else req.num_tokens
        shape = (rows, pool.d_model)

        def fill(view: Optional[memoryview]) -> dict:
            fields: dict = {}
            if req is not None:
                # the buffer taken at dispatch is req.out itself (the same array, so a sum made
                # in it is not copied onto itself); else the slot taken now
                out = req.out if view is None else self._rows_in(view, rows)
                pool.combine(req, out)  # straight into the reply slot
                st = req.round.stats
                fields = {"round": req.round.id, "round_requests": st.requests, "timing": {
                    "route_s": st.route_s, "dispatch_s": st.dispatch_s, "compute_s": st.compute_s,
                    "wait_s": st.wait_s, "combine_s": st.combine_s}}
                versions = req.versions()
                if versions:
                    fields["versions"] = versions
                fields["expert_versions"] = req.expert_versions()
                if req.served is not None:
                    fields["served_set"] = req.served
            return P.result_reply(client.request_id, shape, pool.dtype, **fields)

        buf, client.reply = client.reply, None
        if buf is not None:
            try:
                header = fill(None)
            except BaseException:
                self.loop.discard([buf])
                raise
            sent = self.loop.send(client.conn, header, [buf])
        else:
            sent = self.loop.reply(client.conn, rows * pool.row_bytes, fill)
        if sent:
            self.stats.replies += 1
        if req is not None and self.on_request is not None:
            self.on_request(time.perf_counter() - req.arrived, True)


def stop_with_parent(server: GatewayServer, parent: int, period: float = 0.5) -> None:
    """Drain and stop ``server`` once the process ``parent`` is gone (this one re-parented):
    a tool killed mid-run leaves no gateway, and so no local workers, behind."""
    due = 0.0

    def tick(now: float) -> float:
        nonlocal due
        if now >= due:
            due = now + period
            if os.getppid() != parent and not server.draining:
                log.warning("parent %d is gone: stopping", parent)
                server.request_stop()
        return due

    server.loop.add_tick(tick)


def install_signal_handlers(server: GatewayServer) -> None:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    signal.signal(signal.SIGINT, lambda *_: server.request_stop())
