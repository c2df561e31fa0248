"""Hot update of experts under load, real processes: a gateway and workers on tcp and shm,
client threads sending all along while `moe-gateway update` loads a new version, shifts
traffic 1% -> 100% and finishes (or rolls back). No request may fail, and every output must
be the layer at the old versions or at the new ones, never a mix."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from gateway.client import GatewayClient
from gateway.reference import ReferenceMoE
from gateway.router import Router
from tests.helpers_procs import BACKENDS, Services, backend_problem
from workers.expert import SwiGLUExpert

D, F, E, SEED, NEW_SEED = 16, 32, 8, 3, 77
UPDATED = (2, 5)  # both replicated below: every host of each must load the new version
LAYOUT = ([0, 1, 2, 3], [4, 5, 6, 7], [2, 5])
TOL = dict(rtol=1e-4, atol=1e-5)

pytestmark = pytest.mark.timeout(180)


def reference(new: bool) -> ReferenceMoE:
    experts = [SwiGLUExpert.from_seed(e, D, F, seed=NEW_SEED if new and e in UPDATED else SEED) for e in range(E)]
    return ReferenceMoE(Router(D, E, 2, seed=SEED), experts)


OLD, NEW = reference(False), reference(True)


@pytest.fixture(params=BACKENDS)
def gateway(request, tmp_path):
    problem = backend_problem(request.param)
    if problem:
        pytest.fail(problem)
    with Services() as s:
        workers = [s.worker(request.param, ex, d_model=D, d_ff=F, seed=SEED, max_tokens=512,
                            extra=["--update-dir", str(tmp_path)]) for ex in LAYOUT]
        yield s.gateway(request.param, workers=[w.url for w in workers], d_model=D, d_ff=F, n_experts=E,
                        top_k=2, seed=SEED, max_batch_tokens=128, max_wait_ms=2)


class Load:
    """Client threads sending forward requests until stopped; every result kept."""

    def __init__(self, url: str, n: int = 3):
        self.results: list = []  # (t, x, y, versions)
        self.errors: list = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(url, i)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, url, i):
        rng = np.random.default_rng(i)
        try:
            with GatewayClient(url, timeout=20.0) as c:
                while not self.stop.is_set():
                    x = rng.standard_normal((int(rng.integers(12, 40)), D)).astype(np.float32)
                    y = c.forward(x)
                    self.results.append((time.monotonic(), x, y, c.last_versions))
        except Exception as e:  # noqa: BLE001 - any failure is the finding
            self.errors.append(f"{type(e).__name__}: {e}")

    def count(self) -> int:
        return len(self.results)

    def wait_for(self, n: int, timeout: float = 30.0) -> None:
        target = self.count() + n
        deadline = time.monotonic() + timeout
        while self.count() < target and not self.errors and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def classify(x, y, versions) -> str:
    """'old' or 'new' (what the output equals), 'either' when the request used neither
    updated expert; a mix of versions equals neither reference and fails here."""
    yo, yn = OLD.forward(x)[0], NEW.forward(x)[0]
    is_old, is_new = np.allclose(y, yo, **TOL), np.allclose(y, yn, **TOL)
    assert is_old or is_new, f"output is neither the old layer nor the new one (versions {versions})"
    if is_old and is_new:
        return "either"
    if versions is not None:  # the gateway's own account agrees with the numbers
        assert {v for _, v in versions} == ({1} if is_new else {0}), versions
    return "new" if is_new else "old"


def cli(url, *args) -> dict:
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "update", "--gateway", url, *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_update_under_load_drops_nothing_and_never_mixes_versions(gateway):
    load = Load(gateway.url)
    phases = {}
    try:
        load.wait_for(20)
        started = load.count()  # every request answered before this was decided before the update
        st = cli(gateway.url, "start", "--experts", "2,5", "--new-version", "1", "--seed", str(NEW_SEED), "--wait")
        assert st["state"] == "shifting" and st["fraction"] == 0.01 and st["old"] == [[2, 0], [5, 0]]
        marks = [("loaded", load.count())]
        with GatewayClient(gateway.url, timeout=20.0) as admin:
            for _ in range(4):  # 1% -> 5% -> 25% -> 50% -> 100%
                load.wait_for(40)
                st = admin.update("advance")
                marks.append((st["fraction"], load.count()))
            load.wait_for(40)
            st = cli(gateway.url, "finish", "--wait")
            assert st["state"] == "done"
            marks.append(("done", load.count()))
            load.wait_for(30)
            pong = admin.ping()
    finally:
        load.close()
    assert not load.errors, load.errors[:3]
    gw = pong["gateway"]
    assert gw["failed_requests"] == 0 and gw["errors"] == {}
    kinds = [classify(x, y, v) for _, x, y, v in load.results]
    bounds = [m[1] for m in marks] + [len(kinds)]
    for (name, lo), hi in zip(marks, bounds[1:]):
        phases[name] = [k for k in kinds[lo:hi] if k != "either"]
    assert all(k == "old" for k in kinds[:started] if k != "either")  # before: old only
    assert all(k == "new" for k in phases["done"])  # after: the new version everywhere
    new_share = {name: ks.count("new") / max(1, len(ks)) for name, ks in phases.items()}
    assert new_share[1.0] > 0.9 and new_share[0.5] > 0.2 and new_share[0.05] < 0.5, new_share
    assert sum(k == "new" for k in kinds) > 0 and sum(k == "old" for k in kinds) > 0
    # the workers hold only the new version now, and say it is the active one
    for w in pong["workers"]:
        for e, active, held in w["versions"]:
            assert (active, held) == ((1, [1]) if e in UPDATED else (0, [0])), w["versions"]
    tl = [t[1] for t in st["timeline"]]
    assert tl[:2] == ["start", "loaded"] and tl[-2:] == ["finish", "done"] and tl.count("advance") == 4


def test_rollback_under_load_returns_to_the_old_version(gateway):
    load = Load(gateway.url, n=2)
    try:
        with GatewayClient(gateway.url, timeout=20.0) as admin:
            admin.update("start", experts=[2, 5], version=1, seed=NEW_SEED, steps=[0.5])
            deadline = time.monotonic() + 20
            while admin.update("status")["state"] == "loading" and time.monotonic() < deadline:
                time.sleep(0.02)
            load.wait_for(40)
            mark = load.count()
            st = cli(gateway.url, "rollback", "--wait")
            assert st["state"] == "rolled_back" and st["fraction"] == 0.0
            after = load.count()
            load.wait_for(30)
            pong = admin.ping()
    finally:
        load.close()
    assert not load.errors, load.errors[:3]
    kinds = [classify(x, y, v) for _, x, y, v in load.results]
    assert "new" in kinds[mark - 40:mark]  # the half that went to the new version...
    # ...and none after the rollback (a client may still be reading a reply decided before it)
    assert all(k != "new" for k in kinds[after + 2:])
    for w in pong["workers"]:
        assert all((a, h) == (0, [0]) for _, a, h in w["versions"]), w["versions"]


def test_a_failed_load_leaves_serving_untouched(gateway, tmp_path):
    with GatewayClient(gateway.url, timeout=20.0) as c:
        st = c.update("start", experts=[2], version=1, weights=str(tmp_path / "missing.npz"))
        deadline = time.monotonic() + 20
        while st["state"] not in ("failed",) and time.monotonic() < deadline:
            time.sleep(0.02)
            st = c.update("status")
        assert st["state"] == "failed" and "missing.npz" in st["error"]
        x = np.random.default_rng(9).standard_normal((20, D)).astype(np.float32)
        np.testing.assert_allclose(c.forward(x), OLD.forward(x)[0], **TOL)
        with pytest.raises(Exception, match="no update|cannot advance"):
            c.update("advance")
        with pytest.raises(Exception, match="already active"):
            c.update("start", experts=[2], version=0, seed=1)
        r = subprocess.run([sys.executable, "-m", "gateway.cli", "update", "--gateway", gateway.url, "start",
                            "--experts", "99", "--new-version", "3", "--seed", "1"], capture_output=True, text=True)
        assert r.returncode == 2 and "no expert [99]" in r.stderr
