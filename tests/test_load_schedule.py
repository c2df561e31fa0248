"""`moe-bench load`: arrival schedules on a fake clock, saturation detection, percentiles,
and one short real run against a gateway it starts."""
from __future__ import annotations


import numpy as np
import pytest

from bench import schedule as S
from bench.load_clients import Done, Job, segment_record
from bench.stats import Histogram



def _rate(ts) -> float:
    return (len(ts) - 1) / (ts[-1] - ts[0])


def _paced(gaps, n=10_000, t0=5.0, clock=None, work=None):
    clock = clock or S.FakeClock(t0)
    pacer = S.Pacer(S.arrivals(gaps, t0=t0, max_n=n), clock)
    released, scheduled = [], []
    for a in pacer:
        released.append(clock.now())
        scheduled.append(a.t)
        if work is not None:
            clock.advance(work())
    return np.asarray(scheduled), np.asarray(released), pacer


@pytest.mark.parametrize("rate", [5.0, 123.0, 2000.0])
def test_constant_rate_accuracy(rate):
    sched, released, _ = _paced(S.constant_gaps(rate))
    assert len(released) == 10_000
    assert abs(_rate(released) / rate - 1) < 1e-6
    # absolute deadlines: t_i = t0 + i / rate, no accumulated float error
    assert np.max(np.abs(sched - (5.0 + np.arange(10_000) / rate))) < 1e-9


def test_poisson_rate_accuracy():
    rate = 50.0
    sched, released, _ = _paced(S.poisson_gaps(rate, np.random.default_rng(0)))
    assert abs(_rate(released) / rate - 1) < 0.02
    gaps = np.diff(sched)
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential: CV 1
    # over many seeds: unbiased, and the spread is the Poisson one (1/sqrt(n) = 1% at 10^4
    # arrivals), so a single 10^4-arrival run is within 2% about 95% of the time
    errs = np.array([_rate(np.asarray([a.t for a in S.arrivals(S.poisson_gaps(rate, np.random.default_rng(s)),
                                                                 t0=0.0, max_n=10_000)])) / rate - 1
                     for s in range(40)])
    assert abs(errs.mean()) < 0.005
    assert 0.005 < errs.std() < 0.015
    assert np.mean(np.abs(errs) < 0.02) >= 0.85


def test_duration_bound_and_count():
    rate, dur = 20.0, 7.0
    got = list(S.arrivals(S.constant_gaps(rate), t0=100.0, duration=dur))
    assert len(got) == int(rate * dur)
    assert got[0].t == 100.0 and got[-1].t < 107.0
    assert [a.index for a in got] == list(range(len(got)))
    with pytest.raises(ValueError):
        next(S.arrivals(S.constant_gaps(1.0), t0=0.0))
    with pytest.raises(ValueError):
        next(S.constant_gaps(0.0))


def test_late_consumer_does_not_drift():
    """A consumer that sometimes takes longer than a gap: later deadlines stay where they
    were (it catches up), unlike sleep(gap)-after-each-send, which loses rate."""
    rate, n = 100.0, 10_000
    rng = np.random.default_rng(7)
    # mean work 8 ms < the 10 ms gap, but often longer than it (up to 25 ms)
    work = lambda: float(rng.choice([0.001, 0.005, 0.025], p=[0.4, 0.3, 0.3]))  # noqa: E731
    sched, released, pacer = _paced(S.constant_gaps(rate), n=n, t0=0.0, work=work)
    assert np.max(np.abs(sched - np.arange(n) / rate)) < 1e-9       # deadlines never moved
    assert np.all(released >= sched - 1e-12)                         # never early
    assert abs(_rate(released) / rate - 1) < 0.02                     # achieved = target
    assert max(pacer.lateness) > 0.01                                 # it really was late at times
    assert pacer.lateness[-1] < 0.1                                   # ... and caught up

    # the naive relative-sleep loop, same work: every late send pushes the rest back
    clock, naive = S.FakeClock(0.0), []
    rng = np.random.default_rng(7)
    for _ in range(n):
        naive.append(clock.now())
        clock.advance(work())
        clock.sleep_until(clock.now() + 1 / rate)
    assert _rate(np.asarray(naive)) < 0.6 * rate


