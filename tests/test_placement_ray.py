"""Ray placement's own parts, without a Ray cluster: the decisions (nodes, order, transport),
the worker host an actor runs (here in this process), the secret's wrapper, the gateway's
flags, and that nothing but the placement imports Ray. The real multi-node cluster is
tests/test_ray_cluster.py."""
from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import transport
from gateway import placement_ray as PR
from gateway.pool import WorkerPool
from gateway.reference import ReferenceMoE
from gateway.router import Router
from gateway.supervisor import placement
from tests import helpers_procs as HP
from workers.expert import SwiGLUExpert

ROOT = Path(__file__).resolve().parent.parent
D, F, E, K, SEED = 16, 32, 4, 2, 9
pytestmark = pytest.mark.timeout(120)


def node(i: int, cpus: float, alive: bool = True) -> dict:
    return {"NodeID": f"n{i}", "NodeManagerAddress": f"10.0.0.{i}", "Alive": alive, "Resources": {"CPU": cpus}}


def test_eligible_nodes_hold_the_workers_and_start_with_the_gateways():
    nodes = [node(3, 2), node(1, 0), node(2, 4), node(4, 8, alive=False), node(5, 1)]
    got = PR.eligible_nodes(nodes, per_node=2, cpus_per_worker=1, gateway_node="n2", transport="auto")
    assert [n.node_id for n in got] == ["n2", "n3"]  # n1 has no CPU, n4 is dead, n5 holds one
    # no CPU reserved: every live node qualifies (the head with num_cpus=0 too)
    got = PR.eligible_nodes(nodes, per_node=2, cpus_per_worker=0, gateway_node="n2", transport="tcp")
    assert [n.node_id for n in got] == ["n2", "n1", "n3", "n5"]
    # shm: the gateway's node only
    assert [n.node_id for n in PR.eligible_nodes(nodes, per_node=1, cpus_per_worker=1, gateway_node="n3",
                                                 transport="shm")] == ["n3"]


def test_spread_deals_round_robin_and_pack_fills_a_node_first():
    assert PR.assign_nodes(["a", "b", "c"], 2, "spread") == ["a", "b", "c", "a", "b", "c"]
    assert PR.assign_nodes(["a", "b", "c"], 2, "pack") == ["a", "a", "b", "b", "c", "c"]
    with pytest.raises(ValueError):
        PR.assign_nodes(["a"], 0, "spread")
    with pytest.raises(ValueError):
        PR.assign_nodes(["a"], 1, "scatter")


def test_spread_puts_every_replica_of_a_block_on_another_node():
    order = PR.assign_nodes(["a", "b", "c"], 2, "spread")
    blocks = placement(12, len(order), replicas=2)
    for e in range(12):
        hosts = [order[w] for w, ex in enumerate(blocks) if e in ex]
        assert len(hosts) == 2 and len(set(hosts)) == 2, (e, hosts)
    order = PR.assign_nodes(["a", "b", "c"], 2, "pack")  # pack: the replicas share a node
    assert any(len({order[w] for w, ex in enumerate(blocks) if e in ex}) == 1 for e in range(12))


def test_auto_transport_is_shm_on_the_gateways_host_then_rdma_then_tcp():
    asked = []

    def rdma(answer):
        return lambda: asked.append(1) or answer

    assert PR.choose_transport("auto", same_host=True, has_rdma=rdma(True)) == "shm"
    assert not asked  # not probed when shm decides
    assert PR.choose_transport("auto", same_host=False, has_rdma=rdma(True)) == "rdma"
    assert PR.choose_transport("auto", same_host=False, has_rdma=rdma(False)) == "tcp"
    assert PR.choose_transport("tcp", same_host=True, has_rdma=rdma(True)) == "tcp"
    with pytest.raises(ValueError, match="does not share the gateway's host"):
        PR.choose_transport("shm", same_host=False, has_rdma=rdma(False))
    with pytest.raises(ValueError):
        PR.choose_transport("ib", same_host=True, has_rdma=rdma(False))
    assert PR.listen_url("shm", "10.1.1.2", "moe-x") == "shm://moe-x"
    assert PR.listen_url("tcp", "10.1.1.2", "moe-x") == "tcp://10.1.1.2:0"


