"""`moe-bench load`: its flags, their check before any load is sent, the plan it prints
first, and the run: one load over the systems (bench/load.py, where each flag's meaning
is), or the points of a sweep or comparison (bench/experiments.py)."""
from __future__ import annotations

import argparse

from bench import load_hooks, load_report as R, placement_bench
from bench.experiments import run_points
from bench.load import measure, resolve
from bench.load_config import DEMO, FULL, LAYER_DEFAULTS, MIXED_BURSTINESS, STARTED_DEFAULTS, ConfigError
from bench.output import nan_to_none, note, write_plot
from bench.provenance import emit_report, provenance, write_json_atomic
from bench.scenarios import SCENARIOS
from gateway.chunking import chunk_rows_flag
from transport.service import options


def add_arguments(p: argparse.ArgumentParser) -> None:
    rate = options.positive_number
    p.add_argument("--mode", default=None, choices=["fixed-rate", "ramp", "mixed"],
                   help="fixed-rate: one rate; ramp: steps up to saturation; mixed: bursty arrivals and mixed "
                        "lengths (default fixed-rate; ramp with --sweep/--compare)")
    p.add_argument("--rate", type=rate, default=5.0, metavar="REQ/S",
                   help="target requests/s (ramp: the last step's)")
    p.add_argument("--arrival", default=None, choices=["constant", "poisson", "gamma"],
                   help="gap distribution (default constant; gamma in mixed mode or with --burstiness/--arrival-cv)")
    bursty = p.add_mutually_exclusive_group()
    bursty.add_argument("--burstiness", type=options.positive_number, default=None, metavar="SHAPE",
                        help="gamma arrivals' shape, vLLM's meaning: 1 is Poisson, lower is burstier, higher more "
                             f"regular (gaps' CV = 1/sqrt(burstiness)); default 1, mixed mode {MIXED_BURSTINESS:g}")
    bursty.add_argument("--arrival-cv", type=options.positive_number, default=None, metavar="CV",
                        help="gamma arrivals by the gaps' coefficient of variation instead (burstiness = 1/CV^2): "
                             "1 is Poisson, higher is burstier")
    p.add_argument("--duration", type=options.positive_seconds, default=10.0,
                   help="seconds of measured load (ramp: all steps)")
    p.add_argument("--max-requests", type=options.count, default=0,
                   help="stop after N measured requests (default 0: no cap)")
    p.add_argument("--concurrency", type=options.positive, default=4,
                   help="client threads, the concurrency limit")
    p.add_argument("--warmup", type=options.seconds, default=1.0, help="seconds of unrecorded load first")
    p.add_argument("--seed", type=options.count, default=0, help="schedule, lengths, tokens and weights")
    p.add_argument("--ramp-start", type=rate, default=None, metavar="REQ/S",
                   help="first step's requests/s (default rate/steps)")
    p.add_argument("--ramp-steps", type=options.positive, default=5, help="number of ramp steps")
    p.add_argument("--step-duration", type=options.positive_seconds, default=None,
                   help="seconds per ramp step (default duration/steps)")
    p.add_argument("--slo-tpot", type=options.positive_seconds, default=None,
                   help="TPOT SLO: the ramp's knee and goodput (default 0.1)")
    options.alias(p, "--slo-tpot-ms", "--slo-tpot", type=options.milliseconds_as_seconds)
    p.add_argument("--slo-ttft", type=options.positive_seconds, default=None,
                   help="TTFT SLO: goodput counts requests within both SLOs (default 2)")
    options.alias(p, "--slo-ttft-ms", "--slo-ttft", type=options.milliseconds_as_seconds)
    p.add_argument("--timeout", type=options.positive_seconds, default=30.0, help="per forward pass")
    tgt = p.add_argument_group("systems")
    tgt.add_argument("--systems", default="moe-transport", metavar="NAMES",
                     help="comma-separated: moe-transport, reference, multiprocessing, ray, or all")
    tgt.add_argument("--gateway", type=options.url,
                     help="moe-transport: a running moe-gateway; its configuration (d_model, dtype, experts, top-k, "
                          "router) is asked first and used; flags that contradict it are refused")
    tgt.add_argument("--backend", action="append", choices=["shm", "tcp", "rdma"],
                     help="moe-transport without --gateway: start one with local workers on this "
                          "backend (repeatable; default shm)")
    tgt.add_argument("--local-workers", type=options.positive, default=None,
                     help="worker processes: the started gateway's local workers, and the multiprocessing peer's "
                          f"(default {STARTED_DEFAULTS['local_workers']})")
    tgt.add_argument("--n-experts", type=options.positive, default=None,
                     help=f"default {LAYER_DEFAULTS['n_experts']} (--gateway: its own)")
    tgt.add_argument("--top-k", type=options.positive, default=None,
                     help=f"default {LAYER_DEFAULTS['top_k']} (--gateway: its own)")
    tgt.add_argument("--capacity-factor", type=options.positive_number, default=None, metavar="FACTOR",
                     help="router capacity factor (default none)")
    tgt.add_argument("--d-model", type=options.positive, default=None,
                     help=f"default {DEMO['d_model']} (--full {FULL['d_model']}; --gateway: its own)")
    tgt.add_argument("--d-ff", type=options.positive, default=None,
                     help=f"default {DEMO['d_ff']} (--full {FULL['d_ff']}; --gateway: its workers')")
    tgt.add_argument("--dtype", default=None, choices=["float32", "float64"],
                     help="activations' dtype (default float32; --gateway: its own); the peers compute in float32 only")
    tgt.add_argument("--max-wait", type=options.seconds, default=None,
                     help=f"the started gateway's batching wait (default {STARTED_DEFAULTS['max_wait_ms'] / 1e3:g})")
    options.alias(tgt, "--max-wait-ms", "--max-wait", type=options.milliseconds_as_seconds)
    tgt.add_argument("--max-inflight-rounds", type=options.positive, default=None,
                     help=f"the started gateway's rounds out at once (default {STARTED_DEFAULTS['max_inflight_rounds']})")
    tgt.add_argument("--max-batch-tokens", type=options.positive, default=None,
                     help="the started gateway's tokens per round (default: every client's prefill at once, >= 256)")
    tgt.add_argument("--full", action="store_true", help="d_model 1024, d_ff 2048, prefill 256, decode 32")
    gw = p.add_argument_group("the started gateway's routing and policies (moe-gateway's flags of the same names)")
    gw.add_argument("--replicas", type=options.positive, default=None,
                    help="copies of each expert over the local workers")
    gw.add_argument("--overflow", default=None, choices=["drop", "spill"],
                    help="over capacity: drop the assignment or spill it to the next-best expert (default drop)")
    gw.add_argument("--gate-bias", default=None, type=options.floats, help="comma-separated per-expert gate bias")
    gw.add_argument("--noisy", action="store_true", default=None, help="noisy top-k gating")
    gw.add_argument("--noise-std", type=options.nonnegative, default=None, help="noisy top-k: noise scale (default 1)")
    gw.add_argument("--batching", default=None, choices=["fifo", "expert-aware"],
                    help="which queued requests a round takes (default fifo)")
    gw.add_argument("--balancing", default=None, choices=["load-aware", "least-loaded"],
                    help="replica choice for replicated experts (default load-aware)")
    gw.add_argument("--chunk-rows", default=None, type=chunk_rows_flag, metavar="auto|off|ROWS",
                    help="pipelined rounds: at most this many rows per message to a worker (default auto)")
    ex = p.add_argument_group("experiments: several started gateways, each a ramp to its knee, one report")
    ex.add_argument("--sweep", default=None, metavar="KEY=V1,V2,...",
                    help="one ramp per value of n_experts, top_k or d_model, e.g. n_experts=8,16,32: a table of "
                         "tokens/s at each knee with mean and p99 latency, and (--plot) a figure")
    ex.add_argument("--compare", action="append", default=None, metavar="KEY=V1,V2,...",
                    help="one ramp per variant, each against the first: batching=fifo,expert-aware, "
                         "balancing=load-aware,least-loaded, max_inflight_rounds=1,2 (rounds in flight), "
                         "chunk_rows=off,auto (pipelined rounds); repeatable, each axis varied alone")
    ex.add_argument("--repeat", type=options.positive, default=1, metavar="N",
                    help="measure every point N times, interleaved, and report medians and the spread (default 1)")
    req = p.add_argument_group("requests")
    req.add_argument("--prefill", type=options.positive, default=None, metavar="TOKENS",
                     help=f"prompt tokens (default {DEMO['prefill']})")
    req.add_argument("--decode", type=options.count, default=None, metavar="STEPS",
                     help=f"decode steps (default {DEMO['decode']})")
    sc = p.add_argument_group("routing scenario")
    sc.add_argument("--scenario", default="uniform", choices=SCENARIOS, help="expert popularity")
    sc.add_argument("--zipf-s", type=options.positive_number, default=1.2, help="zipf, drift: the exponent")
    sc.add_argument("--hot-expert", type=options.count, default=0, help="hot: the hot expert")
    sc.add_argument("--hot-share", type=options.fraction, default=0.5, help="hot: share of first choices")
    sc.add_argument("--drift-period", type=options.positive_seconds, default=5.0,
                    help="drift: seconds per rank rotation")
    sc.add_argument("--bank", type=options.positive, default=256, help="steered tokens per expert")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the results, with provenance, as JSON")
    out.add_argument("--markdown", metavar="PATH", help="write the report (what stdout shows) here too")
    out.add_argument("--plot", metavar="PATH", help="PNG: latency vs throughput (ramp) or CDFs, expert load "
                                                     "over time, LRU cache hit rate")
    out.add_argument("--progress", default="auto", choices=["auto", "rich", "plain", "none"],
                     help="progress on stderr (default auto: rich on a terminal, else plain lines)")
    placement_bench.add_arguments(p)


