"""`moe-bench transport`'s report: perftest's statistics from known samples, the data
figure's payload work, the printed tables (columns, ratio directions, marks, targets,
references), provenance, and real short runs: a size the backend cannot carry is
reported and the run goes on; the JSON is rewritten after every size, so an interrupted
run keeps what it measured. No test asserts a speed."""
from __future__ import annotations

import datetime
import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bench import payload as PL
from bench import report as R
from bench.provenance import provenance, write_json_atomic
from bench.stats import min_samples, reliable
from bench.transport_bench import _iters, lat_stats, parse_size
from transport import stream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROVENANCE_KEYS = {"version", "commit", "dirty", "command", "host", "kernel", "cpu_model", "cpus", "date_utc",
                   "python", "numpy"}

pytestmark = pytest.mark.timeout(180)


# -- statistics ----------------------------------------------------------------------------
def test_percentile_sample_rule():
    assert min_samples(50) == 2 and min_samples(95) == 20
    assert min_samples(99) == 100 and min_samples(99.9) == 1000
    assert reliable(99, 100) and not reliable(99, 99)
    assert reliable(99.9, 1000) and not reliable(99.9, 999)
    with pytest.raises(ValueError):
        min_samples(100)


def test_lat_stats_perftest_columns_from_known_samples():
    s = np.arange(1, 1001, dtype=float)  # 1 .. 1000 us, shuffled: order must not matter
    np.random.default_rng(0).shuffle(s)
    st = lat_stats(s)
    assert st["min"] == 1 and st["max"] == 1000
    assert st["p50"] == pytest.approx(500.5)  # t_typical is the median
    assert st["avg"] == pytest.approx(500.5)
    assert st["stdev"] == pytest.approx(np.sqrt(np.sum((np.arange(1, 1001) - 500.5) ** 2) / 999))  # sample stdev
    assert st["p99"] == pytest.approx(990.01) and st["p999"] == pytest.approx(999.001)
    assert st["samples"] == 1000 and st["reliable"] == {"p99": True, "p999": True}
    few = lat_stats(np.array([3.0, 1.0, 2.0, 10.0]))
    assert (few["min"], few["p50"], few["max"]) == (1.0, 2.5, 10.0)
    assert few["samples"] == 4 and few["reliable"] == {"p99": False, "p999": False}
    assert lat_stats(np.full(150, 7.0))["reliable"] == {"p99": True, "p999": False}
    assert lat_stats(np.array([5.0]))["stdev"] == 0.0
    with pytest.raises(ValueError):
        lat_stats(np.array([]))


def test_sizes_and_iterations():
    assert [parse_size(x) for x in ("64", "4K", "4KiB", "1M", "16MiB", "1G")] == \
        [64, 4096, 4096, 1 << 20, 16 << 20, 1 << 30]
    from bench.transport_bench import _sizes
    assert _sizes("64,16K,4K,64,16384") == [64, 16384, 4096]  # the order given, each size once
    assert _iters(64, 2000) == 2000 and _iters(1 << 20, 2000) == 125 and _iters(16 << 20, 2000) == 20


