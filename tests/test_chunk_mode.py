"""Whether auto chunks at all (gateway/chunk_mode.py), without sockets: both ways measured,
the cheaper kept by a margin, probes that space out while the choice holds, and rounds that
faulted in fresh memory left out."""
from __future__ import annotations

import pytest

from gateway.chunk_mode import ChunkMode
from gateway.chunking import MAX_PROBE_EVERY, MODE_MARGIN, PROBE_EVERY, PROBES, SAMPLES, WARMUP


def _asks(m, n):
    return [m.want_chunks() for _ in range(n)]


def test_chunk_mode_measures_both_ways_and_keeps_the_cheaper():
    m = ChunkMode()
    assert not any(_asks(m, 50))  # nothing measured: whole, however often asked
    for _ in range(WARMUP):
        assert not m.want_chunks()
        m.record(False, 0.05, 500)  # 100 us a row, whole
    probes = []
    while len(m.samples[True]) < PROBES:  # whole measured, chunked not yet: every other round
        c = m.want_chunks()
        probes.append(c)
        m.record(c, 0.06 if c else 0.05, 500)  # chunked measured dearer (120 us a row)
        assert len(probes) < 4 * PROBES
    assert probes.count(True) == PROBES and probes.count(False) in (PROBES - 1, PROBES, PROBES + 1)
    picks = []
    for _ in range(3 * PROBE_EVERY):
        c = m.want_chunks()
        picks.append(c)
        m.record(c, 0.06 if c else 0.05, 500)
    # whole nearly always, chunked once in a while to stay measured: after PROBE_EVERY
    # rounds, again after as many, then (the choice held) after twice as many
    assert [i + 1 for i, c in enumerate(picks) if c] == [PROBE_EVERY, 2 * PROBE_EVERY]
    m.record(False, 5.0, 500)  # one round 100x slower (a shared machine) flips nothing
    assert m.per_row(False) == pytest.approx(1e-4) and _asks(m, PROBE_EVERY).count(True) == 1
    m2 = ChunkMode()  # and the other way round: chunks cheaper, chunks kept
    for _ in range(WARMUP):
        m2.record(False, 0.05, 500)
    for _ in range(3 * PROBE_EVERY):
        c = m2.want_chunks()
        m2.record(c, 0.04 if c else 0.05, 500)
    assert _asks(m2, 2 * PROBE_EVERY).count(False) == 1 and m2.per_row(True) < m2.per_row(False)
    snap = m2.snapshot()
    assert snap["asked"] == m2.asked and snap["chunked_s_per_row"] < snap["whole_s_per_row"]
    assert snap["chunks_cheaper"] and not m.snapshot()["chunks_cheaper"]


def test_chunks_are_cheaper_only_by_the_margin():
    """The verdict the choice and its snapshot share: chunked rounds cheaper per row than
    whole ones by more than MODE_MARGIN, and nothing before both ways have a sample."""
    m = ChunkMode()
    assert not m.chunks_cheaper()
    m.record(True, 0.01, 100)
    assert not m.chunks_cheaper()  # no whole round yet
    m.record(False, 0.01 / (1 - MODE_MARGIN) * 1.001, 100)
    assert m.chunks_cheaper()
    m2 = ChunkMode()
    m2.record(True, 0.01, 100)
    m2.record(False, 0.01 / (1 - MODE_MARGIN) * 0.999, 100)  # inside the margin: whole
    assert not m2.chunks_cheaper() and not m2.snapshot()["chunks_cheaper"]


def test_chunk_mode_keeps_chunks_a_few_percent_cheaper():
    """At 4096 tokens over shm with one worker, chunked rounds ran 2-8% cheaper per row than
    whole ones, and a 5% margin kept parts whole in three runs of six (moe-bench moe). Chunks
    3.6% cheaper are kept; 1% cheaper is within the noise, and parts stay whole."""
    whole = (14.05, 14.40, 13.90, 14.30, 14.60)[:WARMUP + 1]  # us a row; lower quartile 14.05
    for chunked, keep in (((13.55, 13.70, 13.62), True), ((13.95, 14.10, 13.98), False)):
        m = ChunkMode()
        for t in whole:
            m.record(False, t * 1e-6, 1)
        for i in range(SAMPLES):  # a close call: made on SAMPLES probes, not PROBES
            assert not m.settled and not m.want_chunks(measurable=False)
            m.record(True, chunked[i % len(chunked)] * 1e-6, 1)
            assert m.close_call()
            if i + 1 == PROBES:  # three probes' lower quartile is the fastest of them
                assert m.per_row(True) == min(chunked) * 1e-6
        assert m.settled and m.want_chunks(measurable=False) is keep
        assert (m.per_row(True) < m.per_row(False) * (1 - MODE_MARGIN)) is keep


