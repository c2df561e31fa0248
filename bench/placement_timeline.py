"""The expert placement of a started gateway over a load run: polled, and what it says.

:class:`PlacementTimeline` asks the gateway's ``placement show`` every ``period`` seconds
from a thread while the load runs, and keeps a timeline: per sample the time (seconds since
the run began, the load tool's clock), each layer's balancedness (vLLM's: mean / max worker
load over the gateway's window), the placement version, the move in progress and the
counts of moves done and abandoned. A move is usually over in tens of milliseconds, less
than a poll: it is seen through those counts, and its window placed from the EPLB run that
started it (the gateway's ``eplb.runs``, on the same monotonic clock) where one did, else
conservatively, from the poll before it (less its duration) to the poll that saw it done.

The rest is pure, for the report and its tests: which requests overlapped a move (p99 TPOT
during moves against the same run's steady p99), and, under drifting routing, whether
balancedness was back to >= 0.9 two EPLB intervals after each shift.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from bench.stats import reliable

MIN_GAIN = 0.01  # an EPLB run whose target lifts balancedness by this much starts a move (gateway/live_placement.py)
ACTIVE = ("loading", "switched", "retiring")


class PlacementTimeline:
    """``show()``: the gateway's ``placement show`` document (a GatewayClient call);
    ``now()``: the load tool's clock; times are kept relative to ``t_run`` on it."""

    def __init__(self, show: Callable[[], dict], now: Callable[[], float], t_run: float, *,
                 period: float = 0.2) -> None:
        self.show, self.now, self.t_run, self.period = show, now, t_run, period
        # the gateway stamps its EPLB runs with time.monotonic(); the load tool's clock may differ
        self.offset = time.monotonic() - now()
        self.samples: list[dict] = []
        self.moves: list[dict] = []
        self.runs: dict = {}  # gateway time -> (seconds, before, after)
        self.errors = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._seen = 0  # moves done + abandoned at the last sample
        self._claimed: set = set()  # EPLB runs a move was placed from

    def start(self) -> "PlacementTimeline":
        self._thread = threading.Thread(target=self._loop, daemon=True, name="placement-timeline")
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.period)

    def poll(self) -> Optional[dict]:
        """One sample (None when the gateway did not answer)."""
        try:
            doc = self.show()
        except Exception:
            self.errors += 1
            return None
        return self.add(doc, self.now())

    def add(self, doc: dict, now: float) -> dict:
        """Record ``doc`` (a ``placement show`` document) as seen at ``now`` (the load tool's clock)."""
        t = now - self.t_run
        for r in (doc.get("eplb") or {}).get("runs") or []:
            self.runs.setdefault(float(r[0]), (float(r[1]), r[2], r[3]))
        reb = doc.get("rebalancer") or {}
        counts = reb.get("moves") or {}
        seen = int(counts.get("done", 0)) + int(counts.get("abandoned", 0))
        prev_t = self.samples[-1]["t"] if self.samples else t - self.period
        if seen > self._seen:
            hist = list(reb.get("history") or [])
            for mv in hist[-(seen - self._seen):]:
                self.moves.append(self._placed(mv, prev_t, t))
        self._seen = max(self._seen, seen)
        bal = {L: v.get("balancedness") for L, v in (doc.get("layers") or {}).items()}
        vals = [b for b in bal.values() if b is not None]
        mv = reb.get("move") or {}
        s = {"t": round(t, 4), "version": doc.get("version"), "balancedness": bal,
             "min_balancedness": min(vals) if vals else None, "physical": doc.get("physical"),
             "redundant": doc.get("redundant"), "move": mv.get("state") if mv.get("state") in ACTIVE else None,
             "moves_done": int(counts.get("done", 0)), "moves_abandoned": int(counts.get("abandoned", 0)),
             "shares": [round(float(w.get("share", 0.0)), 4) for w in doc.get("workers") or []]}
        self.samples.append(s)
        return s

    def _placed(self, mv: dict, prev_t: float, t: float) -> dict:
        """A move first seen over at ``t`` (the sample before: ``prev_t``) on the run's time axis."""
        secs = float(mv.get("seconds") or 0.0)
        out = {"state": mv.get("state"), "reason": mv.get("reason"), "adds": len(mv.get("adds") or []),
               "removes": len(mv.get("removes") or []), "version": mv.get("version"), "seconds": secs,
               "error": mv.get("error") or ""}
        if mv.get("reason") == "eplb":
            lo, hi = prev_t - secs - 0.1, t
            runs = [g for g, (_, b, a) in self.runs.items() if g not in self._claimed
                    and b is not None and a is not None and a >= b + MIN_GAIN
                    and lo <= g - self.offset - self.t_run <= hi]
            if runs:
                g = max(runs)
                self._claimed.add(g)
                start = g - self.offset - self.t_run
                return {**out, "t_start": round(start, 4), "t_end": round(start + self.runs[g][0] + secs, 4),
                        "exact": True}
        return {**out, "t_start": round(max(0.0, prev_t - secs), 4), "t_end": round(t, 4), "exact": False}

    def stop(self) -> dict:
        """Stop polling; the timeline as the JSON keeps it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.poll()  # the end state
        runs = [{"t": round(g - self.offset - self.t_run, 4), "seconds": s, "before": b, "after": a}
                for g, (s, b, a) in sorted(self.runs.items())]
        return {"samples": self.samples, "moves": self.moves, "eplb_runs": runs, "poll_s": self.period,
                "poll_errors": self.errors}


# -- what the timeline says (pure) --------------------------------------------------------------------
def windows(moves: Sequence[dict], pad: float = 0.0) -> list[tuple[float, float]]:
    """Each move's [start, end] on the run's time axis, widened by ``pad`` each side."""
    return [(m["t_start"] - pad, m["t_end"] + pad) for m in moves]


def _overlaps(a: float, b: float, spans: Sequence[tuple[float, float]]) -> bool:
    return any(a <= hi and lo <= b for lo, hi in spans)


def _p(xs: list, q: float) -> Optional[float]:
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def tpot_during_moves(requests: Sequence[tuple], spans: Sequence[tuple[float, float]]) -> dict:
    """``requests``: (decode start, decode end, TPOT seconds, ramp step) per request, on the
    run's time axis. TPOT of the requests whose decode overlapped a move against the steady
    ones: those that did not, in the same ramp steps (a move at a low rate is held against
    that rate's TPOT, not the top step's); p50 and p99 in ms, counts, and the p99 ratio."""
    during = [(x, st) for a, b, x, st in requests if _overlaps(a, b, spans)]
    steps = {st for _, st in during}
    steady = [x for a, b, x, st in requests if st in steps and not _overlaps(a, b, spans)]
    during = [x for x, _ in during]

    def part(xs: list) -> dict:
        p99, p50 = _p(xs, 99), _p(xs, 50)
        return {"n": len(xs), "p99_ms": None if p99 is None else p99 * 1e3,
                "p50_ms": None if p50 is None else p50 * 1e3, "p99_reliable": reliable(99.0, len(xs))}

    d, s = part(during), part(steady)
    return {"during_moves": d, "steady": s, "steps": sorted(steps),
            "ratio": d["p99_ms"] / s["p99_ms"] if d["p99_ms"] and s["p99_ms"] else None}


def drift_recovery(samples: Sequence[dict], period: float, interval: float, *, t_from: float, t_to: float,
                   threshold: float = 0.9) -> dict:
    """Under drifting routing (one rank shift every ``period`` s from the run's start): per
    shift in [t_from, t_to - 2 intervals], the lowest balancedness (over layers) of the first
    sample at or after two EPLB ``interval``s past it, and whether it is >= ``threshold``;
    also the lowest balancedness seen in between (how deep the shift cut)."""
    shifts = []
    k = max(1, int(np.ceil(t_from / period)))
    while k * period <= t_to - 2 * interval:
        ts = k * period
        k += 1
        at = next((s for s in samples if s["t"] >= ts + 2 * interval and s.get("min_balancedness") is not None), None)
        between = [s["min_balancedness"] for s in samples
                   if ts < s["t"] < ts + 2 * interval and s.get("min_balancedness") is not None]
        if at is None:
            continue
        b = at["min_balancedness"]
        shifts.append({"t": round(ts, 3), "balancedness_after_2_intervals": b, "sampled_at": at["t"],
                       "lowest_between": min(between) if between else None, "back": b >= threshold})
    return {"threshold": threshold, "interval_s": interval, "period_s": period, "shifts": shifts,
            "back": sum(s["back"] for s in shifts), "all_back": bool(shifts) and all(s["back"] for s in shifts)}


def requests_of(done: Sequence[Any], t_run: float, keep: Optional[Callable[[Any], bool]] = None) -> list[tuple]:
    """(decode start, decode end, TPOT, ramp step) of every finished request with decode
    steps, on the run's time axis (``done``: bench.load's Done records; warm-up is step -1)."""
    return [(d.first - t_run, d.end - t_run, float(np.mean(d.steps)), d.job.arrival.step)
            for d in done if d.error is None and d.steps and (keep is None or keep(d))]
