"""``moe-bench chaos --eplb``: workers killed and stopped while the gateway moves expert copies.

The gateway runs EPLB with a short interval and spare copies (``--eplb-interval``,
``--redundant-experts``, at most ``--eplb-max-moves`` copies a move); the steady clients
and the churn send skewed traffic -- ``--skew-share`` of their batches steered to a hot
pair of experts that changes every ``--skew-period`` seconds -- so the placement keeps
moving. Before each kill or stop the chaos waits (up to its next gap) for a move in
progress and aims at the worker the move loads a copy onto; :class:`PlacementWatch`
polls ``placement show`` through the run, so the report can say

- the moves done and abandoned, and which actions landed during a move (and that move's
  fate: a worker killed while loading abandons it; the old placement stays);
- which failures were expected: a request needing an expert whose every copy was on the
  down worker at some point of its down window (the placement changes, so this is read
  from the polled copies, not the start-up blocks).

Wrong, lost and duplicated answers stay targets of 0, as in every chaos run.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

import numpy as np

HOT_SETS = ((0, 1), (4, 5), (2, 3), (6, 7))  # each within one start-up block of two workers: moves follow
ACTIVE = ("loading", "switched", "retiring")


def add_arguments(p) -> None:
    from transport.service import options

    g = p.add_argument_group("--eplb: the gateway moves copies by load while workers are killed")
    g.add_argument("--eplb", action="store_true",
                   help="the gateway runs EPLB (short interval, spare copies) under skewed, shifting traffic; "
                        "kills and stops are aimed at moves in progress")
    g.add_argument("--eplb-interval", type=options.positive_seconds, default=0.5,
                   help="with --eplb: the gateway's --eplb-interval")
    g.add_argument("--eplb-window", type=options.positive_seconds, default=1.0,
                   help="with --eplb: the gateway's --eplb-window")
    g.add_argument("--redundant-experts", type=options.count, default=2, metavar="N",
                   help="with --eplb: spare copies the gateway may place")
    g.add_argument("--eplb-max-moves", type=options.positive, default=2, metavar="N",
                   help="with --eplb: copies a move adds at most (small: more, smaller moves)")
    g.add_argument("--skew-share", type=options.fraction, default=0.8,
                   help="with --eplb: share of batches steered to the hot pair of experts")
    g.add_argument("--skew-period", type=options.positive_seconds, default=3.0,
                   help="with --eplb: seconds before the hot pair changes")


def gateway_flags(args) -> list[str]:
    if not getattr(args, "eplb", False):
        return []
    return ["--eplb", "--redundant-experts", str(args.redundant_experts), "--eplb-interval",
            repr(float(args.eplb_interval)), "--eplb-window", repr(float(args.eplb_window)),
            "--eplb-max-moves", str(args.eplb_max_moves)]


class PlacementWatch:
    """``placement show`` every ``period`` s from a thread: (monotonic time, version, copies
    {expert: workers} of layer 0, move state, moves done, abandoned) per sample, and every
    finished move in order."""

    def __init__(self, url: str, secret: Optional[bytes], period: float = 0.05) -> None:
        from gateway.client import GatewayClient

        self.client = GatewayClient(url, timeout=5.0, secret=secret)
        self._probe = GatewayClient(url, timeout=5.0, secret=secret)  # the chaos thread's own
        self.period = period
        self.samples: list[tuple] = []
        self.moves: list[dict] = []
        self.errors = 0
        self._seen = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="placement-watch")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.add(self.client.placement("show", timeout=5.0), time.monotonic())
            except Exception:
                self.errors += 1
            self._stop.wait(self.period)

    def add(self, doc: dict, t: float) -> tuple:
        reb = doc.get("rebalancer") or {}
        n = reb.get("moves") or {}
        done, abandoned = int(n.get("done", 0)), int(n.get("abandoned", 0))
        mv = reb.get("move") or {}
        copies = {int(e): tuple(ws) for e, ws in ((doc.get("layers") or {}).get("0") or {}).get("copies", {}).items()}
        s = (t, doc.get("version"), copies, mv.get("state") if mv.get("state") in ACTIVE else None, done, abandoned)
        with self._lock:
            if done + abandoned > self._seen:
                hist = list(reb.get("history") or [])
                for m in hist[-(done + abandoned - self._seen):]:
                    self.moves.append({"t_seen": t, "state": m.get("state"), "adds": m.get("adds"),
                                       "removes": m.get("removes"), "seconds": m.get("seconds"),
                                       "error": m.get("error") or ""})
                self._seen = done + abandoned
            self.samples.append(s)
        return s

    def move_in_progress(self, wait: float, poll: float = 0.005) -> Optional[dict]:
        """Poll (this thread's own client) up to ``wait`` s for a move in progress: {"state",
        "workers" its copies go to or leave, "index" the move's place among all moves}."""
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                doc = self._probe.placement("show", timeout=5.0)
            except Exception:
                time.sleep(poll)
                continue
            s = self.add(doc, time.monotonic())
            mv = (doc.get("rebalancer") or {}).get("move") or {}
            if s[3] is not None:
                ws = [a[2] for a in mv.get("adds") or []] or [r[2] for r in mv.get("removes") or []]
                return {"state": s[3], "workers": sorted(set(ws)), "index": s[4] + s[5]}
            time.sleep(poll)
        return None

    def experts_on(self, worker: int, t: float) -> list:
        """The experts worker ``worker`` held a copy of at the last sample before ``t``."""
        s = self._at(t)
        return sorted(e for e, ws in s[2].items() if worker in ws) if s else []

    def _at(self, t: float) -> Optional[tuple]:
        with self._lock:
            before = [s for s in self.samples if s[0] <= t]
        return before[-1] if before else None

    def only_on(self, worker: int, lo: float, hi: float) -> set:
        """Experts whose every copy was on ``worker`` at some sample in [lo, hi] (or the one before lo)."""
        with self._lock:
            ss = [s for s in self.samples if lo <= s[0] <= hi]
        first = self._at(lo)
        out: set = set()
        for s in ([first] if first else []) + ss:
            out |= {e for e, ws in s[2].items() if set(ws) <= {worker}}
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.client.close()
        self._probe.close()


class ChaosEplb:
    """The --eplb part of one chaos configuration: skewed batches, the watch, the aim."""

    def __init__(self, args: Any, layer: Any) -> None:
        self.args, self.layer = args, layer
        rng = np.random.default_rng(args.seed + 7)
        self.pools = [[layer.steered(set(h), n=int(rng.integers(2, 17)), seed=1000 * k + j) for j in range(12)]
                      for k, h in enumerate(HOT_SETS)]
        self.t0 = time.monotonic()
        self.watch: Optional[PlacementWatch] = None
        self.actions: list[dict] = []

    def pick(self, rng) -> tuple:
        """A batch (x, reference y, experts): from the hot pair of the moment, or any."""
        if rng.random() < self.args.skew_share:
            k = int((time.monotonic() - self.t0) / self.args.skew_period) % len(self.pools)
            return rng.choice(self.pools[k])
        return rng.choice(self.layer.pairs)

    def start(self, url: str, secret: Optional[bytes]) -> None:
        self.watch = PlacementWatch(url, secret)

    def aim(self, default: int, wait: float) -> tuple[int, Optional[dict]]:
        """The worker to kill or stop: one a move in progress loads onto or leaves (waiting
        up to ``wait`` s for one), else ``default``; and the move seen."""
        mv = self.watch.move_in_progress(wait) if self.watch is not None else None
        if mv and mv["workers"]:
            return mv["workers"][0], mv
        return default, mv

    def note_action(self, ev: dict, mv: Optional[dict]) -> None:
        ev["move"] = mv
        self.actions.append(ev)

    def only(self, ev: dict, t0: float) -> set:
        """Experts with no copy but the victim's during its down window (the run's axis + t0)."""
        end = ev["t_whole"] if ev["t_whole"] is not None else ev["t_return"] + 60.0
        return self.watch.only_on(ev["worker"], ev["t_signal"] + t0 - 0.5, end + t0 + 0.5)

    def report(self) -> dict:
        """Moves done and abandoned, and the actions that landed during one (with its fate)."""
        w = self.watch
        moves = list(w.moves) if w else []
        during = []
        for ev in self.actions:
            mv = ev.get("move")
            if not mv:
                continue
            fate = moves[mv["index"]]["state"] if mv["index"] < len(moves) else "unfinished"
            during.append({"action": ev["action"], "worker": ev["worker"], "state_seen": mv["state"],
                           "fate": fate, "t_signal": ev["t_signal"]})
        versions = [s[1] for s in (w.samples if w else []) if s[1] is not None]
        return {"moves": {"done": sum(m["state"] == "done" for m in moves),
                          "abandoned": sum(m["state"] == "abandoned" for m in moves),
                          "copies_added": sum(len(m["adds"] or []) for m in moves if m["state"] == "done")},
                "actions": len(self.actions), "actions_during_moves": len(during), "during": during,
                "abandoned_errors": [m["error"] for m in moves if m["state"] == "abandoned"][:10],
                "placement_versions": [min(versions), max(versions)] if versions else None,
                "samples": len(w.samples) if w else 0, "poll_errors": w.errors if w else 0,
                "settings": {"interval": self.args.eplb_interval, "window": self.args.eplb_window,
                             "redundant": self.args.redundant_experts, "max_moves": self.args.eplb_max_moves,
                             "skew_share": self.args.skew_share, "skew_period": self.args.skew_period}}

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


def targets(r: dict) -> list[dict]:
    """What makes a --eplb run mean something: moves happened, and actions landed during them."""
    e = r.get("eplb")
    if not e:
        return []
    n = e["moves"]["done"] + e["moves"]["abandoned"]
    return [{"target": "moves happened during the run (done + abandoned >= 1)", "met": n >= 1, "value": e["moves"]},
            {"target": "a worker killed or stopped during a move, at least once", "met": e["actions_during_moves"] >= 1,
             "value": e["actions_during_moves"]}]


def report_lines(r: dict) -> list[str]:
    e = r.get("eplb")
    if not e:
        return []
    fates: dict = {}
    for d in e["during"]:
        fates[d["fate"]] = fates.get(d["fate"], 0) + 1
    return [f"    eplb: moves done {e['moves']['done']}, abandoned {e['moves']['abandoned']} (copies added "
            f"{e['moves']['copies_added']}); placement versions {e['placement_versions']}; {e['actions_during_moves']} "
            f"of {e['actions']} actions during a move (its fate: {fates or '-'})"]
