"""Arrival schedules for `moe-bench load`: pure computation, no I/O, an injectable clock.

An open-loop load generator must send request i at t_i = t0 + (g_1 + ... + g_i), an
ABSOLUTE deadline, never "sleep(gap) after each send": then the time spent sending (or a
late wake-up) does not push every later request back, and the achieved rate equals the
target. A consumer that falls behind finds its next deadlines already due and catches up.

    clock = RealClock()
    pacer = Pacer(arrivals(poisson_gaps(50.0, rng), t0=clock.now(), duration=10.0), clock)
    for a in pacer:            # sleeps until a.t, then yields (a.t is the scheduled time)
        submit(a)

Gaps: :func:`constant_gaps`, :func:`poisson_gaps` (exponential), :func:`gamma_gaps` (the
burstiness is vLLM's: the gamma SHAPE, 1 is Poisson, lower is burstier, higher more
regular; the gaps' coefficient of variation is 1/sqrt(burstiness), and
:func:`burstiness_for_cv` converts a CV into it). :func:`ramp_steps` /
:func:`ramp_arrivals` give a staircase of rates, each step a fixed duration.
:func:`queue_growing`, :class:`StepVerdict`, :func:`find_knee` and :func:`knee_of` judge
over-saturation.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np


# -- clocks ----------------------------------------------------------------------------
class RealClock:
    """time.perf_counter, and a sleep that wakes at an absolute time (not after a gap)."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep_until(self, t: float) -> None:
        while True:
            left = t - time.perf_counter()
            if left <= 0:
                return
            # sleep most of the way; the last ~1 ms in short slices (sleep overshoots)
            time.sleep(left - 0.001 if left > 0.002 else 0.0002)


class FakeClock:
    """A clock the test drives: sleep_until jumps to the deadline (if it is ahead)."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = float(t)
        self.sleeps = 0

    def now(self) -> float:
        return self.t

    def sleep_until(self, t: float) -> None:
        self.sleeps += 1
        if t > self.t:
            self.t = t

    def advance(self, dt: float) -> None:
        self.t += dt


# -- gaps (inter-arrival times) --------------------------------------------------------
def _check_rate(rate: float) -> float:
    rate = float(rate)
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"rate must be a positive finite number, got {rate}")
    return rate


def constant_gaps(rate: float) -> Iterator[float]:
    g = 1.0 / _check_rate(rate)
    while True:
        yield g


def poisson_gaps(rate: float, rng: np.random.Generator, chunk: int = 4096) -> Iterator[float]:
    """Exponential gaps with mean 1/rate (a Poisson process)."""
    scale = 1.0 / _check_rate(rate)
    while True:
        yield from rng.exponential(scale, chunk).tolist()


def gamma_gaps(rate: float, burstiness: float, rng: np.random.Generator, chunk: int = 4096) -> Iterator[float]:
    """Gamma gaps with mean 1/rate and shape ``burstiness`` (vLLM's definition: scale
    1/(rate * burstiness)). Burstiness 1 is Poisson (exponential gaps), lower is burstier,
    higher more regular: the gaps' coefficient of variation is 1/sqrt(burstiness)."""
    rate = _check_rate(rate)
    if not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")
    scale = 1.0 / (burstiness * rate)
    while True:
        yield from rng.gamma(burstiness, scale, chunk).tolist()


def burstiness_for_cv(cv: float) -> float:
    """The gamma shape whose gaps have coefficient of variation ``cv`` (1/cv^2)."""
    if not cv > 0 or math.isinf(cv):
        raise ValueError(f"a coefficient of variation must be a positive finite number, got {cv}")
    return 1.0 / (cv * cv)


def cv_of_burstiness(burstiness: float) -> float:
    """The gaps' coefficient of variation for a gamma shape (1/sqrt(burstiness))."""
    return 1.0 / math.sqrt(burstiness)


