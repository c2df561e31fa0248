"""`moe-bench load`: an open-loop load generator for the MoE layer, ours beside the peers.

    moe-bench load --mode fixed-rate --rate 5 --duration 10 --backend shm      # starts a gateway
    moe-bench load --mode ramp --rate 40 --ramp-steps 5 --gateway tcp://host:7000
    moe-bench load --mode mixed --burstiness 3 --scenario zipf --json out.json --plot out.png
    moe-bench load --mode ramp --full --systems moe-transport,multiprocessing,ray,reference

The request model: a request is a prefill of P tokens (one forward pass of P rows through
the MoE layer) then D decode steps of one token each (D more passes, one after the other),
so TTFT, TPOT (the mean decode step) and end-to-end are measured on the real layer.
Arrivals follow a schedule of ABSOLUTE deadlines (bench.schedule) at the target rate; a
dispatcher releases each request at its time to a pool of C client threads. TTFT and
end-to-end count from the SCHEDULED arrival, so waiting for a free client thread
(queueing) is in them, not hidden (no coordinated omission); ``queue_ms`` is that wait
alone and ``prefill_ms`` the prefill pass alone.

Modes: fixed-rate (constant or --arrival poisson gaps), mixed (gamma gaps whose coefficient
of variation is --burstiness, and request lengths drawn per request: prefill in [P/4, P],
decode in [1, D]), ramp (--ramp-steps rates from --ramp-start to --rate, --step-duration each;
stops at the first over-saturated step, where the queueing delay grows or p99 TPOT exceeds
--slo-tpot-ms, and reports the knee: the highest rate within the SLO).

Routing scenarios (bench.scenarios): tokens come from a bank steered through the real
router, so a run's expert popularity is uniform, Zipf(s), one hot expert, or a Zipf whose
ranking drifts over time. Afterwards the recorded passes are routed again (no routing while
the clock runs) for per-expert load, dropped tokens, and the two models (bench.models):
all-to-all communication volume, checked against the transport's byte counters, and the
hit rate of an LRU expert cache for every number of resident experts.

Systems (bench.systems), one after the other with the same schedule, tokens, weights and
router: moe-transport (a gateway started here, per --backend, or --gateway), the in-process
reference, multiprocessing pipes, one Ray actor per expert. The report gives ours as ratios
to each: tokens/s and p99 TPOT at the same load, and (ramp) tokens/s at each one's knee.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from bench import schedule as S

DEMO = dict(d_model=256, d_ff=512, prefill=64, decode=8)
FULL = dict(d_model=1024, d_ff=2048, prefill=256, decode=32)
PCTS = (("p50", 50.0), ("p95", 95.0), ("p99", 99.0), ("p999", 99.9))
# peers go after ours, the reference last: its two BLAS threads spin after their work
ORDER = {"moe-transport": 0, "multiprocessing": 1, "ray": 2, "reference": 3}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="fixed-rate", choices=["fixed-rate", "ramp", "mixed"])
    p.add_argument("--rate", type=float, default=5.0, help="target requests/s (ramp: the last step's)")
    p.add_argument("--arrival", default=None, choices=["constant", "poisson", "gamma"],
                   help="gap distribution (default: constant; mixed: gamma)")
    p.add_argument("--burstiness", type=float, default=2.0, help="gamma gaps' coefficient of variation (mixed)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of measured load (ramp: all steps)")
    p.add_argument("--max-requests", type=int, default=0, help="stop after N measured requests (0: no cap)")
    p.add_argument("--concurrency", type=int, default=4, help="client threads (the concurrency limit)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of unrecorded load first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ramp-start", type=float, default=None, help="first step's rate (default rate/steps)")
    p.add_argument("--ramp-steps", type=int, default=5)
    p.add_argument("--step-duration", type=float, default=None, help="default duration/steps")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput counts requests within both SLOs")
    p.add_argument("--timeout", type=float, default=30.0, help="per forward, seconds")
    tgt = p.add_argument_group("systems")
    tgt.add_argument("--systems", default="moe-transport",
                     help="comma-separated: moe-transport, reference, multiprocessing, ray, or all")
    tgt.add_argument("--gateway", metavar="URL", help="moe-transport: a running moe-gateway")
    tgt.add_argument("--backend", action="append", choices=["shm", "tcp", "rdma"],
                     help="moe-transport without --gateway: start one with local workers on this "
                          "backend (repeatable; default shm)")
    tgt.add_argument("--workers", type=int, default=2, help="worker processes (moe-transport, multiprocessing)")
    tgt.add_argument("--n-experts", type=int, default=8)
    tgt.add_argument("--top-k", type=int, default=2)
    tgt.add_argument("--capacity-factor", type=float, default=None)
    tgt.add_argument("--d-model", type=int, default=None, help=f"default {DEMO['d_model']} (--full {FULL['d_model']})")
    tgt.add_argument("--d-ff", type=int, default=None, help=f"default {DEMO['d_ff']} (--full {FULL['d_ff']})")
    tgt.add_argument("--max-wait-ms", type=float, default=1.0, help="the started gateway's batching wait")
    tgt.add_argument("--max-inflight-rounds", type=int, default=2, help="the started gateway's rounds out at once")
    tgt.add_argument("--max-batch-tokens", type=int, default=None,
                     help="the started gateway's tokens per round (default: every client's prefill at once)")
    tgt.add_argument("--full", action="store_true", help="d_model 1024, d_ff 2048, prefill 256, decode 32")
    req = p.add_argument_group("requests")
    req.add_argument("--prefill", type=int, default=None, help=f"prompt tokens (default {DEMO['prefill']})")
    req.add_argument("--decode", type=int, default=None, help=f"decode steps (default {DEMO['decode']})")
    sc = p.add_argument_group("routing scenario")
    from bench.scenarios import SCENARIOS
    sc.add_argument("--scenario", default="uniform", choices=SCENARIOS)
    sc.add_argument("--zipf-s", type=float, default=1.2)
    sc.add_argument("--hot-expert", type=int, default=0)
    sc.add_argument("--hot-share", type=float, default=0.5, help="hot: share of first choices")
    sc.add_argument("--drift-period", type=float, default=5.0, help="drift: seconds per rank rotation")
    sc.add_argument("--bank", type=int, default=256, help="steered tokens per expert")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH")
    out.add_argument("--markdown", metavar="PATH", help="write the summary here too")
    out.add_argument("--plot", metavar="PATH", help="PNG: latency vs throughput (ramp) or CDFs, expert load "
                                                     "over time, LRU cache hit rate")
    out.add_argument("--progress", default="auto", choices=["auto", "rich", "plain", "none"])


# -- percentiles -----------------------------------------------------------------------
class Histogram:
    """Latencies in seconds, percentiles in ms: an HDR histogram (1 us .. 1 h, 3 significant
    digits) when the hdrhistogram package imports, else exact numpy percentiles."""

    LOW_US, HIGH_US, DIGITS = 1, 3_600_000_000, 3

    def __init__(self, use_hdr: Optional[bool] = None) -> None:
        self._h = None
        if use_hdr is not False:
            try:
                from hdrh.histogram import HdrHistogram
                self._h = HdrHistogram(self.LOW_US, self.HIGH_US, self.DIGITS)
            except Exception:
                if use_hdr:
                    raise
        self._values: list[float] = []

    @property
    def kind(self) -> str:
        return "hdr" if self._h is not None else "numpy"

    def record(self, seconds: float) -> None:
        self._values.append(seconds)
        if self._h is not None:
            us = int(round(seconds * 1e6))
            self._h.record_value(min(max(us, self.LOW_US), self.HIGH_US))

    def __len__(self) -> int:
        return len(self._values)

    def percentile_ms(self, p: float) -> float:
        if not self._values:
            return float("nan")
        if self._h is not None:
            return self._h.get_value_at_percentile(p) / 1e3
        return float(np.percentile(np.asarray(self._values) * 1e3, p))

    def summary(self) -> dict:
        d: dict[str, Any] = {k: self.percentile_ms(p) for k, p in PCTS}
        if self._values:
            a = np.asarray(self._values) * 1e3
            d.update(mean=float(a.mean()), max=float(a.max()), n=len(a))
        else:
            d.update(mean=float("nan"), max=float("nan"), n=0)
        return d


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
        c.forward(bank.rows(idx[:P]))
        d.first = t = now()
        for j in range(P, P + D):
            d.passes.append((t, idx[j:j + 1]))
            c.forward(bank.rows(idx[j:j + 1]))
            t2 = now()
            d.steps.append(t2 - t)
            t = t2
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
                   system: str = "moe-transport", slo_ttft_ms: float = float("inf")) -> dict:
    """One segment's record (the JSON ``results`` entry): rates, tokens/s, percentiles of
    TTFT/TPOT/e2e/queueing, goodput (requests meeting both SLOs), the saturation verdict."""
    ok = [d for d in done if d.error is None and d.job.record]
    recorded = [d for d in done if d.job.record]
    hist = {k: Histogram(use_hdr) for k in ("ttft", "tpot", "e2e", "queue", "prefill")}
    for d in ok:
        hist["ttft"].record(d.first - d.sched)
        hist["e2e"].record(d.end - d.sched)
        hist["queue"].record(max(0.0, d.start - d.sched))
        hist["prefill"].record(d.first - d.start)
        if d.steps:
            hist["tpot"].record(float(np.mean(d.steps)))
    starts = sorted(d.start for d in recorded)
    if len(starts) >= 2 and starts[-1] > starts[0]:
        achieved = (len(starts) - 1) / (starts[-1] - starts[0])
    else:
        achieved = len(starts) / duration if duration else 0.0
    sch = sorted(d.sched for d in recorded)
    # the rate the realized schedule asked for (bursty or Poisson gaps over a short window
    # differ from the target by chance); achieved below it means the generator fell behind
    scheduled = (len(sch) - 1) / (sch[-1] - sch[0]) if len(sch) >= 2 and sch[-1] > sch[0] else achieved
    if ok:
        t_first = min(d.sched for d in ok)
        wall = max(d.end for d in ok) - t_first
    else:
        wall = 0.0
    tokens = sum(d.tokens for d in ok)
    good = [d for d in ok if 1e3 * (d.first - d.sched) <= slo_ttft_ms
            and (not d.steps or 1e3 * float(np.mean(d.steps)) <= slo_tpot_ms)]
    by_sched = sorted(recorded, key=lambda d: d.sched)
    growing = S.queue_growing([d.sched for d in by_sched], [d.start - d.sched for d in by_sched])
    tpot = hist["tpot"].summary()
    verdict = S.StepVerdict(target_rate, tpot["p99"] if tpot["n"] else 0.0, growing, slo_tpot_ms)
    rec = {"system": system, "backend": backend, "mode": mode, "target_rate": target_rate,
           "achieved_rate": achieved, "scheduled_rate": scheduled, "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
           "tokens_per_s": tokens / wall if wall > 0 else 0.0, "requests": len(recorded),
           "completed": len(ok), "errors": len(recorded) - len(ok), "tokens": tokens,
           "goodput_rps": len(good) / wall if wall > 0 else 0.0,
           "goodput_tokens_per_s": sum(d.tokens for d in good) / wall if wall > 0 else 0.0,
           "goodput_share": len(good) / len(ok) if ok else 0.0, "wall_s": wall,
           "duration_s": duration,
           "ttft_ms": hist["ttft"].summary(), "tpot_ms": tpot, "e2e_ms": hist["e2e"].summary(),
           "queue_ms": hist["queue"].summary(), "prefill_ms": hist["prefill"].summary(),
           "histogram": hist["ttft"].kind, "queue_growing": growing,
           "saturated": not verdict.ok, "verdict": verdict.why}
    if step is not None:
        rec["step"] = step
    errs = [d.error for d in recorded if d.error]
    if errs:
        rec["first_error"] = errs[0]
    return rec


# -- progress --------------------------------------------------------------------------
class Progress:
    def __init__(self, kind: str, total: int, label: str) -> None:
        if kind == "auto":
            kind = "rich" if sys.stdout.isatty() else "plain"
        self.kind, self.total, self.label = kind, max(1, total), label
        self._bar = None
        self._last = 0.0
        if kind == "rich":
            try:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress as RP, TextColumn, TimeElapsedColumn
                self._bar = RP(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TextColumn("{task.fields[info]}"), TimeElapsedColumn(), transient=True)
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
                print(f"  {self.label}: sent {sent}/{self.total} {info}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()



# -- the run ---------------------------------------------------------------------------
def _shm_entries() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _resolve(args) -> None:
    base = FULL if args.full else DEMO
    for k in ("d_model", "d_ff", "prefill", "decode"):
        if getattr(args, k) is None:
            setattr(args, k, base[k])
    if args.arrival is None:
        args.arrival = "gamma" if args.mode == "mixed" else "constant"
    from bench.systems import SYSTEMS
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    if names == ["all"]:
        names = list(SYSTEMS)
    bad = [n for n in names if n not in SYSTEMS]
    if bad:
        raise SystemExit(f"moe-bench load: unknown system {bad}; choose from {', '.join(SYSTEMS)} or all")
    backends = args.backend or ["shm"]
    if args.gateway:
        backends = [args.gateway.partition("://")[0]]
    args.plan = sorted([("moe-transport", b) for b in backends if "moe-transport" in names]
                       + [(n, None) for n in names if n != "moe-transport"], key=lambda nb: ORDER[nb[0]])


def _lengths(args, rng: np.random.Generator) -> tuple[int, int]:
    if args.mode != "mixed":
        return args.prefill, args.decode
    return (int(rng.integers(max(1, args.prefill // 4), args.prefill + 1)),
            int(rng.integers(1, args.decode + 1)) if args.decode > 0 else 0)


def make_system(name: str, backend: Optional[str], args, router):
    from bench import systems as SY
    seed = args.seed
    if name == "moe-transport":
        if args.gateway:
            return SY.MoeTransport(args.gateway, backend, timeout=args.timeout)
        return SY.MoeTransport.start(backend, workers=args.workers, n_experts=router.n_experts, top_k=router.top_k,
                                     d_model=router.d_model, d_ff=args.d_ff, seed=seed,
                                     max_batch_tokens=args.max_batch_tokens or max(256, args.concurrency * args.prefill),
                                     max_wait_ms=args.max_wait_ms, capacity_factor=args.capacity_factor,
                                     max_inflight_rounds=args.max_inflight_rounds)
    if name == "reference":
        return SY.Reference(router, args.d_ff, seed)
    if name == "multiprocessing":
        return SY.Multiprocessing(router, args.workers, args.d_ff, seed, max_rows=args.prefill * router.top_k)
    if name == "ray":
        return SY.RayActors(router, args.d_ff, seed)
    raise ValueError(name)


def run_segment(pool: ClientPool, args, clock, *, rate: float, duration: float, rng: np.random.Generator,
                record: bool, max_n: Optional[int], step: int, label: str, stop: threading.Event,
                bank, scenario, t_run: float) -> tuple[list[Done], list[float]]:
    first = len(pool.done)
    gaps = S.make_gaps(args.arrival, rate, rng, args.burstiness)
    sched = S.arrivals(gaps, t0=clock.now() + 0.005, duration=duration, max_n=max_n, step=step, rate=rate)
    pacer = S.Pacer(sched, clock, stop=stop.is_set)
    expect = int(rate * duration) if max_n is None else min(max_n, int(rate * duration) + 1)
    prog = Progress(args.progress, expect, label)
    sent = 0
    try:
        for a in pacer:
            P, D = _lengths(args, rng)
            idx = bank.draw(P + D, scenario.popularity(a.t - t_run), rng)
            pool.submit(Job(a, P, D, record, idx))
            sent += 1
            prog.update(sent, len(pool.done) - first, pool.busy, 1e3 * pacer.lateness[-1])
        pool.drain(timeout=args.timeout * (1 + args.decode) + 10)
    finally:
        prog.close()
    return pool.done[first:], pacer.lateness


def _counters(system) -> dict:
    """The system's counters, with this process's CPU (client threads, and the peers that
    run in-process) as "load-generator"."""
    from bench.systems import proc_cpu_seconds
    c = system.counters()
    c.setdefault("cpu_s", {})["load-generator"] = proc_cpu_seconds(os.getpid())
    return c


def _delta(before: dict, after: dict, wall: float) -> dict:
    """What a system's counters say about one segment: CPU cores per process, and for
    moe-transport the gateway's per-round stage times, drops and transport bytes."""
    out: dict = {"cpu_cores": {}}
    for proc, v in after.get("cpu_s", {}).items():
        b = before.get("cpu_s", {}).get(proc)
        if v is not None and b is not None and wall > 0:
            out["cpu_cores"][proc] = (v - b) / wall
    if "rounds" in after:
        rounds = after["rounds"] - before["rounds"]
        out["rounds"] = rounds
        out["stage_ms"] = {k: 1e3 * (after["stage_s"][k] - before["stage_s"].get(k, 0.0)) / rounds
                           for k in after["stage_s"]} if rounds else {}
        out["failed_rounds"] = after["failed_rounds"] - before["failed_rounds"]
        out["gateway_dropped"] = after["dropped"] - before["dropped"]
        out["gateway_overflow"] = after["overflow"] - before["overflow"]
        out["transport_bytes"] = after["transport_bytes"] - before["transport_bytes"]
        rows = {e: n - before["expert_rows"].get(e, 0) for e, n in after["expert_rows"].items()}
        out["gateway_expert_rows"] = [rows.get(e, 0) for e in range(max(rows, default=-1) + 1)]
    return out


