"""Whether auto sends a round's parts in chunks at all: measured round costs decide.

The size model (gateway/chunking.py) prices chunks from each worker's costs; what it cannot
see (three busy processes on two cores, say) the rounds' own times show. No I/O here.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

from gateway.chunking import MAX_PROBE_EVERY, MODE_MARGIN, PROBE_EVERY, PROBES, SAMPLES, WARMUP, ColdFilter


class ChunkMode:
    """Whether auto chunks at all: decided from what rounds cost, measured, not modelled.
    The size model (:func:`choose_chunks`) cannot see everything chunks cost, e.g.
    three busy processes on two cores, where the gateway's work on replies as they land
    takes a core from a computing worker. So it is asked once per round the size model
    would chunk (only those: a round too small to chunk costs more per row, and counting it
    on the whole side would flatter chunks), and those of them alone in flight are timed per
    row, whole and chunked. After WARMUP whole rounds, every other measurable round (none
    other in flight when it goes) goes chunked until PROBES are measured, or SAMPLES when
    that close a call (:meth:`close_call`); then chunks are taken once the lower quartile of
    their last SAMPLES is cheaper than whole parts' by MODE_MARGIN, and kept while it is not
    dearer (:meth:`favours_chunks`), the other way tried again one measurable round in
    PROBE_EVERY, and in twice as many after each probe that left the choice as it was (up to
    MAX_PROBE_EVERY: a settled choice stops paying for probes; a flip starts over at
    PROBE_EVERY). Until both ways are measured a round that cannot be measured goes whole:
    under load few rounds are alone, and probing with rounds nobody can time would chunk
    half of them blind. A lower quartile, not a median: a stall only ever lengthens a round,
    and the first rounds to write a slot's pages stall, whichever way they went (a whole
    round after chunked ones writes the pages past the chunks); with a median, two stalled
    probes of three keep parts whole. One slow round, or two, still flips nothing.

    A round's time is not taken at all when it faulted in fresh memory: COLD_FAULTS minor
    page faults more than the fewest of the last SAMPLES rounds (both ways), counted in the
    gateway and, from their replies, its workers. All three probes of a warm-up can stall
    that way (each writing pages of slots no round had used; see
    docs/performance.md#constants-chosen-by-measurement), and a lower quartile cannot see past three. So probing goes on
    until PROBES warm rounds are in. A way whose rounds keep
    faulting (its steady state, not a start-up) is taken as it is after SAMPLES cold rounds
    in a row."""

    def __init__(self) -> None:
        self.samples: dict = {False: deque(maxlen=SAMPLES), True: deque(maxlen=SAMPLES)}  # chunked? -> s/row
        self.rounds = 0  # rounds measured
        self.asked = 0  # rounds asked about
        self._probe_turn = 0  # measurable rounds asked about
        self.probe_every = PROBE_EVERY  # measurable rounds from one probe to the next
        self._until_probe = PROBE_EVERY
        self._kept: Optional[bool] = None  # the way chosen when the last probe went
        self._way: Optional[bool] = None  # chunked? as last chosen (None: not chosen yet)
        self._faults = ColdFilter()  # the last rounds' minor page faults, both ways
        self._cold_run = {False: 0, True: 0}  # cold rounds in a row, each way
        self.cold = 0  # rounds left out as cold
        self._decided = False  # the first probes are behind (they are never taken up again)

    def record(self, chunked: bool, seconds: float, rows: int, faults: Optional[int] = None) -> None:
        """One round's time for ``rows`` rows, whole or ``chunked``; ``faults``: the minor
        page faults it took (None: not known, never cold)."""
        if rows <= 0 or seconds < 0:
            return
        if faults is not None:
            cold = self._faults.cold(faults)
            if cold and self._cold_run[chunked] < SAMPLES:
                self._cold_run[chunked] += 1
                self.cold += 1
                return
            if not cold:
                self._cold_run[chunked] = 0
        self.samples[chunked].append(seconds / rows)
        self.rounds += 1
        probes = len(self.samples[True])
        if len(self.samples[False]) >= WARMUP and probes >= PROBES and (probes >= SAMPLES or not self.close_call()):
            self._decided = True

    @property
    def settled(self) -> bool:
        """Both ways measured: the warm-up and the first probes are behind."""
        return self._decided

    def close_call(self) -> bool:
        """Whether chunked rounds measured within MODE_MARGIN of the margin itself: from
        2*MODE_MARGIN cheaper per row than whole ones to as dear. Three probes' lower
        quartile is their fastest, which can put chunks above whole parts where they run
        cheaper (see docs/performance.md#constants-chosen-by-measurement). Such a call is made on SAMPLES of each
        way."""
        c, w = self.per_row(True), self.per_row(False)
        return c is not None and bool(w) and abs(c / w - (1 - MODE_MARGIN)) < MODE_MARGIN

    def per_row(self, chunked: bool) -> Optional[float]:
        """The lower quartile of the last SAMPLES rounds' seconds per row, that way."""
        got = sorted(self.samples[chunked])
        return got[len(got) // 4] if got else None

    def _chunks_cheaper_by(self, margin: float) -> bool:
        c, w = self.per_row(True), self.per_row(False)
        return c is not None and w is not None and c < w * (1 - margin)

    def chunks_cheaper(self) -> bool:
        """Whether chunked rounds measured cheaper per row than whole ones, by MODE_MARGIN
        (False until both ways have a sample)."""
        return self._chunks_cheaper_by(MODE_MARGIN)

    def favours_chunks(self) -> bool:
        """The choice: chunks once they measured cheaper by MODE_MARGIN, and kept while they
        are not dearer than whole parts. The band between stops the choice from following
        noise back to whole parts (see docs/performance.md#constants-chosen-by-measurement)."""
        return self._chunks_cheaper_by(0.0 if self._way else MODE_MARGIN)

    def may_chunk(self, measurable: bool) -> bool:
        """Whether :meth:`want_chunks` could say yes for such a round: a round that cannot be
        measured goes whole unless the choice has settled on chunks, so the size model need
        not run for it (it runs on every part of every round otherwise)."""
        return measurable or (self._decided and self._way)

    def want_chunks(self, measurable: bool = True) -> bool:
        """For one round the size model would chunk: chunk it? ``measurable``: no other
        round is in flight as it goes (so it can be timed alone)."""
        self.asked += 1
        if len(self.samples[False]) < WARMUP:
            return False
        probing = not self._decided
        better = not probing and self.favours_chunks()
        if not probing:
            self._way = better
        if not measurable:
            return better
        self._probe_turn += 1
        if probing:
            return self._probe_turn % 2 == 0
        self._until_probe -= 1
        if self._until_probe > 0:
            return better
        settled = self._kept == better
        self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY) if settled else PROBE_EVERY
        self._kept, self._until_probe = better, self.probe_every
        return not better

    def snapshot(self) -> dict:
        """What the choice stands on: rounds asked about and measured, the lower quartiles
        per row (seconds), whole and chunked, and which way they favour (a gateway's config
        shows it)."""
        return {"asked": self.asked, "measured": self.rounds, "cold": self.cold, "settled": self.settled,
                "whole_s_per_row": self.per_row(False), "chunked_s_per_row": self.per_row(True),
                "chunks_cheaper": self.chunks_cheaper(), "chunks_kept": self._way}
