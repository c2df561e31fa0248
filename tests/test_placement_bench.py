"""The benchmark side of expert placement, in process: `--compare placement=...` maps each arm
to the started gateway's flags with one physical-expert budget (or is refused with the
reason), the timeline of a polled placement places moves and judges drift recovery and TPOT
during moves, the verdicts follow the targets, `--scale-at` is parsed and analysed, and the
answer check tells right answers from wrong ones against the real reference."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from bench import elastic as EL
from bench import load as L
from bench import load_clients as LCL
from bench import load_cli as LC
from bench import placement_bench as PB
from bench import placement_report as PR
from bench import placement_timeline as PT
from bench import schedule as S


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    LC.add_arguments(p)
    args = p.parse_args(list(argv))
    L.resolve(args)
    return args


# -- the axis and its arms -------------------------------------------------------------------------
def test_placement_arms_share_one_physical_expert_budget():
    a = parse("--compare", "placement=static,replicas,eplb", "--scenarios", "uniform,zipf,hot,drift")
    assert a.mode == "ramp" and a.placement_arms == ["static", "replicas", "eplb"]
    assert a.scenario_list == ["uniform", "zipf", "hot", "drift"]
    assert a.placement_replicas == 2 and a.redundant_experts == 8  # 8 experts x (2 - 1)
    assert a.check_answers is True
    static, repl, eplb = (PB.arm_args(a, arm, "zipf") for arm in ("static", "replicas", "eplb"))
    assert (static.replicas, static.eplb) == (1, False) and (repl.replicas, repl.eplb) == (2, False)
    assert (eplb.replicas, eplb.eplb) == (1, True) and eplb.scenario == "zipf"
    f = L.gateway_flags(eplb)
    assert f[f.index("--replicas") + 1] == "1" and f[f.index("--redundant-experts") + 1] == "8"
    assert "--eplb" in f and f[f.index("--eplb-interval") + 1] == "1.0"
    assert "--eplb" not in L.gateway_flags(repl) and L.gateway_flags(repl)[1] == "2"
    # every arm's balancedness is measured over the same window
    assert all("--eplb-window" in L.gateway_flags(x) for x in (static, repl, eplb))
    # physical experts: static 8, replicas 16, eplb 8 + 8 redundant
    assert 8 * eplb.replicas + eplb.redundant_experts == 8 * repl.replicas


def test_replicas_and_redundant_pass_through_and_pin_workers():
    a = parse("--compare", "placement=static,eplb", "--replicas", "2", "--local-workers", "4", "--n-experts", "16",
              "--worker-cpus", "0,1", "--eplb-interval", "0.5", "--eplb-max-moves", "3")
    assert a.redundant_experts == 16 and a.scenario_list == ["uniform"]
    f = L.gateway_flags(PB.arm_args(a, "eplb", "uniform"))
    assert f[f.index("--worker-cpus") + 1] == "0,1" and f[f.index("--eplb-max-moves") + 1] == "3"
    assert f[f.index("--eplb-interval") + 1] == "0.5"
    b = parse("--rate", "3", "--eplb", "--redundant-experts", "2", "--worker-cpus", "1")
    assert b.points == [] and b.redundant_experts == 2 and b.check_answers is False
    fb = L.gateway_flags(b)
    assert "--eplb" in fb and fb[fb.index("--worker-cpus") + 1] == "1"
    assert "--eplb" not in L.gateway_flags(parse("--rate", "3"))


def test_the_deepseek_preset_sets_the_routing_shape_and_given_flags_win():
    a = parse("--preset", "deepseek-v3", "--compare", "placement=static,eplb")
    assert (a.n_experts, a.top_k, a.local_workers, a.redundant_experts) == (256, 8, 8, 32)
    assert (a.d_model, a.d_ff) == (64, 64) and a.scenario_list == ["zipf"]
    b = parse("--preset", "deepseek-v3", "--compare", "placement=static,eplb", "--d-model", "32",
              "--scenarios", "uniform,zipf", "--redundant-experts", "16")
    assert b.d_model == 32 and b.scenario_list == ["uniform", "zipf"] and b.redundant_experts == 16


@pytest.mark.parametrize("argv, why", [
    (["--compare", "placement=static,dynamic"], "unknown ['dynamic']"),
    (["--compare", "placement=static,eplb", "--compare", "batching=fifo,expert-aware"], "experiment of its own"),
    (["--compare", "placement=static,replicas", "--replicas", "1"], "need --replicas >= 2"),
    (["--compare", "placement=static,replicas", "--replicas", "3"], "needs at least 3 --local-workers"),
    (["--compare", "placement=static,eplb", "--scenarios", "zipf,wavy"], "give distinct ones"),
    (["--compare", "placement=static,eplb", "--redundant-experts", "9"], "9 redundant experts do not fit"),
    (["--rate", "3", "--scenarios", "zipf,hot"], "--scenarios is for --compare placement"),
    (["--rate", "3", "--eplb", "--gateway", "tcp://127.0.0.1:1"], "drop --gateway"),
    (["--compare", "placement=static,eplb", "--noisy", "--check-answers"], "--check-answers: noisy"),
    (["--rate", "3", "--scale-at", "5:2", "--duration", "4"], "past the end of the load"),
    (["--rate", "3", "--scale-at", "5:2", "--scale-at", "2:1", "--duration", "9"], "in time order"),
    (["--mode", "ramp", "--scale-at", "1:2"], "use --mode fixed-rate"),
])
def test_bad_placement_flags_are_refused_with_the_reason(argv, why):
    with pytest.raises(LC.ConfigError) as e:
        parse(*argv)
    assert why in str(e.value)


def test_answers_are_not_checked_where_the_reference_cannot_redo_the_routing():
    a = parse("--compare", "placement=static,eplb", "--capacity-factor", "1.0")
    assert a.check_answers is False and "capacity factor" in a.answers_unchecked


def test_scale_events_parse():
    a = parse("--rate", "3", "--duration", "20", "--scale-at", "5:2", "--scale-at", "12.5:1")
    assert a.scale_at == [(5.0, 2), (12.5, 1)] and a.check_answers is True
    for bad in ("5", "x:2", "5:0", "-1:2"):
        with pytest.raises(SystemExit):
            parse("--rate", "3", "--scale-at", bad)


# -- the timeline ----------------------------------------------------------------------------------
def _doc(version, b, done=0, abandoned=0, history=(), runs=(), state=None):
    return {"version": version, "physical": 8 + version, "redundant": version,
            "layers": {"0": {"balancedness": b}}, "workers": [{"share": 0.5}, {"share": 0.5}],
            "eplb": {"runs": [list(r) for r in runs]},
            "rebalancer": {"move": {"state": state} if state else None, "moves": {"done": done, "abandoned": abandoned},
                           "history": list(history)}}


def test_the_timeline_places_moves_from_eplb_runs_or_conservatively():
    t_run = 100.0
    tl = PT.PlacementTimeline(lambda: {}, lambda: 0.0, t_run, period=0.2)
    tl.offset = 0.0  # the gateway's clock and the load tool's: one clock here
    tl.add(_doc(1, 0.6), t_run + 1.0)
    mv = {"state": "done", "reason": "eplb", "adds": [[0, 0, 1], [0, 1, 1]], "removes": [], "seconds": 0.02}
    # an EPLB run that gained (0.6 -> 0.95) at 101.1 started the move seen over at 101.2
    s = tl.add(_doc(2, 0.95, done=1, history=[mv], runs=[(101.1, 0.004, 0.6, 0.95)]), t_run + 1.2)
    assert s["min_balancedness"] == 0.95 and s["move"] is None and s["moves_done"] == 1
    (m,) = tl.moves
    assert m["exact"] and m["t_start"] == pytest.approx(1.1) and m["t_end"] == pytest.approx(1.124)
    assert m["adds"] == 2 and m["state"] == "done"
    # a move no EPLB run explains (an operator's, a drain): from the poll before, less its time, to this one
    op = {"state": "abandoned", "reason": "draining worker 1", "adds": [[0, 3, 0]], "removes": [], "seconds": 0.05,
          "error": "worker 0 was lost while loading"}
    tl.add(_doc(2, 0.95, done=1, abandoned=1, history=[mv, op], state="loading"), t_run + 1.6)
    m2 = tl.moves[-1]
    assert not m2["exact"] and m2["t_start"] == pytest.approx(1.15) and m2["t_end"] == pytest.approx(1.6)
    assert m2["error"] and tl.samples[-1]["move"] == "loading"
    # an EPLB run that gained nothing never explains a move
    tl.add(_doc(3, 0.97, done=2, abandoned=1, history=[mv, op, mv], runs=[(101.7, 0.003, 0.95, 0.955)]), t_run + 1.8)
    assert not tl.moves[-1]["exact"]
    assert PT.windows(tl.moves)[0] == pytest.approx((1.1, 1.124))


def test_tpot_during_moves_is_held_against_the_same_steps():
    spans = [(10.0, 10.1)]
    reqs = [(9.9, 10.05, 0.030, 0), (10.05, 10.2, 0.040, 0)]  # overlap a move
    reqs += [(1.0 + i * 0.01, 1.1 + i * 0.01, 0.010, 0) for i in range(50)]  # step 0, steady
    reqs += [(20.0 + i * 0.01, 20.1, 0.500, 1) for i in range(50)]  # step 1: no move, much slower: not compared
    r = PT.tpot_during_moves(reqs, spans)
    assert r["during_moves"]["n"] == 2 and r["steady"]["n"] == 50 and r["steps"] == [0]
    assert r["steady"]["p99_ms"] == pytest.approx(10.0) and r["during_moves"]["p99_ms"] == pytest.approx(39.9)
    assert r["ratio"] == pytest.approx(3.99) and not r["during_moves"]["p99_reliable"]
    none = PT.tpot_during_moves(reqs, [])
    assert none["during_moves"]["n"] == 0 and none["ratio"] is None


def test_drift_recovery_is_judged_two_intervals_after_each_shift():
    # shifts every 5 s; balancedness dips after each and is back by +1.5 s, except after the shift at 10 s
    samples = []
    for i in range(0, 200):
        t = i * 0.1
        since = t % 5.0
        b = 0.6 if since < 1.5 else 0.95
        if 10.0 <= t < 14.0:
            b = 0.7
        samples.append({"t": round(t, 3), "min_balancedness": b})
    r = PT.drift_recovery(samples, period=5.0, interval=1.0, t_from=0.0, t_to=19.9)
    assert [s["t"] for s in r["shifts"]] == [5.0, 10.0, 15.0]
    assert [s["back"] for s in r["shifts"]] == [True, False, True] and r["back"] == 2 and not r["all_back"]
    assert r["shifts"][0]["lowest_between"] == 0.6
    late = PT.drift_recovery(samples, period=5.0, interval=1.0, t_from=11.0, t_to=19.9)
    assert [s["t"] for s in late["shifts"]] == [15.0] and late["all_back"]
    assert PT.drift_recovery([], period=5.0, interval=1.0, t_from=0, t_to=20)["all_back"] is False


def _done(t0, step, steps=(0.01, 0.01), error=None):
    job = LCL.Job(S.Arrival(0, t0, step), 4, len(steps), True, np.arange(4 + len(steps)))
    d = LCL.Done(job, start=t0, first=t0 + 0.02, error=error)
    t = d.first
    d.passes = [(t0, job.idx[:4])]
    for s in steps:
        d.passes.append((t, job.idx[:1]))
        t += s
    d.steps, d.end = list(steps), t
    return d


def test_one_run_is_analysed_from_its_timeline_and_requests():
    t_run = 50.0
    done = [_done(t_run + 0.5 + 0.1 * i, -1) for i in range(5)] + [_done(t_run + 2 + 0.1 * i, 0) for i in range(10)]
    done += [_done(t_run + 2.05, 0, error="RemoteError: unavailable")]
    out = {"records": [{"step": 0, "saturated": False}],
           "placement_timeline": {"samples": [{"t": 1.0, "min_balancedness": 0.5, "physical": 8},
                                              {"t": 2.5, "min_balancedness": 0.9, "physical": 16}],
                                  "moves": [{"t_start": 2.0, "t_end": 2.1, "state": "done", "adds": 8}],
                                  "eplb_runs": [{"t": 2.2, "seconds": 0.002, "before": 0.5, "after": 1.0}]}}
    args = argparse.Namespace(scenario="zipf", eplb=True, eplb_interval=1.0, drift_period=5.0)
    r = PB.analyse_run(out, done, t_run, args)
    assert r["failed"] == 1 and r["failed_during_moves"] == 1 and "unavailable" in r["first_error"]
    assert r["moves"] == {"done": 1, "abandoned": 0, "copies_added": 8} and r["physical"] == 16
    assert r["tpot_during_moves"]["during_moves"]["n"] == 1 and r["tpot_during_moves"]["steady"]["n"] == 9
    assert r["steps"][0]["balancedness_mean"] == 0.9 and r["steps"][0]["eplb_seconds"] == pytest.approx(0.002)
    assert r["steps"][-1]["balancedness_mean"] is None  # no sample within the warm-up's requests
    assert r["eplb_runs"]["n"] == 1 and "drift" not in r
    share = PB.gateway_share({"stage_ms": {"route": 0.1, "dispatch": 0.2, "combine": 0.1, "total": 5.0,
                                           "own_cpu": 0.25}, "rounds": 100}, r["steps"][0])
    assert share["rebalance_ms"] == pytest.approx(0.02) and share["share"] == pytest.approx(0.42 / 5.0)
    assert share["own_cpu_ms"] == pytest.approx(0.27) and share["cpu_share"] == pytest.approx(0.27 / 5.0)
    old = PB.gateway_share({"stage_ms": {"route": 0.1, "dispatch": 0.2, "combine": 0.1, "total": 5.0},
                            "rounds": 100}, r["steps"][0])  # a gateway that does not count its CPU time
    assert old["cpu_share"] is None and old["share"] == pytest.approx(0.42 / 5.0)


# -- verdicts ----------------------------------------------------------------------------------------
def _point(scenario, arm, tps, *, mark="", failed=0, wrong=0, during=(0, None), share=None, cpu_share=None,
           drift=None):
    return {"scenario": scenario, "value": arm, "label": f"{arm} / {scenario}", "mark": mark,
            "at_knee": {"tokens_per_s": tps}, "answers": {"checked": 10, "wrong": wrong},
            "gateway_share": {"share": share, "cpu_share": cpu_share} if share is not None else None,
            "placement": {"failed": failed, "during_moves_n": during[0], "during_over_steady": during[1],
                          "drift_back": drift}}


def test_verdicts_follow_the_targets():
    pts = [_point("uniform", "eplb", 1000), _point("zipf", "static", 600), _point("zipf", "eplb", 950, share=0.05),
           _point("deepseek", "eplb", 500, share=0.3, cpu_share=0.08),
           _point("hot", "static", 700, failed=1), _point("hot", "eplb", 850, mark=">=", during=(3, 1.7), wrong=2),
           _point("drift", "eplb", 900, drift=[3, 4])]
    v = {x["target"]: x for x in PR.verdicts(pts)}
    assert v["zipf: eplb's knee tokens/s vs eplb under uniform routing"]["met"]
    assert v["zipf: eplb's knee tokens/s vs static"]["value"] == pytest.approx(950 / 600)
    assert not v["hot: eplb's knee tokens/s vs static"]["met"]  # 850 / 700 < 1.3
    assert "top steps" in v["hot: eplb's knee tokens/s vs static"]["note"]
    assert not v["drift: balancedness >= 0.9 two EPLB intervals after each shift (eplb)"]["met"]
    assert not v["static / hot: failed requests 0"]["met"] and v["static / zipf: failed requests 0"]["met"]
    assert not v["eplb / hot: wrong answers 0 (of 10 checked)"]["met"]
    assert not v["eplb / hot: p99 TPOT during moves vs steady (3 requests during moves)"]["met"]
    assert v["eplb / zipf: the gateway's own share of a round at the knee (wall time of its stages)"]["met"]
    assert "eplb / zipf: the gateway's own share of a round at the knee (its CPU time in them)" not in v
    assert not v["eplb / deepseek: the gateway's own share of a round at the knee (wall time of its stages)"]["met"]
    assert v["eplb / deepseek: the gateway's own share of a round at the knee (its CPU time in them)"]["met"]
    assert "eplb / uniform: p99 TPOT during moves vs steady (0 requests during moves)" not in v  # none: no verdict


# -- elastic -----------------------------------------------------------------------------------------
def test_scaling_is_analysed_from_the_passes_and_the_events():
    t_run = 0.0
    done = []
    for i in range(100):  # 1 pass/s of 5 rows before the scale-up at 10 s, 2/s after it serves
        done.append(_done(t_run + i * 0.1, 0, steps=()))
    passes = EL.pass_ends(done, t_run)
    assert len(passes) == 100 and all(r == 4 for _, r in passes)
    assert EL.rate_between(passes, 0.0, 10.0) == pytest.approx(40.0)
    events = [{"kind": "up", "n": 2, "t": 4.0, "workers_before": 1, "t_first_served": 4.5, "t_admitted": 4.2,
               "t_copies": 4.3},
              {"kind": "down", "n": 1, "t": 7.0, "workers_before": 2, "workers": [1], "t_removed": 7.4}]
    failed = _done(7.1, 0, steps=(), error="RemoteError: worker_failed")
    cpu = [(t, {"0": 0.5 * t, "1": 0.25 * t, "gateway": 0.1 * t}) for t in np.arange(0, 10, 0.5)]
    el = EL.analyse(events, done + [failed], t_run, 1.0, 10.0, [], cpu)
    up, down = el["events"]
    assert up["join_to_first_served_s"] == pytest.approx(0.5)
    assert up["tokens_per_s_before"] == pytest.approx(40.0) and up["speedup"] == pytest.approx(1.0)
    assert up["cores_before"] == {"0": 0.5, "1": 0.25, "gateway": 0.1}
    assert down["failed_while_draining"] == 1 and down["drain_s"] == pytest.approx(0.4) and el["failed"] == 1
    md = "\n".join(EL.markdown(el))
    assert "1 -> 2" in md and "[MISSED] scale 1 -> 2: tokens/s x1.00" in md and "[MISSED] drain 2 -> 1" in md


# -- answers -------------------------------------------------------------------------------------------
def test_answers_are_checked_against_the_reference_at_their_versions():
    from bench.answer_check import AnswerLog
    from bench.scenarios import TokenBank
    from bench.versioned import VersionedReference

    d, f, n, k, seed = 16, 32, 8, 2, 3
    ref = VersionedReference(d, f, n, k, seed=seed)
    bank = TokenBank(ref.router, per_expert=8, seed=1)

    class Client:
        last_expert_versions = {e: 0 for e in range(n)}

    log = AnswerLog()
    rng = np.random.default_rng(0)
    for j in range(6):
        idx = rng.integers(0, len(bank.tokens), 5 if j else 1)
        y = ref.forward(bank.rows(idx), {})
        if j == 2:
            y = y.copy()
            y[1] += 1e-2  # one row off
        log.answer(idx, y, Client())
    unnamed = Client()
    unnamed.last_expert_versions = None
    log.answer(idx, ref.forward(bank.rows(idx), {}), unnamed)
    v = log.verify(bank, f, seed, ref.router)
    assert v["checked"] == 7 and v["wrong"] == 2 and v["unnamed"] == 1
    assert any("1 of 5 rows" in e["why"] for e in v["examples"])
    small = AnswerLog(max_bytes=1)
    small.answer(idx, y, Client())
    assert small.unkept == 1 and len(small) == 0
