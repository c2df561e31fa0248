"""A fake expert worker for in-process tests of the gateway (a test double, not a product).

It speaks the real worker protocol (workers/protocol.py) over a real transport listener, on
its own serve loop in a thread, but computes something trivial and checkable: expert ``e``
at version ``v`` maps x to ``x * scale(e, v)`` with ``scale = e + 1 + 10 * v``, so a test
knows every output exactly (:meth:`FakeWorker.expected`). Behaviours a test may switch at
any time, to exercise the gateway's failure handling without processes and signals:

``delay``        seconds to wait before answering a forward (a slow worker)
``compute_s``    seconds each forward "computes" (sleeps, once read) and says it computed,
                 so the gateway measures a compute rate as from a real worker
``hang``         never answer forwards (a stopped worker that keeps its connections)
``fail``         answer forwards with an ``internal`` error
``crash()``      close every connection at once, stop listening (a killed worker)

``load`` (seed only: the seed is ignored, the version sets the scale), ``retire`` and
``weights`` work as on a real worker, so hot updates and admission run against it.
"""
from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import numpy as np

import transport
from transport.service.loop import ServeLoop
from workers import protocol as P


def scale(expert: int, version: int = 0) -> float:
    return float(expert + 1 + 10 * version)


def fingerprint(expert: int, version: int) -> str:
    """The fake weights' identity: their scale (what a real worker's hash stands for)."""
    return f"fake-scale-{scale(expert, version):g}"


