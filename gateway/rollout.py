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
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import numpy as np

from gateway.update import DEFAULT_STEPS, State, Update, UpdateError, check_steps
from gateway.workers import WorkerLink, WorkerSet
from workers import protocol as P

log = logging.getLogger("moe.rollout")

ACK_TIMEOUT = 30.0  # a load or retire not acknowledged this long is given up on


class Rollout:
    def __init__(self, workers: WorkerSet, n_experts: int, *, next_id: Callable[[], int],
                 ack_timeout: float = ACK_TIMEOUT, layers: Optional[dict] = None,
                 fingerprints: Optional[dict] = None) -> None:
        self.workers = workers
        self.n_experts = n_experts
        # layer -> its serving router: the pool's own dict, shared with its RoundBook, so that a
        # finished update that brought a new router installs it for every later request
        self.routers = layers if layers is not None else {P.DEFAULT_LAYER: None}
        self.fingerprints = dict(fingerprints or {})
        self._ids = next_id
        self.ack_timeout = ack_timeout
        self.update: Optional[Update] = None  # the current (or last) update
        self.updates: list[Update] = []  # every update, oldest first
        self._ctrl: dict = {}  # request id -> (op, worker index, expert, sent at)

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

    def owns(self, rid: Any) -> bool:
        return rid in self._ctrl

    def _install_router(self) -> None:
        """A finished update's new router serves its layer from now on (while FINISHING every
        request was already pinned to it)."""
        up = self.update
        if up is not None and up.router is not None and up.state == State.DONE \
                and self.routers.get(up.layer) is not up.router:
            self.routers[up.layer] = up.router
            log.info("layer %d: the router of version %d serves from now on", up.layer, up.new)

    # -- commands ----------------------------------------------------------------------------
    def _live_hosts(self, expert: int, layer: int = P.DEFAULT_LAYER) -> list[WorkerLink]:
        return [w for w in self.workers if w.hosts(expert, layer) and w.connected]

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
        old = {}
        for e in experts:
            hosts = self._live_hosts(e, layer)
            if not hosts:
                raise UpdateError(f"expert {e} has no connected worker")
            actives = {w.versions.get((layer, e)) for w in hosts}
            if len(actives) != 1:
                raise UpdateError(f"expert {e}'s workers disagree on its active version: "
                                  + ", ".join(f"{w.url}={w.versions.get((layer, e))}" for w in hosts))
            old[e] = actives.pop()
        if weights is not None:
            source: dict = {"weights": weights}
        elif seed is not None:
            source = {"seed": seed}
        else:
            source, router = self._checkpoint_source(checkpoint, layer, experts)
        up = Update(tuple(experts), old, version, steps=steps, auto_interval=auto_interval, layer=layer,
                    router=router if checkpoint is not None else None)
        loads = [(w, e) for e in experts for w in self._live_hosts(e, layer)]
        up.waiting = {(w.index, e) for w, e in loads}
        self.update = up
        self.updates.append(up)
        for w, e in loads:
            self._send(w, P.LOAD, e, layer, version=version, **source)
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
            for w, e in up.finish({e: [w.index for w in self._live_hosts(e, up.layer)] for e in up.experts}):
                self._send(self.workers[w], P.RETIRE, e, up.layer, version=up.old[e])
            self._install_router()
        elif action == "rollback":
            for w, e in up.rollback():
                self._send(self.workers[w], P.RETIRE, e, up.layer, version=up.new)
        return up.status()

    def status(self) -> Optional[dict]:
        return self.update.status() if self.update is not None else None

    # -- control requests --------------------------------------------------------------------
    def _send(self, w: WorkerLink, op: str, expert: int, layer: int, **fields: Any) -> None:
        rid = self._ids()
        self._ctrl[rid] = (op, w.index, expert, time.monotonic(), layer)
        if layer != P.DEFAULT_LAYER:
            fields["layer"] = layer
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
        layer = self.update.layer if self.update is not None else P.DEFAULT_LAYER
        for wi, e in pairs:
            self._send(self.workers[wi], P.RETIRE, e, layer, version=version)

    def on_reply(self, w: WorkerLink, h: dict) -> None:
        op, wi, expert, _, layer = self._ctrl.pop(P.request_id_of(h))
        up = self.update
        if h.get("op") == P.ERROR:
            why = f"{h.get('code')}: {h.get('message')}"
            log.warning("worker %s: %s of expert %d failed: %s", w.url, op, expert, why)
            self._gave_up(wi, op, expert, why)
            return
        if op == P.LOAD and h.get("op") == P.LOADED:
            w.held.setdefault((layer, expert), set()).add(int(h["version"]))
            if up is not None and up.on_loaded(wi, expert):  # rolled back meanwhile
                self._send(w, P.RETIRE, expert, layer, version=up.new)
        elif op == P.RETIRE and h.get("op") == P.RETIRED:
            w.held.get((layer, expert), set()).discard(int(h["version"]))
            w.versions[(layer, expert)] = int(h["active"])
            if up is not None:
                up.on_retired(wi, expert)
                self._install_router()

    def on_worker_down(self, w: WorkerLink) -> None:
        for rid in [r for r, c in self._ctrl.items() if c[1] == w.index]:
            del self._ctrl[rid]
        if self.update is not None:
            self.update.on_worker_lost(w.index)
            self._install_router()

    def tick(self, now: float) -> Optional[float]:
        """The automatic schedule, and acknowledgements that never came."""
        for rid, (op, wi, expert, sent, _) in list(self._ctrl.items()):
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
