"""The points of `moe-bench load --sweep` and `--compare` (bench/experiments.py): each run's
summary at its knee, repeats combined, the markdown report and the plot."""
from __future__ import annotations

import os
from typing import Optional

import numpy as np


AXIS_TITLE = {"n_experts": "experts", "top_k": "top-k", "d_model": "d_model", "batching": "batching",
              "balancing": "balancing", "max_inflight_rounds": "rounds in flight", "chunk_rows": "rows per message"}


def at_knee(run: dict) -> tuple[Optional[dict], str]:
    """The record a point is judged by, and how to read it: the knee step ("" when the knee
    was reached), the top step when nothing saturated (">=", a lower bound), or the first
    step when even it saturated ("<")."""
    recs = run.get("records") or []
    if not recs:
        return None, ""
    knee = run.get("knee") or {}
    if knee.get("reached"):
        return next(r for r in recs if r["target_rate"] == knee["rate"]), ""
    ok = [r for r in recs if not r["saturated"]]
    if ok:
        return ok[-1], ">="
    return recs[0], "<"


def summary(point: dict, res: dict) -> dict:
    run = res["runs"][0]
    rec, mark = at_knee(run)
    out = {"label": point["label"], "axis": point["axis"], "value": point["value"], "kind": point["kind"],
           "baseline": point["baseline"], "knee": run.get("knee"), "mark": mark, "error": run.get("error"),
           "rc": res["rc"], "gateway_config": run.get("gateway_config"),
           "gateway_routing": res["models"].get("gateway_routing"),
           "records": run.get("records", [])}
    if rec is not None:
        st = rec.get("stage_ms") or {}
        out["at_knee"] = {
            "target_rate": rec["target_rate"], "request_throughput": rec["request_throughput"],
            "tokens_per_s": rec["tokens_per_s"], "tpot_mean_ms": rec["tpot_ms"]["mean"],
            "tpot_p99_ms": rec["tpot_ms"]["p99"], "tpot_p99_reliable": rec["tpot_ms"]["reliable"]["p99"],
            "ttft_p99_ms": rec["ttft_ms"]["p99"], "e2e_mean_ms": rec["e2e_ms"]["mean"],
            "passes_per_round": rec.get("passes_per_round"), "stage_ms": st,
            "samples": rec["tpot_ms"]["n"], "verdict": rec["verdict"]}
    return out


def config_of(args, pt: dict) -> tuple:
    """The point's effective configuration (what a gateway started for it varies in)."""
    keys = ("n_experts", "top_k", "d_model", "batching", "balancing", "max_inflight_rounds", "chunk_rows")
    return tuple((k, pt["value"] if k == pt["axis"] else getattr(args, k)) for k in keys)


def combine(pt: dict, trials: list[dict]) -> dict:
    """One point over its repeats: medians of the figures at each repeat's knee, their range,
    and every repeat's knee."""
    ok = [t for t in trials if t.get("at_knee")]
    out = {**pt, "trials": trials, "knees": [t.get("knee") for t in trials],
           "marks": [t.get("mark", "") for t in trials], "error": next((t.get("error") for t in trials
                                                                         if t.get("error")), None),
           "gateway_config": next((t.get("gateway_config") for t in trials if t.get("gateway_config")), None),
           "records": [dict(r, trial=j) for j, t in enumerate(trials) for r in t.get("records", [])]}
    if ok:
        med = {k: float(np.median([t["at_knee"][k] for t in ok if t["at_knee"].get(k) is not None]))
               for k in ("tokens_per_s", "request_throughput", "tpot_mean_ms", "tpot_p99_ms", "ttft_p99_ms",
                         "e2e_mean_ms") if any(t["at_knee"].get(k) is not None for t in ok)}
        pp = [t["at_knee"]["passes_per_round"] for t in ok if t["at_knee"].get("passes_per_round") is not None]
        med["passes_per_round"] = float(np.median(pp)) if pp else None
        med["tpot_p99_reliable"] = all(t["at_knee"]["tpot_p99_reliable"] for t in ok)
        med["stage_ms"] = {k: float(np.median([t["at_knee"]["stage_ms"].get(k, 0.0) for t in ok
                                                 if t["at_knee"].get("stage_ms")] or [0.0]))
                           for k in ("queue", "route", "dispatch", "compute", "wait", "combine", "total", "no_token",
                                     "own_cpu")}
        tps = [t["at_knee"]["tokens_per_s"] for t in ok]
        out["at_knee"] = med
        out["tokens_per_s_range"] = [min(tps), max(tps)]
        busiest = [t["gateway_routing"]["max_over_mean"] for t in ok
                   if (t.get("gateway_routing") or {}).get("max_over_mean") is not None]
        out["gateway_routing"] = {"max_over_mean": float(np.median(busiest)) if busiest else None,
                                  "trials": [t.get("gateway_routing") for t in trials]}
    # a lower bound only if no repeat reached its knee; "<" if every repeat saturated at once
    marks = set(out["marks"])
    out["mark"] = ">=" if marks == {">="} else ("<" if marks == {"<"} else "")
    return out


