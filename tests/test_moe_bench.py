"""`moe-bench moe` end to end at smoke size: every system computes the reference's layer (the
tool checks it before timing), the whole-part and chunked moe-transport run side by side, and
the JSON carries the pipelining figures (gain, its bound from the workers' own clocks, and
the messages a round took). It asserts what was measured, never how fast."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.torch_extra import require_torch_extra

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(300)


def test_moe_bench_sets_chunked_rounds_beside_whole_parts(tmp_path):
    out = tmp_path / "moe.json"
    cmd = [sys.executable, "-m", "bench.cli", "moe", "--quick", "--rounds", "1", "--batches", "3", "--backend", "shm",
           "--d-model", "64", "--d-ff", "128", "--batch", "64", "--chunk-rows", "16", "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    systems = {(r["system"], r["backend"]) for r in data["results"]}
    assert {("moe-transport", "shm"), ("moe-transport+chunks", "shm")} <= systems
    by = {(r["system"], r["backend"]): r for r in data["results"]}
    whole, chunked = by[("moe-transport", "shm")], by[("moe-transport+chunks", "shm")]
    assert whole["stage_ms"]["messages"] == 2  # one message per worker
    # 64 tokens x top-2 = 128 rows over 2 workers, in messages of at most 16 rows
    assert chunked["stage_ms"]["messages"] >= 128 / 16
    # both ways on the same two worker processes: the gain is the chunks', not the processes'
    assert len(whole["worker_pids"]) == 2 and chunked["worker_pids"] == whole["worker_pids"]
    # the no-token time is the forward's, routing aside: within the forward, past the round's
    # clock (which stops at the last reply, before a whole part's combine)
    st = whole["stage_ms"]
    assert 0 <= st["no_token"] <= st["forward"] - st["route"] and st["total"] <= st["forward"]
    g = data["ratios"]["shm"]["chunks"]
    assert g["bound"] == pytest.approx(st["forward"] / (st["forward"] - st["no_token"]))
    assert g["round_ms"] == st["forward"] and g["no_token_ms"] == st["no_token"]
    assert g["bound"] >= 1 and g["gain"] > 0 and g["messages"] == chunked["stage_ms"]["messages"]
    assert g["p50_gain"] == pytest.approx(whole["p50_ms"] / chunked["p50_ms"])
    assert g["of_bound"] == pytest.approx((g["p50_gain"] - 1) / (g["bound"] - 1))
    # the cores' bound: the forward over its CPU work spread on the cores, never above the other
    assert 1 <= g["cpu_bound"] <= g["bound"] + 1e-9 and g["cores"] >= 1
    assert g["cpu_bound"] <= st["forward"] / st["gateway_cpu"] + 1e-9  # not above the gateway's own work
    assert st["gateway_cpu"] > 0 and st["compute_total"] > 0
    assert "chunked rounds" in p.stdout and "of the possible gain" in p.stdout
    # where the missing share went: parts from the two systems' own medians, adding up
    sf, cst = g["shortfall"], chunked["stage_ms"]
    assert sf["missing"] == pytest.approx(100 * (1 - g["of_bound"]))
    assert sf["own_no_token"] == pytest.approx(100 * cst["no_token"] / st["no_token"])
    assert sf["busier"] == pytest.approx(100 * (cst["busiest"] - st["busiest"]) / st["no_token"])
    assert sum(sf[k] for k in ("own_no_token", "busier", "routing", "rest")) == pytest.approx(sf["missing"])
    assert "points of the bound missing" in p.stdout


def test_the_shortfall_parts_are_the_chunked_rounds_costs_in_points_of_the_bound():
    """A chunked forward S ms over the bound's F - I realizes about 1 - S / I of it: its own
    no-token time, a busier worker and slower routing each cost 100 / I points a ms; what
    the medians leave unattributed is the rest."""
    from bench.moe_layer import gain_bounds, shortfall
    whole = {"no_token": 10.0, "busiest": 130.0, "route": 3.0}
    chunked = {"no_token": 2.0, "busiest": 131.0, "route": 3.5}
    F = 143.0  # the whole forward: route + busiest + no-token
    Fc = chunked["route"] + chunked["busiest"] + chunked["no_token"]  # 136.5: 3.5 ms over the bound's 133
    share = gain_bounds(F, whole["no_token"], 1.0, 1.0, F / Fc)["of_bound"]
    sf = shortfall(whole, chunked, share)
    assert sf["own_no_token"] == pytest.approx(20.0) and sf["busier"] == pytest.approx(10.0)
    assert sf["routing"] == pytest.approx(5.0)
    assert sf["missing"] == pytest.approx(100 * (1 - share))
    assert abs(sf["rest"]) < 3  # 1 - S / I is close, S being small against F
    assert sum(sf[k] for k in ("own_no_token", "busier", "routing", "rest")) == pytest.approx(sf["missing"])
    # a chunked round that took nothing more than the bound: nothing missing, nothing attributed
    ideal = {"no_token": 0.0, "busiest": 130.0, "route": 3.0}
    sf0 = shortfall(whole, ideal, gain_bounds(F, 10.0, 1.0, 1.0, F / 133.0)["of_bound"])
    assert all(sf0[k] == pytest.approx(0.0, abs=1e-9) for k in sf0)
    # no bound to share (a whole part with no no-token time): no figures, not a division by zero
    assert all(v != v for v in shortfall({**whole, "no_token": 0.0}, chunked, float("nan")).values())


def test_moe_bench_on_a_machine_with_no_secret_yet(tmp_path):
    """A fresh machine has no per-user secret: the workers make one and require it, so the
    benchmark's own pool must use that same one (it went without and was refused)."""
    env = {k: v for k, v in os.environ.items() if k != "MOE_SECRET_FILE"}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    cmd = [sys.executable, "-m", "bench.cli", "moe", "--quick", "--rounds", "1", "--batches", "1", "--backend", "tcp",
           "--d-model", "32", "--d-ff", "64", "--batch", "16", "--chunk-rows", "off",
           "--json", str(tmp_path / "moe.json")]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    secret = tmp_path / "config" / "moe-transport" / "secret"
    assert secret.exists() and secret.stat().st_mode & 0o077 == 0
    results = json.loads((tmp_path / "moe.json").read_text())["results"]
    assert any(r["system"] == "moe-transport" and r["backend"] == "tcp" for r in results)


