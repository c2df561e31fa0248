"""`moe-bench load` for real: it starts a gateway (and the peers), drives the three modes,
and writes the JSON, markdown and plot; one run measures every system side by side. The
report is on stdout and nothing else is; progress and notes are on stderr; every rate of a
record is over one duration, so goodput never exceeds the request throughput."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PCT = ("p50", "p95", "p99", "p999")

pytestmark = pytest.mark.timeout(240)
HAVE_RAY = importlib.util.find_spec("ray") is not None


def load(tmp_path, *args, timeout=200, rc=0, prefix=(), env=None):
    out, png, md = tmp_path / "load.json", tmp_path / "load.png", tmp_path / "load.md"
    cmd = [*prefix, sys.executable, "-m", "bench.cli", "load", *args, "--json", str(out), "--plot", str(png),
           "--markdown", str(md), "--progress", "plain"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == rc, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    # progress and notes on stderr; stdout is the report (what --markdown wrote) and only that
    assert "/dev/shm left behind: nothing" in p.stderr
    assert p.stdout.startswith("### moe-bench load") and p.stdout.strip() == md.read_text().strip()
    for progress in ("ready in", "sent ", "/dev/shm", "wrote ", "load: mode"):
        assert progress not in p.stdout, progress
    assert png.stat().st_size > 10_000
    doc = json.loads(out.read_text())
    prov = doc["provenance"]
    assert {"version", "commit", "command", "host", "kernel", "cpu_model", "date_utc", "python", "numpy"} <= set(prov)
    assert "bench.cli load" in prov["command"] and prov["version"] and prov["date_utc"].endswith("+00:00")
    for r in doc["results"]:  # one duration: goodput never above the request throughput
        assert r["request_goodput"] <= r["request_throughput"] + 1e-12, r
        assert r["request_throughput"] == pytest.approx(r["completed"] / r["duration_s"])
        assert r["request_goodput"] == pytest.approx(r["good"] / r["duration_s"])
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["duration_s"])
    return doc, p.stdout


def test_fixed_rate_on_our_gateway(tmp_path):
    doc, stdout = load(tmp_path, "--mode", "fixed-rate", "--rate", "5", "--duration", "3", "--backend", "shm",
                       "--prefill", "16", "--decode", "2", "--warmup", "0.5")
    (r,) = doc["results"]
    assert r["system"] == "moe-transport" and r["backend"] == "shm" and r["mode"] == "fixed-rate"
    assert r["target_rate"] == 5.0
    assert r["failed"] == 0 and r["completed"] == r["requests"] == 15
    assert abs(r["start_rate"] / 5.0 - 1) < 0.1
    assert r["duration_s"] >= 3.0 and abs(r["request_throughput"] / 5.0 - 1) < 0.1
    assert r["tokens_per_s"] > 0 and r["tokens"] == 15 * 18
    assert r["total_input_tokens"] == 15 * 16 and r["total_output_tokens"] == 15 * 3
    # 15 requests: p99 and p99.9 are flagged, in the JSON and in the report
    assert r["ttft_ms"]["samples"] == 15 and r["ttft_ms"]["reliable"]["p99"] is False
    assert "P99 TTFT (ms)*:" in stdout and "too few samples" in stdout
    assert "Successful requests:                     15" in stdout and "Failed requests:                         0" in stdout
    assert doc["meta"]["layer"]["d_ff"] == 512 and doc["meta"]["gateway_config"]["d_model"] == 256
    for k in ("ttft_ms", "tpot_ms", "e2e_ms"):
        q = r[k]
        assert 0 < q["p50"] <= q["p95"] <= q["p99"] <= q["p999"], (k, q)
    assert r["ttft_ms"]["p50"] < r["e2e_ms"]["p50"]
    # goodput counts the requests within the SLOs: never above throughput (whether a request
    # meets an SLO is timing, which a test does not assert)
    assert 0 <= r["request_goodput"] <= r["request_throughput"]
    assert r["goodput_share"] == pytest.approx(r["good"] / r["completed"])
    assert set(r["cpu_cores"]) == {"gateway", "worker0", "worker1", "load-generator"} and r["cpu_cores"]["gateway"] > 0
    assert r["stage_ms"]["compute"] > 0 and r["failed_requests"] == 0
    # the model of the all-to-all volume is what the transport counted (payload bytes)
    cv = doc["models"]["comm_volume"]
    assert cv["total_bytes"] == 2 * cv["assignments"] * 256 * 4
    assert cv["measured_over_model"] == pytest.approx(1.0, abs=1e-9)
    assert sum(r["gateway_expert_rows"]) == cv["assignments"]
    lru = doc["models"]["lru_hit_rate"]
    assert len(lru) == 8 and lru == sorted(lru) and lru[-1] > 0.9


@pytest.fixture
def loopback_netns():
    """A network namespace with only loopback up, or None where none can be made (not root).
    The Ray peer starts a local Ray, which binds the machine's interface address by default:
    in here it can only have 127.0.0.1."""
    from bench.netns_cluster import NetnsError, NetnsLan

    lan = NetnsLan(1, tag=f"moel{os.getpid() % 100000}", loopback_only=True)
    try:
        lan.open()
    except NetnsError:
        yield None
        return
    try:
        yield lan
    finally:
        leaked = lan.close()
    assert not leaked, f"left in the namespace: {leaked}"


def test_all_systems_side_by_side_with_a_hot_expert(tmp_path, loopback_netns):
    import shutil
    import tempfile

    # every system runs inside the namespace (the gateway and the peers see the same machine);
    # without one, the Ray peer is left out rather than let onto the machine's network
    with_ray = loopback_netns is not None
    env, ray_tmp = None, None
    if with_ray:
        ray_tmp = tempfile.mkdtemp(prefix="moeray", dir="/tmp")  # not the machine's shared /tmp/ray
        env = dict(os.environ, RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0")
    try:
        doc, stdout = load(tmp_path, "--mode", "mixed", "--rate", "6", "--duration", "3", "--warmup", "0.3",
                           "--systems", "all" if with_ray else "moe-transport,multiprocessing,reference",
                           "--backend", "shm", "--backend", "tcp", "--scenario", "hot",
                           "--hot-expert", "5", "--hot-share", "0.6", "--prefill", "16", "--decode", "3",
                           "--arrival-cv", "3", "--concurrency", "3", rc=0 if HAVE_RAY or not with_ray else 1,
                           prefix=loopback_netns.exec(0) if with_ray else (), env=env)
        if with_ray and HAVE_RAY:  # Ray ran where we put it, on loopback only
            import glob

            logs = glob.glob(os.path.join(ray_tmp, "ray", "session_*", "logs", "raylet.out"))
            assert logs and all("node_manager address: 127.0.0.1:" in open(f).read() for f in logs), logs
    finally:
        if ray_tmp:
            shutil.rmtree(ray_tmp, ignore_errors=True)
    systems = [(r["system"], r["backend"]) for r in doc["results"]]
    want = [("moe-transport", "shm"), ("moe-transport", "tcp"), ("multiprocessing", "pipe"), ("ray", "ray"),
            ("reference", "inproc")]
    if not with_ray:
        assert systems == [s for s in want if s[0] != "ray"]
    elif HAVE_RAY:
        assert systems == want and not doc["failed_systems"]
    else:  # the ray extra is not installed: that peer says how to get it, the others run
        assert systems == [s for s in want if s[0] != "ray"]
        assert "moe-transport[ray]" in doc["failed_systems"]["ray"]
    for r in doc["results"]:
        assert r["mode"] == "mixed" and r["failed"] == 0 and r["completed"] > 0, r
        assert r["arrival"] == "gamma" and r["arrival_cv"] == 3
        assert r["burstiness"] == pytest.approx(1 / 9)  # vLLM's shape for a CV of 3
        # every system got the same requests: same schedule, lengths and tokens
        assert (r["requests"], r["tokens"]) == (doc["results"][0]["requests"], doc["results"][0]["tokens"])
        assert max(range(8), key=lambda e: r["expert_load"][e]) == 5  # the scenario held
        for k in ("ttft_ms", "tpot_ms", "e2e_ms"):
            assert all(r[k][p] > 0 for p in PCT)
    ours = {(x["ours"], x["peer"]) for x in doc["ratios"]}
    peers = ("multiprocessing", "ray", "reference") if HAVE_RAY and with_ray else ("multiprocessing", "reference")
    assert ours == {(f"moe-transport/{b}", p) for b in ("shm", "tcp") for p in peers}
    assert all(x["tokens_per_s"] > 0 and x["p99_tpot_lower_by"] > 0 for x in doc["ratios"])
    share = doc["models"]["expert_load"]["share"]
    assert share[5] > 0.3  # (top-2: the second choices spread the rest)
    assert ("| ray |" in stdout) == (HAVE_RAY and with_ray) and "tokens/s ratio" in stdout


def test_ramp_finds_the_knee(tmp_path):
    """A ramp far past what 2 clients can carry (each request is 9 passes of ~1 ms): it stops
    at the first saturated step (the queueing delay grows) and reports the knee below it."""
    doc, stdout = load(tmp_path, "--mode", "ramp", "--rate", "400", "--ramp-start", "5", "--ramp-steps", "4",
                       "--step-duration", "1.5", "--backend", "shm", "--prefill", "128", "--decode", "8",
                       "--concurrency", "2", "--warmup", "0.3", "--scenario", "drift", "--drift-period", "0.5")
    recs = doc["results"]
    assert [r["step"] for r in recs] == list(range(len(recs)))
    assert recs[-1]["saturated"] and all(not r["saturated"] for r in recs[:-1])
    assert doc["knee_rate"] == (recs[-2]["target_rate"] if len(recs) > 1 else None)
    assert doc["knee"]["reached"] == (len(recs) > 1) and doc["knee"]["saturated_at"] == recs[-1]["target_rate"]
    assert [r["target_rate"] for r in recs] == sorted(r["target_rate"] for r in recs)
    assert doc["knee"]["text"] in stdout and "knee not reached" not in stdout
    bins = doc["models"]["expert_load"]["bins"]
    hot = [max(range(8), key=lambda e: b[e]) for b in bins if sum(b) > 0]
    assert len(set(hot)) > 1  # the drifting popularity moved the hottest expert over time


def test_ramp_that_never_saturates_says_so(tmp_path):
    """Two light steps far below what the layer carries: no step saturates, so there is no
    knee to report, only a lower bound, and the top step is not called the knee."""
    doc, stdout = load(tmp_path, "--mode", "ramp", "--rate", "4", "--ramp-start", "2", "--ramp-steps", "2",
                       "--step-duration", "1", "--backend", "tcp", "--prefill", "8", "--decode", "1",
                       "--concurrency", "2", "--warmup", "0.2", "--slo-tpot-ms", "2000")
    recs = doc["results"]
    assert [r["target_rate"] for r in recs] == [2.0, 4.0] and not any(r["saturated"] for r in recs)
    assert doc["knee"]["reached"] is False and doc["knee"]["at_least"] == 4.0 and doc["knee_rate"] is None
    assert "knee not reached (>= 4 req/s)" in stdout
    assert "top step 2 @ 4 req/s, knee not reached" in stdout