def test_real_clock_paces_absolute():
    clock = S.RealClock()
    t0 = clock.now()
    pacer = S.Pacer(S.arrivals(S.constant_gaps(200.0), t0=t0, max_n=40), clock)
    out = [clock.now() for _ in pacer]
    assert np.all(np.asarray(out) >= t0 + np.arange(40) / 200.0 - 1e-6)
    assert out[-1] - t0 < 39 / 200.0 + 0.05


def test_gamma_burstiness_is_vllms_shape():
    """--burstiness is vLLM's: the gamma shape, scale 1/(rate * burstiness). 1 is Poisson,
    lower is burstier: on a long schedule the gaps' CV is 1/sqrt(burstiness) and the mean
    gap 1/rate, whatever the burstiness."""
    rate = 10.0
    cvs = []
    for b in (0.25, 0.5, 1.0, 2.0, 4.0):
        g = np.fromiter(S.gamma_gaps(rate, b, np.random.default_rng(3)), float, count=200_000)
        cvs.append(g.std() / g.mean())
        assert abs(cvs[-1] * np.sqrt(b) - 1) < 0.03, (b, cvs[-1])
        assert abs(g.mean() * rate - 1) < 0.02
        assert S.cv_of_burstiness(b) == pytest.approx(1 / np.sqrt(b))
        assert S.burstiness_for_cv(S.cv_of_burstiness(b)) == pytest.approx(b)
    assert all(a > b for a, b in zip(cvs, cvs[1:]))  # lower burstiness: burstier
    # burstiness 1 is a Poisson process: the same gaps as the exponential
    e = np.fromiter(S.poisson_gaps(rate, np.random.default_rng(9)), float, count=200_000)
    g1 = np.fromiter(S.gamma_gaps(rate, 1.0, np.random.default_rng(9)), float, count=200_000)
    assert abs(np.quantile(e, 0.9) / np.quantile(g1, 0.9) - 1) < 0.03
    # through the schedule the tool builds (absolute deadlines), long enough to judge
    for b in (0.25, 4.0):
        ts = np.asarray([a.t for a in S.arrivals(S.make_gaps("gamma", rate, np.random.default_rng(5), b),
                                                 t0=0.0, max_n=100_000)])
        gaps = np.diff(ts)
        assert abs(gaps.std() / gaps.mean() * np.sqrt(b) - 1) < 0.03
        assert abs(_rate(ts) / rate - 1) < 0.03
    # bursty arrivals still hit the target rate on absolute deadlines
    _, released, _ = _paced(S.gamma_gaps(rate, 0.25, np.random.default_rng(5)), n=10_000)
    assert abs(_rate(released) / rate - 1) < 0.05
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError):
            next(S.gamma_gaps(rate, bad, np.random.default_rng(0)))


def test_ramp_steps():
    steps = S.ramp_steps(10.0, 50.0, 5, 2.0)
    assert [s.rate for s in steps] == [10.0, 20.0, 30.0, 40.0, 50.0]
    assert all(s.duration == 2.0 for s in steps)
    assert S.ramp_steps(3.0, 7.0, 1, 1.0)[0].rate == 7.0
    arr = list(S.ramp_arrivals(steps, t0=1000.0))
    for j, s in enumerate(steps):
        ts = [a.t for a in arr if a.step == j]
        assert len(ts) == int(s.rate * s.duration)
        assert ts[0] == pytest.approx(1000.0 + 2.0 * j)                 # absolute step boundaries
        assert ts[-1] < 1000.0 + 2.0 * (j + 1)
        assert all(a.rate == s.rate for a in arr if a.step == j)
        assert _rate(ts) == pytest.approx(s.rate)
    assert [a.index for a in arr] == list(range(len(arr)))
    capped = list(S.ramp_arrivals(steps, t0=0.0, max_n=50))
    assert len(capped) == 50 and capped[-1].step == 1
    poisson = list(S.ramp_arrivals(steps, t0=0.0, kind="poisson", rng=np.random.default_rng(1)))
    assert {a.step for a in poisson} == set(range(5))


