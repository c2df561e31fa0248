"""``moe-gateway --placement ray`` on a real Ray cluster of three nodes on this machine, each
node in a network namespace of its own (bench/netns_cluster.py: own veth address, one bridge;
nothing of Ray binds or reaches the machine's network). The gateway is the Ray driver in the
head's namespace; a checking client (tests/layer_client.py) runs there too.

- outputs equal the in-process reference, with workers over shm (the gateway's node) and tcp
  (the other nodes) in one layer, and over tcp only, and shm only;
- the secret reaches the actors through Ray, not through their command line or environment,
  and they refuse a peer without it;
- a worker actor's process SIGKILLed under load: Ray restarts it, the gateway learns its new
  URL and reconnects; every answer is right, the requests that needed it meanwhile got
  ``unavailable``, none was lost;
- a Hugging Face checkpoint (tiny, random, built here) served by Ray-placed workers, each
  node reading it from the shared path, equals transformers' own MoE blocks;
- SIGTERM to the gateway ends its actors; the cluster goes with no process and no /dev/shm
  entry left.

Needs root (namespaces) and Ray (the [ray] extra: a missing Ray fails, it does not skip).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import helpers_procs as HP
from bench.netns_cluster import NetnsError, NetnsLan, RayCluster
from transport.service.launch import spawn_service, stop_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, F, E, K, SEED = 16, 32, 6, 2, 11
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


class Cluster:
    def __init__(self, lan: NetnsLan, ray: RayCluster):
        self.lan, self.ray = lan, ray
        self.env = dict(ray.env, MOE_SECRET_FILE=os.environ["MOE_SECRET_FILE"])

    def python(self, code: str, timeout: float = 60.0, host: int = 0) -> subprocess.CompletedProcess:
        return subprocess.run(self.lan.exec(host) + [sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, env=self.env, cwd=ROOT)

    def gateway(self, *flags: str) -> tuple[subprocess.Popen, str]:
        return spawn_service(self.gateway_argv(*flags), timeout=240.0, env=self.env)

    def gateway_argv(self, *flags: str) -> list[str]:
        return self.lan.exec(0) + [
            sys.executable, "-m", "gateway.cli", "--listen", f"tcp://{self.lan.ips[0]}:0", "--placement", "ray",
            "--ray-address", self.ray.address, "--n-experts", str(E), "--top-k", str(K), "--d-model", str(D),
            "--d-ff", str(F), "--seed", str(SEED), "--max-batch-tokens", "64", "--max-wait-ms", "1",
            "--worker-timeout", "5", *flags]

    def ping(self, url: str) -> dict:
        r = self.python(f"import json; from gateway.client import GatewayClient\n"
                        f"with GatewayClient({url!r}, timeout=20) as c: print(json.dumps(c.ping(timeout=20), default=str))")
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout)

    def client(self, url: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(self.lan.exec(0) + [
            sys.executable, "-m", "tests.layer_client", url, "--d-model", str(D), "--d-ff", str(F),
            "--n-experts", str(E), "--top-k", str(K), "--seed", str(SEED), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env,
            cwd=ROOT)

    def check(self, url: str, n: int = 40) -> list:
        """n requests, every answer checked against the reference."""
        c = self.client(url, "--max-requests", str(n), "--concurrency", "2", "--max-tokens", "64")
        out, _ = c.communicate(timeout=180)
        assert c.returncode == 0
        return json.loads(out.strip().splitlines()[-1])["records"]


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.fail("Ray is not installed: pip install -e '.[ray]' (the Makefile does)")
    shm_before = HP.shm_entries()
    lan = NetnsLan(3)
    try:
        lan.open()
    except NetnsError as e:
        pytest.skip(str(e))
    ray = RayCluster(lan, cpus=[2, 2, 2])
    try:
        ray.start()
        yield Cluster(lan, ray)
    finally:
        ray.close()
        leaked = lan.close()
        ray.remove_temp()
    assert not leaked, f"processes left in the cluster's namespaces: {leaked}"
    assert HP.shm_entries() - shm_before == set()


@pytest.fixture(scope="module")
def auto_gateway(cluster):
    """One worker per node (1 CPU each): the head's over shm, the others' over tcp."""
    proc, url = cluster.gateway("--ray-cpus-per-worker", "1")
    try:
        yield proc, url
    finally:
        stop_process(proc, timeout=30.0)


def test_auto_transport_mixes_shm_and_tcp_and_equals_the_reference(cluster, auto_gateway):
    _, url = auto_gateway
    pong = cluster.ping(url)
    workers = pong["workers"]
    ips = cluster.lan.ips
    assert [w["experts"] for w in workers] == [[0, 1], [2, 3], [4, 5]]
    # spread, the gateway's node first: w0 on the head (shm), w1 and w2 on the others (tcp)
    assert workers[0]["url"].startswith("shm://")
    assert workers[1]["url"].startswith(f"tcp://{ips[1]}:") and workers[2]["url"].startswith(f"tcp://{ips[2]}:")
    assert all(w["state"] == "healthy" for w in workers)
    records = cluster.check(url)
    assert len(records) >= 40 and {r["outcome"] for r in records} == {"ok"}
    rows = [sum(n for _, n in w["expert_rows"]) for w in cluster.ping(url)["workers"]]
    assert all(r > 0 for r in rows), rows  # both transports carried real work


def test_the_secret_reaches_the_actors_through_ray_only(cluster, auto_gateway):
    _, url = auto_gateway
    secret = HP.secret()
    workers = cluster.ping(url)["workers"]
    for w in workers:
        for part in ("cmdline", "environ"):
            with open(f"/proc/{w['pid']}/{part}", "rb") as f:
                assert secret not in f.read(), (w["url"], part)
    # ... and yet they hold it: a peer without it, or with another, is refused
    code = ("import transport, sys\n"
            "for s in (None, b'not-the-secret'):\n"
            "    try:\n"
            "        transport.connect(sys.argv[1], timeout=10, secret=s).close(); print('accepted')\n"
            "    except transport.Refused as e: print('refused', type(e).__name__)\n")
    for w in workers:
        r = subprocess.run(cluster.lan.exec(0) + [sys.executable, "-c", code, w["url"]], capture_output=True,
                           text=True, timeout=60, env=cluster.env, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.split("\n")[:2] == ["refused AuthenticationError"] * 2, (w["url"], r.stdout)


def test_a_killed_worker_actor_is_restarted_by_ray_and_taken_back_under_load(cluster, auto_gateway):
    _, url = auto_gateway
    before = cluster.ping(url)["workers"]
    assert all(w["state"] == "healthy" for w in before)
    victim = before[1]  # a tcp worker on another node, hosting experts 2 and 3 (no replica)
    dead = set(victim["experts"])
    client = cluster.client(url, "--concurrency", "3", "--mark-after", "20")
    try:
        assert client.stdout.readline().strip() == "GOING"
        t_kill = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        back = None
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            w = cluster.ping(url)["workers"][1]
            if w["state"] == "healthy" and w["pid"] != victim["pid"]:
                back = w
                break
            time.sleep(0.5)
        assert back is not None, "the worker did not come back"
        t_back = time.monotonic()
        time.sleep(3.0)  # load on the restarted worker
    finally:
        out, _ = client.communicate(input="", timeout=120)
    records = json.loads(out.strip().splitlines()[-1])["records"]
    outcomes = {}
    for r in records:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    # every answer that came back is right, nothing was lost, nothing failed otherwise
    assert set(outcomes) <= {"ok", "unavailable"}, outcomes
    failed = [r for r in records if r["outcome"] == "unavailable"]
    assert failed, "no request needed the dead worker while it was away"
    for r in failed:  # only requests that needed the dead worker's (unreplicated) experts, after the kill
        assert dead & set(r["experts"]), r
        assert r["t1"] >= t_kill, r
    recovered = [r for r in records if r["outcome"] == "ok" and dead & set(r["experts"]) and r["t0"] > t_kill]
    assert recovered, "no request served by the restarted worker"
    assert min(r["t1"] for r in recovered) <= t_back + 3.0
    assert back["url"] != victim["url"] and back["reconnects"] >= 1 and back["experts"] == victim["experts"]
    assert not HP.pid_alive(victim["pid"])
    after = cluster.ping(url)["workers"]
    assert [w["pid"] for i, w in enumerate(after) if i != 1] == [w["pid"] for i, w in enumerate(before) if i != 1]
    print(f"\nrecovery: healthy again {t_back - t_kill:.2f} s after the kill; first answer needing it "
          f"{min(r['t1'] for r in recovered) - t_kill:.2f} s; {outcomes}")


def test_sigterm_to_the_gateway_ends_its_actors(cluster, auto_gateway):
    proc, url = auto_gateway
    pids = [w["pid"] for w in cluster.ping(url)["workers"]]
    assert all(HP.pid_alive(p) for p in pids)
    assert stop_process(proc, timeout=60.0) == 0
    assert HP.wait_until(lambda: not any(HP.pid_alive(p) for p in pids), timeout=30.0)


UPDATE_CHECK = """
import json, numpy as np
from bench.versioned import VersionedReference
from gateway.client import GatewayClient
from tests.helpers_fault import steered_tokens
ref = VersionedReference({D}, {F}, {E}, {K}, seed={SEED}, seeds={{1: {NEW}}})
x = steered_tokens(ref.router, 12, touching=[2, 3], seed=4)
with GatewayClient({url!r}, timeout=30) as c:
    if {update}:
        c.update("start", experts=[2, 3], version=1, seed={NEW}, timeout=30)
        import time
        t = time.monotonic() + 60
        while c.update("status")["state"] == "loading" and time.monotonic() < t:
            time.sleep(0.1)
        c.update("advance", fraction=1.0)
        c.update("finish")
        while c.update("status")["state"] == "finishing" and time.monotonic() < t:
            time.sleep(0.1)
    y = c.forward(x, timeout=30)
    got = c.last_expert_versions
    print(json.dumps({{"versions": got, "ok": ref.matches(x, y, got), "state": c.update("status")["state"]}}))