def load_meta(args) -> dict:
    """The load flags every point shared, for the report and the JSON."""
    return {"rate": args.rate, "ramp_start": args.ramp_start, "ramp_steps": args.ramp_steps,
            "step_duration": args.step_duration, "warmup": args.warmup, "concurrency": args.concurrency,
            "prefill": args.prefill, "decode": args.decode, "arrival": args.arrival, "backend": args.backend,
            "local_workers": args.local_workers, "d_model": args.d_model, "d_ff": args.d_ff,
            "n_experts": args.n_experts, "top_k": args.top_k, "replicas": args.replicas,
            "batching": args.batching, "balancing": args.balancing, "overflow": args.overflow,
            "chunk_rows": getattr(args, "chunk_rows", "auto"),
            "noisy": args.noisy, "noise_std": args.noise_std, "gate_bias": args.gate_bias,
            "capacity_factor": args.capacity_factor, "max_inflight_rounds": args.max_inflight_rounds,
            "max_wait_ms": args.max_wait_ms, "scenario": args.scenario, "slo_tpot_ms": args.slo_tpot_ms,
            "seed": args.seed, "repeat": max(1, getattr(args, "repeat", 1) or 1)}


def _f(v, fmt: str = "{:.2f}") -> str:
    return "-" if v is None or (isinstance(v, float) and not np.isfinite(v)) else fmt.format(v)


def _knee_text(knee: Optional[dict]) -> str:
    knee = knee or {}
    if knee.get("reached"):
        return f"{knee['rate']:g}"
    if knee.get("at_least") is not None:
        return f">= {knee['at_least']:g}"
    if knee.get("below") is not None:
        return f"< {knee['below']:g}"
    return "-"


def _row(p: dict, first_col: str) -> str:
    a = p.get("at_knee")
    if a is None:
        why = p.get("error") or "nothing measured"
        return f"| {first_col} | - | - | - | - | - | - | - | {why} |"
    knee_txt = " / ".join(_knee_text(k) for k in p.get("knees", [p.get("knee")]))
    lo, hi = p.get("tokens_per_s_range", [a["tokens_per_s"]] * 2)
    spread = f" ({lo:.0f}-{hi:.0f})" if hi > lo else ""
    p99 = _f(a["tpot_p99_ms"]) + ("" if a["tpot_p99_reliable"] else "*")
    gr = p.get("gateway_routing") or {}
    busiest = _f(gr.get("max_over_mean"), "{:.2f}x")
    st = a.get("stage_ms") or {}
    stages = " / ".join(_f(st.get(k)) for k in ("queue", "dispatch", "wait", "combine", "no_token")) if st else "-"
    return (f"| {first_col} | {knee_txt} | {p['mark']}{a['tokens_per_s']:.0f}{spread} | {_f(a['tpot_mean_ms'])} | "
            f"{p99} | {_f(a['ttft_p99_ms'], '{:.1f}')} | {_f(a.get('passes_per_round'))} | {stages} | {busiest} |")


HEAD = ("| {col} | knee req/s | tokens/s at the knee | latency mean ms | latency p99 ms | TTFT p99 ms "
        "| passes per round | stage ms queue / dispatch / wait / combine / no-token | busiest expert vs mean |")
SEP = "|---|---|---|---|---|---|---|---|---|"


