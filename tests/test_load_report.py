"""`moe-bench load`'s statistics and report on synthetic requests (no processes): one
duration for every rate (goodput never above throughput), vLLM's totals and wording, the
knee's wording when nothing saturated, percentiles flagged when their samples are too few,
the arrival flags, and the flag renames."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from bench import load as L
from bench import load_cli as LC
from bench import load_report as R
from bench import schedule as S
from bench.load_clients import Done, Job, segment_record
from bench.stats import Histogram


def _req(i, sched, qdelay, prefill_s, steps, P=16, error=None):
    d = Done(Job(S.Arrival(i, sched, 0, 10.0), P, len(steps)))
    d.start = sched + qdelay
    if error:
        d.error = error
        d.end = d.start + prefill_s
        return d
    d.first = d.start + prefill_s
    d.steps = list(steps)
    d.end = d.first + sum(steps)
    return d


def _random_segment(seed: int) -> list:
    """A segment with everything that made the old figures disagree: bursty arrivals, a
    backlog (starts lag the schedule), long tails that end after the schedule, failures,
    and requests on both sides of the SLOs."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 80))
    sched = np.cumsum(rng.gamma(0.3, 1 / (0.3 * 10.0), n))
    out = []
    for i, t in enumerate(sched):
        q = float(rng.exponential(0.05)) * (1 + i / 10)
        steps = list(rng.lognormal(np.log(0.02), 1.0, int(rng.integers(0, 6))))
        err = "RemoteError: refused" if rng.random() < 0.15 else None
        out.append(_req(i, float(t), q, float(rng.lognormal(np.log(0.05), 1.0)), steps,
                        P=int(rng.integers(1, 64)), error=err))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_goodput_never_exceeds_throughput_synthetic(seed):
    done = _random_segment(seed)
    dur = float(np.random.default_rng(seed + 1000).uniform(0.1, 5.0))  # the schedule's length
    r = segment_record(done, mode="fixed-rate", backend="shm", target_rate=10.0, duration=dur,
                       slo_tpot_ms=30.0, slo_ttft_ms=200.0)
    D = r["duration_s"]
    assert D > 0 and D >= dur - 1e-9
    # one duration: every rate is its count over D
    assert r["request_throughput"] == pytest.approx(r["completed"] / D)
    assert r["request_goodput"] == pytest.approx(r["good"] / D)
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / D)
    assert r["total_token_throughput"] == pytest.approx((r["total_input_tokens"] + r["total_output_tokens"]) / D)
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / D)
    assert r["request_goodput"] <= r["request_throughput"]
    assert r["goodput_tokens_per_s"] <= r["tokens_per_s"]
    assert r["good"] <= r["completed"] and r["completed"] + r["failed"] == r["requests"] == len(done)


def test_vllm_totals_and_failures():
    ok = [_req(i, i * 0.1, 0.001, 0.010, [0.004] * 3, P=16) for i in range(8)]
    bad = [_req(8 + i, 0.8 + i * 0.1, 0.001, 0.002, [], P=16, error="RemoteError: bad_dtype: no") for i in range(2)]
    slow = [_req(10, 1.0, 0.001, 0.500, [0.004] * 3, P=16)]  # TTFT 501 ms: outside a 100 ms TTFT SLO
    r = segment_record(ok + bad + slow, mode="fixed-rate", backend="shm", target_rate=10.0, duration=1.1,
                       slo_tpot_ms=100.0, slo_ttft_ms=100.0)
    assert (r["requests"], r["completed"], r["failed"], r["good"]) == (11, 9, 2, 8)
    assert r["total_input_tokens"] == 9 * 16
    assert r["total_output_tokens"] == 9 * 4  # the prefill's first token, then one per decode step
    assert r["tokens"] == 9 * (16 + 3)  # rows through the layer
    assert r["first_error"].startswith("RemoteError: bad_dtype")
    assert r["duration_s"] == pytest.approx(slow[0].end - 0.0)  # the last request ends after the schedule
    assert r["itl_ms"]["samples"] == 27 and r["tpot_ms"]["samples"] == 9
    assert r["saturated"] and "2 of 11 requests failed" in r["verdict"]  # failures are not "within SLO"