"""


def test_a_ray_restarted_actor_serves_the_finished_update_not_its_start_up_weights(cluster):
    """A hot update finished, then Ray restarts the worker actor hosting the updated experts:
    it comes back with its configured (start-up) weights and is brought to the update's
    version before it takes traffic; the answers say version 1 and equal that layer."""
    proc, url = cluster.gateway("--ray-cpus-per-worker", "1")
    try:
        def run(update: bool) -> dict:
            code = UPDATE_CHECK.format(D=D, F=F, E=E, K=K, SEED=SEED, NEW=SEED + 50, url=url, update=update)
            r = cluster.python(code, timeout=120)
            assert r.returncode == 0, r.stderr[-3000:]
            return json.loads(r.stdout.strip().splitlines()[-1])

        done = run(True)
        assert done["state"] == "done" and done["ok"] and {done["versions"][k] for k in ("2", "3")} == {1}, done
        victim = cluster.ping(url)["workers"][1]
        assert victim["experts"] == [2, 3]
        os.kill(victim["pid"], signal.SIGKILL)
        assert HP.wait_until(lambda: (lambda w: w["state"] == "healthy" and w["pid"] != victim["pid"])(
            cluster.ping(url)["workers"][1]), timeout=180, interval=0.5), "the actor did not come back"
        again = run(False)
        assert again["ok"] and {again["versions"][k] for k in ("2", "3")} == {1}, again
        pong = cluster.ping(url)
        assert [2, 1, [1]] in pong["workers"][1]["versions"] and pong["admission"]["synced"] >= 1
    finally:
        stop_process(proc, timeout=60.0)


def test_workers_scale_adds_and_removes_ray_worker_actors(cluster):
    """`workers scale 4` on three Ray workers: a fourth actor starts where Ray finds room, is
    admitted and given copies (two redundant ones: six experts on four workers balance no
    better without them); `workers scale 3` drains it and ends its actor."""
    proc, url = cluster.gateway("--ray-cpus-per-worker", "1", "--redundant-experts", "2")
    code = """
