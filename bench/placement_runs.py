"""`moe-bench load --compare placement=...`: every placement arm under every routing scenario,
repeats interleaved, then the report, JSON and plot (bench/placement_report.py). What an arm
means is bench/placement_bench.py's."""
from __future__ import annotations

import argparse

from bench import placement_report as R
from bench.load import measure
from bench.load_config import ConfigError
from bench.output import nan_to_none, note, write_plot
from bench.placement_bench import arm_args, combine_trials, trial_summary
from bench.provenance import emit_report, write_json_atomic


def run(args: argparse.Namespace, prov: dict) -> int:
    """Every arm under every scenario, repeats interleaved; the report, JSON and plot."""
    cells = {(sc, arm): {"kind": "compare", "axis": "placement", "value": arm, "scenario": sc,
                         "label": f"{arm} / {sc}", "baseline": arm == args.placement_arms[0]}
             for sc in args.scenario_list for arm in args.placement_arms}
    trials: dict = {c: [] for c in cells}
    rc, repeat = 0, max(1, args.repeat)
    for rep in range(repeat):  # interleaved: a drift in the machine's load hits every arm alike
        for i, ((sc, arm), pt) in enumerate(cells.items()):
            note(f"point {i + 1}/{len(cells)}{f', repeat {rep + 1}/{repeat}' if repeat > 1 else ''}: {pt['label']}")
            pargs = arm_args(args, arm, sc)
            try:
                res = measure(pargs)
            except ConfigError as e:
                note(f"  {pt['label']}: {e}")
                trials[(sc, arm)].append({**pt, "error": str(e), "rc": 2, "records": []})
                rc = 2
                continue
            res["args"] = pargs
            s = trial_summary(pt, res)
            trials[(sc, arm)].append(s)
            rc = max(rc, res["rc"])
            a, pl = s.get("at_knee"), s["placement"]
            if a:
                note(f"  {pt['label']}: {(s['knee'] or {}).get('text')}; {a['tokens_per_s']:.0f} tokens/s, p99 TPOT "
                     f"{a['tpot_p99_ms']:.2f} ms; balancedness {pl.get('balancedness_at_knee')}; moves "
                     f"{pl.get('moves')}; failed {pl.get('failed')}; wrong {(s.get('answers') or {}).get('wrong')}")
    points = [combine_trials(cells[c], t) for c, t in trials.items() if t]
    verdicts = R.verdicts(points)
    md = R.markdown(args, prov, points, verdicts)
    emit_report(md, args.markdown)
    if args.json:
        doc = {"provenance": prov, "experiment": {"kind": "placement", "arms": args.placement_arms,
                                                  "scenarios": args.scenario_list, "repeat": repeat,
                                                  "load": R.load_meta(args)},
               "points": points, "verdicts": verdicts}
        write_json_atomic(args.json, nan_to_none(doc))
        note(f"wrote {args.json}")
    if args.plot:
        write_plot(lambda: R.plot(points, args.plot, args), args.plot, any(p.get("at_knee") for p in points))
    if any(p.get("placement", {}).get("failed") or (p.get("answers") or {}).get("wrong") for p in points):
        rc = max(rc, 1)
    return rc