def validate(args: argparse.Namespace) -> None:
    """The flags resolved and checked before any load (bench.load's ConfigError as a
    usage error)."""
    try:
        resolve(args)
    except ConfigError as e:
        raise options.UsageError(str(e)) from None


START_S = 5.0  # starting a gateway and its local workers, beyond the timed load (measured: 3-8 s)


def plan(args: argparse.Namespace) -> str:
    """What a resolved run will do and about how long it takes at most, said before it
    starts (a ramp stops at its first saturated step, so it may end sooner)."""
    if args.mode == "ramp":
        step = args.step_duration or args.duration / args.ramp_steps
        load_s = step * args.ramp_steps
        what = f"a ramp of {args.ramp_steps} steps of {step:g} s up to {args.rate:g} req/s"
    else:
        load_s = args.duration
        what = f"{args.duration:g} s of {args.mode} load at {args.rate:g} req/s"
    each = args.warmup + load_s + START_S
    if args.points:
        scen = getattr(args, "scenario_list", None) if getattr(args, "placement_arms", None) else None
        labels = [f"{p['label']} / {sc}" for sc in scen for p in args.points] if scen else \
            [p["label"] for p in args.points]
        n = len(labels) * max(1, args.repeat)
        runs = (f"{len(labels)} started gateway(s) ({', '.join(labels)})"
                f"{f' x {args.repeat} repeats, interleaved' if args.repeat > 1 else ''}")
    else:
        n = len(args.plan)
        runs = f"{n} system(s) ({', '.join(s if b is None else f'{s}/{b}' for s, b in args.plan)})"
    return (f"plan: {runs}, each {args.warmup:g} s of warm-up and {what}: about {n * each / 60:.1f} min "
            f"at most")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ConfigError as e:
        note(f"moe-bench load: {e}")
        return 2


def _run(args: argparse.Namespace) -> int:
    prov = provenance()
    resolve(args)
    note(plan(args))
    if args.points:
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
