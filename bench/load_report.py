"""`moe-bench load`'s report: the markdown summary and the plots (matplotlib).

One figure, four panels: latency against throughput per system (ramp) or latency CDFs per
system (fixed-rate, mixed); each expert's share of the rows over time; the LRU expert-cache
hit rate against the number of resident experts; CPU cores per process.
"""
from __future__ import annotations

import os

import numpy as np

PCTS = ("p50", "p95", "p99", "p999")


def _q(d: dict) -> str:
    return " / ".join("-" if d.get(k) is None or d.get(k) != d.get(k) else f"{d[k]:.1f}" for k in PCTS)


def _name(r: dict) -> str:
    return r["system"] if r["system"] != "moe-transport" else f"moe-transport/{r['backend']}"


def markdown(runs: list[dict], ratios: list[dict], targets: list[dict], models: dict, scenario, args) -> str:
    lines = [f"### moe-bench load: {args.mode}, {args.concurrency} clients, {args.prefill}+{args.decode} "
             f"tokens/request, routing {scenario.describe()}", "",
             "| system | step | target req/s | achieved req/s | tokens/s | goodput req/s | TTFT ms p50/p95/p99/p99.9 "
             "| TPOT ms p50/p95/p99/p99.9 | e2e ms p50/p95/p99/p99.9 | queue p99 ms | n | err | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        if run.get("error"):
            lines.append(f"| {_name(run)} | - | - | - | - | - | - | - | - | - | - | - | could not run: {run['error']} |")
        for i, r in enumerate(run["records"]):
            lines.append(f"| {_name(run)} | {r.get('step', i) + 1} | {r['target_rate']:.2f} | {r['achieved_rate']:.2f} | "
                         f"{r['tokens_per_s']:.0f} | {r['goodput_rps']:.2f} | {_q(r['ttft_ms'])} | {_q(r['tpot_ms'])} | "
                         f"{_q(r['e2e_ms'])} | {r['queue_ms']['p99']:.1f} | {r['completed']} | {r['errors']} | "
                         f"{r['verdict']} |")
    if args.mode == "ramp":
        lines += ["", f"knee (highest rate with p99 TPOT <= {args.slo_tpot_ms:g} ms and no queue growth): " +
                  ", ".join(f"{_name(r)} {r['knee']:g} req/s" if r["knee"] is not None else f"{_name(r)} none"
                            for r in runs if r["records"])]
    lines += ["", "| system | CPU cores per process (last step) | per-round stage ms (route / dispatch / compute / "
              "wait / combine) | dropped |", "|---|---|---|---|"]
    for run in runs:
        if not run["records"]:
            continue
        r = run["records"][-1]
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r.get("cpu_cores", {}).items())) or "-"
        st = r.get("stage_ms") or {}
        stages = " / ".join(f"{st.get(k, 0):.2f}" for k in ("route", "dispatch", "compute", "wait", "combine")) \
            if st else "-"
        lines.append(f"| {_name(run)} | {cpu} | {stages} | {r['dropped']} |")
    if ratios:
        lines += ["", "| ours | peer | at req/s | tokens/s ratio | p99 TPOT lower by | p99 TTFT lower by "
                  "| knees (ours, peer) | tokens/s at knee ratio |", "|---|---|---|---|---|---|---|---|"]
        for x in ratios:
            def f(k):
                v = x.get(k)
                return "-" if v is None else f"{v:.2f}x"
            knee = x.get("knee_rate")
            knee = "-" if knee is None else " / ".join("none" if k is None else f"{k:g}" for k in knee)
            at_knee = "peer saturated everywhere" if x.get("peer_saturated_at_every_step") else f("tokens_per_s_at_knee")
            lines.append(f"| {x['ours']} | {x['peer']} | {x.get('at_rate', '-')} | {f('tokens_per_s')} | "
                         f"{f('p99_tpot_lower_by')} | {f('p99_ttft_lower_by')} | {knee} | {at_knee} |")
    for t in targets:
        lines.append(f"- [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']:.2f} (target >= {t['limit']:g})")
    cv, lru, load = models["comm_volume"], models["lru_hit_rate"], models["expert_load"]
    lines += ["", f"**routing**: expert share of rows {', '.join(f'{100 * s:.0f}%' for s in load['share'])}; "
                  f"dropped {load['dropped']}, overflowed {load['overflow']} assignments",
              f"**all-to-all volume (model)**: {cv['total_bytes'] / 1e6:.1f} MB "
              f"({cv.get('bytes_per_token', 0) / 1e3:.1f} kB/token, {cv.get('gbps', 0):.3f} GB/s)"
              + (f"; the transport counted {cv['transport_bytes_measured'] / 1e6:.1f} MB "
                 f"({cv['measured_over_model']:.3f}x the model)" if cv.get("measured_over_model") else ""),
              "**LRU expert cache hit rate** by resident experts: "
              + ", ".join(f"{c + 1}: {100 * h:.0f}%" for c, h in enumerate(lru))]
    return "\n".join(lines)


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
            line, = ax.plot(tps, [r["tpot_ms"]["p99"] for r in recs], "o-", label=f"{_name(run)} TPOT p99")
            ax.plot(tps, [r["tpot_ms"]["p50"] for r in recs], "s--", color=line.get_color(), alpha=0.6,
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
                    ax.plot(v, np.arange(1, len(v) + 1) / len(v), style, label=f"{_name(run)} {key}")
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
    ax.plot(range(1, len(lru) + 1), [100 * h for h in lru], "o-")
    ax.set_xlabel("resident experts (LRU)")
    ax.set_ylabel("hit rate %")
    ax.set_ylim(0, 100)
    ax.set_title("expert cache simulation")

    ax = axes[1][1]
    labels, values = [], []
    for run in runs:
        for proc, v in sorted(run["records"][-1].get("cpu_cores", {}).items()):
            labels.append(f"{_name(run)}\n{proc}")
            values.append(v)
    ax.bar(range(len(values)), values)
    ax.set_xticks(range(len(values)), labels, fontsize=5, rotation=90)
    ax.set_ylabel("CPU cores (last step)")
    ax.set_title("CPU per process")
    fig.suptitle(f"moe-bench load ({mode})")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


