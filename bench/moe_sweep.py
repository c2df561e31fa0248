"""`moe-bench moe` over several batch sizes (``--batch`` repeated, ``--repeat N``): where
chunked rounds pay.

A chunked round has costs a whole part does not shed (the plan and the first chunk before
a worker starts, the last reply's sum after it stops), roughly fixed per round, while the
no-token time they hide grows with the batch: the share of the bound a run realizes rises
with the batch size. One run's share moves by 10-20 points (a 1% difference in a forward
is several points of it), so each size runs ``--repeat`` times, each time on fresh worker
processes, and the summary gives the median with the range.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from bench.moe_layer import SHORTFALL_PARTS

#: the share of the bound chunked rounds aim for
TARGET = 0.8


def summarize(docs: list[dict]) -> list[dict]:
    """One row per (backend, batch) over the runs in ``docs`` (each one run's JSON document):
    medians and ranges of the chunked rounds' figures (bench.moe_layer.pipelining_gain).
    ``sent_whole``: runs whose chunked system sent as many messages as the whole one (auto
    chose whole parts; its share is then noise around 0)."""
    by: dict[tuple[str, int], list[tuple[dict, dict]]] = {}
    control: dict[tuple[str, int], list[float]] = {}  # --control: whole parts against themselves
    for doc in docs:
        batch = int(doc["meta"]["config"]["batch"])
        whole_msgs = {r["backend"]: r["stage_ms"].get("messages") for r in doc["results"]
                      if r["system"] == "moe-transport"}
        for backend, r in doc["ratios"].items():
            if "chunks" in r:
                by.setdefault((backend, batch), []).append((r["chunks"], whole_msgs))
            if "control" in r:
                control.setdefault((backend, batch), []).append(r["control"]["of_bound"])
    rows = []
    for (backend, batch), runs in sorted(by.items()):
        def col(key: str) -> np.ndarray:
            return np.array([g[key] for g, _ in runs], dtype=float)
        share = col("of_bound")
        rows.append({
            "backend": backend, "batch": batch, "runs": len(runs),
            "of_bound": float(np.nanmedian(share)), "of_bound_min": float(np.nanmin(share)),
            "of_bound_max": float(np.nanmax(share)),
            "met": int(np.sum(share >= TARGET)),
            "bound": float(np.median(col("bound"))), "p50_gain": float(np.median(col("p50_gain"))),
            "gain": float(np.median(col("gain"))), "gain_min": float(np.min(col("gain"))),
            "p99_ratio": float(np.median(col("p99_ratio"))),
            "no_token_ms": float(np.median(col("no_token_ms"))),
            "chunked_no_token_ms": float(np.median(col("chunked_no_token_ms"))),
            "round_ms": float(np.median(col("round_ms"))),
            "sent_whole": sum(1 for g, w in runs if g["messages"] <= (w.get(backend) or 0)),
            "shortfall": _median_shortfall([g.get("shortfall") for g, _ in runs]),
        })
        c = control.get((backend, batch))
        if c:
            rows[-1]["control"] = {"of_bound": float(np.nanmedian(c)), "min": float(np.nanmin(c)),
                                   "max": float(np.nanmax(c))}
    return rows


def _median_shortfall(parts: list) -> Optional[dict]:
    """Each part's median over the runs that have them (None: none has)."""
    parts = [p for p in parts if p and np.isfinite(p.get("missing", np.nan))]
    if not parts:
        return None
    return {k: float(np.median([p[k] for p in parts])) for k in ("missing", *SHORTFALL_PARTS)}


def report(rows: list[dict]) -> str:
    """The summary table, one line per (backend, batch size)."""
    head = (f"{'backend':<8} {'tokens':>7} {'runs':>4} {'share of bound (range)':>24} {'met':>5} {'bound':>6} "
            f"{'gain p50':>8} {'tokens/s':>15} {'p99':>6} {'no-token ms whole/chunked':>26}")
    lines = [f"chunked rounds by batch size (medians over runs; target: gain >= {100 * TARGET:.0f}% of the bound)",
             head]
    for r in rows:
        share = f"{100 * r['of_bound']:.0f}% ({100 * r['of_bound_min']:.0f}-{100 * r['of_bound_max']:.0f}%)"
        whole = f", {r['sent_whole']} sent whole" if r["sent_whole"] else ""
        lines.append(f"{r['backend']:<8} {r['batch']:>7} {r['runs']:>4} {share:>24} {r['met']:>2}/{r['runs']:<2} "
                     f"{r['bound']:5.3f}x {r['p50_gain']:7.3f}x {r['gain']:6.3f}x (>={r['gain_min']:.3f}) "
                     f"{r['p99_ratio']:5.2f}x {r['no_token_ms']:12.2f} / {r['chunked_no_token_ms']:.2f}{whole}")
    controlled = [r for r in rows if r.get("control")]
    if controlled:
        lines += ["", "control: whole parts against themselves, in turn (share of the bound, median and range: "
                      "the chunked share's noise)"]
        lines += [f"{r['backend']:<8} {r['batch']:>7} {100 * r['control']['of_bound']:+.0f}% "
                  f"({100 * r['control']['min']:+.0f} to {100 * r['control']['max']:+.0f}%)" for r in controlled]
    parted = [r for r in rows if r.get("shortfall")]
    if parted:
        lines += ["", "where the missing share went (points of the bound, medians over runs; moe_layer.shortfall)",
                  f"{'backend':<8} {'tokens':>7} {'missing':>8} {'own no-token':>13} {'worker busier':>14} "
                  f"{'routing':>8} {'rest':>6}"]
        for r in parted:
            sf = r["shortfall"]
            lines.append(f"{r['backend']:<8} {r['batch']:>7} {sf['missing']:8.0f} {sf['own_no_token']:13.0f} "
                         f"{sf['busier']:14.0f} {sf['routing']:8.0f} {sf['rest']:6.0f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: Optional[str] = None) -> None:
    """Panels against tokens per batch (log scale), one line per backend: the median gain
    beside its bound, and the share of the bound with its range and the target; and, where
    the runs have it, where the missing share went (:func:`_plot_shortfall`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parted = [r for r in rows if r.get("shortfall")]
    fig, axes = plt.subplots(1, 3 if parted else 2, figsize=(16.5 if parted else 11, 4.2))
    ax1, ax2 = axes[:2]
    for i, backend in enumerate(sorted({r["backend"] for r in rows})):
        rs = sorted((r for r in rows if r["backend"] == backend), key=lambda r: r["batch"])
        x = [r["batch"] for r in rs]
        color = f"C{i}"
        ax1.plot(x, [r["p50_gain"] for r in rs], "o-", color=color, label=f"{backend}: gain (median forwards)")
        ax1.plot(x, [r["bound"] for r in rs], "s--", color=color, alpha=0.6, label=f"{backend}: bound")
        med = np.array([100 * r["of_bound"] for r in rs])
        lo = med - np.array([100 * r["of_bound_min"] for r in rs])
        hi = np.array([100 * r["of_bound_max"] for r in rs]) - med
        ax2.errorbar(x, med, yerr=[lo, hi], fmt="o-", color=color, capsize=4,
                     label=f"{backend} (median, range of {max(r['runs'] for r in rs)} runs)")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_ylabel("chunked over whole parts (x)")
    ax1.set_title("gain and its bound")
    ax2.axhline(100 * TARGET, color="red", lw=1, ls=":", label=f"target ({100 * TARGET:.0f}%)")
    ax2.set_ylabel("share of the bound realized (%)")
    ax2.set_title("share of the possible gain")
    sizes = sorted({r["batch"] for r in rows})
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.minorticks_off()
        ax.set_xlabel("tokens per batch")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if parted:
        _plot_shortfall(axes[2], parted)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_shortfall(ax, rows: list[dict]) -> None:
    """Bars per (backend, batch size): the median points of the bound each part of
    :func:`bench.moe_layer.shortfall` took, beside the points missing in all."""
    labels = {"own_no_token": "chunked round's own no-token time", "busier": "busiest worker busier",
              "routing": "routing", "rest": "rest (unattributed)"}
    x = np.arange(len(rows))
    width = 0.8 / (len(SHORTFALL_PARTS) + 1)
    ax.bar(x - 0.4 + width / 2, [r["shortfall"]["missing"] for r in rows], width, color="grey",
           label="missing in all")
    for i, k in enumerate(SHORTFALL_PARTS):
        ax.bar(x - 0.4 + (i + 1.5) * width, [r["shortfall"][k] for r in rows], width, color=f"C{i + 2}",
               label=labels[k])
    ax.axhline(0, color="black", lw=0.8)
    ax.axhline(100 * (1 - TARGET), color="red", lw=1, ls=":", label=f"missing the target allows ({100 * (1 - TARGET):.0f})")
    ax.set_xticks(x, [f"{r['backend']} {r['batch']}" for r in rows])
    ax.set_ylabel("points of the bound (medians over runs)")
    ax.set_title("where the missing share went")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)  # below: bars stay visible
