"""Dispatch rounds: the round life cycle, from dispatch to every request's end.

A *round* carries one or more requests (token batches; gateway/requests.py). Each request
is routed on its own (its output never depends on what it was batched with: capacity is per
request, as in the reference) and the round is planned (gateway/planner.py: replicas, each
request's DispatchPlan, each worker's part and chunks); the requests' rows for one worker go
back to back in ONE message to that worker, gathered straight from where each request's
tokens are (a client's landed buffer) into the worker's send slot, and every request is
combined straight from the workers' replies where they landed (gateway/combine.py). What
each message and reply cost is told to an observer (gateway/round_costs.py), as is when
each worker's last reply is due (gateway/reply_clock.py).

Failure is per worker, not per round, and completion is per request: a request is finished
as soon as every worker it has rows on replied, whatever the others do. When a worker fails
its part (its connection goes, it misses the round's deadline, it replies an error, or it
cannot take the message), each request that needed it is retried once in a new round on
the other workers if every expert it needs there has another healthy host (a forward is
idempotent), and otherwise fails at once with ``unavailable``. A late reply of a failed part
is discarded. So a hung worker delays only the requests that need it.

Chunks: a worker's part may go as several messages of consecutive rows, so the worker
computes the first while the next is gathered and in flight. Such a round's replies are
summed as they land and given back at once (a round holding its replies until the last one
would hold the worker's credits, and with more chunks than credits never get the last one);
a request is finished when the chunks holding its rows are in. A chunk the connection cannot
take yet waits in a per-worker backlog, sent as credits come back; failure stays per part.

Layers: a round carries requests of one layer (the worker message names one), so a batch of
requests of several layers goes out as one round per layer, all sent before any wait.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from gateway.chunk_bounds import chunk_groups
from gateway.chunking import ChunkSetting, parse_chunk_rows
from gateway.combine import add_chunk, start_sums
from gateway.dispatch import SumBuffers
from gateway.planner import Planner
from gateway.reply_clock import ReplyClock
from gateway.requests import NoHealthyWorker, Request, Round, WorkerError
from gateway.round_costs import RoundCosts
from gateway.served import ServedSet
from gateway.worker_link import WorkerLink
from gateway.workers import WorkerSet
from transport import TransportError
from workers import protocol as P

log = logging.getLogger("moe.rounds")

MAX_ATTEMPTS = 2  # a request is tried at most this often (the first round and one retry)
#: a round older than this whose every missing part is on a worker silent for as long (or not
#: usable) no longer holds up the next round: a hung worker must not delay requests that do
#: not need it (its parts still fail at the round's deadline)
STALLED_AFTER = 0.5


class RoundBook:
    """Sends rounds to the workers of ``workers`` and follows them to every request's end.

    ``router``: one router (layer 0), or {layer: router}. ``decide_pins(layer)``: the weights
    versions a new request of that layer is served by (hot update); ``pinned_router(layer,
    pins)``: the router those pins route with, None for the layer's own. ``chunk_rows``:
    "auto" (sized from what each worker's replies measured), 0 (a part is one message) or
    at most that many rows per message (cut between expert groups: chunk_bounds.part_bounds)."""

    def __init__(self, workers: WorkerSet, router, *, dtype: np.dtype, max_batch_tokens: int, timeout: float,
                 split_replicas: bool = True, min_split: int = 16,
                 decide_pins: Optional[Callable[[int], dict]] = None,
                 next_id: Optional[Callable[[], int]] = None, balancing: str = "load-aware",
                 pinned_router: Optional[Callable[[int, dict], Any]] = None,
                 chunk_rows: ChunkSetting = "auto", served: Optional[ServedSet] = None) -> None:
        self.workers = workers
        # a dict is kept as it is: the pool shares it with its Rollout (a finished update
        # installs a new router there)
        self.routers = router if isinstance(router, dict) else (
            dict(router) if isinstance(router, Mapping) else {P.DEFAULT_LAYER: router})
        self.router = next(iter(self.routers.values()))  # the first (or only) layer's
        self.dtype = np.dtype(dtype)
        self.d_model = self.router.d_model
        self.row_bytes = self.d_model * self.dtype.itemsize
        self.timeout = timeout
        self.costs = RoundCosts(workers)  # what rounds cost, fed to chunking (an observer)
        self.planner = Planner(workers, self.routers, dtype=self.dtype, max_batch_tokens=max_batch_tokens,
                               split_replicas=split_replicas, min_split=min_split, balancing=balancing,
                               decide_pins=decide_pins, pinned_router=pinned_router, served=served,
                               chunk_mode=self.costs.chunk_mode)
        self._ids = next_id or _counter()
        self.rounds: dict[int, Round] = {}
        self.sums = SumBuffers()  # float32 sums of narrow outputs, reused (fresh pages fault)
        self._finished: list[Request] = []
        self._settled: list[Round] = []  # rounds whose every part is done (for metrics)
        self._avoid: frozenset = frozenset()  # workers a retry round must not use
        self.retried = 0
        self.chunk_rows = parse_chunk_rows(chunk_rows)
        self._msgs: dict[tuple, tuple] = {}  # (worker, message id) -> (round, chunk)
        self._backlog: dict[int, deque] = {}  # worker -> (round, chunk) its connection could not take yet
        self.clock = ReplyClock()  # when each worker's last message is due back (the loop spins for it)

    @property
    def balancing(self) -> str:
        return self.planner.balancing

    # -- dispatch ------------------------------------------------------------------------------
    def dispatch(self, requests: Sequence[Request], avoid: frozenset = frozenset()) -> Optional[Round]:
        """Route, plan, gather and send ``requests`` as one round per layer (to every worker
        before waiting for any; none in ``avoid``). Requests that cannot go (bad shape, an
        expert nobody healthy hosts) finish at once with their error; see
        :meth:`take_finished`. Returns the (last) round sent, or None."""
        self._avoid = avoid
        try:
            layers = {r.layer for r in requests}
            if len(layers) <= 1:
                return self._dispatch(requests)
            rnd = None
            for L in sorted(layers):
                rnd = self._dispatch([r for r in requests if r.layer == L]) or rnd
            return rnd
        finally:
            self._avoid = frozenset()

    def _dispatch(self, requests: Sequence[Request]) -> Optional[Round]:
        live = []
        t = time.perf_counter()
        cpu0 = time.thread_time()
        route_s = 0.0
        for req in requests:
            req.attempts += 1
            if req.routing is None:
                if not self._route(req):
                    continue
            if not self._hosted(req):
                continue
            live.append(req)
        route_s = time.perf_counter() - t
        if not live:
            return None
        rnd = Round(self._ids(), live, time.monotonic() + self.timeout, live[0].layer, self.sums)
        for other in self.rounds.values():
            other.alone = rnd.alone = False
        rnd.stats.route_s = route_s
        now = time.perf_counter()
        for req in live:
            req.round = rnd
            st = rnd.stats
            st.queue_s = max(st.queue_s, now - req.arrived) if req.attempts == 1 else st.queue_s
            st.tokens += req.num_tokens
            st.dropped += req.routing.dropped
            st.overflow += req.routing.overflow
            st.retried += req.attempts > 1
        t = time.perf_counter()
        self._plan(rnd)
        self.rounds[rnd.id] = rnd
        self._send(rnd)
        start_sums(rnd, self.d_model, self.sums)
        rnd.stats.dispatch_s = time.perf_counter() - t
        rnd.stats.own_cpu_s += time.thread_time() - cpu0
        rnd.sent_at = time.perf_counter()
        if self.chunk_rows == "auto" and self.costs.chunk_mode.may_chunk(rnd.alone):
            self.costs.prepare_next(rnd)  # the next round's chunk sizes, while the workers compute
        self._check_settled(rnd)
        return rnd

    def route_early(self, req: Request) -> Optional[frozenset]:
        """Route ``req`` now, before it is batched (expert-aware batching needs its experts);
        the experts it needs, or None when it was refused (it is finished with its error;
        see :meth:`take_finished`). Dispatch does not route it again."""
        if not self._route(req):
            return None
        # (layer, expert): requests of two layers never share an expert
        return frozenset((req.layer, e) for e in np.flatnonzero(req.routing.expert_counts).tolist())

    def _route(self, req: Request) -> bool:
        err = self.planner.route(req)
        return True if err is None else self._fail(req, err)

    def hosts(self, expert: int, avoid: frozenset = frozenset(), layer: int = P.DEFAULT_LAYER) -> list[int]:
        return self.planner.hosts(expert, avoid or self._avoid, layer)

    def _hosted(self, req: Request) -> bool:
        err = self.planner.unserved(req, self._avoid)
        return True if err is None else self._fail(req, err)

    def _fail(self, req: Request, err: Exception) -> bool:
        req.error = err
        req.waiting = set()
        self._finish(req)
        return False

    def _finish(self, req: Request) -> None:
        if not req.finished:
            req.finished = True
            self._finished.append(req)

    def _plan(self, rnd: Round) -> None:
        self.planner.plan(rnd, self.chunk_rows, self._avoid)
        for r in rnd.requests:
            if not r.waiting:  # every token dropped by capacity: nothing to wait for
                self._finish(r)

    def _send(self, rnd: Round) -> None:
        """Send every worker its part, chunk by chunk across the workers: each worker's first
        chunk, then each one's second, and so on. Worker by worker, the second worker's first
        chunk would wait for the first worker's whole part to be gathered and sent, time it
        could compute nothing (see docs/performance.md#constants-chosen-by-measurement); its later chunks land while it computes."""
        for w_index, rows in rnd.rows.items():
            w = self.workers[w_index]
            n = len(rnd.bounds[w_index]) - 1
            rnd.outstanding.add(w_index)
            rnd.nchunks[w_index] = rnd.left[w_index] = n
            rnd.left_rows[w_index], rnd.sent[w_index] = rows, 0
            rnd.replies[w_index] = [None] * n
            w.outstanding_rows += rows
        order = [(w_index, c) for c in range(max(rnd.nchunks.values(), default=0))
                 for w_index, n in rnd.nchunks.items() if c < n]
        for i, (w_index, c) in enumerate(order):
            if w_index not in rnd.outstanding:  # its part failed
                continue
            w = self.workers[w_index]
            queue = self._backlog.get(w_index)
            if queue:  # behind what waits already: messages to a worker keep their order
                queue.append((rnd, c))
                continue
            why = self._send_chunk(rnd, w, c)
            if why is _LATER:
                self._backlog.setdefault(w_index, deque()).append((rnd, c))
            elif why is not None:
                self._part_failed(rnd, w_index, why)
            elif i + 1 < len(order) and w.conn is not None:
                w.conn.yield_to_peer()  # it reads this chunk while we gather the next
        rnd.stats.rows = sum(rnd.rows.values())
        rnd.stats.workers = len(rnd.rows)

    def _may_wait(self, w_index: int) -> bool:
        """Whether a chunk that ``w_index``'s connection cannot take now may wait: only while
        messages of ours are unanswered there (their replies bring the credits back); a
        connection that is not ready with nothing of ours in flight is a failing worker."""
        return any(w_index in r.outstanding and r.sent[w_index] > r.nchunks[w_index] - r.left[w_index]
                   for r in self.rounds.values())

    def _send_chunk(self, rnd: Round, w: WorkerLink, c: int):
        """Gather and send chunk ``c`` of worker ``w``'s part: None when sent, _LATER when its
        connection cannot take it yet but may (see _may_wait), else why it failed."""
        conn = w.conn
        if conn is None or not w.usable:
            return f"worker {w.describe()} is not usable"
        if not conn.send_ready():
            if self._may_wait(w.index):
                return _LATER
            self.workers.mark_unhealthy(w, "its connection takes no more messages (it holds every credit)")
            return f"worker {w.url} takes no more messages"
        lo, hi = rnd.chunk_bounds(w.index, c)
        rows = hi - lo
        try:
            slot = conn.alloc(rows * self.row_bytes, timeout=0)
        except TransportError as e:
            if self._may_wait(w.index):
                return _LATER
            self.workers.mark_unhealthy(w, f"no send slot: {e}")
            return f"worker {w.url}: no send slot ({e})"
        t0 = time.perf_counter()
        block = slot.array(self.dtype, (rows, self.d_model))
        try:
            for r in rnd.requests:
                base = r.bases.get(w.index)
                if base is None:
                    continue
                a, b = max(base, lo), min(base + r.plan.worker_tokens(w.index), hi)
                if a >= b:
                    continue
                if r.round is rnd and r.x is not None:
                    r.plan.gather_into(r.x, w.index, block[a - lo:b - lo], rows=(a - base, b - base))
                else:  # it left the round (failed, or retried elsewhere) while this chunk waited,
                    # and may be released: nobody reads these rows' outputs
                    block[a - lo:b - lo] = 0
        except BaseException:
            slot.release()
            raise
        t1 = time.perf_counter()
        whole = rows == rnd.rows[w.index]
        groups = rnd.groups[w.index] if whole else chunk_groups(rnd.groups[w.index], lo, hi)
        mid = rnd.id if c == 0 else self._ids()
        header = P.forward_request(mid, (rows, self.d_model), self.dtype, groups, layer=rnd.layer)
        if not self.workers.send(w, header, [slot], ready=True):
            return f"worker {w.describe()} did not take round {rnd.id}"
        self._msgs[(w.index, mid)] = (rnd, c)
        self.clock.sent(w.index, mid, rows, time.monotonic())
        rnd.msg_ids.append((w.index, mid))
        rnd.sent[w.index] += 1
        if not whole:
            rnd.sent_t[(w.index, c)] = time.perf_counter()
            if c:
                rnd.gather_t[(w.index, c)] = t0
        st = rnd.stats
        st.messages += 1
        st.gather_s += t1 - t0
        self.costs.sent(w, t0, t1, rows)
        w.rows_sent += rows
        w.batches_sent += 1
        for g in groups:
            key = (rnd.layer, g[0])
            w.expert_rows[key] = w.expert_rows.get(key, 0) + g[2]
        return None

    def pump(self) -> bool:
        """Send what waits in the backlogs as connections take it; whether any still waits
        (the owner then calls again soon: shm credits come back without a wake-up)."""
        waiting = False
        for w_index, queue in list(self._backlog.items()):
            w = self.workers[w_index]
            while queue:
                rnd, c = queue[0]
                if rnd.id not in self.rounds or w_index not in rnd.outstanding:
                    queue.popleft()  # its part failed meanwhile
                    continue
                why = self._send_chunk(rnd, w, c)
                if why is _LATER:
                    break
                queue.popleft()
                if why is not None:
                    self._part_failed(rnd, w_index, why)
            if queue:
                waiting = True
            else:
                self._backlog.pop(w_index, None)
        return waiting

    # -- replies and failures ------------------------------------------------------------------
    def on_reply(self, w: WorkerLink, msg) -> None:
        """A result or error from worker ``w`` (for one of our rounds, or a late one)."""
        h = msg.header
        rid = P.request_id_of(h)
        self.clock.replied(w.index, rid, time.monotonic())
        sent = self._msgs.get((w.index, rid))
        if sent is None or w.index not in sent[0].outstanding or (w.index, sent[1]) in sent[0].answered:
            msg.release()  # a late reply to a part that already failed (or not ours, or twice)
            return
        rnd, c = sent
        rnd.answered.add((w.index, c))
        lo, hi = rnd.chunk_bounds(w.index, c)
        rows = hi - lo
        self._answered(rnd, w, rows)
        if h.get("op") == P.ERROR:
            msg.release()
            err = P.RemoteError(str(h.get("code")), str(h.get("message")), w.url)
            w.failures += 1
            self._part_failed(rnd, w.index, f"worker {w.url} failed round {rnd.id}: {err}")
            return
        if h.get("shape") != [rows, self.d_model] or h.get("dtype") != P.dtype_name(self.dtype) \
                or len(msg.buffers) != 1 or msg.buffers[0].nbytes != rows * self.row_bytes:
            msg.release()
            self.workers.lost(w, f"malformed reply {str(h)[:200]}")
            self._part_failed(rnd, w.index, f"worker {w.url} sent a malformed reply")
            return
        cs = float(h.get("compute_s", 0.0))
        w.compute_seconds += cs
        w.record_compute(cs, rows)
        w.cpu_s = float(h.get("cpu_s", w.cpu_s))
        faults = w.faults_since(h.get("flt"))
        rnd.worker_faults += faults
        warm, busy = self.costs.replied(rnd, w, c, h, rows, cs, faults)
        st = rnd.stats
        rnd.compute[w.index] = rnd.compute.get(w.index, 0.0) + cs
        rnd.busy[w.index] = rnd.busy.get(w.index, 0.0) + busy
        st.compute_s = max(st.compute_s, rnd.compute[w.index])
        st.busiest_s = max(st.busiest_s, rnd.busy[w.index])
        st.compute_total_s += cs
        key = (w.index, c)
        users = [r for r in rnd.requests if key in r.waiting and r.round is rnd]
        if not users or w.index not in rnd.replies:
            msg.release()  # every request that needed it has gone (retried or failed)
        elif rnd.chunked:  # added where it landed, then given back: the worker's credit returns
            add_chunk(rnd, w.index, lo, hi, users, msg.array(0, self.dtype, (rows, self.d_model)))
            msg.release()
            if warm:
                self.costs.landed(rnd, w, c, h, rows, time.perf_counter())
        else:
            rnd.replies[w.index][c] = (msg, msg.array(0, self.dtype, (rows, self.d_model)))
        for r in users:
            r.waiting.discard(key)
            if not r.waiting:
                self._finish(r)
        if not rnd.left[w.index]:
            rnd.outstanding.discard(w.index)
        self._check_settled(rnd)
        if self._backlog.get(w.index):
            self.pump()  # its reply returned a credit

    @staticmethod
    def _answered(rnd: Round, w: WorkerLink, rows: int) -> None:
        rnd.left[w.index] -= 1
        rnd.left_rows[w.index] -= rows
        w.outstanding_rows -= rows

    def _drop_part(self, rnd: Round, w: WorkerLink) -> None:
        """Worker ``w``'s part of ``rnd`` will not be answered: its rows stop counting as load."""
        rnd.outstanding.discard(w.index)
        self.clock.forget(w.index, [m for wi, m in rnd.msg_ids if wi == w.index])
        w.outstanding_rows -= rnd.left_rows[w.index]
        rnd.left_rows[w.index] = 0

    def on_worker_down(self, w: WorkerLink, why: str) -> None:
        """Worker ``w``'s connection went: every part it had fails now."""
        self._backlog.pop(w.index, None)
        for rnd in list(self.rounds.values()):
            if w.index in rnd.outstanding:
                self._part_failed(rnd, w.index, f"worker {w.url} lost: {why}")

    def expire(self, now: float) -> None:
        """Parts past their round's deadline fail; their workers become unhealthy."""
        for rnd in list(self.rounds.values()):
            if rnd.deadline > now or not rnd.outstanding:
                continue
            for wi in list(rnd.outstanding):
                w = self.workers[wi]
                self.workers.mark_unhealthy(w, f"no reply to round {rnd.id} within {self.timeout:.1f} s")
                self._part_failed(rnd, wi, f"round {rnd.id}: no reply from {w.url} within {self.timeout:.1f} s")

    def _part_failed(self, rnd: Round, w_index: int, why: str) -> None:
        """Worker ``w_index`` will not answer its part of ``rnd``: retry or fail the
        requests that needed it (the others are untouched)."""
        if w_index in rnd.outstanding:
            self._drop_part(rnd, self.workers[w_index])
        retry = []
        for r in rnd.requests:
            if r.round is not rnd or not _needs(r, w_index):
                continue
            r.round = None
            rnd.detach(r)
            r.waiting = set()
            avoid = frozenset({w_index})
            if r.attempts < MAX_ATTEMPTS and self._can_retry(r, avoid):
                retry.append(r)
            else:
                hosted = self._can_retry(r, avoid)
                self._fail(r, (WorkerError if hosted else NoHealthyWorker)(why))
        self._check_settled(rnd)
        if retry:
            self.retried += len(retry)
            log.info("retrying %d request(s) of round %d without %s", len(retry), rnd.id,
                     self.workers[w_index].url)
            self.dispatch(retry, avoid=frozenset({w_index}))

    def _can_retry(self, r: Request, avoid: frozenset) -> bool:
        return all(self.hosts(int(e), avoid, r.layer) for e in np.flatnonzero(r.routing.expert_counts))

    def _check_settled(self, rnd: Round) -> None:
        if rnd.id in self.rounds and not rnd.outstanding and not any(
                r.round is rnd and r.waiting for r in rnd.requests):
            now = time.perf_counter()
            rnd.stats.wait_s = now - rnd.sent_at
            rnd.stats.total_s = now - rnd._t0
            del self.rounds[rnd.id]
            self.costs.settled(rnd, timed=rnd.alone and bool(rnd.rows)
                               and not any(r.error is not None for r in rnd.requests))
            for key in rnd.msg_ids:  # a late reply to one of them is now unknown: released
                self._msgs.pop(key, None)
                self.clock.forget(key[0], (key[1],))
            self._settled.append(rnd)

    # -- what the owner takes --------------------------------------------------------------------
    def take_finished(self) -> list[Request]:
        """Requests that completed (or failed) since the last call, in completion order."""
        done, self._finished = self._finished, []
        return done

    def take_settled(self) -> list[Round]:
        """Rounds whose every part is done since the last call (their stats are final)."""
        done, self._settled = self._settled, []
        return done

    def spin_window(self, now: float) -> Optional[tuple[float, float]]:
        """When to busy-poll for a worker's last outstanding reply (ServeLoop.add_spin)."""
        return self.clock.window(now, lambda w: self.workers[w].chunk_costs)

    def in_flight_versions(self) -> list:
        """The expert placement version of every round not settled yet."""
        return [r.placement_version for r in self.rounds.values()]

    def next_deadline(self) -> Optional[float]:
        return min((r.deadline for r in self.rounds.values() if r.outstanding), default=None)

    @property
    def in_flight(self) -> int:
        return sum(1 for r in self.rounds.values() if r.outstanding)

    def pipelined(self, now: Optional[float] = None) -> int:
        """Rounds that count against the batcher's in-flight limit: those with a part still
        missing, except a round older than STALLED_AFTER whose missing parts are all on
        workers that are unusable or silent for that long (stopped, hung). Without this, a
        few requests stuck on a hung worker would hold every other request until the round
        deadline. New rounds always count, so the limit still paces dispatch."""
        now = time.monotonic() if now is None else now
        n = 0
        for r in self.rounds.values():
            if not r.outstanding:
                continue
            if now - r.started < STALLED_AFTER or any(
                    self.workers[w].usable and now - self.workers[w].last_heard < STALLED_AFTER
                    for w in r.outstanding):
                n += 1
        return n

    def has_stalling(self, now: float) -> bool:
        """Whether a round with a missing part is older than STALLED_AFTER (the owner then
        re-checks :meth:`pipelined` soon: it drops without any event to wake the loop)."""
        return any(r.outstanding and now - r.started >= STALLED_AFTER for r in self.rounds.values())

    def close(self) -> None:
        self._backlog.clear()
        for rnd in list(self.rounds.values()):
            for wi in list(rnd.outstanding):
                self._part_failed_final(rnd, wi)
        for rnd in self.rounds.values():
            for wi in list(rnd.replies):
                rnd.release_replies(wi)
        self.rounds = {}
        self._msgs = {}
        self.clock.clear()

    def _part_failed_final(self, rnd: Round, wi: int) -> None:
        self._drop_part(rnd, self.workers[wi])
        for r in rnd.requests:
            if r.round is rnd and _needs(r, wi):
                r.round = None
                rnd.detach(r)
                self._fail(r, WorkerError("the gateway is closing"))


_LATER = object()  # _send_chunk: the connection cannot take it yet, but will


def _needs(req: Request, w_index: int) -> bool:
    """Whether ``req`` still waits for a chunk of worker ``w_index``."""
    return any(k[0] == w_index for k in req.waiting)


def _counter():
    n = 0

    def nxt() -> int:
        nonlocal n
        n += 1
        return n
    return nxt
