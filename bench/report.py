"""`moe-bench transport`'s report: progress (stderr), the perftest-style tables, ratios and
targets (stdout), plots (matplotlib if present)."""
from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Optional

import numpy as np

from .plotstyle import colour, linestyle
from .stats import MARK, footnote

FIGURE_TITLE = {"descriptor": "descriptor round trip (payload not touched)",
                "data": "data round trip (sender writes, receiver reads every payload byte)"}
RATIO_DIRECTIONS = {"lat_vs_<peer>": "ours / peer, one-way t_typical (median): lower is better",
                    "bw_vs_<peer>": "ours / peer, streaming GB/s: higher is better",
                    "bw_vs_ib_write_bw": "ours / ib_write_bw GB/s: higher is better"}
# figures quoted from elsewhere, never measured by this tool: printed as references only
REFERENCES = {"shm": [{"what": "NIXL shared-memory one-way latency", "value_us": 5.0, "approx": True,
                       "source": "NIXL's published figure; not measured in this run",
                       "compare": ("moe-transport", "shm", "descriptor", 4096)}]}


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class Progress:
    """A progress bar on stderr (rich when installed and stderr is a terminal, otherwise
    one line per step)."""

    def __init__(self, total: int, what: str = "measuring"):
        self.total, self.done, self.t0 = total, 0, time.monotonic()
        self._rich: Any = None
        try:
            from rich.console import Console
            from rich.progress import Progress as RP
            if sys.stderr.isatty():
                self._rich = RP(transient=True, console=Console(stderr=True))
                self._rich.start()
                self._task = self._rich.add_task(what, total=total)
        except ImportError:
            pass

    def advance(self, label: str) -> None:
        self.done += 1
        if self._rich is not None:
            self._rich.update(self._task, advance=1, description=label)
        else:
            print(f"[{self.done}/{self.total} {time.monotonic() - self.t0:6.1f}s] {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None


# -- the numbers -------------------------------------------------------------------------
def _index(results: list[dict]) -> dict:
    return {(r["impl"], r["backend"], r.get("figure", "descriptor"), r["size"]): r
            for r in results if r.get("carried") and "error" not in r}


def zmq_medium(backend: str) -> str:
    """pyzmq beside a backend: over tcp:// for the network backends, ipc:// beside shm."""
    return "ipc" if backend == "shm" else "tcp"


def table_peers(backend: str) -> list[tuple[str, str]]:
    """(impl, medium) of the rows shown in a backend's table, ours first."""
    rows = [("moe-transport", backend), ("raw", backend), ("pyzmq", zmq_medium(backend)), ("pipe", "pipe")]
    rows.insert(1, ("moe-transport-py", backend))  # the fast path's Python side beside the compiled one
    if backend == "rdma":
        rows.append(("perftest", "rdma"))
    return rows


def ratios(results: list[dict]) -> list[dict]:
    """Ours over each peer of its table, per backend, figure and size: ``lat_vs_<peer>``
    (one-way t_typical, lower is better), ``bw_vs_<peer>`` (GB/s, higher is better)."""
    idx = _index(results)
    out = []
    for (impl, backend, fig, size), r in sorted(idx.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3])):
        if impl != "moe-transport":
            continue
        row: dict = {"backend": backend, "figure": fig, "size": size}
        for pimpl, medium in table_peers(backend)[1:]:
            p = idx.get((pimpl, medium, fig, size))
            if p is None:
                continue
            row[f"lat_vs_{pimpl}"] = r["lat_us"]["p50"] / p["lat_us"]["p50"] if p["lat_us"]["p50"] else None
            if p.get("bw_gbps") and r.get("bw_gbps"):
                row[f"bw_vs_{pimpl}"] = r["bw_gbps"] / p["bw_gbps"]
            if p.get("write_bw_gbps") and r.get("bw_gbps"):
                row["bw_vs_ib_write_bw"] = r["bw_gbps"] / p["write_bw_gbps"]
        out.append(row)
    return out


# -- repeats and noise --------------------------------------------------------------------
NOISY_SPREAD = 1.5  # repeats agree when their t_typical are within this factor of each other
NOISY_TAIL = 3.0  # a run whose t_typical is this many times its t_min: half its round trips were held up


