"""The gateway's worker pool: connections to every expert worker, replica choice, and
dispatch rounds that go out to all workers before any reply is awaited.

A *round* carries one or more token batches (requests). Each request is routed on its
own (so its output never depends on what it was batched with: capacity is per request,
as in the reference), gets its own DispatchPlan, and the requests' rows for one worker go
back to back in ONE message to that worker: every request's tokens are gathered straight
from where they are (a client's landed buffer) into the worker's send slot, and combined
straight from the worker's reply (a view where it landed) into the caller's output.

Two ways to drive it:
- :meth:`WorkerPool.forward` blocks for one batch (its own Poller over the workers);
- the server registers :meth:`connections` in its own Poller, calls :meth:`dispatch`,
  :meth:`on_ready` when a worker is readable, :meth:`expire` and :meth:`tick`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence

import numpy as np

import transport
from gateway.dispatch import DispatchPlan, split_over_replicas
from gateway.router import Router, Routing
from gateway.update import DEFAULT_STEPS, Update, UpdateError
from transport import ConnectionClosed, Timeout, TransportError
from transport.poller import Poller
from workers import protocol as P

log = logging.getLogger("moe.pool")

MIN_SLOT_SIZE = 64 << 10
HEALTH_INTERVAL = 1.0  # how often an unhealthy (but connected) worker is pinged back in


class WorkerError(RuntimeError):
    """A batch failed because of a worker (closed, timed out, error reply, bad reply)."""


class NoHealthyWorker(WorkerError):
    """No usable worker hosts an expert the batch was routed to."""


@dataclass
class WorkerState:
    """What the pool knows about one worker (index = its column in dispatch plans)."""

    index: int
    url: str
    conn: Any
    experts: list
    versions: dict  # expert -> active version
    max_tokens: int
    healthy: bool = True
    draining: bool = False
    closed: bool = False
    why: str = ""  # the last failure, for error messages
    outstanding_rows: int = 0
    rows_sent: int = 0
    batches_sent: int = 0
    failures: int = 0
    compute_seconds: float = 0.0
    expert_rows: dict = field(default_factory=dict)  # expert_id -> rows sent
    held: dict = field(default_factory=dict)  # expert -> versions the worker holds
    cpu_s: float = 0.0  # the worker process's CPU seconds, as its last reply said
    pending: dict = field(default_factory=dict)  # round id -> rows awaiting a reply
    _next_ping: float = 0.0

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining and not self.closed

    def describe(self) -> str:
        state = "closed" if self.closed else "draining" if self.draining else \
            "healthy" if self.healthy else "unhealthy"
        return f"{self.url} [{state}{': ' + self.why if self.why and state != 'healthy' else ''}]"

    def as_dict(self) -> dict:
        return {"url": self.url, "experts": list(self.experts), "healthy": self.healthy,
                "draining": self.draining, "closed": self.closed, "why": self.why,
                "outstanding_rows": self.outstanding_rows, "rows_sent": self.rows_sent,
                "batches_sent": self.batches_sent, "failures": self.failures,
                "compute_seconds": self.compute_seconds, "cpu_s": self.cpu_s,
                "versions": [[e, v, sorted(self.held.get(e, {v}))] for e, v in sorted(self.versions.items())],
                "expert_rows": [[e, n] for e, n in sorted(self.expert_rows.items())],
                "transport": self.conn.stats.as_dict() if not self.closed else {}}


@dataclass
class BatchStats:
    """Per-round timing (seconds) and sizes. ``compute_s`` is the slowest worker's own
    measurement (the critical path); ``wait_s`` is from the last send to the last reply,
    so ``wait_s - compute_s`` is roughly what the transport and queueing cost."""

    requests: int = 0
    tokens: int = 0
    rows: int = 0
    workers: int = 0
    dropped: int = 0
    overflow: int = 0
    route_s: float = 0.0
    dispatch_s: float = 0.0
    gather_s: float = 0.0  # the part of dispatch_s that copies tokens into the send slots
    compute_s: float = 0.0
    compute_total_s: float = 0.0
    wait_s: float = 0.0
    combine_s: float = 0.0
    total_s: float = 0.0

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Request:
    __slots__ = ("x", "routing", "plan", "error", "bases", "pins")

    def __init__(self, x: np.ndarray):
        self.x: Optional[np.ndarray] = x
        self.routing: Optional[Routing] = None
        self.plan: Optional[DispatchPlan] = None
        self.error: Optional[Exception] = None
        self.bases: dict = {}  # worker index -> first row of this request in its block
        self.pins: dict = {}  # expert -> the weights version this request is served by


class Round:
    """One dispatch round; ``tag`` is the caller's (the server keeps its requests there)."""

    def __init__(self, rid: int, requests: list, tag: Any, deadline: float):
        self.id = rid
        self.requests = requests
        self.tag = tag
        self.deadline = deadline
        self.rows: dict = {}  # worker index -> rows sent
        self.replies: dict = {}  # worker index -> (Message, (rows, d) view)
        self.error: Optional[Exception] = None
        self.stats = BatchStats(requests=len(requests))
        self._t0 = time.perf_counter()
        self._sent_at = self._t0

    @property
    def finished(self) -> bool:
        return self.error is not None or len(self.replies) == len(self.rows)

    def request_error(self, i: int) -> Optional[Exception]:
        """Why request ``i`` has no output (the round's failure, or its own), else None."""
        return self.error or self.requests[i].error

    def routing(self, i: int) -> Optional[Routing]:
        return self.requests[i].routing

    def versions(self, i: int) -> list:
        """[[expert, version], ...] pinned for request ``i`` (during a hot update)."""
        return [[e, v] for e, v in sorted(self.requests[i].pins.items())]

    def combine(self, i: int, out: np.ndarray) -> np.ndarray:
        """Weighted combine of request ``i``'s expert outputs into ``out`` (T, d), from the
        replies where they landed."""
        err = self.request_error(i)
        if err is not None:
            raise err
        t = time.perf_counter()
        req = self.requests[i]
        outputs = []
        for w in range(req.plan.n_workers):
            n = req.plan.worker_tokens(w)
            if n == 0:
                outputs.append(None)
            else:
                base = req.bases[w]
                outputs.append(self.replies[w][1][base:base + n])
        req.plan.combine(outputs, out)
        self.stats.combine_s += time.perf_counter() - t
        return out

    def release(self) -> None:
        """Hand every reply buffer back to its worker (after the combines)."""
        for msg, _ in self.replies.values():
            msg.release()
        self.replies = {}
        self.rows = {}
        for r in self.requests:
            r.x = None

    def _fail(self, err: Exception) -> None:
        if self.error is None:
            self.error = err