def run_system(name: str, backend: Optional[str], args, router, bank, scenario) -> dict:
    """One system under the whole load (warm-up, then every step); its records and trace."""
    from bench import models as M
    clock = S.RealClock()
    rng = np.random.default_rng(args.seed)  # the same schedule and tokens for every system
    label = name if backend is None else f"{name}/{backend}"
    t = time.monotonic()
    system = make_system(name, backend, args, router)
    backend = system.backend
    extra = f" at {system.url}" if name == "moe-transport" else ""
    print(f"{label}: ready in {time.monotonic() - t:.1f} s{extra}", flush=True)
    out: dict = {"records": [], "done": [], "knee": None, "system": name, "backend": backend}
    stop = threading.Event()
    pool = None
    try:
        pool = ClientPool(system, args.concurrency, bank, clock, args.timeout)
        max_n = args.max_requests or None
        if args.mode == "ramp":
            n = max(1, args.ramp_steps)
            start = args.ramp_start if args.ramp_start is not None else args.rate / n
            steps = S.ramp_steps(start, args.rate, n, args.step_duration or args.duration / n)
        else:
            steps = [S.RampStep(args.rate, args.duration)]
        t_run = clock.now()
        try:
            if args.warmup > 0:
                run_segment(pool, args, clock, rate=steps[0].rate, duration=args.warmup, rng=rng, record=False,
                            max_n=None, step=-1, label=f"{label} warmup", stop=stop, bank=bank, scenario=scenario,
                            t_run=t_run)
            verdicts = []
            for j, st in enumerate(steps):
                left = None if max_n is None else max_n - sum(r["requests"] for r in out["records"])
                if left is not None and left <= 0:
                    break
                before = _counters(system)
                t0 = clock.now()
                step_label = f"{label} step {j + 1}/{len(steps)} @ {st.rate:g}/s" if args.mode == "ramp" else \
                    f"{label} {args.mode}"
                done, lateness = run_segment(pool, args, clock, rate=st.rate, duration=st.duration, rng=rng,
                                             record=True, max_n=left, step=j, label=step_label, stop=stop,
                                             bank=bank, scenario=scenario, t_run=t_run)
                wall = clock.now() - t0
                rec = segment_record(done, mode=args.mode, backend=backend, target_rate=st.rate, duration=st.duration,
                                     slo_tpot_ms=args.slo_tpot_ms, slo_ttft_ms=args.slo_ttft_ms, system=name,
                                     step=j if args.mode == "ramp" else None)
                rec["pacer_late_ms_p99"] = float(np.percentile(lateness, 99) * 1e3) if lateness else 0.0
                if args.mode == "mixed":
                    rec["burstiness"] = args.burstiness
                rec.update(_delta(before, _counters(system), wall))
                trace = M.replay(router, [(t - t_run, idx) for d in done if d.job.record and d.error is None
                                          for t, idx in d.passes], bank)
                load = M.expert_load(trace, router.n_experts)
                rec["expert_load"] = load["share"]
                rec["dropped"], rec["overflow"] = load["dropped"], load["overflow"]
                out["records"].append(rec)
                out["done"].append(done)
                verdicts.append(S.StepVerdict(st.rate, rec["tpot_ms"]["p99"] if rec["tpot_ms"]["n"] else 0.0,
                                              rec["queue_growing"], args.slo_tpot_ms))
                if args.mode == "ramp":
                    print(f"  {label} step {j + 1}: target {st.rate:g}/s achieved {rec['achieved_rate']:.2f}/s, "
                          f"{rec['tokens_per_s']:.0f} tokens/s, p99 TPOT {rec['tpot_ms']['p99']:.1f} ms, "
                          f"p99 queue {rec['queue_ms']['p99']:.1f} ms: {verdicts[-1].why}", flush=True)
                    if not verdicts[-1].ok:
                        break
            if args.mode == "ramp":
                out["knee"] = S.find_knee(verdicts)
        except KeyboardInterrupt:
            stop.set()
            print("interrupted; reporting what finished", flush=True)
            out["interrupted"] = True
    finally:
        if pool is not None:
            pool.close()
        if name == "moe-transport":
            out["placement"] = system.placement
        system.close()
        out["exit_code"] = getattr(system, "rc", 0)
    return out


