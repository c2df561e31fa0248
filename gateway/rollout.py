"""Hot-update orchestration: gateway/update.py's state machine driven over the workers.

``start`` validates every argument before anything changes (a refused command leaves the
state machine as it was), then asks every worker hosting the experts to load the new
version (they keep serving); ``command`` advances, finishes or rolls back. Each load or
retire is a control request the worker answers; one that is not answered within
``ack_timeout`` counts as that worker lost for the update, so finishing and rolling back
always end, whatever a worker does.

An update changes experts of one layer (``layer``; 0 in the demo mode). Its new version is a
seed, an .npz file, or a checkpoint directory (``checkpoint``): the gateway reads that
layer's router and fingerprint from it, and every worker loads its experts of that layer
from the same directory (inside its --update-dir) and refuses them unless their fingerprint
is the one the gateway computed. When the new checkpoint's router differs from the one
serving, the update must cover every expert id of the layer (routed and shared): requests
decided for the new version are then routed by the new router, the others by the old one,
so no output mixes the two models. Only requests of the update's layer are pinned.

The versions an update starts from are the served ones (gateway/served.py); when it is done,
its new versions are. Every host's new version must have the fingerprint the first host
reported, or the update fails. ``settle`` is the operator's way to choose an expert's served
version by hand (the workers disagreed, or an adopted version is to be made official).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import numpy as np

from gateway.control import ControlChannel
from gateway.served import ServedSet, Weights
from gateway.update import DEFAULT_STEPS, State, Update, UpdateError, check_steps
from gateway.worker_link import WorkerLink
from gateway.workers import WorkerSet
from workers import protocol as P

log = logging.getLogger("moe.rollout")

ACK_TIMEOUT = 30.0  # a load or retire not acknowledged this long is given up on (gateway/control.py)


class Rollout:
    def __init__(self, workers: WorkerSet, n_experts: int, *, control: ControlChannel, served: ServedSet,
                 layers: Optional[dict] = None, fingerprints: Optional[dict] = None) -> None:
        self.workers = workers
        self.n_experts = n_experts
        # layer -> its serving router: the pool's own dict, shared with its RoundBook, so that a
        # finished update that brought a new router installs it for every later request
        self.routers = layers if layers is not None else {P.DEFAULT_LAYER: None}
        self.fingerprints = dict(fingerprints or {})
        self.control = control
        self.served = served
        self.update: Optional[Update] = None  # the current (or last) update
        self.updates: list[Update] = []  # every update, oldest first
        self._applied: Optional[Update] = None  # the last update whose outcome the served set took
        #: called with the keys whose served weights an operator settled (their hosts re-admit)
        self.on_settled: Callable[[list], None] = lambda keys: None
        #: why an update may not start now (a move of expert copies loading), or None
        self.blocked: Callable[[], Optional[str]] = lambda: None
        #: the workers the expert placement routes (layer, expert) to, or None (every host)
        self.routed: Callable[[int, int], Optional[tuple]] = lambda layer, expert: None

    # -- what requests get -------------------------------------------------------------------
    def decide(self, layer: int = P.DEFAULT_LAYER) -> dict:
        """Pins for the next request of ``layer`` ({expert: version}; empty when no update pins)."""
        up = self.update
        return up.decide() if up is not None and up.pinning and up.layer == layer else {}

    def router_for(self, layer: int, pins: dict) -> Any:
        """The router a request of ``layer`` pinned to ``pins`` routes with, when the update
        brings a new one and the pins are its new version; else None (the layer's own)."""
        up = self.update
        if up is None or up.router is None or up.layer != layer or not pins:
            return None
        return up.router if next(iter(pins.values())) == up.new else None

    # -- commands ----------------------------------------------------------------------------
    def _live_hosts(self, expert: int, layer: int = P.DEFAULT_LAYER) -> list[WorkerLink]:
        """Hosts of the expert that take part in updates: the workers the placement routes it
        to (every host, without one), connected and admitted (one being admitted is brought
        to the update's state by admission)."""
        routed = self.routed(layer, expert)
        return [w for w in self.workers if w.hosts(expert, layer) and w.admitted
                and (routed is None or w.index in routed)]

    def _n_ids(self, layer: int) -> int:
        r = self.routers.get(layer)
        return self.n_experts if r is None else int(getattr(r, "n_ids", r.n_experts))

    def start(self, experts: Any, version: Any, *, weights: Any = None, seed: Any = None,
              checkpoint: Any = None, layer: Any = None, steps: Any = None, auto_interval: Any = None) -> dict:
        """Load ``version`` of ``experts`` of ``layer`` on every worker hosting them, then
        shift traffic to it in ``steps``. Every argument is checked first: a refused start
        changes nothing."""
        if self.update is not None and self.update.state.active:
            raise UpdateError(f"an update is in progress ({self.update.state.value}); finish or roll it back")
        if self.blocked() is not None:
            raise UpdateError(self.blocked())
        layer = P.DEFAULT_LAYER if layer is None else layer
        if type(layer) is not int or layer not in self.routers:
            raise UpdateError(f"no layer {layer!r} here (layers: {sorted(self.routers)})")
        if not (isinstance(experts, (list, tuple)) and experts and all(type(e) is int for e in experts)):
            raise UpdateError(f"start needs experts: a list of expert ids, got {experts!r}")
        experts = sorted(set(experts))
        n_ids = self._n_ids(layer)
        bad = [e for e in experts if not 0 <= e < n_ids]
        if bad:
            raise UpdateError(f"no expert {bad} (the layer has {n_ids})")
        if type(version) is not int or version < 0:
            raise UpdateError(f"start needs an integer version >= 0, got {version!r}")
        if sum(v is not None for v in (weights, seed, checkpoint)) != 1:
            raise UpdateError("an update needs exactly one of weights (a file in the workers' update "
                              "directory), seed, or checkpoint (a checkpoint directory there)")
        for name, v in (("weights", weights), ("checkpoint", checkpoint)):
            if v is not None and not (isinstance(v, str) and v and "\0" not in v):
                raise UpdateError(f"{name} must be a path, got {v!r}")
        if seed is not None and (type(seed) is not int or seed < 0):
            raise UpdateError(f"seed must be an integer >= 0, got {seed!r}")
        steps = check_steps(steps or DEFAULT_STEPS)
        if auto_interval is not None:
            if not isinstance(auto_interval, (int, float)) or isinstance(auto_interval, bool) \
                    or not auto_interval > 0:
                raise UpdateError(f"auto interval must be > 0 seconds, got {auto_interval!r}")
            auto_interval = float(auto_interval)
        old = self._served_versions(experts, layer)
        if weights is not None:
            source: dict = {"weights": weights}
        elif seed is not None:
            source = {"seed": seed}
        else:
            source, router = self._checkpoint_source(checkpoint, layer, experts)
        up = Update(tuple(experts), old, version, steps=steps, auto_interval=auto_interval, layer=layer,
                    router=router if checkpoint is not None else None, source=dict(source))
        loads = [(w, e) for e in experts for w in self._live_hosts(e, layer)]
        up.waiting = {(w.index, e) for w, e in loads}
        self.update = up
        self.updates.append(up)
        for w, e in loads:
            self._send(w, P.LOAD, e, layer, dict(version=version, **source))
        log.info("update to version %d of experts %s of layer %d started", version, experts, layer)
        return up.status()

    def _checkpoint_source(self, path: str, layer: int, experts: list) -> tuple[dict, Any]:
        """The load fields for a checkpoint version of ``layer``, and the router its requests
        take (None: the serving one). The gateway reads the new layer's router and
        fingerprint itself; the workers check theirs against that fingerprint."""
        from gateway.layer import load_gateway_layers

        cur = self.routers.get(layer)
        if cur is None or not hasattr(cur, "rule"):
            raise UpdateError("a checkpoint version needs a gateway serving a checkpoint (--checkpoint)")
        try:
            new = load_gateway_layers(path, [layer])[layer]
        except (OSError, ValueError) as e:  # CheckpointError is a ValueError
            raise UpdateError(f"checkpoint {path}: {e}") from None
        r = new.router
        if (r.d_model, r.n_experts, r.n_shared, r.top_k) != (cur.d_model, cur.n_experts, cur.n_shared, cur.top_k):
            raise UpdateError(f"layer {layer} of {path} routes {r.n_experts}+{r.n_shared} experts top-{r.top_k} "
                              f"of width {r.d_model}; this gateway serves {cur.n_experts}+{cur.n_shared} "
                              f"top-{cur.top_k} of width {cur.d_model}")
        same = r.rule == cur.rule and all(
            (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))
            for a, b in ((r.weight, cur.weight), (r.bias, cur.bias), (r.shared_gate, cur.shared_gate)))
        if not same and experts != list(range(cur.n_ids)):
            raise UpdateError(f"layer {layer} of {path} has another router: update every expert id of the "
                              f"layer (--experts 0-{cur.n_ids - 1}) so that each request is served by one model")
        return {"checkpoint": path, "fingerprint": new.fingerprint}, (None if same else r)

    def _served_versions(self, experts: list, layer: int) -> dict:
        """{expert: its served version} for an update of ``experts``, or UpdateError when one
        is blocked, has no admitted worker, or has a worker being admitted (its state is
        being settled now: try again in a moment)."""
        old = {}
        for e in experts:
            key = (layer, e)
            why = self.served.why_blocked(key)
            if why is not None:
                raise UpdateError(f"expert {e} is not served: {why}")
            w = self.served.get(key)
            if w is None:
                raise UpdateError(f"expert {e} of layer {layer} is not served by this gateway")
            admitting = [h.url for h in self.workers if h.hosts(e, layer) and h.connected and not h.admitted]
            if admitting:
                raise UpdateError(f"expert {e}: worker(s) {admitting} are being brought to the served weights; "
                                  f"try again in a moment")
            if not self._live_hosts(e, layer):
                raise UpdateError(f"expert {e} has no connected worker")
            old[e] = w.version
        return old

    def command(self, action: str, fraction: Any = None) -> dict:
        """advance / finish / rollback / status of the current update."""
        up = self.update
        if action not in ("advance", "finish", "rollback", "status"):
            raise UpdateError(f"unknown update action {action!r}; use start, advance, finish, rollback, "
                              f"status, settle or served")
        if up is None:
            if action == "status":
                return {"state": "none"}
            raise UpdateError("no update has been started")
        if action == "advance":
            if fraction is not None and (not isinstance(fraction, (int, float)) or isinstance(fraction, bool)):
                raise UpdateError(f"fraction must be a number in (0, 1], got {fraction!r}")
            up.advance(None if fraction is None else float(fraction))
        elif action == "finish":
            for w, e in up.finish({e: [w.index for w in self._live_hosts(e, up.layer)] for e in up.experts}):
                self._send(self.workers[w], P.RETIRE, e, up.layer, {"version": up.old[e]})
            self._settle_outcome()
        elif action == "rollback":
            for w, e in up.rollback():
                self._send(self.workers[w], P.RETIRE, e, up.layer, {"version": up.new})
            self._settle_outcome()
        return up.status()

    def status(self) -> Optional[dict]:
        return self.update.status() if self.update is not None else None

    # -- settling an expert by hand --------------------------------------------------------------
    def settle(self, experts: Any, version: Any, *, layer: Any = None, weights: Any = None, seed: Any = None,
               checkpoint: Any = None) -> dict:
        """Serve ``version`` of ``experts`` (blocked ones, whose workers disagreed, or any): the
        source is the one given, else the one a connected worker holding that version reports;
        every host is then brought to it (admission). Refused while an update changes them."""
        layer = P.DEFAULT_LAYER if layer is None else layer
        if type(layer) is not int or layer not in self.routers:
            raise UpdateError(f"no layer {layer!r} here (layers: {sorted(self.routers)})")
        if not (isinstance(experts, (list, tuple)) and experts and all(type(e) is int for e in experts)):
            raise UpdateError(f"settle needs experts: a list of expert ids, got {experts!r}")
        experts = sorted(set(experts))
        bad = [e for e in experts if not 0 <= e < self._n_ids(layer)]
        if bad:
            raise UpdateError(f"no expert {bad} (the layer has {self._n_ids(layer)})")
        if type(version) is not int or version < 0:
            raise UpdateError(f"settle needs an integer version >= 0, got {version!r}")
        up = self.update
        if up is not None and up.state.active and up.layer == layer and set(up.experts) & set(experts):
            raise UpdateError(f"an update of experts {list(up.experts)} is in progress ({up.state.value}); "
                              f"finish or roll it back first")
        given = [v for v in (weights, seed, checkpoint) if v is not None]
        if len(given) > 1:
            raise UpdateError("settle takes at most one of weights, seed, checkpoint")
        chosen = {}
        for e in experts:
            key = (layer, e)
            found = [ws[version] for w in self.workers if w.hosts(e, layer) and w.connected
                     for ws in [w.weights.get(key, {})] if version in ws]
            fps = {fp for fp, _ in found}
            if given:
                source = {"weights": weights} if weights is not None else (
                    {"seed": seed} if seed is not None else {"checkpoint": checkpoint})
                try:
                    source = P.check_source(source)
                except P.RequestError as err:
                    raise UpdateError(err.message) from None
                chosen[key] = Weights(version, None, source)
            elif len(fps) == 1:
                chosen[key] = Weights(version, fps.pop(), next((src for _, src in found if src), None))
            elif fps:
                raise UpdateError(f"expert {e}: workers hold version {version} with different weights "
                                  f"({sorted(f[:12] for f in fps)}); give its source (seed, weights or checkpoint)")
            else:
                raise UpdateError(f"expert {e}: no connected worker holds version {version}; give its source "
                                  f"(seed, weights or checkpoint)")
        self.served.serve(chosen)
        self.served.adopted = {k: v for k, v in self.served.adopted.items() if k not in chosen}
        log.warning("experts %s of layer %d settled at version %d by an operator (served set %d)", experts, layer,
                    version, self.served.generation)
        self.on_settled(sorted(chosen))
        return {"state": "settled", "experts": experts, "layer": layer, "version": version,
                "generation": self.served.generation}

    # -- control requests --------------------------------------------------------------------
    def _send(self, w: WorkerLink, op: str, expert: int, layer: int, fields: dict) -> None:
        self.control.send(w, op, expert, layer, fields,
                          on_reply=lambda link, h: self._acked(link, op, expert, layer, h),
                          on_fail=lambda why: self._gave_up(w.index, op, expert, why))

    def _gave_up(self, wi: int, op: str, expert: int, why: str) -> None:
        up = self.update
        if up is None:
            return
        if op == P.LOAD:
            self._retire_all(up.on_load_failed(wi, expert, why), up.new)
        else:  # a retire nobody will acknowledge: the version is gone with the worker, or stays unused
            up.on_retired(wi, expert)
        self._settle_outcome()

    def _retire_all(self, pairs: list, version: int) -> None:
        layer = self.update.layer if self.update is not None else P.DEFAULT_LAYER
        for wi, e in pairs:
            self._send(self.workers[wi], P.RETIRE, e, layer, {"version": version})

    def _acked(self, w: WorkerLink, op: str, expert: int, layer: int, h: dict) -> None:
        up = self.update
        if up is None or up.layer != layer or expert not in up.experts:
            return
        if op == P.LOAD:
            fp = w.weights.get((layer, expert), {}).get(up.new, ("",))[0]
            first = up.fingerprints.setdefault(expert, fp)
            if fp != first:  # two hosts read other weights under one version: never serve both
                why = (f"worker {w.url} loaded version {up.new} of expert {expert} with fingerprint {fp[:12]}, "
                       f"another worker {first[:12]}: they do not read the same weights")
                log.error("update: %s", why)
                self._send(w, P.RETIRE, expert, layer, {"version": up.new})
                self._retire_all(up.on_load_failed(w.index, expert, why), up.new)
            elif up.on_loaded(w.index, expert):  # rolled back meanwhile
                self._send(w, P.RETIRE, expert, layer, {"version": up.new})
        else:
            up.on_retired(w.index, expert)
        self._settle_outcome()

    def admitted(self, w: WorkerLink) -> None:
        """``w`` was just admitted holding the update's new version beside the old one (it came
        back while the update loaded or shifted): a rollback or finish now covers it."""
        up = self.update
        if up is None or up.state not in (State.LOADING, State.SHIFTING):
            return
        for e in up.experts:
            if up.new in w.weights.get((up.layer, e), {}):
                up.loaded.add((w.index, e))

    def _settle_outcome(self) -> None:
        """A finished update's versions become the served ones (and its new router, if it
        brought one, serves its layer from now on); a rolled-back one changes nothing."""
        up = self.update
        if up is None or up is self._applied or up.state != State.DONE:
            return
        self._applied = up
        self.served.serve({(up.layer, e): Weights(up.new, up.fingerprints.get(e), up.source) for e in up.experts})
        for e in up.experts:
            self.served.adopted.pop((up.layer, e), None)
        log.info("update to version %d of experts %s of layer %d done: served set %d", up.new, list(up.experts),
                 up.layer, self.served.generation)
        if up.router is not None and self.routers.get(up.layer) is not up.router:
            self.routers[up.layer] = up.router
            log.info("layer %d: the router of version %d serves from now on", up.layer, up.new)

    def on_worker_down(self, w: WorkerLink) -> None:
        if self.update is not None:
            self.update.on_worker_lost(w.index)
            self._settle_outcome()

    def tick(self, now: float) -> Optional[float]:
        """The automatic schedule."""
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
