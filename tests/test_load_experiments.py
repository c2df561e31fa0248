"""`moe-bench load --sweep` and `--compare`: the flags parse into points (or are refused
with the reason), the report and table are built from the points' records, and for real:
a sweep over the number of experts and a comparison of batching policies, each point its
own started gateway ramped to its knee, with the routing flags passed through (the
gateways' own configuration says so) and the routing analysed from the gateways' own
counters."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from bench import experiments_report as XR
from bench import load as L
from bench import load_cli as LC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    LC.add_arguments(p)
    args = p.parse_args(list(argv))
    L.resolve(args)
    return args


def test_sweep_and_compare_parse_into_points():
    a = parse("--sweep", "n-experts=8,16,32")
    assert a.mode == "ramp" and [(p["axis"], p["value"]) for p in a.points] == [("n_experts", v) for v in (8, 16, 32)]
    b = parse("--compare", "batching=fifo,expert-aware", "--compare", "inflight=1,2")
    assert [(p["axis"], p["value"], p["baseline"]) for p in b.points] == [
        ("batching", "fifo", True), ("batching", "expert-aware", False),
        ("max_inflight_rounds", 1, True), ("max_inflight_rounds", 2, False)]
    assert parse("--rate", "3").points == [] and parse("--rate", "3").mode == "fixed-rate"
    c = parse("--compare", "chunks=off,auto,64")  # pipelined rounds: one spelling per setting
    assert [(p["axis"], p["value"], p["baseline"]) for p in c.points] == [
        ("chunk_rows", "off", True), ("chunk_rows", "auto", False), ("chunk_rows", "64", False)]
    assert parse("--chunk-rows", "0").chunk_rows == "off" and parse("--rate", "3").chunk_rows == "auto"


@pytest.mark.parametrize("argv, why", [
    (["--sweep", "d_ff=1,2"], "KEY one of n_experts, top_k, d_model"),
    (["--sweep", "n_experts=8"], "two or more different values"),
    (["--sweep", "top_k=a,b"], "top_k takes int values"),
    (["--compare", "batching=fifo,random"], "unknown ['random']"),
    (["--compare", "batching=fifo,expert-aware", "--compare", "batching=fifo,expert-aware"], "given twice"),
    (["--sweep", "n_experts=4,8", "--compare", "batching=fifo,expert-aware"], "separate experiments"),
    (["--sweep", "n_experts=4,8", "--mode", "fixed-rate"], "contradict --mode fixed-rate"),
    (["--sweep", "n_experts=4,8", "--systems", "moe-transport,reference"], "drop --systems"),
    (["--compare", "inflight=0,2"], "values must be >= 1"),
    (["--compare", "chunk_rows=off,many"], "chunk rows must be"),
    (["--compare", "chunk_rows=off,0"], "two or more different values"),
])
def test_bad_experiments_are_refused_with_the_reason(argv, why):
    with pytest.raises(LC.ConfigError, match=None) as e:
        parse(*argv)
    assert why in str(e.value)


def _rec(step, rate, saturated, tps, tpot_mean=5.0, tpot_p99=9.0):
    pct = {"mean": tpot_mean, "p50": tpot_mean, "p99": tpot_p99, "n": 150, "reliable": {"p99": True}}
    return {"step": step, "target_rate": rate, "saturated": saturated, "tokens_per_s": tps,
            "request_throughput": rate, "tpot_ms": pct, "ttft_ms": dict(pct, p99=20.0), "e2e_ms": dict(pct),
            "queue_ms": {"p99": 1.0}, "verdict": "x", "stage_ms": {"queue": 0.1, "dispatch": 0.2, "wait": 1.0,
                                                                   "combine": 0.1}, "passes_per_round": 1.5}


def test_the_point_is_judged_at_its_knee_or_marked():
    recs = [_rec(0, 10, False, 100), _rec(1, 20, False, 200), _rec(2, 30, True, 250)]
    run = {"records": recs, "knee": {"reached": True, "rate": 20}}
    assert XR.at_knee(run) == (recs[1], "")
    assert XR.at_knee({"records": recs[:2], "knee": {"reached": False, "at_least": 20}}) == (recs[1], ">=")
    assert XR.at_knee({"records": [recs[2]], "knee": {"reached": False, "below": 30}}) == (recs[2], "<")


def test_sweep_table_has_a_row_per_value_with_knee_figures():
    args = parse("--sweep", "n_experts=8,16", "--rate", "30", "--ramp-steps", "3", "--step-duration", "2")
    points = []
    for pt, tps in zip(args.points, (250.0, 180.0)):
        res = {"runs": [{"records": [_rec(0, 10, False, 100), _rec(1, 20, False, tps), _rec(2, 30, True, 300)],
                         "knee": {"reached": True, "rate": 20, "text": "knee 20"}, "gateway_config": {}}],
               "models": {"gateway_routing": {"max_over_mean": 1.25}}, "rc": 0}
        points.append(XR.combine(pt, [XR.summary(pt, res)]))
    md = XR.markdown(args, {"version": "0", "commit": None, "command": "moe-bench load --sweep n_experts=8,16"},
                    points)
    rows = [ln for ln in md.splitlines() if ln.startswith("| 8 |") or ln.startswith("| 16 |")]
    assert len(rows) == 2
    assert rows[0].split(" | ")[1:4] == ["20", "250", "5.00"] and rows[1].split(" | ")[2] == "180"
    assert "1.25x" in rows[0] and "| experts | knee req/s | tokens/s at the knee | latency mean ms" in md


def test_repeats_combine_into_medians_and_the_noise_floor_is_reported():
    args = parse("--compare", "batching=fifo,expert-aware", "--compare", "inflight=1,2", "--repeat", "3")

    def trial(pt, tps):
        res = {"runs": [{"records": [_rec(0, 10, False, tps), _rec(1, 20, True, tps)],
                         "knee": {"reached": True, "rate": 10, "text": "knee 10"}, "gateway_config": {}}],
               "models": {"gateway_routing": {"max_over_mean": 1.1}}, "rc": 0}
        return XR.summary(pt, res)

    figures = {"batching=fifo": (100, 140, 120), "batching=expert-aware": (300, 310, 320),
               "max_inflight_rounds=1": (50, 60, 55), "max_inflight_rounds=2": (110, 150, 130)}
    points = [XR.combine(pt, [trial(pt, v) for v in figures[pt["label"]]]) for pt in args.points]
    fifo, aware, one, two = points
    assert fifo["at_knee"]["tokens_per_s"] == 120 and fifo["tokens_per_s_range"] == [100, 140]
    assert XR._verdict(aware, fifo) == "higher, beyond the spread"
    assert XR._verdict(two, fifo) == "within the spread"  # (110-150 overlaps 100-140)
    assert XR._verdict(one, two) == "lower, beyond the spread"
    md = XR.markdown(args, {"version": "0", "commit": None, "command": "c"}, points)
    # batching=fifo and max_inflight_rounds=2 are one configuration (fifo, 2 rounds in flight by default)
    floor = next(ln for ln in md.splitlines() if ln.startswith("**noise floor**"))
    assert "measured 6 times" in floor and "batching=fifo, max_inflight_rounds=2" in floor
    assert "10 / 10 / 10" in md  # every repeat's knee


def run_load(tmp_path, *args, timeout=400):
    out, png = tmp_path / "x.json", tmp_path / "x.png"
    cmd = [sys.executable, "-m", "bench.cli", "load", "--rate", "16", "--ramp-steps", "2", "--step-duration", "1.5",
           "--warmup", "0.3", "--concurrency", "3", "--prefill", "8", "--decode", "3", "--progress", "none",
           "--json", str(out), "--plot", str(png), *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "/dev/shm left behind: nothing" in p.stderr
    assert png.stat().st_size > 10_000
    return json.loads(out.read_text()), p.stdout


@pytest.mark.timeout(420)
def test_expert_sweep_for_real(tmp_path):
    doc, stdout = run_load(tmp_path, "--sweep", "n_experts=4,8", "--top-k", "1")
    pts = doc["points"]
    assert [p["value"] for p in pts] == [4, 8]
    for p in pts:  # each point its own gateway, with that many experts
        assert p["gateway_config"]["n_experts"] == p["value"] and p["gateway_config"]["top_k"] == 1
        assert p["at_knee"]["tokens_per_s"] > 0 and len(p["records"]) >= 1
        (t,) = p["trials"]
        gr = t["gateway_routing"]
        assert len(gr["rows"]) == p["value"]
        # top-1, no capacity: the gateway dispatched exactly one row per token of the layer
        assert sum(gr["rows"]) == sum(r["tokens"] for r in t["records"])
        for rec in t["records"]:  # each step: messages a round, and auto's choice at its end
            assert 1 <= rec["messages_per_round"] <= 2  # parts whole, on one or both of the 2 workers
            assert {"asked", "measured", "settled", "chunks_kept"} <= set(rec["chunk_costs"])
    table = [ln for ln in stdout.splitlines() if ln.startswith("| 4 |") or ln.startswith("| 8 |")]
    assert len(table) == 2, stdout


@pytest.mark.timeout(420)
def test_batching_comparison_passes_the_routing_flags_through(tmp_path):
    doc, stdout = run_load(tmp_path, "--compare", "batching=fifo,expert-aware", "--replicas", "2", "--noisy",
                           "--noise-std", "0.3", "--overflow", "spill", "--capacity-factor", "2",
                           "--gate-bias=0.4,0,0,0,0,0,0,0", "--balancing", "least-loaded", "--backend", "tcp",
                           "--chunk-rows", "5")
    pts = doc["points"]
    assert [p["value"] for p in pts] == ["fifo", "expert-aware"]
    for p in pts:
        cfg = p["gateway_config"]
        r = cfg["router"]
        assert cfg["batching"] == p["value"] and cfg["balancing"] == "least-loaded" and cfg["replicas"] == 2
        assert cfg["chunk_rows"] == 5
        assert r["noisy"] is True and r["noise_std"] == pytest.approx(0.3) and r["overflow"] == "spill"
        assert r["capacity_factor"] == 2 and r["bias"][0] == pytest.approx(0.4) and r["bias"][1:] == [0.0] * 7
        assert p["at_knee"]["tokens_per_s"] > 0
        (t,) = p["trials"]
        gr = t["gateway_routing"]  # the gateway's own counters: top-2 rows, less what it dropped
        assert sum(gr["rows"]) + gr["dropped"] == 2 * sum(rec["tokens"] for rec in t["records"])
        # chunks of 5 rows: an 8-token prefill's 16 rows take more messages than workers
        assert max(rec["messages_per_round"] for rec in t["records"]) > 2
    assert "**batching** (against fifo)" in stdout and "| expert-aware |" in stdout
