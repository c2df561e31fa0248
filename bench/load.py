"""`moe-bench load`: an open-loop load generator against a moe-gateway.

    moe-bench load --mode fixed-rate --rate 5 --duration 10 --backend shm      # starts a gateway
    moe-bench load --mode ramp --rate 40 --ramp-steps 5 --gateway tcp://host:7000
    moe-bench load --mode mixed --rate 10 --burstiness 3 --backend tcp --json out.json --plot out.png

The request model: a request is a prefill of P tokens (one GatewayClient.forward of P rows
through the MoE layer) then D decode steps of one token each (D more forwards, one row each,
one after the other). So TTFT, TPOT (the mean decode step) and end-to-end are measured on
the real layer. Arrivals follow a schedule of ABSOLUTE deadlines (bench.schedule) at the
target rate; a dispatcher releases each request at its time to a pool of C client threads
(one GatewayClient each). TTFT and end-to-end count from the SCHEDULED arrival, so waiting
for a free client thread (queueing) is in them, not hidden (no coordinated omission);
``queue_ms`` is that wait alone and ``prefill_ms`` the prefill pass alone.

Modes: fixed-rate (constant or --arrival poisson gaps), mixed (gamma gaps whose coefficient
of variation is --burstiness, and request lengths drawn per request: prefill in [P/4, P],
decode in [1, D]), ramp (--ramp-steps rates from --ramp-start to --rate, --step-duration each;
stops at the first over-saturated step, where the queueing delay grows or p99 TPOT exceeds
--slo-tpot-ms, and reports the knee: the highest rate within the SLO).
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="fixed-rate", choices=["fixed-rate", "ramp", "mixed"])
    p.add_argument("--rate", type=float, default=5.0, help="target requests/s (ramp: the last step's)")
    p.add_argument("--arrival", default=None, choices=["constant", "poisson", "gamma"],
                   help="gap distribution (default: constant; mixed: gamma)")
    p.add_argument("--burstiness", type=float, default=2.0, help="gamma gaps' coefficient of variation (mixed)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of measured load (ramp: all steps)")
    p.add_argument("--max-requests", type=int, default=0, help="stop after N measured requests (0: no cap)")
    p.add_argument("--concurrency", type=int, default=4, help="client threads, one GatewayClient each")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of unrecorded load first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ramp-start", type=float, default=None, help="first step's rate (default rate/steps)")
    p.add_argument("--ramp-steps", type=int, default=5)
    p.add_argument("--step-duration", type=float, default=None, help="default duration/steps")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--timeout", type=float, default=30.0, help="per forward, seconds")
    tgt = p.add_argument_group("target")
    tgt.add_argument("--gateway", metavar="URL", help="a running moe-gateway")
    tgt.add_argument("--backend", default="shm", choices=["shm", "tcp", "rdma"],
                     help="without --gateway: start one with local workers on this backend")
    tgt.add_argument("--workers", type=int, default=2)
    tgt.add_argument("--n-experts", type=int, default=8)
    tgt.add_argument("--top-k", type=int, default=2)
    tgt.add_argument("--d-model", type=int, default=None, help=f"default {DEMO['d_model']} (--full {FULL['d_model']})")
    tgt.add_argument("--d-ff", type=int, default=None, help=f"default {DEMO['d_ff']} (--full {FULL['d_ff']})")
    tgt.add_argument("--max-wait-ms", type=float, default=1.0, help="the started gateway's batching wait")
    tgt.add_argument("--full", action="store_true", help="d_model 1024, d_ff 2048, prefill 256, decode 32")
    req = p.add_argument_group("requests")
    req.add_argument("--prefill", type=int, default=None, help=f"prompt tokens (default {DEMO['prefill']})")
    req.add_argument("--decode", type=int, default=None, help=f"decode steps (default {DEMO['decode']})")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH")
    out.add_argument("--plot", metavar="PATH", help="PNG: latency CDFs, or latency vs throughput (ramp)")
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

    def values_ms(self) -> np.ndarray:
        return np.asarray(self._values) * 1e3


# -- one request -----------------------------------------------------------------------
@dataclass
class Job:
    arrival: S.Arrival
    prefill: int
    decode: int
    record: bool = True


@dataclass
class Done:
    job: Job
    start: float = 0.0
    first: float = 0.0     # end of the prefill pass
    end: float = 0.0
    steps: list = field(default_factory=list)  # decode step seconds
    error: Optional[str] = None

    @property
    def sched(self) -> float:
        return self.job.arrival.t

    @property
    def tokens(self) -> int:
        return self.job.prefill + len(self.steps) if self.error is None else 0


class ClientPool:
    """C threads, one GatewayClient each, taking jobs as the dispatcher releases them."""

    def __init__(self, url: str, n: int, d_model: int, max_prefill: int, clock, timeout: float, seed: int):
        self.url, self.clock, self.timeout = url, clock, timeout
        self.d_model = d_model
        self._cv = threading.Condition()
        self._jobs: list[Job] = []
        self._pending = 0
        self._closing = False
        self.done: list[Done] = []
        self.busy = 0
        rng = np.random.default_rng(seed)
        # token rows to feed: prefill takes the first P, decode step j the row (P + j) mod rows
        self.rows = rng.standard_normal((max(max_prefill, 1) + 64, d_model)).astype(np.float32)
        self._errors: list[str] = []
        from gateway.client import GatewayClient
        self._clients = [GatewayClient(url, timeout=timeout) for _ in range(n)]
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True, name=f"load-client-{i}")
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            self._jobs.append(job)
            self._pending += 1
            self._cv.notify()

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._jobs)

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
        from gateway.client import GatewayClient
        from workers.protocol import RemoteError
        import transport
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
            except (RemoteError, transport.Timeout) as e:
                d.error = f"{type(e).__name__}: {e}"
            except Exception as e:  # a broken connection: a fresh client for the next job
                d.error = f"{type(e).__name__}: {e}"
                try:
                    self._clients[i].close()
                except Exception:
                    pass
                try:
                    self._clients[i] = GatewayClient(self.url, timeout=self.timeout)
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
        P, D, rows = d.job.prefill, d.job.decode, self.rows
        now = self.clock.now
        d.start = now()
        c.forward(rows[:P])
        d.first = t = now()
        n = len(rows)
        for j in range(D):
            k = (P + j) % n
            c.forward(rows[k:k + 1])
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


# -- statistics of one segment ---------------------------------------------------------
def segment_record(done: list[Done], *, mode: str, backend: str, target_rate: float, duration: float,
                   slo_tpot_ms: float, step: Optional[int] = None, use_hdr: Optional[bool] = None) -> dict:
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
    by_sched = sorted(recorded, key=lambda d: d.sched)
    growing = S.queue_growing([d.sched for d in by_sched], [d.start - d.sched for d in by_sched])
    tpot = hist["tpot"].summary()
    verdict = S.StepVerdict(target_rate, tpot["p99"] if tpot["n"] else 0.0, growing, slo_tpot_ms)
    rec = {"system": "moe-transport", "backend": backend, "mode": mode, "target_rate": target_rate,
           "achieved_rate": achieved, "scheduled_rate": scheduled, "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
           "tokens_per_s": tokens / wall if wall > 0 else 0.0, "requests": len(recorded),
           "completed": len(ok), "errors": len(recorded) - len(ok), "tokens": tokens,
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


def start_gateway(args, max_prefill: int):
    from workers.cli import blas_env, spawn_service
    listen = {"shm": f"shm://moe-load-{os.getpid()}", "tcp": "tcp://127.0.0.1:0",
              "rdma": f"rdma://{os.environ.get('MOE_RDMA_IP', '127.0.0.1')}:0"}[args.backend]
    max_batch = max(256, args.concurrency * max_prefill)
    argv = [sys.executable, "-m", "gateway.cli", "--listen", listen, "--local-workers", str(args.workers),
            "--backend", args.backend, "--n-experts", str(args.n_experts), "--top-k", str(args.top_k),
            "--d-model", str(args.d_model), "--d-ff", str(args.d_ff), "--seed", str(args.seed),
            "--max-batch-tokens", str(max_batch), "--max-wait-ms", str(args.max_wait_ms)]
    return spawn_service(argv, timeout=60.0, env=blas_env(1))


def _lengths(args, rng: np.random.Generator) -> tuple[int, int]:
    if args.mode != "mixed":
        return args.prefill, args.decode
    return (int(rng.integers(max(1, args.prefill // 4), args.prefill + 1)),
            int(rng.integers(1, args.decode + 1)) if args.decode > 0 else 0)


def run_segment(pool: ClientPool, args, clock, *, rate: float, duration: float, kind: str,
                rng: np.random.Generator, record: bool, max_n: Optional[int], step: int, label: str,
                stop: threading.Event) -> tuple[list[Done], list[float]]:
    first = len(pool.done)
    gaps = S.make_gaps(kind, rate, rng, args.burstiness)
    sched = S.arrivals(gaps, t0=clock.now() + 0.005, duration=duration, max_n=max_n, step=step, rate=rate)
    pacer = S.Pacer(sched, clock, stop=stop.is_set)
    expect = int(rate * duration) if max_n is None else min(max_n, int(rate * duration) + 1)
    prog = Progress(args.progress, expect, label)
    sent = 0
    try:
        for a in pacer:
            P, D = _lengths(args, rng)
            pool.submit(Job(a, P, D, record))
            sent += 1
            prog.update(sent, len(pool.done) - first, pool.busy, 1e3 * pacer.lateness[-1])
        pool.drain(timeout=args.timeout * (1 + args.decode) + 10)
    finally:
        prog.close()
    return pool.done[first:], pacer.lateness


def _resolve(args) -> None:
    base = FULL if args.full else DEMO
    for k in ("d_model", "d_ff", "prefill", "decode"):
        if getattr(args, k) is None:
            setattr(args, k, base[k])
    if args.arrival is None:
        args.arrival = "gamma" if args.mode == "mixed" else "constant"


def run(args: argparse.Namespace) -> int:
    _resolve(args)
    clock = S.RealClock()
    rng = np.random.default_rng(args.seed)
    proc = None
    shm_before = _shm_entries()
    if args.gateway:
        url = args.gateway
        backend = url.partition("://")[0]
    else:
        t = time.monotonic()
        proc, url = start_gateway(args, args.prefill)
        backend = args.backend
        print(f"started moe-gateway at {url} ({args.workers} {backend} workers, d_model {args.d_model}, "
              f"d_ff {args.d_ff}) in {time.monotonic() - t:.1f} s", flush=True)
    records: list[dict] = []
    all_done: list[list[Done]] = []
    knee = None
    stop = threading.Event()
    pool = None
    rc = 0
    try:
        from gateway.client import GatewayClient
        with GatewayClient(url, timeout=args.timeout) as c:
            cfg = c.ping(timeout=args.timeout).get("config", {})
        d_model = int(cfg.get("d_model", args.d_model))
        if d_model != args.d_model and args.gateway:
            args.d_model = d_model
        pool = ClientPool(url, args.concurrency, d_model, args.prefill, clock, args.timeout, args.seed)
        print(f"load: mode {args.mode}, {args.arrival} arrivals, rate {args.rate:g}/s, {args.concurrency} clients, "
              f"requests of {args.prefill} prefill + {args.decode} decode tokens, warmup {args.warmup:g} s",
              flush=True)
        max_n = args.max_requests or None
        if args.mode == "ramp":
            n = max(1, args.ramp_steps)
            start = args.ramp_start if args.ramp_start is not None else args.rate / n
            step_d = args.step_duration or args.duration / n
            steps = S.ramp_steps(start, args.rate, n, step_d)
        else:
            steps = [S.RampStep(args.rate, args.duration)]
        try:
            if args.warmup > 0:
                run_segment(pool, args, clock, rate=steps[0].rate, duration=args.warmup, kind=args.arrival, rng=rng,
                            record=False, max_n=None, step=-1, label="warmup", stop=stop)
            verdicts = []
            for j, st in enumerate(steps):
                left = None if max_n is None else max_n - sum(r["requests"] for r in records)
                if left is not None and left <= 0:
                    break
                label = f"step {j + 1}/{len(steps)} @ {st.rate:g}/s" if args.mode == "ramp" else args.mode
                done, lateness = run_segment(pool, args, clock, rate=st.rate, duration=st.duration, kind=args.arrival,
                                             rng=rng, record=True, max_n=left, step=j, label=label, stop=stop)
                rec = segment_record(done, mode=args.mode, backend=backend, target_rate=st.rate,
                                     duration=st.duration, slo_tpot_ms=args.slo_tpot_ms,
                                     step=j if args.mode == "ramp" else None)
                rec["pacer_late_ms_p99"] = float(np.percentile(lateness, 99) * 1e3) if lateness else 0.0
                if args.mode == "mixed":
                    rec["burstiness"] = args.burstiness
                records.append(rec)
                all_done.append(done)
                verdicts.append(S.StepVerdict(st.rate, rec["tpot_ms"]["p99"] if rec["tpot_ms"]["n"] else 0.0,
                                              rec["queue_growing"], args.slo_tpot_ms))
                if args.mode == "ramp":
                    print(f"  step {j + 1}: target {st.rate:g}/s achieved {rec['achieved_rate']:.2f}/s, "
                          f"p99 TPOT {rec['tpot_ms']['p99']:.1f} ms, p99 queue {rec['queue_ms']['p99']:.1f} ms: "
                          f"{verdicts[-1].why}", flush=True)
                    if not verdicts[-1].ok:
                        break
            if args.mode == "ramp":
                knee = S.find_knee(verdicts)
        except KeyboardInterrupt:
            stop.set()
            print("interrupted; reporting what finished", flush=True)
    finally:
        if pool is not None:
            pool.close()
        if proc is not None:
            from workers.cli import stop_process
            prc = stop_process(proc, timeout=15.0)
            leaked = sorted(_shm_entries() - shm_before)
            print(f"stopped moe-gateway: exit code {prc}; /dev/shm left behind: {leaked or 'nothing'}", flush=True)
            if prc != 0 or leaked:
                rc = 1
    if not records:
        print("no measured requests", file=sys.stderr)
        return 1
    print()
    print(markdown(records, knee if args.mode == "ramp" else None, args))
    if any(r["completed"] == 0 for r in records):
        rc = 1
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = {"mode": args.mode, "arrival": args.arrival, "rate": args.rate, "duration": args.duration,
                "concurrency": args.concurrency, "warmup": args.warmup, "seed": args.seed,
                "prefill": args.prefill, "decode": args.decode, "d_model": args.d_model, "d_ff": args.d_ff,
                "slo_tpot_ms": args.slo_tpot_ms, "gateway": url, "backend": backend,
                "started_gateway": proc is not None, "workers": args.workers if proc is not None else None}
        out = {"meta": meta, "results": records}
        if args.mode == "ramp":
            out["knee_rate"] = knee
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            plot(records, all_done, args.plot, args.mode, args.slo_tpot_ms)
            print(f"wrote {args.plot}")
        except ImportError as e:
            print(f"no plot: {e}", file=sys.stderr)
    return rc


# -- output ----------------------------------------------------------------------------
def markdown(records: list[dict], knee: Optional[float], args) -> str:
    def q(d: dict) -> str:
        return " / ".join(f"{d[k]:.1f}" for k, _ in PCTS)
    lines = [f"### moe-bench load: {records[0]['mode']} ({records[0]['backend']}, {args.concurrency} clients, "
             f"{args.prefill}+{args.decode} tokens/request)", "",
             "| step | target req/s | scheduled req/s | achieved req/s | req/s done | tokens/s | TTFT ms p50/p95/p99/p99.9 "
             "| TPOT ms p50/p95/p99/p99.9 | e2e ms p50/p95/p99/p99.9 | queue p99 ms | n | err | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(records):
        lines.append(f"| {r.get('step', i) + 1 if 'step' in r else i + 1} | {r['target_rate']:.2f} | "
                     f"{r['scheduled_rate']:.2f} | {r['achieved_rate']:.2f} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{q(r['ttft_ms'])} | {q(r['tpot_ms'])} | {q(r['e2e_ms'])} | {r['queue_ms']['p99']:.1f} | "
                     f"{r['completed']} | {r['errors']} | {r['verdict']} |")
    if knee is not None or records[0]["mode"] == "ramp":
        lines += ["", f"knee (highest rate within SLO p99 TPOT <= {args.slo_tpot_ms:g} ms, no queue growth): "
                      + (f"{knee:g} req/s" if knee is not None else "none (the first step is already saturated)")]
    return "\n".join(lines)


def plot(records: list[dict], all_done: list[list[Done]], path: str, mode: str, slo_tpot_ms: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    if mode == "ramp":
        ax = axes[0]
        tps = [r["tokens_per_s"] for r in records]
        for key, style in (("tpot_ms", "o-"), ("ttft_ms", "s--")):
            for pk in ("p50", "p99"):
                ax.plot(tps, [r[key][pk] for r in records], style, label=f"{key[:-3].upper()} {pk}")
        ax.axhline(slo_tpot_ms, color="r", lw=0.8, ls=":", label="TPOT SLO")
        ax.set_xlabel("tokens/s")
        ax.set_ylabel("latency ms")
        ax.set_yscale("log")
        ax.set_title("latency vs throughput")
        ax.legend(fontsize=7)
        ax = axes[1]
        ax.plot([r["target_rate"] for r in records], [r["achieved_rate"] for r in records], "o-", label="achieved")
        lim = max(r["target_rate"] for r in records)
        ax.plot([0, lim], [0, lim], "k:", lw=0.8, label="target")
        ax.set_xlabel("target req/s")
        ax.set_ylabel("achieved req/s")
        ax.legend(fontsize=7)
    else:
        done = [d for seg in all_done for d in seg if d.error is None]
        series = {"TTFT": [1e3 * (d.first - d.sched) for d in done],
                  "TPOT": [1e3 * float(np.mean(d.steps)) for d in done if d.steps],
                  "e2e": [1e3 * (d.end - d.sched) for d in done]}
        ax = axes[0]
        for name, v in series.items():
            if v:
                v = np.sort(v)
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=name)
        ax.set_xscale("log")
        ax.set_xlabel("latency ms")
        ax.set_ylabel("CDF")
        ax.set_title("latency CDF")
        ax.legend(fontsize=7)
        ax = axes[1]
        t0 = min((d.sched for d in done), default=0.0)
        ax.plot([d.sched - t0 for d in done], [1e3 * max(0.0, d.start - d.sched) for d in done], ".", ms=3)
        ax.set_xlabel("scheduled time s")
        ax.set_ylabel("queueing delay ms")
        ax.set_title("queueing delay")
    fig.suptitle(f"moe-bench load ({mode}, {records[0]['backend']})")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
