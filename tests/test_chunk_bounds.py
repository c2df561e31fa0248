"""How a worker's part is cut into chunks without sockets: chunks along expert groups
(chunk_groups), cuts between groups (part_bounds), and the ramps split_part puts at each
end, grown as fast as the measured ways in and out allow."""
from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.chunk_bounds import chunk_groups, part_bounds
from gateway.chunking import ChunkCosts

from tests.helpers_chunks import groups_of


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(1, 9), min_size=1, max_size=6), size=st.integers(1, 20),
       versioned=st.booleans())
def test_chunk_groups_tile_the_block(counts, size, versioned):
    groups, start = [], 0
    for e, n in enumerate(counts):
        groups.append((e, start, n, 3) if versioned else (e, start, n))
        start += n
    rows = start
    seen = []  # (expert, absolute row) in order, rebuilt from the chunks
    for lo in range(0, rows, size):
        hi = min(lo + size, rows)
        cg = chunk_groups(groups, lo, hi)
        at = 0
        for g in cg:
            assert g[1] == at and g[2] > 0  # rebased, contiguous, tiling the chunk
            assert (len(g) == 4) == versioned and (not versioned or g[3] == 3)
            seen.extend((g[0], lo + g[1] + i) for i in range(g[2]))
            at += g[2]
        assert at == hi - lo
    assert seen == [(g[0], g[1] + i) for g in groups for i in range(g[2])]


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(1, 300), min_size=1, max_size=12), size=st.integers(0, 400))
def test_part_bounds_cut_betweengroups_of(counts, size):
    """Chunks tile the part in at most ``size`` rows each; a cut falls inside a group only if
    that group is longer than ``size``, and then into equal pieces; a chunk is closed only
    when the next group would not fit in it."""
    groups = groups_of(counts)
    rows = sum(counts)
    b = part_bounds(groups, rows, size)
    assert b[0] == 0 and b[-1] == rows and all(x < y for x, y in zip(b, b[1:]))
    if size <= 0 or size >= rows:
        assert b == [0, rows]
        return
    assert all(y - x <= size for x, y in zip(b, b[1:]))
    starts = {g[1] for g in groups}
    for cut in b[1:-1]:
        if cut in starts:
            continue
        g = next(g for g in groups if g[1] < cut < g[1] + g[2])
        assert g[2] > size  # only a long group is cut inside
        k = -(-g[2] // size)
        assert cut - g[1] in {g[2] * i // k for i in range(1, k)}  # at one of its equal pieces
    # greedy: a cut before a group that fits in a chunk is needed (the next chunk would not
    # fit in this one); a long group starts a chunk of its own pieces
    count_at = {g[1]: g[2] for g in groups}
    for x, y, z in zip(b, b[1:], b[2:]):
        if count_at.get(y, size + 1) <= size:
            assert z - x > size


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(1, 600), min_size=1, max_size=12), size=st.integers(1, 2048))
@example(counts=[64, 576], size=576)  # the front ramp cuts into part_bounds' last chunk
def test_split_part_ramps_between_part_bounds(counts, size):
    """Chunks tile the part in at most ``size`` rows; a part part_bounds leaves whole stays
    whole; the first and last chunks are cut to the edge (1/EDGE of the size), or where no
    cut can go, are no longer than part_bounds made them (the last one shorter, where the
    front ramp cut into it: [64, 576] at 576 rows goes as 64, 128 and 448 rows, its edge of
    72 rows too small to cut inside a group); a cut
    inside a group is part_bounds' own (a long group's equal pieces) or keeps MIN_PIECE rows
    on both sides of it."""
    from gateway.chunk_bounds import EDGE, MIN_PIECE, split_part
    groups = groups_of(counts)
    rows = sum(counts)
    base = part_bounds(groups, rows, size)
    b = split_part(groups, rows, size)
    assert b[0] == 0 and b[-1] == rows and all(x < y for x, y in zip(b, b[1:]))
    assert all(y - x <= size for x, y in zip(b, b[1:]))
    if len(base) <= 2 or size // EDGE == 0:
        assert b == base
        return
    edge = size // EDGE
    assert b[1] <= edge or b[1] == base[1]
    assert rows - b[-2] <= edge or b[-2] >= base[-2]
    starts = {g[1] for g in groups}
    for cut in set(b[1:-1]) - set(base) - starts:
        g = next(g for g in groups if g[1] < cut < g[1] + g[2])
        left = cut - max([g[1]] + [x for x in b if x < cut])
        right = min([g[1] + g[2]] + [x for x in b if x > cut]) - cut
        assert left >= MIN_PIECE and right >= MIN_PIECE or g[2] > size


@settings(max_examples=200, deadline=None)
@given(size=st.integers(16, 1024), more=st.integers(0, 3000))
def test_ramps_double_from_each_end(size, more):
    """With a cut possible anywhere (one-row groups) and room for both ramps, the chunks from
    each end are edge, 2 edge, 4 edge ... until the next may be full size: each chunk lands
    while the one before computes."""
    from gateway.chunk_bounds import EDGE, split_part
    rows = 4 * size + more
    b = split_part(groups_of([1] * rows), rows, size)
    sizes = [y - x for x, y in zip(b, b[1:])]
    ramp, want = [], size // EDGE
    while want < size:
        ramp.append(want)
        want *= 2
    assert sizes[:len(ramp)] == ramp and sizes[::-1][:len(ramp)] == ramp
    assert all(x <= size for x in sizes)


def test_ramps_grow_as_fast_as_the_transport_allows():
    """A ramp's growth is what lands while the chunk before computes: the worker's compute
    per row over its no-token time per row, half of it each way; clamped to [2, EDGE]."""
    from gateway.chunk_bounds import EDGE, split_part
    c = ChunkCosts()
    assert c.ramp_growth(8192) == 2.0  # nothing measured: the cautious ramp
    c.record_compute(8192, 8192 * 11.5e-6)
    c.record_idle(60e-3)  # tcp-like: 3.7 us a row each way
    assert c.ramp_growth(8192) == pytest.approx(11.5e-6 * 2 * 8192 / 60e-3)
    c.record_idle(1e-9)
    for _ in range(200):
        c.record_idle(12e-3)  # shm-like: 0.7 us a row
    assert c.ramp_growth(8192) == float(EDGE)
    for _ in range(200):
        c.record_idle(1.0)  # the flight far longer than the compute
    assert c.ramp_growth(8192) == 2.0
    # growth EDGE: from the edge chunk straight to full size (one-row groups: cuts anywhere)
    b = split_part(groups_of([1] * 8192), 8192, 2048, float(EDGE))
    assert [y - x for x, y in zip(b, b[1:])] == [256, 2048, 2048, 2048, 1536, 256]
    b = split_part(groups_of([1] * 8192), 8192, 2048, 3.0)
    assert [y - x for x, y in zip(b, b[1:])][:2] == [256, 768]


def test_the_back_ramp_grows_as_fast_as_replies_are_read_and_summed():
    """The chunk before the last must be read and summed while the last one computes: the
    back ramp's growth is the compute per row over the way back's median time per row, from
    replies of OUT_ROWS rows or more; the front ramp's growth until that was measured."""
    from gateway.chunk_bounds import EDGE, split_part
    from gateway.chunking import OUT_ROWS, SAMPLES
    c = ChunkCosts()
    c.record_compute(8192, 8192 * 18e-6)
    for _ in range(SAMPLES):
        c.record_idle(30e-3)  # 1.8 us a row each way: the front ramp grows at EDGE
    assert c.ramp_growth(8192) == float(EDGE)
    assert c.back_growth(8192) == float(EDGE)  # the way back not measured yet
    c.record_out(1e-3, OUT_ROWS - 1)  # a small reply: its wait behind our sends, not its rows
    c.record_out(5.0, 4096)  # a clock from another machine, or a stall
    c.record_out(-1e-3, 4096)
    assert not c.out and c.back_growth(8192) == float(EDGE)
    for rows, per_row in ((3665, 3.4e-6), (1761, 2.9e-6), (1071, 3.6e-6), (512, 40e-6)):
        c.record_out(rows * per_row, rows)  # tcp-like; 512 rows waited behind a send
    assert c.back_growth(8192) == pytest.approx(18e-6 / ((3.4e-6 + 3.6e-6) / 2))
    for _ in range(SAMPLES):
        c.record_out(4096 * 0.8e-6, 4096)  # shm-like: the last reply's sum is all there is
    assert c.back_growth(8192) == float(EDGE)
    for _ in range(SAMPLES):
        c.record_out(0.5, 4096)  # reading a reply far slower than computing it
    assert c.back_growth(8192) == 2.0
    # the back ramp at its own growth, the front one at the other (one-row groups)
    b = split_part(groups_of([1] * 8192), 8192, 2048, float(EDGE), None, 3.0)
    sizes = [y - x for x, y in zip(b, b[1:])]
    assert sizes[:2] == [256, 2048] and sizes[-2:] == [768, 256]
    assert split_part(groups_of([1] * 8192), 8192, 2048, 3.0) == split_part(groups_of([1] * 8192), 8192, 2048, 3.0,
                                                                          None, 3.0)


def test_the_front_ramp_grows_as_fast_as_chunks_reach_the_worker():
    """The chunk after the first must reach the worker while the first computes: the front
    ramp's growth is the compute per row over the way in's median time per row, from chunks
    of OUT_ROWS rows or more; the whole round's no-token time until that was measured."""
    from gateway.chunk_bounds import EDGE
    from gateway.chunking import OUT_ROWS, SAMPLES
    c = ChunkCosts()
    c.record_compute(8192, 8192 * 18e-6)
    for _ in range(SAMPLES):
        c.record_idle(30e-3)  # 1.8 us a row each way in a round sent whole: growth EDGE
    assert c.front_growth(8192) == c.ramp_growth(8192) == float(EDGE)
    c.record_in(1e-3, OUT_ROWS - 1)  # a small chunk: its fixed costs, not its rows
    c.record_in(5.0, 4096)  # a clock from another machine, or a stall
    c.record_in(-1e-3, 4096)
    assert not c.into and c.front_growth(8192) == float(EDGE)
    for rows, per_row in ((2530, 3.7e-6), (3221, 3.3e-6), (704, 4.1e-6)):
        c.record_in(rows * per_row, rows)  # tcp-like: gathered and copied beside the compute
    assert c.front_growth(8192) == pytest.approx(18e-6 / 3.7e-6)
    assert c.back_growth(8192) == c.ramp_growth(8192)  # each ramp from its own way
    for _ in range(SAMPLES):
        c.record_in(0.5, 4096)
    assert c.front_growth(8192) == 2.0


def test_ramp_examples():
    from gateway.chunk_bounds import split_part
    # 1024-row groups at 2048 a chunk: 256, 512, 1024 from each end (inside the first and
    # last groups where no group starts in reach), full chunks between
    assert split_part(groups_of([1024] * 8), 8192, 2048) == [0, 256, 768, 1792, 3072, 5120, 6400, 7424, 7936, 8192]
    # small groups: the first chunk ends at a group start; no group is cut for an edge
    assert split_part(groups_of([64, 70, 60, 66]), 260, 128) == [0, 64, 134, 260]
    assert split_part(groups_of([300, 200, 500]), 1000, 512) == [0, 500, 1000]


def test_a_ramp_cut_that_would_leave_a_sliver_moves_back_instead_of_ending_the_ramp():
    """Where the next ramp chunk's end falls less than MIN_PIECE rows from its group's end
    (no group start in reach), the cut moves back to keep MIN_PIECE rows past it: a ramp
    that stopped there was followed by a full chunk, which the worker then waited for (over
    tcp, 128 rows and then 2940: 6.3 ms)."""
    from gateway.chunk_bounds import MIN_PIECE, split_part
    groups = groups_of([900, 1598, 1598, 1598, 1598, 900])
    b = split_part(groups, 8192, 4096, 5.5, 128)
    assert b[:3] == [0, 128, 900 - MIN_PIECE]  # 128 + 5.5 * 128 = 832 would leave 68 rows
    assert b[-3:] == [7292 + MIN_PIECE, 8064, 8192]
    sizes = [y - x for x, y in zip(b, b[1:])]  # (before: 128, 3968, 3968, 128)
    assert sizes == [128, 644, 1726, 3196, 1726, 644, 128]


def test_part_bounds_examples():
    # groups 100, 100, 100, 300, 20 rows at most 250 rows a chunk: 200 | 100 | 150 150 (+20)
    assert part_bounds(groups_of([100, 100, 100, 300, 20]), 620, 250) == [0, 200, 300, 450, 620]
    assert part_bounds(groups_of([64] * 8), 512, 128) == [0, 128, 256, 384, 512]
    assert part_bounds(groups_of([64] * 8), 512, 100) == [0, 64, 128, 192, 256, 320, 384, 448, 512]
    assert part_bounds(groups_of([10]), 10, 0) == [0, 10]  # off: one message
    assert part_bounds(groups_of([257]), 257, 256) == [0, 128, 257]  # not 256 rows and a sliver
