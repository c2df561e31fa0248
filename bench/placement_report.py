"""The report of `moe-bench load --compare placement=...` (bench/placement_bench.py): one
table, the verdicts of issue 50's targets, and one plot.

The table: per scenario and arm, tokens/s at the knee (median of the repeats, their range)
against static under the same scenario and against the same arm under uniform routing,
p99 TPOT at the knee, balancedness at the knee (mean over the knee step's samples of the
lowest layer's), the physical experts serving at the end, moves done / abandoned, failed
requests and wrong answers over the whole run, p99 TPOT of the requests that overlapped a
move against the steady ones of the same steps, the gateway's own share of a round and
the EPLB run time.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from bench.experiments_report import _f, _knee_text

COLOURS = {"static": "tab:gray", "replicas": "tab:orange", "eplb": "tab:blue"}
TARGETS = {"uniform_ratio": 0.9, "static_ratio": 1.3, "during_ratio": 1.5, "share": 0.10, "drift": 0.9}


def load_meta(args) -> dict:
    return {"rate": args.rate, "ramp_start": args.ramp_start, "ramp_steps": args.ramp_steps,
            "step_duration": args.step_duration, "warmup": args.warmup, "concurrency": args.concurrency,
            "prefill": args.prefill, "decode": args.decode, "arrival": args.arrival, "backend": args.backend,
            "local_workers": args.local_workers, "worker_cpus": args.worker_cpus, "d_model": args.d_model,
            "d_ff": args.d_ff, "n_experts": args.n_experts, "top_k": args.top_k,
            "replicas": args.placement_replicas, "redundant_experts": args.redundant_experts,
            "eplb_interval": args.eplb_interval, "eplb_window": args.eplb_window,
            "eplb_max_moves": args.eplb_max_moves, "scenarios": args.scenario_list, "zipf_s": args.zipf_s,
            "hot_share": args.hot_share, "hot_expert": args.hot_expert, "drift_period": args.drift_period,
            "slo_tpot_ms": args.slo_tpot_ms, "balancing": args.balancing, "batching": args.batching,
            "max_inflight_rounds": args.max_inflight_rounds, "max_wait_ms": args.max_wait_ms, "seed": args.seed,
            "repeat": max(1, args.repeat), "preset": args.preset, "check_answers": args.check_answers,
            "placement_poll": args.placement_poll}


def _tps(p: dict) -> Optional[float]:
    return (p.get("at_knee") or {}).get("tokens_per_s")


def _find(points: list, scenario: str, arm: str) -> Optional[dict]:
    return next((p for p in points if p["scenario"] == scenario and p["value"] == arm), None)


def _ratio(a: Optional[dict], b: Optional[dict]) -> Optional[float]:
    x, y = (_tps(a) if a else None), (_tps(b) if b else None)
    return x / y if x and y else None


def _bound(a: dict, b: dict) -> str:
    """How a ratio of two knees reads when either ramp never saturated (a lower bound, ...)."""
    ma, mb = a.get("mark", ""), b.get("mark", "")
    if not ma and not mb:
        return ""
    return f" (top steps: {ma or 'knee'} / {mb or 'knee'})"


def verdicts(points: list[dict]) -> list[dict]:
    """Issue 50's targets where this run measured them: each {"target", "value", "limit", "met"}."""
    out = []

    def add(target: str, value, limit, met, note: str = "") -> None:
        out.append({"target": target, "value": value, "limit": limit, "met": met, "note": note})

    for sc in ("zipf", "hot"):
        e = _find(points, sc, "eplb")
        if e is None:
            continue
        u, s = _find(points, "uniform", "eplb"), _find(points, sc, "static")
        r = _ratio(e, u)
        if r is not None:
            add(f"{sc}: eplb's knee tokens/s vs eplb under uniform routing", r, TARGETS["uniform_ratio"],
                r >= TARGETS["uniform_ratio"], _bound(e, u))
        r = _ratio(e, s)
        if r is not None:
            add(f"{sc}: eplb's knee tokens/s vs static", r, TARGETS["static_ratio"], r >= TARGETS["static_ratio"],
                _bound(e, s))
    e = _find(points, "drift", "eplb")
    if e is not None and e["placement"].get("drift_back"):
        back, n = e["placement"]["drift_back"]
        add("drift: balancedness >= 0.9 two EPLB intervals after each shift (eplb)", f"{back}/{n}", "all",
            n > 0 and back == n)
    for p in points:
        pl, ans = p["placement"], p.get("answers") or {}
        add(f"{p['label']}: failed requests 0", pl["failed"], 0, pl["failed"] == 0)
        if p.get("answers"):
            add(f"{p['label']}: wrong answers 0 (of {ans['checked']} checked)", ans["wrong"], 0, ans["wrong"] == 0)
        if p["value"] == "eplb" and pl["during_moves_n"]:
            r = pl["during_over_steady"]
            add(f"{p['label']}: p99 TPOT during moves vs steady ({pl['during_moves_n']} requests during moves)",
                r, TARGETS["during_ratio"], r is not None and r <= TARGETS["during_ratio"])
        gs = p.get("gateway_share") or {}
        if p["value"] == "eplb" and gs.get("share") is not None:
            add(f"{p['label']}: the gateway's own share of a round at the knee (wall time of its stages)",
                gs["share"], TARGETS["share"], gs["share"] <= TARGETS["share"])
        if p["value"] == "eplb" and gs.get("cpu_share") is not None:
            add(f"{p['label']}: the gateway's own share of a round at the knee (its CPU time in them)",
                gs["cpu_share"], TARGETS["share"], gs["cpu_share"] <= TARGETS["share"])
    return out


