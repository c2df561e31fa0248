"""`moe-bench load --scale-at SECONDS:N`: workers added and drained under load.

    moe-bench load --local-workers 1 --worker-cpus 0,1 --rate 200 --concurrency 8 --duration 30 \\
        --scale-at 10:2 --scale-at 20:1 --plot elastic.png

SECONDS into the measured load (after the warm-up) the started gateway is told ``workers
scale N`` (an authenticated control request, as ``moe-gateway workers scale N``): it starts
workers (pinned by ``--worker-cpus``, worker i to the i-th CPU) or drains, removes and stops
the highest-numbered ones. Meanwhile its workers are pinged every 50 ms, so the report gives

- per scale-up: the time from the command to the new worker admitted, given copies and
  first served (its own row counters move), and tokens/s before the command against
  tokens/s once it serves (the load must offer more than one worker can take for this to
  mean anything: a fixed rate above one worker's knee, or enough --concurrency);
- per scale-down: the time until the drained worker is removed, and the requests that
  failed while it drained (the target is none).

Tokens/s over time counts the rows each forward pass carried when it ended.
"""
from __future__ import annotations

import argparse
import threading
from typing import Any, Optional

import numpy as np

from bench.load_config import ConfigError
from transport.service import options

SETTLE_S = 1.0  # seconds after a change before its throughput counts (rounds in flight, warm caches)
POLL_S = 0.05
CPU_EVERY_S = 0.5
BIN_S = 0.5
TARGET_SPEEDUP = 1.5


def _scale_event(text: str) -> tuple[float, int]:
    t, sep, n = text.partition(":")
    try:
        secs, count = float(t), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SECONDS:N (e.g. 10:2), got {text!r}") from None
    if not sep or secs < 0 or count < 1:
        raise argparse.ArgumentTypeError(f"expected SECONDS:N with SECONDS >= 0 and N >= 1, got {text!r}")
    return secs, count


def add_arguments(g) -> None:

    g.add_argument("--scale-at", action="append", default=None, metavar="SECONDS:N",
                   type=options.named_type(_scale_event, "scale_event", "SECONDS:N"),
                   help="SECONDS into the measured load, tell the started gateway 'workers scale N' (repeatable, "
                        "in time order): tokens/s before and after, join-to-first-served, a drain's failures")


def resolve(args) -> None:

    ev = args.scale_at
    if not ev:
        return
    if args.gateway or args.points:
        raise ConfigError("--scale-at scales the gateway one run starts: no --gateway, --sweep or --compare")
    if args.mode != "fixed-rate":
        raise ConfigError("--scale-at measures tokens/s before and after at one offered load: use --mode fixed-rate")
    if [t for t, _ in ev] != sorted(t for t, _ in ev):
        raise ConfigError("--scale-at events must be in time order")
    if ev[-1][0] >= args.duration:
        raise ConfigError(f"--scale-at {ev[-1][0]:g}:{ev[-1][1]} is past the end of the load (--duration "
                          f"{args.duration:g})")


