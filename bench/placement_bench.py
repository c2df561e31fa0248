"""`moe-bench load --compare placement=static,replicas,eplb`: expert placement against skewed load.

    moe-bench load --compare placement=static,replicas,eplb --scenarios uniform,zipf,hot,drift \\
        --worker-cpus 0,1 --rate 60 --ramp-steps 6 --step-duration 3 --repeat 3 --plot placement.png

Each arm is a started gateway (local workers, the same load flags), ramped to its knee:

- ``static``: today's contiguous blocks, one copy of each expert (``--replicas 1``);
- ``replicas``: ``--replicas R`` copies of every expert (R: ``--replicas``, default 2);
- ``eplb``: one copy each to start, and ``--eplb --redundant-experts N`` with N = n_experts
  x (R - 1): the replicas arm's physical-expert budget, placed by measured load
  (``--eplb-interval``/``--eplb-window``, short by default to suit a ramp of a few seconds
  a step).

Every arm runs under each of ``--scenarios`` (default: ``--scenario``), arms side by side,
repeats interleaved (``--repeat``); every answer is kept and checked against the reference
after the clock stops, and ``placement show`` is polled through the run (the timeline of
balancedness, placement version and moves: bench/placement_timeline.py). The report
(bench/placement_report.py): tokens/s at the knee and p99 TPOT per arm and scenario,
balancedness and physical experts, failed and wrong answers, p99 TPOT of requests during
moves against the steady ones, drift recovery, the gateway's own share of a round, and
the verdicts of issue 50's targets.

This module also holds the flags that pass to any started gateway (``--eplb``,
``--worker-cpus``) and the DeepSeek-V3 routing-shape preset (``--preset deepseek-v3``).
"""
from __future__ import annotations

import argparse
import copy
from typing import Any, Optional

import numpy as np

from bench import elastic
from bench.answer_check import why_unchecked
from bench.experiments_report import at_knee, combine, summary
from bench.load_config import ConfigError
from bench.placement_timeline import _overlaps, drift_recovery, requests_of, tpot_during_moves, windows
from bench.scenarios import SCENARIOS
from transport.service import options

ARMS = ("static", "replicas", "eplb")
EPLB_INTERVAL, EPLB_WINDOW, POLL = 1.0, 1.0, 0.2  # seconds: a few per ramp step of a few seconds
# DeepSeek-V3's routed layer: 256 experts, top-8, on 8 workers with 32 redundant copies (its EPLB
# deployment's shape); a tiny d_model/d_ff so 8 worker processes fit a 2-core machine
PRESETS = {"deepseek-v3": dict(n_experts=256, top_k=8, local_workers=8, redundant_experts=32, d_model=64, d_ff=64,
                               scenario="zipf")}


def add_arguments(p: argparse.ArgumentParser) -> None:

    g = p.add_argument_group("expert placement (the started gateway's; --compare placement=static,replicas,eplb)")
    g.add_argument("--eplb", action="store_true",
                   help="the started gateway moves and replicates expert copies from the load it measures "
                        "(moe-gateway --eplb); its placement is polled through the run")
    g.add_argument("--redundant-experts", type=options.count, default=None, metavar="N",
                   help="with --eplb: spare copies per layer (default 0; --compare placement: n_experts x "
                        "(replicas - 1), the replicas arm's budget)")
    g.add_argument("--eplb-interval", type=options.positive_seconds, default=EPLB_INTERVAL,
                   help=f"the started gateway's --eplb-interval (default {EPLB_INTERVAL:g}, for steps of a few s)")
    g.add_argument("--eplb-window", type=options.positive_seconds, default=EPLB_WINDOW,
                   help=f"the started gateway's --eplb-window (default {EPLB_WINDOW:g})")
    g.add_argument("--eplb-max-moves", type=options.positive, default=None, metavar="N",
                   help="the started gateway's --eplb-max-moves (default: its own, 8)")
    g.add_argument("--worker-cpus", type=options.cpu_list, default=None,
                   help="pin the started gateway's local workers, worker i to the i-th CPU (modulo), e.g. 0,1")
    g.add_argument("--scenarios", default=None, metavar="LIST",
                   help=f"--compare placement: every arm under each of these ({','.join(SCENARIOS)}; "
                        "default: --scenario)")
    g.add_argument("--placement-poll", type=options.positive_seconds, default=POLL, metavar="SECONDS",
                   help=f"how often placement show is asked during the run (default {POLL:g})")
    g.add_argument("--check-answers", action=argparse.BooleanOptionalAction, default=None,
                   help="keep every answer and check it against the reference after the run (default: on with "
                        "--compare placement and --scale-at)")
    g.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="deepseek-v3: 256 experts top-8 on 8 local workers, 32 redundant, zipf routing, "
                        "d_model/d_ff 64 (each flag given still wins)")

    elastic.add_arguments(g)


