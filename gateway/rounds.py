"""Dispatch rounds: the one owner of round book-keeping.

A *round* carries one or more requests (token batches). Each request is routed on its own
(its output never depends on what it was batched with: capacity is per request, as in the
reference) and gets its own DispatchPlan; the requests' rows for one worker go back to back
in ONE message to that worker, gathered straight from where each request's tokens are (a
client's landed buffer) into the worker's send slot, and every request is combined straight
from the workers' replies where they landed.

Failure is per worker, not per round, and completion is per request: a request is finished
as soon as every worker it has rows on replied, whatever the others do. When a worker fails
its part (its connection goes, it misses the round's deadline, it replies an error, or it
cannot take the message), each request that needed it is retried once in a new round on
the other workers if every expert it needs there has another healthy host (a forward is
idempotent), and otherwise fails at once with ``unavailable``. A late reply of a failed part
is discarded. So a hung worker delays only the requests that need it.

Chunks: a worker's part may go as several messages of consecutive rows (gateway/chunking.py
chooses the size), so the worker computes the first while the next is gathered and in
flight. In such a round every reply is added into its requests' sums as it lands and given
back at once (a round holding its replies until the last one would hold the worker's
credits, and with more chunks than credits never get the last one); a request is finished
when the chunks holding its rows are in, so the requests whose rows came back first are
answered while the workers compute the rest. A chunk the connection cannot take yet waits
in a per-worker backlog, sent as credits come back; failure stays per part (any chunk
failing fails the worker's part).

Layers: a gateway serving a checkpoint has one router per MoE layer, and each request names
its layer. A round carries requests of one layer (the worker message names one), so a batch
of requests of several layers goes out as one round per layer, all sent before any wait.
"""
from __future__ import annotations

import logging
import resource
import time
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from gateway.chunking import ChunkMode, ChunkSetting, ColdFilter, chunk_groups, parse_chunk_rows, split_part
from gateway.dispatch import ChunkSum, DispatchPlan, SumBuffers, split_over_replicas
from gateway.reply_clock import ReplyClock
from gateway.replicas import BALANCING, choose_least_loaded, choose_replicas
from gateway.router import Routing
from gateway.served import ServedSet
from gateway.workers import WorkerLink, WorkerSet
from transport import TransportError
from workers import protocol as P

log = logging.getLogger("moe.rounds")

MAX_ATTEMPTS = 2  # a request is tried at most this often (the first round and one retry)
#: a round older than this whose every missing part is on a worker silent for as long (or not
#: usable) no longer holds up the next round: a hung worker must not delay requests that do
#: not need it (its parts still fail at the round's deadline)
STALLED_AFTER = 0.5


class WorkerError(RuntimeError):
    """A request failed because of a worker (closed, timed out, error reply, bad reply)."""

    code = P.WORKER_FAILED


