"""Expert hot update as a state machine with no I/O (the pool does the sending).

An update moves a set of experts from their active version to a new one:

    LOADING ──all workers loaded──▶ SHIFTING ──finish──▶ FINISHING ──old retired──▶ DONE
       │   ╲                          │  ▲ advance (1% → 5% → ... → 100%)
       │    load failed ▶ FAILED      │  │
       └──────── rollback ────────────┴──┴──▶ ROLLING_BACK ──new retired──▶ ROLLED_BACK

Every request is decided ONCE, as a whole: all experts of the update serve it at the new
version, or all at the old one (``pins``), so no output mixes versions. The split is
deterministic, not random: after n requests exactly floor(sum of fractions) went to the new
version, so a 1% step sends one request in a hundred, evenly spaced.

While LOADING and ROLLING_BACK every request is pinned to the old version, while FINISHING
to the new one; pins end only when the workers acknowledged the retire, so a request never
meets a worker whose active version is not the one it was decided for.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Sequence

DEFAULT_STEPS = (0.01, 0.05, 0.25, 0.5, 1.0)


class UpdateError(ValueError):
    """An update command that does not apply (bad arguments, wrong state)."""


class State(str, Enum):
    LOADING = "loading"
    SHIFTING = "shifting"
    FINISHING = "finishing"
    DONE = "done"
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"

    @property
    def active(self) -> bool:
        return self in (State.LOADING, State.SHIFTING, State.FINISHING, State.ROLLING_BACK)


def check_steps(steps: Sequence[float]) -> tuple[float, ...]:
    steps = tuple(float(s) for s in steps)
    if not steps or any(not 0.0 < s <= 1.0 for s in steps) or list(steps) != sorted(steps):
        raise UpdateError(f"steps must be increasing fractions in (0, 1], got {list(steps)}")
    if steps[-1] != 1.0:
        steps += (1.0,)
    return steps


@dataclass
class Update:
    """One update. ``old``: expert -> the version active when it started."""

    experts: tuple
    old: dict
    new: int
    steps: tuple = DEFAULT_STEPS
    auto_interval: Optional[float] = None  # seconds between automatic advances (then finish)
    layer: int = 0  # the MoE layer whose experts it updates (0: the demo mode's one layer)
    router: object = None  # a new router the new version routes with (a checkpoint layer's), or None
    source: Optional[dict] = None  # the load fields of the new version ({"seed": 7}, ...)
    fingerprints: dict = field(default_factory=dict)  # expert -> the new version's, as its first load said
    clock: object = time.monotonic
    state: State = State.LOADING
    step: int = -1  # index into steps while SHIFTING
    waiting: set = field(default_factory=set)  # (worker, expert) loads or retires not acknowledged
    loaded: set = field(default_factory=set)  # (worker, expert) holding the new version
    served: Counter = field(default_factory=Counter)  # "old"/"new" -> requests decided
    timeline: list = field(default_factory=list)
    error: str = ""
    _acc: float = 0.0
    _t0: float = 0.0
    _next_auto: Optional[float] = None

    def __post_init__(self) -> None:
        self.steps = check_steps(self.steps)
        if not self.experts:
            raise UpdateError("an update needs at least one expert")
        if any(self.old[e] == self.new for e in self.experts):
            raise UpdateError(f"version {self.new} is already active")
        self._t0 = self.clock()
        self._event("start")

    # -- what a request gets -------------------------------------------------------
    @property
    def fraction(self) -> float:
        """The share of requests decided for the new version now."""
        if self.state == State.SHIFTING:
            return self.steps[self.step]
        return 1.0 if self.state in (State.FINISHING, State.DONE) else 0.0

    @property
    def pinning(self) -> bool:
        return self.state.active

    def decide(self) -> dict:
        """Pins for the next request: {expert: version}, the same version for all."""
        if not self.pinning:
            return {}
        self._acc += self.fraction
        new = self._acc >= 1.0 - 1e-9
        if new:
            self._acc -= 1.0
        self.served["new" if new else "old"] += 1
        return {e: self.new if new else self.old[e] for e in self.experts}

    # -- commands ------------------------------------------------------------------
    def advance(self, fraction: Optional[float] = None) -> None:
        """The next step (or the first step at or above ``fraction``)."""
        if self.state != State.SHIFTING:
            raise UpdateError(f"cannot advance an update that is {self.state.value}")
        if fraction is None:
            self.step = min(self.step + 1, len(self.steps) - 1)
        else:
            if not 0.0 < fraction <= 1.0:
                raise UpdateError(f"fraction must be in (0, 1], got {fraction}")
            self.step = next(i for i, s in enumerate(self.steps) if s >= fraction - 1e-12)
        self._event("advance")
        self._arm_auto()

    def finish(self, workers_of: dict) -> list:
        """All traffic to the new version; returns the (worker, expert) retires of the old
        version to send."""
        if self.state != State.SHIFTING:
            raise UpdateError(f"cannot finish an update that is {self.state.value}")
        self.state = State.FINISHING
        self.waiting = {(w, e) for e in self.experts for w in workers_of[e]}
        self._next_auto = None
        self._event("finish")
        retires = sorted(self.waiting)
        self._maybe_settled()  # no host to retire on (all away or being admitted): done now
        return retires

    def rollback(self) -> list:
        """All traffic back to the old version; returns the (worker, expert) retires of the
        new version to send now (loads still in flight are retired when they land)."""
        if self.state not in (State.LOADING, State.SHIFTING):
            raise UpdateError(f"cannot roll back an update that is {self.state.value}")
        self.state = State.ROLLING_BACK
        pending_loads = set(self.waiting)
        self.waiting = set(self.loaded) | pending_loads
        self._next_auto = None
        self._event("rollback")
        self._maybe_settled()
        return sorted(self.loaded)

    # -- acknowledgements from workers ---------------------------------------------
    def on_loaded(self, worker: int, expert: int) -> bool:
        """A worker holds the new version; True if it must be retired at once (rolling back)."""
        self.loaded.add((worker, expert))
        if self.state == State.LOADING:
            self.waiting.discard((worker, expert))
            if not self.waiting:
                self.state = State.SHIFTING
                self.step = 0
                self._event("loaded")
                self._arm_auto()
            return False
        return self.state == State.ROLLING_BACK

    def on_load_failed(self, worker: int, expert: int, why: str) -> list:
        """Returns the retires to send (every load that did succeed)."""
        if self.state == State.ROLLING_BACK:
            self.waiting.discard((worker, expert))
            self._maybe_settled(final=State.FAILED if self.error else None)
            return []
        if self.state != State.LOADING:
            return []
        self.error = f"worker {worker} could not load expert {expert}: {why}"
        self.state = State.ROLLING_BACK
        self.waiting = set(self.loaded) | (self.waiting - {(worker, expert)})
        self._event("load failed")
        self._maybe_settled(final=State.FAILED)
        return sorted(self.loaded)

    def on_retired(self, worker: int, expert: int) -> None:
        self.waiting.discard((worker, expert))
        if self.state == State.ROLLING_BACK:
            self.loaded.discard((worker, expert))
        self._maybe_settled(final=State.FAILED if self.error else None)

    def on_worker_lost(self, worker: int) -> None:
        """A worker's connection is gone: nothing will be acknowledged by it."""
        gone = {k for k in self.waiting if k[0] == worker}
        self.waiting -= gone
        self.loaded = {k for k in self.loaded if k[0] != worker}
        if self.state == State.LOADING and gone and not self.waiting:
            self.state, self.step = State.SHIFTING, 0
            self._event("loaded")
            self._arm_auto()
        self._maybe_settled(final=State.FAILED if self.error else None)

    def _maybe_settled(self, final: Optional[State] = None) -> None:
        if self.waiting:
            return
        if self.state == State.FINISHING:
            self.state = State.DONE
            self._event("done")
        elif self.state == State.ROLLING_BACK:
            self.state = final or State.ROLLED_BACK
            self._event(self.state.value)

    # -- automatic advance -----------------------------------------------------------
    def _arm_auto(self) -> None:
        if self.auto_interval is not None and self.state == State.SHIFTING:
            self._next_auto = self.clock() + self.auto_interval

    def due(self) -> Optional[str]:
        """'advance' or 'finish' when the automatic schedule says so, else None."""
        if self._next_auto is None or self.clock() < self._next_auto:
            return None
        self._next_auto = None
        return "finish" if self.step == len(self.steps) - 1 else "advance"

    # -- reporting -------------------------------------------------------------------
    def _event(self, what: str) -> None:
        self.timeline.append([round(self.clock() - self._t0, 6), what, self.fraction])

    def status(self) -> dict:
        return {"state": self.state.value, "experts": list(self.experts), "layer": self.layer,
                "new_router": self.router is not None,
                "old": [[e, self.old[e]] for e in self.experts], "new": self.new,
                "fraction": self.fraction, "step": self.step, "steps": list(self.steps),
                "served": {"old": self.served["old"], "new": self.served["new"]},
                "waiting": sorted([list(k) for k in self.waiting]), "error": self.error,
                "timeline": [list(t) for t in self.timeline], "auto_interval": self.auto_interval}
