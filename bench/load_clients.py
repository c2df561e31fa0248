"""The client side of a `moe-bench load` run: one request (:class:`Job`, :class:`Done`), the
pool of client threads that sends them at their scheduled times, one segment of load
(:func:`run_segment`) and its statistics (:func:`segment_record`), and progress on stderr."""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from bench import schedule as S
from bench.output import note
from bench.stats import Histogram


# -- one request -----------------------------------------------------------------------
@dataclass
class Job:
    arrival: S.Arrival
    prefill: int
    decode: int
    record: bool = True
    idx: Optional[np.ndarray] = None  # token-bank rows: prefill's P, then one per decode step


@dataclass
class Done:
    job: Job
    start: float = 0.0
    first: float = 0.0     # end of the prefill pass
    end: float = 0.0
    steps: list = field(default_factory=list)  # decode step seconds
    passes: list = field(default_factory=list)  # (start time, bank rows) of every forward pass
    error: Optional[str] = None

    @property
    def sched(self) -> float:
        return self.job.arrival.t

    @property
    def tokens(self) -> int:
        return self.job.prefill + len(self.steps) if self.error is None else 0


class ClientPool:
    """C threads, one client of the system under load each, taking jobs as the dispatcher
    releases them. A job's tokens are rows of the token bank (the routing scenario)."""

    def __init__(self, system, n: int, bank, clock, timeout: float) -> None:
        self.system, self.clock, self.timeout, self.bank = system, clock, timeout, bank
        self._cv = threading.Condition()
        self._jobs: list[Job] = []
        self._pending = 0
        self._closing = False
        self.done: list[Done] = []
        self.busy = 0
        self.on_answer = None  # (bank rows, output, client): bench/load_hooks.py's answer check
        self._clients = [system.client() for _ in range(n)]
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True, name=f"load-client-{i}")
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            self._jobs.append(job)
            self._pending += 1
            self._cv.notify()

    def drain(self, timeout: float) -> bool:
        """Wait until every submitted job has finished."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
        return True

    def _loop(self, i: int) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closing:
                    self._cv.wait()
                if not self._jobs:
                    return
                job = self._jobs.pop(0)
                self.busy += 1
            d = Done(job)
            try:
                self._run(self._clients[i], d)
            except Exception as e:  # the request failed; a broken client is replaced
                d.error = f"{type(e).__name__}: {e}"
                if not _request_level(e):
                    try:
                        self._clients[i].close()
                    except Exception:
                        pass
                    try:
                        self._clients[i] = self.system.client()
                    except Exception:
                        pass
            if not d.end:
                d.end = self.clock.now()
            with self._cv:
                self.done.append(d)
                self.busy -= 1
                self._pending -= 1
                self._cv.notify_all()

    def _run(self, c, d: Done) -> None:
        P, D, idx, bank = d.job.prefill, d.job.decode, d.job.idx, self.bank
        now = self.clock.now
        d.start = now()
        d.passes.append((d.start, idx[:P]))
        y = c.forward(bank.rows(idx[:P]))
        d.first = t = now()
        if self.on_answer is not None:  # kept for checking; its own time is no decode step's
            self.on_answer(idx[:P], y, c)
            t = now()
        for j in range(P, P + D):
            d.passes.append((t, idx[j:j + 1]))
            y = c.forward(bank.rows(idx[j:j + 1]))
            t2 = now()
            d.steps.append(t2 - t)
            t = t2
            if self.on_answer is not None:
                self.on_answer(idx[j:j + 1], y, c)
                t = now()
        d.end = t

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=self.timeout + 5)
        for c in self._clients:
            try:
                c.close()
            except Exception:
                pass


def _request_level(e: Exception) -> bool:
    """An error that is the request's (a refusal, a timeout), not the client connection's."""
    from workers.protocol import RemoteError
    import transport
    return isinstance(e, (RemoteError, transport.Timeout, TimeoutError))


# -- statistics of one segment ---------------------------------------------------------
def segment_record(done: list[Done], *, mode: str, backend: str, target_rate: float, duration: float,
                   slo_tpot_ms: float, step: Optional[int] = None, use_hdr: Optional[bool] = None,
                   system: str = "moe-transport", slo_ttft_ms: float = float("inf"),
                   t_start: Optional[float] = None) -> dict:
    """One segment's record (the JSON ``results`` entry), vLLM's accounting: successful
    and failed requests, totals, and every rate over ONE duration, so goodput (requests
    within both SLOs, a subset of the completed ones) never exceeds the request throughput;
    percentiles of TTFT/TPOT/ITL/E2EL/queueing (each with its sample count and which
    percentiles it supports); the saturation verdict.

    ``duration`` is the length of the schedule that offered the load (the step's, or less
    when --max-requests cut it short), starting at ``t_start`` (default: the first
    scheduled arrival); the benchmark duration (``duration_s``) runs from ``t_start`` to
    the later of the schedule's end and the end of the last request, as vLLM's runs from
    the first send (its arrivals span n/rate) to the last reply."""
    recorded = [d for d in done if d.job.record]
    ok = [d for d in recorded if d.error is None]
    hist = {k: Histogram(use_hdr) for k in ("ttft", "tpot", "itl", "e2e", "queue", "prefill")}
    for d in ok:
        hist["ttft"].record(d.first - d.sched)
        hist["e2e"].record(d.end - d.sched)
        hist["queue"].record(max(0.0, d.start - d.sched))
        hist["prefill"].record(d.first - d.start)
        if d.steps:
            hist["tpot"].record(float(np.mean(d.steps)))
            for s in d.steps:
                hist["itl"].record(s)
    if recorded:
        t_begin = min(d.sched for d in recorded) if t_start is None else t_start
        t_end = max(t_begin + duration, max(max(d.end, d.sched) for d in recorded))
        bench_s = t_end - t_begin
    else:
        bench_s = 0.0

    def per_s(x: float) -> float:
        return x / bench_s if bench_s > 0 else 0.0

    starts = sorted(d.start for d in recorded if d.start)
    # the rate at which requests got a client thread; below the schedule's when the clients
    # (the concurrency limit) or the generator fell behind
    start_rate = (len(starts) - 1) / (starts[-1] - starts[0]) if len(starts) >= 2 and starts[-1] > starts[0] else 0.0
    sch = sorted(d.sched for d in recorded)
    # the rate the realized schedule asked for (bursty or Poisson gaps over a short window
    # differ from the target by chance)
    scheduled = (len(sch) - 1) / (sch[-1] - sch[0]) if len(sch) >= 2 and sch[-1] > sch[0] else 0.0
    good = [d for d in ok if 1e3 * (d.first - d.sched) <= slo_ttft_ms
            and (not d.steps or 1e3 * float(np.mean(d.steps)) <= slo_tpot_ms)]
    input_tokens = sum(d.job.prefill for d in ok)
    decode_tokens = sum(len(d.steps) for d in ok)
    generated = sum(1 + len(d.steps) for d in ok)  # the prefill's first token, then one per decode step
    layer_tokens = input_tokens + decode_tokens  # rows through the MoE layer
    by_sched = sorted(recorded, key=lambda d: d.sched)
    growing = S.queue_growing([d.sched for d in by_sched], [max(0.0, d.start - d.sched) for d in by_sched])
    tpot = hist["tpot"].summary()
    verdict = S.StepVerdict(target_rate, tpot["p99"] if tpot["n"] else 0.0, growing, slo_tpot_ms,
                            failed=len(recorded) - len(ok), requests=len(recorded))
    rec = {"system": system, "backend": backend, "mode": mode, "target_rate": target_rate,
           "scheduled_rate": scheduled, "start_rate": start_rate,
           "requests": len(recorded), "completed": len(ok), "failed": len(recorded) - len(ok),
           "duration_s": bench_s, "schedule_s": duration,
           "total_input_tokens": input_tokens, "total_output_tokens": generated, "tokens": layer_tokens,
           "request_throughput": per_s(len(ok)), "request_goodput": per_s(len(good)),
           "output_throughput": per_s(generated), "total_token_throughput": per_s(input_tokens + generated),
           "tokens_per_s": per_s(layer_tokens), "goodput_tokens_per_s": per_s(sum(d.tokens for d in good)),
           "good": len(good), "goodput_share": len(good) / len(ok) if ok else 0.0,
           "ttft_ms": hist["ttft"].summary(), "tpot_ms": tpot, "itl_ms": hist["itl"].summary(),
           "e2e_ms": hist["e2e"].summary(), "queue_ms": hist["queue"].summary(),
           "prefill_ms": hist["prefill"].summary(), "histogram": hist["ttft"].kind,
           "queue_growing": growing, "saturated": not verdict.ok, "verdict": verdict.why}
    if step is not None:
        rec["step"] = step
    errs = [d.error for d in recorded if d.error]
    if errs:
        rec["first_error"] = errs[0]
    return rec


# -- progress (stderr) -----------------------------------------------------------------
class Progress:
    def __init__(self, kind: str, total: int, label: str) -> None:
        if kind == "auto":
            kind = "rich" if sys.stderr.isatty() else "plain"
        self.kind, self.total, self.label = kind, max(1, total), label
        self._bar = None
        self._last = 0.0
        if kind == "rich":
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress as RP, TextColumn, TimeElapsedColumn
                self._bar = RP(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TextColumn("{task.fields[info]}"), TimeElapsedColumn(), transient=True,
                               console=Console(stderr=True))
                self._bar.start()
                self._task = self._bar.add_task(label, total=self.total, info="")
            except Exception:
                self.kind = "plain"

    def update(self, sent: int, done: int, busy: int, lateness_ms: float) -> None:
        info = f"done {done} busy {busy} late {lateness_ms:.1f} ms"
        if self._bar is not None:
            self._bar.update(self._task, completed=min(sent, self.total), info=info)
        elif self.kind == "plain":
            now = time.monotonic()
            if now - self._last >= 1.0:
                self._last = now
                note(f"  {self.label}: sent {sent}/{self.total} {info}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def request_lengths(args, rng: np.random.Generator) -> tuple[int, int]:
    """(prefill, decode) tokens of the next request: fixed, or drawn in mixed mode."""
    if args.mode != "mixed":
        return args.prefill, args.decode
    return (int(rng.integers(max(1, args.prefill // 4), args.prefill + 1)),
            int(rng.integers(1, args.decode + 1)) if args.decode > 0 else 0)


def run_segment(pool: ClientPool, args, clock, *, rate: float, duration: float, rng: np.random.Generator,
                record: bool, max_n: Optional[int], step: int, label: str, stop: threading.Event,
                bank, scenario, t_run: float) -> tuple[list[Done], list[float]]:
    first = len(pool.done)
    gaps = S.make_gaps(args.arrival, rate, rng, args.burstiness if args.arrival == "gamma" else 1.0)
    t0 = clock.now() + 0.005
    sched = S.arrivals(gaps, t0=t0, duration=duration, max_n=max_n, step=step, rate=rate)
    pacer = S.Pacer(sched, clock, stop=stop.is_set)
    expect = int(rate * duration) if max_n is None else min(max_n, int(rate * duration) + 1)
    prog = Progress(args.progress, expect, label)
    sent, last = 0, None
    try:
        for a in pacer:
            P, D = request_lengths(args, rng)
            idx = bank.draw(P + D, scenario.popularity(a.t - t_run), rng)
            pool.submit(Job(a, P, D, record, idx))
            sent += 1
            last = a.t
            prog.update(sent, len(pool.done) - first, pool.busy, 1e3 * pacer.lateness[-1])
        pool.drain(timeout=args.timeout * (1 + args.decode) + 10)
    finally:
        prog.close()
    # the schedule's length: the whole step, unless --max-requests or a stop cut it short
    # (then up to one mean gap after its last arrival)
    if last is not None and ((max_n is not None and sent >= max_n) or stop.is_set()):
        duration = min(duration, last - t0 + 1.0 / rate)
    return pool.done[first:], pacer.lateness, t0, duration
