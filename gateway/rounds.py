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

Layers: a gateway serving a checkpoint has one router per MoE layer, and each request names
its layer. A round carries requests of one layer (the worker message names one), so a batch
of requests of several layers goes out as one round per layer, all sent before any wait.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from gateway.dispatch import DispatchPlan, split_over_replicas
from gateway.replicas import BALANCING, choose_least_loaded, choose_replicas
from gateway.router import Routing
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

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Request:
    """One token batch inside the gateway, across its attempts."""

    __slots__ = ("x", "tag", "layer", "routing", "plan", "pins", "error", "attempts", "round", "bases", "waiting",
                 "finished", "arrived")

    def __init__(self, x: np.ndarray, tag: Any = None, layer: int = P.DEFAULT_LAYER):
        self.x: Optional[np.ndarray] = x
        self.tag = tag  # the caller's (the server keeps the client connection and message there)
        self.layer = layer
        self.routing: Optional[Routing] = None
        self.plan: Optional[DispatchPlan] = None
        self.pins: dict = {}  # expert -> the weights version this request is served by
        self.error: Optional[Exception] = None
        self.attempts = 0
        self.round: Optional["Round"] = None
        self.bases: dict = {}  # worker -> first row of this request in the worker's block
        self.waiting: set = set()  # workers whose reply this request still needs
        self.finished = False
        self.arrived = time.perf_counter()

    @property
    def num_tokens(self) -> int:
        return 0 if self.x is None else int(self.x.shape[0])

    def versions(self) -> list:
        """[[expert, version], ...] pinned for this request (during a hot update)."""
        return [[e, v] for e, v in sorted(self.pins.items())]

    def combine(self, out: np.ndarray) -> np.ndarray:
        """The weighted combine of this request's expert outputs into ``out`` (T, d), from
        the replies where they landed."""
        if self.error is not None:
            raise self.error
        rnd = self.round
        t = time.perf_counter()
        outputs = []
        for w in range(self.plan.n_workers):
            n = self.plan.worker_tokens(w)
            if n == 0:
                outputs.append(None)
            else:
                base = self.bases[w]
                outputs.append(rnd.replies[w][1][base:base + n])
        self.plan.combine(outputs, out)
        rnd.stats.combine_s += time.perf_counter() - t
        return out

    def release(self) -> None:
        """Done with this request's outputs: its share of the replies goes back."""
        rnd, self.round = self.round, None
        if rnd is not None:
            rnd.detach(self)
        self.x = None