class NoHealthyWorker(WorkerError):
    """No healthy worker hosts an expert the request needs."""

    code = P.UNAVAILABLE


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
    retried: int = 0
    queue_s: float = 0.0  # the longest a request of this round waited to be dispatched
    route_s: float = 0.0
    dispatch_s: float = 0.0
    gather_s: float = 0.0  # the part of dispatch_s that copies tokens into the send slots
    compute_s: float = 0.0
    compute_total_s: float = 0.0
    wait_s: float = 0.0
    combine_s: float = 0.0
    total_s: float = 0.0
    messages: int = 0  # messages sent (more than ``workers`` when parts went in chunks)
    busiest_s: float = 0.0  # the busiest worker's time handling this round's messages (its
    # own receive-to-reply clocks), so total_s - busiest_s is its time with no token to compute

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Request:
    """One token batch inside the gateway, across its attempts."""

    __slots__ = ("x", "tag", "layer", "routing", "plan", "pins", "error", "attempts", "round", "bases", "waiting",
                 "finished", "arrived", "acc", "out", "used", "served")

    def __init__(self, x: np.ndarray, tag: Any = None, layer: int = P.DEFAULT_LAYER,
                 out: Optional[np.ndarray] = None):
        self.x: Optional[np.ndarray] = x
        self.tag = tag  # the caller's (the server keeps the client connection and message there)
        self.layer = layer
        self.routing: Optional[Routing] = None
        self.plan: Optional[DispatchPlan] = None
        self.pins: dict = {}  # expert -> the weights version a hot update decided for this request
        self.used: dict = {}  # expert -> the version every group of its rows was pinned to (the answer's)
        self.served: Optional[int] = None  # the served set's generation when it was routed
        self.error: Optional[Exception] = None
        self.attempts = 0
        self.round: Optional["Round"] = None
        self.bases: dict = {}  # worker -> first row of this request in the worker's block
        self.waiting: set = set()  # workers whose reply this request still needs
        self.finished = False
        self.arrived = time.perf_counter()
        self.acc: Optional[ChunkSum] = None  # float32 sum of a chunked round's replies so far
        # where the caller wants the output, if known when it is dispatched: a float32 one is
        # a chunked round's sum itself, so nothing is copied once the last chunk is in
        self.out = out

    @property
    def num_tokens(self) -> int:
        return 0 if self.x is None else int(self.x.shape[0])

    def versions(self) -> list:
        """[[expert, version], ...] pinned for this request (during a hot update)."""
        return [[e, v] for e, v in sorted(self.pins.items())]

    def expert_versions(self) -> list:
        """[[expert, version], ...] of every expert that computed rows of this request."""
        return [[e, v] for e, v in sorted(self.used.items())]

    def combine(self, out: np.ndarray) -> np.ndarray:
        """The weighted combine of this request's expert outputs into ``out`` (T, d), from
        the replies where they landed."""
        if self.error is not None:
            raise self.error
        rnd = self.round
        t = time.perf_counter()
        if self.acc is not None:  # a chunked round: summed as the chunks landed
            self.plan.finish(self.acc, out)
            self.drop_sum()
            rnd.stats.combine_s += time.perf_counter() - t
            rnd.combined()
            return out
        outputs = []
        for w in range(self.plan.n_workers):
            n = self.plan.worker_tokens(w)
            if n == 0:
                outputs.append(None)
            else:
                base = self.bases[w]
                outputs.append(rnd.replies[w][0][1][base:base + n])
        self.plan.combine(outputs, out, sums=rnd.sums)
        rnd.stats.combine_s += time.perf_counter() - t
        rnd.combined()
        return out

    def drop_sum(self) -> None:
        """Its chunked sum is done with (combined, or its round given up)."""
        acc, self.acc = self.acc, None
        if acc is not None:
            acc.release()

    def release(self) -> None:
        """Done with this request's outputs: its share of the replies goes back."""
        rnd, self.round = self.round, None
        if rnd is not None:
            rnd.detach(self)
        self.drop_sum()
        self.x = self.out = None