def test_saturation_detection_synthetic():
    rng = np.random.default_rng(0)
    t = np.arange(200) / 40.0  # 5 s at 40/s
    flat = 0.002 + 0.001 * rng.random(200)
    spiky = flat.copy()
    spiky[::37] += 0.05  # occasional hiccups, no trend
    growing = 0.002 + 0.25 * t + 0.002 * rng.random(200)  # backlog grows 250 ms per second
    assert not S.queue_growing(t, flat)
    assert not S.queue_growing(t, spiky)
    assert S.queue_growing(t, growing)
    assert not S.queue_growing(t[:3], growing[:3])  # too few points to judge
    # a knee: steps within the SLO, then one whose p99 TPOT exceeds it, then one whose queue grows
    v = [S.StepVerdict(10, 20.0, False, 100.0), S.StepVerdict(20, 60.0, False, 100.0),
         S.StepVerdict(30, 140.0, False, 100.0), S.StepVerdict(40, 90.0, True, 100.0)]
    assert [x.ok for x in v] == [True, True, False, False]
    assert "TPOT" in v[2].why and "queueing" in v[3].why
    assert S.find_knee(v) == 20
    assert S.find_knee(v[2:]) is None
    assert S.find_knee([S.StepVerdict(10, 1.0, False, 100.0), S.StepVerdict(20, 1.0, True, 100.0)]) == 10


def test_segment_record_on_synthetic_requests():
    """The runner's statistics on requests with known timings."""
    def req(i, sched, qdelay, prefill, steps):
        d = Done(Job(S.Arrival(i, sched, 0, 10.0), 64, len(steps)))
        d.start = sched + qdelay
        d.first = d.start + prefill
        d.steps = list(steps)
        d.end = d.first + sum(steps)
        return d
    ok = [req(i, i * 0.1, 0.001, 0.010, [0.004] * 8) for i in range(50)]
    r = segment_record(ok, mode="fixed-rate", backend="shm", target_rate=10.0, duration=5.0, slo_tpot_ms=100.0)
    assert r["start_rate"] == pytest.approx(10.0, rel=1e-6)
    assert r["scheduled_rate"] == pytest.approx(10.0, rel=1e-6)
    # one duration for every rate: the 5 s schedule (the last request ends inside it)
    assert r["duration_s"] == pytest.approx(5.0) and r["request_throughput"] == pytest.approx(10.0)
    assert r["completed"] == 50 and r["failed"] == 0
    assert r["tpot_ms"]["p50"] == pytest.approx(4.0, rel=0.01)
    assert r["ttft_ms"]["p99"] == pytest.approx(11.0, rel=0.01)
    assert r["e2e_ms"]["p50"] == pytest.approx(43.0, rel=0.01)
    assert r["tokens"] == 50 * 72 and not r["saturated"]
    late = [req(i, i * 0.1, 0.3 * i * 0.1, 0.010, [0.004] * 8) for i in range(50)]
    r = segment_record(late, mode="ramp", backend="shm", target_rate=10.0, duration=5.0, slo_tpot_ms=100.0, step=2)
    assert r["queue_growing"] and r["saturated"] and r["step"] == 2
    assert r["start_rate"] < 10.0 / 1.2
    assert r["scheduled_rate"] == pytest.approx(10.0, rel=1e-6)  # the schedule was right; the starts lagged


@pytest.mark.parametrize("use_hdr", [True, False])
def test_histogram_percentiles_against_numpy(use_hdr):
    rng = np.random.default_rng(11)
    data = np.concatenate([rng.lognormal(np.log(0.005), 0.6, 20_000), [0.9, 1.5]])  # seconds, a long tail
    h = Histogram(use_hdr=use_hdr)
    assert h.kind == ("hdr" if use_hdr else "numpy")
    for v in data:
        h.record(float(v))
    s = h.summary()
    ms = data * 1e3
    for key, p in (("p50", 50), ("p95", 95), ("p99", 99), ("p999", 99.9)):
        want = float(np.percentile(ms, p))
        if use_hdr:  # 3 significant digits, value-at-percentile semantics
            assert s[key] == pytest.approx(want, rel=0.01, abs=0.002)
        else:
            assert s[key] == pytest.approx(want, rel=1e-12)
    assert s["n"] == len(data) and s["max"] == pytest.approx(1500.0)
    # exact known data: 1..1000 ms
    h = Histogram(use_hdr=use_hdr)
    for v in range(1, 1001):
        h.record(v / 1e3)
    assert h.percentile_ms(50) == pytest.approx(500.0, abs=0.6)
    assert h.percentile_ms(99.9) == pytest.approx(999.0, abs=1.1)
    assert np.isnan(Histogram(use_hdr=use_hdr).percentile_ms(50))
