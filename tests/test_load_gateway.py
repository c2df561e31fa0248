"""`moe-bench load --gateway URL` against a real running gateway whose layer differs from
the tool's defaults (d_model 64, d_ff 128, float64, 4 experts, top-1): the tool asks the
gateway first and uses its configuration (every request served, the real configuration,
d_ff included, in the JSON); flags that contradict it are refused before any load; and a
run whose every request fails is reported (failed counts, the first error), never a crash."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.helpers_procs import Services, shm_entries, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GW = dict(local_workers=2, d_model=64, d_ff=128, dtype="float64", n_experts=4, top_k=1)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def gateway():
    with Services() as s:
        yield s.gateway("tcp", **GW)


def _load(tmp_path, url, *args, timeout=120):
    out = tmp_path / "load.json"
    cmd = [sys.executable, "-m", "bench.cli", "load", "--gateway", url, "--rate", "8", "--duration", "1",
           "--warmup", "0.2", "--prefill", "8", "--decode", "2", "--concurrency", "2", "--progress", "plain",
           "--json", str(out), *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return p, (json.loads(out.read_text()) if out.exists() else None)


def test_the_gateways_configuration_is_asked_and_used(tmp_path, gateway):
    p, doc = _load(tmp_path, gateway.url)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (r,) = doc["results"]
    assert r["failed"] == 0 and r["completed"] == r["requests"] == 8  # nothing refused for its dtype or width
    lay = doc["meta"]["layer"]
    assert (lay["d_model"], lay["d_ff"], lay["dtype"], lay["n_experts"], lay["top_k"]) == (64, 128, "float64", 4, 1)
    assert lay["d_ff_source"] == "the gateway's workers"  # as each worker's hello told the gateway
    assert doc["meta"]["d_ff"] == 128 and doc["meta"]["gateway"] == gateway.url
    cfg = doc["meta"]["gateway_config"]
    assert cfg["d_model"] == 64 and cfg["dtype"] == "float64" and cfg["router"]["n_experts"] == 4
    assert len(cfg["workers"]) == 2 and all(w["d_ff"] == 128 for w in cfg["workers"])
    # the model of the all-to-all volume uses the real row size (64 float64 values)
    cv = doc["models"]["comm_volume"]
    assert cv["row_bytes"] == 64 * 8 and cv["measured_over_model"] == pytest.approx(1.0, abs=1e-9)
    assert "d_model 64, d_ff 128" in p.stdout and "float64" in p.stdout


@pytest.mark.parametrize("flags, named", [
    (["--d-model", "256"], ["--d-model 256 (the gateway has 64)"]),
    (["--dtype", "float32", "--top-k", "2"], ["--dtype float32 (the gateway has float64)",
                                             "--top-k 2 (the gateway has 1)"]),
    (["--d-ff", "512"], ["--d-ff 512 (the gateway has 128)"]),
    (["--backend", "shm"], ["--backend shm contradicts --gateway"]),
    (["--noisy", "--batching", "expert-aware"], ["--noisy True (the gateway has False)",
                                                 "--batching expert-aware (the gateway has fifo)"]),
    (["--replicas", "2", "--gate-bias=1,0,0,0"], ["--replicas 2 (the gateway has 1)",
                                                  "--gate-bias 1,0,0,0 (the gateway has None)"]),
    (["--sweep", "n_experts=4,8"], ["cannot change a running --gateway"]),
])
def test_contradicting_flags_are_refused_before_any_load(tmp_path, gateway, flags, named):
    before = gateway_requests(gateway.url)
    p, doc = _load(tmp_path, gateway.url, *flags)
    assert p.returncode == 2, p.stderr[-2000:]
    for n in named:
        assert n in p.stderr
    assert doc is None and p.stdout == ""
    assert gateway_requests(gateway.url) == before  # refused before a single request


def gateway_requests(url: str) -> int:
    from gateway.client import GatewayClient
    with GatewayClient(url, timeout=10) as c:
        return c.ping(timeout=10)["gateway"]["requests"]


def test_a_run_whose_every_request_fails_is_reported_not_a_crash(tmp_path):
    """The gateway's workers are killed after it started: every request fails. The tool
    reports the failures (vLLM's "Failed requests", the first error), writes its JSON and
    exits non-zero, without a traceback."""
    with Services() as s:
        # workers the gateway does not supervise (its own local ones would be restarted)
        ws = [s.worker("tcp", ex, d_model=64, d_ff=128, max_tokens=1024, extra=["--dtype", "float64"])
              for ex in ([0, 1], [2, 3])]
        gw = s.gateway("tcp", workers=[w.url for w in ws], **{k: v for k, v in GW.items() if k != "local_workers"})
        kids = [w.pid for w in ws]
        for w in ws:
            w.kill()
        shm0 = shm_entries()
        p, doc = _load(tmp_path, gw.url, "--timeout", "5")
        assert shm_entries() - shm0 == set()
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    (r,) = doc["results"]
    assert r["completed"] == 0 and r["failed"] == r["requests"] > 0
    assert r["request_throughput"] == 0 and r["request_goodput"] == 0 and r["first_error"]
    assert doc["models"]["from_system"] is None and doc["models"]["expert_load"]["dropped"] == 0
    assert f"Failed requests:                         {r['failed']}" in p.stdout
    assert "first failure:" in p.stdout and "requests failed" in p.stderr


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_a_started_gateway_with_slots_over_the_client_default_is_reached(tmp_path, backend):
    """The gateway a run starts sizes its slots to a whole round (max_batch_tokens x d_model x
    the dtype's size): past the client's default 4 MiB limit, the run's clients accept what
    that configuration announces (they were refused at `make bench-load`'s settings)."""
    from gateway.client import gateway_slot_size
    assert gateway_slot_size(9000, 64, "float64") > 4 << 20
    out = tmp_path / "load.json"
    cmd = [sys.executable, "-m", "bench.cli", "load", "--systems", "moe-transport", "--backend", backend,
           "--d-model", "64", "--d-ff", "128", "--dtype", "float64", "--max-batch-tokens", "9000",
           "--rate", "8", "--duration", "1", "--warmup", "0.2", "--prefill", "8", "--decode", "2",
           "--concurrency", "2", "--progress", "plain", "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert "Traceback" not in p.stderr and "could not run" not in p.stdout + p.stderr, p.stdout[-2000:] + p.stderr[-2000:]
    rows = [r for r in json.loads(out.read_text())["results"] if r.get("system", "").startswith("moe-transport")]
    assert rows and all(r["completed"] == r["requests"] > 0 and r["failed"] == 0 for r in rows)
    assert not json.loads(out.read_text())["failed_systems"]
