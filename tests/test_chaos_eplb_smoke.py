"""`moe-bench chaos --eplb`, a short run: the gateway moves expert copies under skewed,
shifting traffic while workers are killed and stopped; nothing is wrong, lost or duplicated,
every failure is explained by a worker that held the only copy of an expert it needed (read
from the polled placement, which moves), and the report says what the moves did."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers_procs import shm_entries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(180)


def test_a_short_chaos_run_with_eplb_moves_keeps_its_invariants(tmp_path):
    out = tmp_path / "chaos.json"
    shm_before = shm_entries()
    argv = [sys.executable, "-m", "bench.cli", "chaos", "--eplb", "--backend", "tcp", "--replicas", "1",
            "--duration", "10", "--warmup", "1", "--p99-seconds", "0.5", "--hostile-idle", "10", "--hostile-half", "2",
            "--bg-idle", "5", "--bg-half", "2", "--gap", "0.3,1", "--down", "0.3,0.8", "--json", str(out)]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=150,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert out.exists(), r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["settings"]["eplb"] is True
    (run,) = doc["configs"]
    assert "error" not in run, run
    q = run["requests"]
    assert q["wrong"] == 0 and q["lost"] == 0 and q["duplicated"] == 0, q
    assert q["unexpected_failures"] == 0, q["unexpected_examples"]
    assert q["sent"] == q["ok"] + q["failed"] + q["wrong"] + q["lost"] + q["stale"] + q["mixed"]
    assert q["ok"] > 0
    e = run["eplb"]
    assert e["moves"]["done"] >= 1 and e["placement_versions"][1] > e["placement_versions"][0], e
    assert e["actions"] == len(run["events"]) == run["recovery_s"]["kills"] + run["recovery_s"]["stops"]
    assert e["actions_during_moves"] == len(e["during"]) <= e["actions"]
    assert all(d["fate"] in ("done", "abandoned", "unfinished") for d in e["during"])
    assert all(ev["recovery_s"] is not None for ev in run["events"]), run["events"]
    names = {t["target"] for t in run["targets"]}
    assert {"wrong 0", "lost 0", "duplicated 0", "moves happened during the run (done + abandoned >= 1)"} <= names
    assert "eplb: moves done" in r.stdout and "[met] wrong 0" in r.stdout, r.stdout[-3000:]
    assert run["dev_shm_left_after_stop"] == [] and shm_entries() - shm_before == set()