def _row(p: dict, points: list) -> str:
    a, pl = p.get("at_knee"), p["placement"]
    ans = p.get("answers")
    wrong = "unchecked" if not ans else f"{ans['wrong']} ({ans['checked']})"
    moves = f"{pl['moves_done']} / {pl['moves_abandoned']}"
    dm = ("-" if not pl["during_moves_n"] else
          f"{_f(pl['during_moves_p99_ms'])} / {_f(pl['steady_p99_ms'])} ({pl['during_moves_n']})")
    gs = p.get("gateway_share") or {}
    share = "-" if gs.get("share") is None else f"{100 * gs['share']:.1f}% ({_f(gs['own_ms'], '{:.3f}')} ms)"
    if gs.get("cpu_share") is not None:
        share += f"; CPU {100 * gs['cpu_share']:.1f}%"
    run = "-" if pl["eplb_run_median_s"] is None else \
        f"{1e3 * pl['eplb_run_median_s']:.1f} / {1e3 * (pl['eplb_run_max_s'] or 0):.1f}"
    base = f"| {p['scenario']} | {p['value']} | {_f(pl['physical'], '{:.0f}')} |"
    if a is None:
        return base + f" - | - | - | - | - | - | {moves} | {pl['failed']} / {wrong} | {dm} | {share} | {run} |"
    lo, hi = p.get("tokens_per_s_range", [a["tokens_per_s"]] * 2)
    spread = f" ({lo:.0f}-{hi:.0f})" if hi > lo else ""
    knees = " / ".join(_knee_text(k) for k in p.get("knees", [p.get("knee")]))
    vs_static = _ratio(p, _find(points, p["scenario"], "static"))
    vs_uniform = _ratio(p, _find(points, "uniform", p["value"])) if p["scenario"] != "uniform" else None
    p99 = _f(a["tpot_p99_ms"]) + ("" if a.get("tpot_p99_reliable") else "*")
    return (base + f" {knees} | {p['mark']}{a['tokens_per_s']:.0f}{spread} | {_f(vs_static, '{:.2f}x')} | "
                   f"{_f(vs_uniform, '{:.2f}x')} | {p99} | {_f(pl['balancedness_at_knee'], '{:.3f}')} | {moves} | "
                   f"{pl['failed']} / {wrong} | {dm} | {share} | {run} |")


HEAD = ("| scenario | arm | physical experts | knee req/s | tokens/s at the knee | vs static | vs the arm under "
        "uniform | p99 TPOT ms | balancedness at the knee | moves done / abandoned | failed / wrong (checked) | "
        "p99 TPOT ms during moves / steady (n) | gateway's share of a round | EPLB run ms median / max |")
SEP = "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"