def apply_preset(args: argparse.Namespace) -> None:
    """The preset's values where the flag was not given (before defaults are filled in)."""
    for k, v in PRESETS.get(getattr(args, "preset", None), {}).items():
        if k == "scenario":
            if args.scenario == "uniform" and not getattr(args, "scenarios", None):
                args.scenario = v  # (uniform is the flag's default: an explicit uniform needs --scenarios)
        elif getattr(args, k, None) is None:
            setattr(args, k, v)


def _free_slots(n_experts: int, workers: int) -> int:
    """Spare copies a started gateway's workers can hold: each starts with its block (one
    copy each) and may host twice that (moe-worker --max-experts' default), at most every
    expert once."""
    from gateway.supervisor import placement

    return sum(min(2 * len(b), n_experts) for b in placement(n_experts, workers, 1)) - n_experts


def resolve(args: argparse.Namespace) -> None:
    """The placement and --scale-at flags checked and filled in (bench.load's ConfigError on a
    contradiction)."""

    arms = [p["value"] for p in args.points if p["axis"] == "placement"]
    args.placement_arms = arms
    if arms:
        if len(arms) != len(args.points):
            raise ConfigError("--compare placement is an experiment of its own: give no other --compare axis")
        r = args.replicas if "replicas" in args.explicit else 2
        if r < 2:
            raise ConfigError("--compare placement: the replicas arm and eplb's budget need --replicas >= 2")
        if r > args.local_workers:
            raise ConfigError(f"--replicas {r} needs at least {r} --local-workers (copies go to distinct workers)")
        args.placement_replicas = r
        scen = [s.strip() for s in (args.scenarios or args.scenario).split(",") if s.strip()]
        bad = [s for s in scen if s not in SCENARIOS]
        if bad or not scen or len(set(scen)) != len(scen):
            raise ConfigError(f"--scenarios {args.scenarios!r}: give distinct ones of {', '.join(SCENARIOS)}")
        args.scenario_list = scen
    elif args.scenarios:
        raise ConfigError("--scenarios is for --compare placement (a single run takes --scenario)")
    if arms or args.eplb:
        if args.gateway:
            raise ConfigError("--eplb and --compare placement start their own gateway; drop --gateway")
        n = args.n_experts
        budget = n * (args.placement_replicas - 1) if arms else 0
        args.redundant_experts = budget if args.redundant_experts is None else args.redundant_experts
        free = _free_slots(n, args.local_workers)
        if args.redundant_experts > free:
            raise ConfigError(f"{args.redundant_experts} redundant experts do not fit: {args.local_workers} workers "
                              f"starting with {n} experts in blocks have {free} spare slots (moe-worker "
                              f"--max-experts defaults to twice a worker's start-up experts); ask for fewer "
                              f"(--redundant-experts, or --replicas 2)")
    if args.check_answers is None:
        args.check_answers = bool(arms or getattr(args, "scale_at", None))
        why = why_unchecked(args) if args.check_answers else None
        if why:
            args.check_answers = False
            args.answers_unchecked = why
    elif args.check_answers:
        why = why_unchecked(args)
        if why:
            raise ConfigError(f"--check-answers: {why}")

    elastic.resolve(args)


def gateway_flags(args: argparse.Namespace) -> list[str]:
    """The started gateway's placement flags (bench.load.gateway_flags adds them)."""
    out: list[str] = []
    if getattr(args, "worker_cpus", None):
        out += ["--worker-cpus", ",".join(str(c) for c in args.worker_cpus)]
    if getattr(args, "eplb", False) or getattr(args, "placement_arm", None):
        out += ["--eplb-window", repr(float(args.eplb_window))]  # every arm's balancedness over one window
    if getattr(args, "eplb", False):
        out += ["--eplb", "--redundant-experts", str(args.redundant_experts or 0),
                "--eplb-interval", repr(float(args.eplb_interval))]
        if args.eplb_max_moves:
            out += ["--eplb-max-moves", str(args.eplb_max_moves)]
    return out