def test_kernel_bench_runs_bf16_chunked_rounds_beside_whole_parts(tmp_path):
    """`moe-bench moe --compute torch --dtype bfloat16`: the torch kernel behind bf16 on the
    wire, parts whole and in chunks (summed in float32 as they land, rounded once), every
    system checked against the numpy fp32 layer before timing."""
    require_torch_extra()  # skips only where the extra is not meant to be installed
    out = tmp_path / "kernels.json"
    cmd = [sys.executable, "-m", "bench.cli", "moe", "--compute", "torch", "--dtype", "bfloat16", "--quick",
           "--rounds", "1", "--batches", "2", "--d-model", "64", "--d-ff", "128", "--batch", "48",
           "--chunk-rows", "16", "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    b = json.loads(out.read_text())["batches"]["48"]
    assert {"moe-transport/torch-bfloat16", "moe-transport/torch-bfloat16+chunks"} <= set(b["tokens_per_s"])
    assert b["chunked_vs_whole"] > 0 and "chunked rounds" in p.stdout
    # and the bound it is set against, from the whole parts' own clocks
    assert b["chunks_bound"] >= 1 and 0 <= b["no_token_ms"] and "of the possible gain" in p.stdout
    # and the gateway's own work, which no chunking takes off its thread
    assert b["gateway_cpu_ms"] > 0 and 1 <= b["chunks_cpu_bound"] <= b["chunks_bound"] + 1e-9
    # and where the missing share went, from the chunked system's own clocks
    sf = b["chunks_shortfall"]
    assert sf["own_no_token"] == pytest.approx(100 * b["chunked_no_token_ms"] / b["no_token_ms"])
    assert sum(sf[k] for k in ("own_no_token", "busier", "routing", "rest")) == pytest.approx(sf["missing"])
    assert "points of the bound missing" in p.stdout


def test_a_start_that_fails_leaves_no_worker_running(monkeypatch):
    """When the pool cannot be made (a refused handshake, a dead worker), the workers the
    benchmark had spawned are stopped: orphans held the caller's stdout open, and a test
    reading it waited for its whole timeout."""
    import gateway.pool
    from bench.moe_layer import TransportSystem
    from gateway.reference import ReferenceMoE

    started = []

    def refused(self, urls, *a, **kw):
        started.extend(system.procs)
        assert len(urls) == 2  # both workers are up when the pool connects
        raise ConnectionRefusedError("refused by the test")

    monkeypatch.setattr(gateway.pool.WorkerPool, "__init__", refused)
    system = TransportSystem.__new__(TransportSystem)
    with pytest.raises(ConnectionRefusedError):
        TransportSystem.__init__(system, "tcp", ReferenceMoE.from_seed(16, 32, 4, 2, seed=0).router, 2, 16, 32, 0, 8)
    assert len(started) == 2
    assert all(p.poll() is not None for p in started)


def test_chunked_twin_runs_on_the_same_workers_and_cuts_only_its_own_forwards():
    """``same_workers``: the chunked system the bench sets beside whole parts is the same
    worker processes and pool; each forward cuts parts its own system's way, whatever the
    other set last; closing the twin leaves the workers to their owner."""
    import numpy as np

    from bench.moe_layer import TransportSystem
    from gateway.reference import ReferenceMoE

    ref = ReferenceMoE.from_seed(16, 32, 4, 2, seed=0)
    whole = TransportSystem("tcp", ref.router, 2, 16, 32, 0, 24, chunk_rows=0)
    try:
        twin = whole.same_workers(4)
        assert twin.pool is whole.pool and twin.procs is whole.procs
        x = np.random.default_rng(1).standard_normal((24, 16)).astype(np.float32)
        want = ref.forward(x)[0]
        for sys_, rows in ((whole, 0), (twin, 4), (whole, 0), (twin, 4)):
            np.testing.assert_allclose(sys_.forward(x), want, rtol=1e-4, atol=1e-5)
            assert whole.pool.chunk_rows == rows
        # 24 tokens x top-2 over two workers: one message each whole, at most 4 rows a chunk
        assert [s["messages"] for s in whole.stages] == [2, 2]
        assert all(s["messages"] >= 48 / 4 for s in twin.stages)
        with pytest.raises(ValueError):
            whole.pool.chunk_rows = -1
        assert whole.pool.chunk_rows == 4  # a refused setting leaves the last one
        twin.close()
        assert all(p.poll() is None for p in whole.procs)
        np.testing.assert_allclose(whole.forward(x), want, rtol=1e-4, atol=1e-5)
    finally:
        whole.close()
    assert all(p.poll() is not None for p in whole.procs)


class _Probing:
    """A system whose auto choice settles after ``unsettled`` forwards, and is asked about
    each of the first ``asked`` of them."""

    def __init__(self, unsettled: int, asked: int = 10 ** 6):
        self.unsettled, self.asks, self.ran = unsettled, asked, []

    def chunk_choice(self):
        return {"asked": min(len(self.ran), self.asks), "settled": len(self.ran) >= self.unsettled}

    def forward(self, i):
        self.ran.append(i)


def test_warm_up_goes_on_while_auto_still_measures_both_ways():
    """A cold start's rounds are left out of auto's choice, so it can still be probing after
    the default warm-up: the bench warms up until it is not (bounded), unless the count is
    fixed, and a system with no auto choice (or not asked any more) gets no more."""
    import argparse
    from bench.moe_layer import WARMUP_EXTEND, warm_up, warmup_forwards
    from gateway.chunking import REPROBE_EVERY
    auto, fixed = argparse.Namespace(warmup_forwards=None), argparse.Namespace(warmup_forwards=3)
    n = warmup_forwards(auto)
    s = _Probing(n + 5)
    assert warm_up(s, s.forward, auto) == n + 5 and s.ran == list(range(n + 5))
    s = _Probing(10 ** 6)  # never settles: bounded
    assert warm_up(s, s.forward, auto) == n + WARMUP_EXTEND * n == len(s.ran)
    s = _Probing(n + 5)
    assert warm_up(s, s.forward, fixed) == 3 == len(s.ran)
    s = _Probing(n + 5, asked=0)  # the size model never wanted chunks: nothing to wait for
    assert warm_up(s, s.forward, auto) == n == len(s.ran)
    # it stopped wanting them: waiting would not settle it, once the size model's re-probe
    # (one priced-out round in REPROBE_EVERY goes in chunks again) has had its turn
    s = _Probing(10 ** 6, asked=n + 3)
    assert warm_up(s, s.forward, auto) == n + 3 + REPROBE_EVERY == len(s.ran)

    class _Reprobing(_Probing):  # asked about every REPROBE_EVERY-th forward only
        def chunk_choice(self):
            return {"asked": len(self.ran) // REPROBE_EVERY, "settled": len(self.ran) >= self.unsettled}

    s = _Reprobing(n + 3 * REPROBE_EVERY)  # settles after a few re-probes: warmed up until then
    assert warm_up(s, s.forward, auto) == n + 3 * REPROBE_EVERY == len(s.ran)
    ran = []
    assert warm_up(object(), ran.append, auto) == n == len(ran)


def test_the_warm_up_line_says_what_autos_choice_stands_on():
    """A run that sent its parts whole shows why: its per-row figures and which way won."""
    from bench.moe_layer import per_row_line
    from gateway.chunk_mode import ChunkMode
    m = ChunkMode()
    assert per_row_line(m.snapshot()) == ""  # nothing measured: nothing to show
    m.record(False, 0.0174, 1000)
    m.record(True, 0.0165, 1000)
    line = per_row_line(m.snapshot())
    assert "whole 17.40 us" in line and "chunked 16.50 us" in line and line.endswith("chunks measured cheaper")
    m2 = ChunkMode()
    m2.record(False, 0.0174, 1000)
    m2.record(True, 0.0180, 1000)
    assert per_row_line(m2.snapshot()).endswith("whole parts measured cheaper")
    # chunks cheaper, but not by the margin: whole parts, and the line says why
    assert per_row_line({**m.snapshot(), "chunked_s_per_row": 0.0172 / 1000, "chunks_cheaper": False,
                         "chunks_kept": False}).endswith("chunks not cheaper by the margin: parts whole")
    # taken once, then kept inside the margin
    assert per_row_line({**m.snapshot(), "chunked_s_per_row": 0.0172 / 1000, "chunks_cheaper": False,
                         "chunks_kept": True}).endswith("chunks kept, not dearer")


def _run_doc(batch: int, share: float, bound: float, chunked_msgs: float, whole_msgs: float = 1.0) -> dict:
    gain = 1 + share * (bound - 1)
    missing = 100 * (1 - share)
    g = {"of_bound": share, "bound": bound, "p50_gain": gain, "gain": gain, "p99_ratio": 0.95,
         "no_token_ms": 8.0, "chunked_no_token_ms": 1.7, "round_ms": 140.0, "messages": chunked_msgs,
         "shortfall": {"missing": missing, "own_no_token": 21.0, "busier": missing / 2, "routing": 1.0,
                       "rest": missing / 2 - 22.0}}
    return {"meta": {"config": {"batch": batch}},
            "results": [{"system": "moe-transport", "backend": "shm", "stage_ms": {"messages": whole_msgs}},
                        {"system": "moe-transport+chunks", "backend": "shm", "stage_ms": {"messages": chunked_msgs}}],
            "ratios": {"shm": {"chunks": g}}}


def test_the_sweep_summary_gives_each_size_its_median_range_and_runs_that_met_the_target():
    """Per (backend, batch): the median share with its range over the runs, how many met the
    80% target, and which runs sent their parts whole (as many messages as the whole system)."""
    from bench.moe_sweep import report, summarize
    docs = [_run_doc(4096, s, 1.06, 4) for s in (0.58, 0.74, 0.27)]
    docs += [_run_doc(16384, s, 1.08, 6) for s in (1.13, 0.81)] + [_run_doc(16384, 0.02, 1.08, 1)]
    docs.append({"meta": {"config": {"batch": 512}}, "results": [], "ratios": {"shm": {}}})  # chunks off
    rows = summarize(docs)
    assert [(r["backend"], r["batch"], r["runs"]) for r in rows] == [("shm", 4096, 3), ("shm", 16384, 3)]
    small, large = rows
    assert small["of_bound"] == pytest.approx(0.58)
    assert (small["of_bound_min"], small["of_bound_max"]) == pytest.approx((0.27, 0.74))
    assert small["met"] == 0 and small["sent_whole"] == 0
    assert large["of_bound"] == pytest.approx(0.81) and large["met"] == 2 and large["sent_whole"] == 1
    assert large["bound"] == pytest.approx(1.08) and large["gain_min"] == pytest.approx(1 + 0.02 * 0.08)
    text = report(rows)
    assert "58% (27-74%)" in text and "81% (2-113%)" in text and "1 sent whole" in text
    assert " 0/3 " in text and " 2/3 " in text
    # and where the missing share went: each part's median over the runs
    assert small["shortfall"]["missing"] == pytest.approx(42.0) and small["shortfall"]["busier"] == pytest.approx(21.0)
    assert small["shortfall"]["own_no_token"] == pytest.approx(21.0)
    assert large["shortfall"]["missing"] == pytest.approx(100 * (1 - 0.81))
    assert "where the missing share went" in text
    parts = text.split("where the missing share went")[1].splitlines()
    assert ["shm", "4096", "42", "21", "21", "1", "-1"] in [line.split() for line in parts]
    assert "control" not in small and "control:" not in text  # no run had --control


def test_the_sweep_summary_sets_the_control_beside_the_chunked_share():
    """--control runs: the share whole parts get against themselves, median and range by size,
    from the runs that have it."""
    from bench.moe_sweep import report, summarize
    docs = [_run_doc(4096, s, 1.06, 4) for s in (0.58, 0.74, 0.27)]
    for doc, c in zip(docs, (0.04, -0.09, None)):
        if c is not None:
            doc["ratios"]["shm"]["control"] = {"of_bound": c, "p50_gain": 1 + c * 0.06, "gain": 1.0, "bound": 1.06}
    (row,) = summarize(docs)
    assert row["control"]["of_bound"] == pytest.approx(-0.025)
    assert (row["control"]["min"], row["control"]["max"]) == pytest.approx((-0.09, 0.04))
    assert ["shm", "4096", "-2%", "(-9", "to", "+4%)"] in [line.split() for line in report([row]).splitlines()]


def test_moe_bench_sweeps_batch_sizes_into_one_summary_and_plot(tmp_path):
    """--batch repeated with --repeat: each size runs that many times on fresh processes; the
    JSON keeps every run's document and the summary rows; --plot draws them."""
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    cmd = [sys.executable, "-m", "bench.cli", "moe", "--quick", "--rounds", "1", "--batches", "2", "--backend", "shm",
           "--d-model", "32", "--d-ff", "64", "--batch", "32", "--batch", "64", "--repeat", "2",
           "--local-workers", "1", "--chunk-rows", "16", "--warmup-forwards", "1", "--control",
           "--json", str(out), "--plot", str(png)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [d["meta"]["config"]["batch"] for d in data["runs"]] == [32, 32, 64, 64]
    assert data["meta"]["config"]["batches"] == [32, 64] and data["meta"]["config"]["repeat"] == 2
    rows = {(r["backend"], r["batch"]): r for r in data["sweep"]}
    assert set(rows) == {("shm", 32), ("shm", 64)} and all(r["runs"] == 2 for r in rows.values())
    for (_, batch), r in rows.items():
        shares = sorted(d["ratios"]["shm"]["chunks"]["of_bound"] for d in data["runs"]
                        if d["meta"]["config"]["batch"] == batch)
        assert (r["of_bound_min"], r["of_bound_max"]) == pytest.approx(tuple(shares))
    # --control: whole parts against themselves on the same workers, their share per run and by size
    for d in data["runs"]:
        by = {r["system"]: r for r in d["results"] if r["backend"] == "shm"}
        whole, control = by["moe-transport"], by["moe-transport+control"]
        assert control["worker_pids"] == whole["worker_pids"] and len(whole["worker_pids"]) == 1
        assert control["stage_ms"]["messages"] == whole["stage_ms"]["messages"] == 1  # whole parts, both
        c = d["ratios"]["shm"]["control"]
        assert c["p50_gain"] == pytest.approx(whole["p50_ms"] / control["p50_ms"])
        assert c["of_bound"] == pytest.approx((c["p50_gain"] - 1) / (c["bound"] - 1))
    for (_, batch), r in rows.items():
        shares = sorted(d["ratios"]["shm"]["control"]["of_bound"] for d in data["runs"]
                        if d["meta"]["config"]["batch"] == batch)
        assert (r["control"]["min"], r["control"]["max"]) == pytest.approx(tuple(shares))
    assert "control: whole parts against themselves" in p.stdout
    assert "== run 4/4: 64-token batches ==" in p.stdout and "chunked rounds by batch size" in p.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_moe_bench_refuses_a_sweep_flag_it_would_ignore():
    cmd = [sys.executable, "-m", "bench.cli", "moe", "--compute", "torch", "--repeat", "2"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--repeat and --plot are for the numpy layer" in p.stderr