@pytest.mark.parametrize("chunked_us,keep", [(12.5, True), (14.3, False)],
                         ids=["chunks-11%-cheaper", "chunks-2%-dearer"])
def test_chunk_mode_settles_a_clear_call_on_its_first_probes(chunked_us, keep):
    """Chunks well clear of the margin either way: PROBES probes decide, and the next
    rounds go the chosen way."""
    m = ChunkMode()
    for _ in range(WARMUP):
        m.record(False, 14.0e-6, 1)
    for i in range(PROBES):
        assert not m.settled
        m.record(True, (chunked_us + 0.1 * i) * 1e-6, 1)
    assert m.settled and not m.close_call() and m.want_chunks(measurable=False) is keep


def test_chunk_mode_keeps_chunks_until_they_are_dearer():
    """Chunks are taken once 2% cheaper per row, then kept while not dearer: at 4096 tokens
    over shm a chunked probe that moved them from 2.0% to 1.7% cheaper sent the rest of a
    run whole (2 runs of 8). Back from whole parts, chunks must be 2% cheaper again."""
    m = ChunkMode()
    for _ in range(WARMUP + 1):
        m.record(False, 16.8e-6, 1)

    def chunked_at(us: float) -> bool:  # the choice once the last SAMPLES chunked rounds took us a row
        for _ in range(SAMPLES):
            m.record(True, us * 1e-6, 1)
        return m.want_chunks(measurable=False)

    assert chunked_at(16.4) and m.snapshot()["chunks_kept"]  # 2.4% cheaper: taken
    assert chunked_at(16.55) and not m.chunks_cheaper()  # 1.5%: inside the margin, kept
    assert chunked_at(16.79)  # still not dearer
    assert not chunked_at(16.9) and m.snapshot()["chunks_kept"] is False  # dearer: whole parts
    assert 16.6 > 16.8 * (1 - MODE_MARGIN) and not chunked_at(16.6)  # 1.2% cheaper is not enough back
    assert chunked_at(16.4)  # 2.4% is


def test_chunk_mode_sees_through_stalled_probes():
    """The first rounds to write a slot's pages stall (2-5x here), whichever way they go: two
    stalled probes of three must not keep parts whole when chunks are cheaper (measured at
    8192 tokens over tcp: whole 16.3-17.4 us a row, with stalls of 60 and 89; chunked 13.6,
    with stalls of 29 and 25)."""
    m = ChunkMode()
    for s in (16.74, 16.64, 17.43, 17.39, 16.27)[:WARMUP + 1]:
        m.record(False, s * 1e-6, 1)
    for chunked, s in ((True, 29.36), (False, 60.40), (True, 13.58), (False, 89.18), (True, 25.15)):
        m.record(chunked, s * 1e-6, 1)
    assert m.want_chunks(measurable=False)  # chunks cheaper: even unmeasurable rounds go chunked
    assert m.per_row(True) == pytest.approx(13.58e-6)


def test_chunk_mode_probes_less_while_the_choice_holds_and_again_when_it_flips():
    """A probe costs a round the dearer way: while probes leave the choice as it was the
    interval doubles (to MAX_PROBE_EVERY); once the measured medians flip it, it starts
    over at PROBE_EVERY."""
    m = ChunkMode()
    for _ in range(WARMUP):
        m.record(False, 0.05, 500)
    for _ in range(PROBES):
        m.record(True, 0.06, 500)  # chunks dearer
    gaps, last = [], 0
    for i in range(1, 2000):
        if m.want_chunks():
            gaps.append(i - last)
            last = i
    assert gaps[:6] == [PROBE_EVERY, PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY, MAX_PROBE_EVERY]
    assert set(gaps[5:]) == {MAX_PROBE_EVERY} and m.probe_every == MAX_PROBE_EVERY
    for _ in range(SAMPLES):  # chunks are cheaper now (say the load changed)
        m.record(True, 0.03, 500)
    picks = _asks(m, MAX_PROBE_EVERY)
    assert picks[0] and 1 <= picks.count(False) <= 5  # chunked from here on, whole as probes:
    flip = picks.index(False) + 1  # the first probe after the flip saw it and started over
    probes = [i + 1 for i, c in enumerate(picks) if not c]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == [PROBE_EVERY * 2 ** i for i in range(len(gaps))]  # from PROBE_EVERY, doubling again
    assert flip <= MAX_PROBE_EVERY and m.probe_every < MAX_PROBE_EVERY


