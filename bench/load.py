"""`moe-bench load`: an open-loop load generator for the MoE layer, ours beside the peers.

    moe-bench load --mode fixed-rate --rate 5 --duration 10 --backend shm      # starts a gateway
    moe-bench load --mode ramp --rate 40 --ramp-steps 5 --gateway tcp://host:7000
    moe-bench load --mode mixed --burstiness 0.25 --scenario zipf --json out.json --plot out.png
    moe-bench load --mode ramp --full --systems moe-transport,multiprocessing,ray,reference

The request model: a request is a prefill of P tokens (one forward pass of P rows through
the MoE layer) then D decode steps of one token each (D more passes, one after the other),
so TTFT, TPOT (the mean decode step), ITL (every decode step) and end-to-end are measured
on the real layer; as in vLLM's accounting the prefill yields the first generated token
and each decode step one more (D + 1 generated tokens), and the layer itself carries
P + D rows per request. Arrivals follow a schedule of ABSOLUTE deadlines (bench.schedule)
at the target rate; a dispatcher releases each request at its time to a pool of C client
threads. TTFT and end-to-end count from the SCHEDULED arrival, so waiting for a free
client thread (queueing) is in them, not hidden (no coordinated omission); ``queue_ms`` is
that wait alone and ``prefill_ms`` the prefill pass alone.

Every rate of a segment (request throughput, goodput, token throughputs) is computed over
ONE duration, vLLM's "benchmark duration": from the segment's first scheduled arrival to
the end of its last request. Goodput counts the requests within both SLOs, a subset of
the completed ones, so it can never exceed the request throughput.

Modes: fixed-rate (constant or --arrival poisson gaps), mixed (gamma gaps, bursty by
default, and request lengths drawn per request: prefill in [P/4, P], decode in [1, D]),
ramp (--ramp-steps rates from --ramp-start to --rate, --step-duration each; stops at the
first over-saturated step, where the queueing delay grows, p99 TPOT exceeds --slo-tpot-ms
or requests fail, and reports the knee: the highest rate within the SLO; a ramp that never
saturated says "knee not reached (>= X req/s)"). Gamma arrivals take vLLM's --burstiness
(the gamma shape: 1 is Poisson, lower is burstier) or, equivalently, --arrival-cv (the
gaps' coefficient of variation, 1/sqrt(burstiness)).

Routing scenarios (bench.scenarios): tokens come from a bank steered through the real
router, so a run's expert popularity is uniform, Zipf(s), one hot expert, or a Zipf whose
ranking drifts over time. Afterwards the recorded passes are routed again (no routing while
the clock runs) for per-expert load, dropped tokens, and the two models (bench.models):
all-to-all communication volume, checked against the transport's byte counters, and the
hit rate of an LRU expert cache for every number of resident experts.

Systems (bench.systems), one after the other with the same schedule, tokens, weights and
router: moe-transport (a gateway started here, per --backend, or a running one given by
--gateway, whose configuration is asked first and used), the in-process reference,
multiprocessing pipes, one Ray actor per expert. The report gives ours as ratios to each:
tokens/s and p99 TPOT at the same load, and (ramp) tokens/s at each one's knee.

The report (markdown, with vLLM-style result blocks) goes to stdout; progress and notes to
stderr; the JSON carries the provenance (version, commit, command line, host, date).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from bench import load_hooks, schedule as S
from bench.output import nan_to_none, note, write_plot
from bench.stats import Histogram
from gateway.chunking import chunk_rows_flag

DEMO = dict(d_model=256, d_ff=512, prefill=64, decode=8)
FULL = dict(d_model=1024, d_ff=2048, prefill=256, decode=32)
LAYER_DEFAULTS = dict(n_experts=8, top_k=2, dtype="float32")
STARTED_DEFAULTS = dict(local_workers=2, max_wait_ms=1.0, max_inflight_rounds=2)
# the started gateway's routing and policies (moe-gateway's defaults)
GATEWAY_DEFAULTS = dict(replicas=1, overflow="drop", noisy=False, noise_std=1.0, batching="fifo",
                        balancing="load-aware", chunk_rows="auto")
# --sweep KEY: the layer's shape; --compare KEY: a gateway policy (aliases -> the flag's dest)
SWEEP_KEYS = {"n_experts": int, "top_k": int, "d_model": int}
COMPARE_KEYS = {"batching": str, "balancing": str, "max_inflight_rounds": int, "chunk_rows": str, "placement": str}
KEY_ALIASES = {"experts": "n_experts", "k": "top_k", "inflight": "max_inflight_rounds",
               "pipelining": "max_inflight_rounds", "rounds_in_flight": "max_inflight_rounds",
               "chunks": "chunk_rows"}
MIXED_BURSTINESS = 0.25  # mixed mode's default gamma shape: gaps with a CV of 2
# peers go after ours, the reference last: its two BLAS threads spin after their work
ORDER = {"moe-transport": 0, "multiprocessing": 1, "ray": 2, "reference": 3}


class ConfigError(Exception):
    """The flags contradict each other or the running gateway: refused before any load."""


from bench import load_cli  # noqa: E402
add_arguments, validate = load_cli.add_arguments, load_cli.validate  # the subcommand's interface


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


# -- the run ---------------------------------------------------------------------------
def _shm_entries() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _resolve(args) -> None:
    """Defaults, the arrival process, and the plan of systems; ConfigError on flags that
    contradict each other."""
    if getattr(args, "resolved", False):  # bench.cli validated these flags already
        return
    from bench.load_cli import seconds_to_ms
    from bench import placement_bench
    placement_bench.apply_preset(args)
    seconds_to_ms(args)
    base = FULL if args.full else DEMO
    args.explicit = {k for k in ("d_model", "d_ff", "n_experts", "top_k", "dtype", "capacity_factor",
                                 "local_workers", "max_wait_ms", "max_inflight_rounds", "max_batch_tokens", "backend",
                                 *GATEWAY_DEFAULTS, "gate_bias")
                     if getattr(args, k, None) is not None}
    args.points = _points(args)
    if args.mode is None:
        args.mode = "ramp" if args.points else "fixed-rate"
    if args.points:
        if args.mode != "ramp":
            raise ConfigError(f"--sweep/--compare ramp every point to its knee; they contradict --mode {args.mode}")
        if args.gateway:
            raise ConfigError("--sweep/--compare start a gateway per point; they cannot change a running --gateway")
        if args.systems.strip() != "moe-transport":
            raise ConfigError("--sweep/--compare measure moe-transport's gateways (one per point); drop --systems")
        if len(args.backend or ["shm"]) != 1:
            raise ConfigError("--sweep/--compare run on one --backend")
    for k, v in GATEWAY_DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    for k in ("prefill", "decode"):
        if getattr(args, k) is None:
            setattr(args, k, base[k])
    if not args.gateway:
        for k in ("d_model", "d_ff"):
            if getattr(args, k) is None:
                setattr(args, k, base[k])
        for k, v in LAYER_DEFAULTS.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
    for k, v in STARTED_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    # arrivals: --burstiness is vLLM's gamma shape; --arrival-cv the same process by its CV
    shape = args.burstiness if args.burstiness is not None else \
        (S.burstiness_for_cv(args.arrival_cv) if args.arrival_cv is not None else None)
    if args.arrival is None:
        args.arrival = "gamma" if args.mode == "mixed" or shape is not None else "constant"
    elif args.arrival != "gamma" and shape is not None:
        raise ConfigError(f"--burstiness/--arrival-cv shape gamma arrivals; they contradict --arrival {args.arrival}")
    if args.arrival == "gamma":
        args.burstiness = shape if shape is not None else (MIXED_BURSTINESS if args.mode == "mixed" else 1.0)
        args.arrival_cv = S.cv_of_burstiness(args.burstiness)
    elif args.arrival == "poisson":
        args.burstiness, args.arrival_cv = 1.0, 1.0
    else:
        args.burstiness, args.arrival_cv = None, 0.0
    from bench.systems import SYSTEMS
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    if names == ["all"]:
        names = list(SYSTEMS)
    bad = [n for n in names if n not in SYSTEMS]
    if bad:
        raise ConfigError(f"unknown system {bad}; choose from {', '.join(SYSTEMS)} or all")
    backends = args.backend or ["shm"]
    if args.gateway:
        scheme = args.gateway.partition("://")[0]
        if args.backend and args.backend != [scheme]:
            raise ConfigError(f"--backend {','.join(args.backend)} contradicts --gateway {args.gateway} "
                              f"(a running gateway is reached over {scheme})")
        backends = [scheme]
    args.plan = sorted([("moe-transport", b) for b in backends if "moe-transport" in names]
                       + [(n, None) for n in names if n != "moe-transport"], key=lambda nb: ORDER[nb[0]])
    placement_bench.resolve(args)  # and bench.elastic's flags
    args.resolved = True


def _points(args) -> list[dict]:
    """--sweep/--compare as a list of points: {"axis", "value", "label"}; a --compare axis's
    first value is its baseline."""
    out: list[dict] = []
    specs = ([("sweep", args.sweep)] if getattr(args, "sweep", None) else []) + \
        [("compare", c) for c in (getattr(args, "compare", None) or [])]
    if args.sweep and getattr(args, "compare", None):
        raise ConfigError("--sweep and --compare are separate experiments: give one of them")
    for kind, spec in specs:
        key, eq, values = spec.partition("=")
        key = key.strip().replace("-", "_")
        key = KEY_ALIASES.get(key, key)
        table = SWEEP_KEYS if kind == "sweep" else COMPARE_KEYS
        if not eq or key not in table:
            raise ConfigError(f"--{kind} {spec!r}: expected KEY=V1,V2,... with KEY one of {', '.join(table)}")
        try:
            vals = [table[key](v.strip()) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"--{kind} {spec!r}: {key} takes {table[key].__name__} values") from None
        if len(vals) < 2 or len(set(vals)) != len(vals):
            raise ConfigError(f"--{kind} {spec!r}: give two or more different values")
        if key in ("batching", "balancing", "placement"):
            allowed = {"batching": ("fifo", "expert-aware"), "balancing": ("load-aware", "least-loaded"),
                       "placement": ("static", "replicas", "eplb")}[key]
            bad = [v for v in vals if v not in allowed]
            if bad:
                raise ConfigError(f"--compare {key}: unknown {bad}; choose from {', '.join(allowed)}")
        if key == "chunk_rows":
            try:
                vals = [chunk_rows_flag(v) for v in vals]
            except argparse.ArgumentTypeError as e:
                raise ConfigError(f"--compare {key}: {e}") from None
            if len(set(vals)) != len(vals):
                raise ConfigError(f"--compare {spec!r}: give two or more different values")
        if any(isinstance(v, int) and v < 1 for v in vals):
            raise ConfigError(f"--{kind} {spec!r}: values must be >= 1")
        if kind == "compare" and any(p["axis"] == key for p in out):
            raise ConfigError(f"--compare {key} given twice")
        out += [{"kind": kind, "axis": key, "value": v, "label": f"{key}={v}", "baseline": i == 0}
                for i, v in enumerate(vals)]
    return out


def describe_gateway(url: str, timeout: float) -> dict:
    """What a running gateway serves, from its pong: ``config`` (d_model, dtype, experts,
    top-k, router, batching) and its workers (each with the d_ff its hello said)."""
    from gateway.client import GatewayClient
    try:
        with GatewayClient(url, timeout=timeout, connect_timeout=min(timeout, 10.0)) as c:
            pong = c.ping(timeout=timeout)
    except Exception as e:
        raise ConfigError(f"cannot reach the gateway at {url}: {type(e).__name__}: {e}") from None
    cfg = dict(pong.get("config") or {})
    if "router" not in cfg:
        raise ConfigError(f"the gateway at {url} does not describe its router (too old?)")
    workers = [{"url": w.get("url"), "experts": w.get("experts"), "healthy": w.get("healthy"),
                "d_ff": w.get("d_ff")} for w in pong.get("workers", [])]
    d_ffs = sorted({w["d_ff"] for w in workers if w.get("d_ff") is not None})
    cfg["workers"] = workers
    cfg["d_ff"] = d_ffs[0] if len(d_ffs) == 1 else None
    cfg["d_ff_source"] = ("the gateway's workers" if len(d_ffs) == 1 else
                          f"workers disagree: {d_ffs}" if d_ffs else "unknown: no worker reported it")
    return cfg


def adopt_gateway(args, cfg: dict) -> None:
    """Take the layer's configuration from the running gateway; ConfigError when a flag the
    user gave contradicts it (nothing is sent before that)."""
    router = cfg["router"]
    have = {"d_model": cfg.get("d_model", router.get("d_model")), "dtype": cfg.get("dtype", router.get("dtype")),
            "n_experts": cfg.get("n_experts", router.get("n_experts")), "top_k": cfg.get("top_k", router.get("top_k")),
            "capacity_factor": router.get("capacity_factor"), "d_ff": cfg.get("d_ff"),
            "max_wait_ms": cfg.get("max_wait_ms"), "max_inflight_rounds": cfg.get("max_inflight_rounds"),
            "max_batch_tokens": cfg.get("max_batch_tokens"), "local_workers": len(cfg.get("workers", [])) or None,
            "noisy": router.get("noisy"), "noise_std": router.get("noise_std") if router.get("noisy") else None,
            "overflow": router.get("overflow"), "batching": cfg.get("batching"), "balancing": cfg.get("balancing"),
            "chunk_rows": None if cfg.get("chunk_rows") is None else chunk_rows_flag(str(cfg["chunk_rows"])),
            "replicas": cfg.get("replicas"),
            "gate_bias": None if router.get("bias") is None else ",".join(f"{b:g}" for b in router["bias"])}
    if "gate_bias" in args.explicit and args.gate_bias is not None:  # compare numbers, not spellings
        args.gate_bias = ",".join(f"{float(b):g}" for b in args.gate_bias.split(",") if b.strip())
    clash = []
    for k in sorted(args.explicit):
        if k == "backend" or (have.get(k) is None and k not in ("capacity_factor", "gate_bias")):
            continue  # (d_ff unknown: cannot be checked; recorded as the user's, unverified)
        mine, theirs = getattr(args, k), have.get(k)
        if mine is None or theirs is None or isinstance(mine, str) or isinstance(theirs, str):
            differ = mine != theirs
        else:
            differ = float(mine) != float(theirs)
        if differ:
            clash.append(f"--{k.replace('_', '-')} {mine} (the gateway has {theirs})")
    if clash:
        raise ConfigError(f"the gateway at {args.gateway} serves another configuration than the flags say: "
                          f"{'; '.join(clash)}. Drop those flags to use the gateway's, or point at a matching gateway.")
    for k in ("d_model", "dtype", "n_experts", "top_k", "capacity_factor"):
        setattr(args, k, have[k])
    for k in ("noisy", "noise_std", "overflow", "batching", "balancing", "replicas", "gate_bias"):
        if have[k] is not None or k == "gate_bias":
            setattr(args, k, have[k])
    if have["d_ff"] is not None:
        args.d_ff = have["d_ff"]
    args.d_ff_source = cfg["d_ff_source"] if have["d_ff"] is not None else (
        "--d-ff (not verified: " + cfg["d_ff_source"] + ")" if args.d_ff is not None else cfg["d_ff_source"])


def _lengths(args, rng: np.random.Generator) -> tuple[int, int]:
    if args.mode != "mixed":
        return args.prefill, args.decode
    return (int(rng.integers(max(1, args.prefill // 4), args.prefill + 1)),
            int(rng.integers(1, args.decode + 1)) if args.decode > 0 else 0)


def started_router(args):
    """The router a gateway started with these flags builds (gateway/config.py's make_router):
    the load generator steers tokens with it and the peers route with it."""
    from gateway.config import make_router
    try:
        return _make_router(make_router, args)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _make_router(make_router, args):
    return make_router(argparse.Namespace(d_model=args.d_model, n_experts=args.n_experts, top_k=args.top_k,
                                          noisy=bool(args.noisy), noise_std=args.noise_std,
                                          capacity_factor=args.capacity_factor, overflow=args.overflow,
                                          seed=args.seed, gate_bias=args.gate_bias))


def gateway_flags(args) -> list[str]:
    """The started gateway's routing and policy flags (the rest is MoeTransport.start's)."""
    out = ["--replicas", str(args.replicas), "--overflow", args.overflow, "--batching", args.batching,
           "--balancing", args.balancing, "--chunk-rows", str(args.chunk_rows)]
    if args.noisy:
        out += ["--noisy", "--noise-std", repr(float(args.noise_std))]
    if args.gate_bias:
        out.append(f"--gate-bias={args.gate_bias}")  # "=": values may start with "-"
    from bench.placement_bench import gateway_flags as placement_flags
    return out + placement_flags(args)


def make_system(name: str, backend: Optional[str], args, router):
    from bench import systems as SY
    seed = args.seed
    if name == "moe-transport":
        if args.gateway:
            return SY.MoeTransport(args.gateway, backend, timeout=args.timeout)
        return SY.MoeTransport.start(backend, workers=args.local_workers, n_experts=router.n_experts,
                                     top_k=router.top_k, d_model=router.d_model, d_ff=args.d_ff, seed=seed,
                                     max_batch_tokens=args.max_batch_tokens or max(256, args.concurrency * args.prefill),
                                     max_wait_ms=args.max_wait_ms, capacity_factor=args.capacity_factor,
                                     max_inflight_rounds=args.max_inflight_rounds, dtype=args.dtype,
                                     extra=gateway_flags(args))
    if args.dtype != "float32":
        raise RuntimeError(f"the {name} peer computes in float32 only (this run's dtype is {args.dtype})")
    if args.d_ff is None:
        raise RuntimeError(f"the {name} peer needs d_ff, which the gateway's workers did not report: pass --d-ff")
    if name == "reference":
        return SY.Reference(router, args.d_ff, seed)
    if name == "multiprocessing":
        return SY.Multiprocessing(router, args.local_workers, args.d_ff, seed, max_rows=args.prefill * router.top_k)
    if name == "ray":
        return SY.RayActors(router, args.d_ff, seed)
    raise ValueError(name)


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
            P, D = _lengths(args, rng)
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
    if "rounds" in after and "rounds" in before:
        rounds = after["rounds"] - before["rounds"]
        out["rounds"] = rounds
        out["stage_ms"] = {k: 1e3 * (after["stage_s"][k] - before["stage_s"].get(k, 0.0)) / rounds
                           for k in after["stage_s"]} if rounds else {}
        out["failed_requests"] = after["failed_requests"] - before["failed_requests"]
        if "requests" in after and "requests" in before:  # forward passes the gateway took
            out["passes_per_round"] = (after["requests"] - before["requests"]) / rounds if rounds else None
        if rounds and after.get("messages") is not None and before.get("messages") is not None:
            out["messages_per_round"] = (after["messages"] - before["messages"]) / rounds
        if after.get("chunk_costs") is not None:  # auto's choice at the segment's end
            out["chunk_costs"] = after["chunk_costs"]
        out["gateway_dropped"] = after.get("dropped", 0) - before.get("dropped", 0)
        out["gateway_overflow"] = after.get("overflow", 0) - before.get("overflow", 0)
        out["transport_bytes"] = after["transport_bytes"] - before["transport_bytes"]
        out["gateway_errors"] = {k: n - before.get("errors", {}).get(k, 0) for k, n in after.get("errors", {}).items()
                                 if n - before.get("errors", {}).get(k, 0)}
        rows = {e: n - before["expert_rows"].get(e, 0) for e, n in after["expert_rows"].items()}
        out["gateway_expert_rows"] = [rows.get(e, 0) for e in range(max(rows, default=-1) + 1)]
    return out


def _safe_counters(system) -> dict:
    try:
        return _counters(system)
    except Exception as e:  # a gateway that went away: the segment is still reported
        note(f"  counters unavailable: {type(e).__name__}: {e}")
        return {}


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
    note(f"{label}: ready in {time.monotonic() - t:.1f} s{extra}")
    out: dict = {"records": [], "done": [], "knee": None, "system": name, "backend": backend}
    if name == "moe-transport":
        out["gateway_config"] = {k: v for k, v in system.config.items()}
        out["gateway_started"] = system.proc is not None
    stop = threading.Event()
    pool = None
    hooks: list = []
    try:
        pool = ClientPool(system, args.concurrency, bank, clock, args.timeout)
        max_n = args.max_requests or None
        if args.mode == "ramp":
            n = max(1, args.ramp_steps)
            start = args.ramp_start if args.ramp_start is not None else args.rate / n
            steps = S.ramp_steps(start, args.rate, n, args.step_duration or args.duration / n)
        else:
            steps = [S.RampStep(args.rate, args.duration)]
        out["planned_rates"] = [st.rate for st in steps]
        t_run = clock.now()
        hooks = load_hooks.start(args, name, system, pool, clock, t_run, bank, router)
        verdicts: list = []
        try:
            if args.warmup > 0:
                run_segment(pool, args, clock, rate=steps[0].rate, duration=args.warmup, rng=rng, record=False,
                            max_n=None, step=-1, label=f"{label} warmup", stop=stop, bank=bank, scenario=scenario,
                            t_run=t_run)
            for j, st in enumerate(steps):
                left = None if max_n is None else max_n - sum(r["requests"] for r in out["records"])
                if left is not None and left <= 0:
                    break
                before = _safe_counters(system)
                t0 = clock.now()
                step_label = f"{label} step {j + 1}/{len(steps)} @ {st.rate:g}/s" if args.mode == "ramp" else \
                    f"{label} {args.mode}"
                done, lateness, t_sched, window = run_segment(
                    pool, args, clock, rate=st.rate, duration=st.duration, rng=rng, record=True, max_n=left, step=j,
                    label=step_label, stop=stop, bank=bank, scenario=scenario, t_run=t_run)
                wall = clock.now() - t0
                rec = segment_record(done, mode=args.mode, backend=backend, target_rate=st.rate, duration=window,
                                     slo_tpot_ms=args.slo_tpot_ms, slo_ttft_ms=args.slo_ttft_ms, system=name,
                                     step=j if args.mode == "ramp" else None, t_start=t_sched)
                rec["step_duration_s"] = st.duration
                rec["pacer_late_ms_p99"] = float(np.percentile(lateness, 99) * 1e3) if lateness else 0.0
                rec["arrival"] = args.arrival
                if args.arrival == "gamma":
                    rec["burstiness"], rec["arrival_cv"] = args.burstiness, args.arrival_cv
                rec.update(_delta(before, _safe_counters(system), wall))
                trace = M.replay(router, [(t - t_run, idx) for d in done if d.job.record and d.error is None
                                          for t, idx in d.passes], bank)
                load = M.expert_load(trace, router.n_experts)
                rec["expert_load"] = load["share"]
                if "gateway_expert_rows" in rec:
                    rec["gateway_expert_share"] = M.gateway_routing([rec], router.n_experts)["share"]
                rec["dropped"], rec["overflow"] = load["dropped"], load["overflow"]
                out["records"].append(rec)
                out["done"].append(done)
                verdicts.append(S.StepVerdict(st.rate, rec["tpot_ms"]["p99"] if rec["tpot_ms"]["n"] else 0.0,
                                              rec["queue_growing"], args.slo_tpot_ms, failed=rec["failed"],
                                              requests=rec["requests"]))
                if rec["failed"]:
                    note(f"  {label}: {rec['failed']} of {rec['requests']} requests failed; first: {rec['first_error']}")
                if args.mode == "ramp":
                    note(f"  {label} step {j + 1}: target {st.rate:g}/s, throughput {rec['request_throughput']:.2f} "
                         f"req/s, {rec['tokens_per_s']:.0f} tokens/s, p99 TPOT {rec['tpot_ms']['p99']:.1f} ms, "
                         f"p99 queue {rec['queue_ms']['p99']:.1f} ms: {verdicts[-1].why}")
                    if not verdicts[-1].ok:
                        break
            if args.mode == "ramp":
                out["knee"] = S.knee_of(verdicts)
        except KeyboardInterrupt:
            stop.set()
            note("interrupted; reporting what finished")
            out["interrupted"] = True
            if args.mode == "ramp":
                out["knee"] = S.knee_of(verdicts)
    finally:
        if pool is not None:
            pool.close()
        load_hooks.finish(hooks, out)
        if name == "moe-transport":
            out["placement"] = system.placement
        system.close()
        out["exit_code"] = getattr(system, "rc", 0)
    return out


def _ratios(runs: list[dict], mode: str) -> list[dict]:
    """Each moe-transport run against each peer: tokens/s and p99 TPOT at the same load
    (the last step both completed), and, for a ramp, tokens/s at each one's knee (a knee
    not reached makes that side's figure a lower bound, and the ratio says so)."""
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
                if a["ttft_ms"]["n"] and b["ttft_ms"]["n"]:
                    row["p99_ttft_lower_by"] = b["ttft_ms"]["p99"] / a["ttft_ms"]["p99"]
            if mode == "ramp":
                ko, kp = o.get("knee") or {}, p.get("knee") or {}
                row["knee"] = [ko.get("text"), kp.get("text")]
                row["knee_rate"] = [ko.get("rate"), kp.get("rate")]
                ka, kb = _at_knee(o), _at_knee(p)
                if ka and kb and kb["tokens_per_s"]:
                    v = ka["tokens_per_s"] / kb["tokens_per_s"]
                    if ko.get("reached") and kp.get("reached"):
                        row["tokens_per_s_at_knee"] = v
                    elif not ko.get("reached") and kp.get("reached"):
                        row["tokens_per_s_at_knee_at_least"] = v  # ours did not saturate: a lower bound
                    elif ko.get("reached") and not kp.get("reached"):
                        row["tokens_per_s_at_knee_at_most"] = v
                    else:
                        row["tokens_per_s_top_steps"] = v  # neither saturated: top steps only
                elif ka and not kb:
                    row["peer_saturated_at_every_step"] = True  # no ratio: the peer met the SLO nowhere
            out.append(row)
    return out


