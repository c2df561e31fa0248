"""What rounds cost, fed to chunking as they happen: an observer of the round book.

The round book (gateway/rounds.py) tells it each message sent, each reply that came and each
round settled; it records on each worker's ChunkCosts (gateway/chunking.py) the send and
gather per row, the compute and serve time of each reply, the gap between a reply and the
next chunk's start, the ways out and in of a chunk, and, for rounds alone in flight, their
time per row whole and chunked (ChunkMode). It decides nothing about a round.

Replies that fault fresh memory are start-up costs, not the steady state: a reply whose
worker faulted that much (ChunkCosts.cold_reply), or any reply of a round that faulted in
fresh memory so far (ColdFilter), leaves its compute rate out of the size model.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from gateway.chunk_mode import ChunkMode
from gateway.chunking import ColdFilter

if TYPE_CHECKING:
    from gateway.requests import Round
    from gateway.worker_link import WorkerLink
    from gateway.workers import WorkerSet


class RoundCosts:
    def __init__(self, workers: "WorkerSet") -> None:
        self.workers = workers
        self.chunk_mode = ChunkMode()  # auto: chunks at all, from measured round costs
        # settled rounds' page faults: a round that wrote fresh memory here slows the compute
        # of its workers beside it, and their rates in it are left out (see replied)
        self.round_faults = ColdFilter()

    def prepare_next(self, rnd: "Round") -> None:
        """Size each of its workers' next part now, while they compute this one."""
        for w, rows in rnd.rows.items():
            link = self.workers[w]
            link.chunk_sizer.prepare(rows, "auto", link.chunk_costs, rnd.groups[w])

    @staticmethod
    def sent(w: "WorkerLink", t0: float, t1: float, rows: int) -> None:
        """A message of ``rows`` rows to ``w``: gathered from t0 to t1, sent by now."""
        t2 = time.perf_counter()
        w.chunk_costs.record_send(t2 - t1, rows)
        w.chunk_costs.record_gather(t2 - t0, rows)

    def replied(self, rnd: "Round", w: "WorkerLink", c: int, h: dict, rows: int, compute_s: float,
                faults: int) -> tuple[bool, float]:
        """A reply to chunk ``c`` of ``w``'s part: its compute and serve time, and the gap
        before it; (whether it was warm, the worker's busy seconds for it)."""
        busy = duration(h, compute_s)
        warm = not w.chunk_costs.cold_reply(faults)
        if warm:
            # nor a round that has faulted in fresh memory so far: the gateway's faults slow the
            # worker's compute beside them, and a rate measured then prices chunks out (see
            # docs/performance.md#constants-chosen-by-measurement)
            if not self.round_faults.is_cold(rnd.faults):
                w.chunk_costs.record_compute(rows, compute_s)
            w.chunk_costs.record_serve(busy - compute_s)
        _record_gap(rnd, w, c, h, measure=warm)
        return warm, busy

    @staticmethod
    def landed(rnd: "Round", w: "WorkerLink", c: int, h: dict, rows: int, now: float) -> None:
        """A chunk's reply summed by ``now``: its way back and, for a chunk after the first,
        its way in (only for a worker on this machine: its clock is ours)."""
        if not w.local:
            return
        t_out, t_rx, began = h.get("t_out"), h.get("t_rx"), rnd.gather_t.get((w.index, c))
        if isinstance(t_out, float):
            w.chunk_costs.record_out(now - t_out, rows)
        if isinstance(t_rx, float) and began is not None:
            w.chunk_costs.record_in(t_rx - began, rows)

    def settled(self, rnd: "Round", timed: bool) -> None:
        """Every part of ``rnd`` is done; ``timed``: it was alone in flight and failed nothing,
        so it is timed to its last combine."""
        self.round_faults.remember(rnd.faults)
        if timed:
            # timed to its last combine: a part sent whole is combined after its last reply,
            # and that combine is what chunks, summed as they land, hide
            rnd.to_combine = sum(r.round is rnd for r in rnd.requests)
            rnd.on_combined = self._timed
            if not rnd.to_combine:
                rnd.combined()

    def _timed(self, rnd: "Round", seconds: float) -> None:
        """A round alone in flight, from its plan to its last combine: each worker's time in
        it with no token to compute (parts sent whole: what chunks could hide), and, for
        rounds the size model would chunk, its time per row, whole or chunked."""
        for wi, busy in rnd.busy.items():
            if len(rnd.bounds[wi]) == 2:
                self.workers[wi].chunk_costs.record_idle(max(0.0, seconds - busy))
        if rnd.eligible:
            self.chunk_mode.record(rnd.chunked, seconds, sum(rnd.rows.values()), rnd.faults)


def _record_gap(rnd: "Round", w: "WorkerLink", c: int, h: dict, measure: bool = True) -> None:
    """The worker's time from replying to chunk c - 1 to taking chunk c, when chunk c was
    already sent as that reply came (each clock compared only with itself). ``measure``
    False: only note this reply's clocks, for the next chunk's gap."""
    t_in, t_out = h.get("t_in"), h.get("t_out")
    prev: Optional[tuple] = rnd.last_reply.get(w.index)
    now = time.perf_counter()
    if isinstance(t_out, float):
        rnd.last_reply[w.index] = (t_out, now)
    sent = rnd.sent_t.get((w.index, c))
    if measure and prev is not None and sent is not None and isinstance(t_in, float) and sent < prev[1] \
            and t_in >= prev[0]:
        lo, hi = rnd.chunk_bounds(w.index, c)
        w.chunk_costs.record_gap(t_in - prev[0], hi - lo)


def duration(h: dict, compute_s: float) -> float:
    """The worker's time handling a message, from the receive and reply clocks its reply
    carries (its compute alone from a worker that sends none)."""
    t_in, t_out = h.get("t_in"), h.get("t_out")
    if isinstance(t_in, float) and isinstance(t_out, float) and 0.0 <= t_out - t_in < 3600.0:
        return t_out - t_in
    return compute_s
