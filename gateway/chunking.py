"""Chunked rounds: how a worker's part of a round is cut into messages, and how big a chunk.

A worker's part of a round is one block of rows grouped by expert. Sent whole, the worker
computes only once the whole block has arrived, and the gateway waits while it computes.
Cut into chunks of at most ``C`` rows (between expert groups where it can: :func:`part_bounds`),
each its own message, the worker starts on the first chunk
while the next is gathered and in flight, and a request whose rows all came back is combined
while the worker computes the rest. What that can save is the worker's time with no token
to compute in a round sent whole; what it costs is a message per chunk and, a smaller
matrix product often running slower per row, the compute lost to smaller products. Both are
measured on each worker (:class:`ChunkCosts`) and the size chosen where the saving beats the
cost, or fixed by the operator. No I/O here: the rules are tested alone.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from gateway.chunk_bounds import EDGE, split_part

#: chunk sizes tried are powers of two from here: below it every BLAS kernel runs far from
#: its rate and the per-message cost dominates
MIN_CHUNK = 32
#: chunks must save more than this share of the part's compute (measurement noise aside)
MARGIN = 0.02
DECAY = 0.9  # weight of the past in the decayed sums below
#: a sample past CLIP times what its estimate expects counts as CLIP times it (plus
#: CLIP_FLOOR seconds, for estimates near zero): one stall (a page-fault storm, a
#: descheduled process) must not make messages or a size look dear for good -- auto stops
#: sending what looks dear, and so stops measuring it (see docs/performance.md#constants-chosen-by-measurement)
CLIP = 2.0
CLIP_FLOOR = 1e-3
WARMUP = 4  # rounds sent whole (and measured) before auto first tries chunks
PROBES = 3  # then rounds sent in chunks, to measure them
SAMPLES = 8  # the last rounds of each way that the choice looks at
# chunks are taken only once that much cheaper per row: a wider margin kept parts whole where
# chunks measured cheaper (see docs/performance.md#constants-chosen-by-measurement)
MODE_MARGIN = 0.02
PROBE_EVERY = 16  # one round in this many goes the other way, so both stay measured...
MAX_PROBE_EVERY = 256  # ...one in twice as many each time a probe left the choice as it was
#: a part the size model keeps whole only because its chunk sizes measured slow goes in
#: chunks one round in this many, PROBES times, then in twice as many each time (ChunkSizer;
#: see docs/performance.md#constants-chosen-by-measurement)
REPROBE_EVERY = 4
#: a round that took this many minor page faults more than the fewest of the last SAMPLES
#: rounds wrote fresh memory (1 MiB of 4 KiB pages): its time is a start-up cost, and the
#: whole-or-chunked choice leaves it out (ChunkMode.record; see docs/performance.md#constants-chosen-by-measurement)
COLD_FAULTS = 256
MAX_CHUNKS = 64  # auto's smallest size tried cuts a part in at most this many
OUT_ROWS = 512  # replies from this many rows measure the way back per row (ChunkCosts.out)
#: a chunk size's compute rate prices it (choose_chunks) only once this many of its replies
#: are measured: a size's first replies are its start-up, slower per row than what follows,
#: and priced from them it sends the next rounds whole (see docs/performance.md#constants-chosen-by-measurement)
RATE_SAMPLES = 3

ChunkSetting = Union[str, int]  # "auto", or a fixed size in rows (0: never chunk)


def parse_chunk_rows(value: ChunkSetting) -> ChunkSetting:
    """``"auto"``, ``"off"``/0 (never chunk) or a positive row count; ValueError otherwise."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "auto":
            return "auto"
        if v in ("off", "0"):
            return 0
        try:
            value = int(v)
        except ValueError:
            raise ValueError(f"chunk rows must be 'auto', 'off' or a row count, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"chunk rows must be 'auto', 'off' or a row count >= 0, got {value!r}")
    return value


def chunk_rows_flag(value: str) -> str:
    """The argparse type of every ``--chunk-rows``: one spelling per setting (auto, off, or
    rows), so a running gateway's setting compares with a flag's."""
    import argparse
    try:
        v = parse_chunk_rows(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return "off" if v == 0 else str(v)


def _clipped(x: float, expected: Optional[float], floor: float = 0.0) -> float:
    """``x`` bounded by CLIP times ``expected`` (at least 0: a fitted line may dip below
    it, and a bound below 0 would feed the fit its own error) plus ``floor``."""
    return x if expected is None else min(x, CLIP * max(0.0, expected) + floor)


def _bucket(rows: int) -> int:
    """Half octaves: 128 rows and 250 rows are told apart (a chunk and a part it came from)."""
    return round(2 * math.log2(max(1, int(rows))))


class DecayedLine:
    """A line ``y = a + b x`` fitted to decayed sums (the past weighs DECAY per sample), for
    a cost with a fixed part per message and a part growing with its rows: ``a`` is what one
    more message costs, ``b x`` is paid whole or chunked alike."""

    __slots__ = ("sums",)

    def __init__(self) -> None:
        self.sums = [0.0] * 5  # n, x, y, x^2, x*y

    def record(self, x: float, y: float) -> None:
        g = self.sums
        if g[0] >= 3:  # a fit to clip against
            y = _clipped(y, self.predict(x), CLIP_FLOOR)
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            g[i] = DECAY * g[i] + v

    def _slope(self) -> Optional[float]:
        """``b`` (clamped at 0), None where the x seen do not spread enough to fit."""
        n, sx, sy, sxx, sxy = self.sums
        den = n * sxx - sx * sx
        return None if den <= 1e-9 * max(1.0, n * sxx) else max(0.0, (n * sxy - sx * sy) / den)

    def predict(self, x: float) -> Optional[float]:
        """``a + b x`` as fitted (the mean where it cannot fit), None before the first sample."""
        n, sx, sy = self.sums[:3]
        if n <= 0:
            return None
        b = self._slope() or 0.0
        return (sy - b * sx) / n + b * x

    @property
    def intercept(self) -> Optional[float]:
        """``a`` clamped to [0, mean]; the mean itself where the x seen do not spread enough to
        fit (all of it then counts as fixed), None before the first sample."""
        n, sx, sy = self.sums[:3]
        if n <= 0:
            return None
        b = self._slope()
        return sy / n if b is None else min(sy / n, max(0.0, (sy - b * sx) / n))


class ColdFilter:
    """Tells samples taken while fresh memory was written (a new slot's pages, a first large
    batch) from the steady state, by the minor page faults each took: COLD_FAULTS more than
    the fewest of the last SAMPLES is cold. Faults every sample alike are the baseline; the
    first sample has nothing to compare with and counts."""

    def __init__(self) -> None:
        self._recent: deque = deque(maxlen=SAMPLES)

    def is_cold(self, faults: int) -> bool:
        """Whether a sample that took ``faults`` is cold."""
        return bool(self._recent) and faults > min(self._recent) + COLD_FAULTS

    def remember(self, faults: int) -> None:
        self._recent.append(faults)

    def cold(self, faults: int) -> bool:
        """Whether a sample that took ``faults`` is cold (and remember it)."""
        got = self.is_cold(faults)
        self.remember(faults)
        return got


def _record_way(way: deque, seconds: float, rows: int) -> None:
    """One chunk's time on a way (in or back), per row, from a large enough chunk."""
    if 0.0 <= seconds < 1.0 and rows >= OUT_ROWS:  # else a clock from elsewhere, or a stall
        way.append(seconds / rows)


@dataclass
class ChunkCosts:
    """What one worker costs, measured from its replies: the fixed cost of one message
    (the gateway's send and receive handling plus the worker's own outside its compute),
    and compute seconds per row by message size (power-of-two buckets, decayed sums so a
    block weighs by its rows)."""

    # the gateway's time to send one (after its gather), by size (half-octave buckets:
    # the last SAMPLES). Over tcp a send copies what the socket takes at once: its time
    # grows with the rows up to the socket's buffer, then stays flat, and that copy is paid
    # whole or chunked alike. No line fits that; each size's time bounds the fixed part
    # from above (see send_s).
    send: dict = field(default_factory=dict)
    serve: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))  # the worker's time on one outside its compute
    # send_s, serve_s and seconds_per_row until what they read is recorded again: the size
    # model asks for them for every size it weighs, many times a round
    _fixed: dict = field(default_factory=dict, repr=False, compare=False)
    # the worker's time between replying to one chunk and taking the next one, already
    # sent: its reply's send, its loop, and its own copying of bytes where the transport
    # makes it copy (tcp: growing with the rows)
    gap: DecayedLine = field(default_factory=DecayedLine)
    # its time with no token to compute in the last SAMPLES rounds sent whole. A worker's
    # first rounds (its slots' pages touched for the first time) run several times the
    # rest, and once auto chunks only its probes go whole, so a mean or a median would carry
    # the first rounds for long. A stall only ever lengthens a round: the least of them is
    # the estimate (idle_s)
    idle: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))
    # seconds a row from a chunk's reply leaving the worker (its clock: only a worker on this
    # machine) to its rows summed here: the way back alone, for chunks of OUT_ROWS rows or
    # more (the last SAMPLES). Over tcp it is dearer a row than half a whole round's no-token
    # time (the gateway reads and sums while the worker computes beside it), so the back
    # ramp grows slower than the front one (back_growth). Not a line: a small
    # chunk's reply can wait behind the gateway's sends, and a fit to those waits put the
    # whole cost in the fixed part
    out: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))
    # seconds a row from our gather of a chunk after a part's first to the worker having it
    # (its clock, ``t_rx``: only a worker on this machine that receives while it computes),
    # chunks of OUT_ROWS rows or more (the last SAMPLES): the way in beside the computing
    # worker. Over tcp it is dearer a row than in a round sent whole, so a front ramp grown
    # from the whole round's no-token time lands the second chunk after the first is done
    # (front_growth; see docs/performance.md#constants-chosen-by-measurement)
    into: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))
    # seconds a row of our gather and send of a message of OUT_ROWS rows or more (the last
    # SAMPLES): the way in where the worker does not say when a chunk reached it (shm, where
    # the flight is a slot index)
    gather: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))
    per_row: dict = field(default_factory=dict)  # bucket -> [decayed seconds, decayed rows, replies]
    # the worker's minor page faults per reply: a reply that wrote fresh memory measures the
    # faults, not its compute or its gap, and a first probe's stalled gap would price
    # messages so high that auto never chunks again (see cold_reply)
    faults: ColdFilter = field(default_factory=ColdFilter)

    @property
    def msg_s(self) -> Optional[float]:
        """The fixed cost of one more message, or None until both sides were measured."""
        if self.send_s is None or self.serve_s is None:
            return None
        return self.send_s + self.serve_s + (self.gap_s or 0.0)

    @property
    def send_s(self) -> Optional[float]:
        """The fixed part of the gateway's send: at most any size's median time (the
        smallest messages' as a rule: they copy the fewest bytes), None before the first."""
        if not self.send:
            return None
        got = self._fixed.get("send")
        if got is None:
            got = self._fixed["send"] = min(statistics.median(q) for q in self.send.values())
        return got

    @property
    def serve_s(self) -> Optional[float]:
        """The worker's median time on one message outside its compute."""
        if not self.serve:
            return None
        got = self._fixed.get("serve")
        if got is None:
            got = self._fixed["serve"] = statistics.median(self.serve)
        return got

    @property
    def gap_s(self) -> Optional[float]:
        """The fixed part of the worker's gap between chunks."""
        return self.gap.intercept

    def ramp_growth(self, rows: int) -> float:
        """How fast :func:`split_part`'s ramps may grow for a part of ``rows`` rows: while a
        chunk of r rows computes (c r seconds), the next, g r rows, must land (u g r), so g
        = c / u. u is the worker's no-token time in a round sent whole, per row, half of it
        on the way in (gather and flight) and half on the way out (flight and sum). Over tcp
        c / u is small; over shm, with no flight, large, where a ramp's small chunks would
        only cost messages. Clamped to [2, EDGE] (EDGE: from the edge chunk straight to full
        size); 2 until both are measured."""
        c = self.seconds_per_row(rows)
        if not c or not self.idle_s or rows <= 0:
            return 2.0
        return min(float(EDGE), max(2.0, c * 2 * rows / self.idle_s))

    def front_growth(self, rows: int) -> float:
        """:meth:`ramp_growth` for the ramp up from a part's first chunk, from the way in
        as measured (:attr:`into`): the worker's compute per row over the median way in per
        row, clamped to [2, EDGE]; :meth:`ramp_growth` until that was measured (always, for
        a worker that does not say when a chunk reached it)."""
        return self._growth_by(self.into, rows)

    def back_growth(self, rows: int) -> float:
        """:meth:`ramp_growth` for the ramp down to a part's last chunk: the chunk before the
        last must be read and summed here while the last one computes, so the growth is the
        worker's compute per row over the way back's time per row, as measured (:attr:`out`),
        clamped to [2, EDGE]; :meth:`ramp_growth` until that was measured. Grown by the way
        in instead, the chunk before the last can take longer to sum than the last takes to
        compute (see docs/performance.md#constants-chosen-by-measurement)."""
        return self._growth_by(self.out, rows)

    def _growth_by(self, way: deque, rows: int) -> float:
        """Compute per row over the median of ``way``'s seconds per row, clamped to
        [2, EDGE]; :meth:`ramp_growth` while ``way`` holds nothing."""
        c = self.seconds_per_row(rows)
        u = statistics.median(way) if way else None
        if not c or not u or rows <= 0:
            return self.ramp_growth(rows)
        return min(float(EDGE), max(2.0, c / u))

    def edge_rates(self, rows: int) -> Optional[tuple[float, float]]:
        """What each row of a part's first and last chunks leaves exposed, in seconds: the
        first's way in (gathered, sent and taken up) before the worker starts, the last's way
        back (read and summed) after it ends. Each as measured (:attr:`into`, else
        :attr:`gather`; :attr:`out`), else half the whole part's no-token time a row (for a
        part of ``rows`` rows). The two ways differ from that half, so priced by it the edges
        come out larger than what exposes least (see docs/performance.md#constants-chosen-by-measurement). None before any no-token
        time."""
        if self.idle_s is None or rows <= 0:  # (a no-token time of 0 prices the unmeasured at 0)
            return None
        half = self.idle_s / (2 * rows)
        way_in = self.into or self.gather
        return (statistics.median(way_in) if way_in else half,
                statistics.median(self.out) if self.out else half)

    def cold_reply(self, faults: int) -> bool:
        """Whether a reply whose worker took ``faults`` minor page faults since its last is
        cold: its compute, its time outside it and its gap are then not recorded."""
        return self.faults.cold(faults)

    def record_send(self, seconds: float, rows: int = 1) -> None:
        if seconds >= 0 and rows > 0:
            self.send.setdefault(_bucket(rows), deque(maxlen=SAMPLES)).append(seconds)
            self._fixed.pop("send", None)

    def record_serve(self, seconds: float) -> None:
        if seconds >= 0:
            self.serve.append(seconds)
            self._fixed.pop("serve", None)

    def record_gap(self, seconds: float, rows: int) -> None:
        if 0.0 <= seconds < 1.0 and rows > 0:  # else a worker clock from elsewhere, or a stop
            self.gap.record(rows, seconds)

    def record_in(self, seconds: float, rows: int) -> None:
        _record_way(self.into, seconds, rows)

    def record_out(self, seconds: float, rows: int) -> None:
        _record_way(self.out, seconds, rows)

    def record_gather(self, seconds: float, rows: int) -> None:
        _record_way(self.gather, seconds, rows)

    def record_idle(self, seconds: float) -> None:
        """A round that sent this worker its part whole, alone in flight (with other rounds
        out, the worker may have been busy with theirs)."""
        if seconds >= 0:
            self.idle.append(seconds)

    @property
    def idle_s(self) -> Optional[float]:
        """The least no-token time of the last rounds sent whole, None before the first."""
        return min(self.idle) if self.idle else None

    def record_compute(self, rows: int, seconds: float) -> None:
        self._fixed.clear()  # the compute rates read from per_row, and what sent or served left
        if rows <= 0 or seconds < 0:
            return
        acc = self.per_row.setdefault(_bucket(rows), [0.0, 0.0, 0])
        if acc[1] > 0:
            seconds = _clipped(seconds, rows * acc[0] / acc[1])
        acc[0] = DECAY * acc[0] + seconds
        acc[1] = DECAY * acc[1] + rows
        acc[2] += 1

    def seconds_per_row(self, rows: int, samples: int = 1) -> Optional[float]:
        """Measured compute per row at this size, else at the nearest size measured, of
        the sizes with at least ``samples`` replies measured (None if none has)."""
        key = ("per_row", _bucket(rows), samples)
        if key not in self._fixed:
            got = [k for k, acc in self.per_row.items() if acc[2] >= samples and acc[1] > 0]
            if got:
                b = key[1]
                s, n, _ = self.per_row[min(got, key=lambda k: (abs(k - b), -k))]
                self._fixed[key] = s / n
            else:
                self._fixed[key] = None
        return self._fixed[key]