def test_host_key_differs_in_another_network_namespace():
    import os
    import shutil

    here = PR.host_key()
    assert here == PR.host_key() and all(v is not None for v in here)
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for a second network namespace")
    code = "from gateway.placement_ray import host_key; print(repr(host_key()))"
    out = subprocess.run(["unshare", "--net", sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    if out.returncode:
        pytest.skip(f"unshare --net is not permitted here: {out.stderr.strip()}")
    there = eval(out.stdout)
    assert there[0] == here[0] and there[2:] == here[2:]  # same kernel, /dev/shm and user
    assert there[1] != here[1]  # another network namespace: shm's abstract socket is not reachable


def test_secret_wrapper_never_prints_and_survives_pickling():
    s = PR.SharedSecret(b"top-secret-bytes")
    assert "top-secret" not in repr(s) and "top-secret" not in str(s) and "top-secret" not in f"{[s]}"
    assert pickle.loads(pickle.dumps(s)).value == b"top-secret-bytes"


def _flags(experts):
    return ["--experts", ",".join(map(str, experts)), "--d-model", str(D), "--d-ff", str(F), "--seed", str(SEED),
            "--max-tokens", "256"]


@pytest.mark.parametrize("scheme", ["tcp", "shm"])
def test_worker_host_serves_the_layer_with_the_secret(scheme):
    """What an actor runs, run here: it listens where the transport decision says, demands
    the secret, and its answers are the reference's."""
    shm_before = HP.shm_entries()
    sec = HP.secret()
    hosts = [PR.WorkerHost(i, _flags(ex), transport=scheme, gateway_host=PR.host_key(), name=f"moe-t-{scheme}",
                           secret=PR.SharedSecret(sec), node_ip="127.0.0.1")
             for i, ex in enumerate(placement(E, 2))]
    try:
        assert all(h.url.startswith(f"{scheme}://") for h in hosts)
        w = hosts[0].where()
        assert w["url"] == hosts[0].url and w["transport"] == scheme and w["serving"] and w["index"] == 0
        with pytest.raises(transport.AuthenticationError):
            transport.connect(hosts[0].url, timeout=5.0, secret=b"not-the-secret").close()
        router = Router(D, E, K, seed=SEED)
        ref = ReferenceMoE(Router(D, E, K, seed=SEED), [SwiGLUExpert.from_seed(e, D, F, seed=SEED) for e in range(E)])
        with WorkerPool([h.url for h in hosts], router, max_batch_tokens=64, secret=sec) as pool:
            x = np.random.default_rng(3).standard_normal((40, D)).astype(np.float32)
            y, _ = pool.forward(x)
            np.testing.assert_allclose(y, ref.forward(x)[0], rtol=1e-4, atol=2e-5)
    finally:
        assert all(h.stop(5.0) for h in hosts)
    assert not any(h.where()["serving"] for h in hosts)
    assert HP.shm_entries() - shm_before == set()


def test_worker_host_serves_its_metrics_when_asked():
    import urllib.request

    h = PR.WorkerHost(0, _flags([0, 1]) + ["--metrics-port", "0"], transport="tcp", node_ip="127.0.0.1",
                      secret=PR.SharedSecret(HP.secret()))
    try:
        url = h.where()["metrics"]
        assert url.startswith("http://127.0.0.1:")
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'moe_expert_tokens_total{expert="1"' in text
    finally:
        h.stop(5.0)


def test_worker_host_on_a_public_address_refuses_to_start_without_a_secret():
    with pytest.raises(ValueError, match="without a shared secret"):
        PR.WorkerHost(0, _flags([0]), transport="tcp", node_ip="10.11.12.13")


def test_gateway_flags(tmp_path):
    from gateway.cli import build_parser, main

    args = build_parser().parse_args(["--placement", "ray", "--ray-workers-per-node", "2", "--ray-strategy", "pack",
                                      "--ray-transport", "tcp", "--ray-cpus-per-worker", "0.5",
                                      "--worker-cpus", "0,1"])
    assert (args.placement, args.ray_workers_per_node, args.ray_strategy, args.ray_transport) == ("ray", 2, "pack",
                                                                                                  "tcp")
    assert args.ray_cpus_per_worker == 0.5 and args.worker_cpus == [0, 1]
    assert build_parser().parse_args([]).placement == "local"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--ray-strategy", "scatter"])
    # Ray starts the workers: a --workers list besides is a contradiction, said before any Ray call
    with pytest.raises(SystemExit) as e:
        main(["--placement", "ray", "--workers", "tcp://127.0.0.1:1", "--d-model", "8"])
    assert e.value.code == 2  # a usage error, from the parse-and-check, before anything starts


BLOCK_RAY = r"""
import importlib.abc, sys
class NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray' (blocked by the test)")
sys.meta_path.insert(0, NoRay())
import gateway.cli, gateway.placement_ray, gateway.server, gateway.pool, workers.cli, workers.daemon, bench.systems
assert not any(k == "ray" or k.startswith("ray.") for k in sys.modules), "ray was imported"
from gateway.placement_ray import RayPlacement, RayWorkers
try:
    RayWorkers(RayPlacement(), lambda i, e: [], n_experts=2)
except RuntimeError as e:
    print("HINT:", e)
"""


def test_nothing_imports_ray_until_a_ray_placement_starts():
    p = subprocess.run([sys.executable, "-c", BLOCK_RAY], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "HINT: --placement ray needs Ray: pip install 'moe-transport[ray]'" in p.stdout