class Round:
    def __init__(self, rid: int, requests: list, deadline: float, layer: int = P.DEFAULT_LAYER):
        self.id = rid
        self.layer = layer
        self.requests = requests
        self.deadline = deadline
        self.rows: dict = {}  # worker -> rows sent
        self.replies: dict = {}  # worker -> (Message, (rows, d) view)
        self.outstanding: set = set()  # workers whose reply has not come (nor failed)
        self.users: dict = {}  # worker -> requests of this round still using its reply
        self.stats = BatchStats(requests=len(requests))
        self._t0 = time.perf_counter()
        self.sent_at = self._t0
        self.started = time.monotonic()

    def detach(self, req: Request) -> None:
        for w in req.bases:
            n = self.users.get(w, 0) - 1
            self.users[w] = n
            if n <= 0 and w in self.replies:
                self.replies.pop(w)[0].release()

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
    pins)``: the router those pins route with, None for the layer's own."""

    def __init__(self, workers: WorkerSet, router, *, dtype: np.dtype, max_batch_tokens: int, timeout: float,
                 split_replicas: bool = True, min_split: int = 16,
                 decide_pins: Optional[Callable[[int], dict]] = None,
                 next_id: Optional[Callable[[], int]] = None, balancing: str = "load-aware",
                 pinned_router: Optional[Callable[[int, dict], Any]] = None) -> None:
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
        self._ids = next_id or _counter()
        self.rounds: dict[int, Round] = {}
        self._finished: list[Request] = []
        self._settled: list[Round] = []  # rounds whose every part is done (for metrics)
        self._avoid: frozenset = frozenset()  # workers a retry round must not use
        self.retried = 0

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
        rnd = Round(self._ids(), live, time.monotonic() + self.timeout, live[0].layer)
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
        rnd.stats.dispatch_s = time.perf_counter() - t
        rnd.sent_at = time.perf_counter()
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
            table = np.zeros(n_experts, dtype=np.int64)
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
                                                  assign[at:at + T], n_workers, n_experts=n_experts)
            at += T
            r.bases, r.waiting = {}, set()
        for w in range(n_workers):
            base = 0
            for r in reqs:
                n = r.plan.worker_tokens(w)
                if n:
                    r.bases[w] = base
                    r.waiting.add(w)
                    base += n
            if base:
                rnd.rows[w] = base
                rnd.users[w] = sum(1 for r in reqs if w in r.bases)
        for r in reqs:
            if not r.waiting:  # every token dropped by capacity: nothing to wait for
                self._finish(r)

    def _send(self, rnd: Round) -> None:
        for w_index, rows in list(rnd.rows.items()):
            w = self.workers[w_index]
            rnd.outstanding.add(w_index)
            why = self._send_part(rnd, w, rows)
            if why is not None:
                self._part_failed(rnd, w_index, why)
        rnd.stats.rows = sum(rnd.rows.values())
        rnd.stats.workers = len(rnd.rows)

    def _send_part(self, rnd: Round, w: WorkerLink, rows: int) -> Optional[str]:
        """Gather and send worker ``w``'s block; why it could not, or None."""
        conn = w.conn
        if conn is None or not w.usable:
            return f"worker {w.describe()} is not usable"
        if not conn.send_ready():
            self.workers.mark_unhealthy(w, "its connection takes no more messages (it holds every credit)")
            return f"worker {w.url} takes no more messages"
        try:
            slot = conn.alloc(rows * self.row_bytes, timeout=0)
        except TransportError as e:
            self.workers.mark_unhealthy(w, f"no send slot: {e}")
            return f"worker {w.url}: no send slot ({e})"
        block = slot.array(self.dtype, (rows, self.d_model))
        t = time.perf_counter()
        groups = []
        for r in rnd.requests:
            base = r.bases.get(w.index)
            if base is None:
                continue
            n = r.plan.worker_tokens(w.index)
            r.plan.gather_into(r.x, w.index, block[base:base + n])
            pins = r.pins
            groups.extend((e, base + s, c, pins[e]) if e in pins else (e, base + s, c)
                          for e, s, c in r.plan.groups(w.index))
        rnd.stats.gather_s += time.perf_counter() - t
        header = P.forward_request(rnd.id, (rows, self.d_model), self.dtype, groups, layer=rnd.layer)
        if not self.workers.send(w, header, [slot]):
            return f"worker {w.describe()} did not take round {rnd.id}"
        w.outstanding_rows += rows
        w.rows_sent += rows
        w.batches_sent += 1
        for g in groups:
            key = (rnd.layer, g[0])
            w.expert_rows[key] = w.expert_rows.get(key, 0) + g[2]
        return None

    # -- replies and failures ------------------------------------------------------------------
    def on_reply(self, w: WorkerLink, msg) -> None:
        """A result or error from worker ``w`` (for one of our rounds, or a late one)."""
        h = msg.header
        rid = P.request_id_of(h)
        rnd = self.rounds.get(rid)
        if rnd is None or w.index not in rnd.outstanding:
            msg.release()  # a late reply to a part that already failed
            return
        rnd.outstanding.discard(w.index)
        rows = rnd.rows[w.index]
        w.outstanding_rows -= rows
        if h.get("op") == P.ERROR:
            msg.release()
            err = P.RemoteError(str(h.get("code")), str(h.get("message")), w.url)
            w.failures += 1
            self._part_failed(rnd, w.index, f"worker {w.url} failed round {rid}: {err}")
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
        st = rnd.stats
        st.compute_s = max(st.compute_s, cs)
        st.compute_total_s += cs
        if rnd.users.get(w.index, 0) <= 0:
            msg.release()  # every request that needed it has gone (retried or failed)
        else:
            rnd.replies[w.index] = (msg, msg.array(0, self.dtype, (rows, self.d_model)))
            for r in rnd.requests:
                if w.index in r.waiting and r.round is rnd:
                    r.waiting.discard(w.index)
                    if not r.waiting:
                        self._finish(r)
        self._check_settled(rnd)

    def on_worker_down(self, w: WorkerLink, why: str) -> None:
        """Worker ``w``'s connection went: every part it had fails now."""
        for rnd in list(self.rounds.values()):
            if w.index in rnd.outstanding:
                rnd.outstanding.discard(w.index)
                w.outstanding_rows -= rnd.rows[w.index]
                self._part_failed(rnd, w.index, f"worker {w.url} lost: {why}")

    def expire(self, now: float) -> None:
        """Parts past their round's deadline fail; their workers become unhealthy."""
        for rnd in list(self.rounds.values()):
            if rnd.deadline > now or not rnd.outstanding:
                continue
            for wi in list(rnd.outstanding):
                w = self.workers[wi]
                rnd.outstanding.discard(wi)
                w.outstanding_rows -= rnd.rows[wi]
                self.workers.mark_unhealthy(w, f"no reply to round {rnd.id} within {self.timeout:.1f} s")
                self._part_failed(rnd, wi, f"round {rnd.id}: no reply from {w.url} within {self.timeout:.1f} s")

    def _part_failed(self, rnd: Round, w_index: int, why: str) -> None:
        """Worker ``w_index`` will not answer its part of ``rnd``: retry or fail the
        requests that needed it (the others are untouched)."""
        rnd.outstanding.discard(w_index)
        retry = []
        for r in rnd.requests:
            if r.round is not rnd or w_index not in r.waiting:
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
        for rnd in list(self.rounds.values()):
            for wi in list(rnd.outstanding):
                self._part_failed_final(rnd, wi)
        for rnd in self.rounds.values():
            for msg, _ in rnd.replies.values():
                msg.release()
            rnd.replies = {}
        self.rounds = {}

    def _part_failed_final(self, rnd: Round, wi: int) -> None:
        rnd.outstanding.discard(wi)
        for r in rnd.requests:
            if r.round is rnd and wi in r.waiting:
                r.round = None
                rnd.detach(r)
                self._fail(r, WorkerError("the gateway is closing"))


def _counter():
    n = 0

    def nxt() -> int:
        nonlocal n
        n += 1
        return n
    return nxt