class FakeWorker:
    def __init__(self, experts: Sequence[int], *, d_model: int, url: str = "tcp://127.0.0.1:0",
                 dtype=np.float32, max_tokens: int = 4096, secret: Optional[bytes] = None) -> None:
        self.experts = sorted(int(e) for e in experts)
        self.max_experts = 2 * len(self.experts)
        self.d_model = d_model
        self.dtype = np.dtype(dtype)
        self.max_tokens = max_tokens
        self.active = {e: 0 for e in self.experts}
        self.held = {e: {0} for e in self.experts}
        self.delay = 0.0
        self.compute_s = 0.0
        self.hang = False
        self.fail = False
        self.forwards = 0  # forward requests received
        self.fault_step: Optional[int] = None  # if set, each result says this many more page faults (flt)
        self.faults = 0
        self.rows = 0  # rows computed
        self._held_msgs: list = []  # forwards kept unanswered while hanging
        slot = max(64 << 10, max_tokens * d_model * self.dtype.itemsize)
        self.loop = ServeLoop()
        self.listener = transport.listen(url, slot_size=slot, nslots=8, timeout=10.0, secret=secret)
        self.url = self.listener.url
        self.loop.add_listener(self.listener, self._handle, max_connections=16, idle_timeout=None, name="gateway")
        self._thread = threading.Thread(target=self.loop.run, name=f"fake-worker-{self.url}", daemon=True)
        self._thread.start()

    # -- what a test computes against ----------------------------------------------------------
    def expected(self, x: np.ndarray, expert: int) -> np.ndarray:
        return x * scale(expert, self.active[expert])

    # -- behaviour switches --------------------------------------------------------------------
    def crash(self) -> None:
        """Close every connection and the listener at once (a killed worker)."""
        done = threading.Event()

        def go() -> None:
            self.loop.stop_accepting()
            for c in self.loop.connections():
                self.loop.close_connection(c, "crashed")
            self._held_msgs.clear()
            done.set()
        self.loop.call_soon_threadsafe(go)
        done.wait(5)

    def close(self) -> None:
        self.loop.request_stop()
        self._thread.join(5)
        for m in self._held_msgs:
            m.release()
        self.loop.close()

    def __enter__(self) -> "FakeWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the protocol ----------------------------------------------------------------------------
    def _handle(self, conn, msg) -> None:
        h = msg.header
        rid = P.request_id_of(h)
        op = h.get("op") if isinstance(h, dict) else None
        if op == P.FORWARD:
            self.forwards += 1
            if self.hang:
                self._held_msgs.append(msg)  # unanswered, and its slot (credit) kept
                return
            if self.delay:
                time.sleep(self.delay)
            self._forward(conn, msg)
            return
        msg.release()
        if op == P.INFO:
            self.loop.send(conn, {"op": P.INFO, "id": rid, "experts": self.experts, "versions": self._versions(),
                                  "d_model": self.d_model, "d_ff": 1, "dtype": self.dtype.name,
                                  "max_tokens": self.max_tokens, "pid": 0, "url": self.url,
                                  "max_experts": self.max_experts})
        elif op == P.PING:
            self.loop.send(conn, {"op": P.PONG, "id": rid, "experts": self.experts, "versions": self._versions(),
                                  "in_flight": 0, "draining": False, "counters": {}, "cpu_s": 0.0, "pid": 0})
        elif op == P.WEIGHTS:
            entries = [P.weights_entry(0, e, v, fingerprint(e, v), {"seed": v})
                       for e in self.experts for v in sorted(self.held[e])]
            self.loop.send(conn, P.weights_page(entries, h.get("start", 0), rid))
        elif op == P.LOAD:
            e, v = h["expert"], h["version"]
            if e not in self.held:  # a new physical copy, active at this version
                if len(self.experts) >= self.max_experts:
                    self.loop.send(conn, P.error_reply(rid, P.BAD_REQUEST, f"at most {self.max_experts} experts"))
                    return
                self.experts = sorted(self.experts + [e])
                self.held[e], self.active[e] = set(), v
            self.held[e].add(v)
            self.loop.send(conn, {"op": P.LOADED, "id": rid, "expert": e, "version": v,
                                  "fingerprint": fingerprint(e, v), "source": {"seed": v}})
        elif op == P.UNHOST:
            e = h["expert"]
            if e not in self.held or len(self.experts) == 1:
                self.loop.send(conn, P.error_reply(rid, P.BAD_REQUEST, f"cannot unhost expert {e}"))
                return
            self.experts.remove(e)
            del self.held[e], self.active[e]
            self.loop.send(conn, {"op": P.UNHOSTED, "id": rid, "expert": e})
        elif op == P.RETIRE:
            e, v = h["expert"], h["version"]
            self.held[e].discard(v)
            if self.active[e] == v:
                self.active[e] = max(self.held[e])
            self.loop.send(conn, {"op": P.RETIRED, "id": rid, "expert": e, "version": v, "active": self.active[e]})

    def _versions(self) -> list:
        return [[e, self.active[e], sorted(self.held[e])] for e in self.experts]

    def _forward(self, conn, msg) -> None:
        h = msg.header
        rid = P.request_id_of(h)
        if self.fail:
            msg.release()
            self.loop.send(conn, P.error_reply(rid, P.INTERNAL, "fake failure"))
            return
        try:
            batch = P.parse_forward(h, [b.nbytes for b in msg.buffers], dtype=self.dtype, d_model=self.d_model,
                                    max_rows=self.max_tokens, experts=self.experts, need_groups=True)
        except P.RequestError as e:
            msg.release()
            self.loop.send(conn, P.error_reply(rid, e.code, e.message))
            return
        shape = (batch.rows, self.d_model)
        x = msg.array(0, self.dtype, shape)
        t_in = time.perf_counter()
        if self.compute_s:
            time.sleep(self.compute_s)
        computed = time.perf_counter() - t_in if self.compute_s else 0.0

        def fill(view: memoryview) -> dict:
            y = np.frombuffer(view, dtype=self.dtype, count=batch.rows * self.d_model).reshape(shape)
            versions = []
            for e, start, count, v in batch.groups:
                version = self.active[e] if v is None else v
                y[start:start + count] = x[start:start + count] * scale(e, version)
                if v is not None and count:
                    versions.append([e, v])
            self.rows += batch.rows
            msg.release()
            reply = P.result_reply(rid, shape, self.dtype, compute_s=computed, experts=[], cpu_s=0.0, t_in=t_in,
                                   t_out=time.perf_counter())
            if versions:
                reply["versions"] = sorted(versions)
            if self.fault_step is not None:
                self.faults += self.fault_step
                reply["flt"] = self.faults
            return reply

        self.loop.reply(conn, batch.nbytes, fill)


def fake_layer_output(x: np.ndarray, routing, versions: Optional[dict] = None) -> np.ndarray:
    """What the gateway must return for ``x`` over fake workers: the routing's weighted sum
    of x * scale(e, version)."""
    versions = versions or {}
    y = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for e, w in zip(routing.topk_idx[t], routing.topk_weights[t]):
            if e >= 0:
                y[t] += w * x[t] * scale(int(e), versions.get(int(e), 0))
    return y.astype(x.dtype)
