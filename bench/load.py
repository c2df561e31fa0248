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
import threading
import time
from typing import Optional

import numpy as np

from bench import load_hooks, load_report as R, models as M, placement_bench, schedule as S, systems as SY
from bench.load_clients import ClientPool, run_segment, segment_record
from bench.load_config import (COMPARE_KEYS, DEMO, FULL, GATEWAY_DEFAULTS, KEY_ALIASES, LAYER_DEFAULTS,
                               MIXED_BURSTINESS, ORDER, STARTED_DEFAULTS, SWEEP_KEYS, ConfigError, seconds_to_ms)
from bench.output import note
from bench.scenarios import Scenario, TokenBank
from bench.systems import SYSTEMS, proc_cpu_seconds
from gateway.chunking import chunk_rows_flag
from gateway.client import GatewayClient
from gateway.config import make_router
from gateway.router import Router


# -- the run ---------------------------------------------------------------------------
def _shm_entries() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def resolve(args) -> None:
    """Defaults, the arrival process, and the plan of systems; ConfigError on flags that
    contradict each other."""
    if getattr(args, "resolved", False):  # bench.cli validated these flags already
        return
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


def started_router(args):
    """The router a gateway started with these flags builds (gateway/config.py's make_router):
    the load generator steers tokens with it and the peers route with it."""
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
    return out + placement_bench.gateway_flags(args)


def make_system(name: str, backend: Optional[str], args, router):
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


def _counters(system) -> dict:
    """The system's counters, with this process's CPU (client threads, and the peers that
    run in-process) as "load-generator"."""
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


def measure(args: argparse.Namespace) -> dict:
    """Run every system of ``args.plan`` (resolved) under the load; their runs, the routing
    models, ratios and the run's meta, and the exit code so far."""
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
    ratios = R.ratios(measured, args.mode)
    targets = R.targets(ratios, args.mode)
    meta = _meta(args, router, scenario, gw_cfg, runs)
    return {"runs": runs, "measured": measured, "models": models, "ratios": ratios, "targets": targets,
            "meta": meta, "scenario": scenario, "router": router, "leaked": leaked, "rc": rc}
