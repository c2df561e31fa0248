"""A worker's expert versions: the double buffer behind hot update.

``start_load`` reads a new version of an expert in a background thread while the serve loop
keeps serving, then holds it beside the active one (at most ``MAX_VERSIONS`` per expert);
a forward group may pin either version (``pick``); ``retire`` drops one, and retiring the
active one makes the other active. The loop never waits for a load: the loader hands the
result back through ``post`` (the serve loop's call_soon_threadsafe).

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
from workers.expert import SwiGLUExpert

log = logging.getLogger("moe.worker")

MAX_VERSIONS = 2  # versions held per expert: the active one and one being rolled out


class Versions:
    def __init__(self, experts: Mapping[int, SwiGLUExpert], *, max_tokens: int, dtype: np.dtype,
                 update_dir: Optional[str], post: Callable[[Callable[[], None]], None],
                 reply: Callable[[Any, dict], None]) -> None:
        self.active = dict(experts)  # expert id -> the active version
        self.held = {e: {ex.version: ex} for e, ex in self.active.items()}  # id -> version -> expert
        self.max_tokens = max_tokens
        self.dtype = dtype
        self.update_dir = os.path.realpath(update_dir) if update_dir else None
        self._post = post
        self._loading: dict = {}  # (expert, version) -> the connection that asked
        self._reply = reply  # (connection, reply header): how a finished load is answered

    def table(self) -> list:
        """[[expert, active version, [held versions]], ...]"""
        return [[e, ex.version, sorted(self.held[e])] for e, ex in sorted(self.active.items())]

    def pick(self, groups: list) -> list:
        """The expert object serving each forward group (its pinned version, or the active one)."""
        out = []
        for e, _, count, v in groups:
            if v is None or not count:
                out.append(self.active[e])
                continue
            ex = self.held[e].get(v)
            if ex is None:
                raise P.RequestError(P.UNKNOWN_VERSION, f"expert {e} has no version {v} here "
                                                        f"(held: {sorted(self.held[e])})")
            out.append(ex)
        return out

    def forget(self, conn) -> None:
        """A connection closed: loads it asked for still finish, but nobody is told."""
        for key, c in list(self._loading.items()):
            if c is conn:
                self._loading[key] = None

    # -- load ------------------------------------------------------------------
    def weights_path(self, name: str) -> str:
        """``name`` resolved inside update_dir, or RequestError (the same for every refusal)."""
        refuse = P.RequestError(P.LOAD_FAILED, f"cannot load weights {name!r}: not a readable .npz file in "
                                               "the worker's update directory")
        if self.update_dir is None:
            raise P.RequestError(P.LOAD_FAILED, "this worker accepts no weight files: start it with "
                                                "--update-dir DIR to allow loads from DIR")
        path = os.path.realpath(os.path.join(self.update_dir, name))
        if os.path.commonpath([path, self.update_dir]) != self.update_dir or not os.path.isfile(path):
            raise refuse
        return path

    def start_load(self, conn, req: "P.LoadRequest") -> Optional[dict]:
        """Begin loading; the reply now if there is nothing to do (already held)."""
        held = self.held[req.expert]
        if req.version in held:  # idempotent: a retried load finds it done
            return {"op": P.LOADED, "id": req.request_id, "expert": req.expert, "version": req.version}
        if (req.expert, req.version) in self._loading:
            raise P.RequestError(P.BAD_REQUEST, f"expert {req.expert} version {req.version} is already loading")
        if len(held) + sum(1 for e, _ in self._loading if e == req.expert) >= MAX_VERSIONS:
            raise P.RequestError(P.BAD_REQUEST, f"expert {req.expert} already holds versions {sorted(held)} "
                                                f"(at most {MAX_VERSIONS}): retire one first")
        path = self.weights_path(req.weights) if req.weights is not None else None
        self._loading[(req.expert, req.version)] = conn
        threading.Thread(target=self._load, args=(req, path), daemon=True,
                         name=f"load-e{req.expert}-v{req.version}").start()
        return None

    def _load(self, req: "P.LoadRequest", path: Optional[str]) -> None:
        """Loader thread: build the new version off the serve loop, hand it over."""
        try:
            ref = self.active[req.expert]
            if path is not None:
                ex = SwiGLUExpert.from_npz(path, req.expert, max_tokens=self.max_tokens, dtype=self.dtype)
            else:
                ex = SwiGLUExpert.from_seed(req.expert, ref.d_model, ref.d_ff, seed=req.seed, dtype=self.dtype,
                                            max_tokens=self.max_tokens)
            if (ex.d_model, ex.d_ff) != (ref.d_model, ref.d_ff):
                raise ValueError(f"weights are ({ex.d_model}, {ex.d_ff}), this worker serves "
                                 f"({ref.d_model}, {ref.d_ff})")
            ex.version = req.version
            result: Any = ex
        except Exception as e:  # reported to the requester; the worker keeps serving
            result = e
        self._post(lambda: self._finish(req, result))

    def _finish(self, req: "P.LoadRequest", result: Any) -> None:
        conn = self._loading.pop((req.expert, req.version), None)
        if isinstance(result, Exception):
            reply = P.error_reply(req.request_id, P.LOAD_FAILED,
                                  f"expert {req.expert} version {req.version}: {type(result).__name__}: {result}")
        else:
            self.held[req.expert][req.version] = result
            log.info("expert %d: version %d loaded (held %s)", req.expert, req.version,
                     sorted(self.held[req.expert]))
            reply = {"op": P.LOADED, "id": req.request_id, "expert": req.expert, "version": req.version}
        if conn is not None:
            self._reply(conn, reply)

    # -- retire ----------------------------------------------------------------
    def retire(self, rid, expert: int, version: int) -> dict:
        held = self.held[expert]
        if version not in held:
            raise P.RequestError(P.UNKNOWN_VERSION, f"expert {expert} has no version {version} "
                                                    f"(held: {sorted(held)})")
        if len(held) == 1:
            raise P.RequestError(P.BAD_REQUEST, f"version {version} is expert {expert}'s only one")
        del held[version]
        if self.active[expert].version == version:  # the other one becomes the active one
            self.active[expert] = next(iter(held.values()))
        log.info("expert %d: version %d retired; active %d", expert, version, self.active[expert].version)
        return {"op": P.RETIRED, "id": rid, "expert": expert, "version": version,
                "active": self.active[expert].version}