def test_every_request_failed_is_a_record_not_a_crash():
    bad = [_req(i, i * 0.1, 0.001, 0.002, [], error="RemoteError: unavailable") for i in range(5)]
    r = segment_record(bad, mode="ramp", backend="tcp", target_rate=10.0, duration=0.5, slo_tpot_ms=100.0, step=0)
    assert r["completed"] == 0 and r["failed"] == 5 and r["request_throughput"] == 0.0 == r["request_goodput"]
    assert r["ttft_ms"]["samples"] == 0 and np.isnan(r["ttft_ms"]["p99"])
    from bench import models as M
    load = M.expert_load([], 8)  # what the run records for such a step (it used to raise KeyError 'dropped')
    assert load["dropped"] == 0 and load["overflow"] == 0 and load["share"] == [0.0] * 8


def test_small_samples_are_flagged():
    h = Histogram(use_hdr=False)
    for v in range(14):
        h.record(0.001 * (v + 1))
    s = h.summary()
    assert s["samples"] == s["n"] == 14
    assert s["reliable"] == {"p50": True, "p95": False, "p99": False, "p999": False}
    h = Histogram(use_hdr=False)
    for v in range(150):
        h.record(0.001 * (v + 1))
    assert h.summary()["reliable"] == {"p50": True, "p95": True, "p99": True, "p999": False}
    assert Histogram(use_hdr=False).summary()["reliable"] == {"p50": False, "p95": False, "p99": False,
                                                              "p999": False}


def _args(**kw):
    base = dict(mode="fixed-rate", concurrency=4, prefill=16, decode=3, slo_tpot_ms=100.0, slo_ttft_ms=2000.0,
                arrival="constant", burstiness=None, arrival_cv=0.0, warmup=1.0, gateway=None, local_workers=2,
                max_wait_ms=1.0, max_inflight_rounds=2, max_batch_tokens=None)
    base.update(kw)
    return argparse.Namespace(**base)


def _run(records, knee=None):
    return {"system": "moe-transport", "backend": "shm", "records": records, "done": [], "knee": knee}


def _md(runs, args):
    from bench.provenance import provenance
    from bench.scenarios import Scenario
    models = {"comm_volume": {}, "lru_hit_rate": [], "expert_load": {}, "from_system": None}
    meta = {"layer": {"n_experts": 8, "top_k": 2, "capacity_factor": None, "d_model": 256, "d_ff": 512,
                      "d_ff_source": "test", "dtype": "float32"}, "gateway_config": {}}
    return R.markdown(runs, [], [], models, Scenario("uniform", 8), args, provenance(), meta)


def test_report_wording_marks_and_knee_not_reached():
    few = [_req(i, i * 0.1, 0.001, 0.010, [0.004] * 3) for i in range(14)]
    recs = []
    for j, rate in enumerate((5.0, 10.0)):
        r = segment_record(few, mode="ramp", backend="shm", target_rate=rate, duration=1.4, slo_tpot_ms=100.0, step=j)
        recs.append(r)
    verdicts = [S.StepVerdict(r["target_rate"], r["tpot_ms"]["p99"], r["queue_growing"], 100.0, failed=r["failed"],
                              requests=r["requests"]) for r in recs]
    knee = S.knee_of(verdicts)
    assert knee["reached"] is False and knee["rate"] is None and knee["at_least"] == 10.0
    assert knee["text"].startswith("knee not reached (>= 10 req/s)")
    assert S.find_knee(verdicts) is None  # the top step is not called the knee
    md = _md([_run(recs, knee)], _args(mode="ramp"))
    assert "knee not reached (>= 10 req/s)" in md
    assert "knee 10" not in md
    # vLLM's wording, one block for the top step
    for label in ("Successful requests:", "Failed requests:", "Maximum request concurrency:",
                  "Request rate configured (RPS):", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):", "Request goodput (req/s):",
                  "Output token throughput (tok/s):", "Total token throughput (tok/s):", "Mean TTFT (ms):",
                  "Median TTFT (ms):", "Mean TPOT (ms):", "Mean ITL (ms):", "Median E2EL (ms):",
                  "Time to First Token", "Time per Output Token (excl. 1st token)", "Inter-token Latency",
                  "End-to-end Latency"):
        assert label in md, label
    assert "top step 2 @ 10 req/s, knee not reached" in md
    # 14 samples: p95, p99 and p99.9 are marked, with the footnote
    assert "P99 TTFT (ms)*:" in md and "P99.9 E2EL (ms)*:" in md and "P95 TPOT (ms)*:" in md
    assert "too few samples" in md and "p99 needs 100" in md and "p99.9 needs 1000" in md
    row = next(line for line in md.splitlines() if line.startswith("| moe-transport/shm | 1 |"))
    assert row.count("*") >= 9  # p95, p99, p99.9 of TTFT, TPOT and E2EL
    # enough samples: no mark on p99
    many = [_req(i, i * 0.01, 0.001, 0.010, [0.004] * 3) for i in range(150)]
    r = segment_record(many, mode="fixed-rate", backend="shm", target_rate=100.0, duration=1.5, slo_tpot_ms=100.0)
    md = _md([_run([r])], _args())
    assert "P99 TTFT (ms):" in md and "P99 TTFT (ms)*:" not in md and "P99.9 TTFT (ms)*:" in md