def _at_knee(run: dict) -> Optional[dict]:
    ok = [r for r in run["records"] if not r["saturated"]]
    return max(ok, key=lambda r: r["tokens_per_s"]) if ok else None


def _targets(ratios: list[dict], mode: str) -> list[dict]:
    """The load targets, evaluated where this run measured them (a benchmark, not a test)."""
    out = []
    if mode != "ramp":
        return out
    for r in ratios:
        if r["ours"] != "moe-transport/shm":
            continue
        limit = {"ray": 5.0, "multiprocessing": 2.0}.get(r["peer"])
        if not limit:
            continue
        for key, how in (("tokens_per_s_at_knee", ""), ("tokens_per_s_at_knee_at_least", " (ours: knee not reached, "
                                                                                          "a lower bound)")):
            if key in r:
                v = r[key]
                out.append({"target": f"shm tokens/s at the knee / {r['peer']}{how}", "value": v, "limit": limit,
                            "met": v >= limit})
    return out


def _meta(args, router, scenario, gw_cfg: Optional[dict], runs: list[dict]) -> dict:
    started = next((r.get("gateway_config") for r in runs if r.get("gateway_started")), None)
    return {"mode": args.mode, "arrival": args.arrival, "burstiness": args.burstiness, "arrival_cv": args.arrival_cv,
            "rate": args.rate, "duration": args.duration, "concurrency": args.concurrency, "warmup": args.warmup,
            "seed": args.seed, "prefill": args.prefill, "decode": args.decode,
            "ramp": {"start": args.ramp_start, "steps": args.ramp_steps, "step_duration": args.step_duration}
            if args.mode == "ramp" else None,
            "layer": {"d_model": router.d_model, "d_ff": args.d_ff, "d_ff_source": args.d_ff_source,
                      "dtype": args.dtype, "n_experts": router.n_experts, "top_k": router.top_k,
                      "capacity_factor": router.capacity_factor, "router": router.describe()},
            "d_model": router.d_model, "d_ff": args.d_ff, "dtype": args.dtype, "n_experts": router.n_experts,
            "top_k": router.top_k, "slo_tpot_ms": args.slo_tpot_ms, "slo_ttft_ms": args.slo_ttft_ms,
            "scenario": scenario.describe(), "gateway": args.gateway,
            "gateway_config": gw_cfg if gw_cfg is not None else started,
            "local_workers": None if args.gateway else args.local_workers,
            "gateway_policies": {k: getattr(args, k, None) for k in (*GATEWAY_DEFAULTS, "gate_bias",
                                                                     "max_inflight_rounds", "max_wait_ms")},
            "systems": [f"{n}/{b}" if b else n for n, b in args.plan]}


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ConfigError as e:
        note(f"moe-bench load: {e}")
        return 2


