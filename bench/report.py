"""Progress, ratio tables and plots for the benchmarks (rich and matplotlib if present)."""
from __future__ import annotations

import sys
import time
from typing import Any, Optional


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class Progress:
    """A progress bar (rich when installed, otherwise one line per step on stderr)."""

    def __init__(self, total: int, what: str = "measuring"):
        self.total, self.done, self.t0 = total, 0, time.monotonic()
        self._rich: Any = None
        try:
            from rich.progress import Progress as RP
            if sys.stderr.isatty():
                self._rich = RP(transient=True)
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


def _index(results: list[dict]) -> dict:
    return {(r["impl"], r["backend"], r["size"]): r for r in results}


def _peer_key(impl: str, backend: str) -> tuple[str, str]:
    return (impl, {"pyzmq": "ipc", "pipe": "pipe", "perftest": backend}.get(impl, backend))


def ratios(results: list[dict]) -> dict:
    """Ours over each peer, per backend and size (latency p50 ratio, bandwidth ratio),
    and the issue's targets evaluated on them."""
    idx = _index(results)
    out: dict = {"per_size": [], "targets": []}
    ours = [r for r in results if r["impl"] == "moe-transport"]
    for r in ours:
        row = {"backend": r["backend"], "size": r["size"]}
        for impl in ("raw", "pyzmq", "pipe", "perftest"):
            p = idx.get((impl, *_peer_key(impl, r["backend"])[1:], r["size"]))
            if p is not None:
                row[f"lat_vs_{impl}"] = r["lat_us"]["p50"] / p["lat_us"]["p50"]
                if p.get("bw_gbps"):
                    row[f"bw_vs_{impl}"] = r["bw_gbps"] / p["bw_gbps"]
                if p.get("write_bw_gbps"):
                    row["bw_vs_ib_write_bw"] = r["bw_gbps"] / p["write_bw_gbps"]
        out["per_size"].append(row)

    def lat(impl, backend, size):
        r = idx.get((impl, backend, size))
        return r["lat_us"]["p50"] if r else None

    def target(name, value, limit, ok):
        if value is not None:
            out["targets"].append({"target": name, "value": round(value, 3), "limit": limit, "met": bool(ok(value))})

    for b in {r["backend"] for r in ours}:
        if b == "shm":
            a, f = lat("moe-transport", "shm", 4096), lat("raw", "shm", 4096)
            target("shm 4KiB latency / bare shm floor", a / f if a and f else None, 2.0, lambda v: v <= 2.0)
            small = lat("moe-transport", "shm", 64)
            for big in (1 << 20, 16 << 20):
                x = lat("moe-transport", "shm", big)
                target(f"shm {human(big)} latency / 64 B latency", x / small if x and small else None, 2.0, lambda v: v <= 2.0)
            target("shm one-way 4KiB latency (us) vs NIXL shm ~5 us", a, 5.0, lambda v: v < 5.0)
        if b == "tcp":
            a, f = lat("moe-transport", "tcp", 4096), lat("raw", "tcp", 4096)
            target("tcp 4KiB latency / raw socket", a / f if a and f else None, 1.25, lambda v: v <= 1.25)
            o, p = idx.get(("moe-transport", "tcp", 1 << 20)), idx.get(("raw", "tcp", 1 << 20))
            target("tcp 1MiB bandwidth / raw socket", o["bw_gbps"] / p["bw_gbps"] if o and p else None, 0.9, lambda v: v >= 0.9)
        if b == "rdma":
            for s in (64, 4096):
                a, f = lat("moe-transport", "rdma", s), lat("perftest", "rdma", s)
                target(f"rdma {human(s)} latency / ib_send_lat", a / f if a and f else None, 1.5, lambda v: v <= 1.5)
            o, p = idx.get(("moe-transport", "rdma", 1 << 20)), idx.get(("perftest", "rdma", 1 << 20))
            target("rdma 1MiB bandwidth / ib_write_bw", o["bw_gbps"] / p["write_bw_gbps"] if o and p else None,
                   0.7, lambda v: v >= 0.7)
        zs = [row["lat_vs_pyzmq"] for row in out["per_size"] if row["backend"] == b and "lat_vs_pyzmq" in row]
        if zs:
            target(f"{b} worst latency / pyzmq over all sizes", max(zs), 1.0, lambda v: v < 1.0)
    return out


def print_transport(results: list[dict], rat: dict) -> None:
    idx = _index(results)
    for b in sorted({r["backend"] for r in results if r["impl"] == "moe-transport"}):
        peer_impls = [i for i in ("raw", "pyzmq", "pipe", "perftest") if any(k[0] == i for k in idx)]
        print(f"\n== moe-transport over {b}: latency = half round trip (us), bandwidth GB/s")
        head = f"{'size':>9} {'p50':>8} {'p99':>8} {'GB/s':>7}"
        for i in peer_impls:
            head += f" | {i + ' p50':>10} {'ratio':>6} {i + ' GB/s':>10} {'ratio':>6}"
        print(head)
        for r in sorted((r for r in results if r["impl"] == "moe-transport" and r["backend"] == b), key=lambda r: r["size"]):
            line = f"{human(r['size']):>9} {r['lat_us']['p50']:8.1f} {r['lat_us']['p99']:8.1f} {r['bw_gbps']:7.2f}"
            for i in peer_impls:
                p = idx.get((i, *_peer_key(i, b)[1:], r["size"]))
                if p is None:
                    line += f" | {'-':>10} {'-':>6} {'-':>10} {'-':>6}"
                else:
                    line += (f" | {p['lat_us']['p50']:10.1f} {r['lat_us']['p50'] / p['lat_us']['p50']:6.2f}"
                             f" {p['bw_gbps']:10.2f} {r['bw_gbps'] / p['bw_gbps'] if p['bw_gbps'] else 0:6.2f}")
            print(line)
    if rat.get("targets"):
        print("\n== targets (a benchmark, never a test)")
        for t in rat["targets"]:
            print(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']} (limit {t['limit']})")


def plot_transport(results: list[dict], path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot")
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key in sorted({(r["impl"], r["backend"]) for r in results}):
        rs = sorted((r for r in results if (r["impl"], r["backend"]) == key), key=lambda r: r["size"])
        xs = [r["size"] for r in rs]
        style = "-o" if key[0] == "moe-transport" else "--."
        ax1.plot(xs, [r["lat_us"]["p50"] for r in rs], style, label=f"{key[0]} {key[1]}")
        ax2.plot(xs, [r["bw_gbps"] for r in rs], style, label=f"{key[0]} {key[1]}")
    for ax, title in ((ax1, "latency p50 (us, half RTT)"), (ax2, "streaming bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return path
