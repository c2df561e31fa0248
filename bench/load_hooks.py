"""What a `moe-bench load` run of a started gateway can do beside its load, as hooks.

bench.load's run_system starts these once its clients exist (before the warm-up) and ends
them before the system stops; each writes its findings into the run's record:

- ``answers`` (``--check-answers``): every answer kept, checked against the reference
  layer after the clock stops (bench/answer_check.py);
- ``placement_timeline`` (``--eplb``, ``--compare placement=...``): ``placement show``
  polled during the run, moves and balancedness over time (bench/placement_timeline.py),
  and what they say about the requests (bench/placement_bench.py);
- ``elastic`` (``--scale-at SECONDS:N``): ``workers scale N`` under load, tokens/s before
  and after, join-to-first-served and the failures of a drain (bench/elastic.py).
"""
from __future__ import annotations

import os
from typing import Any

from bench import elastic
from bench.answer_check import AnswerLog
from bench.output import note
from bench.placement_bench import analyse_run
from bench.placement_timeline import PlacementTimeline
from gateway.client import GatewayClient


class AnswerHook:
    def __init__(self, pool: Any, bank: Any, router: Any, args: Any) -> None:

        self.log, self.bank, self.router, self.args = AnswerLog(), bank, router, args
        pool.on_answer = self.log.answer

    def finish(self, out: dict) -> None:

        v = self.log.verify(self.bank, self.args.d_ff, self.args.seed, self.router)
        out["answers"] = v
        note(f"  answers checked against the reference: {v['checked']}, wrong {v['wrong']}"
             + (f", {v['unkept']} past the memory cap not checked" if v["unkept"] else ""))


class PlacementHook:
    def __init__(self, system: Any, pool: Any, clock: Any, t_run: float, args: Any) -> None:
        self.pool, self.t_run, self.args = pool, t_run, args
        # the slots a gateway started here announces may exceed the client's default cap
        self.client = GatewayClient(system.url, timeout=5.0,
                                    max_peer_slot_size=getattr(system, "max_peer_slot_size", None))
        self.timeline = PlacementTimeline(lambda: self.client.placement("show", timeout=5.0), clock.now, t_run,
                                          period=args.placement_poll).start()

    def finish(self, out: dict) -> None:

        try:
            out["placement_timeline"] = self.timeline.stop()
        finally:
            self.client.close()
        out["placement_analysis"] = analyse_run(out, list(self.pool.done), self.t_run, self.args)


def start(args: Any, name: str, system: Any, pool: Any, clock: Any, t_run: float, bank: Any, router: Any) -> list:
    """The hooks this run asked for (a started moe-transport gateway only)."""
    if name != "moe-transport" or getattr(system, "proc", None) is None:
        return []
    hooks: list = []
    try:
        if getattr(args, "eplb", False) or getattr(args, "placement_arm", None):
            hooks.append(PlacementHook(system, pool, clock, t_run, args))
        if getattr(args, "scale_at", None):

            hooks.append(elastic.ElasticHook(system, pool, clock, t_run, args))
        if getattr(args, "check_answers", False):  # last: it checks after the others have stopped
            hooks.append(AnswerHook(pool, bank, router, args))
    except BaseException:
        finish(hooks, {})
        raise
    return hooks


def finish(hooks: list, out: dict) -> None:
    """End every hook (each one's failure said, not hiding the others')."""

    for h in hooks:
        try:
            h.finish(out)
        except Exception as e:
            note(f"  {type(h).__name__}: {type(e).__name__}: {e}")
            out.setdefault("hook_errors", []).append(f"{type(h).__name__}: {type(e).__name__}: {e}")


# -- a single run's report (``moe-bench load`` without --compare) -----------------------------------------
def report(runs: list) -> str:
    """The hooks' sections of the report, for the runs that had them."""

    lines: list = []
    for r in runs:
        a = r.get("answers")
        if a is not None:
            lines += ["", f"**answers checked** against the reference layer after the run: {a['checked']}, wrong "
                          f"{a['wrong']}" + (f" ({a['unkept']} past the memory cap not checked)" if a["unkept"] else "")
                      + (f"; first: {a['examples'][0]}" if a["examples"] else "")]
        an = r.get("placement_analysis")
        if an is not None:
            tdm = an["tpot_during_moves"]
            d, s = tdm["during_moves"], tdm["steady"]
            b = [st["balancedness_mean"] for st in an["steps"].values() if st["balancedness_mean"] is not None]
            lines += ["", f"**placement** (polled every {r['placement_timeline']['poll_s']:g} s): moves done "
                          f"{an['moves']['done']}, abandoned {an['moves']['abandoned']}; physical experts at the end "
                          f"{an['physical']}; balancedness per step "
                          f"{', '.join(f'{x:.3f}' for x in b) or '-'}; requests failed {an['failed']} "
                          f"({an['failed_during_moves']} during moves); p99 TPOT during moves "
                          f"{_ms(d['p99_ms'])} ms ({d['n']} requests) vs steady {_ms(s['p99_ms'])} ms ({s['n']})"]
            if an.get("drift"):
                dr = an["drift"]
                lines.append(f"drift: balancedness >= {dr['threshold']} two intervals after {dr['back']} of "
                             f"{len(dr['shifts'])} shifts")
        if r.get("elastic") is not None:
            lines += elastic.markdown(r["elastic"])
    return "\n".join(lines) + ("\n" if lines else "")


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def plots(runs: list, path: str) -> None:
    """Figures of their own beside --plot: ``<path>-elastic.png`` for --scale-at."""

    for r in runs:
        if r.get("elastic") is not None:
            root, ext = os.path.splitext(path)
            p = f"{root}-elastic{ext or '.png'}"
            try:
                elastic.plot(r["elastic"], p)
                note(f"wrote {p}")
            except ImportError as e:
                note(f"no elastic plot: {e}")


def rc(runs: list) -> int:
    """1 when a hook found a wrong answer or a failed scale, else 0."""
    for r in runs:
        if (r.get("answers") or {}).get("wrong"):
            return 1
        el = r.get("elastic")
        if el is not None and (el["errors"] or any(e.get("failed_while_draining") for e in el["events"])):
            return 1
    return 0