def _run(args: argparse.Namespace) -> int:
    from bench import load_report as R
    from bench.provenance import emit_report, provenance, write_json_atomic
    prov = provenance()
    _resolve(args)
    from bench.load_cli import plan
    note(plan(args))
    if args.points:
        from bench.experiments import run_points
        return run_points(args, prov)
    res = measure(args)
    runs, measured, models, meta = res["runs"], res["measured"], res["models"], res["meta"]
    md = R.markdown(runs, res["ratios"], res["targets"], models, res["scenario"], args, prov, meta)
    md += load_hooks.report(runs)
    emit_report(md, args.markdown)
    if args.json:
        moe = [r for r in measured if r["system"] == "moe-transport"]
        doc = {"provenance": prov, "meta": meta, "results": [rec for r in measured for rec in r["records"]],
               "knees": {f"{r['system']}/{r['backend']}": r["knee"] for r in measured},
               "ratios": res["ratios"], "targets": res["targets"], "models": models,
               "failed_systems": {r["system"]: r["error"] for r in runs if r.get("error")},
               "interrupted": any(r.get("interrupted") for r in runs), "shm_left_behind": res["leaked"]}
        if args.mode == "ramp" and moe:
            doc["knee"] = moe[0]["knee"]
            doc["knee_rate"] = (moe[0]["knee"] or {}).get("rate")  # null unless a knee was reached
        write_json_atomic(args.json, nan_to_none(doc))
        note(f"wrote {args.json}")
    if args.plot:
        write_plot(lambda: R.plot(measured, models, args.plot, args.mode, args.slo_tpot_ms), args.plot,
                   bool(measured))
        load_hooks.plots(runs, args.plot)
    return max(res["rc"], load_hooks.rc(runs))