def make_gaps(kind: str, rate: float, rng: np.random.Generator, burstiness: float = 1.0) -> Iterator[float]:
    """Gaps of ``kind`` at ``rate``; ``burstiness`` (the gamma shape) shapes gamma gaps only."""
    if kind == "constant":
        return constant_gaps(rate)
    if kind == "poisson":
        return poisson_gaps(rate, rng)
    if kind == "gamma":
        return gamma_gaps(rate, burstiness, rng)
    raise ValueError(f"unknown arrival process {kind!r}")


# -- absolute schedules ----------------------------------------------------------------
@dataclass(frozen=True)
class Arrival:
    index: int      # 0, 1, 2, ... over the whole schedule
    t: float        # the scheduled (absolute) time
    step: int = 0   # ramp step (0 outside a ramp)
    rate: float = 0.0  # the target rate in force


def arrivals(gaps: Iterable[float], *, t0: float, duration: Optional[float] = None,
             max_n: Optional[int] = None, step: int = 0, rate: float = 0.0, start_index: int = 0,
             first_at_t0: bool = True) -> Iterator[Arrival]:
    """Absolute times t0 (+ g1) (+ g2) ... while t < t0 + duration and fewer than max_n.

    The sum is compensated (Kahan), so 10^6 gaps of 1/rate land on t0 + i/rate to ~1e-12 s.
    ``first_at_t0``: the first request at t0 itself (else after the first gap)."""
    if duration is None and max_n is None:
        raise ValueError("an unbounded schedule: give duration or max_n")
    end = None if duration is None else t0 + duration
    it = iter(gaps)
    offset, comp = 0.0, 0.0
    if not first_at_t0:
        offset = next(it)
    i = 0
    while max_n is None or i < max_n:
        t = t0 + offset
        if end is not None and t >= end:
            return
        yield Arrival(start_index + i, t, step, rate)
        i += 1
        # Kahan summation of the gaps
        y = next(it) - comp
        s = offset + y
        comp = (s - offset) - y
        offset = s


@dataclass(frozen=True)
class RampStep:
    rate: float
    duration: float


def ramp_steps(start: float, stop: float, n_steps: int, step_duration: float) -> list[RampStep]:
    """n_steps rates evenly from start to stop (inclusive), each for step_duration."""
    if n_steps < 1:
        raise ValueError("a ramp needs at least one step")
    if n_steps == 1:
        return [RampStep(_check_rate(stop), step_duration)]
    return [RampStep(_check_rate(start + (stop - start) * i / (n_steps - 1)), step_duration)
            for i in range(n_steps)]


def ramp_arrivals(steps: Sequence[RampStep], *, t0: float, kind: str = "constant",
                  rng: Optional[np.random.Generator] = None, burstiness: float = 1.0,
                  max_n: Optional[int] = None) -> Iterator[Arrival]:
    """One schedule over all steps: step j covers [t0 + sum of earlier durations, + its own),
    its boundary absolute too, so no step's timing depends on the ones before."""
    rng = rng if rng is not None else np.random.default_rng(0)
    start, n = t0, 0
    for j, s in enumerate(steps):
        left = None if max_n is None else max_n - n
        if left is not None and left <= 0:
            return
        for a in arrivals(make_gaps(kind, s.rate, rng, burstiness), t0=start, duration=s.duration,
                          max_n=left, step=j, rate=s.rate, start_index=n):
            n += 1
            yield a
        start = t0 + sum(x.duration for x in steps[:j + 1])


class Pacer:
    """Yields each arrival once the clock reaches its scheduled time (absolute deadlines:
    lateness in the consumer never shifts later arrivals). ``lateness`` records now - t
    at each release."""

    def __init__(self, schedule: Iterable[Arrival], clock, stop: Optional[Callable[[], bool]] = None) -> None:
        self.schedule, self.clock, self.stop = schedule, clock, stop
        self.lateness: list[float] = []

    def __iter__(self) -> Iterator[Arrival]:
        for a in self.schedule:
            if self.stop is not None and self.stop():
                return
            self.clock.sleep_until(a.t)
            self.lateness.append(self.clock.now() - a.t)
            yield a


