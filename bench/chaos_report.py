"""The report of `moe-bench chaos` (bench/chaos.py): a table of every configuration, each
one's details and targets, and a timeline plot of answers per second with the kills and
stops shaded."""
from __future__ import annotations

import sys
from typing import Optional

from bench.chaos_settings import D_FF, D_MODEL, N_EXPERTS, TOP_K, log
from bench.chaos_eplb import report_lines as eplb_report_lines


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def print_report(doc: dict, out=None) -> None:
    out = out or sys.stdout
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("moe-bench chaos: SIGKILL/SIGSTOP of workers, client churn, hostile background; every answer "
      "checked against the reference")
    s = doc["settings"]
    p(f"  layer d_model={D_MODEL} d_ff={D_FF} experts={N_EXPERTS} top_k={TOP_K}; {s['clients']} steady clients + "
      f"churn; deadline {s['deadline']:.0f} s; worker timeout {s['worker_timeout']:.0f} s; gateway cap "
      f"{s['max_connections']} connections, idle timeout {s['idle_timeout']:.0f} s, handshake deadline 5 s")
    p(f"  background during chaos: {s['bg']}; p99 crowd: {s['hostile_idle']} idle + {s['hostile_half']} half-open")
    p("")
    hdr = (f"{'config':<26} {'dur':>5} {'sent':>7} {'ok':>7} {'failed':>6} {'unexp':>5} {'wrong':>5} "
           f"{'lost':>4} {'dup':>3} {'kills':>5} {'stops':>5} {'rec med':>7} {'rec max':>7} "
           f"{'p99 ms':>7} {'+crowd':>7} {'ratio':>5}")
    p(hdr)
    p("-" * len(hdr))
    for r in doc["configs"]:
        if "error" in r:
            p(f"{r['name']:<26} ERROR {r['error']}")
            continue
        q, rec, pp = r["requests"], r["recovery_s"], r["p99"]
        name = f"{r['backend']} r{r['replicas']} {r['workers']}"
        p(f"{name:<26} {r['chaos_s']:>5.0f} {q['sent']:>7} {q['ok']:>7} {q['failed']:>6} "
          f"{q['unexpected_failures']:>5} {q['wrong']:>5} {q['lost']:>4} {q['duplicated']:>3} {rec['kills']:>5} "
          f"{rec['stops']:>5} {_ms(rec['kill_median']):>7} {_ms(rec['kill_max']):>7} "
          f"{(pp['alone_p99_ms'] or 0):>7.1f} {(pp['crowded_p99_ms'] or 0):>7.1f} {(pp['ratio'] or 0):>5.2f}")
    p("")
    p("  rec med/max: ms from a killed worker's return (restart printed LISTENING / respawn seen) to the service "
      "whole again (unreplicated: a request needing only its experts answered; replicated: reported healthy)")
    p("")
    for r in doc["configs"]:
        if "error" in r:
            continue
        name = f"{r['backend']} r{r['replicas']} {r['workers']}"
        pp = r["p99"]
        p(f"{name}: good client alone p50/p99 {pp['alone_p50_ms']:.1f}/{pp['alone_p99_ms']:.1f} ms, with the crowd "
          f"{pp['crowded_p50_ms']:.1f}/{pp['crowded_p99_ms']:.1f} ms (crowd open at start {pp['crowd_open_at_start']})")
        p(f"    failed by code {r['requests']['failed_by_code'] or '{}'}; max failure latency "
          f"{_ms(r['failure_latency_s']['max'])} ms; stop recovery med/max {_ms(r['recovery_s']['stop_median'])}/"
          f"{_ms(r['recovery_s']['stop_max'])} ms")
        base, end = r["baseline"]["processes"], r["end"]["processes"]
        p("    resources (baseline -> end): " + "; ".join(
            f"{role} rss {base[role]['rss_kb'] and base[role]['rss_kb'] // 1024}->"
            f"{end[role]['rss_kb'] and end[role]['rss_kb'] // 1024} MiB fds {base[role]['fds']}->{end[role]['fds']}"
            for role in base) + f"; /dev/shm {len(r['baseline']['dev_shm'])}->{len(r['end']['dev_shm'])} entries")
        if "updates" in r:
            u, adm = r["updates"], r["updates"].get("admission") or {}
            p(f"    hot updates: {u['commands']}; returning workers brought to the served weights: "
              f"{adm.get('synced', 0)} (median {_ms(adm.get('sync_seconds_median'))} ms, max "
              f"{_ms(adm.get('sync_seconds_max'))} ms), refused {adm.get('refused', 0)}; stale answers "
              f"{r['requests']['stale']}, mixed {r['requests']['mixed']}")
        for line in eplb_report_lines(r):
            p(line)
        for t in r["targets"]:
            p(f"    [{'met' if t['met'] else 'MISSED' if t['met'] is False else 'n/a'}] {t['target']} ({t['value']})")
    p("")


def plot(doc: dict, path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed; no plot")
        return None
    runs = [r for r in doc["configs"] if "timeline" in r]
    if not runs:
        return None
    fig, axes = plt.subplots(len(runs), 1, figsize=(13, 2.8 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        ts = [b["t"] for b in r["timeline"]]
        for key, color in (("ok", "tab:green"), ("error", "tab:orange"), ("wrong", "tab:red"), ("lost", "black")):
            ys = [b.get(key, 0) for b in r["timeline"]]
            if any(ys):
                ax.plot(ts, ys, color=color, lw=0.8, label=f"{key}/s")
        for ev in r["events"]:
            end = ev["t_whole"] if ev["t_whole"] is not None else ev["t_return"]
            ax.axvspan(ev["t_signal"], end, color="tab:red" if ev["action"] == "kill" else "tab:blue",
                       alpha=0.12 if ev["worker"] == 0 else 0.22, lw=0)
        ax.set_yscale("symlog")
        ax.set_title(f"{r['backend']} replicas={r['replicas']} workers={r['workers']}: answers per second; "
                     f"shaded: a worker killed (red) or stopped (blue) until whole again", fontsize=9)
        ax.set_xlabel("seconds into the chaos")
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    log(f"wrote {path}")
    return path