def arm_args(args: argparse.Namespace, arm: str, scenario: str) -> argparse.Namespace:
    """The load flags of one arm under one scenario: its replicas and EPLB settings."""
    if arm not in ARMS:
        raise ValueError(f"unknown placement arm {arm!r}; one of {ARMS}")
    a = copy.copy(args)
    a.scenario, a.placement_arm = scenario, arm
    a.replicas = args.placement_replicas if arm == "replicas" else 1
    a.eplb = arm == "eplb"
    a.explicit = set(args.explicit) | {"replicas"}
    a.plan = [("moe-transport", (args.backend or ["shm"])[0])]
    return a


# -- one run's findings (from bench.load_hooks.PlacementHook) ----------------------------------------------
def step_spans(done: list, t_run: float) -> dict:
    """{ramp step: (first scheduled arrival, last end)} on the run's time axis (warm-up: -1)."""
    spans: dict = {}
    for d in done:
        st = d.job.arrival.step
        lo, hi = spans.get(st, (np.inf, -np.inf))
        spans[st] = (min(lo, d.sched - t_run), max(hi, d.end - t_run))
    return spans


def analyse_run(out: dict, done: list, t_run: float, args: Any) -> dict:
    """What the timeline says about this run's requests: failures, TPOT during moves against
    steady, per-step balancedness and EPLB run time, drift recovery."""

    tl = out.get("placement_timeline") or {}
    samples, moves = tl.get("samples", []), tl.get("moves", [])
    spans = windows(moves)
    sat = next((r.get("step", 0) for r in out.get("records", []) if r.get("saturated")), None)
    keep = (lambda d: d.job.arrival.step < sat) if sat is not None else None
    failed = [d for d in done if d.error is not None]
    res = {"requests": len(done), "failed": len(failed),
           "failed_during_moves": sum(1 for d in failed if _overlaps(d.start - t_run, d.end - t_run, spans)),
           "first_error": failed[0].error if failed else None,
           "tpot_during_moves": tpot_during_moves(requests_of(done, t_run, keep), spans),
           "moves": {"done": sum(m["state"] == "done" for m in moves),
                     "abandoned": sum(m["state"] == "abandoned" for m in moves),
                     "copies_added": sum(m["adds"] for m in moves if m["state"] == "done")},
           "physical": samples[-1]["physical"] if samples else None}
    per_step = {}
    for st, (lo, hi) in sorted(step_spans(done, t_run).items()):
        bs = [s["min_balancedness"] for s in samples if lo <= s["t"] <= hi and s["min_balancedness"] is not None]
        runs = [r["seconds"] for r in tl.get("eplb_runs", []) if lo <= r["t"] <= hi]
        per_step[st] = {"t0": round(lo, 3), "t1": round(hi, 3), "balancedness_mean": float(np.mean(bs)) if bs else None,
                        "balancedness_min": min(bs) if bs else None, "eplb_runs": len(runs),
                        "eplb_seconds": float(sum(runs))}
    res["steps"] = per_step
    runs = [r["seconds"] for r in tl.get("eplb_runs", [])]
    res["eplb_runs"] = {"n": len(runs), "median_s": float(np.median(runs)) if runs else None,
                        "max_s": max(runs) if runs else None, "interval_s": args.eplb_interval if args.eplb else None}
    if args.scenario == "drift" and samples:
        end = max((hi for _, hi in step_spans(done, t_run).values()), default=0.0)
        res["drift"] = drift_recovery(samples, args.drift_period, args.eplb_interval, t_from=0.0, t_to=end)
    return res


def trial_summary(pt: dict, res: dict) -> dict:
    """bench.experiments.summary, with the placement findings at the knee."""

    s = summary(pt, res)
    s["scenario"] = pt["scenario"]
    run = res["runs"][0] if res.get("runs") else {}
    an = run.get("placement_analysis") or {}
    rec, _ = at_knee(run) if run else (None, "")
    st = (an.get("steps") or {}).get(rec.get("step", 0) if rec else None) or {}
    s["placement"] = {k: an.get(k) for k in ("requests", "failed", "failed_during_moves", "first_error",
                                             "tpot_during_moves", "moves", "physical", "eplb_runs", "drift")}
    s["placement"]["balancedness_at_knee"] = st.get("balancedness_mean")
    s["answers"] = run.get("answers")
    s["answers_unchecked"] = getattr(res.get("args"), "answers_unchecked", None)
    s["timeline"] = run.get("placement_timeline")
    s["gateway_share"] = gateway_share(rec, st)
    return s


