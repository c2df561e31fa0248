"""Control requests to workers (load, retire, unhost), each acknowledged or given up on.

One channel serves every owner of a worker's weights: the hot update (gateway/rollout.py),
admission (gateway/admission.py) and moves of copies (gateway/rebalancer.py). A request's owner passes what to do with the
worker's answer and with a failure (an error reply, the worker lost, no answer within
``ack_timeout``); every request ends in exactly one of them. The worker's acknowledged
state is kept on its link (``WorkerLink.weights``), the truth admission plans from.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from gateway.worker_link import WorkerLink
from gateway.workers import WorkerSet
from workers import protocol as P

log = logging.getLogger("moe.control")

OnReply = Callable[[WorkerLink, dict], None]
OnFail = Callable[[str], None]


@dataclass
class _Pending:
    op: str
    worker: int
    expert: int
    layer: int
    sent: float
    on_reply: OnReply
    on_fail: OnFail


class ControlChannel:
    def __init__(self, workers: WorkerSet, *, next_id: Callable[[], int], ack_timeout: float) -> None:
        self.workers = workers
        self._ids = next_id
        self.ack_timeout = ack_timeout
        self._pending: dict[int, _Pending] = {}

    def send(self, w: WorkerLink, op: str, expert: int, layer: int, fields: dict, *,
             on_reply: OnReply, on_fail: OnFail) -> None:
        """Send ``op`` for (layer, expert) with ``fields``; one of the callbacks runs later
        (on_fail at once when it cannot be sent)."""
        rid = self._ids()
        self._pending[rid] = _Pending(op, w.index, expert, layer, time.monotonic(), on_reply, on_fail)
        if layer != P.DEFAULT_LAYER:
            fields = {**fields, "layer": layer}
        if not self.workers.send(w, P.request(op, rid, expert=expert, **fields)):
            self._pending.pop(rid, None)
            on_fail(f"{op} could not be sent to {w.describe()}")

    def owns(self, rid: Any) -> bool:
        return rid in self._pending

    def pending(self, worker: int) -> int:
        """Control requests to worker ``worker`` not answered yet."""
        return sum(1 for p in self._pending.values() if p.worker == worker)

    def on_reply(self, w: WorkerLink, h: dict) -> None:
        p = self._pending.pop(P.request_id_of(h))
        if h.get("op") == P.ERROR:
            why = f"{h.get('code')}: {h.get('message')}"
            log.warning("worker %s: %s of expert %d failed: %s", w.url, p.op, p.expert, why)
            p.on_fail(why)
            return
        key = (p.layer, p.expert)
        try:
            if p.op == P.LOAD and h.get("op") == P.LOADED:
                fp = h.get("fingerprint")
                w.loaded(key, int(h["version"]), fp if isinstance(fp, str) else "", h.get("source"))
            elif p.op == P.RETIRE and h.get("op") == P.RETIRED:
                w.retired(key, int(h["version"]), int(h["active"]))
            elif p.op == P.UNHOST and h.get("op") == P.UNHOSTED:
                w.unhosted(key)
            else:
                raise ValueError(f"unexpected answer {str(h)[:120]}")
        except (KeyError, TypeError, ValueError) as e:
            p.on_fail(f"malformed {p.op} acknowledgement: {e}")
            return
        p.on_reply(w, h)

    def on_worker_down(self, w: WorkerLink) -> None:
        """Nothing more will come from ``w``: its requests are dropped (their owners hear of
        the loss from the pool, and treat it as a loss, not as a refusal)."""
        for rid in [r for r, p in self._pending.items() if p.worker == w.index]:
            del self._pending[rid]

    def tick(self, now: float) -> Optional[float]:
        """Requests not acknowledged within ack_timeout are given up; when to look next."""
        for rid, p in list(self._pending.items()):
            if now - p.sent > self.ack_timeout:
                del self._pending[rid]
                log.warning("worker %s did not acknowledge %s of expert %d in %.0f s: giving up on it",
                            self.workers[p.worker].url, p.op, p.expert, self.ack_timeout)
                p.on_fail(f"no acknowledgement of {p.op} in {self.ack_timeout:.0f} s")
        if not self._pending:
            return None
        return min(p.sent for p in self._pending.values()) + self.ack_timeout