def test_chunk_mode_probes_only_with_rounds_it_can_measure():
    """Under load few rounds are alone in flight, so few can be timed: until both ways are
    measured the others go whole (probing with them chunked half the rounds blind), and
    once measured they follow the measured way; a probe is one measurable round in
    PROBE_EVERY, however rarely a measurement comes."""
    m = ChunkMode()
    for _ in range(WARMUP):
        m.record(False, 0.05, 500)
    assert not any(m.want_chunks(measurable=False) for _ in range(100))  # chunks not measured yet
    while len(m.samples[True]) < PROBES:
        if m.want_chunks(measurable=True):
            m.record(True, 0.06, 500)  # chunks measured dearer
    assert not any(m.want_chunks(measurable=False) for _ in range(100))
    picks = [m.want_chunks(measurable=True) for _ in range(20 * PROBE_EVERY)]
    assert [i + 1 for i, c in enumerate(picks) if c] == [16, 32, 64, 128, 256]  # backing off
    m2 = ChunkMode()  # chunks measured cheaper: unmeasurable rounds go chunked too
    for _ in range(WARMUP):
        m2.record(False, 0.05, 500)
    for _ in range(PROBES):
        m2.record(True, 0.04, 500)
    assert all(m2.want_chunks(measurable=False) for _ in range(100))


# measured at 8192 tokens over tcp, one worker (minor page faults of the gateway and the
# worker per round, and us per row): the whole warm-up rounds are warm; all three probes,
# and the whole rounds between them, write pages of slots no round had used
_WARM_WHOLE = [(16.74, 690), (16.64, 545), (17.43, 640), (17.39, 528)]
_COLD_PROBES = [(True, 29.36, 16912), (False, 60.40, 42903), (True, 25.15, 5285), (False, 89.18, 10579),
                (True, 31.02, 5421)]
_WARM_PROBES = [(True, 13.58, 528), (False, 16.92, 528), (True, 13.91, 529), (False, 17.05, 528),
                (True, 13.66, 528)]


def _replay(m, rounds, faults=True):
    for chunked, us, flt in rounds:
        m.record(chunked, us * 1e-6, 1, flt if faults else None)


def test_chunk_mode_leaves_out_rounds_that_faulted_in_fresh_memory():
    """All three warm-up probes stalled on fresh slot pages: their times (and the stalled
    whole rounds') are left out, probing goes on, and the warm probes that follow decide.
    The same times without the fault counts keep parts whole: the stalls decide there."""
    m = ChunkMode()
    _replay(m, [(False, us, flt) for us, flt in _WARM_WHOLE][:WARMUP])
    _replay(m, _COLD_PROBES)
    assert m.cold == len(_COLD_PROBES) and not m.settled
    assert m.want_chunks() != m.want_chunks()  # still probing: every other measurable round
    _replay(m, _WARM_PROBES)
    assert m.settled and len(m.samples[True]) == PROBES
    assert m.want_chunks(measurable=False) and m.per_row(True) == pytest.approx(13.58e-6)
    assert m.snapshot()["cold"] == len(_COLD_PROBES) and m.snapshot()["settled"]

    blind = ChunkMode()
    _replay(blind, [(False, us, flt) for us, flt in _WARM_WHOLE][:WARMUP], faults=False)
    _replay(blind, _COLD_PROBES, faults=False)
    assert blind.settled and not blind.want_chunks(measurable=False)


def test_chunk_mode_takes_a_steady_fault_rate_as_the_baseline():
    """Faults every round alike (the gateway's fresh output array, 528 here, each round) are
    the steady state: nothing is left out."""
    m = ChunkMode()
    _replay(m, [(i % 2 == 1, 15.0, 528 + (i % 3)) for i in range(12)])
    assert m.cold == 0 and m.rounds == 12


def test_chunk_mode_takes_a_way_that_always_faults_after_a_run_of_cold_rounds():
    """A way whose every round faults is that way's cost, not a start-up: after SAMPLES cold
    rounds in a row its rounds count, and keep counting until one is warm again."""
    m = ChunkMode()
    _replay(m, [(False, 15.0, 0)] * WARMUP)
    for i in range(SAMPLES):
        m.record(True, 20e-6, 1, 5000)
        m.record(False, 15e-6, 1, 0)
    assert m.cold == SAMPLES and not m.samples[True]
    _replay(m, [(True, 20.0, 5000)] * 3)
    assert len(m.samples[True]) == 3 and m.settled and not m.want_chunks(measurable=False)