def choose_chunks(rows: int, setting: ChunkSetting, costs: Optional[ChunkCosts],
                  groups: Optional[Sequence[Sequence[int]]] = None,
                  price_compute: bool = True) -> tuple[int, int]:
    """``(size, edge)`` for a part of ``rows`` rows: at most ``size`` rows a chunk, the ramps
    of :func:`split_part` starting from ``edge`` rows; ``size == rows`` means one message.

    Fixed: that size (0: one message), edges 1/EDGE of it. Auto: of the powers of two from
    MIN_CHUNK that leave at least two chunks and at most MAX_CHUNKS, and edges 1/EDGE,
    1/(2 EDGE) or 1/(4 EDGE) of each, the pair whose expected saving most exceeds its cost.
    The saving is the worker's measured no-token time less what stays exposed: the first
    chunk's way in before the worker starts and the last one's way back after it ends, each
    row at its way's measured time (:meth:`ChunkCosts.edge_rates`; until measured, half the
    whole part's no-token time a row). The cost is n
    messages plus each chunk's rows times the extra compute per row measured at its size
    (or the nearest size measured), once RATE_SAMPLES replies measured it. A smaller edge
    exposes less and costs more messages (a longer ramp) and slower small products: the
    measured costs decide. One message when none saves more than MARGIN of the part's
    compute, or before the first rounds measured it. With the part's ``groups``, the chunks
    are the ones :func:`split_part` makes of it, else equal ones. ``price_compute=False``:
    as if every size computed at the whole part's rate (what :class:`ChunkSizer`
    re-probes)."""
    if rows <= 1:
        return max(rows, 0), max(rows, 0)
    if setting != "auto":
        c = int(setting)
        c = rows if c <= 0 or c >= rows else c
        return c, c // EDGE
    if rows < 2 * MIN_CHUNK:  # no size leaves two chunks: a decode step's part, most rounds
        return rows, rows     # under load, which should not pay for reading the costs
    msg_s = costs.msg_s if costs is not None else None  # (medians of the sizes': read once)
    idle_s = costs.idle_s if costs is not None else None
    whole = costs.seconds_per_row(rows) if costs is not None else None
    if msg_s is None or idle_s is None or not whole:
        return rows, rows
    row_in, row_out = costs.edge_rates(rows)
    spr: dict = {}  # bucket -> extra compute per row at that size (looked up once a call)

    def lost(n: int) -> float:
        if not price_compute:
            return 0.0
        b = _bucket(n)
        if b not in spr:
            spr[b] = max(0.0, (costs.seconds_per_row(n, RATE_SAMPLES) or whole) - whole)
        return n * spr[b]

    best, best_net = (rows, rows), MARGIN * rows * whole
    growth, back = costs.front_growth(rows), costs.back_growth(rows)
    sizes, c = [], MIN_CHUNK
    while c * MAX_CHUNKS < rows:  # more messages than that never pays: not worth the model's time
        c *= 2
    while 2 * c <= rows:
        sizes.append(c)
        c *= 2
    # largest first (ties keep fewer messages), and a size whose messages alone cost more
    # than the best saving so far ends the search: every smaller size sends more
    for c in reversed(sizes):
        if idle_s - (-(-rows // c)) * msg_s <= best_net:
            break
        if groups is None:
            n = -(-rows // c)
            candidates = [(c // EDGE, n, c * row_in + (rows - (n - 1) * c) * row_out,
                           (n - 1) * lost(c) + lost(rows - (n - 1) * c))]
        else:
            candidates = []
            for k in (1, 2, 4):
                e = c // (EDGE * k)
                if k > 1 and e < MIN_CHUNK:
                    break
                b = split_part(groups, rows, c, growth, e, back)
                candidates.append((e, len(b) - 1, b[1] * row_in + (b[-1] - b[-2]) * row_out,
                                   sum(lost(y - x) for x, y in zip(b, b[1:]))))
        for e, n, exposed, extra in candidates:
            net = idle_s - exposed - n * msg_s - extra
            if net > best_net:
                best, best_net = (c, e), net
    return best


class ChunkSizer:
    """One worker's chunk size each round: :func:`choose_chunks`, and a re-probe of what it
    priced out. Only chunks measure a chunk size's compute rate, so once the model keeps a
    part whole because its sizes measured slow, nothing measures them again, and one chunked
    round run slow by the machine, not by its size, would keep parts whole for the rest of a
    run. So when the model sends
    a part whole that it would chunk at the whole part's rate, one such round in ``every``
    goes at that size instead: one in REPROBE_EVERY for PROBES re-probes, then in twice as
    many after each (up to MAX_PROBE_EVERY: sizes that stay slow stop costing rounds), and
    from the start once the model chunks on its own again. Not doubling at once: a rate is
    a decayed mean, and one re-probe moves it only part of the way back (see
    docs/performance.md#constants-chosen-by-measurement). The whole-or-chunked choice
    (:class:`ChunkMode`) still has the last word on a re-probed round, as on any other."""

    def __init__(self) -> None:
        self.every = REPROBE_EVERY
        self._left = REPROBE_EVERY  # priced-out rounds before the next re-probe
        self._run = 0  # re-probes since the model last chunked on its own
        self.reprobes = 0
        self._ahead: Optional[tuple] = None  # (rows' bucket, (size, edge) or None for whole): see prepare
        self.ahead_used = 0  # choices a round took from prepare

    def prepare(self, rows: int, setting: ChunkSetting, costs: Optional[ChunkCosts],
                groups: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Choose ahead, for the next part, from this one: called once a round's messages
        went, while the worker computes. The model's search otherwise runs in the next
        round's plan, before its first chunk can go: time the
        worker waits, and which a part sent whole never pays. The next part takes it if its
        rows are in the same half octave (:func:`_bucket`), else chooses then; a choice is
        used once. The costs it saw are one round older than the next plan's. A round at a
        fixed size neither prepares nor takes one, so a pool switched between the two ways
        round by round (``moe-bench moe``'s twin systems) keeps the choice auto made ahead
        and does not choose in the plan, which a pool on auto alone never does."""
        if setting != "auto":
            return
        size, edge = choose_chunks(rows, setting, costs, groups)
        self._ahead = (_bucket(rows), None if size >= rows else (size, edge))  # None: whole

    def choose(self, rows: int, setting: ChunkSetting, costs: Optional[ChunkCosts],
               groups: Optional[Sequence[Sequence[int]]] = None) -> tuple[int, int]:
        """``(size, edge)`` for a part of ``rows`` rows, as :func:`choose_chunks`."""
        if setting != "auto":
            return choose_chunks(rows, setting, costs, groups)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == _bucket(rows):
            got = (rows, rows) if ahead[1] is None or ahead[1][0] >= rows else ahead[1]
            self.ahead_used += 1
        else:
            got = choose_chunks(rows, setting, costs, groups)
        if got[0] < rows:
            self.every = self._left = REPROBE_EVERY
            self._run = 0
            return got
        self._left -= 1
        if self._left > 0:
            return got
        self._left = self.every  # (the priced-out sizes are only looked at when one is due)
        unpriced = choose_chunks(rows, setting, costs, groups, price_compute=False)
        if unpriced[0] >= rows:  # whole even so: messages cost more than they hide
            return got
        self.reprobes += 1
        self._run += 1
        if self._run >= PROBES:
            self.every = self._left = min(2 * self.every, MAX_PROBE_EVERY)
        return unpriced