import json, sys, time
from gateway.client import GatewayClient
with GatewayClient({url!r}, timeout=60) as c:
    out = {{"up": c.workers("scale", n=4)}}
    t = time.monotonic() + 120
    while time.monotonic() < t:
        doc = c.placement("show")
        if len(doc["workers"]) == 4 and doc["workers"][3]["copies"] > 0:
            break
        time.sleep(0.5)
    out["copies"] = doc["workers"][3]["copies"] if len(doc["workers"]) == 4 else 0
    out["pid"] = c.ping()["workers"][3]["pid"] if len(doc["workers"]) == 4 else None
    out["down"] = c.workers("scale", n=3)
    while time.monotonic() < t and c.ping()["workers"][3]["state"] != "removed":
        time.sleep(0.5)
    out["state"] = c.ping()["workers"][3]["state"]
    print(json.dumps(out))
"""
    try:
        r = cluster.python(code.format(url=url), timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["up"]["starting"] == 1 and out["copies"] > 0, out
        assert out["down"]["draining"] == [3] and out["state"] == "removed", out
        assert HP.wait_until(lambda: not HP.pid_alive(out["pid"]), timeout=60)
        records = cluster.check(url, n=20)
        assert {r["outcome"] for r in records} == {"ok"}
    finally:
        stop_process(proc, timeout=60.0)


@pytest.mark.parametrize("flags,transports,n_workers", [
    # 2 per node, filled node by node, every expert twice: all tcp, the head's workers too
    (["--ray-transport", "tcp", "--ray-strategy", "pack", "--ray-workers-per-node", "2",
      "--ray-cpus-per-worker", "0.5", "--replicas", "2"], {"tcp"}, 6),
    # shm only: the gateway's node alone
    (["--ray-transport", "shm", "--ray-workers-per-node", "2", "--ray-cpus-per-worker", "0.5"], {"shm"}, 2),
], ids=["tcp-pack-replicas", "shm-only"])
def test_forced_transports_equal_the_reference(cluster, flags, transports, n_workers):
    proc, url = cluster.gateway(*flags)
    try:
        workers = cluster.ping(url)["workers"]
        assert len(workers) == n_workers
        assert {w["url"].split("://")[0] for w in workers} == transports
        if "pack" in flags:  # filled node by node: workers 0,1 on the head, 2,3 on host 1, ...
            hosts = [w["url"].split("://")[1].rsplit(":", 1)[0] for w in workers]
            assert hosts == [ip for ip in cluster.lan.ips for _ in range(2)]
            assert all(sum(e in w["experts"] for w in workers) == 2 for e in range(E))
        records = cluster.check(url)
        assert {r["outcome"] for r in records} == {"ok"}
    finally:
        assert stop_process(proc, timeout=60.0) == 0


def test_a_placement_the_cluster_cannot_hold_fails_at_start_saying_why(cluster):
    r = subprocess.run(cluster.gateway_argv("--ray-cpus-per-worker", "64"), capture_output=True, text=True,
                       timeout=180, env=cluster.env)
    assert r.returncode == 1, r.stderr[-2000:]  # a failure at run time: the cluster cannot hold it
    assert "no Ray node can hold 1 worker(s) of 64 CPU(s)" in r.stderr
    assert all(f"{ip} alive CPU=" in r.stderr for ip in cluster.lan.ips)  # what the cluster has


@pytest.mark.parametrize("case", ["qwen2_moe-bfloat16", "deepseek_v3-float32"])
def test_a_checkpoint_served_by_ray_workers_equals_transformers(cluster, case, tmp_path_factory):
    """Shared-expert pieces and routed experts placed on the three nodes' actors; every MoE
    layer's output against transformers' block on the same input."""
    from tests import models_fixture
    from tests.torch_extra import require_torch_extra

    require_torch_extra()
    root = tmp_path_factory.getbasetemp() / "ray-models"
    if not (root / case / "case.json").exists():
        models_fixture.write(root)
    d = root / case
    dtype = json.loads((d / "case.json").read_text())["dtype"]
    argv = cluster.lan.exec(0) + [
        sys.executable, "-m", "gateway.cli", "--listen", f"tcp://{cluster.lan.ips[0]}:0", "--placement", "ray",
        "--ray-address", cluster.ray.address, "--ray-cpus-per-worker", "0.5", "--checkpoint", str(d / "checkpoint"),
        "--dtype", dtype, "--compute", "numpy", "--max-batch-tokens", "64", "--worker-timeout", "30"]
    proc, url = spawn_service(argv, timeout=240.0, env=cluster.env)
    try:
        r = cluster.python("import json, sys; from pathlib import Path; from tests.models_fixture import compare_layers\n"
                           f"worst, workers = compare_layers({url!r}, Path({str(d)!r}), timeout=60)\n"
                           "print(json.dumps({'worst': worst, 'workers': workers}, default=str))", timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        workers = out["workers"]
        assert len(workers) == 3  # one actor per node
        assert {w["url"].split("://")[0] for w in workers} == {"shm", "tcp"}
        assert all(w["kernel"]["wire_dtype"] == dtype for w in workers)
        served = sorted(e for w in workers for L, ids in w["layers"][:1] for e in ids)
        assert served == sorted(set(served)) and len(served) >= 8  # every id of the layer, once
    finally:
        assert stop_process(proc, timeout=60.0) == 0
