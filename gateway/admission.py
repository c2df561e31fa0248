"""Admission: a worker that connects takes traffic only once it holds the served weights.

Every connection (the first, a reconnection after a respawn, a restart, a Ray restart, a
new worker) starts *admitting* (gateway/workers.py). :meth:`Admission.begin` plans from what
the worker holds (its ``weights`` pages, then each acknowledged load and retire) against what
the gateway serves (gateway/served.py): it sends the next loads and retires, one step at a
time, each acknowledged within the control channel's ``ack_timeout``, and admits the worker
once nothing differs. A worker that cannot get there (its update directory lacks the served
version's file, it holds a served version number with other weights, it does not answer) is
refused: its connection is dropped and retried slowly, the reason is in the log, /metrics and
``ping()``, and its experts are served by other copies or answered ``unavailable``.

While a hot update finishes or rolls back an expert the worker hosts, the worker waits (it
is admitted against the settled outcome); while an update loads or shifts, it is brought to
hold both versions, like the others.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from gateway.control import ControlChannel
from gateway.expert_placement import ExpertPlacement
from gateway.rollout import Rollout
from gateway.served import ServedSet, Step, key_name, next_step, show_source
from gateway.worker_link import Health, WorkerLink
from gateway.workers import WorkerSet
from workers import protocol as P

log = logging.getLogger("moe.admission")

MAX_STEPS = 8  # a worker not converged after this many steps is refused (each step is acknowledged)
DEFER_RECHECK = 0.05  # how soon a worker waiting for an update to settle is looked at again


@dataclass
class _Sync:
    started: float
    steps: int = 0
    pending: int = 0  # control requests of the current step not answered yet
    failed: Optional[str] = None
    waiting: bool = False  # for an update to settle
    loads: list = field(default_factory=list)


@dataclass
class AdmissionStats:
    admitted: int = 0  # workers admitted with nothing to change
    synced: int = 0  # workers admitted after loads or retires
    refused: int = 0
    seconds: list = field(default_factory=list)  # each synced worker's time from connect to admitted (last 256)
    seconds_total: float = 0.0

    def as_dict(self) -> dict:
        s = sorted(self.seconds)
        return {"admitted": self.admitted, "synced": self.synced, "refused": self.refused,
                "sync_seconds_median": s[len(s) // 2] if s else None, "sync_seconds_max": s[-1] if s else None}


class Admission:
    """``placement()``: the expert placement routing now (None: every hosted copy routes)."""

    def __init__(self, workers: WorkerSet, served: ServedSet, control: ControlChannel, rollout: Rollout,
                 placement: Callable[[], Optional[ExpertPlacement]] = lambda: None) -> None:
        self.workers = workers
        self.served = served
        self.control = control
        self.rollout = rollout
        self.placement = placement
        self.stats = AdmissionStats()
        self._syncs: dict[int, _Sync] = {}

    # -- the first connections ---------------------------------------------------------------
    def start(self) -> None:
        """Decide the served set from every connected worker's active weights (rule 2 of
        gateway/served.py), then admit each worker."""
        keys = sorted({(L, e) for w in self.workers for L, ids in w.layers.items() for e in ids})
        served = {}
        for key in keys:
            reports = {}
            for w in self.workers:
                if w.connected and w.hosts(key[1], key[0]):
                    held = w.weights.get(key, {})
                    v = w.versions.get(key)
                    reports[w.url] = (v, *held[v]) if v in held else None
            note = self.served.agree(key, reports)
            if note is not None:
                log.warning("%s", note)
            if key not in self.served.blocked:
                served[key] = self.served.active[key]
        self.served.serve(served)
        for w in self.workers:
            if w.connected:
                self.begin(w)

    # -- each connection -------------------------------------------------------------------
    def begin(self, w: WorkerLink) -> None:
        """``w`` just connected (admitting): bring it to the served weights."""
        self._syncs[w.index] = _Sync(time.monotonic())
        self._step(w)

    def recheck(self, keys: list) -> None:
        """The served weights of ``keys`` changed by hand: their admitted hosts are brought
        to them again, out of traffic meanwhile."""
        for w in self.workers:
            if w.admitted and any(w.hosts(e, L) for L, e in keys):
                w.state, w.why = Health.ADMITTING, "being brought to the settled weights"
                self.begin(w)

    def syncing(self, w: WorkerLink) -> bool:
        return w.index in self._syncs

    def on_worker_down(self, w: WorkerLink) -> None:
        self._syncs.pop(w.index, None)

    def _hosted(self, w: WorkerLink) -> list:
        return [(L, e) for L, ids in sorted(w.layers.items()) for e in sorted(ids)]

    def _keys(self, w: WorkerLink) -> tuple[list, list]:
        """(the experts ``w`` must hold at the served weights, the copies it hosts that the
        placement does not route to it and are to be dropped). A worker the placement routes
        nothing to (new, or drained) keeps what it hosts, brought to the served weights."""
        hosted = self._hosted(w)
        p = self.placement()
        routed = p.on(w.index) if p is not None else []
        if not routed:
            return hosted, []
        return routed, [k for k in hosted if k not in set(routed)]

    def _step(self, w: WorkerLink) -> None:
        sync = self._syncs.get(w.index)
        if sync is None or w.conn is None:
            return
        self._unblock(w)
        up = self.rollout.update
        keys, extra = self._keys(w)
        if extra:  # first, to make room (keeping one while none of its routed copies is hosted yet)
            drop = extra if any(w.hosts(e, L) for L, e in keys) else extra[1:]
            if drop:
                self._unhost(w, sync, drop)
                return
        wanted = self.served.wanted(keys, up if up is not None and up.state.active else None)
        if wanted is None:  # an update is settling an expert it hosts: wait for the outcome
            sync.waiting = True
            return
        sync.waiting = False
        step = next_step(w.weights, wanted, P.MAX_VERSIONS)
        if step.refuse is None and not step.done and sync.steps >= MAX_STEPS:
            step.refuse = f"not at the served weights after {MAX_STEPS} steps"
        if step.refuse is not None:
            self._refuse(w, step.refuse)
        elif step.done and extra:
            self._unhost(w, sync, extra)
        elif step.done:
            self._admit(w, sync)
        else:
            self._send(w, sync, step)

    def _send(self, w: WorkerLink, sync: _Sync, step: Step) -> None:
        sync.steps += 1
        sync.pending = len(step.loads) + len(step.retires)
        for key, weights in step.loads:
            log.info("worker %s: loading version %d of %s (%s)", w.url, weights.version, key_name(key),
                     show_source(weights.source))
            fields = {"version": weights.version, **(weights.source or {})}
            self.control.send(w, P.LOAD, key[1], key[0], fields,
                              on_reply=lambda link, h, k=key, want=weights: self._loaded(link, k, want),
                              on_fail=lambda why, k=key, want=weights: self._failed(
                                  w, f"cannot load version {want.version} of {key_name(k)} "
                                     f"({show_source(want.source)}): {why}"))
        for key, version in step.retires:
            self.control.send(w, P.RETIRE, key[1], key[0], {"version": version},
                              on_reply=lambda link, h: self._done_one(link),
                              on_fail=lambda why, k=key, v=version: self._failed(
                                  w, f"cannot retire version {v} of {key_name(k)}: {why}"))

    def _unhost(self, w: WorkerLink, sync: _Sync, keys: list) -> None:
        """Drop the copies the placement does not route to ``w`` (restarted with its start-up
        experts after copies moved away): their slots are the placement's."""
        sync.steps += 1
        sync.pending = len(keys)
        for L, e in keys:
            self.control.send(w, P.UNHOST, e, L, {}, on_reply=lambda link, h: self._done_one(link),
                              on_fail=lambda why, k=(L, e): self._failed(w, f"cannot unhost {key_name(k)}: {why}"))

    def _loaded(self, w: WorkerLink, key: tuple, want) -> None:
        fp = w.weights.get(key, {}).get(want.version, ("",))[0]
        if want.fingerprint is None:
            self.served.learn(key, want.version, fp)
            up = self.rollout.update
            if up is not None and up.layer == key[0] and up.new == want.version:
                up.fingerprints.setdefault(key[1], fp)
        elif fp != want.fingerprint:
            self._failed(w, f"loaded version {want.version} of {key_name(key)} ({show_source(want.source)}) with "
                            f"fingerprint {fp[:12]}, the gateway serves {want.fingerprint[:12]}: not the same weights")
            return
        self._done_one(w)

    def _done_one(self, w: WorkerLink) -> None:
        sync = self._syncs.get(w.index)
        if sync is None:
            return
        sync.pending -= 1
        if sync.pending <= 0:
            if sync.failed is not None:
                self._refuse(w, sync.failed)
            else:
                self._step(w)

    def _failed(self, w: WorkerLink, why: str) -> None:
        sync = self._syncs.get(w.index)
        if sync is None:
            return
        sync.failed = sync.failed or why
        self._done_one(w)

    def _admit(self, w: WorkerLink, sync: _Sync) -> None:
        self._syncs.pop(w.index, None)
        changed = sync.steps > 0
        self.workers.admit(w)
        self.rollout.admitted(w)
        if changed:
            took = time.monotonic() - sync.started
            self.stats.synced += 1
            self.stats.seconds = (self.stats.seconds + [took])[-256:]
            self.stats.seconds_total += took
            log.warning("worker %s admitted after being brought to the served weights (%d step(s), %.2f s)",
                        w.url, sync.steps, took)
        else:
            self.stats.admitted += 1
            log.info("worker %s admitted: it holds the served weights", w.url)

    def _refuse(self, w: WorkerLink, why: str) -> None:
        self._syncs.pop(w.index, None)
        self.stats.refused += 1
        self.workers.refuse(w, f"not admitted: {why}")

    def _unblock(self, w: WorkerLink) -> None:
        """Blocked experts ``w`` hosts whose connected hosts now all hold the same active
        weights are served again (rule 2 of gateway/served.py)."""
        for key in [k for k in self.served.blocked if w.hosts(k[1], k[0])]:
            reports = {}
            for h in self.workers:
                if h.connected and h.hosts(key[1], key[0]):
                    v = h.versions.get(key)
                    held = h.weights.get(key, {})
                    reports[h.url] = (v, *held[v]) if v in held else None
            kinds = {r[:2] if r else None for r in reports.values()}
            if len(kinds) == 1 and None not in kinds:
                self.served.agree(key, reports)
                self.served.serve({key: self.served.active[key]})
                log.warning("%s: its workers agree again (version %d): served", key_name(key),
                            self.served.active[key].version)

    def tick(self, now: float) -> Optional[float]:
        """Workers waiting for an update to settle are looked at again."""
        waiting = [i for i, s in self._syncs.items() if s.waiting]
        for i in waiting:
            self._step(self.workers[i])
        return now + DEFER_RECHECK if waiting else None

    def snapshot(self) -> dict:
        return {**self.stats.as_dict(),
                "syncing": [{"worker": i, "steps": s.steps, "waiting_for_update": s.waiting,
                             "seconds": round(time.monotonic() - s.started, 3)} for i, s in sorted(self._syncs.items())]}