def measure(args: argparse.Namespace) -> dict:
    """Run every system of ``args.plan`` (resolved) under the load; their runs, the routing
    models, ratios and the run's meta, and the exit code so far."""
    from bench import load_report as R
    from bench import models as M
    from bench.scenarios import Scenario, TokenBank
    from gateway.router import Router
    shm_before = _shm_entries()
    gw_cfg = None
    if args.gateway:  # the layer is what the running gateway serves: ask it first
        gw_cfg = describe_gateway(args.gateway, args.timeout)
        adopt_gateway(args, gw_cfg)
        router = Router.from_description(gw_cfg["router"])
        note(f"gateway {args.gateway}: d_model {args.d_model}, d_ff {args.d_ff} ({args.d_ff_source}), {args.dtype}, "
             f"{router.n_experts} experts top-{router.top_k}, {len(gw_cfg.get('workers', []))} workers")
        mbt = gw_cfg.get("max_batch_tokens")
        if mbt and args.prefill > mbt:
            note(f"note: prefills of up to {args.prefill} tokens exceed the gateway's max_batch_tokens {mbt}: "
                 f"it refuses such requests (they are reported as failed)")
    else:
        args.d_ff_source = "--d-ff, given to the gateway started here" if "d_ff" in args.explicit else \
            "the default given to the gateway started here"
        router = started_router(args)
    scenario = Scenario(args.scenario, router.n_experts, zipf_s=args.zipf_s, hot_expert=args.hot_expert,
                        hot_share=args.hot_share, drift_period=args.drift_period)
    bank = TokenBank(router, per_expert=args.bank, seed=args.seed + 1, dtype=np.dtype(args.dtype))
    note(f"load: mode {args.mode}, {R.arrival_text(args)}, rate {args.rate:g}/s, {args.concurrency} clients, "
         f"requests of {args.prefill} prefill + {args.decode} decode tokens, warmup {args.warmup:g} s; "
         f"{router.n_experts} experts top-{router.top_k}, d_model {router.d_model}, {args.dtype}; routing "
         f"{scenario.describe()}; systems {', '.join(n if b is None else f'{n}/{b}' for n, b in args.plan)}")
    runs, rc = [], 0
    for name, backend in args.plan:
        try:
            runs.append(run_system(name, backend, args, router, bank, scenario))
        except Exception as e:  # a system that cannot run here is reported, and the rest goes on
            note(f"{name}: could not run: {type(e).__name__}: {e}")
            rc = 1
            runs.append({"system": name, "backend": backend, "records": [], "done": [], "knee": None,
                         "error": f"{type(e).__name__}: {e}"})
        if runs[-1].get("interrupted"):
            break
    leaked = sorted(_shm_entries() - shm_before)
    for r in runs:
        if r.get("exit_code") not in (0, None):
            note(f"{r['system']}: gateway exit code {r['exit_code']}")
            rc = 1
    note(f"/dev/shm left behind: {leaked or 'nothing'}")
    if leaked:
        rc = 1
    measured = [r for r in runs if r["records"]]
    if not measured:
        note("no measured requests")
        rc = 1
    if any(rec["completed"] == 0 for r in measured for rec in r["records"]):
        rc = 1
    # the models, from the first system's run that completed requests (every system got the same passes)
    first = next((r for r in measured if any(d.error is None for seg in r["done"] for d in seg)), None)
    segs = first["done"] if first else []
    t_run = min((d.sched for seg in segs for d in seg), default=0.0)
    trace = M.replay(router, sorted((t - t_run, idx) for seg in segs for d in seg
                                    if d.error is None for t, idx in d.passes), bank)
    wall = sum(rec["duration_s"] for rec in first["records"]) if first else 0.0
    placement = first.get("placement") if first else None
    models = {"comm_volume": M.comm_volume(trace, router.d_model * np.dtype(args.dtype).itemsize, placement, wall),
              "lru_hit_rate": M.lru_hit_rates(trace, router.n_experts),
              "expert_load": M.expert_load(trace, router.n_experts),
              "from_system": None if first is None else f"{first['system']}/{first['backend']}",
              "noisy_replay": bool(router.noisy)}
    moe = [r for r in measured if r["system"] == "moe-transport"]
    if moe:  # what the gateway itself routed (with its noise, capacity and bias): its counters
        models["gateway_routing"] = M.gateway_routing(moe[0]["records"], router.n_experts)
    if moe and moe[0] is first and "transport_bytes" in moe[0]["records"][0]:
        got = sum(rec.get("transport_bytes", 0) for rec in moe[0]["records"])
        model = models["comm_volume"]["total_bytes"]
        models["comm_volume"]["transport_bytes_measured"] = got
        models["comm_volume"]["measured_over_model"] = got / model if model else None
    ratios = _ratios(measured, args.mode)
    targets = _targets(ratios, args.mode)
    meta = _meta(args, router, scenario, gw_cfg, runs)
    return {"runs": runs, "measured": measured, "models": models, "ratios": ratios, "targets": targets,
            "meta": meta, "scenario": scenario, "router": router, "leaked": leaked, "rc": rc}