def choose_replicas(counts: np.ndarray, hosts: dict, load: np.ndarray, *, split: bool = True,
                    min_split: int = 16) -> tuple[dict, dict]:
    """Load-aware replica choice for one round.

    ``counts[e]``: rows routed to expert e; ``hosts[e]``: usable workers hosting e;
    ``load[w]``: rows outstanding on w (updated in place with this round's choice).
    Experts with one host are placed first (no choice), then replicated experts from the
    busiest down, each on the replica with the least load; with ``split``, a big expert is
    water-filled over its replicas instead (each share at least ``min_split`` rows).
    Returns (replicas, shares) for :func:`split_over_replicas`.
    """
    replicas: dict = {}
    shares: dict = {}
    order = sorted((e for e in range(len(counts)) if counts[e] > 0),
                   key=lambda e: (len(hosts[e]) > 1, -counts[e], e))
    for e in order:
        ws = hosts[e]
        c = float(counts[e])
        if len(ws) == 1:
            replicas[e], shares[e] = [ws[0]], [1.0]
            load[ws[0]] += c
            continue
        ls = np.array([load[w] for w in ws], dtype=np.float64)
        if split and c >= 2 * min_split:
            share = _water_fill(ls, c)
            keep = share >= min_split
            if not keep.any():
                keep = share == share.max()
            share = np.where(keep, share, 0.0)
        else:
            share = np.zeros(len(ws))
            share[int(np.argmin(ls))] = 1.0
        share = share / share.sum()
        replicas[e] = [w for w, s in zip(ws, share) if s > 0]
        shares[e] = [float(s) for s in share if s > 0]
        for w, s in zip(ws, share):
            load[w] += c * s
    return replicas, shares


def _water_fill(loads: np.ndarray, amount: float) -> np.ndarray:
    """Shares of ``amount`` that bring the lowest loads up to a common level."""
    order = np.sort(loads)
    level = order[0] + amount
    for k in range(1, len(order) + 1):
        level = (order[:k].sum() + amount) / k
        if k == len(order) or level <= order[k]:
            break
    return np.maximum(0.0, level - loads)


