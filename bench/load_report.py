"""`moe-bench load`'s report: the markdown summary (stdout) and the plots (matplotlib).

The summary: a settings header (provenance, layer, gateway, arrivals, SLOs), one table
row per system and step, the knee of a ramp (or "knee not reached (>= X req/s)"), and for
each system a result block worded as vLLM's benchmark_serving prints it ("Successful
requests", "Benchmark duration (s)", "Request throughput (req/s)", percentiles of TTFT,
TPOT, ITL and E2EL, ...). Percentiles the sample count cannot support are marked with
``*`` and a footnote (p99 needs 100 samples, p99.9 1000).

One figure, four panels: latency against throughput per system (ramp) or latency CDFs per
system (fixed-rate, mixed); each expert's share of the rows over time; the LRU expert-cache
hit rate against the number of resident experts; CPU cores per process.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from bench.plotstyle import colour
from bench.stats import MARK, footnote

PCTS = ("p50", "p95", "p99", "p999")
PCT_VALUE = {"p50": 50.0, "p95": 95.0, "p99": 99.0, "p999": 99.9}
PCT_LABEL = {"p50": "P50", "p95": "P95", "p99": "P99", "p999": "P99.9"}
W = 50  # vLLM's block width


def _num(v) -> bool:
    return v is not None and v == v


def _cell(d: dict, k: str, marks: list) -> str:
    v = d.get(k)
    if not _num(v):
        return "-"
    ok = d.get("reliable", {}).get(k, True)
    if not ok:
        marks.append(k)
    return f"{v:.1f}{'' if ok else MARK}"


def _q(d: dict, marks: list) -> str:
    return " / ".join(_cell(d, k, marks) for k in PCTS)


def _name(r: dict) -> str:
    return r["system"] if r["system"] != "moe-transport" else f"moe-transport/{r['backend']}"


def arrival_text(args) -> str:
    if args.arrival == "constant":
        return "constant arrivals (every 1/rate s)"
    if args.arrival == "poisson":
        return "Poisson arrivals (burstiness 1, gaps' CV 1)"
    b, cv = args.burstiness, args.arrival_cv
    how = "a Poisson process" if b == 1 else ("burstier than Poisson" if b < 1 else "more regular than Poisson")
    return f"gamma arrivals (burstiness {b:g}, gaps' CV {cv:.2f}: {how})"


def _header(args, prov: dict, meta: dict) -> list[str]:
    commit = prov.get("commit")
    commit = "not a git checkout" if not commit else f"commit {commit[:12]}{' (local changes)' if prov.get('dirty') else ''}"
    lay = meta["layer"]
    gw = meta.get("gateway_config") or {}
    if args.gateway:
        where = (f"the running gateway {args.gateway} ({len(gw.get('workers', []))} workers; max batch "
                 f"{gw.get('max_batch_tokens')} tokens, max wait {gw.get('max_wait_ms')} ms, "
                 f"{gw.get('max_inflight_rounds')} rounds in flight), configuration from its pong")
    else:
        where = (f"started here per backend with {args.local_workers} local workers (max batch "
                 f"{gw.get('max_batch_tokens') or args.max_batch_tokens or max(256, args.concurrency * args.prefill)} tokens, max wait {args.max_wait_ms:g} ms, "
                 f"{args.max_inflight_rounds} rounds in flight)")
    cap = f", capacity factor {lay['capacity_factor']:g}" if lay.get("capacity_factor") else ""
    pol = meta.get("gateway_policies") or {}
    if pol.get("batching"):
        where += (f"; batching {pol['batching']}, balancing {pol['balancing']}, {pol['replicas']} "
                  f"cop{'y' if pol['replicas'] == 1 else 'ies'} of each expert, overflow {pol['overflow']}"
                  + (f", noisy top-k (noise std {pol['noise_std']:g})" if pol.get("noisy") else "")
                  + (f", gate bias {pol['gate_bias']}" if pol.get("gate_bias") else ""))
    return [f"moe-transport {prov.get('version')} · {commit} · {prov.get('date_utc')}",
            "",
            f"- command: `{prov.get('command')}`",
            f"- host: {prov.get('host')} · kernel {prov.get('kernel')} · {prov.get('cpu_model')} x{prov.get('cpus')} · "
            f"load average at start {prov.get('loadavg_at_start')} · {prov.get('python')}, numpy {prov.get('numpy')}",
            f"- layer: {lay['n_experts']} experts, top-{lay['top_k']}{cap}, d_model {lay['d_model']}, "
            f"d_ff {'unknown' if lay['d_ff'] is None else lay['d_ff']} "
            f"[d_ff from: {lay['d_ff_source']}], {lay['dtype']}",
            f"- gateway: {where}",
            f"- load: {arrival_text(args)}; warm-up {args.warmup:g} s (not recorded); {args.concurrency} client threads "
            f"(maximum request concurrency); SLOs TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms "
            f"(goodput: requests within both)",
            "- rates: every rate of a row is over its benchmark duration (first scheduled arrival to the end of the "
            "last request); tokens/s counts the rows through the MoE layer (prefill + decode tokens)"]


def result_block(r: dict, args, system: str, where: str, marks: list) -> list[str]:
    """One segment as vLLM's benchmark_serving prints its result (same wording), headed
    by the system and (ramp) which step it is."""
    out = [f"{' Serving Benchmark Result ':=^{W}}"]

    def line(label: str, v, fmt: str = "{:<10.2f}") -> None:
        out.append("{:<40} ".format(label) + (fmt.format(v) if _num(v) else "-").rstrip())

    line("System:", system, "{}")
    if where:
        line("Segment:", where, "{}")

    line("Successful requests:", r["completed"], "{:<10}")
    line("Failed requests:", r["failed"], "{:<10}")
    line("Maximum request concurrency:", args.concurrency, "{:<10}")
    line("Request rate configured (RPS):", r["target_rate"])
    line("Benchmark duration (s):", r["duration_s"])
    line("Total input tokens:", r["total_input_tokens"], "{:<10}")
    line("Total generated tokens:", r["total_output_tokens"], "{:<10}")
    line("Request throughput (req/s):", r["request_throughput"])
    line("Request goodput (req/s):", r["request_goodput"])
    line("Output token throughput (tok/s):", r["output_throughput"])
    line("Total token throughput (tok/s):", r["total_token_throughput"])
    line("MoE layer throughput (tok/s):", r["tokens_per_s"])
    for key, name, head in (("ttft_ms", "TTFT", "Time to First Token"),
                            ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
                            ("itl_ms", "ITL", "Inter-token Latency"),
                            ("e2e_ms", "E2EL", "End-to-end Latency")):
        d = r[key]
        out.append(f"{head:-^{W}}")
        line(f"Mean {name} (ms):", d.get("mean"))
        line(f"Median {name} (ms):", d.get("p50"))
        for k in ("p95", "p99", "p999"):
            ok = d.get("reliable", {}).get(k, True) or not _num(d.get(k))  # nothing to mark on "-"
            if not ok:
                marks.append(k)
            line(f"{PCT_LABEL[k]} {name} (ms){'' if ok else MARK}:", d.get(k))
        line(f"Samples ({name}):", d.get("samples", d.get("n")), "{:<10}")
    out.append("=" * W)
    if r.get("first_error"):
        out.append(f"first failure: {r['first_error'][:200]}")
    return out


def _block_record(run: dict, mode: str):
    """Which segment of a run gets the result block: the only one, or (ramp) the knee step,
    else the top step within the SLO, else the first."""
    recs = run["records"]
    if not recs:
        return None, ""
    if mode != "ramp":
        return recs[-1], ""
    knee = run.get("knee") or {}
    if knee.get("reached"):
        r = next(x for x in recs if x["target_rate"] == knee["rate"])
        return r, f"at the knee, step {r['step'] + 1} @ {r['target_rate']:g} req/s"
    ok = [x for x in recs if not x["saturated"]]
    if ok:
        r = ok[-1]
        return r, f"top step {r['step'] + 1} @ {r['target_rate']:g} req/s, knee not reached"
    r = recs[0]
    return r, f"first step @ {r['target_rate']:g} req/s, already saturated"


def markdown(runs: list[dict], ratios: list[dict], targets: list[dict], models: dict, scenario, args,
             prov: dict, meta: dict) -> str:
    marks: list = []
    lines = [f"### moe-bench load: {args.mode}, {args.concurrency} clients, {args.prefill}+{args.decode} "
             f"tokens/request, routing {scenario.describe()}", ""]
    lines += _header(args, prov, meta)
    lines += ["", "| system | step | target req/s | successful | failed | duration s | req/s | goodput req/s "
              "| tokens/s | TTFT ms p50/p95/p99/p99.9 | TPOT ms p50/p95/p99/p99.9 | E2EL ms p50/p95/p99/p99.9 "
              "| queue p99 ms | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        if run.get("error"):
            lines.append(f"| {_name(run)} | - | - | - | - | - | - | - | - | - | - | - | - | could not run: "
                         f"{run['error']} |")
        for i, r in enumerate(run["records"]):
            lines.append(f"| {_name(run)} | {r.get('step', i) + 1} | {r['target_rate']:.2f} | {r['completed']} | "
                         f"{r['failed']} | {r['duration_s']:.2f} | {r['request_throughput']:.2f} | "
                         f"{r['request_goodput']:.2f} | {r['tokens_per_s']:.0f} | {_q(r['ttft_ms'], marks)} | "
                         f"{_q(r['tpot_ms'], marks)} | {_q(r['e2e_ms'], marks)} | {_cell(r['queue_ms'], 'p99', marks)} | "
                         f"{r['verdict']} |")
    if args.mode == "ramp":
        lines += [""] + [f"**{_name(r)}**: {(r.get('knee') or {}).get('text', 'no step measured')} (knee: the highest "
                         f"rate with p99 TPOT <= {args.slo_tpot_ms:g} ms, no queue growth and no failed request)"
                         for r in runs if r["records"]]
    blocks = []
    for run in runs:
        r, where = _block_record(run, args.mode)
        if r is None:
            continue
        blocks += result_block(r, args, _name(run), where, marks) + [""]
    if blocks:
        lines += ["", "```text"] + blocks[:-1] + ["```"]
    if marks:
        lines += ["", footnote({PCT_LABEL[k].lower(): PCT_VALUE[k] for k in PCTS if k in marks})]
    lines += ["", "| system | CPU cores per process (last step) | per-round stage ms (route / dispatch / compute / "
              "wait / combine / busiest worker with no token) | dropped |", "|---|---|---|---|"]
    for run in runs:
        if not run["records"]:
            continue
        r = run["records"][-1]
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r.get("cpu_cores", {}).items())) or "-"
        st = r.get("stage_ms") or {}
        stages = " / ".join(f"{st.get(k, 0):.2f}" for k in ("route", "dispatch", "compute", "wait", "combine",
                                                             "no_token")) if st else "-"
        lines.append(f"| {_name(run)} | {cpu} | {stages} | {r.get('dropped', '-')} |")
    if ratios:
        lines += ["", "| ours | peer | at req/s | tokens/s ratio (higher is better) | p99 TPOT lower by "
                  "| p99 TTFT lower by | knees (ours; peer) | tokens/s at knee ratio |",
                  "|---|---|---|---|---|---|---|---|"]
        for x in ratios:
            def f(k):
                v = x.get(k)
                return "-" if v is None else f"{v:.2f}x"
            knee = x.get("knee")
            knee = "-" if knee is None else "; ".join(k or "-" for k in knee)
            if x.get("peer_saturated_at_every_step"):
                at_knee = "peer saturated everywhere"
            elif "tokens_per_s_at_knee" in x:
                at_knee = f("tokens_per_s_at_knee")
            elif "tokens_per_s_at_knee_at_least" in x:
                at_knee = f">= {f('tokens_per_s_at_knee_at_least')} (ours: knee not reached)"
            elif "tokens_per_s_at_knee_at_most" in x:
                at_knee = f"<= {f('tokens_per_s_at_knee_at_most')} (peer: knee not reached)"
            elif "tokens_per_s_top_steps" in x:
                at_knee = f"{f('tokens_per_s_top_steps')} at the top steps (no knee reached)"
            else:
                at_knee = "-"
            lines.append(f"| {x['ours']} | {x['peer']} | {x.get('at_rate', '-')} | {f('tokens_per_s')} | "
                         f"{f('p99_tpot_lower_by')} | {f('p99_ttft_lower_by')} | {knee} | {at_knee} |")
    for t in targets:
        lines.append(f"- [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']:.2f} (target >= {t['limit']:g})")
    cv, lru, load = models["comm_volume"], models["lru_hit_rate"], models["expert_load"]
    if models.get("from_system") is None:
        lines += ["", "**routing**: no request completed; no routing trace to model"]
        return "\n".join(lines)
    gr = models.get("gateway_routing")
    if gr and gr.get("max_over_mean") is not None:
        lines += ["", f"**routing as the gateway did it** (its own counters: rows dispatched per expert"
                      f"{', its noise included' if models.get('noisy_replay') else ''}): expert share of rows "
                      f"{', '.join(f'{100 * s:.0f}%' for s in gr['share'])}; busiest expert "
                      f"{gr['max_over_mean']:.2f}x the mean; dropped {gr['dropped']}, over capacity "
                      f"{gr['overflow']} assignments"]
    elif gr:
        lines += ["", "**routing as the gateway did it**: no rows sent"]
    replayed = "routed again with a fresh noise stream (the same distribution, not the gateway's draws)" \
        if models.get("noisy_replay") else "routed again"
    lines += ["", f"**routing model** ({models['from_system']}'s completed requests, {replayed}; feeds the models "
                  f"below): expert share of rows "
                  f"{', '.join(f'{100 * s:.0f}%' for s in load['share'])}; "
                  f"dropped {load['dropped']}, overflowed {load['overflow']} assignments",
              f"**all-to-all volume (model)**: {cv['total_bytes'] / 1e6:.1f} MB "
              f"({cv.get('bytes_per_token', 0) / 1e3:.1f} kB/token, {cv.get('gbps', 0):.3f} GB/s)"
              + (f"; the transport counted {cv['transport_bytes_measured'] / 1e6:.1f} MB "
                 f"({cv['measured_over_model']:.3f}x the model)" if cv.get("measured_over_model") else ""),
              "**LRU expert cache hit rate** by resident experts: "
              + ", ".join(f"{c + 1}: {100 * h:.0f}%" for c, h in enumerate(lru))]
    return "\n".join(lines)


# -- ours against each peer -------------------------------------------------------------
def ratios(runs: list[dict], mode: str) -> list[dict]:
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
                ka, kb = at_knee(o), at_knee(p)
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


def at_knee(run: dict) -> Optional[dict]:
    """The run's busiest step within the SLO (None: every step saturated)."""
    ok = [r for r in run["records"] if not r["saturated"]]
    return max(ok, key=lambda r: r["tokens_per_s"]) if ok else None


