"""Hot updates for ``moe-bench chaos --updates``: a driver that starts, advances, finishes and
rolls back updates at random while the chaos kills and stops workers, and the record that
says, for any moment, which versions of each expert the gateway may answer with.

An answer names the version of every expert that computed it (``expert_versions``). It is
*right* when it equals the reference layer at exactly those versions (bench/versioned.py),
*stale* when one of them was not being served at any moment of the request's life (a
version not yet started, or already retired: what a worker that came back with other
weights would answer), and *mixed* when it used two experts of one update at different
sides of it.
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from bench.versioned import VersionedReference

ACTIONS = ("advance", "finish", "rollback")
SETTLE_TIMEOUT = 60.0  # the most one update command waits for its state to settle


@dataclass
class UpdateSpan:
    """One update: its experts, old versions, new version, and when it was started and
    ended (monotonic seconds; ``ended`` None while it runs), and how."""

    experts: tuple
    old: dict
    new: int
    started: float
    ended: Optional[float] = None
    outcome: str = ""  # done, rolled_back, failed


@dataclass
class VersionBook:
    """Which version of each expert may answer when (thread-safe)."""

    n_experts: int
    spans: list = field(default_factory=list)
    served: dict = field(default_factory=dict)  # expert -> [(version, since, until or None)]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.served = {e: [(0, float("-inf"), None)] for e in range(self.n_experts)}

    def current(self, e: int) -> int:
        with self.lock:
            return self.served[e][-1][0]

    def begin(self, span: UpdateSpan) -> None:
        with self.lock:
            self.spans.append(span)

    def discard(self, span: UpdateSpan) -> None:
        """An update the gateway refused to start: it never served."""
        with self.lock:
            self.spans.remove(span)

    def end(self, span: UpdateSpan, outcome: str, t: float) -> None:
        with self.lock:
            span.ended, span.outcome = t, outcome
            if outcome == "done":
                for e in span.experts:
                    v, since, _ = self.served[e][-1]
                    self.served[e][-1] = (v, since, t)
                    self.served[e].append((span.new, span.started, None))

    def allowed(self, e: int, v: int, t0: float, t1: float) -> bool:
        """Whether version ``v`` of expert ``e`` could serve at some moment of [t0, t1]: it
        was served then, or an update of ``e`` to ``v`` was running then (its traffic split)."""
        with self.lock:
            for ver, since, until in self.served[e]:
                if ver == v and since <= t1 and (until is None or until >= t0):
                    return True
            return any(e in s.experts and s.new == v and s.started <= t1 and (s.ended is None or s.ended >= t0)
                       for s in self.spans)

    def mixed(self, versions: dict, t0: float, t1: float) -> bool:
        """Whether an answer used two experts of one update at different sides of it."""
        with self.lock:
            for s in self.spans:
                if s.started > t1 or (s.ended is not None and s.ended < t0):
                    continue
                sides = {versions[e] == s.new for e in s.experts if e in versions}
                if len(sides) > 1:
                    return True
        return False


class UpdateDriver:
    """Random hot updates against a gateway until stopped: start an update of one to three
    experts to a fresh version (a fresh seed), then advance, finish or roll back at random;
    each command waits for the state to settle. A refused command (an expert whose worker is
    down or being admitted, say) is counted and tried again later."""

    def __init__(self, url: str, secret: Optional[bytes], book: VersionBook, ref: VersionedReference, *,
                 gap: tuple = (0.5, 2.0), seed: int = 0, log: Callable[[str], None] = print) -> None:
        self.url, self.secret, self.book, self.ref = url, secret, book, ref
        self.gap, self.rng, self.log = gap, random.Random(seed), log
        self.stop = threading.Event()
        self.counts: dict = {}
        self.version = 0
        self.thread = threading.Thread(target=self._run, daemon=True, name="updates")
        self.current: Optional[UpdateSpan] = None

    def start(self) -> "UpdateDriver":
        self.thread.start()
        return self

    def close(self) -> dict:
        self.stop.set()
        self.thread.join(SETTLE_TIMEOUT + 10)
        return dict(self.counts)

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def _run(self) -> None:
        from gateway.client import GatewayClient
        from workers.protocol import RemoteError

        client = None
        while not self.stop.wait(self.rng.uniform(*self.gap)):
            try:
                if client is None:
                    client = GatewayClient(self.url, timeout=10.0, secret=self.secret)
                self._act(client)
            except RemoteError as e:
                self._count("refused")
                self.log(f"update command refused: {e.message}")
            except Exception as e:  # a connection lost with the gateway's load: reconnect
                self._count("errors")
                self.log(f"update driver: {type(e).__name__}: {e}")
                if client is not None:
                    client.close()
                client = None
        if client is not None:
            client.close()

    def _act(self, c) -> None:
        span = self.current
        if span is None:
            experts = sorted(self.rng.sample(range(self.book.n_experts), self.rng.randint(1, 3)))
            self.version += 1
            seed = self.rng.randrange(1, 1 << 30)
            self.ref.add_version(self.version, seed)
            old = {e: self.book.current(e) for e in experts}
            span = UpdateSpan(tuple(experts), old, self.version, time.monotonic())
            self.book.begin(span)  # before the command: its loads may serve as soon as it lands
            try:
                st = c.update("start", experts=experts, version=self.version, seed=seed, steps=[0.25, 0.5, 1.0])
            except BaseException:
                self.book.discard(span)
                raise
            self.current = span
            self._count("started")
            self._settle(c, st)
            return
        action = self.rng.choice(ACTIONS)
        st = c.update(action)
        self._count(action)
        self._settle(c, st)

    def _settle(self, c, st: dict) -> None:
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while st["state"] in ("loading", "finishing", "rolling_back") and time.monotonic() < deadline:
            time.sleep(0.05)
            st = c.update("status")
        if st["state"] in ("done", "rolled_back", "failed"):
            self.book.end(self.current, st["state"], time.monotonic())
            self._count(st["state"])
            self.log(f"update to version {self.current.new} of experts {list(self.current.experts)}: {st['state']}"
                     + (f" ({st['error']})" if st.get("error") else ""))
            self.current = None

    def finish(self, c) -> None:
        """End the running update (rolled back), so the run ends on a served set."""
        if self.current is not None:
            try:
                self._settle(c, c.update("rollback"))
            except Exception as e:
                self.log(f"final rollback: {e}")
