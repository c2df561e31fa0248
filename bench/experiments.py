"""`moe-bench load --sweep` and `--compare`: the MoE experiments as one command each.

    moe-bench load --sweep n_experts=8,16,32 --rate 40 --ramp-steps 4 --step-duration 3
    moe-bench load --compare batching=fifo,expert-aware --compare balancing=load-aware,least-loaded \
        --compare max_inflight_rounds=1,2 --replicas 2 --rate 40 --ramp-steps 4 --step-duration 3

Every point starts its own gateway (local workers, the same load flags, one setting
changed) and ramps it to its knee (bench.load's ramp: the highest rate with p99 TPOT within
the SLO, no queue growth and no failed request). A sweep prints one row per value of
n_experts, top_k or d_model: tokens/s at the knee with the mean and p99 latency there; a
comparison prints one table per axis, each variant beside the first (the default when the
flags keep it), and the pipelining comparison is ``max_inflight_rounds=1,N``. The
figures are single runs on whatever machine runs them: the report gives the host and load
average, and a difference smaller than the steps' own spread is not a finding.
"""
from __future__ import annotations

import copy

from bench import placement_runs
from bench.experiments_report import combine, load_meta, markdown, plot, summary
from bench.load import measure
from bench.load_config import ConfigError
from bench.output import nan_to_none, note, write_plot
from bench.provenance import emit_report, write_json_atomic


def run_points(args, prov: dict) -> int:
    if getattr(args, "placement_arms", None):
        return placement_runs.run(args, prov)

    backend = (args.backend or ["shm"])[0]
    trials: list[list[dict]] = [[] for _ in args.points]
    rc = 0
    repeat = max(1, args.repeat)
    for rep in range(repeat):  # interleaved: a drift in the machine's load hits every point alike
        for i, pt in enumerate(args.points):
            pargs = copy.copy(args)
            setattr(pargs, pt["axis"], pt["value"])
            pargs.explicit = set(args.explicit) | {pt["axis"]}
            pargs.plan = [("moe-transport", backend)]
            note(f"point {i + 1}/{len(args.points)}{f', repeat {rep + 1}/{repeat}' if repeat > 1 else ''}: "
                 f"{pt['label']}")
            try:
                res = measure(pargs)
            except ConfigError as e:
                note(f"  {pt['label']}: {e}")
                trials[i].append({**pt, "error": str(e), "rc": 2, "records": []})
                rc = 2
                continue
            s = summary(pt, res)
            trials[i].append(s)
            rc = max(rc, res["rc"])
            a = s.get("at_knee")
            if a:
                note(f"  {pt['label']}: {(s['knee'] or {}).get('text')}; {a['tokens_per_s']:.0f} tokens/s, "
                     f"TPOT mean {a['tpot_mean_ms']:.2f} ms p99 {a['tpot_p99_ms']:.2f} ms")
    points = [combine(pt, t) for pt, t in zip(args.points, trials)]
    md = markdown(args, prov, points)
    emit_report(md, args.markdown)
    if args.json:
        doc = {"provenance": prov, "experiment": {"kind": args.points[0]["kind"],
                                                  "axes": sorted({p["axis"] for p in args.points}),
                                                  "repeat": repeat, "load": load_meta(args)},
               "points": points}
        write_json_atomic(args.json, nan_to_none(doc))
        note(f"wrote {args.json}")
    if args.plot:
        write_plot(lambda: plot(points, args.plot, args.slo_tpot_ms), args.plot,
                   any(p.get("at_knee") for p in points))
    return rc