def combine_repeats(recs: list[dict]) -> dict:
    """One row from a size's repeats (run interleaved with the other implementations'):
    the repeat with the median t_typical (its latency columns together), bandwidth and
    message rate the medians over the repeats, ``repeats`` what each gave, and ``noisy``
    (None, or why: :func:`noise`): such a row is shown but judges no target."""
    ok = [r for r in recs if r.get("carried") and "error" not in r]
    if not ok or len(ok) != len(recs):
        return next((r for r in recs if "error" in r), recs[0])
    order = sorted(ok, key=lambda r: r["lat_us"]["p50"])
    rec = dict(order[(len(order) - 1) // 2])
    p50s = [r["lat_us"]["p50"] for r in ok]
    rec["repeats"] = {"n": len(ok), "lat_p50_us": p50s, "spread": {"lat": spread(p50s, rec["lat_us"]["p50"])}}
    for key in ("bw_gbps", "msg_rate"):
        vals = [r[key] for r in ok if r.get(key) is not None]
        if len(vals) == len(ok) and len(ok) > 1:
            rec[key] = float(statistics.median(vals))
            rec["repeats"][key] = vals
            rec["repeats"]["spread"][key] = spread(vals, rec[key])
    rec["noisy"] = noise(rec)
    return rec


def spread(values: list, median: float) -> float:
    """How far the repeats that agree with the median (within NOISY_SPREAD of it) are from
    each other, as max / min (1.0: one repeat, or all alike): the scatter a verdict must
    clear."""
    agree = [v for v in values if v > 0 and median > 0 and max(v, median) / min(v, median) <= NOISY_SPREAD]
    return max(agree) / min(agree) if len(agree) > 1 else 1.0


def noise(rec: dict) -> Optional[str]:
    """Why a row's figures do not hold still (None: they do): no majority of its repeats
    agrees with the median one (one busy repeat out of three spoils nothing), or the median
    repeat's own t_typical sits far above its t_min."""
    p50s = rec.get("repeats", {}).get("lat_p50_us") or []
    med = rec["lat_us"]["p50"]
    if len(p50s) > 1 and min(p50s) > 0:
        agree = sum(1 for v in p50s if max(v, med) / min(v, med) <= NOISY_SPREAD)
        if 2 * agree <= len(p50s):
            return (f"its {len(p50s)} repeats' t_typical span {min(p50s):.1f}..{max(p50s):.1f} us, no majority "
                    f"within {NOISY_SPREAD:g}x of the median")
    L = rec["lat_us"]
    if L["min"] > 0 and L["p50"] / L["min"] > NOISY_TAIL:
        return f"t_typical {L['p50']:.1f} us is {L['p50'] / L['min']:.0f}x its t_min {L['min']:.1f} us"
    return None


def targets(results: list[dict]) -> list[dict]:
    """moe-transport's targets, judged on what this run measured (a benchmark, never a
    test), each from the median repeat of its rows, and only where the rows' scatter over
    the repeats cannot flip the verdict; otherwise ``met`` is None and ``noisy`` says why
    (a noisy row, or too close to call). ``range``: the ratio's span given that scatter."""
    idx = _index(results)
    out: list[dict] = []

    def row(impl, backend, size, fig="descriptor"):
        return idx.get((impl, backend, fig, size))

    def lat(r):
        return r["lat_us"]["p50"] if r else None

    def target(name, rn, rd, value, limit, op, source, keys=("lat", "lat")):
        num, den = value(rn), value(rd)
        if num is None or not den:
            return
        v = num / den
        noisy = "; ".join(f"{r.get('label') or r['impl']} ({r['backend']}) at {human(r['size'])}: {r['noisy']}"
                          for r in (rn, rd) if r.get("noisy"))
        # the ratio may be off by the two rows' scatter: a verdict only where that cannot flip it
        u = float(np.prod([r.get("repeats", {}).get("spread", {}).get(k, 1.0) for r, k in zip((rn, rd), keys)]))
        lo, hi = v / u, v * u
        met = (hi <= limit if op == "<=" else lo >= limit) or None
        if met is None and (lo > limit if op == "<=" else hi < limit):
            met = False
        if noisy:
            met = None
        elif met is None:
            noisy = (f"too close to call: the repeats' scatter (x{u:.2f}) puts it anywhere in {lo:.3f}..{hi:.3f}; "
                     f"more --repeat narrows it")
        out.append({"target": name, "value": round(v, 3), "limit": limit, "op": op, "met": met, "source": source,
                    "noisy": noisy or None, "range": [round(lo, 3), round(hi, 3)],
                    "repeats": min(r.get("repeats", {}).get("n", 1) for r in (rn, rd))})

    bw = lambda r: r.get("bw_gbps") if r else None  # noqa: E731
    wbw = lambda r: r.get("write_bw_gbps") if r else None  # noqa: E731
    for b in sorted({k[1] for k in idx if k[0] == "moe-transport"}):
        if b == "shm":
            target("shm descriptor one-way t_typical at 4 KiB / bare slot-index handoff (same run)",
                   row("moe-transport", "shm", 4096), row("raw", "shm", 4096), lat, 10.0, "<=",
                   "shared-memory latency target")
            for big in (1 << 20, 16 << 20):
                target(f"shm descriptor t_typical at {human(big)} / at 64 B", row("moe-transport", "shm", big),
                       row("moe-transport", "shm", 64), lat, 1.2, "<=", "shared-memory size-independence target")
        if b == "tcp":
            target("tcp descriptor t_typical at 4 KiB / raw socket", row("moe-transport", "tcp", 4096),
                   row("raw", "tcp", 4096), lat, 1.25, "<=", "TCP latency target")
            target("tcp descriptor bandwidth at 1 MiB / raw socket", row("moe-transport", "tcp", 1 << 20),
                   row("raw", "tcp", 1 << 20), bw, 0.9, ">=", "TCP bandwidth target", ("bw_gbps", "bw_gbps"))
        if b == "rdma":
            for s in (64, 4096):
                target(f"rdma descriptor t_typical at {human(s)} / bare pyverbs loop", row("moe-transport", "rdma", s),
                       row("raw", "rdma", s), lat, 2.0, "<=", "RDMA latency target")
            rn, rp = row("moe-transport", "rdma", 1 << 20), row("perftest", "rdma", 1 << 20)
            if bw(rn) is not None and wbw(rp):
                target("rdma bandwidth at 1 MiB / ib_write_bw", rn, rp, lambda r: bw(r) if r is rn else wbw(r),
                       0.9, ">=", "RDMA bandwidth target", ("bw_gbps", "write_bw_gbps"))
        _zmq_target(out, b, idx, row, lat)
    return out


def _zmq_target(out: list, b: str, idx: dict, row, lat) -> None:
    """Ours slower than pyzmq at no size: judged over the sizes whose rows hold still."""
    pairs = [(s, row("moe-transport", b, s), row("pyzmq", zmq_medium(b), s)) for s in sorted({k[3] for k in idx})]
    pairs = [(s, ours, z) for s, ours, z in pairs if lat(ours) and lat(z)]
    if not pairs:
        return
    def u(r):
        return r.get("repeats", {}).get("spread", {}).get("lat", 1.0)

    clean = [(lat(o) / lat(z), u(o) * u(z)) for s, o, z in pairs if not o.get("noisy") and not z.get("noisy")]
    left = [human(s) for s, o, z in pairs if o.get("noisy") or z.get("noisy")]
    worst, scatter = max(clean, default=(max(lat(o) / lat(z) for _, o, z in pairs), 1.0))
    met = None if not clean else True if worst * scatter < 1.0 else False if worst / scatter >= 1.0 else None
    why = [f"noisy sizes left out: {', '.join(left)}"] if left else []
    if clean and met is None:
        why.append(f"too close to call: the repeats' scatter (x{scatter:.2f}) spans the target")
    out.append({"target": f"{b} descriptor worst t_typical / pyzmq over all sizes", "value": round(worst, 3),
                "limit": 1.0, "op": "<", "met": met, "source": "against pyzmq", "noisy": "; ".join(why) or None,
                "repeats": min(min(o.get("repeats", {}).get("n", 1), z.get("repeats", {}).get("n", 1))
                               for _, o, z in pairs)})


def references(results: list[dict]) -> list[dict]:
    """Figures quoted from elsewhere, each beside this run's comparable measurement; they
    were NOT measured here and carry no verdict."""
    idx = _index(results)
    out = []
    for b in sorted({r["backend"] for r in results if r["impl"] == "moe-transport"}):
        for ref in REFERENCES.get(b, []):
            r = idx.get(ref["compare"])
            out.append({**{k: v for k, v in ref.items() if k != "compare"}, "measured": False,
                        "this_run": None if r is None else {"impl": ref["compare"][0], "figure": ref["compare"][2],
                                                            "size": ref["compare"][3],
                                                            "one_way_us": r["lat_us"]["p50"]}})
    return out


def transport_summary(doc: dict) -> None:
    """Fill the doc's ratios, targets and references from its results."""
    res = doc["results"]
    doc["ratios"] = {"directions": RATIO_DIRECTIONS, "per_size": ratios(res)}
    doc["targets"] = targets(res)
    doc["references"] = references(res)


# -- printing ----------------------------------------------------------------------------
def _settings_lines(doc: dict) -> list[str]:
    pv, st = doc["provenance"], doc["settings"]
    commit = pv.get("commit")
    commit = "not a git checkout" if not commit else f"commit {commit[:12]}{' (local changes)' if pv.get('dirty') else ''}"
    pin = st.get("pinning")
    aff = st.get("affinity")
    pin_s = (f"client on CPU {pin['client_cpu']}, echo servers on CPU {pin['server_cpu']}" if pin else
             f"none (every process may run on CPUs {','.join(map(str, aff)) if aff else '?'})")
    lines = [f"moe-bench transport · moe-transport {pv.get('version')} · {commit} · {pv.get('date_utc')}",
             f" command         : {pv.get('command')}",
             f" host            : {pv.get('host')} · kernel {pv.get('kernel')} · {pv.get('cpu_model')} x{pv.get('cpus')}"
             f" · load average {pv.get('loadavg_at_start')}",
             f" python          : {pv.get('python')} · numpy {pv.get('numpy')}",
             f" backends        : {', '.join(st['backends'])}",
             f" sizes           : {', '.join(str(s) for s in st['sizes'])} bytes",
             f" figures         : {', '.join(st['figures'])}",
             f" iterations      : {st['iterations_rule']}",
             f" warm-up         : {st['warmup_rule']}",
             f" streaming       : {st['stream']['bursts']} bursts of {st['stream']['messages']} messages; "
             f"{st['stream']['bandwidth']}",
             f" slot size       : {st['slot_size'] if st.get('slot_size') else 'the largest size'} bytes x {st['nslots']} slots "
             f"(moe-transport)",
             f" CPU pinning     : {pin_s}"]
    for k, v in st["spin"].items():
        lines.append(f" spin ({k}){' ' * max(1, 9 - len(k))}: {v}")
    lines.append(f" latency         : {st['latency']}")
    n = st.get("repeat") or 1
    lines.append(f" repeats         : {n} per size, interleaved with the other implementations"
                 + ("; each row is the median repeat (bandwidth: the median)" if n > 1 else "")
                 + "; a noisy row judges no target")
    return lines


def _f(v: Optional[float], width: int, ok: bool = True) -> str:
    if v is None:
        return f"{'-':>{width}}"
    s = f"{v:.2f}" + ("" if ok else MARK)
    return f"{s:>{width}}"


def _ratio(v: Optional[float], width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{f'{v:.2f}x':>{width}}"


def print_transport(doc: dict, out=None) -> None:
    out = out or sys.stdout
    results = doc["results"]
    idx = {(r["impl"], r["backend"], r.get("figure", "descriptor"), r["size"]): r for r in results}
    pr = lambda s="": print(s, file=out)  # noqa: E731
    for line in _settings_lines(doc):
        pr(line)
    if doc.get("interrupted"):
        pr(" status          : INTERRUPTED: the tables hold what was measured before")
    marked = nobw = False
    noisy_rows: list[str] = []
    sizes = doc["settings"]["sizes"]
    tables = [b for b in doc["settings"]["backends"] if any(r["backend"] == b and r["impl"] == "moe-transport"
                                                             for r in results)]
    w_lab = 22
    for b in tables:
        rows = table_peers(b)
        for fig in doc["settings"]["figures"]:
            pr()
            pr(f"== {b} · {FIGURE_TITLE[fig]} " + "=" * max(3, 100 - len(b) - len(FIGURE_TITLE[fig])))
            pr(f" {'#bytes':>9}  {'implementation':<{w_lab}} {'#iter':>6} {'t_min':>9} {'t_typical':>9} {'t_avg':>9}"
               f" {'t_max':>9} {'t_stdev':>9} {'99%':>9} {'99.9%':>9} {'BW':>9} {'MsgRate':>9}"
               f"   {'ours/this t_typical':>20}   {'ours/this BW':>18}")
            pr(f" {'':>9}  {'':<{w_lab}} {'':>6} {'[usec]':>9} {'[usec]':>9} {'[usec]':>9} {'[usec]':>9} {'[usec]':>9}"
               f" {'[usec]':>9} {'[usec]':>9} {'[GB/s]':>9} {'[Mmsg/s]':>9}"
               f"   {'(lower is better)':>20}   {'(higher is better)':>18}")
            for size in sizes:
                ours = idx.get(("moe-transport", b, fig, size))
                for impl, medium in rows:
                    r = idx.get((impl, medium, fig, size))
                    if r is None:
                        continue
                    label = r.get("label") or impl
                    if impl in ("pyzmq",):
                        label = f"pyzmq {medium}"
                    head = f" {size:>9}  {label:<{w_lab}}"
                    if "error" in r:
                        pr(f"{head} failed: {r['error'][:100]}")
                        continue
                    if not r.get("carried", True):
                        pr(f"{head} {r['note']}")
                        continue
                    L = r["lat_us"]
                    rel = L.get("reliable", {})
                    ok99, ok999 = rel.get("p99", True), rel.get("p999", True)
                    marked |= not (ok99 and ok999)
                    nobw |= r.get("bw_gbps") is None and "bw_note" in r
                    bw = _f(r.get("bw_gbps"), 9) if "bw_note" not in r else f"{'no data':>9}"
                    rate = r.get("msg_rate")
                    line = (f"{head} {r['iters']:>6} {_f(L['min'], 9)} {_f(L['p50'], 9)} {_f(L['avg'], 9)}"
                            f" {_f(L.get('max'), 9)} {_f(L.get('stdev'), 9)} {_f(L['p99'], 9, ok99)}"
                            f" {_f(L['p999'], 9, ok999)} {bw} {_f(rate / 1e6 if rate else None, 9)}")
                    noisy_rows.extend([f"{label} ({r['backend']}) {human(size)} {fig}: {r['noisy']}"]
                                      if r.get("noisy") else [])
                    if impl != "moe-transport":
                        ok = ours is not None and ours.get("carried", True) and "error" not in ours
                        lr = ours["lat_us"]["p50"] / L["p50"] if ok and L["p50"] else None
                        br = ours["bw_gbps"] / r["bw_gbps"] if ok and ours.get("bw_gbps") and r.get("bw_gbps") else None
                        line += f"   {_ratio(lr, 20)}   {_ratio(br, 18)}"
                        if impl == "perftest" and ok and r.get("write_bw_gbps") and ours.get("bw_gbps"):
                            line += f"   (ib_write_bw {r['write_bw_gbps']:.2f} GB/s: ours/this "\
                                    f"{ours['bw_gbps'] / r['write_bw_gbps']:.2f}x)"
                    pr(line)
            if fig == "data" and b == "rdma":
                pr("  (perftest appears in the descriptor figure only: its payload is moved by the NIC, "
                   "never read or written by a CPU)")
    if marked or nobw:
        pr()
    if marked:
        pr(footnote({"99%": 99, "99.9%": 99.9}))
    if nobw:
        pr("no data: in the descriptor figure a shared-memory slot index is passed and no payload byte moves, "
           "so no bandwidth is claimed (MsgRate stands; the data figure gives the GB/s)")
    if noisy_rows:
        pr()
        pr("noisy rows (the machine was busy while they ran: shown, but they judge no target; rerun with "
           "more --repeat, or on a quieter machine):")
        for line in noisy_rows:
            pr(f"  {line}")
    if doc.get("targets"):
        pr()
        n = doc["settings"].get("repeat") or 1
        pr(f"== targets (a benchmark, never a test; ratios of figures measured in this run, "
           f"{'from the median of ' + str(n) + ' repeats' if n > 1 else 'from one run: --repeat 3 for medians'})")
        for t in doc["targets"]:
            verdict = ("met" if t["met"] else "MISSED") if t["met"] is not None else \
                "too close to call" if (t.get("noisy") or "").startswith("too close") else "noisy: not judged"
            pr(f"  [{verdict}] {t['target']}: {t['value']} (target {t['op']} {t['limit']}; {t['source']})"
               + (f"; {t['noisy']}" if t.get("noisy") else ""))
    if doc.get("references"):
        pr()
        pr("== references (NOT measured in this run: quoted figures, for orientation only, no verdict)")
        for ref in doc["references"]:
            here = ref.get("this_run")
            cmp_ = (f"; this run's moe-transport {human(here['size'])} {here['figure']} one-way t_typical: "
                    f"{here['one_way_us']:.2f} us" if here else "")
            pr(f"  reference: {ref['what']} {'~' if ref.get('approx') else ''}{ref['value_us']:g} us "
               f"({ref['source']}){cmp_}")


def print_plan(backends: list[str], sizes: list[int], figures: list[str], repeat: int, iters: int) -> None:
    """What the run will measure, before it starts (stderr)."""
    print(f"plan: backends {', '.join(backends)}; {len(sizes)} sizes ({human(min(sizes))} .. {human(max(sizes))}); "
          f"figures {', '.join(figures)}; {repeat} repeat(s) of every size, interleaved; up to {iters} round trips "
          f"per size and implementation", file=sys.stderr, flush=True)


def plot_transport(results: list[dict], path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot (pip install 'moe-transport[bench]')", file=sys.stderr)
        return None
    ok = [r for r in results if r.get("carried") and "error" not in r]
    figs = [f for f in FIGURE_TITLE if any(r.get("figure") == f for r in ok)]
    if not figs:
        print("note: nothing measured; no plot", file=sys.stderr)
        return None
    fig, axes = plt.subplots(len(figs), 2, figsize=(12, 4.5 * len(figs)), squeeze=False)
    for row, figure in enumerate(figs):
        ax1, ax2 = axes[row]
        rs_fig = [r for r in ok if r.get("figure") == figure]
        for key in sorted({(r["impl"], r["backend"]) for r in rs_fig}):
            rs = sorted((r for r in rs_fig if (r["impl"], r["backend"]) == key), key=lambda r: r["size"])
            xs = [r["size"] for r in rs]
            style = dict(color=colour(key[0]), ls=linestyle(key[1]), marker="o" if key[0] == "moe-transport" else ".",
                         lw=2.0 if key[0] == "moe-transport" else 1.2)
            name = f"{rs[0].get('label', key[0])} ({key[1]})"
            ax1.plot(xs, [r["lat_us"]["p50"] for r in rs], label=name, **style)
            bw = [(r["size"], r["bw_gbps"]) for r in rs if r.get("bw_gbps")]
            if bw:
                ax2.plot([x for x, _ in bw], [y for _, y in bw], label=name, **style)
        for ax, title in ((ax1, "one-way t_typical (usec, half RTT)"), (ax2, "streaming bandwidth (GB/s)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("message size (bytes)")
            ax.set_title(f"{figure}: {title}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
            else:
                ax.text(0.5, 0.5, "no bandwidth claimed: no payload byte moves", ha="center", va="center",
                        transform=ax.transAxes, fontsize=8)
    fig.suptitle("moe-bench transport: descriptor (payload untouched) and data (every byte written and read)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
    return path
