"""Where a worker's part of a round is cut into chunks; no I/O.

A part is one block of rows grouped by expert; a worker computes each group with one matrix
product, and a group cut in two runs as two smaller, slower ones. :func:`part_bounds` cuts
between groups where it can; :func:`split_part` adds ramps, so the first chunk is small (the
worker starts sooner) and the last is small (the gateway waits less after the last reply);
:func:`chunk_groups` rebases a part's groups onto one chunk. How big a chunk is, and whether
to chunk at all, is gateway/chunking.py's and gateway/chunk_mode.py's.
"""
from __future__ import annotations

from typing import Optional, Sequence

EDGE = 8  # a part's first and last chunks are at most 1/EDGE of the size, ramping up (see split_part)
MIN_PIECE = 128  # rows below which cutting a group for a ramp's chunk costs more than it hides (see docs/performance.md#constants-chosen-by-measurement)


def part_bounds(groups: Sequence[Sequence[int]], rows: int, size: int) -> list[int]:
    """Where a part of ``rows`` rows is cut into chunks of at most ``size`` rows: the row
    offsets ``[0, ..., rows]``. A worker computes each expert group with one matrix product,
    and a group cut in two runs as two smaller, slower ones, so cuts fall between groups:
    whole groups are packed into a chunk while they fit, and only a group longer than
    ``size`` is cut, into equal pieces (not ``size`` and a sliver), its last piece packed
    with what follows. ``groups`` ((expert, start, count, ...), in row order) tile the part."""
    if size <= 0 or size >= rows:
        return [0, rows] if rows > 0 else [0]
    bounds, start = [0], 0  # start: first row of the chunk being filled
    for g in groups:
        s, n = int(g[1]), int(g[2])
        if s + n - start <= size:
            continue  # fits in the chunk being filled
        if s > start:
            bounds.append(s)  # close it before this group
            start = s
        if n > size:  # a long group: equal pieces, the last one left open
            k = -(-n // size)
            bounds.extend(s + n * i // k for i in range(1, k))
            start = bounds[-1]
    bounds.append(rows)
    return bounds


def _front_cut(spans: list, lo: int, hi: int, limit: int) -> Optional[int]:
    """Where a ramp chunk starting at ``lo`` ends, at most ``limit`` rows on and before ``hi``:
    the last group start that leaves at least half of ``limit``; else ``limit`` rows on,
    inside a group, if both its pieces keep MIN_PIECE rows (a product is one read of the
    expert's weights whatever its rows: a small piece costs more than the rows it stops
    exposing), or short of it, MIN_PIECE rows before the group's end; else the last group
    start in reach; else None (the ramp stops there, and the next chunk is a full one, which
    the worker waits for; see docs/performance.md#constants-chosen-by-measurement)."""
    at = [s for s, _ in spans if lo < s <= lo + limit and s < hi]
    if at and max(at) - lo >= limit // 2:
        return max(at)
    x = lo + limit
    if x < hi and limit >= MIN_PIECE:
        inside = [(s, e) for s, e in spans if s < x < e]
        if inside:
            start, end = max(inside[0][0], lo), min(inside[0][1], hi)
            x = min(x, end - MIN_PIECE)
            if x - start >= MIN_PIECE:
                return x
    return max(at) if at else None


def _back_cut(spans: list, lo: int, hi: int, limit: int) -> Optional[int]:
    """:func:`_front_cut` from the other end: where a ramp chunk ending at ``hi`` starts."""
    at = [s for s, _ in spans if lo < s < hi and hi - s <= limit]
    if at and hi - min(at) >= limit // 2:
        return min(at)
    x = hi - limit
    if x > lo and limit >= MIN_PIECE:
        inside = [(s, e) for s, e in spans if s < x < e]
        if inside:
            start, end = max(inside[0][0], lo), min(inside[0][1], hi)
            x = max(x, start + MIN_PIECE)
            if end - x >= MIN_PIECE:
                return x
    return min(at) if at else None


def split_part(groups: Sequence[Sequence[int]], rows: int, size: int, growth: float = 2.0,
               edge: Optional[int] = None, back_growth: Optional[float] = None) -> list[int]:
    """A part's chunk offsets at chunk size ``size``, ``[0, ..., rows]``: ramps at both ends,
    :func:`part_bounds` between them. The worker starts once the first chunk is gathered and
    sent, and the round ends once the last chunk's reply is summed, so those two are what
    the overlap cannot hide: they are cut to ``edge`` rows (default 1/EDGE of the size;
    auto picks it, :func:`choose_chunks`). And the chunk after the
    first must land while the first computes (the one before the last be summed while the
    last computes), else the worker waits for it: a small edge chunk beside a full one only
    exposed that one's flight instead. So from each end the chunks grow by ``growth`` (edge,
    2 edge, 4 edge, ... at 2; see :meth:`ChunkCosts.ramp_growth`) until the next may be full
    size; the back ramp by ``back_growth`` if given (:meth:`ChunkCosts.back_growth`: the way
    back may be slower than the way in). Each end's ramp stays in its half of the part; a
    cut goes where :func:`_front_cut` (:func:`_back_cut`) finds room, and a ramp stops where
    it finds none."""
    base = part_bounds(groups, rows, size)
    edge = size // EDGE if edge is None else min(edge, size)
    if len(base) <= 2 or edge <= 0:
        return base
    spans = [(int(g[1]), int(g[1]) + int(g[2])) for g in groups]
    front, limit = [0], edge
    while limit < size:
        x = _front_cut(spans, front[-1], rows // 2, limit)
        if x is None:  # stopped short: on to part_bounds' next cut, not a repacked chunk
            nxt = [y for y in base[1:-1] if y > front[-1]]
            if nxt:
                front.append(nxt[0])
            break
        limit = max(edge, int(growth * (x - front[-1])))
        front.append(x)
    back, limit = [rows], edge
    bg = growth if back_growth is None else back_growth
    while limit < size:
        x = _back_cut(spans, max(front[-1], rows // 2), back[-1], limit)
        if x is None:
            prv = [y for y in base[1:-1] if front[-1] < y < back[-1]]
            if prv:
                back.append(prv[-1])
            break
        limit = max(edge, int(bg * (back[-1] - x)))
        back.append(x)
    a, b = front[-1], back[-1]
    middle = [a + m for m in part_bounds(chunk_groups(groups, a, b), b - a, size)[1:-1]] if b > a else []
    return front + middle + back[::-1]


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
