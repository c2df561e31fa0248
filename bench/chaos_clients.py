"""`moe-bench chaos`'s clients: the layer they check answers against, a client that sends
and checks every request, and the tally of outcomes."""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np


from bench.chaos_settings import D_FF, D_MODEL, N_EXPERTS, TOP_K, log


# -- outcomes -----------------------------------------------------------------------------------
@dataclass
class Outcome:
    t_sent: float
    t_done: float
    result: str  # ok, wrong, lost, error:<code>
    experts: tuple
    source: str  # steady, churn, probe


class Tally:
    """Every request's outcome, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.duplicated = 0
        self.late = 0  # replies that came after their request was counted lost
        self.send_failed = 0  # requests that could not even be sent (connection gone)
        self.latencies: list[float] = []  # ok steady requests, seconds

    def add(self, o: Outcome) -> None:
        with self.lock:
            self.outcomes.append(o)
            if o.result == "ok" and o.source == "steady":
                self.latencies.append(o.t_done - o.t_sent)

    def note(self, what: str) -> None:
        with self.lock:
            setattr(self, what, getattr(self, what) + 1)


class Layer:
    """Token batches and their reference outputs, computed once (the checks stay cheap)."""

    def __init__(self, seed: int, n: int = 96) -> None:
        from gateway.reference import ReferenceMoE

        self.ref = ReferenceMoE.from_seed(D_MODEL, D_FF, N_EXPERTS, TOP_K, seed=seed)
        rng = np.random.default_rng(seed + 1)
        self.pairs = []
        for i in range(n):
            x = rng.standard_normal((int(rng.integers(1, 33)), D_MODEL)).astype(np.float32)
            y = self.ref.forward(x)[0]
            experts = tuple(sorted({int(e) for e in self.ref.router.route(x).topk_idx.ravel() if e >= 0}))
            self.pairs.append((x, y, experts))

    def steered(self, experts: set, n: int = 4, seed: int = 0):
        """Tokens routed only to ``experts`` and their reference output (recovery probes)."""
        rng = np.random.default_rng(seed)
        rows: list = []
        while len(rows) < n:
            x = rng.standard_normal((256, D_MODEL)).astype(np.float32)
            for row, idx in zip(x, self.ref.router.route(x).topk_idx):
                if set(int(e) for e in idx) <= experts:
                    rows.append(row)
        x = np.stack(rows[:n])
        return x, self.ref.forward(x)[0], tuple(sorted(experts))


class Client:
    """A well-behaved client on a raw transport connection: each request gets a fresh id and
    its reply is matched by id, so duplicates and losses are seen (GatewayClient hides them)."""

    def __init__(self, url: str, secret: Optional[bytes], tally: Tally, deadline: float,
                 checker: Optional[Callable] = None) -> None:
        import transport

        self.conn = transport.connect(url, slot_size=1 << 16, nslots=4, timeout=10.0, secret=secret)
        self.tally, self.deadline = tally, deadline
        # checker(x, y, {expert: version}, t_sent, t_done) -> ok/wrong/stale/mixed: with hot updates
        # the right answer is the layer at the versions the answer names (bench/chaos_updates.py)
        self.checker = checker
        self.ids = itertools.count(1)
        self.done: set = set()
        self.abandoned: set = set()

    def request(self, x: np.ndarray, y_ref: np.ndarray, experts: tuple, source: str) -> str:
        import transport
        from workers import protocol as P

        rid = next(self.ids)
        t0 = time.monotonic()
        try:
            slot = self.conn.alloc(x.nbytes, timeout=self.deadline)
            np.copyto(slot.array(np.float32, x.shape), x)
            self.conn.send(P.forward_request(rid, x.shape, np.float32), [slot], timeout=self.deadline)
        except transport.TransportError:
            self.tally.note("send_failed")
            raise
        end = t0 + self.deadline
        while True:
            left = end - time.monotonic()
            if left <= 0:
                self.abandoned.add(rid)
                self.tally.add(Outcome(t0, time.monotonic(), "lost", experts, source))
                return "lost"
            try:
                msg = self.conn.recv(timeout=min(left, 0.5))
            except transport.Timeout:
                continue
            except transport.ConnectionClosed:
                self.tally.add(Outcome(t0, time.monotonic(), "lost", experts, source))
                log(f"{source} request {rid}: the gateway closed the connection before answering")
                raise
            with msg:
                h = msg.header
                got = P.request_id_of(h)
                if got != rid:
                    self.tally.note("late" if got in self.abandoned else "duplicated")
                    continue
                if got in self.done:
                    self.tally.note("duplicated")
                    continue
                self.done.add(rid)
                if h.get("op") == P.RESULT:
                    y = msg.array(0, np.float32, tuple(h["shape"]))
                    if self.checker is not None:
                        ev = h.get("expert_versions") or []
                        result = self.checker(x, y, {int(e): int(v) for e, v in ev}, t0, time.monotonic())
                    else:
                        ok = y.shape == y_ref.shape and np.allclose(y, y_ref, rtol=1e-4, atol=1e-5)
                        result = "ok" if ok else "wrong"
                else:
                    result = f"error:{h.get('code')}"
            self.tally.add(Outcome(t0, time.monotonic(), result, experts, source))
            # duplicates of this id may still come: check the socket briefly without waiting
            return result

    def drain_duplicates(self) -> None:
        """Read what is left (a duplicate reply would be here), briefly."""
        import transport
        from workers import protocol as P

        try:
            while True:
                with self.conn.recv(timeout=0.05) as msg:
                    self.tally.note("late" if P.request_id_of(msg.header) in self.abandoned else "duplicated")
        except transport.TransportError:
            pass

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass
