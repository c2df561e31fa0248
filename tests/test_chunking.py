"""Chunked rounds without sockets: the chunk-size rule and the costs it reads (how a part
is cut is in test_chunk_bounds.py)."""
from __future__ import annotations

import pytest

from gateway.chunking import MIN_CHUNK, RATE_SAMPLES, ChunkCosts, choose_chunks, parse_chunk_rows

from tests.helpers_chunks import groups_of


@pytest.mark.parametrize("value,expect", [("auto", "auto"), ("AUTO", "auto"), ("off", 0), ("0", 0), ("64", 64),
                                          (0, 0), (128, 128)])
def test_parse_chunk_rows(value, expect):
    assert parse_chunk_rows(value) == expect


@pytest.mark.parametrize("value", ["-1", "many", -3, 1.5, True, None])
def test_parse_chunk_rows_refuses(value):
    with pytest.raises(ValueError, match="chunk rows"):
        parse_chunk_rows(value)


def test_fixed_sizes():
    assert choose_chunks(100, 0, None)[0] == 100  # off: one message
    assert choose_chunks(100, 7, None)[0] == 7
    assert choose_chunks(100, 100, None)[0] == 100
    assert choose_chunks(100, 500, None)[0] == 100
    assert choose_chunks(1, 7, None)[0] == 1
    assert choose_chunks(0, 7, None)[0] == 0


def _costs(msg_s, per_row: dict, idle_s=None, replies: int = RATE_SAMPLES) -> ChunkCosts:
    """Costs measured: each size's rate from ``replies`` replies (by default enough to
    price it)."""
    c = ChunkCosts()
    c.record_send(msg_s / 2)
    c.record_serve(msg_s / 2)
    if idle_s is not None:
        c.record_idle(idle_s)
    for _ in range(replies):
        for rows, spr in per_row.items():
            c.record_compute(rows, rows * spr)
    return c


def test_auto_reads_no_cost_for_a_part_too_small_to_cut():
    """Below two chunks of MIN_CHUNK rows no size fits: one message, decided before any
    cost is read (a decode step's part, most rounds under load, paid 20 us a call)."""
    class Unread(ChunkCosts):
        def __getattribute__(self, name):
            raise AssertionError(f"read {name}")

    for rows in (2, MIN_CHUNK, 2 * MIN_CHUNK - 1):
        assert choose_chunks(rows, "auto", Unread()) == (rows, rows)
    with pytest.raises(AssertionError, match="read"):
        choose_chunks(2 * MIN_CHUNK, "auto", Unread())


def test_auto_needs_measurements():
    assert choose_chunks(1024, "auto", None)[0] == 1024
    assert choose_chunks(1024, "auto", ChunkCosts())[0] == 1024
    c = ChunkCosts()
    c.record_compute(1024, 0.1)  # a compute rate but no message cost nor idle time yet
    assert choose_chunks(1024, "auto", c)[0] == 1024
    assert choose_chunks(1024, "auto", _costs(50e-6, {1024: 1e-3}))[0] == 1024  # no idle time measured
    # a worker never idle in a round sent whole (its clocks said so): nothing to hide
    assert choose_chunks(1024, "auto", _costs(50e-6, {1024: 1e-3}, 0.0), groups_of([128] * 8))[0] == 1024
    assert choose_chunks(1024, "auto", _costs(50e-6, {1024: 1e-3}, 0.0))[0] == 1024


def _net(c, rows, idle, msg, spr_c, whole):
    n = -(-rows // c)
    return idle * (1 - 1 / n) - n * msg - rows * max(0.0, spr_c - whole)


def test_auto_takes_the_size_whose_saving_beats_its_cost_most():
    # 1 ms a row over 1024 rows (1.02 s of compute), 100 ms idle a round, 1 ms a message,
    # every size as fast per row: the saving idle*(1-1/n) grows with n, messages cost n ms
    rows, idle, msg = 1024, 0.1, 1e-3
    got = choose_chunks(rows, "auto", _costs(msg, {rows: 1e-3}, idle))[0]
    sizes = [MIN_CHUNK * 2 ** i for i in range(6) if MIN_CHUNK * 2 ** i * 2 <= rows]
    assert got == max(sizes, key=lambda c: _net(c, rows, idle, msg, 1e-3, 1e-3))
    assert got == 128  # n = 8: 100 ms * 7/8 - 8 ms, the best of 32 .. 512


def test_auto_sends_whole_when_the_idle_time_is_small():
    # the busiest worker idles 2 ms of a 200 ms round: no chunking saves 2% of the compute
    assert choose_chunks(256, "auto", _costs(100e-6, {256: 0.8e-3}, 2e-3))[0] == 256


def test_auto_avoids_sizes_measured_slower_per_row():
    # 32 and 64 rows measured 30% slower per row: their loss beats the saving; 128 is as fast
    costs = _costs(1e-6, {1024: 1e-3, 32: 1.3e-3, 64: 1.3e-3, 128: 1.0e-3}, idle_s=0.2)
    assert choose_chunks(1024, "auto", costs)[0] == 128
    # every smaller size slower: one message
    costs = _costs(1e-6, {1024: 1e-3, 32: 2e-3, 64: 2e-3, 128: 2e-3, 256: 2e-3, 512: 2e-3}, idle_s=0.2)
    assert choose_chunks(1024, "auto", costs)[0] == 1024


def test_a_size_is_priced_by_its_compute_only_once_measured_enough():
    """A chunk size's first replies are its start-up: until RATE_SAMPLES of them measured
    it slow, the model prices it at the whole part's rate (and the whole-or-chunked choice
    times the rounds); from then on its measured rate counts."""
    rates = {1024: 1e-3, 32: 2e-3, 64: 2e-3, 128: 2e-3, 256: 2e-3, 512: 2e-3}
    unpriced = choose_chunks(1024, "auto", _costs(1e-6, rates, idle_s=0.2), price_compute=False)[0]
    got = [choose_chunks(1024, "auto", _costs(1e-6, rates, idle_s=0.2, replies=n))[0]
           for n in range(1, RATE_SAMPLES + 2)]
    assert unpriced < 1024 and got == [unpriced] * (RATE_SAMPLES - 1) + [1024, 1024]
    # an unmeasured size takes the nearest one measured enough: here a slow 512 priced,
    # 128 and 256 seen once each, so 256 is priced as 512 and 128 as the whole part
    c = _costs(1e-6, {1024: 1e-3, 512: 2e-3}, idle_s=0.2)
    for rows in (128, 256):
        c.record_compute(rows, rows * 2e-3)
    assert c.seconds_per_row(256, RATE_SAMPLES) == pytest.approx(2e-3)
    assert c.seconds_per_row(128, RATE_SAMPLES) == pytest.approx(2e-3)  # 256's bucket is nearer than 1024's
    assert c.seconds_per_row(128) == pytest.approx(2e-3) and c.seconds_per_row(64, 99) is None


def _trapped() -> ChunkCosts:
    """Every chunk size measured 30% slower than the whole part, once: priced out, though
    at the whole part's rate 128 rows would save the most."""
    return _costs(1e-3, {1024: 1e-3, 32: 1.3e-3, 64: 1.3e-3, 128: 1.3e-3, 256: 1.3e-3, 512: 1.3e-3}, idle_s=0.1)


def test_sizer_reprobes_sizes_priced_out_by_their_compute():
    """Only chunks measure a chunk size's rate: a part kept whole because its sizes
    measured slow goes chunked one round in REPROBE_EVERY, PROBES times, then in twice as
    many each time."""
    from gateway.chunking import PROBES, REPROBE_EVERY, ChunkSizer
    costs, sizer = _trapped(), ChunkSizer()
    assert choose_chunks(1024, "auto", costs)[0] == 1024
    assert choose_chunks(1024, "auto", costs, price_compute=False)[0] == 128
    got = [sizer.choose(1024, "auto", costs)[0] for _ in range(REPROBE_EVERY * (PROBES + 6))]
    ch = [i + 1 for i, size in enumerate(got) if size != 1024]
    gaps = [b - a for a, b in zip([0] + ch, ch)]
    assert gaps == [REPROBE_EVERY] * PROBES + [2 * REPROBE_EVERY, 4 * REPROBE_EVERY]
    assert {got[i - 1] for i in ch} == {128} and sizer.reprobes == PROBES + 2
    # the re-probe measured the sizes as fast as the whole part: the model chunks on its
    # own, and a later trap starts over at REPROBE_EVERY
    for rows in (32, 64, 128, 256, 512):
        for _ in range(20):
            costs.record_compute(rows, rows * 1e-3)
    assert sizer.choose(1024, "auto", costs)[0] == 128 and sizer.every == REPROBE_EVERY
    again = [sizer.choose(1024, "auto", _trapped())[0] for _ in range(REPROBE_EVERY)]
    assert again == [1024] * (REPROBE_EVERY - 1) + [128]


def test_sizer_reprobes_nothing_that_messages_price_out():
    """Whole even at the whole part's rate (a message costs more than it hides), or a
    fixed size: the sizer answers as the model does, every round."""
    from gateway.chunking import REPROBE_EVERY, ChunkSizer
    sizer = ChunkSizer()
    dear = _costs(100e-6, {256: 0.8e-3}, 2e-3)
    assert [sizer.choose(256, "auto", dear)[0] for _ in range(8 * REPROBE_EVERY)] == [256] * 8 * REPROBE_EVERY
    assert [sizer.choose(1024, 0, _trapped())[0] for _ in range(8 * REPROBE_EVERY)] == [1024] * 8 * REPROBE_EVERY
    assert [sizer.choose(1024, 256, None)[0] for _ in range(8 * REPROBE_EVERY)] == [256] * 8 * REPROBE_EVERY
    assert sizer.reprobes == 0


def test_sizer_takes_a_choice_made_ahead_once_for_rows_of_its_half_octave():
    """A round's messages out, the sizer chooses for the next part from this one, so the
    next plan only cuts; the choice is the model's for those rows, used once, and only by a
    part of about as many rows. A whole part ahead never makes a larger part chunk."""
    from gateway.chunking import ChunkSizer
    rows, idle, msg = 1024, 0.1, 1e-3
    costs, sizer = _costs(msg, {rows: 1e-3}, idle), ChunkSizer()
    want = choose_chunks(rows, "auto", costs)
    assert want[0] == 128
    sizer.prepare(rows, "auto", costs)
    dear = _costs(1.0, {rows: 1e-3}, idle)  # messages a second each: the model now sends whole
    assert choose_chunks(1100, "auto", dear)[0] == 1100
    assert sizer.choose(1100, "auto", dear) == want and sizer.ahead_used == 1  # the choice made ahead
    assert sizer.choose(1100, "auto", dear)[0] == 1100  # used once: chosen again, at the round
    sizer.prepare(rows, "auto", costs)
    assert sizer.choose(4096, "auto", dear)[0] == 4096 and sizer.ahead_used == 1  # another half octave
    sizer.prepare(rows, "auto", dear)  # whole ahead ...
    assert sizer.choose(1100, "auto", costs) == (1100, 1100) and sizer.ahead_used == 2  # ... stays whole
    sizer.prepare(rows, "auto", costs)
    assert sizer.choose(1100, 256, costs) == choose_chunks(1100, 256, costs)  # a fixed size: as set
    sizer.prepare(1100, 0, costs)  # a round at a fixed size between two on auto (a twin's) ...
    assert sizer.choose(1100, "auto", dear) == want and sizer.ahead_used == 3  # ... leaves the choice


def test_idle_time_is_the_least_of_recent_whole_rounds():
    """A worker's first rounds (its slots touched for the first time) run far longer than
    the rest, and once auto chunks only its probes go whole: the first rounds must not size
    the chunks of the rounds after them."""
    from gateway.chunking import SAMPLES
    c = ChunkCosts()
    assert c.idle_s is None
    for s in (0.36, 0.05, 0.55, 0.45):  # warming up (measured: 51-550 ms against 29 ms after)
        c.record_idle(s)
    assert c.idle_s == pytest.approx(0.05)
    c.record_idle(0.029)  # the first probe after: a median would need half the window
    assert c.idle_s == pytest.approx(0.029)
    c.record_idle(-1.0)  # a clock gone backwards is not a sample
    assert c.idle_s == pytest.approx(0.029)
    for _ in range(SAMPLES):  # a lasting rise is followed once the window has passed
        c.record_idle(0.04)
    assert c.idle_s == pytest.approx(0.04)


def test_one_stall_does_not_make_messages_or_a_size_look_dear():
    """A stall (a page-fault storm, a descheduled process) in one sample must not size the
    chunks after it: auto stops sending what looks dear, and so would never measure it
    again. Measured here: one 130 ms gap took a tcp worker's message cost from 1 ms to
    17 ms, and every round after went whole."""
    c = ChunkCosts()
    for _ in range(10):
        for rows in (128, 512, 2048):
            c.record_send(100e-6 + rows * 1e-7, rows)
            c.record_serve(20e-6)
            c.record_gap(200e-6 + rows * 1e-7, rows)
            c.record_compute(rows, rows * 12e-6)
    before, spr = c.msg_s, c.seconds_per_row(512)
    c.record_send(0.13, 128)
    c.record_serve(0.13)
    c.record_gap(0.13, 128)
    c.record_compute(512, 0.13 * 512)
    assert c.msg_s < before + 0.3e-3  # a decayed mean would have gained 13 ms a term
    assert c.seconds_per_row(512) < spr * 1.2
    # a lasting change is followed: every send, gap and product now twice as long
    for _ in range(30):
        for rows in (128, 512, 2048):
            c.record_send(2 * (100e-6 + rows * 1e-7), rows)
            c.record_serve(40e-6)
            c.record_gap(2 * (200e-6 + rows * 1e-7), rows)
            c.record_compute(rows, rows * 24e-6)
    assert c.msg_s == pytest.approx(2 * (100e-6 + 128e-7) + 40e-6 + 2 * 200e-6, rel=0.05)
    assert c.seconds_per_row(512) == pytest.approx(24e-6, rel=0.05)


def test_clipped_gaps_never_drive_the_fit_below_zero():
    """Clipping against a fitted line that dips below zero (a steep slope, small rows) must
    not feed the fit negative samples: it diverged so once, by doubling every round."""
    c = ChunkCosts()
    for _ in range(50):
        for rows, y in ((2048, 2e-3), (4096, 10e-3), (128, 0.0)):  # the line is -5.5 ms at 128 rows
            c.record_gap(y, rows)
            assert c.gap.predict(128) is not None and c.gap_s >= 0.0
    assert c.gap.sums[2] >= 0.0 and 0.0 <= c.gap_s < 1e-3


def test_costs_decay_toward_new_measurements():
    c = ChunkCosts()
    for _ in range(100):
        c.record_send(1.0)
        c.record_serve(1.0)
    for _ in range(100):
        c.record_send(0.1)
        c.record_serve(0.1)
    assert c.msg_s == pytest.approx(0.2, rel=1e-3)
    c.record_send(-5.0)  # a clock that went backwards is ignored
    assert c.msg_s == pytest.approx(0.2, rel=1e-3)


@pytest.mark.parametrize("way", ["in", "out"])
def test_auto_prices_the_ramps_it_will_cut(way):
    """The size model weighs the messages split_part really sends, the ramps' included: a
    slow way in means more chunks up from the first, a slow way back more down to the last."""
    from gateway.chunk_bounds import split_part
    from gateway.chunking import OUT_ROWS, SAMPLES
    groups = groups_of([1] * 8192)
    flat = {r: 18e-6 for r in (8192, 4096, 2048, 1024, 512, 256, 128, 64, 32)}
    fast, slow = _costs(0.2e-3, flat, 60e-3), _costs(0.2e-3, flat, 60e-3)
    record, growth = {"in": ("record_in", "front_growth"), "out": ("record_out", "back_growth")}[way]
    for _ in range(SAMPLES):
        getattr(slow, record)(OUT_ROWS * 9e-6, OUT_ROWS)  # growth 2 that way
    assert getattr(slow, growth)(8192) == 2.0 and getattr(fast, growth)(8192) == fast.ramp_growth(8192)

    def messages(costs):
        size, edge = choose_chunks(8192, "auto", costs, groups)
        return len(split_part(groups, 8192, size, costs.front_growth(8192), edge, costs.back_growth(8192))) - 1
    assert 1 < messages(fast) < messages(slow)


def test_auto_with_groups_counts_split_messages_and_exposed_edges():
    """With the part's groups, auto weighs the messages split_part really makes and what
    stays exposed (the ramps' first and last chunks), not n equal chunks, over the sizes and
    the edges it may start the ramps from."""
    from gateway.chunk_bounds import EDGE, split_part
    groups = groups_of([1024] * 8)
    flat = {r: 1e-5 for r in (8192, 4096, 2048, 1024, 512, 256, 128, 64, 32)}  # no compute lost
    assert len(split_part(groups, 8192, 4096)) - 1 == 10
    assert len(split_part(groups, 8192, 2048)) - 1 == 9
    assert len(split_part(groups, 8192, 1024)) - 1 == 14

    def net(costs, size, edge):  # the saving less the cost, as the docstring states it
        b = split_part(groups, 8192, size, costs.ramp_growth(8192), edge)
        return costs.idle_s * (1 - (b[1] + b[-1] - b[-2]) / (2 * 8192)) - (len(b) - 1) * costs.msg_s

    for msg in (0.05e-3, 0.4e-3, 1e-3, 3e-3):
        costs = _costs(msg, flat, 30e-3)
        size, edge = choose_chunks(8192, "auto", costs, groups)
        assert size < 8192
        tried = [(c, c // (EDGE * k)) for c in (256, 512, 1024, 2048, 4096) for k in (1, 2, 4)]
        assert all(net(costs, size, edge) >= net(costs, c, e) - 1e-12 for c, e in tried), msg
    # 4096 a chunk from 128-row edges: 12 messages, 1/64 exposed; at 1/EDGE: 10, 1/16
    assert choose_chunks(8192, "auto", _costs(0.4e-3, flat, 30e-3), groups) == (4096, 128)
    assert choose_chunks(8192, "auto", _costs(1e-3, flat, 30e-3), groups) == (4096, 4096 // EDGE)  # dearer: shorter ramps
    assert choose_chunks(8192, "auto", _costs(10e-3, flat, 30e-3), groups)[0] == 8192  # dear ones: whole


def test_auto_prices_the_edges_by_their_ways_measured_time_a_row():
    """What a part's first and last chunks leave exposed is priced by each way's measured
    time a row: in, the worker's clock where it says when a chunk reached it, else our
    gather and send; back, from its reply to the rows summed. Until measured, half the
    whole part's no-token time a row. Ways dearer than that make auto cut smaller edges
    (over shm the way back measured 0.6-0.7 us a row against that half's 0.4, and 512-row
    edges were chosen where 128-row ones left 0.4 ms less exposed), cheaper ones larger."""
    from gateway.chunk_bounds import EDGE
    from gateway.chunking import OUT_ROWS, SAMPLES
    groups = groups_of([1024] * 8)
    flat = {r: 18e-6 for r in (8192, 4096, 2048, 1024, 512, 256, 128, 64, 32)}
    half = 30e-3 / (2 * 8192)

    def measured(msg_s, way_s):
        c = _costs(msg_s, flat, 30e-3)
        assert c.edge_rates(8192) == (half, half)
        for _ in range(SAMPLES):
            c.record_gather(OUT_ROWS * way_s, OUT_ROWS)
            c.record_out(OUT_ROWS * way_s, OUT_ROWS)
        assert c.edge_rates(8192) == pytest.approx((way_s, way_s))
        return c

    assert choose_chunks(8192, "auto", _costs(1e-3, flat, 30e-3), groups) == (4096, 4096 // EDGE)
    assert choose_chunks(8192, "auto", measured(1e-3, 4 * half), groups)[1] < 4096 // EDGE
    assert choose_chunks(8192, "auto", _costs(0.4e-3, flat, 30e-3), groups) == (4096, 128)
    assert choose_chunks(8192, "auto", measured(0.4e-3, half / 4), groups)[1] > 128
    c = measured(1e-3, 4 * half)
    c.record_in(OUT_ROWS * half / 2, OUT_ROWS)  # the worker's own clock, where it has one, first
    assert c.edge_rates(8192) == pytest.approx((half / 2, 4 * half))
    c.record_gather(1e-3, OUT_ROWS - 1)  # a small message: its fixed costs, not its rows
    c.record_gather(5.0, 4096)  # a stall
    assert list(c.gather) == pytest.approx([4 * half] * SAMPLES)


def test_auto_keeps_edges_whose_small_products_run_slow():
    """A small edge exposes less, but its products (and its ramp's) may run slower per row:
    that compute is counted per chunk, at the rate measured at the chunk's size."""
    from gateway.chunk_bounds import EDGE
    groups = groups_of([1024] * 8)
    fast = {r: 1e-5 for r in (8192, 4096, 2048, 1024, 512, 256, 128, 64, 32)}
    assert choose_chunks(8192, "auto", _costs(0.4e-3, fast, 30e-3), groups)[1] < 4096 // EDGE
    slow = {**fast, 256: 3e-5, 128: 3e-5, 64: 3e-5, 32: 3e-5}  # 3x slower below 512 rows
    size, edge = choose_chunks(8192, "auto", _costs(0.4e-3, slow, 30e-3), groups)
    assert edge >= 512 and size // EDGE == edge


def test_fixed_sizes_keep_the_default_edge():
    from gateway.chunk_bounds import EDGE
    assert choose_chunks(8192, 2048, None) == (2048, 2048 // EDGE)
    assert choose_chunks(8192, 0, None) == (8192, 8192 // EDGE)


def test_message_cost_holds_the_workers_gap():
    c = ChunkCosts()
    c.record_send(1e-4)
    c.record_serve(1e-4)
    assert c.msg_s == pytest.approx(2e-4)
    c.record_gap(3e-4, 100)
    assert c.msg_s == pytest.approx(5e-4)  # one size seen: the gap is all per message
    c.record_gap(5.0, 100)  # a clock from another machine, or a stopped worker: not a message's cost
    c.record_gap(-1e-3, 100)
    assert c.msg_s == pytest.approx(5e-4)


def test_gap_growing_with_rows_is_not_a_message_cost():
    """Over tcp the worker copies each chunk's bytes itself between chunks: that part grows
    with the rows, is paid whole or chunked alike, and must not make messages look dear."""
    c = ChunkCosts()
    for rows in (128, 1024, 512, 2048, 128, 1024) * 3:
        c.record_gap(50e-6 + rows * 2e-6, rows)  # 50 us a message, 2 us a row
    assert c.gap_s == pytest.approx(50e-6, rel=1e-6)
    c2 = ChunkCosts()
    for rows in (128, 1024, 512):
        c2.record_gap(300e-6, rows)  # flat: all of it per message
    assert c2.gap_s == pytest.approx(300e-6)


def test_a_send_growing_with_rows_is_not_a_message_cost():
    """Over tcp the gateway's send copies what the socket takes of the chunk at once: that
    part grows with the rows (up to the socket's buffer, then flat) and is paid whole or
    chunked alike. Counted per message, it made every message cost a millisecond and auto
    chose chunks too big: only the smallest messages' time counts."""
    c = ChunkCosts()
    c.record_serve(10e-6)
    for rows in (8192, 128, 1024, 512, 2048, 128, 1024) * 3:
        c.record_send(40e-6 + min(rows, 600) * 1e-6, rows)  # 40 us a message, 1 us a row to 600
    assert c.send_s == pytest.approx(40e-6 + 128e-6, rel=1e-6)
    assert c.msg_s == pytest.approx(178e-6, rel=1e-6)
    one = ChunkCosts()
    one.record_send(2e-3, 8192)  # one size seen (whole parts only): all of it counts
    assert one.send_s == pytest.approx(2e-3)
    one.record_send(-1.0, 128)  # a clock that went backwards is ignored
    assert one.send_s == pytest.approx(2e-3)


def test_worker_fault_counts_are_differences_between_replies():
    from gateway.worker_link import WorkerLink
    w = WorkerLink(index=0, url="tcp://127.0.0.1:1")
    assert w.faults_since(None) == 0 and w.faults is None  # a reply that does not say
    assert w.faults_since(1000) == 1000  # the first reply: its start-up
    assert w.faults_since(1300) == 300
    for bad in ("7", 2.5, True, -1, [1]):  # not a count: ignored, the last one kept
        assert w.faults_since(bad) == 0
    assert w.faults == 1300
    assert w.faults_since(40) == 40  # fewer than before: a restarted worker, from zero
    assert w.faults_since(40) == 0


def test_a_round_counts_the_faults_it_took_here_and_on_its_workers():
    from gateway.requests import Round
    import mmap
    rnd = Round(1, [], deadline=0.0)
    rnd.worker_faults = 7
    before = rnd.faults
    assert before >= 7
    fresh = mmap.mmap(-1, 4 << 20)  # 4 MiB written for the first time: a fault a page (or
    for off in range(0, len(fresh), 4096):  # one per 2 MiB, with transparent huge pages)
        fresh[off] = 1
    assert rnd.faults >= before + 2
    fresh.close()
