"""When each worker's last outstanding reply is due, so the loop can busy-poll for it.

Woken from a sleep, the gateway's thread runs a while after a worker's reply was sent (in a
VM, the wake-up of a halted virtual CPU), on every round, whole or chunked: a large share
of a one-token forward, a small one of a 256-token one (see docs/performance.md#reply-spin). Spinning for every
reply would cost a core the workers compute on. So only a worker's *last* outstanding message gets a
window, predicted from its measured costs (:class:`~gateway.chunking.ChunkCosts`: its
compute per row at that size and its time outside compute), only if that is short (see
COMPUTE_MAX), and only where the gateway has a processor no local worker needs. The
messages before the last are summed as they land; their wake-up delays nothing the worker
waits for.

No I/O: the round book tells it what was sent and answered (:class:`ReplyClock`), the
loop asks it for a window (:meth:`ReplyClock.window`). Times are ``time.monotonic()``.
"""
from __future__ import annotations

import os
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Optional

#: only messages predicted to compute at most this long get a window: there a wake-up is a
#: large share of the wait. Longer ones gain nothing measurable, nor do windows for every
#: chunk's reply, not only the last (see docs/performance.md#reply-spin)
COMPUTE_MAX = 1e-3
#: a window opens this long before the predicted reply, and closes as long after it
LEAD_MIN = 0.4e-3
#: plus this share of the predicted compute (its run-to-run spread; see docs/performance.md#reply-spin)
LEAD_SHARE = 0.05
#: and never more than this each side: a worse prediction costs a sleep's wake-up, no more
LEAD_MAX = 2e-3
#: replies whose lateness against the costs' prediction centres the next windows: the
#: costs leave out the reply's way back (over tcp a copy through the socket that grows
#: with the rows)
LAGS = 16


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


@dataclass
class _Worker:
    outstanding: dict = field(default_factory=dict)  # message key -> (rows, sent at), in send order
    replied_at: float = float("-inf")  # its last reply: when it started on the next message
    window: Optional[tuple] = None  # (opens, closes) last given for its last message
    predicted: bool = False  # for its last message as it stands (window None: it gets none)
    due: float = 0.0  # what its costs alone predicted for that message
    lags: deque = field(default_factory=lambda: deque(maxlen=LAGS))  # replies' time past that


@dataclass
class ReplyClock:
    """Predicted reply times of the workers' last outstanding messages.

    ``cpus``: processors the gateway and its local workers share (default: this process's
    affinity); ``local_workers``: workers on this machine (shm://, loopback addresses). A
    window is given only when each of them and the gateway can have a processor: otherwise
    the worker that has just replied, the one computing and the spinning gateway share too
    few processors, and the tail gets slower (see docs/performance.md#reply-spin)."""

    cpus: int = field(default_factory=usable_cpus)
    local_workers: int = 0
    enabled: bool = True
    windows: int = 0  # last messages given a window (and still last when answered)
    hits: int = 0  # ... whose reply came inside it
    early: int = 0  # ... before it opened
    late: int = 0  # ... after it closed (or never: the part failed)
    _workers: dict = field(default_factory=dict)

    def sent(self, worker: int, key: Hashable, rows: int, now: float) -> None:
        st = self._workers.setdefault(worker, _Worker())
        st.outstanding[key] = (rows, now)
        st.predicted = False
        if st.window is not None:  # its last message is no longer the last
            st.window = None
            self.windows -= 1

    def replied(self, worker: int, key: Hashable, now: float) -> None:
        """A reply (result or error) to message ``key`` of ``worker`` landed at ``now``."""
        st = self._workers.get(worker)
        if st is None or st.outstanding.pop(key, None) is None:
            return
        st.replied_at = now
        st.predicted = False
        if st.window is not None and not st.outstanding:
            opens, closes = st.window
            st.lags.append(now - st.due)
            if now < opens:
                self.early += 1
            elif now <= closes:
                self.hits += 1
            else:
                self.late += 1
            st.window = None

    def forget(self, worker: int, keys=None) -> None:
        """Messages that will not be answered (``keys``; None: all of ``worker``'s)."""
        st = self._workers.get(worker)
        if st is None:
            return
        for key in (list(st.outstanding) if keys is None else keys):
            st.outstanding.pop(key, None)
        st.predicted = False
        if not st.outstanding and st.window is not None:
            self.late += 1
            st.window = None

    def window(self, now: float, costs_of) -> Optional[tuple[float, float]]:
        """The earliest (opens, closes) still ahead of ``now`` among the workers whose one
        outstanding message has a prediction, or None. ``costs_of(worker)``: its
        :class:`~gateway.chunking.ChunkCosts` (None: not measured)."""
        if not self.enabled or self.local_workers >= self.cpus:
            return None
        best = None
        for w, st in self._workers.items():
            if len(st.outstanding) != 1:
                continue
            if not st.predicted:  # once per last message: the loop asks every iteration
                st.predicted = True
                st.window = self._predict(st, costs_of(w))
                if st.window is not None:
                    self.windows += 1
            if st.window is not None and st.window[1] > now and (best is None or st.window[0] < best[0]):
                best = st.window
        return best

    @staticmethod
    def _predict(st: _Worker, costs) -> Optional[tuple[float, float]]:
        (rows, sent_at), = st.outstanding.values()
        per_row = costs.seconds_per_row(rows) if costs is not None else None
        if per_row is None:
            return None
        compute = rows * per_row
        if compute > COMPUTE_MAX:
            return None
        st.due = max(sent_at, st.replied_at) + (costs.serve_s or 0.0) + compute
        due = st.due + (statistics.median(st.lags) if st.lags else 0.0)
        lead = min(LEAD_MAX, LEAD_MIN + LEAD_SHARE * compute)
        return due - lead, due + lead

    def snapshot(self) -> dict:
        return {"enabled": self.enabled, "cpus": self.cpus, "local_workers": self.local_workers,
                "windows": self.windows, "hits": self.hits,
                "early": self.early, "late": self.late}

    def clear(self) -> None:
        for w in list(self._workers):
            self.forget(w)