class Round:
    def __init__(self, rid: int, requests: list, deadline: float, layer: int = P.DEFAULT_LAYER,
                 sums: Optional[SumBuffers] = None):
        self.id = rid
        self.sums = sums  # where its requests' float32 sums are taken from
        self.layer = layer
        self.requests = requests
        self.deadline = deadline
        self.rows: dict = {}  # worker -> rows of its part
        self.bounds: dict = {}  # worker -> its part's chunk offsets [0, ..., rows] ([0, rows]: one message)
        self.groups: dict = {}  # worker -> its part's groups (expert, start, count[, version])
        self.replies: dict = {}  # worker -> per chunk: (Message, (rows, d) view), or None
        self.nchunks: dict = {}  # worker -> messages its part goes in
        self.left: dict = {}  # worker -> chunks not answered yet
        self.left_rows: dict = {}  # worker -> rows not answered yet (they count as its load)
        self.sent: dict = {}  # worker -> chunks sent
        self.last_reply: dict = {}  # worker -> (its reply clock t_out, our receive time) of its last chunk
        self.sent_t: dict = {}  # (worker, chunk) -> when we sent it (chunked parts only)
        self.gather_t: dict = {}  # (worker, chunk) -> when we began its gather (chunks after the first)
        self.answered: set = set()  # (worker, chunk) answered
        self.busy: dict = {}  # worker -> its seconds handling our messages (receive to reply)
        self.compute: dict = {}  # worker -> its compute seconds
        self.msg_ids: list = []  # (worker, message id) of its chunks (the book maps them back)
        self.outstanding: set = set()  # workers whose part has not been answered (nor failed)
        self.alone = True  # no other round was out during its life (its idle times are its own)
        self.eligible = False  # auto, and the size model would chunk it (ChunkMode measures these)
        self.users: dict = {}  # worker -> requests of this round still using its reply
        # a round timed for the chunk choice: called with its seconds from its plan to its
        # last request's combine, once that is done (to_combine: requests still to combine)
        self.on_combined: Optional[Callable[["Round", float], None]] = None
        self.to_combine = 0
        self.stats = BatchStats(requests=len(requests))
        self.worker_faults = 0  # minor page faults its workers' replies said they took
        self._faults0 = minor_faults()
        self._t0 = time.perf_counter()
        self.sent_at = self._t0
        self.started = time.monotonic()

    def combined(self) -> None:
        """One of its requests was combined: the last one ends a timed round's clock."""
        if self.on_combined is not None:
            self.to_combine -= 1
            if self.to_combine <= 0:
                done, self.on_combined = self.on_combined, None
                done(self, time.perf_counter() - self._t0)

    @property
    def faults(self) -> int:
        """Minor page faults taken while it was out, here and (as their replies said) on its
        workers: a round that wrote fresh memory (a new slot's pages, a first large batch)
        pays for it, once, in its time."""
        return minor_faults() - self._faults0 + self.worker_faults

    def detach(self, req: Request) -> None:
        for w in req.bases:
            n = self.users.get(w, 0) - 1
            self.users[w] = n
            if n <= 0 and w in self.replies:
                self.release_replies(w)

    def release_replies(self, w: int) -> None:
        for got in self.replies.pop(w, ()):
            if got is not None:
                got[0].release()

    @property
    def chunked(self) -> bool:
        return any(len(b) > 2 for b in self.bounds.values())

    def chunks_of(self, req: Request, w: int) -> range:
        """The chunks of worker ``w``'s part that hold ``req``'s rows."""
        base, b = req.bases[w], self.bounds[w]
        return range(bisect_right(b, base) - 1, bisect_left(b, base + req.plan.worker_tokens(w)))

    def chunk_bounds(self, w: int, c: int) -> tuple[int, int]:
        b = self.bounds[w]
        return b[c], b[c + 1]

    @property
    def settled(self) -> bool:
        """Every part answered or failed, and no request uses a reply any more."""
        return not self.outstanding and not self.replies


def n_ids(router) -> int:
    """Expert ids a router routes to: a FamilyRouter's shared pieces included."""
    return int(getattr(router, "n_ids", router.n_experts))


def slots_per_token(router) -> int:
    """Rows one token may occupy: top-k, plus a FamilyRouter's shared pieces."""
    return int(router.top_k + getattr(router, "n_shared", 0))