class ElasticHook:
    """Runs the scale events of ``args.scale_at`` against ``system`` (a started gateway)."""

    def __init__(self, system: Any, pool: Any, clock: Any, t_run: float, args: Any) -> None:
        from gateway.client import GatewayClient

        self.pool, self.clock, self.t_run, self.args = pool, clock, t_run, args
        self.t0 = args.warmup  # the measured load starts after the warm-up (run time axis)
        self.client = GatewayClient(system.url, timeout=30.0)
        self.events: list[dict] = []
        self.errors: list[str] = []
        self.cpu: list = []  # (t, {worker index or "gateway": CPU seconds})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="elastic")
        self._thread.start()

    def _now(self) -> float:
        return self.clock.now() - self.t_run

    def _run(self) -> None:
        todo = list(self.args.scale_at)
        while not self._stop.is_set():
            if todo and self._now() >= self.t0 + todo[0][0]:
                _, n = todo.pop(0)
                try:
                    self.events.append(self._scale(n))
                except Exception as e:
                    self.errors.append(f"scale {n}: {type(e).__name__}: {e}")
                continue
            try:
                self._ping()
            except Exception:
                pass
            wait = CPU_EVERY_S if not todo else min(CPU_EVERY_S, max(0.0, self.t0 + todo[0][0] - self._now()))
            self._stop.wait(wait)

    def _ping(self) -> list:
        """The gateway's workers (and their CPU seconds, kept: cores per phase)."""
        p = self.client.ping(timeout=10.0)
        self.cpu.append((round(self._now(), 4), {str(i): w.get("cpu_s") for i, w in enumerate(p["workers"])
                                                 if w.get("state") != "removed"} | {"gateway": p.get("cpu_s")}))
        return p["workers"]

    def _scale(self, n: int) -> dict:
        before = self._ping()
        t_cmd = self._now()
        reply = self.client.workers("scale", n=n, timeout=30.0)
        ev = {"n": n, "t": round(t_cmd, 4), "reply": reply, "workers_before": sum(w.get("state") != "removed"
                                                                                    for w in before)}
        if "starting" in reply:
            ev["kind"] = "up"
            new = set(range(len(before), len(before) + int(reply["starting"])))
            ev.update(self._watch_join(new, len(before)))
        else:
            ev["kind"] = "down"
            ev["workers"] = list(reply.get("draining") or [])
            ev.update(self._watch_drain(set(ev["workers"])))
        return ev

    def _watch_join(self, new: set, first: int, limit: float = 120.0) -> dict:
        """Times (run axis) at which the new workers were admitted, given copies, first served."""
        out: dict = {"t_admitted": None, "t_copies": None, "t_first_served": None, "workers": sorted(new)}
        t_end = self._now() + limit
        while self._now() < t_end and not self._stop.is_set():
            ws = self._ping()
            mine = [w for i, w in enumerate(ws) if i in new]
            if len(mine) == len(new):
                if out["t_admitted"] is None and all(w.get("healthy") for w in mine):
                    out["t_admitted"] = round(self._now(), 4)
                if out["t_copies"] is None and out["t_admitted"] is not None:
                    doc = self.client.placement("show", timeout=10.0)
                    if all(doc["workers"][i]["copies"] > 0 for i in new):
                        out["t_copies"] = round(self._now(), 4)
                if all(sum(r for _, r in w.get("expert_rows") or []) > 0 for w in mine):
                    out["t_first_served"] = round(self._now(), 4)
                    return out
            self._stop.wait(POLL_S)
        return out

    def _watch_drain(self, gone: set, limit: float = 120.0) -> dict:
        t_end = self._now() + limit
        while self._now() < t_end and not self._stop.is_set():
            ws = self._ping()
            if all(i < len(ws) and ws[i].get("state") == "removed" for i in gone):
                return {"t_removed": round(self._now(), 4)}
            self._stop.wait(POLL_S)
        return {"t_removed": None}

    def finish(self, out: dict) -> None:
        self._stop.set()
        self._thread.join(30)
        try:
            self.client.close()
        finally:
            out["elastic"] = analyse(self.events, list(self.pool.done), self.t_run, self.t0,
                                     self.t0 + self.args.duration, self.errors, self.cpu)


# -- what the run says (pure) ------------------------------------------------------------------------------
def pass_ends(done: list, t_run: float) -> list[tuple[float, int]]:
    """(end time on the run axis, rows) of every forward pass that finished."""
    out = []
    for d in done:
        if d.error is not None:
            continue
        ends = [p[0] for p in d.passes[1:]] + [d.end]
        ends[0] = d.first  # the prefill ends when the first token is out
        out += [(e - t_run, len(p[1])) for e, p in zip(ends, d.passes)]
    return out


def rate_between(passes: list, a: float, b: float) -> Optional[float]:
    """Rows per second ending in [a, b)."""
    if b - a <= 0:
        return None
    return sum(r for t, r in passes if a <= t < b) / (b - a)


def cores_between(cpu: list, a: float, b: float) -> dict:
    """CPU cores each process used over [a, b] (from the CPU-second samples nearest inside)."""
    inside = [(t, c) for t, c in cpu if a <= t <= b]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return {}
    (t0, c0), (t1, c1) = inside[0], inside[-1]
    return {k: round((c1[k] - c0[k]) / (t1 - t0), 3) for k in c1
            if c1.get(k) is not None and c0.get(k) is not None}


