"""What goes where, with no I/O: a request's routing and a round's plan.

Routing: a request is routed by its layer's router (or, when a hot update decided it for
its new version and the update brings its own router, by that one), after its pins; it can
go only if every expert it needs is served (gateway/served.py) and has a healthy host.

Planning: over the round's requests at once, each needed expert's rows go to its healthy
hosts (one replica, or split by load: gateway/replicas.py), each request gets its
DispatchPlan, each worker its part (its requests' rows back to back), the part's groups
(each pinned to the version it is computed with, recorded on its request: the answer says
which versions made it) and its chunk bounds (gateway/chunking.py).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np

from gateway.chunk_bounds import split_part
from gateway.chunk_mode import ChunkMode
from gateway.chunking import ChunkSetting
from gateway.dispatch import DispatchPlan, split_over_replicas
from gateway.expert_placement import ExpertPlacement
from gateway.load_window import LoadWindow
from gateway.replicas import BALANCING, choose_least_loaded, choose_replicas
from gateway.requests import NoHealthyWorker, Request, Round, n_ids
from gateway.served import ServedSet
from gateway.workers import WorkerSet
from workers import protocol as P


class Planner:
    """``routers``: {layer: router} (kept as given: a finished update may install a new one
    there); ``decide_pins(layer)``: the versions a hot update decides for a new request of
    that layer; ``pinned_router(layer, pins)``: the router those pins route with (None: the
    layer's own); ``served``: what the gateway serves (every group is pinned to it);
    ``chunk_mode``: auto's measured choice of whether to chunk at all."""

    def __init__(self, workers: WorkerSet, routers: dict, *, dtype: np.dtype, max_batch_tokens: int,
                 split_replicas: bool = True, min_split: int = 16, balancing: str = "load-aware",
                 decide_pins: Optional[Callable[[int], dict]] = None,
                 pinned_router: Optional[Callable[[int, dict], Any]] = None,
                 served: Optional[ServedSet] = None, chunk_mode: Optional[ChunkMode] = None,
                 load: Optional[LoadWindow] = None) -> None:
        if balancing not in BALANCING:
            raise ValueError(f"balancing must be one of {BALANCING}, got {balancing!r}")
        self.workers = workers
        self.routers = routers
        self.n_ids = {L: n_ids(r) for L, r in routers.items()}
        first = next(iter(routers.values()))
        self.d_model = first.d_model
        self.dtype = np.dtype(dtype)
        self.max_batch_tokens = max_batch_tokens
        self.split_replicas, self.min_split, self.balancing = split_replicas, min_split, balancing
        self.decide_pins = decide_pins or (lambda layer: {})
        self.pinned_router = pinned_router or (lambda layer, pins: None)
        self.served = served
        self.chunk_mode = chunk_mode or ChunkMode()
        # which workers route each expert (gateway/expert_placement.py); None: every worker
        # that hosts it. Replaced as a whole when it changes: a round keeps the one it was
        # planned under
        self.placement: Optional[ExpertPlacement] = None
        self.load = load  # rows per expert over a window (EPLB reads it)

    def route(self, req: Request) -> Optional[Exception]:
        """Route ``req`` (its pins first: a hot update that brings its own router routes the
        requests it decides for its new version); the error that refuses it, or None."""
        x = req.x
        router = self.routers.get(req.layer)
        if router is None:
            return ValueError(f"layer {req.layer} is not served here (layers: {sorted(self.routers)})")
        if x.ndim != 2 or x.shape[1] != self.d_model or x.dtype != self.dtype:
            return ValueError(f"batch must be (T, {self.d_model}) {P.dtype_name(self.dtype)}, "
                              f"got {x.shape} {P.dtype_name(x.dtype)}")
        if x.shape[0] > self.max_batch_tokens:
            return ValueError(f"batch of {x.shape[0]} tokens exceeds max_batch_tokens {self.max_batch_tokens}")
        req.pins = self.decide_pins(req.layer)
        req.served = self.served.generation if self.served is not None else None
        router = self.pinned_router(req.layer, req.pins) or router
        try:
            req.routing = router.route(x)
        except ValueError as e:
            return e
        return None

    def hosts(self, expert: int, avoid: frozenset = frozenset(), layer: int = P.DEFAULT_LAYER) -> list[int]:
        """The healthy workers outside ``avoid`` that route ``expert`` of ``layer`` now."""
        p = self.placement
        if p is None:
            return [w.index for w in self.workers if w.usable and w.hosts(expert, layer) and w.index not in avoid]
        workers = self.workers
        return [w for w in p.of(layer, expert) if w not in avoid and workers[w].usable]

    def unserved(self, req: Request, avoid: frozenset = frozenset()) -> Optional[Exception]:
        """Why ``req`` cannot go now (an expert it needs is blocked, or has no healthy host
        outside ``avoid``), or None."""
        needed = np.flatnonzero(req.routing.expert_counts)
        L = req.layer
        if self.served is not None and self.served.blocked:
            why = [self.served.why_blocked((L, int(e))) for e in needed]
            why = [w for w in why if w is not None]
            if why:
                return NoHealthyWorker("not served: " + "; ".join(why))
        lost = [int(e) for e in needed if not self.hosts(int(e), avoid, L)]
        if not lost:
            return None
        of = f" of layer {L}" if len(self.routers) > 1 or L != P.DEFAULT_LAYER else ""
        why = "; ".join(f"expert {e}{of} on " + (", ".join(w.describe() for w in self.workers if w.hosts(e, L))
                                                 or "no worker") for e in lost)
        return NoHealthyWorker(f"no healthy worker for {why}")

    def plan(self, rnd: Round, chunk_rows: ChunkSetting, avoid: frozenset = frozenset()) -> None:
        """Choose each expert's replicas over the round, each request's DispatchPlan, each
        worker's part, its groups (pinned) and its chunk bounds; which chunks each request
        waits for."""
        reqs = rnd.requests
        idx = np.concatenate([r.routing.topk_idx for r in reqs]) if len(reqs) > 1 else reqs[0].routing.topk_idx
        n_experts = self.n_ids[rnd.layer]
        counts = np.bincount(idx[idx >= 0].ravel(), minlength=n_experts)
        rnd.placement_version = self.placement.version if self.placement is not None else 0
        if self.load is not None and rnd.requests[0].attempts == 1:
            self.load.record(rnd.layer, counts, time.monotonic())
        load = np.array([w.outstanding_rows for w in self.workers], dtype=np.float64)
        hosts = {e: self.hosts(e, avoid, rnd.layer) for e in range(n_experts) if counts[e]}
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
        # auto sizes chunks only where they could be sent: a round that cannot be measured goes
        # whole until the measured choice settles on chunks (ChunkMode.may_chunk)
        sizing = chunk_rows != "auto" or self.chunk_mode.may_chunk(rnd.alone)
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
                rnd.groups[w] = self.part_groups(rnd, w)
                if sizing:
                    link = self.workers[w]
                    costs = link.chunk_costs
                    size, edge = link.chunk_sizer.choose(base, chunk_rows, costs, rnd.groups[w])
                    rnd.bounds[w] = split_part(rnd.groups[w], base, size, costs.front_growth(base), edge,
                                               costs.back_growth(base))
                else:
                    rnd.bounds[w] = [0, base]
        # auto: the size model would chunk this round; measured costs say whether to
        rnd.eligible = chunk_rows == "auto" and rnd.chunked
        if rnd.eligible and not self.chunk_mode.want_chunks(measurable=rnd.alone):
            rnd.bounds = {w: [0, n] for w, n in rnd.rows.items()}
        for w in rnd.rows:
            users = [r for r in reqs if w in r.bases]
            rnd.users[w] = len(users)
            for r in users:
                r.waiting.update((w, c) for c in rnd.chunks_of(r, w))
        for r in reqs:
            r.drop_sum()  # a chunked round's sums are made once its messages are out (start_sums)

    def part_groups(self, rnd: Round, w_index: int) -> list:
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