def markdown(args, prov: dict, points: list[dict], verdicts_: list[dict]) -> str:
    m = load_meta(args)
    commit = prov.get("commit")
    dirty = " (local changes)" if prov.get("dirty") else ""
    commit = "not a git checkout" if not commit else f"commit {commit[:12]}{dirty}"
    cpus = ",".join(map(str, m["worker_cpus"])) if m["worker_cpus"] else "not pinned"
    preset = f" (preset {m['preset']}: DeepSeek-V3's routing shape, a tiny layer)" if m["preset"] else ""
    lines = ["### moe-bench load --compare placement: each arm a ramp to its knee", "",
             f"moe-transport {prov.get('version')} · {commit} · {prov.get('date_utc')}", "",
             f"- command: `{prov.get('command')}`",
             f"- host: {prov.get('host')} · {prov.get('cpu_model')} x{prov.get('cpus')} · load average at start "
             f"{prov.get('loadavg_at_start')} · {prov.get('python')}",
             f"- each arm: a gateway started here on {(m['backend'] or ['shm'])[0]} with {m['local_workers']} local "
             f"workers (CPUs {cpus}), {m['n_experts']} experts top-{m['top_k']}, d_model {m['d_model']}, d_ff "
             f"{m['d_ff']}{preset}, "
             f"balancing {m['balancing']}, {m['max_inflight_rounds']} rounds in flight; static: one copy of each "
             f"expert in blocks; replicas: {m['replicas']} copies of each; eplb: one copy each to start and "
             f"{m['redundant_experts']} redundant, placed by the load over a {m['eplb_window']:g} s window every "
             f"{m['eplb_interval']:g} s (at most {m['eplb_max_moves'] or 8} copies a move)",
             f"- load: {m['concurrency']} clients, requests of {m['prefill']} prefill + {m['decode']} decode tokens, "
             f"{m['arrival']} arrivals; ramp of {m['ramp_steps']} steps up to {m['rate']:g} req/s, "
             f"{m['step_duration'] or 'duration/steps'} s each after {m['warmup']:g} s of warm-up; knee: the highest "
             f"rate with p99 TPOT <= {m['slo_tpot_ms']:g} ms, no queue growth and no failed request",
             f"- routing: zipf s={m['zipf_s']:g}; hot: expert {m['hot_expert']} takes {100 * m['hot_share']:.0f}% of "
             f"first choices; drift: the zipf ranking moves one expert every {m['drift_period']:g} s",
             "- balancedness: the gateway's (mean / max worker load over its window), polled every "
             f"{m['placement_poll']:g} s; moves: placement changes the gateway carried out; failed: requests "
             "that failed over the whole run (warm-up and saturated steps too); wrong: answers that differ from "
             "the reference layer (" + ("every answer kept and checked after the run" if m["check_answers"] else
                                        "not checked: " + str(getattr(args, "answers_unchecked", "off"))) + ")",
             "- during moves: requests whose decode overlapped a move, against the other requests of the same "
             "ramp steps (within the SLO); gateway's share: route + dispatch (plan, gather, send) + combine + EPLB "
             "runs spread over the rounds, over the round's wall time, at the knee step (wall time of those stages; "
             "CPU: the gateway thread's CPU time in them, without the time workers on its cores took)",
             (f"- every arm measured {m['repeat']} times, interleaved (A B C A B C ...): knees of each repeat, "
              "figures the median, tokens/s (min-max)" if m["repeat"] > 1 else
              "- every arm measured once (--repeat N for several, interleaved)"),
             "", HEAD, SEP]
    lines += [_row(p, points) for p in points]
    lines += ["", "`>=`: no step saturated (the top step, a lower bound); `<`: the first step already had; "
                  "`*`: a p99 from fewer than 100 samples"]
    drift = [p for p in points if p["placement"].get("drift_back")]
    if drift:
        lines += ["", "**drift**: shifts after which balancedness was >= 0.9 two EPLB intervals later: " +
                  "; ".join(f"{p['value']} {p['placement']['drift_back'][0]}/{p['placement']['drift_back'][1]}"
                            for p in drift)]
    lines += ["", "**targets** (issue 50; a benchmark on a shared machine, not a test)", ""]
    for v in verdicts_:
        val = v["value"] if isinstance(v["value"], str) else _f(v["value"], "{:.3g}")
        mark = "met" if v["met"] else "MISSED"
        lines.append(f"- [{mark}] {v['target']}: {val} (target {v['limit']}){v.get('note', '')}")
    lines += ["", "<details><summary>every ramp step</summary>", "",
              "| point | step | target req/s | req/s | tokens/s | TPOT ms mean / p99 | verdict |",
              "|---|---|---|---|---|---|---|"]
    for p in points:
        for r in p.get("records", []):
            t = r["tpot_ms"]
            lines.append(f"| {p['label']} #{r.get('trial', 0) + 1} | {r.get('step', 0) + 1} | "
                         f"{r['target_rate']:.2f} | {r['request_throughput']:.2f} | {r['tokens_per_s']:.0f} | "
                         f"{_f(t['mean'])} / {_f(t['p99'])} | {r['verdict']} |")
    lines += ["", "</details>"]
    return "\n".join(lines)