def analyse(events: list[dict], done: list, t_run: float, t_start: float, t_stop: float, errors: list,
            cpu: Optional[list] = None) -> dict:
    """Per event: tokens/s before (from the previous change, once settled) and after (once
    the new worker serves, until the next change), the speed-up, the CPU cores each process
    had in both windows, and a drain's failures."""
    cpu = cpu or []
    passes = pass_ends(done, t_run)
    failed = [d for d in done if d.error is not None]
    out = []
    prev = t_start
    for k, ev in enumerate(events):
        nxt = events[k + 1]["t"] if k + 1 < len(events) else t_stop
        e = dict(ev)
        a = prev + SETTLE_S if ev["t"] - prev > 2 * SETTLE_S else prev
        e["tokens_per_s_before"] = rate_between(passes, a, ev["t"])
        e["cores_before"] = cores_between(cpu, a, ev["t"])
        ready = ev.get("t_first_served") if ev["kind"] == "up" else ev.get("t_removed")
        if ready is not None:
            a = ready + SETTLE_S if nxt - ready > 2 * SETTLE_S else ready
            e["tokens_per_s_after"] = rate_between(passes, a, nxt)
            e["cores_after"] = cores_between(cpu, a, nxt)
            e["speedup"] = (e["tokens_per_s_after"] / e["tokens_per_s_before"]
                            if e["tokens_per_s_before"] and e["tokens_per_s_after"] else None)
        if ev["kind"] == "up" and ev.get("t_first_served") is not None:
            e["join_to_first_served_s"] = round(ev["t_first_served"] - ev["t"], 4)
        if ev["kind"] == "down":
            end = (ev.get("t_removed") or t_stop) + SETTLE_S
            e["failed_while_draining"] = sum(1 for d in failed if d.start - t_run <= end and d.end - t_run >= ev["t"])
            if ev.get("t_removed") is not None:
                e["drain_s"] = round(ev["t_removed"] - ev["t"], 4)
        out.append(e)
        prev = ready if ready is not None else ev["t"]
    edges = np.arange(0.0, max([t for t, _ in passes] + [t_stop]) + BIN_S, BIN_S)
    rows = np.zeros(max(1, len(edges) - 1))
    for t, r in passes:
        j = int(t // BIN_S)
        if 0 <= j < len(rows):
            rows[j] += r
    return {"events": out, "failed": len(failed), "first_error": failed[0].error if failed else None,
            "errors": errors, "measured": [t_start, t_stop], "bin_s": BIN_S,
            "tokens_per_s_bins": [round(float(x / BIN_S), 1) for x in rows]}


def markdown(el: dict) -> list[str]:
    """The report's section for --scale-at."""
    lines = ["", "**workers scaled under load** (--scale-at; run time axis: seconds since the warm-up began)", "",
             "| at s | scale | workers | tokens/s before | tokens/s after | after / before | CPU cores before | "
             "CPU cores after | admitted / copies / first served s after the command | drained and removed s | "
             "failed while draining |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in el["events"]:
        def rel(k: str) -> str:
            return "-" if e.get(k) is None else f"{e[k] - e['t']:.2f}"
        f = (lambda v, fmt="{:.0f}": "-" if v is None else fmt.format(v))  # noqa: E731
        joined = " / ".join(rel(k) for k in ("t_admitted", "t_copies", "t_first_served")) if e["kind"] == "up" else "-"
        lines.append(f"| {e['t']:.1f} | {e['workers_before']} -> {e['n']} | {e.get('workers')} | "
                     f"{f(e.get('tokens_per_s_before'))} | {f(e.get('tokens_per_s_after'))} | "
                     f"{f(e.get('speedup'), '{:.2f}x')} | {_cores(e.get('cores_before'))} | "
                     f"{_cores(e.get('cores_after'))} | {joined} | {f(e.get('drain_s'), '{:.2f}')} | "
                     f"{e.get('failed_while_draining', '-')} |")
    lines += ["", f"failed requests over the whole run: {el['failed']}"
              + (f" (first: {el['first_error']})" if el["first_error"] else "")]
    if el["errors"]:
        lines.append(f"scale commands that failed: {el['errors']}")
    for e in el["events"]:
        if e["kind"] == "up" and e.get("speedup") is not None:
            ok = e["speedup"] >= TARGET_SPEEDUP
            lines.append(f"- [{'met' if ok else 'MISSED'}] scale {e['workers_before']} -> {e['n']}: tokens/s x"
                         f"{e['speedup']:.2f} (target >= {TARGET_SPEEDUP})")
        if e["kind"] == "down":
            ok = e.get("failed_while_draining") == 0 and e.get("t_removed") is not None
            lines.append(f"- [{'met' if ok else 'MISSED'}] drain {e['workers_before']} -> {e['n']} under load: "
                         f"{e.get('failed_while_draining')} failed, removed "
                         f"{'never' if e.get('t_removed') is None else 'after ' + format(e['drain_s'], '.2f') + ' s'}")
    return lines


def _cores(c: Optional[dict]) -> str:
    """"gateway 0.4, w0 0.9, w1 0.8": who had the machine's cores (a worker that gets none adds nothing)."""
    if not c:
        return "-"
    return ", ".join(f"{k if k == 'gateway' else 'w' + k} {v:.2f}" for k, v in c.items())


def plot(el: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.5))
    ys = el["tokens_per_s_bins"]
    ax.plot(np.arange(len(ys)) * el["bin_s"], ys, lw=1, color="tab:blue", label="tokens/s")
    for e in el["events"]:
        ax.axvline(e["t"], color="k", lw=0.8, ls="--")
        ax.annotate(f"scale {e['n']}", (e["t"], max(ys or [1]) * 0.95), fontsize=7)
        for k, c in (("t_first_served", "tab:green"), ("t_removed", "tab:red")):
            if e.get(k) is not None:
                ax.axvline(e[k], color=c, lw=0.8, ls=":")
    ax.axvspan(0, el["measured"][0], color="0.9", lw=0, label="warm-up")
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel(f"tokens/s ({el['bin_s']:g} s bins)")
    ax.set_title("workers scaled under load: dashed the command, green first served, red removed", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