def test_knee_reached_and_below_the_ramp():
    ok = S.StepVerdict(10, 5.0, False, 100.0)
    sat = S.StepVerdict(20, 150.0, False, 100.0)
    k = S.knee_of([ok, sat])
    assert k["reached"] and k["rate"] == 10 and k["saturated_at"] == 20 and k["text"].startswith("knee 10 req/s")
    k = S.knee_of([sat])
    assert not k["reached"] and k["below"] == 20 and "below the ramp" in k["text"]
    assert S.knee_of([])["text"] == "no step measured"
    assert not S.StepVerdict(10, 1.0, False, 100.0, failed=1, requests=5).ok
    assert not S.StepVerdict(10, 1.0, False, 100.0, failed=0, requests=0).ok


def _parser():
    p = argparse.ArgumentParser()
    LC.add_arguments(p)
    return p


def test_arrival_flags():
    p = _parser()
    a = p.parse_args(["--burstiness", "0.25"])
    L.resolve(a)
    assert a.arrival == "gamma" and a.burstiness == 0.25 and a.arrival_cv == pytest.approx(2.0)
    a = p.parse_args(["--arrival-cv", "2"])
    L.resolve(a)
    assert a.arrival == "gamma" and a.burstiness == pytest.approx(0.25) and a.arrival_cv == pytest.approx(2.0)
    a = p.parse_args(["--mode", "mixed"])
    L.resolve(a)
    assert a.arrival == "gamma" and a.burstiness == LC.MIXED_BURSTINESS  # mixed stays bursty by default
    a = p.parse_args(["--arrival", "gamma"])
    L.resolve(a)
    assert a.burstiness == 1.0 and a.arrival_cv == 1.0  # vLLM's default: Poisson
    a = p.parse_args([])
    L.resolve(a)
    assert a.arrival == "constant" and a.burstiness is None
    with pytest.raises(LC.ConfigError):
        L.resolve(p.parse_args(["--arrival", "constant", "--burstiness", "2"]))
    with pytest.raises(SystemExit):  # one or the other
        p.parse_args(["--burstiness", "1", "--arrival-cv", "1"])
    with pytest.raises(SystemExit):
        p.parse_args(["--burstiness", "0"])


def test_worker_count_flag_is_local_workers():
    from bench import moe_bench
    for mod in (LC, moe_bench):
        p = argparse.ArgumentParser()
        mod.add_arguments(p)
        assert p.parse_args(["--local-workers", "3"]).local_workers == 3
        with pytest.raises(SystemExit):  # no alias left: --workers means the gateway's URL list elsewhere
            p.parse_args(["--workers", "3"])
    a = _parser().parse_args([])
    L.resolve(a)
    assert a.local_workers == 2
