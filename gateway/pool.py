"""WorkerPool: the distributed MoE layer over expert workers, on one serve loop.

It composes the pieces, each the one owner of its concern: the workers' connections and
health (gateway/workers.py), rounds (gateway/rounds.py), and hot update
(gateway/rollout.py). It runs on a :class:`transport.service.loop.ServeLoop`: the gateway
server passes its own (one loop, one thread for clients and workers), and used alone (the
benchmarks, tests) the pool makes one, and :meth:`forward` is a thin synchronous driver over
the same round code.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from gateway.admission import Admission
from gateway.chunking import ChunkSetting, parse_chunk_rows
from gateway.combine import combine_request
from gateway.control import ControlChannel
from gateway.expert_placement import ExpertPlacement, PlacementError
from gateway.live_placement import LivePlacement
from gateway.load_window import LoadWindow
from gateway.rebalancer import MAX_MOVES, Rebalancer
from gateway.rollout import ACK_TIMEOUT, Rollout
from gateway.requests import BatchStats, Request, WorkerError, n_ids, slots_per_token
from gateway.rounds import RoundBook
from gateway.router import Router
from gateway.served import ServedSet
from gateway.worker_link import LayerShape, WorkerLink
from gateway.workers import WorkerSet
from transport.service import secrets
from transport.service.loop import ServeLoop
from workers import protocol as P

log = logging.getLogger("moe.pool")

BACKLOG_RETRY = 0.001  # how soon chunks waiting for a connection are tried again
WorkerState = WorkerLink  # the name earlier callers (metrics, tests) use


class WorkerPool:
    """Connections to expert workers and the MoE forward across them.

    ``urls``: the workers' transport URLs. ``router``: the gate (its n_experts must all be
    hosted), or {layer: router} for a model's MoE layers (gateway/layer.py's FamilyRouters;
    shared-expert pieces are ids like the routed ones). ``fingerprints``: {layer: the
    checkpoint layer's fingerprint} every worker must report for the layers it serves (None:
    demo weights). ``max_batch_tokens``: the largest batch one round carries (sizes the
    slots: a worker may get up to max_batch_tokens * (top_k + shared pieces) rows). ``timeout``: a worker's part of a
    round fails after it. ``connect_timeout``: how long the first connection to each worker
    is retried. ``secret``: the workers' shared secret (default FIND: as the services find
    it, $MOE_SECRET_FILE or the per-user default file; None: no secret). ``chunk_rows``: how
    a worker's part of a round is cut into messages ("auto", 0 for one message, or rows per
    message; gateway/chunking.py). ``reply_spin``: busy-poll for a worker's last
    outstanding reply around when it is due, where that is soon (up to 1 ms of compute) and
    the gateway has a processor no local worker needs (gateway/reply_clock.py).
    """

    def __init__(self, urls: Sequence[str], router: Router, *, dtype: Any = np.float32,
                 max_batch_tokens: int = 1024, timeout: float = 10.0, connect_timeout: float = 10.0,
                 nslots: int = 8, split_replicas: bool = True, min_split: int = 16,
                 secret: Any = secrets.FIND, loop: Optional[ServeLoop] = None,
                 balancing: str = "load-aware", ack_timeout: float = ACK_TIMEOUT,
                 fingerprints: Optional[Mapping[int, Optional[str]]] = None,
                 chunk_rows: ChunkSetting = "auto", reply_spin: bool = True, max_moves: int = MAX_MOVES,
                 load_window: float = 60.0, eplb: bool = False, redundant_experts: int = 0,
                 eplb_interval: float = 60.0) -> None:
        secret = secrets.for_client(secret)
        self.routers = dict(router) if isinstance(router, Mapping) else {P.DEFAULT_LAYER: router}
        if not self.routers:
            raise ValueError("a pool needs at least one layer's router")
        router = self.router = next(iter(self.routers.values()))  # the first (or only) layer's
        if any(r.d_model != router.d_model for r in self.routers.values()):
            raise ValueError("every layer of a model has one d_model")
        self.dtype = P.wire_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
        self.d_model = router.d_model
        self.n_experts = router.n_experts  # routed experts of the first layer (shared pieces: n_ids)
        self.fingerprints = dict(fingerprints or {})
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_rows = self.max_batch_tokens * max(slots_per_token(r) for r in self.routers.values())
        self.row_bytes = self.d_model * self.dtype.itemsize
        self.timeout = timeout
        self._own_loop = loop is None
        self.loop = loop or ServeLoop()
        ids = itertools.count(1)
        next_id = lambda: next(ids)  # noqa: E731  (rounds and control requests share it)
        layers = {L: n_ids(r) for L, r in self.routers.items()}
        shape = LayerShape(self.d_model, self.dtype, self.max_rows, self.n_experts, layers, self.fingerprints)
        self.workers = WorkerSet(urls, shape, nslots=nslots, timeout=timeout, secret=secret,
                                 post=self.loop.call_soon_threadsafe)
        self.served = ServedSet(layers)
        self.control = ControlChannel(self.workers, next_id=next_id, ack_timeout=ack_timeout)
        self.rollout = Rollout(self.workers, self.n_experts, control=self.control, served=self.served,
                               layers=self.routers, fingerprints=self.fingerprints)
        self.rounds = RoundBook(self.workers, self.routers, dtype=self.dtype, max_batch_tokens=self.max_batch_tokens,
                                timeout=timeout, split_replicas=split_replicas, min_split=min_split,
                                decide_pins=self.rollout.decide, next_id=next_id, balancing=balancing,
                                pinned_router=self.rollout.router_for, chunk_rows=chunk_rows, served=self.served)
        planner = self.rounds.planner
        planner.load = LoadWindow(layers, window=load_window)
        self.admission = Admission(self.workers, self.served, self.control, self.rollout,
                                   placement=lambda: planner.placement)
        self.rebalancer = Rebalancer(self.workers, self.served, self.control, self.rollout, planner,
                                     self.rounds.in_flight_versions, max_moves=max_moves)
        self.live = LivePlacement(self.workers, self.rebalancer, planner, layers, eplb_on=eplb,
                                  redundant=redundant_experts, interval=eplb_interval)
        self.rollout.on_settled = self.admission.recheck
        self.rollout.routed = lambda layer, e: planner.placement.of(layer, e) if planner.placement else None
        self.rollout.blocked = lambda: ("a move of expert copies is loading; try again when it is done"
                                        if self.rebalancer.loading else None)
        self.workers.on_message = self._on_message
        self.workers.on_up.append(self._up)
        self.workers.on_down.append(self._down)
        self.workers.on_write_pending.append(self._write_pending)
        self.on_round = None  # callable(BatchStats) after each settled round (metrics)
        self._started = False  # the first connections are admitted together (Admission.start)
        try:
            self.workers.connect_all(connect_timeout)
            # the placement at start: every copy the workers host routes
            planner.placement = ExpertPlacement.from_hosting({w.index: w.layers for w in self.workers}, layers)
            self.admission.start()
            self._await_admission(ack_timeout)
        except BaseException:
            self.close()
            raise
        self.loop.add_tick(self._tick)
        self.rounds.clock.enabled = reply_spin
        self.rounds.clock.local_workers = sum(secrets.is_loopback(u) for u in urls)
        self.loop.add_spin(self.rounds.spin_window)

    # -- plumbing ------------------------------------------------------------------------------
    def _up(self, w: WorkerLink) -> None:
        """A worker (re)connected: watch it, and admit it once it holds the served weights
        (on the first connections, :meth:`Admission.start` does, after all of them)."""
        self.loop.watch(w.conn, lambda w=w: self._ready(w))
        if self._started:
            self.admission.begin(w)

    def _await_admission(self, timeout: float) -> None:
        """At start: serve once every first connection was admitted (or refused), bounded."""
        self._started = True
        deadline = time.monotonic() + timeout
        while any(self.admission.syncing(w) for w in self.workers) and time.monotonic() < deadline:
            self.loop.run_once(timeout=0.02)

    def _write_pending(self, w: WorkerLink) -> None:
        self.loop.watch_write(w.conn, True)

    def _ready(self, w: WorkerLink) -> None:
        """``w``'s connection is readable, or has room for a frame it is still writing."""
        conn = w.conn
        if conn is not None and self.loop.watching_write(conn) and self.workers.flush(w) and w.conn is conn:
            self.loop.watch_write(conn, False)
        self.workers.read(w)

    def _down(self, w: WorkerLink, why: str) -> None:
        self.loop.unwatch(w.conn)
        self.control.on_worker_down(w)
        self.admission.on_worker_down(w)
        self.rebalancer.on_worker_down(w)
        self.rollout.on_worker_down(w)
        self.rounds.on_worker_down(w, why)

    def _on_message(self, w: WorkerLink, msg) -> None:
        h = msg.header
        rid = P.request_id_of(h)
        if self.control.owns(rid):
            msg.release()
            self.control.on_reply(w, h)
            return
        op = h.get("op") if isinstance(h, dict) else None
        if op in (P.RESULT, P.ERROR) and rid != -1:
            self.rounds.on_reply(w, msg)
            return
        msg.release()
        if op == P.PONG and w.admitted and not self.control.pending(w.index) and _held_changed(w, h):
            # loads and retires go only through this gateway's control channel: a worker whose
            # versions changed otherwise is not known to hold the served weights any more
            self.workers.lost(w, "its weights changed without this gateway (another gateway?): re-admitting")
            return
        if isinstance(h, dict):
            self.workers.on_notice(w, h)

    def _tick(self, now: float) -> Optional[float]:
        self.rounds.expire(now)
        backlog = self.rounds.pump()  # chunks a connection could not take yet
        t = self.workers.tick(now)
        r = self.rollout.tick(now)
        c = self.control.tick(now)
        a = self.admission.tick(now)
        m = self.rebalancer.tick(now)
        lp = self.live.tick(now)
        d = self.rounds.next_deadline()
        due = [x for x in (t, r, c, a, m, lp, d) if x is not None]
        if backlog:  # shm returns credits without a wake-up: look again soon
            due.append(now + BACKLOG_RETRY)
        if self.rounds.has_stalling(now):  # a stalled round stops holding the batcher: look again soon
            due.append(now + 0.05)
        if self.on_round is not None:
            for rnd in self.rounds.take_settled():
                self.on_round(rnd.stats)
        else:
            self.rounds.take_settled()
        return min(due) if due else None

    # -- the server's interface --------------------------------------------------------------
    def dispatch(self, requests: Sequence[Request]) -> None:
        self.rounds.dispatch(requests)

    def take_finished(self) -> list[Request]:
        return self.rounds.take_finished()

    @property
    def in_flight(self) -> int:
        return self.rounds.in_flight

    @property
    def pipelined(self) -> int:
        """Rounds that count against the batcher's in-flight limit (see RoundBook.pipelined)."""
        return self.rounds.pipelined()

    @property
    def layers(self) -> list[int]:
        return sorted(self.routers)

    def hosts(self, expert: int, layer: int = P.DEFAULT_LAYER) -> list[int]:
        return self.rounds.hosts(expert, layer=layer)

    def stats(self) -> list[dict]:
        return [w.as_dict() for w in self.workers]

    @property
    def chunk_rows(self) -> ChunkSetting:
        """How each worker's part of a round is cut into messages ("auto", 0 or rows per
        message); settable between forwards (a benchmark times both ways on the same workers)."""
        return self.rounds.chunk_rows

    @chunk_rows.setter
    def chunk_rows(self, value: ChunkSetting) -> None:
        self.rounds.chunk_rows = parse_chunk_rows(value)

    def chunk_choice(self) -> dict:
        """What auto's whole-or-chunked choice stands on (ChunkMode.snapshot): rounds asked
        about, measured and left out as cold, whether both ways are measured yet, and the
        lower quartiles per row."""
        return self.rounds.costs.chunk_mode.snapshot()

    def replication(self) -> int:
        """The most workers hosting one expert (1: no replica to choose between)."""
        return max((sum(1 for w in self.workers if e in w.experts) for e in range(self.n_experts)), default=0)

    @staticmethod
    def combine(req: Request, out: np.ndarray) -> np.ndarray:
        """``req``'s output into ``out``, from its replies where they landed (gateway/combine.py)."""
        return combine_request(req, out)

    def route_early(self, req: Request) -> Optional[frozenset]:
        """Route ``req`` before it is batched (expert-aware batching); see RoundBook.route_early."""
        return self.rounds.route_early(req)

    def hot_update(self, action: Any, fields: Mapping[str, Any]) -> dict:
        """A hot-update command (gateway/rollout.py): start, advance, finish, rollback, status,
        settle, or served (what the gateway serves). UpdateError when refused."""
        f = fields.get
        if action == "settle":
            return self.rollout.settle(f("experts"), f("version"), layer=f("layer"), weights=f("weights"),
                                       seed=f("seed"), checkpoint=f("checkpoint"))
        if action == "served":
            return {"state": "served", **self.served.status(), "update": self.rollout.status(),
                    "admission": self.admission.snapshot()}
        if action == "start":
            return self.rollout.start(f("experts"), f("version"), weights=f("weights"), seed=f("seed"),
                                      checkpoint=f("checkpoint"), layer=f("layer"), steps=f("steps"),
                                      auto_interval=f("auto_interval"))
        return self.rollout.command(str(action), f("fraction"))

    def placement_op(self, action: Any, fields: Mapping[str, Any]) -> dict:
        """``placement show`` (the placement, per layer its version, balancedness and copies) or
        ``placement load`` (move toward a saved one). PlacementError when refused."""
        if action == "show":
            return self.live.show()
        if action == "load":
            return self.live.load(fields.get("placement") or {})
        raise PlacementError(f"unknown placement action {action!r}; use show or load")

    def workers_op(self, action: Any, fields: Mapping[str, Any]) -> dict:
        """``workers list|add|drain|remove|scale``. PlacementError when refused."""
        if action == "list":
            return {"workers": self.stats()}
        if action == "add":
            urls = fields.get("urls")
            if not (isinstance(urls, list) and urls and all(isinstance(u, str) and "://" in u for u in urls)):
                raise PlacementError(f"add needs worker URLs (scheme://...), got {urls!r}")
            return self.live.add(urls)
        if action in ("drain", "remove"):
            return self.live.drain(self.live._worker(fields.get("worker")).index, remove=action == "remove")
        if action == "scale":
            n = fields.get("n")
            if not isinstance(n, int) or isinstance(n, bool):
                raise PlacementError(f"scale needs a number of workers, got {n!r}")
            return self.live.scale(n)
        raise PlacementError(f"unknown workers action {action!r}; use list, add, drain, remove or scale")

    def status(self) -> dict:
        """The pool's part of the gateway's pong: workers, update, served set, admission,
        reply spinning, and the layer's configuration."""
        return {"workers": self.stats(), "rounds_in_flight": self.in_flight, "update": self.rollout.status(),
                "reply_spin": self.rounds.clock.snapshot(), "served": self.served.status(),
                "admission": self.admission.snapshot(),
                "config": {"balancing": self.rounds.balancing, "chunk_rows": self.chunk_rows,
                           # auto: what rounds alone in flight cost per row, whole and chunked
                           "chunk_costs": self.chunk_choice(), "replicas": self.replication(),
                           "n_experts": self.n_experts, "top_k": self.router.top_k, "d_model": self.d_model,
                           "dtype": P.dtype_name(self.dtype), "router": self.router.describe(),
                           "layers": [[L, self.routers[L].describe(), self.fingerprints.get(L)]
                                      for L in self.layers]}}

    def reply_spin(self) -> dict:
        return self.rounds.clock.snapshot()

    @property
    def update(self):
        return self.rollout.update

    @property
    def updates(self) -> list:
        return self.rollout.updates

    def update_start(self, experts, version, **kw) -> dict:
        return self.rollout.start(experts, version, **kw)

    def update_command(self, action: str, fraction=None) -> dict:
        return self.rollout.command(action, fraction)

    # -- blocking API (a thin driver over the same rounds) -----------------------------------
    def forward(self, x: np.ndarray, out: Optional[np.ndarray] = None, *,
                timeout: Optional[float] = None, layer: int = P.DEFAULT_LAYER) -> tuple[np.ndarray, BatchStats]:
        """The MoE layer ``layer`` on ``x`` (T, d_model): returns (y, per-stage stats). Raises
        WorkerError (or NoHealthyWorker) when the workers fail this batch (``out``, if given,
        then holds no result); never hangs."""
        x = np.asarray(x)
        if x.dtype != self.dtype and P.dtype_name(x.dtype) == P.dtype_name(self.dtype):
            x = x.view(self.dtype)  # bf16 as uint16 bits or as ml_dtypes.bfloat16: the same bytes
        if out is None:
            out = np.empty(x.shape, dtype=self.dtype)
        elif out.shape != x.shape or out.dtype != self.dtype:
            raise ValueError(f"out must be {x.shape} {P.dtype_name(self.dtype)}, got {out.shape} {out.dtype}")
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        req = Request(x, layer=layer, out=out)
        self.rounds.dispatch([req])
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout) * 2
        while not req.finished:
            if time.monotonic() > deadline:  # bounded even if every timer failed us
                raise WorkerError("no answer in time")
            self.loop.run_once(timeout=0.05)
        self.rounds.take_finished()  # standalone use: the only request in flight is this one
        stats = req.round.stats if req.round is not None else BatchStats()
        try:
            if req.error is not None:
                raise req.error
            combine_request(req, out)
        finally:
            req.release()
        return out, stats

    def ping(self, timeout: float = 5.0) -> list[Optional[dict]]:
        """Every connected worker's pong (experts, versions, in-flight, counters), or None for
        one that did not answer in time. Blocking: not for the server loop."""
        pongs: list[Optional[dict]] = [None] * len(self.workers)
        rid = -2
        waiting = {w.index for w in self.workers if w.connected}
        on_message = self.workers.on_message

        def catch(w: WorkerLink, msg) -> None:
            h = msg.header
            if isinstance(h, dict) and h.get("op") == P.PONG and h.get("id") == rid:
                pongs[w.index] = h
                waiting.discard(w.index)
            on_message(w, msg)

        self.workers.on_message = catch
        try:
            for w in self.workers:
                if w.index in waiting and not self.workers.send(w, P.request(P.PING, rid)):
                    waiting.discard(w.index)
            deadline = time.monotonic() + timeout
            while waiting and time.monotonic() < deadline:
                self.loop.run_once(timeout=0.02)
        finally:
            self.workers.on_message = on_message
        return pongs

    def close(self) -> None:
        self.rounds.close()
        self.workers.close()
        if self._own_loop:
            self.loop.close()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _held_changed(w: WorkerLink, pong: dict) -> bool:
    """Whether a pong's versions table holds other versions than ``w`` acknowledged."""
    versions = pong.get("versions")
    if not isinstance(versions, list):
        return False
    try:
        said = {(P.entry_layer(v, 3), int(v[0])): set(int(x) for x in v[2]) for v in versions}
    except (TypeError, ValueError, IndexError):
        return False
    return any(said.get(k, set()) != set(held) for k, held in w.weights.items())