# -- saturation ------------------------------------------------------------------------
def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys against xs (0 for fewer than 2 distinct xs)."""
    x = np.asarray(xs, float)
    y = np.asarray(ys, float)
    if len(x) < 2 or np.ptp(x) == 0:
        return 0.0
    xm = x - x.mean()
    return float(np.dot(xm, y - y.mean()) / np.dot(xm, xm))


def queue_growing(sched_t: Sequence[float], delay_s: Sequence[float], *, min_slope: float = 0.05,
                  min_delay_s: float = 0.02, min_points: int = 5) -> bool:
    """True when the queueing delay (actual start - scheduled start) keeps growing over the
    step: the least-squares slope exceeds ``min_slope`` seconds of delay per second AND the
    late part of the step waits more than ``min_delay_s`` more than the early part (a flat,
    small delay, or jitter around one, is not saturation)."""
    n = len(delay_s)
    if n < min_points:
        return False
    d = np.asarray(delay_s, float)
    third = max(1, n // 3)
    grew = float(np.median(d[-third:]) - np.median(d[:third]))
    return slope(sched_t, d) > min_slope and grew > min_delay_s


@dataclass
class StepVerdict:
    """One ramp step judged: within the SLO when its queueing delay does not grow, its p99
    TPOT is within the SLO, and no request failed (a step whose requests fail is not
    carrying that rate, whatever the latency of the others)."""
    rate: float
    p99_tpot_ms: float
    queue_growing: bool
    slo_tpot_ms: float
    failed: int = 0
    requests: Optional[int] = None

    @property
    def ok(self) -> bool:
        return (not self.queue_growing and self.p99_tpot_ms <= self.slo_tpot_ms and self.failed == 0
                and self.requests != 0)

    @property
    def why(self) -> str:
        if self.ok:
            return "within SLO"
        reasons = []
        if self.requests == 0:
            reasons.append("no request was sent")
        if self.failed:
            of = f" of {self.requests}" if self.requests is not None else ""
            reasons.append(f"{self.failed}{of} requests failed")
        if self.queue_growing:
            reasons.append("queueing delay grows")
        if self.p99_tpot_ms > self.slo_tpot_ms:
            reasons.append(f"p99 TPOT {self.p99_tpot_ms:.1f} ms > SLO {self.slo_tpot_ms:g} ms")
        return "; ".join(reasons)


def find_knee(verdicts: Sequence[StepVerdict]) -> Optional[float]:
    """The knee: the highest rate within the SLO below the first saturated step. None when
    even the first step saturated, and None when NO step saturated (the top step is then a
    lower bound, not a knee: see :func:`knee_of`)."""
    return knee_of(verdicts)["rate"]


def knee_of(verdicts: Sequence[StepVerdict]) -> dict:
    """The ramp's verdict on its knee, for the report and the JSON:

    - reached: ``rate`` the highest rate within the SLO, ``saturated_at`` the first step
      that was not (and ``why``);
    - not reached: no step saturated, so the knee is at least the top rate measured
      (``at_least``), never the top step itself;
    - below the ramp: even the first step saturated (``below``)."""
    vs = list(verdicts)
    if not vs:
        return {"reached": False, "rate": None, "at_least": None, "below": None, "saturated_at": None,
                "text": "no step measured"}
    bad = next((i for i, v in enumerate(vs) if not v.ok), None)
    if bad is None:
        top = max(v.rate for v in vs)
        return {"reached": False, "rate": None, "at_least": top, "below": None, "saturated_at": None,
                "text": f"knee not reached (>= {top:g} req/s): no step saturated"}
    if bad == 0:
        return {"reached": False, "rate": None, "at_least": None, "below": vs[0].rate, "saturated_at": vs[0].rate,
                "why": vs[0].why, "text": f"knee below the ramp (< {vs[0].rate:g} req/s): the first step saturated "
                                          f"({vs[0].why})"}
    knee = max(v.rate for v in vs[:bad])
    return {"reached": True, "rate": knee, "at_least": None, "below": None, "saturated_at": vs[bad].rate,
            "why": vs[bad].why, "text": f"knee {knee:g} req/s (saturated at {vs[bad].rate:g} req/s: {vs[bad].why})"}