# -- the data figure's payload work --------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 4095, PL.SMALL_SUM, PL.SMALL_SUM + 1, PL.SMALL_FILL + 3, 1 << 20])
def test_payload_written_read_and_checked(n):
    buf = bytearray(n)
    for v in (1, 77, 255):
        PL.fill(buf, v)
        assert buf == bytes([v]) * n  # every byte written
        assert PL.checksum(buf) == PL.expected(n, v)
        assert PL.verify(buf, n) == v
    bad = bytearray(buf)
    bad[n // 2] ^= 0x01  # one byte wrong anywhere is caught (every byte is read)
    if n > 1:
        with pytest.raises(AssertionError):
            PL.verify(bad, n)
    else:  # a lone byte is uniform: its value tells (the echo checks the value it expects)
        assert PL.verify(bad, n) == 254
    with pytest.raises(AssertionError):
        PL.verify(bytearray(n), n)  # an untouched (zeroed) slot is never a valid payload
    with pytest.raises(AssertionError):
        PL.verify(buf[:-1], n)  # short


def test_payload_counter():
    seq, v = [], 0
    for _ in range(600):
        v = PL.next_byte(v)
        seq.append(v)
    assert min(seq) == 1 and max(seq) == 255 and all(a != b for a, b in zip(seq, seq[1:]))


# -- the printed report from a synthetic run -------------------------------------------------
def _rec(impl, backend, fig, size, p50, bw, label=None, n=1000):
    s = lat_stats(np.linspace(0.5 * p50, 1.5 * p50, n))
    r = {"impl": impl, "backend": backend, "label": label or impl, "figure": fig, "size": size, "carried": True,
         "iters": n, "warmup": 5, "lat_us": s, "bw_gbps": bw, "bw_peak_gbps": bw, "msg_rate": 2.5e5,
         "stream_count": 50, "bursts": 3}
    if backend == "shm" and fig == "descriptor":  # what measure() records: a slot index moves no bytes
        r.update(bw_gbps=None, bw_peak_gbps=None, bw_note="no payload byte moves")
    return r


def _doc(results, backends=("shm",), sizes=(64, 4096, 1 << 20), figures=("descriptor", "data")):
    from bench.transport_bench import settings_of
    import argparse
    args = argparse.Namespace(warmup_iters=None, stream_count=None, slot_size=None, pin=None, no_peers=False)
    doc = {"provenance": provenance(), "settings": settings_of(args, list(backends), list(sizes), 300, list(figures)),
           "complete": True, "interrupted": False, "results": results}
    R.transport_summary(doc)
    return doc


def test_printed_tables_columns_ratios_marks_targets_and_references():
    res = []
    for fig in ("descriptor", "data"):
        for size, ours, floor, zmq in ((64, 4.0, 0.5, 40.0), (4096, 4.0, 0.5, 42.0), (1 << 20, 4.4, 0.5, 400.0)):
            k = 1 if fig == "descriptor" else 3
            res.append(_rec("moe-transport", "shm", fig, size, ours * k, 2.0 * k))
            res.append(_rec("raw", "shm", fig, size, floor * k, 4.0 * k, "bare slot handoff",
                            n=50 if size == 1 << 20 else 1000))
            res.append(_rec("pyzmq", "ipc", fig, size, zmq, 1.0, "pyzmq ipc"))
    res.append({"impl": "pipe", "backend": "pipe", "label": "multiprocessing.Pipe", "figure": "descriptor",
                "size": 1 << 20, "carried": False, "max_message": 65536, "note": "not carried (max 65536 B)"})
    doc = _doc(res)
    out = io.StringIO()
    R.print_transport(doc, out)
    text = out.getvalue()
    for col in ("#bytes", "#iter", "t_min", "t_typical", "t_avg", "t_max", "t_stdev", "99%", "99.9%", "BW",
                "[GB/s]", "MsgRate", "[Mmsg/s]", "[usec]"):
        assert col in text, col
    assert "ours/this t_typical" in text and "(lower is better)" in text
    assert "ours/this BW" in text and "(higher is better)" in text
    for setting in ("backends", "sizes", "iterations", "warm-up", "CPU pinning", "spin (shm)", "host", "kernel",
                    "python", "numpy", "command"):
        assert setting in text, setting
    assert "descriptor round trip" in text and "data round trip" in text
    assert "not carried (max 65536 B)" in text
    # ratio on the floor's 4 KiB rows: ours 4.0 / floor 0.5 = 8x latency; bandwidth only where bytes move:
    # the data figure (6 / 12 = 0.5x), not the descriptor figure (a slot index: "no data", no ratio)
    desc, data = [line for line in text.splitlines() if line.split()[:2] == ["4096", "bare"]]
    assert "8.00x" in desc and "no data" in desc and desc.rstrip().endswith("-") and "0.25" in desc  # 0.25 Mmsg/s
    assert "8.00x" in data and "0.50x" in data and "no data" not in data
    assert "no bandwidth is claimed" in text
    # 50 round trips cannot support 99% or 99.9%: marked, with the footnote
    big = next(line for line in text.splitlines() if line.split()[:2] == ["1048576", "bare"])
    assert big.count("*") == 2
    assert "too few samples" in text
    # the shared-memory targets, from figures of this run
    t = {x["target"]: x for x in doc["targets"]}
    handoff = t["shm descriptor one-way t_typical at 4 KiB / bare slot-index handoff (same run)"]
    assert handoff["value"] == pytest.approx(8.0) and handoff["limit"] == 10.0 and handoff["met"]
    flat = t["shm descriptor t_typical at 1 MiB / at 64 B"]
    assert flat["value"] == pytest.approx(1.1) and flat["limit"] == 1.2 and flat["met"]
    assert not any("NIXL" in x for x in t)  # a quoted figure is never a target ...
    (ref,) = doc["references"]
    assert ref["measured"] is False and ref["this_run"]["one_way_us"] == pytest.approx(4.0)
    refline = next(line for line in text.splitlines() if "NIXL" in line)
    assert refline.strip().startswith("reference:") and "not measured in this run" in refline
    assert "NOT measured in this run" in text  # ... and its section says so
    # the JSON's ratios say which way they go
    assert "lower is better" in doc["ratios"]["directions"]["lat_vs_<peer>"]
    assert "higher is better" in doc["ratios"]["directions"]["bw_vs_<peer>"]
    r4 = next(r for r in doc["ratios"]["per_size"] if (r["figure"], r["size"]) == ("data", 4096))
    assert r4["lat_vs_raw"] == pytest.approx(8.0) and r4["bw_vs_raw"] == pytest.approx(0.5)


def test_provenance_and_atomic_json(tmp_path):
    p = provenance()
    assert PROVENANCE_KEYS <= set(p)
    assert p["version"] == "0.1.0" and p["numpy"] == np.__version__
    assert datetime.datetime.fromisoformat(p["date_utc"]).utcoffset() == datetime.timedelta(0)
    if os.path.isdir(os.path.join(ROOT, ".git")) or os.path.isfile(os.path.join(ROOT, ".git")):
        assert len(p["commit"]) == 40
    path = tmp_path / "sub" / "x.json"
    write_json_atomic(str(path), {"a": 1})
    write_json_atomic(str(path), {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert os.listdir(path.parent) == ["x.json"]  # no temporary left behind
    with pytest.raises(ValueError):  # NaN is not JSON: refused, and the old file stays whole
        write_json_atomic(str(path), {"a": float("nan")})
    assert json.loads(path.read_text()) == {"a": 2}


# -- real short runs -----------------------------------------------------------------------
def _cmd(*args):
    return [sys.executable, "-m", "bench.cli", "transport", *args]


def test_uncarried_size_is_reported_and_the_run_goes_on(tmp_path):
    """tcp with an 8 KiB slot: 16 KiB is beyond ours, not the peers'. It is reported as not
    carried and the run measures the next size (4 KiB) and both figures; pyzmq runs over tcp."""
    out = tmp_path / "t.json"
    p = subprocess.run(_cmd("--backend", "tcp", "--sizes", "64,16K,4K", "--slot-size", "8K", "--iters", "30",
                            "--stream-count", "60", "--json", str(out)),
                       cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["interrupted"] is False
    assert PROVENANCE_KEYS <= set(doc["provenance"]) and "--slot-size 8K" in doc["provenance"]["command"]
    assert doc["settings"]["sizes"] == [64, 16384, 4096] and doc["settings"]["slot_size"] == 8192
    res = {(r["impl"], r["backend"], r["figure"], r["size"]): r for r in doc["results"]}
    for fig in ("descriptor", "data"):
        nc = res[("moe-transport", "tcp", fig, 16384)]
        assert nc["carried"] is False and nc["max_message"] == 8192 and nc["note"] == "not carried (max 8192 B)"
        for size in (64, 4096):  # measured before and after the size it could not carry
            r = res[("moe-transport", "tcp", fig, size)]
            assert r["carried"] and r["lat_us"]["samples"] == 30 and r["bw_gbps"] > 0
            if stream.NATIVE_AVAILABLE:  # the Python path beside the compiled one
                assert res[("moe-transport-py", "tcp", fig, size)]["carried"]
        for impl, medium in (("raw", "tcp"), ("pyzmq", "tcp"), ("pipe", "pipe")):
            r = res[(impl, medium, fig, 16384)]
            assert r["carried"] and r["lat_us"]["p50"] > 0
    assert not any("error" in r for r in doc["results"])
    assert "not carried (max 8192 B)" in p.stdout and "pyzmq tcp" in p.stdout
    assert "data round trip" in p.stdout and "descriptor round trip" in p.stdout
    # progress on stderr only; the report on stdout only
    assert "[1/3" in p.stderr and "[1/3" not in p.stdout
    assert "wrote" in p.stderr and "wrote" not in p.stdout
    ratios = {(r["figure"], r["size"]) for r in doc["ratios"]["per_size"]}
    assert ratios == {(f, s) for f in ("descriptor", "data") for s in (64, 4096)}


def _group_alive(pgid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(d))
    return pids


def test_interrupted_run_keeps_what_it_measured(tmp_path):
    """The JSON is rewritten (atomically) after every size: interrupted after the first
    size, the file holds that size's figures, says the run is incomplete, and the printed
    report shows them; no process of the run is left."""
    out = tmp_path / "t.json"
    p = subprocess.Popen(_cmd("--backend", "tcp", "--no-peers", "--sizes", "64,1K,4K,16K,64K,256K,1M",
                              "--iters", "4000", "--stream-count", "2000", "--json", str(out)),
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         # a suite started in the background by a non-interactive shell inherits
                         # SIGINT ignored, and Python then installs no KeyboardInterrupt handler
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        first = None
        while time.monotonic() < deadline and p.poll() is None:
            if out.exists():
                doc = json.loads(out.read_text())  # always whole: written through a rename
                assert doc["complete"] is False
                if any(r["size"] == 64 for r in doc["results"]):
                    first = doc
                    break
            time.sleep(0.05)
        assert first is not None, "the first size never reached the JSON"
        assert {r["figure"] for r in first["results"] if r["size"] == 64} == {"descriptor", "data"}
        os.kill(p.pid, signal.SIGINT)
        stdout, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130, stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and doc["complete"] is False
    sizes = {r["size"] for r in doc["results"]}
    assert 64 in sizes and sizes != {64, 1024, 4096, 16384, 65536, 262144, 1 << 20}
    assert "INTERRUPTED" in stdout and "interrupted" in stderr
    assert any(line.split()[:2] == ["64", "moe-transport"] for line in stdout.splitlines())
    time.sleep(0.5)
    assert _group_alive(p.pid) == []


def test_shm_run_both_figures_and_no_bandwidth_claimed_for_a_slot_index(tmp_path):
    """On shm the descriptor figure passes a slot index: its rows claim no GB/s (message
    rate only) for ours and the bare handoff, while the data figure, where every byte is
    written and read, has the bandwidth. Nothing is left in /dev/shm."""
    from tests.helpers_procs import shm_entries
    before = shm_entries()
    out = tmp_path / "t.json"
    p = subprocess.run(_cmd("--backend", "shm", "--sizes", "64,64K", "--iters", "30", "--stream-count", "60",
                            "--json", str(out)), cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert shm_entries() - before == set()
    res = {(r["impl"], r["backend"], r["figure"], r["size"]): r for r in json.loads(out.read_text())["results"]}
    for size in (64, 65536):
        for impl in ("moe-transport", "raw"):
            d, x = res[(impl, "shm", "descriptor", size)], res[(impl, "shm", "data", size)]
            assert d["bw_gbps"] is None and d["msg_rate"] > 0 and "bw_note" in d
            assert x["bw_gbps"] > 0 and x["lat_us"]["samples"] == 30
        assert res[("pyzmq", "ipc", "descriptor", size)]["bw_gbps"] > 0  # a socket's kernel does move the bytes
    assert "no data" in p.stdout and "pyzmq ipc" in p.stdout


# -- repeats, noise and verdicts -------------------------------------------------------------
def test_a_verdict_comes_from_the_median_repeat_and_a_noisy_row_judges_nothing():
    """Three repeats of each row: the row is the median one; a row whose repeats disagree
    (one ran while the machine was busy) or whose own t_typical is far above its t_min is
    flagged noisy, and a target reading it says so instead of MISSED."""
    def reps(impl, size, p50s, label=None):
        return R.combine_repeats([_rec(impl, "shm", "descriptor", size, v, None, label) for v in p50s])

    steady = reps("moe-transport", 64, [4.0, 4.1, 3.9])
    assert steady["lat_us"]["p50"] == pytest.approx(4.0) and steady["noisy"] is None
    assert steady["repeats"]["n"] == 3 and sorted(steady["repeats"]["lat_p50_us"]) == pytest.approx([3.9, 4.0, 4.1])
    one_busy = reps("moe-transport", 1 << 20, [4.2, 1974.0, 4.25])  # one busy repeat: the median stands
    assert one_busy["lat_us"]["p50"] == pytest.approx(4.25) and one_busy["noisy"] is None
    two_busy = reps("moe-transport", 1 << 20, [4.4, 1974.0, 900.0])  # no two agree: nothing to judge by
    assert two_busy["lat_us"]["p50"] == pytest.approx(900.0) and "no majority within" in two_busy["noisy"]
    # one run whose median sat far above its minimum (t_min 22 us, t_typical 1974 us)
    tail = _rec("moe-transport", "shm", "descriptor", 16 << 20, 1974.0, None)
    tail["lat_us"] = lat_stats(np.r_[np.full(10, 22.0), np.full(90, 1974.0)])
    tail = R.combine_repeats([tail])
    assert "x its t_min 22.0 us" in tail["noisy"]
    res = [steady, two_busy, tail, reps("raw", 4096, [0.5, 0.5, 0.5], "bare slot handoff"),
           reps("moe-transport", 4096, [4.0, 4.0, 4.0])]
    doc = _doc(res, sizes=(64, 4096, 1 << 20, 16 << 20), figures=("descriptor",))
    doc["settings"]["repeat"] = 3
    t = {x["target"]: x for x in doc["targets"]}
    assert t["shm descriptor one-way t_typical at 4 KiB / bare slot-index handoff (same run)"]["met"] is True
    for big in ("1 MiB", "16 MiB"):
        x = t[f"shm descriptor t_typical at {big} / at 64 B"]
        assert x["met"] is None and x["noisy"] and x["repeats"] in (1, 3)
    # the same run with only one busy repeat at 1 MiB: judged, from the median
    calm = _doc([steady, one_busy], sizes=(64, 1 << 20), figures=("descriptor",))
    x = {x["target"]: x for x in calm["targets"]}["shm descriptor t_typical at 1 MiB / at 64 B"]
    assert x["met"] is True and x["value"] == pytest.approx(4.25 / 4.0, rel=1e-3) and x["noisy"] is None
    assert x["range"][1] <= 1.2  # the scatter of the agreeing repeats (4.2..4.25, 3.9..4.1) cannot flip it
    # repeats that agree (within 1.5x) but scatter more than the target's margin: too close to call
    wide = reps("moe-transport", 1 << 20, [4.0, 4.8, 5.6])  # 5.6 / 4.0 = 1.4x; 4.8 / 4.0 = 1.2
    x = {x["target"]: x for x in _doc([steady, wide], sizes=(64, 1 << 20), figures=("descriptor",))["targets"]}
    close = x["shm descriptor t_typical at 1 MiB / at 64 B"]
    assert wide["noisy"] is None and close["met"] is None and close["noisy"].startswith("too close to call")
    assert close["range"][0] < 1.2 < close["range"][1]
    far = reps("moe-transport", 1 << 20, [8.0, 9.0, 10.0])  # 2.25x the 64 B row: MISSED whatever the scatter
    x = {x["target"]: x for x in _doc([steady, far], sizes=(64, 1 << 20), figures=("descriptor",))["targets"]}
    assert x["shm descriptor t_typical at 1 MiB / at 64 B"]["met"] is False
    out = io.StringIO()
    R.print_transport(doc, out)
    text = out.getvalue()
    assert "[noisy: not judged] shm descriptor t_typical at 1 MiB / at 64 B" in text
    assert "[MISSED]" not in text and "from the median of 3 repeats" in text
    assert "noisy rows" in text and "issue" not in text.lower()


def test_the_plot_has_a_legend_on_every_panel_and_one_colour_per_implementation(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    seen = []
    real = Figure.savefig

    def capture(self, *a, **k):
        seen.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", capture)
    res = []
    for backend, zmq in (("shm", "ipc"), ("tcp", "tcp")):
        for fig in ("descriptor", "data"):
            for size in (64, 4096, 1 << 20):
                res += [_rec("moe-transport", backend, fig, size, 4.0, 2.0), _rec("raw", backend, fig, size, 1.0, 4.0),
                        _rec("pyzmq", zmq, fig, size, 40.0, 1.0, "pyzmq"), _rec("pipe", "pipe", fig, size, 30.0, 1.0)]
    path = str(tmp_path / "t.png")
    assert R.plot_transport(res, path) == path
    (figure,) = seen
    colours: dict = {}
    for ax in figure.axes:
        assert ax.get_legend() is not None, ax.get_title()
        for line in ax.get_lines():
            impl = line.get_label().split(" (")[0]
            colours.setdefault(impl, set()).add(line.get_color())
    assert set(colours) >= {"moe-transport", "raw", "pyzmq", "pipe"}
    assert all(len(c) == 1 for c in colours.values()), colours  # one colour each, on every panel
    assert len({next(iter(c)) for c in colours.values()}) == len(colours)  # and no two alike
