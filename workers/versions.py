"""A worker's expert versions: the double buffer behind hot update.

``start_load`` reads a new version of an expert in a background thread while the serve loop
keeps serving, then holds it beside the active one (at most ``MAX_VERSIONS`` per expert);
a forward group may pin either version (``pick``); ``retire`` drops one, and retiring the
active one makes the other active. The loop never waits for a load: the loader hands the
result back through ``post`` (the serve loop's call_soon_threadsafe).

Experts are keyed by (layer, id). A new version comes from a seed, an .npz file or a
checkpoint directory (that layer's expert id; ``workers.loading.build_version``), and is the
same kind of object as the version it sits beside (a demo SwiGLUExpert, or a kernel).

New weights are read only from ``update_dir`` (a path that resolves outside it is refused
with the same answer as a missing file, so a caller cannot probe the worker's files).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Mapping, Optional

import numpy as np

from workers import protocol as P
from workers.loading import build_version

log = logging.getLogger("moe.worker")

MAX_VERSIONS = P.MAX_VERSIONS


def weights_nbytes(ex: Any) -> int:
    """Bytes of an expert's weights (a demo SwiGLUExpert's or a kernel's)."""
    n = getattr(ex, "nbytes", None)
    if isinstance(n, int):
        return n
    k = getattr(ex, "kernel", None)
    return int(getattr(k, "nbytes", 0) or 0) if k is not None else 0


