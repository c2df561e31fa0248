"""Moves of expert copies between workers, live: every placement change goes through here.

A *move* takes the expert placement (gateway/expert_placement.py) toward a target in one
bounded step:

    loading ──every add acknowledged at the served weights──▶ switched ──rounds of the old
       │                                                        placement settled──▶ retiring ──▶ done
       └──an add failed, timed out, or its worker went──▶ abandoned (the old placement stays)

1. *loading*: each added copy is loaded on its worker from the served weights' source (a
   hot update aimed at a worker that did not hold the expert), acknowledged within the
   control channel's ack timeout, with the served fingerprint; the placement is unchanged
   meanwhile. A worker that already holds the served weights needs no load.
2. *switched*: the next placement version routes to the added copies and no longer to the
   removed ones; rounds already planned keep the version they were planned under.
3. *retiring*: once no round of an older version is in flight, each removed copy is
   dropped from its worker (``unhost``), freeing its slot.

At most ``max_moves`` copies are added per move (loading never starves serving); a target
further away is reached over several moves. No move starts while a hot update runs, and a
hot update does not start while a move is loading (both change what workers hold).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from gateway.control import ControlChannel
from gateway.expert_placement import ExpertPlacement, PlacementError
from gateway.served import ServedSet, key_name
from gateway.worker_link import WorkerLink
from gateway.workers import WorkerSet
from workers import protocol as P

log = logging.getLogger("moe.rebalancer")

MAX_MOVES = 8  # copies added per move at most (--eplb-max-moves)


@dataclass
class Move:
    adds: list  # [(layer, expert, worker)]
    removes: list
    reason: str
    started: float
    state: str = "loading"  # loading, switched, retiring, done, abandoned
    outstanding: set = field(default_factory=set)  # (op, layer, expert, worker) not acknowledged
    loaded: list = field(default_factory=list)  # adds this move loaded (not held before): undone if abandoned
    version: Optional[int] = None  # the placement version it switched to
    ended: Optional[float] = None
    error: str = ""

    def as_dict(self) -> dict:
        return {"state": self.state, "reason": self.reason, "adds": [list(a) for a in self.adds],
                "removes": [list(r) for r in self.removes], "version": self.version, "error": self.error,
                "seconds": round((self.ended or time.monotonic()) - self.started, 3)}


@dataclass
class MoveStats:
    done: int = 0
    abandoned: int = 0
    copies_added: int = 0
    copies_removed: int = 0
    loads: int = 0  # copies loaded on a worker (an add to a worker already holding it loads nothing)
    bytes_loaded: int = 0  # their weights' bytes, as the workers said


class Rebalancer:
    """``planner``: whose ``placement`` routes (gateway/planner.py); ``in_flight_versions()``:
    the placement versions of the rounds still in flight (the round book's)."""

    def __init__(self, workers: WorkerSet, served: ServedSet, control: ControlChannel, rollout: Any,
                 planner: Any, in_flight_versions: Any, *, max_moves: int = MAX_MOVES) -> None:
        self.workers, self.served, self.control, self.rollout = workers, served, control, rollout
        self.planner = planner
        self.in_flight_versions = in_flight_versions
        self.max_moves = max(1, int(max_moves))
        self.move: Optional[Move] = None
        self.history: deque = deque(maxlen=32)
        self.stats = MoveStats()

    @property
    def placement(self) -> ExpertPlacement:
        return self.planner.placement

    @property
    def busy(self) -> bool:
        return self.move is not None and self.move.state in ("loading", "switched", "retiring")

    @property
    def loading(self) -> bool:
        return self.move is not None and self.move.state == "loading"

    # -- starting a move ------------------------------------------------------------------------
    def apply(self, target: ExpertPlacement, reason: str) -> dict:
        """Start the next bounded move toward ``target`` (its copies; its version is ignored).
        PlacementError when it cannot start (a move or an update runs, the target breaks a
        rule, a copy would go to a worker that cannot take it)."""
        if self.busy:
            raise PlacementError(f"a move is in progress ({self.move.state}); try again when it is done")
        up = self.rollout.update
        if up is not None and up.state.active:
            raise PlacementError(f"a hot update is in progress ({up.state.value}); finish or roll it back first")
        target.check(n_workers=len(self.workers))
        adds, removes = self.placement.diff(target)
        for L, e, w in adds:
            link = self.workers[w]
            if not link.usable or link.parked:
                raise PlacementError(f"worker {w} ({link.describe()}) cannot take a copy of {key_name((L, e))}")
        adds, removes = self._bounded(adds, removes)
        if not adds and not removes:
            return {"state": "unchanged", "version": self.placement.version}
        self.move = Move(adds, removes, reason, time.monotonic())
        log.info("move (%s): adding %s, removing %s", reason, adds, removes)
        self._load()
        return self.move.as_dict()

    def _room(self, w: WorkerLink) -> int:
        """Slots ``w`` has for new copies: copies it hosts that nothing routes to are freed
        first (a restarted worker's start-up experts, say)."""
        routed = set(self.placement.on(w.index))
        hosted = [(L, e) for L, ids in w.layers.items() for e in ids]
        kept = sum(1 for k in hosted if k in routed) or min(1, len(hosted))  # a worker keeps one expert
        return w.max_experts - kept

    def _bounded(self, adds: list, removes: list) -> tuple[list, list]:
        """At most max_moves adds, each to a worker with a free slot; then the removes that
        leave every expert a copy once those adds are in."""
        room = {w.index: self._room(w) for w in self.workers}
        chosen = []
        for L, e, w in adds:
            held = self.workers[w].hosts(e, L)
            if len(chosen) < self.max_moves and (held or room.get(w, 0) > 0):
                chosen.append((L, e, w))
                if not held:
                    room[w] -= 1
        copies = {}
        for L, e, w in chosen:
            copies.setdefault((L, e), set(self.placement.of(L, e))).add(w)
        kept = []
        for L, e, w in removes:
            c = copies.setdefault((L, e), set(self.placement.of(L, e)))
            if len(c) > 1:
                c.discard(w)
                kept.append((L, e, w))
        return chosen, kept

    # -- loading --------------------------------------------------------------------------------
    def _load(self) -> None:
        """Free the slots the adds need (unrouted copies on their workers), then load."""
        mv = self.move
        routed = {(L, e, w) for L, per in self.placement.copies.items() for e, ws in enumerate(per) for w in ws}
        targets = {w for _, _, w in mv.adds}
        for w in sorted(targets):
            link = self.workers[w]
            hosted = [(L, e) for L, ids in sorted(link.layers.items()) for e in sorted(ids)]
            spare = [(L, e) for L, e in hosted if (L, e, w) not in routed and (L, e, w) not in mv.adds]
            if len(spare) == len(hosted):
                spare = spare[1:]  # never its last expert: it goes in a later move
            for L, e in spare:
                op = (P.UNHOST, L, e, w)
                mv.outstanding.add(op)
                self.control.send(link, P.UNHOST, e, L, {}, on_reply=lambda lk, h, op=op: self._freed(op),
                                  on_fail=lambda why, op=op: self._freed(op))
        if not mv.outstanding:
            self._send_loads()

    def _freed(self, op: tuple) -> None:
        mv = self.move
        if mv is None or mv.state != "loading" or op not in mv.outstanding:
            return
        mv.outstanding.discard(op)
        if not mv.outstanding:
            self._send_loads()

    def _send_loads(self) -> None:
        mv = self.move
        for L, e, w in mv.adds:
            link, key = self.workers[w], (L, e)
            weights = self.served.get(key)
            if weights is None:
                self._abandon(f"{key_name(key)} is not served")
                return
            held = link.weights.get(key, {}).get(weights.version)
            if held is not None and (weights.fingerprint is None or held[0] == weights.fingerprint):
                continue  # it holds the served weights already
            op = (P.LOAD, L, e, w)
            mv.outstanding.add(op)
            fields = {"version": weights.version, **(weights.source or {})}
            self.control.send(link, P.LOAD, e, L, fields,
                              on_reply=lambda lk, h, op=op, want=weights: self._loaded(lk, op, want, h),
                              on_fail=lambda why, op=op: self._abandon(f"{key_name(op[1:3])} on worker {op[3]}: "
                                                                        f"{why}"))
        self._maybe_switch()

    def _loaded(self, w: WorkerLink, op: tuple, want, h: dict) -> None:
        mv = self.move
        if mv is None or op not in mv.outstanding:
            return
        mv.outstanding.discard(op)
        _, L, e, wi = op
        mv.loaded.append((L, e, wi))
        self.stats.loads += 1
        nbytes = h.get("nbytes")
        if isinstance(nbytes, int) and not isinstance(nbytes, bool) and 0 <= nbytes < 1 << 40:
            self.stats.bytes_loaded += nbytes
        fp = w.weights.get((L, e), {}).get(want.version, ("",))[0]
        if want.fingerprint is not None and fp != want.fingerprint:
            self._abandon(f"worker {wi} loaded {key_name((L, e))} with fingerprint {fp[:12]}, the gateway serves "
                          f"{want.fingerprint[:12]}")
            return
        self._maybe_switch()

    def _maybe_switch(self) -> None:
        mv = self.move
        if mv is None or mv.state != "loading" or mv.outstanding:
            return
        try:
            new = self.placement.changed(mv.adds, mv.removes)
        except PlacementError as e:
            self._abandon(str(e))
            return
        self.planner.placement = new
        mv.state, mv.version = "switched", new.version
        self.stats.copies_added += len(mv.adds)
        log.info("placement version %d routes from now on (%s)", new.version, mv.reason)
        self._maybe_retire()

    def _abandon(self, why: str) -> None:
        mv = self.move
        if mv is None or mv.state != "loading":
            return
        mv.state, mv.error, mv.ended = "abandoned", why, time.monotonic()
        mv.outstanding.clear()
        self.stats.abandoned += 1
        log.warning("move abandoned, the placement stays at version %d: %s", self.placement.version, why)
        for L, e, w in mv.loaded:  # copies this move added that nothing routes to: their slots back
            link = self.workers[w]
            if link.conn is not None and w not in self.placement.of(L, e) and link.hosts(e, L):
                self.control.send(link, P.UNHOST, e, L, {}, on_reply=lambda lk, h: None, on_fail=lambda why: None)
        self._end()

    # -- retiring -------------------------------------------------------------------------------
    def _maybe_retire(self) -> None:
        mv = self.move
        if mv is None or mv.state != "switched":
            return
        if any(v < mv.version for v in self.in_flight_versions()):
            return  # a round planned under an older placement may still need a removed copy
        mv.state = "retiring"
        for L, e, w in mv.removes:
            link = self.workers[w]
            hosted = sum(len(ids) for ids in link.layers.values())
            if link.conn is None or w in self.placement.of(L, e) or not link.hosts(e, L) or hosted <= 1:
                continue  # (a worker keeps its last expert: unrouted, it serves nothing)
            op = (P.UNHOST, L, e, w)
            mv.outstanding.add(op)
            self.control.send(link, P.UNHOST, e, L, {}, on_reply=lambda lk, h, op=op: self._retired(op),
                              on_fail=lambda why, op=op: self._retired(op, why))
        self._maybe_done()

    def _retired(self, op: tuple, why: str = "") -> None:
        mv = self.move
        if mv is None or op not in mv.outstanding:
            return
        mv.outstanding.discard(op)
        if why:  # an unrouted copy stays on that worker; admission drops it when it reconnects
            log.warning("worker %d kept its unrouted copy of %s: %s", op[3], key_name(op[1:3]), why)
        self._maybe_done()

    def _maybe_done(self) -> None:
        mv = self.move
        if mv is not None and mv.state == "retiring" and not mv.outstanding:
            mv.state, mv.ended = "done", time.monotonic()
            self.stats.done += 1
            self.stats.copies_removed += len(mv.removes)
            self._end()

    def _end(self) -> None:
        self.history.append(self.move)

    # -- events -----------------------------------------------------------------------------------
    def on_worker_down(self, w: WorkerLink) -> None:
        mv = self.move
        if mv is None:
            return
        if mv.state == "loading" and any(a[2] == w.index for a in mv.adds):
            self._abandon(f"worker {w.index} was lost while loading")
            return
        for op in [o for o in mv.outstanding if o[3] == w.index]:
            self._retired(op, "worker lost")

    def tick(self, now: float) -> Optional[float]:
        if self.move is not None and self.move.state == "switched":
            self._maybe_retire()
            return now + 0.01
        return None

    def status(self) -> dict:
        s = self.stats
        return {"move": self.move.as_dict() if self.move is not None else None,
                "moves": {"done": s.done, "abandoned": s.abandoned, "copies_added": s.copies_added,
                          "copies_removed": s.copies_removed, "loads": s.loads},
                "history": [m.as_dict() for m in self.history]}