def plot(points: list[dict], path: str, args) -> None:
    """Top: tokens/s at the knee and p99 TPOT per arm, grouped by scenario. Below, one panel
    per scenario: balancedness over time per arm (the first repeat), its moves marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = list(dict.fromkeys(p["scenario"] for p in points))
    arms = list(dict.fromkeys(p["value"] for p in points))
    fig = plt.figure(figsize=(max(10, 4.5 * len(scen)), 8.5))
    gs = fig.add_gridspec(2, max(2, len(scen)))
    ax_t = fig.add_subplot(gs[0, :max(1, len(scen) // 2)])
    ax_l = fig.add_subplot(gs[0, max(1, len(scen) // 2):])
    w = 0.8 / max(1, len(arms))
    for j, arm in enumerate(arms):
        xs = np.arange(len(scen)) + (j - (len(arms) - 1) / 2) * w
        ps = [_find(points, sc, arm) for sc in scen]
        tps = [_tps(p) or 0.0 for p in ps]
        rng = [p.get("tokens_per_s_range", [v, v]) if p else [0, 0] for p, v in zip(ps, tps)]
        ax_t.bar(xs, tps, w, yerr=[[v - r[0] for v, r in zip(tps, rng)], [r[1] - v for v, r in zip(tps, rng)]],
                 capsize=3, color=COLOURS.get(arm), label=arm)
        p99 = [((p or {}).get("at_knee") or {}).get("tpot_p99_ms") or 0.0 for p in ps]
        ax_l.bar(xs, p99, w, color=COLOURS.get(arm), label=arm)
    for ax, what in ((ax_t, "tokens/s at the knee"), (ax_l, "p99 TPOT at the knee, ms")):
        ax.set_xticks(np.arange(len(scen)), scen)
        ax.set_ylabel(what)
        ax.legend(fontsize=7)
    ax_l.axhline(args.slo_tpot_ms, color="r", lw=0.8, ls=":")
    for i, sc in enumerate(scen):
        ax = fig.add_subplot(gs[1, i])
        for arm in arms:
            p = _find(points, sc, arm)
            tl = ((p or {}).get("trials") or [{}])[0].get("timeline") or {}
            ss = [s for s in tl.get("samples", []) if s.get("min_balancedness") is not None]
            if not ss:
                continue
            ax.plot([s["t"] for s in ss], [s["min_balancedness"] for s in ss], color=COLOURS.get(arm), lw=1,
                    label=arm)
            for m in tl.get("moves", []):
                ax.axvline(m["t_start"], color=COLOURS.get(arm), lw=0.6, ls="--" if m["state"] == "done" else ":",
                           alpha=0.7)
        if sc == "drift":  # the ranking shifts here
            for k in range(1, int(ax.get_xlim()[1] // args.drift_period) + 1):
                ax.axvline(k * args.drift_period, color="k", lw=0.5, alpha=0.4)
        ax.axhline(0.9, color="k", lw=0.5, ls=":")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{sc}: balancedness (dashed: a move{'; grey: a shift' if sc == 'drift' else ''})", fontsize=8)
        ax.set_xlabel("seconds into the run (warm-up included)")
        ax.legend(fontsize=7)
    fig.suptitle(f"moe-bench load --compare placement={','.join(arms)}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
