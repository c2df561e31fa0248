"""Live placement with real moe-gateway and moe-worker processes over tcp and shm: EPLB moves
copies toward skewed load while clients send, an operator's saved placement is loaded with
the command line, workers are added, drained and removed, and a worker restarted after moves
serves its placement. Every answer is checked against the reference; none may fail."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from bench.versioned import VersionedReference
from gateway.client import GatewayClient
from gateway.eplb import balancedness
from tests.helpers_fault import steered_tokens
from tests.helpers_procs import BACKENDS, Services, backend_problem, wait_until
from tests.test_admission import restart
from workers import protocol as P

D, F, E, K, SEED = 16, 32, 8, 2, 5
MAX_BATCH = 64
TOL = dict(rtol=1e-4, atol=1e-5)
HOT = [0, 1]  # worker 0's experts get most of the tokens

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def ref():
    return VersionedReference(D, F, E, K, seed=SEED)


def _require(backend):
    problem = backend_problem(backend)
    if problem:
        pytest.fail(problem)


def cli(url, command, *args, ok=True):
    r = subprocess.run([sys.executable, "-m", "gateway.cli", command, "--gateway", url, *args],
                       capture_output=True, text=True, timeout=60)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


class Load:
    """Clients sending skewed batches (mostly tokens routed to HOT) until stopped."""

    def __init__(self, url, ref, n=2):
        self.ref, self.ok, self.bad, self.errors = ref, 0, 0, []
        self.stop = threading.Event()
        hot = steered_tokens(ref.router, 256, within=HOT, seed=1)
        cold = steered_tokens(ref.router, 64, seed=2)
        self.pool = (hot, cold)
        self.threads = [threading.Thread(target=self._run, args=(url, i), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, url, i):
        rng = np.random.default_rng(i)
        hot, cold = self.pool
        with GatewayClient(url, timeout=20.0) as c:
            while not self.stop.is_set():
                src = hot if rng.random() < 0.8 else cold
                x = src[rng.integers(0, len(src), int(rng.integers(4, 24)))]
                try:
                    y = c.forward(x, timeout=20.0)
                except P.RemoteError as e:
                    self.errors.append(f"{e.code}: {e.message}")
                    continue
                if self.ref.matches(x, y, c.last_expert_versions or {}, **TOL):
                    self.ok += 1
                else:
                    self.bad += 1

    def close(self):
        if self.stop.is_set():
            return
        self.stop.set()
        for t in self.threads:
            t.join(60)
        assert self.bad == 0 and not self.errors, (self.bad, self.errors[:3])


def _workers(s, backend, layout, **kw):
    return [s.worker(backend, ex, d_model=D, d_ff=F, seed=SEED, max_tokens=MAX_BATCH * K,
                     extra=["--max-experts", "6"]) for ex in layout]


def _gateway(s, backend, workers, *extra):
    flags = dict(d_model=D, d_ff=F, n_experts=E, top_k=K, seed=SEED, max_batch_tokens=MAX_BATCH, max_wait_ms=0,
                 worker_timeout=3)
    gw = s.gateway(backend, workers=[w.url for w in workers], **flags)
    return gw


@pytest.mark.parametrize("backend", BACKENDS)
def test_eplb_moves_copies_toward_skewed_load_while_serving(backend, ref):
    """Experts 0 and 1 (worker 0) get 80% of the tokens: EPLB with two redundant copies
    spreads them; balancedness rises, and not one answer fails or is wrong."""
    _require(backend)
    with Services() as s:
        workers = _workers(s, backend, ([0, 1, 2, 3], [4, 5, 6, 7]))
        flags = dict(d_model=D, d_ff=F, n_experts=E, top_k=K, seed=SEED, max_batch_tokens=MAX_BATCH, max_wait_ms=0,
                     worker_timeout=3, eplb=True, redundant_experts=2, eplb_interval=1, eplb_window=3,
                     eplb_max_moves=4)
        gw = s.gateway(backend, workers=[w.url for w in workers], **flags)
        load = Load(gw.url, ref)
        try:
            with GatewayClient(gw.url, timeout=20.0) as c:
                assert wait_until(lambda: (lambda d: d["version"] >= 2 and d["rebalancer"]["move"]["state"] == "done")(
                    c.placement("show")), timeout=40, interval=0.2)
                time.sleep(3.5)  # a window of load under the new placement
                after = c.placement("show")
        finally:
            load.close()
        layer = after["layers"]["0"]
        start = [[0] if e < 4 else [1] for e in range(E)]  # the start-up placement, under the same load
        b0, b1 = balancedness(layer["load"], start, 2), layer["balancedness"]
        assert b0 < 0.7 and b1 > b0 + 0.2, (b0, b1)
        assert after["redundant"] == 2 and load.ok > 50
        copies = after["layers"]["0"]["copies"]
        assert all(copies[str(e)] for e in range(E)) and any(len(copies[str(e)]) == 2 for e in HOT)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_saved_placement_is_loaded_live_and_a_restarted_worker_serves_its_copies(backend, ref, tmp_path):
    """`placement save`, edit, `placement load`: expert 3 moves from worker 0 to worker 1
    under load. Then worker 0 is SIGKILLed and restarted with its start-up flags (it hosts
    3 again): admission drops 3 and it serves experts 0-2 only."""
    _require(backend)
    with Services() as s:
        workers = _workers(s, backend, ([0, 1, 2, 3], [4, 5, 6, 7]))
        gw = _gateway(s, backend, workers)
        path = tmp_path / "map.json"
        assert "saved placement version 1" in cli(gw.url, "placement", "save", str(path)).stdout
        doc = json.loads(path.read_text())
        assert doc["layers"]["0"]["copies"]["3"] == [0]
        doc["layers"]["0"]["copies"]["3"] = [1]
        path.write_text(json.dumps(doc))
        load = Load(gw.url, ref)
        try:
            cli(gw.url, "placement", "load", str(path))
            with GatewayClient(gw.url, timeout=20.0) as c:
                assert wait_until(lambda: c.placement("show")["rebalancer"]["move"]["state"] == "done", timeout=30)
                shown = json.loads(cli(gw.url, "placement", "show", "--json").stdout)
                assert shown["version"] == 2 and shown["layers"]["0"]["copies"]["3"] == [1]
                assert "balancedness" in cli(gw.url, "placement", "show").stdout
                assert c.ping()["workers"][0]["experts"] == [0, 1, 2]
                load.close()  # no replicas: while worker 0 is down its experts are unavailable
                workers[0].kill()
                restart(s, workers[0])
                assert wait_until(lambda: c.ping()["workers"][0]["state"] == "healthy", timeout=30)
                assert c.ping()["workers"][0]["experts"] == [0, 1, 2]  # its start-up 3 was dropped
                x = steered_tokens(ref.router, 12, touching=[3], seed=7)
                y = c.forward(x)
                assert ref.matches(x, y, c.last_expert_versions, **TOL)
        finally:
            load.close()
        bad = cli(gw.url, "placement", "load", str(tmp_path / "missing.json"), ok=False)
        assert bad.returncode == 2 and "cannot read" in bad.stderr


def test_workers_added_drained_and_removed_under_load(ref):
    """A third worker is added and given copies (placement load), then worker 0 is removed:
    its copies go to the others first; nothing fails."""
    with Services() as s:
        workers = _workers(s, "tcp", ([0, 1, 2, 3], [4, 5, 6, 7]))
        gw = _gateway(s, "tcp", workers)
        load = Load(gw.url, ref)
        try:
            third = s.worker("tcp", [0], d_model=D, d_ff=F, seed=SEED, max_tokens=MAX_BATCH * K,
                             extra=["--max-experts", "6"])
            out = json.loads(cli(gw.url, "workers", "add", third.url).stdout)
            assert out["added"] == [2]
            with GatewayClient(gw.url, timeout=20.0) as c:
                assert wait_until(lambda: c.ping()["workers"][2]["state"] == "healthy", timeout=30)
                st = json.loads(cli(gw.url, "workers", "remove", "0").stdout)
                assert st["state"] == "draining"
                assert wait_until(lambda: c.ping()["workers"][0]["state"] == "removed", timeout=60, interval=0.2)
                doc = c.placement("show")
                assert all(0 not in ws for ws in doc["layers"]["0"]["copies"].values())
                assert doc["workers"][2]["copies"] > 0  # the new worker took some
            refused = cli(gw.url, "workers", "drain", "7", ok=False)
            assert refused.returncode == 2 and "no worker 7" in refused.stderr  # a bad request: the user's to fix
        finally:
            load.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_workers_scale_starts_and_stops_local_workers_under_load(backend, ref):
    """`workers scale 2` on a gateway with one local worker: a second process starts, is
    admitted and given copies before it takes traffic; `workers scale 1` drains it, removes
    it and stops its process. Nothing fails meanwhile."""
    from tests.helpers_fault import children
    from tests.helpers_procs import pid_alive

    _require(backend)
    with Services() as s:
        gw = s.gateway(backend, local_workers=1, d_model=D, d_ff=F, n_experts=E, top_k=K, seed=SEED,
                       max_batch_tokens=MAX_BATCH, max_wait=0, worker_timeout=3, timeout=60)
        load = Load(gw.url, ref)
        try:
            with GatewayClient(gw.url, timeout=20.0) as c:
                t0 = time.monotonic()
                out = json.loads(cli(gw.url, "workers", "scale", "2").stdout)
                assert out["starting"] == 1
                assert wait_until(lambda: len(c.ping()["workers"]) == 2 and
                                  c.placement("show")["workers"][1]["copies"] > 0, timeout=60, interval=0.2)
                joined = time.monotonic() - t0
                assert wait_until(lambda: c.ping()["workers"][1]["expert_rows"], timeout=20)  # it serves
                assert len(children(gw.pid)) == 2
                new_pid = c.ping()["workers"][1]["pid"]
                out = json.loads(cli(gw.url, "workers", "scale", "1").stdout)
                assert out["draining"] == [1]
                assert wait_until(lambda: c.ping()["workers"][1]["state"] == "removed", timeout=60, interval=0.2)
                assert wait_until(lambda: not pid_alive(new_pid), timeout=20)
                assert all(ws == [0] for ws in c.placement("show")["layers"]["0"]["copies"].values())
        finally:
            load.close()
        print(f"\njoin to first served: {joined:.2f} s")