def markdown(args, prov: dict, points: list[dict]) -> str:
    kind = points[0]["kind"] if points else "sweep"
    commit = prov.get("commit")
    commit = "not a git checkout" if not commit else f"commit {commit[:12]}{' (local changes)' if prov.get('dirty') else ''}"
    m = load_meta(args)
    lines = [f"### moe-bench load --{kind}: every point a ramp to its knee", "",
             f"moe-transport {prov.get('version')} · {commit} · {prov.get('date_utc')}", "",
             f"- command: `{prov.get('command')}`",
             f"- host: {prov.get('host')} · {prov.get('cpu_model')} x{prov.get('cpus')} · load average at start "
             f"{prov.get('loadavg_at_start')} · {prov.get('python')}",
             f"- each point: a gateway started here on {m['backend'][0] if m['backend'] else 'shm'} with "
             f"{m['local_workers']} local workers ({m['replicas']} cop{'y' if m['replicas'] == 1 else 'ies'} of each "
             f"expert), {m['n_experts']} experts top-{m['top_k']}, d_model {m['d_model']}, d_ff {m['d_ff']}, "
             f"batching {m['batching']}, balancing {m['balancing']}, {m['max_inflight_rounds']} rounds in flight, "
             f"chunk rows {m.get('chunk_rows', 'auto')}, "
             f"max wait {m['max_wait_ms']:g} ms, overflow {m['overflow']}"
             + (f", noisy top-k (std {m['noise_std']:g})" if m["noisy"] else "")
             + (f", gate bias {m['gate_bias']}" if m["gate_bias"] else "")
             + (f", capacity factor {m['capacity_factor']:g}" if m["capacity_factor"] else "")
             + "; the row's setting replaces its own",
             f"- load: {m['concurrency']} clients, requests of {m['prefill']} prefill + {m['decode']} decode tokens, "
             f"{m['arrival']} arrivals, routing {m['scenario']}; ramp of {m['ramp_steps']} steps up to {m['rate']:g} "
             f"req/s, {m['step_duration'] or 'duration/steps'} s each after {m['warmup']:g} s of warm-up; knee: the "
             f"highest rate with p99 TPOT <= {m['slo_tpot_ms']:g} ms, no queue growth and no failed request",
             "- latency: TPOT, the time of one decode step (one 1-token pass through the gateway and its workers), "
             "at the knee step; tokens/s counts rows through the MoE layer; `>=` marks a top step when no step "
             "saturated (a lower bound), `<` a first step that already had; `*` a p99 from fewer than 100 samples",
             "- no-token: per round, the busiest worker's time with no token to compute (its own receive and "
             "reply clocks), what pipelined rounds (--chunk-rows) could hide",
             "- passes per round: forward passes (requests to the gateway) per dispatch round; busiest expert: its "
             "rows over the mean expert's, from the gateway's own counters (the routing it really did)",
             (f"- every point measured {m['repeat']} times, interleaved (A B A B ...): knees of each repeat, "
              f"figures the median, tokens/s (min-max)" if m["repeat"] > 1 else
              "- every point measured once (--repeat N for several, interleaved)")]
    if kind == "sweep":
        axis = points[0]["axis"]
        lines += ["", HEAD.format(col=AXIS_TITLE[axis]), SEP]
        lines += [_row(p, str(p["value"])) for p in points]
    else:
        for axis in dict.fromkeys(p["axis"] for p in points):
            group = [p for p in points if p["axis"] == axis]
            base = group[0]
            lines += ["", f"**{AXIS_TITLE[axis]}** (against {base['value']})", "",
                      HEAD.format(col=AXIS_TITLE[axis]).rstrip("|") + "| tokens/s vs first | p99 latency vs first "
                                                                     "| tokens/s at the knee, against the first |",
                      SEP + "---|---|---|"]
            for p in group:
                lines.append(_row(p, str(p["value"])) + f" {_ratio(p, base, 'tokens_per_s')} | "
                                                         f"{_ratio(p, base, 'tpot_p99_ms')} | {_verdict(p, base)} |")
            if axis == "balancing" and (base.get("gateway_config") or {}).get("replicas", 1) <= 1:
                lines.append("\nno expert has two hosts (--replicas 1): both balancing policies choose alike")
    lines += noise_floor(args, points)
    lines += ["", "<details><summary>every ramp step</summary>", "",
              "| point | step | target req/s | req/s | tokens/s | TPOT ms mean / p50 / p99 | queue p99 ms | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    for p in points:
        for r in p.get("records", []):
            t = r["tpot_ms"]
            trial = f" #{r['trial'] + 1}" if m["repeat"] > 1 else ""
            lines.append(f"| {p['label']}{trial} | {r.get('step', 0) + 1} | {r['target_rate']:.2f} | "
                         f"{r['request_throughput']:.2f} | {r['tokens_per_s']:.0f} | {_f(t['mean'])} / {_f(t['p50'])} / "
                         f"{_f(t['p99'])} | {_f(r['queue_ms']['p99'], '{:.1f}')} | {r['verdict']} |")
    lines += ["", "</details>"]
    return "\n".join(lines)


def _verdict(p: dict, base: dict) -> str:
    """Whether tokens/s at the knee differs from the first variant beyond the spread of the
    measurements (with one repeat, the ramp's step is the only resolution there is)."""
    if p is base:
        return "-"
    a, b = p.get("tokens_per_s_range"), base.get("tokens_per_s_range")
    if not a or not b:
        return "-"
    if a[0] > b[1]:
        return "higher, beyond the spread" if len(p.get("trials", [])) > 1 else "higher (one run each)"
    if a[1] < b[0]:
        return "lower, beyond the spread" if len(p.get("trials", [])) > 1 else "lower (one run each)"
    return "within the spread"


def noise_floor(args, points: list[dict]) -> list[str]:
    """The same configuration met at several points (a comparison's baselines are often one
    configuration): their spread is the run-to-run noise on this machine, said as such."""
    groups: dict = {}
    for p in points:
        if p.get("at_knee"):
            groups.setdefault(config_of(args, p), []).append(p)
    out = []
    for cfg, ps in groups.items():
        if len(ps) < 2:  # one point's repeats: its own range column already shows their spread
            continue
        figs = [t["at_knee"]["tokens_per_s"] for p in ps for t in p.get("trials", []) if t.get("at_knee")]
        desc = ", ".join(f"{AXIS_TITLE[k]} {v}" for k, v in cfg)
        out += ["", f"**noise floor**: one configuration ({desc}) measured {len(figs)} times here "
                    f"({', '.join(p['label'] for p in ps)}): tokens/s at the knee "
                    f"{', '.join(f'{v:.0f}' for v in figs)} (max/min {max(figs) / min(figs):.2f}x); a difference "
                    f"smaller than that is not a finding"]
    return out


def _ratio(p: dict, base: dict, key: str) -> str:
    a, b = (p.get("at_knee") or {}).get(key), (base.get("at_knee") or {}).get(key)
    if p is base or a is None or not b:
        return "-" if p is not base else "1.00x"
    return f"{a / b:.2f}x"


def plot(points: list[dict], path: str, slo_tpot_ms: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_names = list(dict.fromkeys(p["axis"] for p in points))
    fig, axes = plt.subplots(2, len(axes_names), figsize=(5.5 * len(axes_names), 7.5), squeeze=False)
    for j, axis in enumerate(axes_names):
        group = [p for p in points if p["axis"] == axis and p.get("at_knee")]
        labels = [str(p["value"]) for p in group]
        x = np.arange(len(group))
        tps = [p["at_knee"]["tokens_per_s"] for p in group]
        rng = [p.get("tokens_per_s_range", [v, v]) for p, v in zip(group, tps)]
        yerr = [[v - r[0] for v, r in zip(tps, rng)], [r[1] - v for v, r in zip(tps, rng)]]
        top = axes[0][j]
        bars = top.bar(x, tps, yerr=yerr, capsize=4, color=["tab:gray" if p["mark"] else "tab:blue" for p in group])
        for b, p in zip(bars, group):
            if p["mark"]:
                top.annotate(p["mark"], (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom")
        from matplotlib.patches import Patch
        top.legend(handles=[Patch(color="tab:blue", label="at the knee"),
                            Patch(color="tab:gray", label="no knee: the last step")], fontsize=7)
        top.set_xticks(x, labels)
        top.set_xlabel(AXIS_TITLE[axis])
        top.set_ylabel("tokens/s at the knee")
        top.set_title(f"{AXIS_TITLE[axis]}: tokens/s at the knee\n(median, min-max of repeats; grey: no knee)",
                      fontsize=8)
        bot = axes[1][j]
        bot.plot(x, [p["at_knee"]["tpot_mean_ms"] for p in group], "o-", label="mean")
        bot.plot(x, [p["at_knee"]["tpot_p99_ms"] for p in group], "s--", label="p99")
        bot.axhline(slo_tpot_ms, color="r", lw=0.8, ls=":", label="TPOT SLO")
        bot.set_xticks(x, labels)
        bot.set_xlabel(AXIS_TITLE[axis])
        bot.set_ylabel("latency per decode step at the knee, ms")
        bot.set_yscale("log")
        bot.legend(fontsize=7)
    fig.suptitle("moe-bench load: each point a ramp to its knee")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