def gateway_share(rec: Optional[dict], step: dict) -> Optional[dict]:
    """The gateway's own part of a round at the knee step: route, dispatch (plan, gather and
    send), combine, and EPLB runs spread over the step's rounds; as ms per round and as a
    share of the round's wall time. ``share`` counts those stages' wall time, which includes
    the time the gateway's thread was preempted (by workers sharing its cores);
    ``cpu_share`` its CPU time in them (``own_cpu``), what the gateway itself costs."""
    if not rec or not rec.get("stage_ms") or not rec.get("rounds"):
        return None
    st = rec["stage_ms"]
    rebalance_ms = 1e3 * step.get("eplb_seconds", 0.0) / rec["rounds"]
    own = st.get("route", 0.0) + st.get("dispatch", 0.0) + st.get("combine", 0.0) + rebalance_ms
    cpu = st["own_cpu"] + rebalance_ms if st.get("own_cpu") is not None else None
    total = st.get("total", 0.0)
    return {"route_ms": st.get("route"), "dispatch_ms": st.get("dispatch"), "combine_ms": st.get("combine"),
            "rebalance_ms": rebalance_ms, "own_ms": own, "own_cpu_ms": cpu, "round_ms": total,
            "share": own / total if total else None,
            "cpu_share": cpu / total if total and cpu is not None else None}


def combine_trials(pt: dict, trials: list[dict]) -> dict:
    """bench.experiments.combine, with the placement findings over the repeats: medians of
    the figures, sums of the failures and wrong answers."""

    out = combine(pt, trials)
    pls = [t.get("placement") or {} for t in trials]

    def med(vals: list) -> Optional[float]:
        vals = [v for v in vals if v is not None]
        return float(np.median(vals)) if vals else None

    tdm = [p.get("tpot_during_moves") or {} for p in pls]
    ans = [t.get("answers") for t in trials if t.get("answers")]
    drift = [p["drift"] for p in pls if p.get("drift")]
    out["placement"] = {
        "balancedness_at_knee": med([p.get("balancedness_at_knee") for p in pls]),
        "physical": med([p.get("physical") for p in pls]),
        "failed": sum(p.get("failed") or 0 for p in pls),
        "failed_during_moves": sum(p.get("failed_during_moves") or 0 for p in pls),
        "moves_done": sum((p.get("moves") or {}).get("done", 0) for p in pls),
        "moves_abandoned": sum((p.get("moves") or {}).get("abandoned", 0) for p in pls),
        "during_moves_n": sum((d.get("during_moves") or {}).get("n", 0) for d in tdm),
        "during_moves_p99_ms": med([(d.get("during_moves") or {}).get("p99_ms") for d in tdm]),
        "steady_p99_ms": med([(d.get("steady") or {}).get("p99_ms") for d in tdm]),
        "during_over_steady": med([d.get("ratio") for d in tdm]),
        "drift_back": [sum(d["back"] for d in drift), sum(len(d["shifts"]) for d in drift)] if drift else None,
        "eplb_run_median_s": med([(p.get("eplb_runs") or {}).get("median_s") for p in pls]),
        "eplb_run_max_s": max([(p.get("eplb_runs") or {}).get("max_s") or 0.0 for p in pls], default=None),
    }
    out["answers"] = {"checked": sum(a["checked"] for a in ans), "wrong": sum(a["wrong"] for a in ans),
                      "unkept": sum(a.get("unkept", 0) for a in ans)} if ans else None
    gs = [t.get("gateway_share") for t in trials if t.get("gateway_share")]
    out["gateway_share"] = {k: med([g.get(k) for g in gs]) for k in ("route_ms", "dispatch_ms", "combine_ms",
                                                                      "rebalance_ms", "own_ms", "own_cpu_ms", "round_ms",
                                                                      "share", "cpu_share")
                            } if gs else None
    return out
