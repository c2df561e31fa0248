"""Hot-update orchestration: gateway/update.py's state machine driven over the workers.

``start`` validates every argument before anything changes (a refused command leaves the
state machine as it was), then asks every worker hosting the experts to load the new
version (they keep serving); ``command`` advances, finishes or rolls back. Each load or
retire is a control request the worker answers; one that is not answered within
``ack_timeout`` counts as that worker lost for the update, so finishing and rolling back
always end, whatever a worker does.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from gateway.update import DEFAULT_STEPS, State, Update, UpdateError, check_steps
from gateway.workers import WorkerLink, WorkerSet
from workers import protocol as P

log = logging.getLogger("moe.rollout")

ACK_TIMEOUT = 30.0  # a load or retire not acknowledged this long is given up on


class Rollout:
    def __init__(self, workers: WorkerSet, n_experts: int, *, next_id: Callable[[], int],
                 ack_timeout: float = ACK_TIMEOUT) -> None:
        self.workers = workers
        self.n_experts = n_experts
        self._ids = next_id
        self.ack_timeout = ack_timeout
        self.update: Optional[Update] = None  # the current (or last) update
        self.updates: list[Update] = []  # every update, oldest first
        self._ctrl: dict = {}  # request id -> (op, worker index, expert, sent at)

    # -- what requests get -------------------------------------------------------------------
    def decide(self) -> dict:
        """Pins for the next request ({expert: version}; empty when no update pins)."""
        up = self.update
        return up.decide() if up is not None and up.pinning else {}

    def owns(self, rid: Any) -> bool:
        return rid in self._ctrl

    # -- commands ----------------------------------------------------------------------------
    def _live_hosts(self, expert: int) -> list[WorkerLink]:
        return [w for w in self.workers if expert in w.experts and w.connected]

    def start(self, experts: Any, version: Any, *, weights: Any = None, seed: Any = None,
              steps: Any = None, auto_interval: Any = None) -> dict:
        """Load ``version`` of ``experts`` on every worker hosting them, then shift traffic
        to it in ``steps``. Every argument is checked first: a refused start changes nothing."""
        if self.update is not None and self.update.state.active:
            raise UpdateError(f"an update is in progress ({self.update.state.value}); finish or roll it back")
        if not (isinstance(experts, (list, tuple)) and experts and all(type(e) is int for e in experts)):
            raise UpdateError(f"start needs experts: a list of expert ids, got {experts!r}")
        experts = sorted(set(experts))
        bad = [e for e in experts if not 0 <= e < self.n_experts]
        if bad:
            raise UpdateError(f"no expert {bad} (the layer has {self.n_experts})")
        if type(version) is not int or version < 0:
            raise UpdateError(f"start needs an integer version >= 0, got {version!r}")
        if (weights is None) == (seed is None):
            raise UpdateError("an update needs exactly one of weights (a file in the workers' update "
                              "directory) or seed")
        if weights is not None and not (isinstance(weights, str) and weights and "\0" not in weights):
            raise UpdateError(f"weights must be a file name, got {weights!r}")
        if seed is not None and (type(seed) is not int or seed < 0):
            raise UpdateError(f"seed must be an integer >= 0, got {seed!r}")
        steps = check_steps(steps or DEFAULT_STEPS)
        if auto_interval is not None:
            if not isinstance(auto_interval, (int, float)) or isinstance(auto_interval, bool) \
                    or not auto_interval > 0:
                raise UpdateError(f"auto interval must be > 0 seconds, got {auto_interval!r}")
            auto_interval = float(auto_interval)
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
        up = Update(tuple(experts), old, version, steps=steps, auto_interval=auto_interval)
        loads = [(w, e) for e in experts for w in self._live_hosts(e)]
        up.waiting = {(w.index, e) for w, e in loads}
        self.update = up
        self.updates.append(up)
        source = {"weights": weights} if weights is not None else {"seed": seed}
        for w, e in loads:
            self._send(w, P.LOAD, e, version=version, **source)
        log.info("update to version %d of experts %s started", version, experts)
        return up.status()

    def command(self, action: str, fraction: Any = None) -> dict:
        """advance / finish / rollback / status of the current update."""
        up = self.update
        if action not in ("advance", "finish", "rollback", "status"):
            raise UpdateError(f"unknown update action {action!r}; use start, advance, finish, rollback, status")
        if up is None:
            if action == "status":
                return {"state": "none"}
            raise UpdateError("no update has been started")
        if action == "advance":
            if fraction is not None and (not isinstance(fraction, (int, float)) or isinstance(fraction, bool)):
                raise UpdateError(f"fraction must be a number in (0, 1], got {fraction!r}")
            up.advance(None if fraction is None else float(fraction))
        elif action == "finish":
            for w, e in up.finish({e: [w.index for w in self._live_hosts(e)] for e in up.experts}):
                self._send(self.workers[w], P.RETIRE, e, version=up.old[e])
        elif action == "rollback":
            for w, e in up.rollback():
                self._send(self.workers[w], P.RETIRE, e, version=up.new)
        return up.status()

    def status(self) -> Optional[dict]:
        return self.update.status() if self.update is not None else None

    # -- control requests --------------------------------------------------------------------
    def _send(self, w: WorkerLink, op: str, expert: int, **fields: Any) -> None:
        rid = self._ids()
        self._ctrl[rid] = (op, w.index, expert, time.monotonic())
        if not self.workers.send(w, P.request(op, rid, expert=expert, **fields)):
            self._ctrl.pop(rid, None)
            self._gave_up(w.index, op, expert, f"{op} could not be sent to {w.describe()}")

    def _gave_up(self, wi: int, op: str, expert: int, why: str) -> None:
        up = self.update
        if up is None:
            return
        if op == P.LOAD:
            self._retire_all(up.on_load_failed(wi, expert, why), up.new)
        else:  # a retire nobody will acknowledge: the version is gone with the worker, or stays unused
            up.on_retired(wi, expert)

    def _retire_all(self, pairs: list, version: int) -> None:
        for wi, e in pairs:
            self._send(self.workers[wi], P.RETIRE, e, version=version)

    def on_reply(self, w: WorkerLink, h: dict) -> None:
        op, wi, expert, _ = self._ctrl.pop(P.request_id_of(h))
        up = self.update
        if h.get("op") == P.ERROR:
            why = f"{h.get('code')}: {h.get('message')}"
            log.warning("worker %s: %s of expert %d failed: %s", w.url, op, expert, why)
            self._gave_up(wi, op, expert, why)
            return
        if op == P.LOAD and h.get("op") == P.LOADED:
            w.held.setdefault(expert, set()).add(int(h["version"]))
            if up is not None and up.on_loaded(wi, expert):  # rolled back meanwhile
                self._send(w, P.RETIRE, expert, version=up.new)
        elif op == P.RETIRE and h.get("op") == P.RETIRED:
            w.held.get(expert, set()).discard(int(h["version"]))
            w.versions[expert] = int(h["active"])
            if up is not None:
                up.on_retired(wi, expert)

    def on_worker_down(self, w: WorkerLink) -> None:
        for rid in [r for r, c in self._ctrl.items() if c[1] == w.index]:
            del self._ctrl[rid]
        if self.update is not None:
            self.update.on_worker_lost(w.index)

    def tick(self, now: float) -> Optional[float]:
        """The automatic schedule, and acknowledgements that never came."""
        for rid, (op, wi, expert, sent) in list(self._ctrl.items()):
            if now - sent > self.ack_timeout:
                del self._ctrl[rid]
                log.warning("worker %s did not acknowledge %s of expert %d in %.0f s: giving up on it",
                            self.workers[wi].url, op, expert, self.ack_timeout)
                self._gave_up(wi, op, expert, f"no acknowledgement in {self.ack_timeout:.0f} s")
        up = self.update
        if up is not None and up.pinning:
            due = up.due()
            if due is not None:
                try:
                    self.command(due)
                except UpdateError as e:
                    log.warning("automatic update %s: %s", due, e)
            return now + 0.1 if up.auto_interval is not None else None
        return None

    @property
    def state(self) -> Optional[State]:
        return self.update.state if self.update is not None else None