class Versions:
    def __init__(self, experts: Mapping[tuple, Any], *, max_tokens: int, dtype: np.dtype,
                 update_dir: Optional[str], post: Callable[[Callable[[], None]], None],
                 reply: Callable[[Any, dict], None], max_experts: Optional[int] = None,
                 on_hosting: Callable[[], None] = lambda: None) -> None:
        self.active = dict(experts)  # (layer, expert id) -> the active version
        self.held = {k: {ex.version: ex} for k, ex in self.active.items()}  # (layer, id) -> version -> expert
        for ex in self.active.values():
            ex.fingerprint  # noqa: B018  (hashed once at start: info must answer at once)
        self.max_tokens = max_tokens
        self.dtype = dtype
        self.update_dir = os.path.realpath(update_dir) if update_dir else None
        self._post = post
        self._loading: dict = {}  # (layer, expert, version) -> the connection that asked
        self._reply = reply  # (connection, reply header): how a finished load is answered
        # physical copies this worker may host (loads of experts it does not host add one)
        self.max_experts = max(len(self.active), int(max_experts or 2 * len(self.active)))
        self._on_hosting = on_hosting  # the set of hosted experts changed (the daemon's tables)

    def table(self) -> list:
        """[[expert, active version, [held versions](, layer)], ...] (protocol.with_layer)"""
        return [P.with_layer([e, ex.version, sorted(self.held[(L, e)])], L)
                for (L, e), ex in sorted(self.active.items())]

    def weights(self) -> list:
        """Every held version's identity: [[layer, expert, version, fingerprint, source], ...]
        (protocol.weights_entry)."""
        return [P.weights_entry(L, e, v, ex.fingerprint, ex.source)
                for (L, e), held in sorted(self.held.items()) for v, ex in sorted(held.items())]

    def pick(self, layer: int, groups: list) -> list:
        """The expert object serving each forward group (its pinned version, or the active one)."""
        out = []
        for e, _, count, v in groups:
            if v is None or not count:
                out.append(self.active[(layer, e)])
                continue
            ex = self.held[(layer, e)].get(v)
            if ex is None:
                raise P.RequestError(P.UNKNOWN_VERSION, f"expert {e} of layer {layer} has no version {v} here "
                                                        f"(held: {sorted(self.held[(layer, e)])})")
            out.append(ex)
        return out

    def forget(self, conn) -> None:
        """A connection closed: loads it asked for still finish, but nobody is told."""
        for key, c in list(self._loading.items()):
            if c is conn:
                self._loading[key] = None

    # -- load ------------------------------------------------------------------
    def weights_path(self, name: str, directory: bool = False) -> str:
        """``name`` resolved inside update_dir, or RequestError (the same for every refusal).
        ``directory``: a checkpoint directory rather than an .npz file."""
        what = "checkpoint directory" if directory else ".npz file"
        refuse = P.RequestError(P.LOAD_FAILED, f"cannot load weights {name!r}: not a readable {what} in "
                                               "the worker's update directory")
        if self.update_dir is None:
            raise P.RequestError(P.LOAD_FAILED, "this worker accepts no weight files: start it with "
                                                "--update-dir DIR to allow loads from DIR")
        path = os.path.realpath(os.path.join(self.update_dir, name))
        ok = os.path.isdir(path) if directory else os.path.isfile(path)
        if os.path.commonpath([path, self.update_dir]) != self.update_dir or not ok:
            raise refuse
        return path

    def start_load(self, conn, req: "P.LoadRequest") -> Optional[dict]:
        """Begin loading; the reply now if there is nothing to do (already held). A load of an
        expert not hosted here adds a physical copy of it, if there is room."""
        key = (req.layer, req.expert)
        if key not in self.held:
            return self._start_new(conn, req)
        held = self.held[key]
        if req.version in held:  # idempotent: a retried load finds it done
            return self._loaded(req, held[req.version])
        if (*key, req.version) in self._loading:
            raise P.RequestError(P.BAD_REQUEST, f"expert {req.expert} version {req.version} is already loading")
        if len(held) + sum(1 for L, e, _ in self._loading if (L, e) == key) >= MAX_VERSIONS:
            raise P.RequestError(P.BAD_REQUEST, f"expert {req.expert} already holds versions {sorted(held)} "
                                                f"(at most {MAX_VERSIONS}): retire one first")
        path = self._source_path(req)
        self._loading[(*key, req.version)] = conn
        threading.Thread(target=self._load, args=(req, path), daemon=True,
                         name=f"load-l{req.layer}-e{req.expert}-v{req.version}").start()
        return None

    def _start_new(self, conn, req: "P.LoadRequest") -> None:
        key = (req.layer, req.expert)
        if any((L, e) == key for L, e, _ in self._loading):
            raise P.RequestError(P.BAD_REQUEST, f"expert {req.expert} of layer {req.layer} is already loading")
        hosting = len(self.active) + len({(L, e) for L, e, _ in self._loading if (L, e) not in self.active})
        if hosting >= self.max_experts:
            raise P.RequestError(P.BAD_REQUEST, f"this worker hosts {len(self.active)} experts (and loads "
                                                f"{hosting - len(self.active)}) of at most {self.max_experts}: "
                                                f"unhost one first, or start it with a larger --max-experts")
        path = self._source_path(req)
        self._loading[(*key, req.version)] = conn
        threading.Thread(target=self._load, args=(req, path), daemon=True,
                         name=f"host-l{req.layer}-e{req.expert}-v{req.version}").start()
        return None

    def _source_path(self, req: "P.LoadRequest") -> Optional[str]:
        if req.weights is not None:
            return self.weights_path(req.weights)
        if req.checkpoint is not None:
            return self.weights_path(req.checkpoint, directory=True)
        return None

    def template(self, layer: int) -> Any:
        """A hosted expert of ``layer`` (else of any layer): what a new copy is built like."""
        same = [ex for (L, _), ex in sorted(self.active.items()) if L == layer]
        return same[0] if same else next(iter(self.active.values()))

    def unhost(self, rid, expert: int, layer: int = P.DEFAULT_LAYER) -> dict:
        """Drop ``expert`` of ``layer`` with every version held (a forward already taken
        keeps the weights it bound)."""
        key = (layer, expert)
        if key not in self.active:
            raise P.RequestError(P.UNKNOWN_EXPERT, f"expert {expert} of layer {layer} is not hosted here")
        if len(self.active) == 1:
            raise P.RequestError(P.BAD_REQUEST, f"expert {expert} is this worker's only one")
        del self.active[key]
        del self.held[key]
        log.info("layer %d expert %d: unhosted (%d hosted)", layer, expert, len(self.active))
        self._on_hosting()
        r = {"op": P.UNHOSTED, "id": rid, "expert": expert}
        if layer != P.DEFAULT_LAYER:
            r["layer"] = layer
        return r

    @staticmethod
    def _loaded(req: "P.LoadRequest", ex: Any) -> dict:
        r = {"op": P.LOADED, "id": req.request_id, "expert": req.expert, "version": req.version,
             "fingerprint": ex.fingerprint, "source": ex.source, "nbytes": weights_nbytes(ex)}
        if req.layer != P.DEFAULT_LAYER:
            r["layer"] = req.layer
        return r

    def _load(self, req: "P.LoadRequest", path: Optional[str]) -> None:
        """Loader thread: build the new version off the serve loop, hand it over."""
        try:
            key = (req.layer, req.expert)
            ref = self.active.get(key)
            result: Any = build_version(req, path, ref if ref is not None else self.template(req.layer),
                                        max_tokens=self.max_tokens, new=ref is None)
            result.fingerprint  # noqa: B018  (hashed here, off the serve loop)
        except Exception as e:  # reported to the requester; the worker keeps serving
            result = e
        self._post(lambda: self._finish(req, result))

    def _finish(self, req: "P.LoadRequest", result: Any) -> None:
        key = (req.layer, req.expert)
        conn = self._loading.pop((*key, req.version), None)
        if isinstance(result, Exception):
            reply = P.error_reply(req.request_id, P.LOAD_FAILED,
                                  f"expert {req.expert} version {req.version}: {type(result).__name__}: {result}")
        else:
            if key not in self.active:  # a new physical copy: hosted, active at this version
                self.active[key] = result
                self.held[key] = {}
                self._on_hosting()
            self.held[key][req.version] = result
            log.info("layer %d expert %d: version %d loaded (held %s)", req.layer, req.expert, req.version,
                     sorted(self.held[key]))
            reply = self._loaded(req, result)
        if conn is not None:
            self._reply(conn, reply)

    # -- retire ----------------------------------------------------------------
    def retire(self, rid, expert: int, version: int, layer: int = P.DEFAULT_LAYER) -> dict:
        key = (layer, expert)
        held = self.held[key]
        if version not in held:
            raise P.RequestError(P.UNKNOWN_VERSION, f"expert {expert} has no version {version} "
                                                    f"(held: {sorted(held)})")
        if len(held) == 1:
            raise P.RequestError(P.BAD_REQUEST, f"version {version} is expert {expert}'s only one")
        del held[version]
        if self.active[key].version == version:  # the other one becomes the active one
            self.active[key] = next(iter(held.values()))
        log.info("layer %d expert %d: version %d retired; active %d", layer, expert, version,
                 self.active[key].version)
        r = {"op": P.RETIRED, "id": rid, "expert": expert, "version": version, "active": self.active[key].version}
        if layer != P.DEFAULT_LAYER:
            r["layer"] = layer
        return r
