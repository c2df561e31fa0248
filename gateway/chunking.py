"""Chunked rounds: how a worker's part of a round is cut into messages, and how big a chunk.

A worker's part of a round is one block of rows grouped by expert. Sent whole, the worker
computes only once the whole block has arrived, and the gateway waits while it computes.
Cut into chunks of ``C`` rows, each its own message, the worker starts on the first chunk
while the next is gathered and in flight, and a request whose rows all came back is combined
while the worker computes the rest. Each chunk costs a message, and a smaller matrix product
may run slower per row, so the size is chosen from what was measured on that worker
(:class:`ChunkCosts`), or fixed by the operator. No I/O here: the rules are tested alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

#: chunk sizes tried are powers of two from here: below it every BLAS kernel runs far from
#: its rate and the per-message cost dominates
MIN_CHUNK = 32
#: a chunk's compute must be at least this many times the per-message cost (5% overhead)
MSG_COST_RATIO = 20.0
#: a chunk size is used only if its measured compute per row is within this factor of the
#: whole block's (a smaller product may be slower per row: that loss would eat the overlap)
SLOWER_PER_ROW = 1.10
DECAY = 0.9  # weight of the past in the decayed sums below

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


def _decayed(mean: Optional[float], x: float) -> Optional[float]:
    if x < 0:
        return mean
    return x if mean is None else DECAY * mean + (1 - DECAY) * x


def _bucket(rows: int) -> int:
    return max(1, int(rows)).bit_length()  # 32..63 rows -> 6, 64..127 -> 7, ...


@dataclass
class ChunkCosts:
    """What one worker costs, measured from its replies: the fixed cost of one message
    (the gateway's send and receive handling plus the worker's own outside its compute),
    and compute seconds per row by message size (power-of-two buckets, decayed sums so a
    block weighs by its rows)."""

    send_s: Optional[float] = None  # the gateway's time to send one (after its gather)
    serve_s: Optional[float] = None  # the worker's time on one outside its compute
    per_row: dict = field(default_factory=dict)  # bucket -> [decayed seconds, decayed rows]

    @property
    def msg_s(self) -> Optional[float]:
        """The fixed cost of one more message, or None until both sides were measured."""
        if self.send_s is None or self.serve_s is None:
            return None
        return self.send_s + self.serve_s

    def record_send(self, seconds: float) -> None:
        self.send_s = _decayed(self.send_s, seconds)

    def record_serve(self, seconds: float) -> None:
        self.serve_s = _decayed(self.serve_s, seconds)

    def record_compute(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds < 0:
            return
        acc = self.per_row.setdefault(_bucket(rows), [0.0, 0.0])
        acc[0] = DECAY * acc[0] + seconds
        acc[1] = DECAY * acc[1] + rows

    def seconds_per_row(self, rows: int) -> Optional[float]:
        """Measured compute per row at this size, else at the nearest size measured."""
        if not self.per_row:
            return None
        b = _bucket(rows)
        near = min(self.per_row, key=lambda k: (abs(k - b), -k))
        s, n = self.per_row[near]
        return s / n if n > 0 else None


def choose_chunk_rows(rows: int, setting: ChunkSetting, costs: Optional[ChunkCosts]) -> int:
    """Rows per chunk for a part of ``rows`` rows; ``rows`` itself means one message.

    Fixed: that size (0: one message). Auto: the smallest power of two from MIN_CHUNK that
    leaves at least two chunks, whose compute is at least MSG_COST_RATIO times a message's
    cost, and whose compute per row, as measured at that size (or the nearest size
    measured), is within SLOWER_PER_ROW of the whole block's. Nothing measured yet: one
    message (the first rounds measure)."""
    if rows <= 1:
        return max(rows, 0)
    if setting != "auto":
        c = int(setting)
        return rows if c <= 0 or c >= rows else c
    if costs is None or costs.msg_s is None:
        return rows
    whole = costs.seconds_per_row(rows)
    if not whole:
        return rows
    c = MIN_CHUNK
    while 2 * c <= rows:
        spr = costs.seconds_per_row(c) or whole
        if c * spr >= MSG_COST_RATIO * costs.msg_s and spr <= SLOWER_PER_ROW * whole:
            return c
        c *= 2
    return rows


def chunk_groups(groups: Sequence[Sequence[int]], lo: int, hi: int) -> list[tuple]:
    """The groups of rows [lo, hi) of a block, rebased to the chunk: (expert, start, count)
    or (expert, start, count, version) as given; a group cut by a boundary appears in both
    chunks with its part of the rows. ``groups`` is in row order."""
    out = []
    for g in groups:
        start, count = g[1], g[2]
        a, b = max(start, lo), min(start + count, hi)
        if a < b:
            out.append((g[0], a - lo, b - a, *g[3:]))
        elif start >= hi:
            break
    return out