class WorkerPool:
    """Connections to expert workers and the MoE forward across them.

    ``urls``: the workers' transport URLs. ``router``: the gate (its n_experts must all be
    hosted). ``max_batch_tokens``: the largest batch one round carries (sizes the slots:
    a worker may get up to max_batch_tokens * top_k rows).
    """

    def __init__(self, urls: Sequence[str], router: Router, *, dtype: Any = np.float32,
                 max_batch_tokens: int = 1024, timeout: float = 10.0, connect_timeout: float = 10.0,
                 nslots: int = 8, split_replicas: bool = True, min_split: int = 16) -> None:
        if not urls:
            raise ValueError("a pool needs at least one worker URL")
        self.router = router
        self.dtype = np.dtype(dtype)
        self.d_model = router.d_model
        self.n_experts = router.n_experts
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_rows = self.max_batch_tokens * router.top_k
        self.timeout = timeout
        self.split_replicas, self.min_split = split_replicas, min_split
        self.row_bytes = self.d_model * self.dtype.itemsize
        slot_size = max(MIN_SLOT_SIZE, self.max_rows * self.row_bytes)
        self.workers: list[WorkerState] = []
        self._rounds: dict[int, Round] = {}
        self._next_id = 1
        self._poller: Optional[Poller] = None  # forward()'s own
        self._watchers: list = []  # (poller, data_fn): pollers the workers are registered in
        self._finished: list[Round] = []  # outbox of take_finished()
        self.update: Optional[Update] = None  # the current (or last) hot update
        self.updates: list[Update] = []  # every update, oldest first
        self._ctrl: dict = {}  # request id -> (op, worker index, expert) of a load or retire
        try:
            for i, url in enumerate(urls):
                conn = transport.connect(url, slot_size=slot_size, nslots=nslots, timeout=connect_timeout)
                w = WorkerState(i, url, conn, [], {}, 0)
                self.workers.append(w)
                self._hello(w, connect_timeout)
            self._check_coverage()
        except BaseException:
            self.close()
            raise

    # -- setup -----------------------------------------------------------------
    def _hello(self, w: WorkerState, timeout: float) -> None:
        w.conn.send(P.request(P.INFO, 0), timeout=timeout)
        deadline = time.monotonic() + timeout
        while True:
            msg = w.conn.recv(timeout=max(0.0, deadline - time.monotonic()))
            h = msg.header
            msg.release()
            if isinstance(h, dict) and h.get("op") == P.INFO:
                break
        P.raise_if_error(h, w.url)
        if h.get("d_model") != self.d_model or h.get("dtype") != self.dtype.name:
            raise ValueError(f"worker {w.url} serves d_model={h.get('d_model')} {h.get('dtype')}, "
                             f"the gateway needs d_model={self.d_model} {self.dtype.name}")
        w.experts = sorted(int(e) for e in h.get("experts", []))
        self._set_versions(w, h.get("versions", []))
        w.max_tokens = int(h.get("max_tokens", 0))
        if w.max_tokens < self.max_rows or w.conn.max_message < self.max_rows * self.row_bytes:
            raise ValueError(
                f"worker {w.url} takes batches of at most {w.max_tokens} rows "
                f"({w.conn.max_message} bytes) but this pool may send {self.max_rows} rows "
                f"(max_batch_tokens {self.max_batch_tokens} x top_k {self.router.top_k}); "
                f"start it with --max-tokens >= {self.max_rows} or lower max_batch_tokens")
        bad = [e for e in w.experts if not 0 <= e < self.n_experts]
        if bad:
            log.warning("worker %s hosts experts %s beyond the router's %d", w.url, bad, self.n_experts)

    @staticmethod
    def _set_versions(w: WorkerState, versions: list) -> None:
        """From info/pong: [[expert, active, [held, ...]], ...]."""
        w.versions = {int(v[0]): int(v[1]) for v in versions}
        w.held = {int(v[0]): set(int(x) for x in (v[2] if len(v) > 2 else [v[1]])) for v in versions}

    def _check_coverage(self) -> None:
        missing = [e for e in range(self.n_experts) if not any(e in w.experts for w in self.workers)]
        if missing:
            raise ValueError(f"experts {missing} are hosted by no worker of {[w.url for w in self.workers]}")

    def hosts(self, expert: int, usable_only: bool = True) -> list[int]:
        return [w.index for w in self.workers if expert in w.experts and (w.usable or not usable_only)]

    def watch(self, poller: Poller, data=None) -> None:
        """Register every open worker connection in ``poller`` (with ``data(worker)``, or
        the worker itself, as its data); the pool unregisters a worker it closes."""
        fn = data or (lambda w: w)
        for w in self.workers:
            if not w.closed:
                poller.register(w.conn, fn(w))
        self._watchers.append((poller, fn))

    def unwatch(self, poller: Poller) -> None:
        for w in self.workers:
            if not w.closed:
                poller.unregister(w.conn)
        self._watchers = [(p, f) for p, f in self._watchers if p is not poller]

    # -- dispatch --------------------------------------------------------------
    def dispatch(self, batches: Sequence[np.ndarray], *, tag: Any = None,
                 timeout: Optional[float] = None) -> Round:
        """Route every batch, gather each worker's rows into one send slot, send to all
        workers. Never raises for a worker's failure: the round comes back failed."""
        rid = self._next_id
        self._next_id += 1
        rnd = Round(rid, [_Request(x) for x in batches], tag,
                    time.monotonic() + (self.timeout if timeout is None else timeout))
        st = rnd.stats
        t = time.perf_counter()
        live = self._route(rnd)
        st.route_s = time.perf_counter() - t
        t = time.perf_counter()
        if live:
            self._plan(rnd, live)
            self._send(rnd, live)
        st.dispatch_s = time.perf_counter() - t
        rnd._sent_at = time.perf_counter()
        if rnd.finished:
            st.total_s = time.perf_counter() - rnd._t0
        else:
            self._rounds[rid] = rnd
        return rnd

    def _route(self, rnd: Round) -> list[int]:
        """Route each request; those needing an expert nobody can serve fail alone."""
        live = []
        usable = {e: bool(self.hosts(e)) for e in range(self.n_experts)}
        for i, req in enumerate(rnd.requests):
            x = req.x
            if x.ndim != 2 or x.shape[1] != self.d_model or x.dtype != self.dtype:
                req.error = ValueError(f"batch must be (T, {self.d_model}) {self.dtype.name}, "
                                       f"got {x.shape} {x.dtype}")
                continue
            if x.shape[0] > self.max_batch_tokens:
                req.error = ValueError(f"batch of {x.shape[0]} tokens exceeds max_batch_tokens "
                                       f"{self.max_batch_tokens}")
                continue
            try:
                routing = self.router.route(x)
            except ValueError as e:
                req.error = e
                continue
            req.routing = routing
            if self.update is not None and self.update.pinning:
                req.pins = self.update.decide()
            st = rnd.stats
            st.tokens += x.shape[0]
            st.dropped += routing.dropped
            st.overflow += routing.overflow
            needed = np.flatnonzero(routing.expert_counts)
            lost = [int(e) for e in needed if not usable[int(e)]]
            if lost:
                why = "; ".join(f"expert {e} on {', '.join(self.workers[w].describe() for w in self.hosts(e, False))}"
                                for e in lost)
                req.error = NoHealthyWorker(f"no healthy worker for {why}")
                continue
            live.append(i)
        return live

    def _plan(self, rnd: Round, live: list[int]) -> None:
        reqs = [rnd.requests[i] for i in live]
        idx = np.concatenate([r.routing.topk_idx for r in reqs]) if len(reqs) > 1 else reqs[0].routing.topk_idx
        counts = np.bincount(idx[idx >= 0].ravel(), minlength=self.n_experts)
        load = np.array([w.outstanding_rows for w in self.workers], dtype=np.float64)
        hosts = {e: self.hosts(e) for e in range(self.n_experts) if counts[e]}
        replicas, shares = choose_replicas(counts, hosts, load, split=self.split_replicas,
                                           min_split=self.min_split)
        # one assignment over the round, so a replicated expert is balanced across requests
        if all(len(ws) == 1 for ws in replicas.values()):  # no split: a table lookup is enough
            table = np.zeros(self.n_experts, dtype=np.int64)
            for e, ws in replicas.items():
                table[e] = ws[0]
            assign = np.where(idx >= 0, table[np.maximum(idx, 0)], -1)
        else:
            assign = split_over_replicas(idx, replicas, shares)
        at = 0
        n_workers = len(self.workers)
        for r in reqs:
            T = r.routing.num_tokens
            r.plan = DispatchPlan.from_assignment(r.routing.topk_idx, r.routing.topk_weights,
                                                  assign[at:at + T], n_workers, n_experts=self.n_experts)
            at += T
        for w in range(n_workers):
            base = 0
            for r in reqs:
                r.bases[w] = base
                base += r.plan.worker_tokens(w)
            if base:
                rnd.rows[w] = base

    def _send(self, rnd: Round, live: list[int]) -> None:
        reqs = [rnd.requests[i] for i in live]
        for w, rows in rnd.rows.items():
            ws = self.workers[w]
            try:
                slot = ws.conn.alloc(rows * self.row_bytes, timeout=self.timeout)
            except TransportError as e:
                self._worker_failed(ws, f"cannot allocate a send slot: {e}")
                rnd._fail(WorkerError(f"worker {ws.url} failed round {rnd.id}: {ws.why}"))
                break
            block = slot.array(self.dtype, (rows, self.d_model))
            t = time.perf_counter()
            groups = []
            for r in reqs:
                base = r.bases[w]
                n = r.plan.worker_tokens(w)
                if n:
                    r.plan.gather_into(r.x, w, block[base:base + n])
                    pins = r.pins
                    groups.extend((e, base + s, c, pins[e]) if e in pins else (e, base + s, c)
                                  for e, s, c in r.plan.groups(w))
            rnd.stats.gather_s += time.perf_counter() - t
            try:
                ws.conn.send(P.forward_request(rnd.id, (rows, self.d_model), self.dtype, groups), [slot],
                             timeout=self.timeout)
            except (TransportError, ValueError) as e:
                self._worker_failed(ws, f"send failed: {e}", closed=isinstance(e, ConnectionClosed))
                rnd._fail(WorkerError(f"worker {ws.url} failed round {rnd.id}: {ws.why}"))
                break
            ws.pending[rnd.id] = rows
            ws.outstanding_rows += rows
            ws.rows_sent += rows
            ws.batches_sent += 1
            for g in groups:
                ws.expert_rows[g[0]] = ws.expert_rows.get(g[0], 0) + g[2]
        rnd.stats.rows = sum(rnd.rows.values())
        rnd.stats.workers = len(rnd.rows)

    # -- replies ---------------------------------------------------------------
    def on_ready(self, w: WorkerState) -> list[Round]:
        """Take every message worker ``w`` has ready (call when its connection polls
        readable); returns :meth:`take_finished`."""
        for _ in range(64):
            try:
                msg = w.conn.recv(timeout=0)
            except Timeout:
                break
            except TransportError as e:  # ConnectionClosed, ProtocolError
                self._worker_failed(w, f"connection lost: {e}", closed=True)
                break
            self._handle(w, msg)
        return self.take_finished()

    def take_finished(self) -> list[Round]:
        """Rounds (other than one :meth:`dispatch` returned finished) that completed or
        failed since the last call, whatever noticed it: a reply, a worker lost while
        sending another round, a deadline."""
        done, self._finished = self._finished, []
        return done

    def _handle(self, w: WorkerState, msg) -> None:
        h = msg.header
        op = h.get("op") if isinstance(h, dict) else None
        if P.request_id_of(h) in self._ctrl:
            msg.release()
            self._on_ctrl_reply(w, h)
            return
        if op in (P.RESULT, P.ERROR) and P.request_id_of(h) in w.pending:
            rid = P.request_id_of(h)
            w.outstanding_rows -= w.pending.pop(rid)
            rnd = self._rounds.get(rid)
            if rnd is None or rnd.error is not None:
                msg.release()  # a late reply to a round that already failed
                return
            if op == P.ERROR:
                msg.release()
                err = P.RemoteError(str(h.get("code")), str(h.get("message")), w.url)
                self._worker_failed(w, f"error reply: {err}")
                self._finish_failed(rnd, WorkerError(f"worker {w.url} failed round {rid}: {err}"))
                return
            rows = rnd.rows.get(w.index, -1)
            if h.get("shape") != [rows, self.d_model] or h.get("dtype") != self.dtype.name \
                    or len(msg.buffers) != 1 or msg.buffers[0].nbytes != rows * self.row_bytes:
                msg.release()
                self._worker_failed(w, f"malformed reply {h!r}")
                self._finish_failed(rnd, WorkerError(f"worker {w.url} sent a malformed reply"))
                return
            rnd.replies[w.index] = (msg, msg.array(0, self.dtype, (rows, self.d_model)))
            cs = float(h.get("compute_s", 0.0))
            w.compute_seconds += cs
            w.cpu_s = float(h.get("cpu_s", w.cpu_s))
            rnd.stats.compute_s = max(rnd.stats.compute_s, cs)
            rnd.stats.compute_total_s += cs
            if rnd.finished:
                now = time.perf_counter()
                rnd.stats.wait_s = now - rnd._sent_at
                rnd.stats.total_s = now - rnd._t0
                del self._rounds[rid]
                self._finished.append(rnd)
            return
        msg.release()
        if op == P.DRAINING:
            log.info("worker %s is draining: no new batches go to it", w.url)
            w.draining = True
        elif op == P.PONG:
            if "versions" in h:
                self._set_versions(w, h["versions"])
            if not w.closed and not h.get("draining"):
                if not w.healthy:
                    log.info("worker %s is healthy again", w.url)
                w.healthy, w.why = True, ""
            w.draining = bool(h.get("draining"))
        elif op not in (P.INFO,):
            log.warning("unexpected message from worker %s: %r", w.url, h)

    def _finish_failed(self, rnd: Round, err: Exception) -> None:
        rnd._fail(err)
        rnd.stats.total_s = time.perf_counter() - rnd._t0
        rnd.release()
        if self._rounds.pop(rnd.id, None) is not None:
            self._finished.append(rnd)

    def _worker_failed(self, w: WorkerState, why: str, *, closed: bool = False) -> None:
        """Mark ``w`` unhealthy; if its connection is gone, close it and fail the rounds
        still waiting on it (an unhealthy but connected worker may still answer them)."""
        w.failures += 1
        w.healthy = False
        w.why = why
        w._next_ping = time.monotonic() + HEALTH_INTERVAL
        log.warning("worker %s: %s", w.url, why)
        if closed and not w.closed:
            w.closed = True
            for poller, _ in self._watchers:
                poller.unregister(w.conn)  # before close: its fd number may be reused at once
            w.conn.close()
            for rid in [r for r, c in self._ctrl.items() if c[1] == w.index]:
                del self._ctrl[rid]
            if self.update is not None:
                self.update.on_worker_lost(w.index)
        if not closed:
            return
        for rid in list(w.pending):
            rnd = self._rounds.get(rid)
            w.outstanding_rows -= w.pending.pop(rid)
            if rnd is not None and rnd.error is None:
                self._finish_failed(rnd, WorkerError(f"worker {w.url} failed round {rid}: {why}"))

    # -- time ------------------------------------------------------------------
    def next_deadline(self) -> Optional[float]:
        """The earliest round deadline (time.monotonic), or None with nothing in flight."""
        return min((r.deadline for r in self._rounds.values()), default=None)

    def expire(self, now: Optional[float] = None) -> list[Round]:
        """Fail the rounds past their deadline (the workers that did not answer become
        unhealthy, pinged back in by :meth:`tick`); returns :meth:`take_finished`."""
        now = time.monotonic() if now is None else now
        for rnd in [r for r in self._rounds.values() if r.deadline <= now]:
            late = [self.workers[w] for w in rnd.rows if w not in rnd.replies]
            for w in late:
                w.healthy, w.why = False, f"no reply to round {rnd.id} in time"
                w.failures += 1
                w._next_ping = now + HEALTH_INTERVAL
            names = ", ".join(w.url for w in late)
            self._finish_failed(rnd, WorkerError(f"round {rnd.id}: no reply from {names} within the timeout"))
        return self.take_finished()

    def tick(self, now: Optional[float] = None) -> None:
        """Ping unhealthy (still connected) workers, so one that recovered comes back; run a
        hot update's automatic schedule."""
        now = time.monotonic() if now is None else now
        if self.update is not None and self.update.pinning:
            due = self.update.due()
            if due is not None:
                try:
                    self.update_command(due)
                except UpdateError as e:
                    log.warning("automatic update %s: %s", due, e)
        for w in self.workers:
            if not w.closed and not w.healthy and now >= w._next_ping:
                w._next_ping = now + HEALTH_INTERVAL
                try:
                    w.conn.send(P.request(P.PING, 0), timeout=0.5)
                except TransportError as e:
                    self._worker_failed(w, f"ping failed: {e}", closed=isinstance(e, ConnectionClosed))

    @property
    def in_flight(self) -> int:
        return len(self._rounds)

    # -- hot update ------------------------------------------------------------
    def _live_hosts(self, expert: int) -> list[WorkerState]:
        return [w for w in self.workers if expert in w.experts and not w.closed]

    def update_start(self, experts: Sequence[int], version: int, *, weights: Optional[str] = None,
                     seed: Optional[int] = None, steps: Sequence[float] = DEFAULT_STEPS,
                     auto_interval: Optional[float] = None) -> dict:
        """Load ``version`` of ``experts`` on every worker hosting them (they keep serving),
        then shift traffic to it in ``steps`` (see gateway/update.py). Returns the status."""
        if self.update is not None and self.update.state.active:
            raise UpdateError(f"an update is in progress ({self.update.state.value}); finish or roll it back")
        if (weights is None) == (seed is None):
            raise UpdateError("an update needs exactly one of weights (an .npz path every worker can read) or seed")
        experts = sorted({int(e) for e in experts})
        bad = [e for e in experts if not 0 <= e < self.n_experts]
        if bad:
            raise UpdateError(f"no expert {bad} (the layer has {self.n_experts})")
        if auto_interval is not None and auto_interval <= 0:
            raise UpdateError(f"auto interval must be > 0 seconds, got {auto_interval}")
        old = {}
        for e in experts:
            hosts = self._live_hosts(e)
            if not hosts:
                raise UpdateError(f"expert {e} has no connected worker")
            actives = {w.versions.get(e) for w in hosts}
            if len(actives) != 1:
                raise UpdateError(f"expert {e}'s workers disagree on its active version: "
                                  + ", ".join(f"{w.url}={w.versions.get(e)}" for w in hosts))
            old[e] = actives.pop()
        up = Update(tuple(experts), old, int(version), steps=steps, auto_interval=auto_interval)
        loads = [(w, e) for e in experts for w in self._live_hosts(e)]
        up.waiting = {(w.index, e) for w, e in loads}
        self.update = up
        self.updates.append(up)
        source = {"weights": weights} if weights is not None else {"seed": int(seed)}
        for w, e in loads:
            self._ctrl_send(w, P.LOAD, e, version=int(version), **source)
        log.info("update to version %d of experts %s started", version, experts)
        return up.status()

    def update_command(self, action: str, fraction: Optional[float] = None) -> dict:
        """advance / finish / rollback / status of the current update."""
        up = self.update
        if up is None:
            if action == "status":
                return {"state": "none"}
            raise UpdateError("no update has been started")
        if action == "advance":
            up.advance(fraction)
        elif action == "finish":
            for w, e in up.finish({e: [w.index for w in self._live_hosts(e)] for e in up.experts}):
                self._ctrl_send(self.workers[w], P.RETIRE, e, version=up.old[e])
        elif action == "rollback":
            for w, e in up.rollback():
                self._ctrl_send(self.workers[w], P.RETIRE, e, version=up.new)
        elif action != "status":
            raise UpdateError(f"unknown update action {action!r}; use start, advance, finish, rollback, status")
        return up.status()

    def _ctrl_send(self, w: WorkerState, op: str, expert: int, **fields) -> None:
        rid = self._next_id
        self._next_id += 1
        self._ctrl[rid] = (op, w.index, expert)
        try:
            w.conn.send(P.request(op, rid, expert=expert, **fields), timeout=self.timeout)
        except TransportError as e:
            self._ctrl.pop(rid, None)
            self._worker_failed(w, f"{op} failed: {e}", closed=isinstance(e, ConnectionClosed))
            if not w.closed and op == P.LOAD and self.update is not None:
                self._retire_all(self.update.on_load_failed(w.index, expert, str(e)), self.update.new)

    def _retire_all(self, pairs: list, version: int) -> None:
        for wi, e in pairs:
            self._ctrl_send(self.workers[wi], P.RETIRE, e, version=version)

    def _on_ctrl_reply(self, w: WorkerState, h: dict) -> None:
        op, wi, expert = self._ctrl.pop(P.request_id_of(h))
        up = self.update
        if h.get("op") == P.ERROR:
            why = f"{h.get('code')}: {h.get('message')}"
            log.warning("worker %s: %s of expert %d failed: %s", w.url, op, expert, why)
            if up is not None and op == P.LOAD:
                self._retire_all(up.on_load_failed(wi, expert, why), up.new)
            elif up is not None:  # a retire that failed: the version is not held (anymore)
                up.on_retired(wi, expert)
            return
        if op == P.LOAD and h.get("op") == P.LOADED:
            w.held.setdefault(expert, set()).add(int(h["version"]))
            if up is not None and up.on_loaded(wi, expert):  # rolled back meanwhile
                self._ctrl_send(w, P.RETIRE, expert, version=up.new)
        elif op == P.RETIRE and h.get("op") == P.RETIRED:
            w.held.get(expert, set()).discard(int(h["version"]))
            w.versions[expert] = int(h["active"])
            if up is not None:
                up.on_retired(wi, expert)

    # -- blocking API ----------------------------------------------------------
    def forward(self, x: np.ndarray, out: Optional[np.ndarray] = None, *,
                timeout: Optional[float] = None) -> tuple[np.ndarray, BatchStats]:
        """The MoE layer on ``x`` (T, d_model): returns (y, per-stage stats). Raises
        WorkerError (or NoHealthyWorker) when a worker fails this batch; never hangs."""
        x = np.asarray(x)
        if out is None:
            out = np.empty(x.shape, dtype=self.dtype)
        elif out.shape != x.shape or out.dtype != self.dtype:
            raise ValueError(f"out must be {x.shape} {self.dtype.name}, got {out.shape} {out.dtype}")
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        rnd = self.dispatch([x], timeout=timeout)
        self._wait(rnd)
        try:
            rnd.combine(0, out)
        finally:
            rnd.release()
        return out, rnd.stats

    def _wait(self, rnd: Round) -> None:
        poller = self._own_poller()
        while not rnd.finished:
            now = time.monotonic()
            self.tick(now)
            if now >= rnd.deadline:
                self.expire(now)
                break
            for _, w in poller.poll(min(rnd.deadline - now, HEALTH_INTERVAL)):
                self.on_ready(w)
        self.take_finished()  # standalone use: the only round in flight is this one

    def _own_poller(self) -> Poller:
        if self._poller is None:
            self._poller = Poller()
            self.watch(self._poller)
        return self._poller

    def ping(self, timeout: float = 5.0) -> list[Optional[dict]]:
        """Ping every open worker; their pongs (experts, versions, in-flight, counters), or
        None for a worker that did not answer in time. Blocking: not for the server loop."""
        pongs: list[Optional[dict]] = [None] * len(self.workers)
        waiting = set()
        for w in self.workers:
            if w.closed:
                continue
            try:
                w.conn.send(P.request(P.PING, -1), timeout=timeout)
                waiting.add(w.index)
            except TransportError as e:
                self._worker_failed(w, f"ping failed: {e}", closed=isinstance(e, ConnectionClosed))
        deadline = time.monotonic() + timeout
        while waiting and time.monotonic() < deadline:
            for i in list(waiting):
                w = self.workers[i]
                try:
                    msg = w.conn.recv(timeout=max(0.0, min(0.05, deadline - time.monotonic())))
                except Timeout:
                    continue
                except TransportError as e:
                    self._worker_failed(w, f"connection lost: {e}", closed=True)
                    waiting.discard(i)
                    continue
                h = msg.header
                if isinstance(h, dict) and h.get("op") == P.PONG and h.get("id") == -1:
                    msg.release()
                    pongs[i] = h
                    waiting.discard(i)
                    self._handle(w, _Header(h))
                else:
                    self._handle(w, msg)
        return pongs

    def stats(self) -> list[dict]:
        return [w.as_dict() for w in self.workers]

    def close(self) -> None:
        for rnd in list(self._rounds.values()):
            self._finish_failed(rnd, WorkerError("the pool was closed"))
        for poller, _ in list(self._watchers):
            self.unwatch(poller)
        for w in self.workers:
            if not w.closed:
                w.closed = True
                w.conn.close()
        if self._poller is not None:
            self._poller.close()
            self._poller = None

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Header:
    """A stand-in message for a header already taken out of its (released) message."""

    def __init__(self, header: dict):
        self.header = header

    def release(self) -> None:
        pass
