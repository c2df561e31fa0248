"""Live placement: what changes the expert placement while the gateway serves, and when.

Three sources of change, all carried out as bounded moves (gateway/rebalancer.py):

- **EPLB** (``--eplb``): every ``--eplb-interval`` seconds, each layer's per-expert load over
  the last ``--eplb-window`` seconds (the gateway's own routing, gateway/load_window.py)
  goes to DeepSeek's algorithm (gateway/eplb.py) with each worker's free slots and
  ``--redundant-experts`` copies to spread; a target that lowers the busiest worker's load
  is moved toward, at most ``--eplb-max-moves`` copies a move.
- **An operator**: ``placement load`` (a saved map, static EPLB; also ``--placement-file`` at
  start) and ``workers drain/remove`` (the worker's copies moved to the others first,
  refused when the rest cannot hold every logical expert).
- **The fleet**: ``workers add URL`` and ``workers scale N`` (local or Ray workers): a new
  worker is admitted, then given copies by the algorithm before it takes traffic.

A worker's slots are its ``max_experts`` (from its info) while it is admitted and not
parked; a drained (parked) or lost worker has none, so the algorithm places nothing there.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Optional

import numpy as np

from gateway import eplb
from gateway.expert_placement import ExpertPlacement, PlacementError
from gateway.rebalancer import Rebalancer
from gateway.worker_link import Health
from gateway.workers import WorkerSet

log = logging.getLogger("moe.placement")

MIN_GAIN = 0.01  # a target must lift balancedness by this much to be moved toward
MIN_ROWS = 64  # a window with fewer rows than this says too little to move anything
RETRY_AFTER = 5.0  # seconds before a drain whose move was abandoned is tried again
# how far the busiest worker may go above the best placement found to keep copies where they
# are: with none, small load changes reshuffle most copies of a large layer (docs/design.md#one-versioned-placement-changed-only-by-bounded-moves)
SLACK = 0.01


class LivePlacement:
    """``fleet``: starts and stops worker processes for ``workers scale`` (local or Ray
    placement), or None (workers listed by hand: only add/drain/remove)."""

    def __init__(self, workers: WorkerSet, rebalancer: Rebalancer, planner: Any, n_ids: Mapping[int, int], *,
                 eplb_on: bool = False, redundant: int = 0, interval: float = 60.0,
                 fleet: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.workers, self.rebalancer, self.planner = workers, rebalancer, planner
        self.n_ids = dict(n_ids)
        self.eplb_on, self.redundant, self.interval = eplb_on, int(redundant), float(interval)
        self.fleet = fleet
        self.clock = clock
        self._next = clock() + self.interval
        self._target: Optional[ExpertPlacement] = None  # an operator's target, reached over moves
        self._target_reason = ""
        self._removing: set = set()  # workers to take out once drained
        self._started: Any = None  # the last move this started (an abandoned one is not retried at once)
        self._joining: set = set()  # workers added by workers add/scale, given copies once admitted
        self._retry_at = 0.0
        self._scaling = False
        self.last_error = ""
        self.runs: list = []  # (when, seconds the algorithm took, balancedness before, after) per EPLB run

    # -- what the placement is and how balanced ------------------------------------------------------
    def slots(self) -> np.ndarray:
        return np.array([w.max_experts if self._live(w) else 0 for w in self.workers], dtype=np.int64)

    @staticmethod
    def _live(w) -> bool:
        return w.admitted and w.usable and not w.parked

    def alive(self) -> np.ndarray:
        return np.array([self._live(w) for w in self.workers], dtype=bool)

    def balancedness(self, layer: int, now: Optional[float] = None) -> Optional[float]:
        """vLLM's mean / max worker load over the window (None: no load yet)."""
        load = self.planner.load.load(layer, self.clock() if now is None else now)
        if load.sum() <= 0:
            return None
        p = self.planner.placement
        return float(eplb.balancedness(load, p.lists(layer), len(self.workers), alive=self.alive()))

    def show(self) -> dict:
        """The placement as ``placement show --json`` prints it: per layer its version,
        balancedness and copies (logical expert -> workers), and the move in progress."""
        p, now = self.planner.placement, self.clock()
        layers = {}
        for L in sorted(p.copies):
            load = self.planner.load.load(L, now)
            layers[str(L)] = {"version": p.version, "balancedness": self.balancedness(L, now),
                              "copies": {str(e): list(ws) for e, ws in enumerate(p.copies[L])},
                              "load": load.tolist(), "redundant": p.redundant()}
        share = self.shares(now)
        return {"version": p.version, "layers": layers, "redundant": p.redundant(), "physical": p.physical(),
                "workers": [{"index": w.index, "url": w.url, "state": w.state.value, "parked": w.parked,
                             "slots": w.max_experts, "copies": len(p.on(w.index)), "share": share[w.index]}
                            for w in self.workers],
                "last_error": self.last_error,
                "eplb": {"on": self.eplb_on, "redundant": self.redundant, "interval_s": self.interval,
                         "runs": [list(r) for r in self.runs[-16:]]},
                "rebalancer": self.rebalancer.status()}

    def shares(self, now: Optional[float] = None) -> list:
        """Each worker's share of the window's load under the current placement."""
        p = self.planner.placement
        now = self.clock() if now is None else now
        n = len(self.workers)
        tot = np.zeros(n)
        for L in p.copies:
            tot += eplb.worker_loads(self.planner.load.load(L, now), p.lists(L), n)
        s = tot.sum()
        return [float(x / s) if s > 0 else 0.0 for x in tot]

    # -- an operator's target ----------------------------------------------------------------------
    def load(self, doc: Mapping) -> dict:
        """Move toward a saved placement (``placement load``, ``--placement-file``)."""
        target = ExpertPlacement.from_dict(doc, self.n_ids)
        target.check(n_workers=len(self.workers), slots={w.index: w.max_experts for w in self.workers})
        self._target, self._target_reason = target, "operator's placement"
        return self._step_target() or {"state": "unchanged", "version": self.planner.placement.version}

    def _step_target(self) -> Optional[dict]:
        if self._target is None or self.rebalancer.busy:
            return None
        adds, removes = self.planner.placement.diff(self._target)
        if not adds and not removes:
            self._target = None
            return None
        return self._apply(self._target, self._target_reason)

    def _apply(self, target: ExpertPlacement, reason: str) -> dict:
        st = self.rebalancer.apply(target, reason)
        self._started = self.rebalancer.move
        return st

    def _after_abandon(self, now: float) -> bool:
        """The last move this started was abandoned: an operator's target is dropped (said in
        the log and ``show``), a drain is tried again after a pause. True while paused."""
        mv = self._started
        if mv is None or mv.state != "abandoned":
            return now < self._retry_at
        self._started, self.last_error = None, f"{mv.reason}: {mv.error}"
        if self._target is not None and mv.reason == self._target_reason:
            self._target = None
            log.warning("the target (%s) is dropped: %s", mv.reason, mv.error)
        self._retry_at = now + RETRY_AFTER
        return True

    # -- the fleet ---------------------------------------------------------------------------------
    def add(self, urls: list) -> dict:
        """Connect workers at ``urls``; once admitted, the placement algorithm gives them
        copies (from the load window, every expert counted at least once)."""
        added = [self.workers.add(u).index for u in urls]
        self._joining.update(added)
        return {"added": added, "note": "admitted as they connect, then given copies by the placement algorithm"}

    def drain(self, index: int, remove: bool = False) -> dict:
        """Move worker ``index``'s copies to the others, then (``remove``) take it out."""
        w = self._worker(index)
        rest = [x for x in self.workers if x.index != index and self._live(x)]
        p = self.planner.placement
        only = [(L, e) for L, e in p.on(index) if not (set(p.of(L, e)) - {index})]
        room = sum(x.max_experts - len(p.on(x.index)) for x in rest)
        if only and (not rest or room < len(only)):
            raise PlacementError(f"worker {index}'s copies of {only[:6]} are the only ones, and the other workers "
                                 f"have {room} free slots: add workers first")
        w.parked = True
        if remove:
            self._removing.add(index)
        self._drain_step(w)
        return {"worker": index, "state": "draining", "copies_left": len(p.on(index))}

    def _drain_step(self, w) -> None:
        if self.rebalancer.busy:
            return
        p = self.planner.placement
        mine = p.on(w.index)
        if not mine:
            if w.index in self._removing:
                self._removing.discard(w.index)
                self.workers.remove(w.index, "removed by an operator")
                if self.fleet is not None:
                    self.fleet.stop(w.index)
            return
        target = {L: [set(ws) for ws in per] for L, per in p.copies.items()}
        live = [x for x in self.workers if self._live(x) and x.index != w.index]
        room = {x.index: x.max_experts - len(p.on(x.index)) for x in live}
        n = len(self.workers)
        busy = sum(eplb.worker_loads(self.planner.load.load(L, self.clock()), p.lists(L), n) for L in p.copies)
        for L, e in mine:
            target[L][e].discard(w.index)
            if not target[L][e]:  # its only copy: to the least busy live worker with room
                fits = [x for x in room if room[x] > 0]
                if not fits:
                    raise PlacementError(f"no worker has room for {L, e}: add workers first")
                pick = min(fits, key=lambda x: (busy[x], -room[x], x))
                target[L][e].add(pick)
                room[pick] -= 1
        self._apply(ExpertPlacement.from_lists(target, p.version), f"draining worker {w.index}")

    def scale(self, n: int) -> dict:
        """Start or stop workers (through the fleet) to have ``n``: new ones are added as by
        ``workers add``; the highest-numbered ones are drained, then removed and stopped."""
        if self.fleet is None:
            raise PlacementError("workers scale needs workers this gateway starts (--local-workers or --placement "
                                 "ray); with --workers use workers add / remove")
        if n < 1:
            raise PlacementError("scale to at least 1 worker")
        if self._scaling:
            raise PlacementError("a scale is in progress; try again when its workers have started")
        live = [w for w in self.workers if w.state != Health.REMOVED and not w.parked]
        if n > len(live):
            self._scaling = True
            self.fleet.start(n - len(live), self._started_workers)
            return {"starting": n - len(live), "workers": len(live)}
        gone = sorted(live, key=lambda x: -x.index)[:len(live) - n]
        for w in gone:
            self.drain(w.index, remove=True)
        return {"draining": [w.index for w in gone], "workers": n}

    def _started_workers(self, urls: list) -> list:
        """The fleet's new workers listen at ``urls`` (on the loop): their pool indices."""
        self._scaling = False
        return self.add(urls)["added"] if urls else []

    def _give_copies(self, now: float) -> bool:
        """Workers added and now admitted get copies by the algorithm; True if a move started."""
        ready = {i for i in self._joining if self.workers[i].usable}
        self._joining -= {i for i in self._joining if self.workers[i].state == Health.REMOVED}
        if not ready or self.rebalancer.busy:
            return False
        self._joining -= ready
        target = self.eplb_target(now, prior=1.0)
        if target is None:
            return False
        self._target, self._target_reason = target, "copies for added workers"  # over as many moves as it takes
        return self._step_target() is not None

    def _worker(self, index: Any):
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self.workers):
            raise PlacementError(f"no worker {index!r} (workers 0-{len(self.workers) - 1})")
        w = self.workers[index]
        if w.state == Health.REMOVED:
            raise PlacementError(f"worker {index} was removed")
        return w

    # -- EPLB ------------------------------------------------------------------------------------------
    def _layer_slots(self, layer: int) -> np.ndarray:
        """Each worker's slots for ``layer``: its slots less the copies of other layers it holds."""
        p = self.planner.placement
        slots = self.slots()
        for w in range(len(slots)):
            slots[w] = max(0, slots[w] - sum(1 for L, _ in p.on(w) if L != layer))
        return slots

    def eplb_step(self, now: float) -> Optional[dict]:
        """One EPLB run over every layer; the move started (at most --eplb-max-moves copies:
        the next run goes on from where it got), if any."""
        target = self.eplb_target(now)
        return self._apply(target, "eplb") if target is not None else None

    def eplb_target(self, now: float, prior: float = 0.0) -> Optional[ExpertPlacement]:
        """The placement DeepSeek's algorithm gives every layer for the window's load, or
        None where no layer would be balanced better. ``prior``: rows every expert counts
        beyond what the window measured (a new worker's first copies, with little or no load
        yet)."""
        p = self.planner.placement
        target, gain = {}, False
        t0 = time.perf_counter()
        for L in sorted(p.copies):
            load = self.planner.load.load(L, now) + prior
            cur = p.lists(L)
            if load.sum() < MIN_ROWS and not prior:
                target[L] = cur
                continue
            alive = self.alive()
            try:
                new = eplb.rebalance(load, self._layer_slots(L), redundant=self.redundant, current=cur, alive=alive,
                                     slack=SLACK)
            except ValueError as e:
                log.warning("eplb: layer %d: %s", L, e)
                target[L] = cur
                continue
            before = eplb.balancedness(load, cur, len(self.workers), alive=alive)
            after = eplb.balancedness(load, new, len(self.workers), alive=alive)
            self.runs = (self.runs + [(round(now, 3), 0.0, round(before, 4), round(after, 4))])[-64:]
            if after >= before + MIN_GAIN and new != cur:
                target[L], gain = new, True
            else:
                target[L] = cur
        took = time.perf_counter() - t0
        if self.runs:
            r = self.runs[-1]
            self.runs[-1] = (r[0], round(took, 6), r[2], r[3])
        return ExpertPlacement.from_lists(target, p.version) if gain else None

    # -- the loop's tick ---------------------------------------------------------------------------------
    def tick(self, now: float) -> Optional[float]:
        if self.rebalancer.busy:
            return None
        if self._after_abandon(now):
            return self._retry_at
        try:
            for w in self.workers:
                if w.parked and w.state != Health.REMOVED:
                    self._drain_step(w)
                    if self.rebalancer.busy:
                        return None
            if self._step_target() is not None or self._give_copies(now):
                return None
            if self.eplb_on and now >= self._next:
                self._next = now + self.interval
                self.eplb_step(now)
        except (PlacementError, ValueError) as e:
            log.warning("placement: %s", e)
        if self._joining:
            return now + 0.05
        return self._next if self.eplb_on else now + 1.0