class RoundBook:
    """Sends rounds to the workers of ``workers`` and follows them to every request's end.

    ``router``: one router (layer 0), or {layer: router}. ``decide_pins(layer)``: the weights
    versions a new request of that layer is served by (hot update); ``pinned_router(layer,
    pins)``: the router those pins route with, None for the layer's own. ``chunk_rows``:
    "auto" (sized from what each worker's replies measured), 0 (a part is one message) or
    at most that many rows per message (cut between expert groups: chunking.part_bounds)."""

    def __init__(self, workers: WorkerSet, router, *, dtype: np.dtype, max_batch_tokens: int, timeout: float,
                 split_replicas: bool = True, min_split: int = 16,
                 decide_pins: Optional[Callable[[int], dict]] = None,
                 next_id: Optional[Callable[[], int]] = None, balancing: str = "load-aware",
                 pinned_router: Optional[Callable[[int, dict], Any]] = None,
                 chunk_rows: ChunkSetting = "auto", served: Optional[ServedSet] = None) -> None:
        if balancing not in BALANCING:
            raise ValueError(f"balancing must be one of {BALANCING}, got {balancing!r}")
        self.balancing = balancing
        self.workers = workers
        # a dict is kept as it is: the pool shares it with its Rollout (a finished update
        # installs a new router there)
        self.routers = router if isinstance(router, dict) else (
            dict(router) if isinstance(router, Mapping) else {P.DEFAULT_LAYER: router})
        self.router = next(iter(self.routers.values()))  # the first (or only) layer's
        self.dtype = np.dtype(dtype)
        self.d_model = self.router.d_model
        self.n_experts = n_ids(self.router)
        self.n_ids = {L: n_ids(r) for L, r in self.routers.items()}
        self.pinned_router = pinned_router or (lambda layer, pins: None)
        self.max_batch_tokens = max_batch_tokens
        self.row_bytes = self.d_model * self.dtype.itemsize
        self.timeout = timeout
        self.split_replicas, self.min_split = split_replicas, min_split
        self.decide_pins = decide_pins or (lambda layer: {})
        # what the gateway serves: every group is pinned to its expert's served version (or
        # the update's pin), so a worker computes it with exactly that version or refuses
        self.served = served
        self._ids = next_id or _counter()
        self.rounds: dict[int, Round] = {}
        self.sums = SumBuffers()  # float32 sums of narrow outputs, reused (fresh pages fault)
        self._finished: list[Request] = []
        self._settled: list[Round] = []  # rounds whose every part is done (for metrics)
        self._avoid: frozenset = frozenset()  # workers a retry round must not use
        self.retried = 0
        self.chunk_rows = parse_chunk_rows(chunk_rows)
        self.chunk_mode = ChunkMode()  # auto: chunks at all, from measured round costs
        # settled rounds' page faults: a round that wrote fresh memory here slows the compute
        # of its workers beside it, and their rates in it are left out (see _reply)
        self.round_faults = ColdFilter()
        self._msgs: dict[tuple, tuple] = {}  # (worker, message id) -> (round, chunk)
        self._backlog: dict[int, deque] = {}  # worker -> (round, chunk) its connection could not take yet
        self.clock = ReplyClock()  # when each worker's last message is due back (the loop spins for it)

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
        self._sums(rnd)
        rnd.stats.dispatch_s = time.perf_counter() - t
        rnd.sent_at = time.perf_counter()
        if self.chunk_rows == "auto":  # the next round's chunk sizes, while the workers compute
            for w, rows in rnd.rows.items():
                link = self.workers[w]
                link.chunk_sizer.prepare(rows, "auto", link.chunk_costs, rnd.groups[w])
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
        x = req.x
        router = self.routers.get(req.layer)
        if router is None:
            return self._fail(req, ValueError(f"layer {req.layer} is not served here (layers: "
                                              f"{sorted(self.routers)})"))
        if x.ndim != 2 or x.shape[1] != self.d_model or x.dtype != self.dtype:
            return self._fail(req, ValueError(f"batch must be (T, {self.d_model}) {P.dtype_name(self.dtype)}, "
                                              f"got {x.shape} {P.dtype_name(x.dtype)}"))
        if x.shape[0] > self.max_batch_tokens:
            return self._fail(req, ValueError(f"batch of {x.shape[0]} tokens exceeds max_batch_tokens "
                                              f"{self.max_batch_tokens}"))
        # pins first: a hot update that brings its own router routes the requests it serves
        req.pins = self.decide_pins(req.layer)
        req.served = self.served.generation if self.served is not None else None
        router = self.pinned_router(req.layer, req.pins) or router
        try:
            req.routing = router.route(x)
        except ValueError as e:
            return self._fail(req, e)
        return True

    def hosts(self, expert: int, avoid: frozenset = frozenset(), layer: int = P.DEFAULT_LAYER) -> list[int]:
        avoid = avoid or self._avoid
        return [w.index for w in self.workers if w.usable and w.hosts(expert, layer) and w.index not in avoid]

    def _hosted(self, req: Request) -> bool:
        needed = np.flatnonzero(req.routing.expert_counts)
        L = req.layer
        if self.served is not None and self.served.blocked:
            why = [self.served.why_blocked((L, int(e))) for e in needed]
            why = [w for w in why if w is not None]
            if why:
                return self._fail(req, NoHealthyWorker("not served: " + "; ".join(why)))
        lost = [int(e) for e in needed if not self.hosts(int(e), layer=L)]
        if not lost:
            return True
        of = f" of layer {L}" if len(self.routers) > 1 or L != P.DEFAULT_LAYER else ""
        why = "; ".join(f"expert {e}{of} on " + (", ".join(w.describe() for w in self.workers if w.hosts(e, L))
                                                 or "no worker") for e in lost)
        return self._fail(req, NoHealthyWorker(f"no healthy worker for {why}"))

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
        reqs = rnd.requests
        idx = np.concatenate([r.routing.topk_idx for r in reqs]) if len(reqs) > 1 else reqs[0].routing.topk_idx
        n_experts = self.n_ids[rnd.layer]
        counts = np.bincount(idx[idx >= 0].ravel(), minlength=n_experts)
        load = np.array([w.outstanding_rows for w in self.workers], dtype=np.float64)
        hosts = {e: self.hosts(e, layer=rnd.layer) for e in range(n_experts) if counts[e]}
        if self.balancing == "least-loaded":
            cost = np.array([w.seconds_per_row for w in self.workers], dtype=np.float64)
            replicas, shares = choose_least_loaded(counts, hosts, load, cost)
        else:
            replicas, shares = choose_replicas(counts, hosts, load, split=self.split_replicas,
                                               min_split=self.min_split)
        # one assignment over the round, so a replicated expert is balanced across requests
        if all(len(ws) == 1 for ws in replicas.values()):  # no split: a table lookup is enough
            table = np.full(n_experts + 1, -1, dtype=np.int64)  # table[-1]: a dropped slot's -1
            for e, ws in replicas.items():
                table[e] = ws[0]
            assign = table[idx]
        else:
            assign = split_over_replicas(idx, replicas, shares)
        at = 0
        n_workers = len(self.workers)
        for r in reqs:
            T = r.routing.num_tokens
            r.plan = DispatchPlan.from_assignment(r.routing.topk_idx, r.routing.topk_weights,
                                                  assign[at:at + T], n_workers, n_experts=n_experts)
            at += T
            r.bases, r.waiting, r.used = {}, set(), {}
        for w in range(n_workers):
            base = 0
            for r in reqs:
                n = r.plan.worker_tokens(w)
                if n:
                    r.bases[w] = base
                    base += n
            if base:
                rnd.rows[w] = base
                rnd.groups[w] = self._part_groups(rnd, w)
                link = self.workers[w]
                costs = link.chunk_costs
                size, edge = link.chunk_sizer.choose(base, self.chunk_rows, costs, rnd.groups[w])
                rnd.bounds[w] = split_part(rnd.groups[w], base, size, costs.front_growth(base), edge,
                                           costs.back_growth(base))
        # auto: the size model would chunk this round; measured costs say whether to
        rnd.eligible = self.chunk_rows == "auto" and rnd.chunked
        if rnd.eligible and not self.chunk_mode.want_chunks(measurable=rnd.alone):
            rnd.bounds = {w: [0, n] for w, n in rnd.rows.items()}
        for w in rnd.rows:
            users = [r for r in reqs if w in r.bases]
            rnd.users[w] = len(users)
            for r in users:
                r.waiting.update((w, c) for c in rnd.chunks_of(r, w))
        for r in reqs:
            r.drop_sum()  # a chunked round's sums are made once its messages are out (_sums)
            if not r.waiting:  # every token dropped by capacity: nothing to wait for
                self._finish(r)

    def _sums(self, rnd: Round) -> None:
        """A chunked round's sums, made after its messages went (the first reply can only be
        read after this returns): off the path to the first worker's start."""
        if rnd.chunked:
            for r in rnd.requests:
                if r.round is rnd and r.waiting and r.acc is None:
                    r.acc = r.plan.accumulator(self.d_model, into=r.out, sums=self.sums)

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

    def _part_groups(self, rnd: Round, w_index: int) -> list:
        """Worker ``w_index``'s groups of ``rnd``, each pinned to the version it is computed
        with (recorded on its request: the answer says which versions made it)."""
        groups = []
        table = self.served.versions(rnd.layer) if self.served is not None else None
        for r in rnd.requests:
            base = r.bases.get(w_index)
            if base is None:
                continue
            pins, used = r.pins, r.used
            for e, s, c in r.plan.groups(w_index):
                v = pins[e] if e in pins else (table[e] if table is not None else None)
                if v is None:
                    groups.append((e, base + s, c))
                else:
                    groups.append((e, base + s, c, v))
                    used[e] = v
        return groups

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
        t2 = time.perf_counter()
        w.chunk_costs.record_send(t2 - t1, rows)
        w.chunk_costs.record_gather(t2 - t0, rows)
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
        busy = _duration(h, cs)
        warm = not w.chunk_costs.cold_reply(faults)
        if warm:
            # nor a round that has faulted in fresh memory so far: the gateway's faults slow the
            # worker's compute beside them, and a rate measured then prices chunks out (see
            # docs/performance.md#constants-chosen-by-measurement)
            if not self.round_faults.is_cold(rnd.faults):
                w.chunk_costs.record_compute(rows, cs)
            w.chunk_costs.record_serve(busy - cs)
        self._record_gap(rnd, w, c, h, measure=warm)
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
            t = time.perf_counter()
            y = msg.array(0, self.dtype, (rows, self.d_model))
            for r in users:
                base = r.bases[w.index]
                a, b = max(lo, base), min(hi, base + r.plan.worker_tokens(w.index))
                r.plan.accumulate(w.index, a - base, b - base, y[a - lo:b - lo], r.acc)
            msg.release()
            now = time.perf_counter()
            st.combine_s += now - t
            if warm and w.local:  # its clock is ours
                t_out, t_rx, began = h.get("t_out"), h.get("t_rx"), rnd.gather_t.get(key)
                if isinstance(t_out, float):
                    w.chunk_costs.record_out(now - t_out, rows)
                if isinstance(t_rx, float) and began is not None:
                    w.chunk_costs.record_in(t_rx - began, rows)
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
    def _record_gap(rnd: Round, w: WorkerLink, c: int, h: dict, measure: bool = True) -> None:
        """The worker's time from replying to chunk c - 1 to taking chunk c, when chunk c
        was already sent as that reply came (each clock compared only with itself).
        ``measure`` False: only note this reply's clocks, for the next chunk's gap."""
        t_in, t_out = h.get("t_in"), h.get("t_out")
        prev = rnd.last_reply.get(w.index)
        now = time.perf_counter()
        if isinstance(t_out, float):
            rnd.last_reply[w.index] = (t_out, now)
        sent = rnd.sent_t.get((w.index, c))
        if measure and prev is not None and sent is not None and isinstance(t_in, float) and sent < prev[1] \
                and t_in >= prev[0]:
            lo, hi = rnd.chunk_bounds(w.index, c)
            w.chunk_costs.record_gap(t_in - prev[0], hi - lo)

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
            self.round_faults.remember(rnd.faults)
            if rnd.alone and rnd.rows and not any(r.error is not None for r in rnd.requests):
                # timed to its last combine: a part sent whole is combined after its last
                # reply, and that combine is what chunks, summed as they land, hide
                rnd.to_combine = sum(r.round is rnd for r in rnd.requests)
                rnd.on_combined = self._timed
                if not rnd.to_combine:
                    rnd.combined()
            for key in rnd.msg_ids:  # a late reply to one of them is now unknown: released
                self._msgs.pop(key, None)
                self.clock.forget(key[0], (key[1],))
            self._settled.append(rnd)

    def _timed(self, rnd: Round, seconds: float) -> None:
        """A round alone in flight, from its plan to its last combine: each worker's time in
        it with no token to compute (parts sent whole: what chunks could hide), and, for
        rounds the size model would chunk, its time per row, whole or chunked."""
        for wi, busy in rnd.busy.items():
            if len(rnd.bounds[wi]) == 2:
                self.workers[wi].chunk_costs.record_idle(max(0.0, seconds - busy))
        if rnd.eligible:
            self.chunk_mode.record(rnd.chunked, seconds, sum(rnd.rows.values()), rnd.faults)

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


def minor_faults() -> int:
    """This process's minor page faults so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _duration(h: dict, compute_s: float) -> float:
    """The worker's time handling a message, from the receive and reply clocks its reply
    carries (its compute alone from a worker that sends none)."""
    t_in, t_out = h.get("t_in"), h.get("t_out")
    if isinstance(t_in, float) and isinstance(t_out, float) and 0.0 <= t_out - t_in < 3600.0:
        return t_out - t_in
    return compute_s


def _counter():
    n = 0

    def nxt() -> int:
        nonlocal n
        n += 1
        return n
    return nxt