def targets(ratios: list[dict], mode: str) -> list[dict]:
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


def plot(runs: list[dict], models: dict, path: str, mode: str, slo_tpot_ms: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    ax = axes[0][0]
    if mode == "ramp":
        for run in runs:
            recs = run["records"]
            tps = [r["tokens_per_s"] for r in recs]
            c = colour(run["system"])
            ax.plot(tps, [r["tpot_ms"]["p99"] for r in recs], "o-", color=c, label=f"{_name(run)} TPOT p99")
            ax.plot(tps, [r["tpot_ms"]["p50"] for r in recs], "s--", color=c, alpha=0.6,
                    label=f"{_name(run)} TPOT p50")
        ax.axhline(slo_tpot_ms, color="r", lw=0.8, ls=":", label="TPOT SLO")
        ax.set_xlabel("tokens/s")
        ax.set_ylabel("TPOT ms")
        ax.set_title("latency vs throughput (each point a ramp step)")
    else:
        for run in runs:
            done = [d for seg in run["done"] for d in seg if d.error is None]
            for key, style in (("TPOT", "-"), ("TTFT", "--")):
                v = [1e3 * float(np.mean(d.steps)) for d in done if d.steps] if key == "TPOT" else \
                    [1e3 * (d.first - d.sched) for d in done]
                if v:
                    v = np.sort(v)
                    ax.plot(v, np.arange(1, len(v) + 1) / len(v), style, color=colour(run["system"]),
                            label=f"{_name(run)} {key}")
        ax.set_xlabel("latency ms")
        ax.set_ylabel("CDF")
        ax.set_title("latency CDF")
    ax.set_xscale("log")
    ax.set_yscale("log" if mode == "ramp" else "linear")
    ax.legend(fontsize=6)

    ax = axes[0][1]
    load = models["expert_load"]
    if load["bins"]:
        b = np.asarray(load["bins"])
        share = b / np.maximum(b.sum(axis=1, keepdims=True), 1)
        ax.stackplot(load["bins_t"], share.T, labels=[f"expert {e}" for e in range(share.shape[1])])
        ax.set_ylim(0, 1)
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("share of rows")
    ax.set_title("per-expert load over time")
    ax.legend(fontsize=6, loc="upper right", ncol=2)

    ax = axes[1][0]
    lru = models["lru_hit_rate"]
    ax.plot(range(1, len(lru) + 1), [100 * h for h in lru], "o-", color="k",
            label=f"LRU over {models.get('from_system') or 'the recorded passes'}")
    ax.legend(fontsize=6, loc="lower right")
    ax.set_xlabel("resident experts (LRU)")
    ax.set_ylabel("hit rate %")
    ax.set_ylim(0, 100)
    ax.set_title("expert cache simulation")

    ax = axes[1][1]
    labels, values, colours = [], [], []
    for run in runs:
        for proc, v in sorted(run["records"][-1].get("cpu_cores", {}).items()):
            labels.append(f"{_name(run)}\n{proc}")
            values.append(v)
            colours.append(colour(run["system"]))
    ax.bar(range(len(values)), values, color=colours)
    for run in runs:  # a legend entry per system, in its colour
        ax.bar([0], [0], color=colour(run["system"]), label=_name(run))
    if runs:
        ax.legend(fontsize=6)
    ax.set_xticks(range(len(values)), labels, fontsize=5, rotation=90)
    ax.set_ylabel("CPU cores (last step)")
    ax.set_title("CPU per process")
    fig.suptitle(f"moe-bench load ({mode})")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