def _ratios(runs: list[dict], mode: str) -> list[dict]:
    """Each moe-transport run against each peer: tokens/s and p99 TPOT at the same load
    (the last step both completed), and, for a ramp, tokens/s at each one's knee."""
    ours = [r for r in runs if r["system"] == "moe-transport"]
    peers = [r for r in runs if r["system"] != "moe-transport"]
    out = []
    for o in ours:
        for p in peers:
            row = {"ours": f"moe-transport/{o['backend']}", "peer": p["system"]}
            n = min(len(o["records"]), len(p["records"]))
            if n:
                a, b = o["records"][n - 1], p["records"][n - 1]
                row["at_rate"] = a["target_rate"]
                row["tokens_per_s"] = a["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else None
                if a["tpot_ms"]["n"] and b["tpot_ms"]["n"]:
                    row["p99_tpot_lower_by"] = b["tpot_ms"]["p99"] / a["tpot_ms"]["p99"]
                    row["p99_ttft_lower_by"] = b["ttft_ms"]["p99"] / a["ttft_ms"]["p99"]
            if mode == "ramp":
                ka, kb = _at_knee(o), _at_knee(p)
                row["knee_rate"] = [o["knee"], p["knee"]]
                if ka and kb and kb["tokens_per_s"]:
                    row["tokens_per_s_at_knee"] = ka["tokens_per_s"] / kb["tokens_per_s"]
                elif ka and not kb:
                    row["peer_saturated_at_every_step"] = True  # no ratio: the peer met the SLO nowhere
            out.append(row)
    return out


def _at_knee(run: dict) -> Optional[dict]:
    ok = [r for r in run["records"] if not r["saturated"]]
    return max(ok, key=lambda r: r["tokens_per_s"]) if ok else None


def _targets(ratios: list[dict], mode: str) -> list[dict]:
    """The issue's targets, evaluated where this run measured them (a benchmark, not a test)."""
    out = []
    if mode != "ramp":
        return out
    for r in ratios:
        if r["ours"] != "moe-transport/shm" or "tokens_per_s_at_knee" not in r:
            continue
        limit = {"ray": 5.0, "multiprocessing": 2.0}.get(r["peer"])
        if limit:
            v = r["tokens_per_s_at_knee"]
            out.append({"target": f"shm tokens/s at the knee / {r['peer']}", "value": v, "limit": limit,
                        "met": v >= limit})
    return out


def run(args: argparse.Namespace) -> int:
    from bench import load_report as R
    from bench import models as M
    from bench.scenarios import Scenario, TokenBank
    from gateway.router import Router
    _resolve(args)
    shm_before = _shm_entries()
    if args.gateway:  # the layer is what the running gateway serves
        from gateway.client import GatewayClient
        with GatewayClient(args.gateway, timeout=args.timeout) as c:
            cfg = c.ping(timeout=args.timeout).get("config", {})
        if "router" not in cfg:
            raise SystemExit("moe-bench load: that gateway does not describe its router (too old?)")
        router = Router.from_description(cfg["router"])
        args.d_model = router.d_model
    else:
        router = Router(args.d_model, args.n_experts, args.top_k, seed=args.seed,
                        capacity_factor=args.capacity_factor)
    scenario = Scenario(args.scenario, router.n_experts, zipf_s=args.zipf_s, hot_expert=args.hot_expert,
                        hot_share=args.hot_share, drift_period=args.drift_period)
    bank = TokenBank(router, per_expert=args.bank, seed=args.seed + 1)
    print(f"load: mode {args.mode}, {args.arrival} arrivals, rate {args.rate:g}/s, {args.concurrency} clients, "
          f"requests of {args.prefill} prefill + {args.decode} decode tokens, warmup {args.warmup:g} s; "
          f"{router.n_experts} experts top-{router.top_k}, d_model {router.d_model}; routing {scenario.describe()}; "
          f"systems {', '.join(n if b is None else f'{n}/{b}' for n, b in args.plan)}", flush=True)
    runs, rc = [], 0
    for name, backend in args.plan:
        try:
            runs.append(run_system(name, backend, args, router, bank, scenario))
        except Exception as e:  # a peer that cannot run here is reported, and the rest goes on
            print(f"{name}: could not run: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            rc = 1
            runs.append({"system": name, "backend": backend, "records": [], "done": [], "knee": None,
                         "error": f"{type(e).__name__}: {e}"})
        if runs[-1].get("interrupted"):
            break
    leaked = sorted(_shm_entries() - shm_before)
    for r in runs:
        if r.get("exit_code") not in (0, None):
            print(f"{r['system']}: gateway exit code {r['exit_code']}", file=sys.stderr)
            rc = 1
    print(f"/dev/shm left behind: {leaked or 'nothing'}", flush=True)
    if leaked:
        rc = 1
    measured = [r for r in runs if r["records"]]
    if not measured:
        print("no measured requests", file=sys.stderr)
        return 1
    if any(rec["completed"] == 0 for r in measured for rec in r["records"]):
        rc = 1
    # the models, from the first system's run (every system got the same passes)
    first = measured[0]
    t_run = min(d.sched for seg in first["done"] for d in seg) if first["done"] else 0.0
    trace = M.replay(router, sorted((t - t_run, idx) for seg in first["done"] for d in seg
                                    if d.error is None for t, idx in d.passes), bank)
    wall = sum(rec["wall_s"] for rec in first["records"])
    placement = first.get("placement")
    models = {"comm_volume": M.comm_volume(trace, router.d_model * 4, placement, wall),
              "lru_hit_rate": M.lru_hit_rates(trace, router.n_experts),
              "expert_load": M.expert_load(trace, router.n_experts)}
    moe = [r for r in measured if r["system"] == "moe-transport"]
    if moe and "transport_bytes" in moe[0]["records"][0]:
        got = sum(rec["transport_bytes"] for rec in moe[0]["records"])
        model = models["comm_volume"]["total_bytes"]
        models["comm_volume"]["transport_bytes_measured"] = got
        models["comm_volume"]["measured_over_model"] = got / model if model else None
    ratios = _ratios(measured, args.mode)
    targets = _targets(ratios, args.mode)
    md = R.markdown(runs, ratios, targets, models, scenario, args)
    print()
    print(md)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(md + "\n")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = {"mode": args.mode, "arrival": args.arrival, "rate": args.rate, "duration": args.duration,
                "concurrency": args.concurrency, "warmup": args.warmup, "seed": args.seed,
                "prefill": args.prefill, "decode": args.decode, "d_model": router.d_model, "d_ff": args.d_ff,
                "n_experts": router.n_experts, "top_k": router.top_k, "slo_tpot_ms": args.slo_tpot_ms,
                "slo_ttft_ms": args.slo_ttft_ms, "scenario": scenario.describe(), "gateway": args.gateway,
                "systems": [f"{n}/{b}" if b else n for n, b in args.plan]}
        doc = {"meta": meta, "results": [rec for r in measured for rec in r["records"]],
               "knees": {f"{r['system']}/{r['backend']}": r["knee"] for r in measured},
               "ratios": ratios, "targets": targets, "models": models,
               "failed_systems": {r["system"]: r["error"] for r in runs if r.get("error")}}
        if args.mode == "ramp" and moe:
            doc["knee_rate"] = moe[0]["knee"]
        with open(args.json, "w") as f:
            json.dump(_nan_to_none(doc), f, indent=1, default=float, allow_nan=False)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            R.plot(measured, models, args.plot, args.mode, args.slo_tpot_ms)
            print(f"wrote {args.plot}")
        except ImportError as e:
            print(f"no plot: {e}", file=sys.stderr)
    return rc


def _nan_to_none(x):
    """JSON has no NaN: an empty histogram's percentiles become null."""
    if isinstance(x, float):
        return x if np.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nan_to_none(v) for v in x]
    return x
